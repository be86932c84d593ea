"""Byte quantities as people write them ("64MiB", "1.5GiB") and as they read them."""

from __future__ import annotations

import math
import re

# Decimal units are powers of 1000 and binary units powers of 1024, as the SI and IEC
# define them; "64MB" and "64MiB" are different numbers and both are accepted.
_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}

_QUANTITY = re.compile(r"^\s*(?P<number>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(?P<unit>[a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(text: str | int) -> int:
    """Return the number of bytes `text` names: 4096, "4096", "64MiB", "1.5 GiB", "2gb".

    Decimals are allowed with a unit and rounded down to whole bytes. Raises ValueError
    naming the input and the accepted units for anything else (negative numbers included).
    """
    if isinstance(text, bool):
        raise ValueError(f"not a byte quantity: {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"a byte quantity cannot be negative: {text}")
        return text
    if not isinstance(text, str):
        raise ValueError(f"not a byte quantity: {text!r}")
    match = _QUANTITY.match(text)
    unit = match.group("unit").lower() if match else None
    if match is None or unit not in _UNITS:
        accepted = "B, KB, MB, GB, TB (powers of 1000), KiB, MiB, GiB, TiB (powers of 1024)"
        raise ValueError(f"not a byte quantity: {text!r}; write a number with an optional unit: {accepted}")
    number = float(match.group("number"))
    if unit in ("", "b") and not number.is_integer():
        raise ValueError(f"not a whole number of bytes: {text!r}")
    value = number * _UNITS[unit]
    if not math.isfinite(value):
        raise ValueError(f"byte quantity too large: {text!r}")
    return int(value)


def format_bytes(num_bytes: int | float) -> str:
    """`2097152` -> "2.00 MiB": binary units, two decimals, bytes below 1 KiB."""
    sign = "-" if num_bytes < 0 else ""
    magnitude = abs(num_bytes)
    if magnitude < 1024:
        return f"{sign}{int(magnitude)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        magnitude /= 1024
        if magnitude < 1024 or unit == "TiB":
            return f"{sign}{magnitude:.2f} {unit}"
    raise AssertionError("unreachable")
