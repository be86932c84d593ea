"""The two process-wide CPU switches beside each kernel family's own (levels.py): the
architecture the whole library is compiled for, and the level a process runs as.

- PAGEDKV_CPU_LEVEL, "run as a CPU of this level would": `avx2` (an AVX2 server: Zen 2 or 3,
  Haswell to Skylake client) or `portable`; unset or `auto`, this CPU's best. It sets the
  build's architecture (below: `avx2` builds for x86-64-v3, `portable` for x86-64) and every
  family's default level (levels.py: where the family's own switch is unset, what the
  family's `auto` runs on a CPU whose best level is the highest of the family's not above
  this one). A family's own switch still forces any level.
- PAGEDKV_CPU_ARCH, the -march of the whole library: `native` (the default, unless
  PAGEDKV_CPU_LEVEL names a level) or x86-64, x86-64-v2, x86-64-v3, x86-64-v4.

Why the architecture matters: a level above portable is compiled under `#pragma GCC target`,
which adds instruction sets to -march's and takes none away. Built with -march=native on an
AVX-512 CPU, the "avx2" functions may use EVEX encodings, 32 vector registers and AVX-512
instructions, and the code outside the levelled functions (layer_ops.c's norms, SiLU and
rotary, decode_stack.c, argmax.c, each family's portable level) is vectorised for AVX-512
too: a forced-AVX2 test or benchmark would not run what an AVX2 server runs. Built for
x86-64-v3, nothing outside the AVX-512 levels' functions uses AVX-512
(tests/test_cpu_arch.py reads the disassembly), and those levels still build, so the
library still serves this CPU's best and a test can force each level.

Both switches are checked against the fixed lists below: nothing else reaches the
compiler's command line. A bad value is a ValueError from build.load().
"""

from __future__ import annotations

import os
import platform

ARCH_ENV = "PAGEDKV_CPU_ARCH"
LEVEL_ENV = "PAGEDKV_CPU_LEVEL"
X86_ARCHES = ("x86-64", "x86-64-v2", "x86-64-v3", "x86-64-v4")
ARCHES = ("native", *X86_ARCHES)
# The -march a PAGEDKV_CPU_LEVEL builds (on x86; elsewhere native).
LEVEL_ARCHES = {"avx2": "x86-64-v3", "portable": "x86-64"}
LEVELS = ("auto", *LEVEL_ARCHES)
# The process levels in order: a family's level not named here is above them all.
LEVEL_ORDER = ("portable", "avx2")


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def level() -> str | None:
    """PAGEDKV_CPU_LEVEL's level, or None where it is unset or `auto` (this CPU's best)."""
    value = os.environ.get(LEVEL_ENV, "").strip().lower() or "auto"
    if value not in LEVELS:
        raise ValueError(f"{LEVEL_ENV}={value!r}: expected one of {', '.join(LEVELS)}")
    return None if value == "auto" else value


def arch() -> str:
    """The -march the library is built for: PAGEDKV_CPU_ARCH's, else PAGEDKV_CPU_LEVEL's
    (on x86), else native."""
    value = os.environ.get(ARCH_ENV, "").strip().lower()
    if not value:
        chosen = level()
        return LEVEL_ARCHES[chosen] if chosen is not None and is_x86() else "native"
    if value not in ARCHES:
        raise ValueError(f"{ARCH_ENV}={value!r}: expected one of {', '.join(ARCHES)}")
    if value != "native" and not is_x86():
        raise ValueError(f"{ARCH_ENV}={value} names an x86 architecture; this machine is {platform.machine()}")
    level()  # a bad PAGEDKV_CPU_LEVEL is refused whatever the architecture
    return value


def rank(name: str) -> int:
    """A level's place among the process levels (LEVEL_ORDER), any other level above them."""
    return LEVEL_ORDER.index(name) if name in LEVEL_ORDER else len(LEVEL_ORDER)


__all__ = ["ARCHES", "ARCH_ENV", "LEVELS", "LEVEL_ARCHES", "LEVEL_ENV", "X86_ARCHES", "arch", "is_x86", "level", "rank"]
