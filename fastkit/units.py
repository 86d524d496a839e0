"""Byte units and the one byte formatter (standard library only: pure-torch files may import it)."""

from __future__ import annotations

KiB = 1024
MiB = 1024**2
GiB = 1024**3
_UNITS = {"GiB": GiB, "MiB": MiB, "KiB": KiB, "B": 1}


def fmt_bytes(n: float | None, unit: str | None = None, *, unknown: str = "-") -> str:
    """Bytes for people: ``1.50 GiB``, ``12.0 MiB``, ``24.0 KiB``, ``512 B``; ``0`` for none at all.

    ``unit`` ('GiB', 'MiB', 'KiB', 'B') fixes the unit (a column that compares sizes); by default the
    largest unit that keeps the number >= 1. GiB get two decimals, MiB and KiB one. ``None`` -> ``unknown``.
    """
    if n is None:
        return unknown
    if n == 0:
        return "0"
    if unit is None:
        unit = next((u for u, size in _UNITS.items() if abs(n) >= size), "B")
    value = n / _UNITS[unit]
    if unit == "B":
        return f"{int(value)} B"
    return f"{value:.2f} {unit}" if unit == "GiB" else f"{value:.1f} {unit}"


__all__ = ["GiB", "KiB", "MiB", "fmt_bytes"]
