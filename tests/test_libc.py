"""pagedkv/libc.py: one handle to the C library, a function or None, types as asked."""

from __future__ import annotations

import ctypes
import sys

import pytest

from pagedkv import libc


def test_a_function_the_c_library_lacks_is_none_not_an_error():
    assert libc.function("pagedkv_no_such_function") is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_a_function_comes_with_the_types_asked_and_is_the_same_everywhere():
    trim = libc.function("malloc_trim", [ctypes.c_size_t])
    assert trim is not None and trim.argtypes == [ctypes.c_size_t] and trim.restype is ctypes.c_int
    assert libc.function("malloc_trim") is trim  # one handle: the types set once hold for every caller
    assert trim(0) in (0, 1)
