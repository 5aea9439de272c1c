"""Byte sizes as people write them (``"12GiB"``) and as they read them (``"1.5 KiB"``),
without torch: the CLI checks a budget flag before anything heavy is imported."""

from __future__ import annotations

import re

__all__ = ["format_bytes", "parse_bytes"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str | int | float) -> int:
    """``"12GiB"`` → 12884901888. Decimal (GB) and binary (GiB) units; a bare number is bytes."""
    if isinstance(text, int | float):
        if text < 0:
            raise ValueError(f"a memory size cannot be negative: {text}")
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(
            f"cannot read {text!r} as a memory size: write a number with an optional unit, "
            "e.g. 12GiB, 800MiB, 16GB or 1073741824"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: float) -> str:
    """Bytes in binary units, three significant figures: 1536 → "1.5 KiB", never "1e+03 MiB"."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 999.5:  # three figures that round to 1000 read better as 0.977 of the next unit
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} TiB"
