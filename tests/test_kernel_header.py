"""The kernel library's one public header (csrc/pagedkv_kernels.h): the compiler holds the
definitions to it, and the ctypes signatures come from it (cpu_kernels/header.py), whose
reader refuses anything outside the header's regular form."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from model_service import cpu_kernels
from model_service.cpu_kernels import build, header

COMPILER = shutil.which("cc") or shutil.which("gcc")


def test_the_header_gives_every_signature():
    signatures = header.signatures()
    i32, i64, f32, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    assert signatures["decode_stack"] == ([ptr, ptr, ptr, i32, ptr, ptr, ptr, i64, ptr, i64, ptr, i32, ptr, i32, i32,
                                          i32], i32)
    assert signatures["rms_norm"] == ([ptr, i64, ptr, ptr, i32, i32, f32, i32, i32], None)
    assert signatures["quant_best_level"] == ([], i32)
    best = [name for name in signatures if name.endswith(("_best_level", "_cpu_level"))]
    assert len(best) == 7  # one per family with levels


def test_the_loaded_library_takes_the_headers_signatures():
    library = cpu_kernels.load()
    assert library is not None, cpu_kernels.load_error()
    for name, (argtypes, restype) in header.signatures().items():
        function = getattr(library, name)
        assert function.argtypes == argtypes and function.restype == restype, name


GOOD = "int f(const void *x, int64_t n, float s, int32_t **out);\n"


@pytest.mark.parametrize(("text", "message"), [
    ("/* open comment\nint f(void);", "unterminated comment"),
    ("int f(double x);", "a type ctypes is not told of"),
    ("int f(int32_t n);", "a type ctypes is not told of"),  # its width is ctypes', not declared here
    ("int f();", "cannot read parameter ''"),
    ("int f(int x, );", "cannot read parameter ''"),
    ("int f(int);", "cannot read parameter 'int'"),
    ("float f(int x);", "returns float"),
    ("int f(void);\nint f(void);", "declared twice"),
    ("int x = 3;", "cannot read"),
    ("struct s { int a; };", "cannot read"),
    ("typedef struct a b;", "cannot read"),
    ("int f(int (*g)(int));", "unbalanced parentheses|cannot read"),
    ("int f(int x", "unbalanced parentheses"),
    ("", "no prototypes"),
    ("#define X 1\n", "no prototypes"),
])
def test_the_reader_refuses_what_it_cannot_read(text, message):
    with pytest.raises(header.HeaderError, match=message):
        header.parse(text)


def test_the_reader_takes_the_headers_form():
    text = "/* a\n comment */\n#ifndef X\n#include <stdint.h>\ntypedef struct m m;\n" + GOOD + "void g(void); // end\n#endif\n"
    assert header.parse(text) == {"f": ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p], ctypes.c_int),
                                  "g": ([], None)}


@pytest.mark.skipif(COMPILER is None, reason="no C compiler")
@pytest.mark.parametrize(("source", "error"), [
    # a definition that disagrees with its prototype
    ("int quant_repack_x8(uint8_t *blocks, int type, int rows, int64_t cols) { return 0; }", "conflicting types"),
    # an exported function the header does not declare
    ("int quant_undeclared(int x) { return x; }", "missing-prototypes"),
])
def test_the_build_refuses_a_definition_the_header_does_not_match(tmp_path, source, error):
    path = tmp_path / "bad.c"
    path.write_text(f'#include "pagedkv_kernels.h"\n{source}\n')
    flags = [flag for flag in build.FLAGS if flag != "-shared"]
    result = subprocess.run([COMPILER, *flags, f"-I{build.CSRC}", "-c", "-o", str(tmp_path / "bad.o"), str(path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and error in result.stderr


def test_every_kernel_source_ships_with_the_package():
    """The library is compiled where it runs, from the installed sources: each .c and .h
    under csrc/ (its x86/ folder included) must match pyproject's package data."""
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["model_service.cpu_kernels"]
    package = build.CSRC.parent
    shipped = {path for pattern in patterns for path in package.glob(pattern)}  # as setuptools globs them
    sources = {path for path in build.CSRC.rglob("*") if path.suffix in (".c", ".h")}
    assert any(path.parent.name == "x86" for path in sources)
    assert sources - shipped == set()
