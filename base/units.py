"""Sizes as people write them (``500G``) and as people read them (``1.2 GiB``)."""

from __future__ import annotations

import re

SIZE = re.compile(r"^(?P<n>\d+(?:\.\d+)?)\s*(?P<unit>[KMGT]?)i?B?$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``500G``, ``1.5T``, ``800MiB``, ``0`` -> bytes (powers of 1024)."""
    match = SIZE.match(text.strip())
    if not match:
        raise ValueError(f"{text!r} is not a size such as 500G or 800M")
    factor = 1024 ** " KMGT".index((match["unit"] or " ").upper())
    return int(float(match["n"]) * factor)


def human_bytes(count: int) -> str:
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{count} B"
