"""Where the kernel library uses AVX-512, read from its disassembly, and which of its
functions may (tests/test_cpu_arch.py).

The rule, exactly:
- An instruction uses AVX-512 when it is EVEX-encoded (its first byte after any segment or
  address-size prefix is 0x62, which in 64-bit mode is only ever EVEX: every zmm register,
  xmm16-31/ymm16-31, masking and every AVX-512 instruction at any width take it) or names
  an opmask register %k0-%k7 (kmov, kand, ...: VEX-encoded, but AVX-512F's).
- A function belongs to an AVX-512 level when its definition lies, in its source file as
  the compiler preprocesses it (the build's own flags, `cc -E`), inside a `#pragma GCC
  target(...)` region (push_options to pop_options) whose options name an avx512 feature:
  csrc/x86/*_avx512*.h's pragmas, and whatever those headers include under them. The
  disassembly names a function by its C name, or that name and a suffix GCC adds to its
  parts and copies (`f._omp_fn.0` for an OpenMP region of f, `f.isra.0`, `f.constprop.0`,
  `f.part.0`, `f.cold`): the name before the first dot. A static name defined in several
  sources counts as an AVX-512 level's only where every source defines it in such a region.
- Every other function (the portable levels, the AVX2 levels, the entry points and
  dispatch, layer_ops.c, decode_stack.c, argmax.c, ...) must use no AVX-512 instruction:
  what an AVX2 CPU would run of them.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

_PREFIXES = {"26", "2e", "36", "3e", "64", "65", "67"}  # the only prefixes an EVEX instruction may carry
_OPMASK = re.compile(r"%k[0-7]\b")
_HEADER = re.compile(r"^[0-9a-f]+ <(?P<name>[^>]+)>:$")
_PRAGMA = re.compile(r'^\s*#\s*pragma\s+GCC\s+(?P<what>push_options|pop_options|reset_options|target)\b(?P<rest>.*)$')
_LITERALS = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'')
_ATTRIBUTE = re.compile(r"__attribute__\s*\(\(|__asm__\s*\(|\basm\s*\(")
_NAME_BEFORE_PAREN = re.compile(r"([A-Za-z_]\w*)\s*\($")


def _strip_balanced(text: str, pattern: re.Pattern) -> str:
    """`text` without each match of `pattern` (which ends in an open parenthesis) and the
    parentheses it opens."""
    while (match := pattern.search(text)) is not None:
        depth, at = match.group(0).count("("), match.end()
        while at < len(text) and depth:
            depth += {"(": 1, ")": -1}.get(text[at], 0)
            at += 1
        text = text[:match.start()] + " " + text[at:]
    return text


def _function_name(head: str) -> str | None:
    """The name a file-scope declaration's text before its `{` defines, where it is a function."""
    head = _strip_balanced(head, _ATTRIBUTE)
    depth = 0
    for at, char in enumerate(head):
        if char == "=" and depth == 0:
            return None  # an initializer
        if char == "(":
            if depth == 0:
                match = _NAME_BEFORE_PAREN.search(head[:at + 1])
                return match.group(1) if match else None
            depth += 1
        elif char == ")":
            depth -= 1
    return None  # a struct, union or enum


def avx512_regions(preprocessed: str) -> dict[str, bool]:
    """Each function a preprocessed translation unit defines: whether it is defined in a
    target pragma region that names an avx512 feature."""
    stack: list[frozenset[str]] = []
    current: frozenset[str] = frozenset()
    functions: dict[str, bool] = {}
    depth, head = 0, []
    for line in preprocessed.splitlines():
        pragma = _PRAGMA.match(line)
        if pragma:
            what = pragma["what"]
            if what == "push_options":
                stack.append(current)
            elif what == "pop_options":
                current = stack.pop() if stack else frozenset()
            elif what == "reset_options":
                current = frozenset()
            else:
                options = re.findall(r'"([^"]*)"', pragma["rest"])
                current |= {option.strip() for joined in options for option in joined.split(",")}
            continue
        if line.lstrip().startswith("#"):
            continue  # line markers and other pragmas
        for char in _LITERALS.sub('""', line) + "\n":
            if char == "{":
                if depth == 0:
                    name = _function_name("".join(head))
                    if name is not None:
                        functions[name] = any(option.startswith("avx512") for option in current)
                depth += 1
            elif char == "}":
                depth -= 1
                if depth == 0:
                    head = []
            elif char == ";" and depth == 0:
                head = []
            elif depth == 0:
                head.append(char)
    return functions


def avx512_functions(compiler: str, flags: Sequence[str], sources: Iterable[Path]) -> set[str]:
    """The names of the functions of `sources` that belong to AVX-512 levels (the rule above)."""
    defined: dict[str, list[bool]] = {}
    for source in sources:
        result = subprocess.run([compiler, *(flag for flag in flags if flag != "-shared"), "-E", str(source)],
                                capture_output=True, text=True, timeout=120, check=True)
        for name, avx512 in avx512_regions(result.stdout).items():
            defined.setdefault(name, []).append(avx512)
    return {name for name, where in defined.items() if all(where)}


def uses_avx512(raw: str, text: str) -> bool:
    """Whether the instruction of these bytes (objdump's hex pairs) and text uses AVX-512."""
    pairs = raw.split()
    while pairs and pairs[0] in _PREFIXES:
        pairs = pairs[1:]
    return (bool(pairs) and pairs[0] == "62") or _OPMASK.search(text) is not None


def instructions(disassembly: str) -> Iterator[tuple[str, str, str]]:
    """(function by its C name, bytes as objdump's hex pairs, text) of each instruction of
    `objdump -d --wide` output."""
    function = ""
    for line in disassembly.splitlines():
        header = _HEADER.match(line)
        if header:
            function = header["name"].split("@")[0].split(".")[0]
            continue
        parts = line.split("\t")
        if len(parts) >= 3 and parts[0].strip().endswith(":"):
            yield function, parts[1], parts[2].strip()


def avx512_uses(disassembly: str) -> dict[str, list[str]]:
    """Per function of `objdump -d --wide` output (by its C name), its instructions that use AVX-512."""
    found: dict[str, list[str]] = {}
    for function, raw, text in instructions(disassembly):
        if uses_avx512(raw, text):
            found.setdefault(function, []).append(text)
    return found


_PACKED_YMM_ARITHMETIC = re.compile(r"^v(?:fn?m(?:add|sub)\d*ps|(?:add|sub|mul|div)ps)\b.*%ymm")


def packed_ymm_arithmetic(disassembly: str) -> dict[str, int]:
    """Per function (by its C name), how many of its instructions are packed float32
    arithmetic on ymm registers (an add, multiply, divide or FMA of 8 lanes): a loop
    vectorized for AVX2 has them, one GCC left scalar has none."""
    counts: dict[str, int] = {}
    for function, _, text in instructions(disassembly):
        if _PACKED_YMM_ARITHMETIC.match(text):
            counts[function] = counts.get(function, 0) + 1
    return counts


def disassemble(objdump: str, library: Path) -> str:
    return subprocess.run([objdump, "-d", "--wide", str(library)], capture_output=True, text=True,
                          timeout=300, check=True).stdout


def stray_avx512(objdump: str, library: Path, allowed: set[str]) -> dict[str, list[str]]:
    """The functions of `library` outside `allowed` that use AVX-512, with those instructions."""
    return {name: uses for name, uses in avx512_uses(disassemble(objdump, library)).items() if name not in allowed}


__all__ = ["avx512_functions", "avx512_regions", "avx512_uses", "disassemble", "instructions", "packed_ymm_arithmetic",
           "stray_avx512", "uses_avx512"]
