"""The ctypes signatures of the kernel library, read from its public header
(csrc/pagedkv_kernels.h): the compiler holds the C definitions to that header, and this
holds the Python side to it, so the interface is written once.

The header keeps to a small regular form and this reader accepts that form only, refusing
anything else with the line it could not read (a typo there must fail the build's load, not
pass an argument of the wrong width): comments, preprocessor lines, `typedef struct NAME
NAME;`, and prototypes `int|void name(param, ...);` whose params are `void` alone or
`[const] TYPE [*...] name` with TYPE int, int64_t or float, or any type behind a pointer.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

HEADER = Path(__file__).parent / "csrc" / "pagedkv_kernels.h"

SCALARS = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float}
RESULTS = {"int": ctypes.c_int, "void": None}

_IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
_PROTOTYPE = re.compile(rf"(?P<result>{_IDENTIFIER})\s+(?P<name>{_IDENTIFIER})\s*\((?P<params>[^()]*)\)")
_TYPEDEF = re.compile(rf"typedef\s+struct\s+({_IDENTIFIER})\s+\1")
_PARAM = re.compile(rf"(?:const\s+)?(?P<type>{_IDENTIFIER})(?:\s+|(?P<stars>(?:\s*\*(?:\s*const\b)?)+)\s*)"
                    rf"(?P<name>{_IDENTIFIER})")


class HeaderError(ValueError):
    """The header holds something outside the form this reader takes."""


def _strip(text: str) -> str:
    if re.search(r"/\*(?:(?!\*/).)*$", text, flags=re.S):
        raise HeaderError("unterminated comment")
    text = re.sub(r"/\*.*?\*/", lambda match: "\n" * match.group().count("\n"), text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    return "\n".join("" if line.lstrip().startswith("#") else line for line in text.splitlines())


def _param(text: str, where: str) -> type | None:
    match = _PARAM.fullmatch(text.strip())
    if match is None:
        raise HeaderError(f"{where}: cannot read parameter {text.strip()!r}")
    if match["stars"]:
        return ctypes.c_void_p
    if match["type"] not in SCALARS:
        raise HeaderError(f"{where}: parameter {text.strip()!r} has a type ctypes is not told of here "
                          f"(one of {', '.join(SCALARS)}, or a pointer)")
    return SCALARS[match["type"]]


def parse(text: str) -> dict[str, tuple[list, type | None]]:
    """name -> (argtypes, restype) of every prototype in `text`, in order."""
    body = _strip(text)
    if body.count("(") != body.count(")"):
        raise HeaderError("unbalanced parentheses")
    signatures: dict[str, tuple[list, type | None]] = {}
    for statement in body.split(";"):
        statement = " ".join(statement.split())
        if not statement or _TYPEDEF.fullmatch(statement):
            continue
        match = _PROTOTYPE.fullmatch(statement)
        if match is None:
            raise HeaderError(f"cannot read {statement[:120]!r}: expected a prototype or `typedef struct N N`")
        name, result, params = match["name"], match["result"], match["params"].strip()
        if result not in RESULTS:
            raise HeaderError(f"{name}: returns {result}, expected one of {', '.join(RESULTS)}")
        if name in signatures:
            raise HeaderError(f"{name} is declared twice")
        argtypes = [] if params == "void" else [_param(param, name) for param in params.split(",")]
        signatures[name] = (argtypes, RESULTS[result])
    if not signatures:
        raise HeaderError("no prototypes")
    return signatures


def signatures(path: Path = HEADER) -> dict[str, tuple[list, type | None]]:
    """The public header's functions: name -> (argtypes, restype)."""
    try:
        return parse(path.read_text())
    except HeaderError as error:
        raise HeaderError(f"{path.name}: {error}") from None


__all__ = ["HEADER", "HeaderError", "parse", "signatures"]
