"""The mark of tests that need the C kernels (model_service/cpu_kernels), which the first
load() builds with the machine's C compiler: without one they skip, saying why."""

from __future__ import annotations

import pytest

from model_service import cpu_kernels

needs_c_kernels = pytest.mark.skipif(
    cpu_kernels.load() is None,
    reason=f"the CPU kernels did not build (a C compiler, cc or $CC, is needed): {cpu_kernels.load_error()}")
