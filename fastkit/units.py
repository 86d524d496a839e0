"""Byte units, the one byte formatter, and the training dtypes by name (standard library only: pure-torch files
and the planner, which answers without torch, import it)."""

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


DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
"""Bytes per value of each dtype fastkit trains in, by torch's name for it."""


def dtype_name(dtype: object) -> str:
    """``torch.bfloat16``, ``"bfloat16"`` or ``"torch.bfloat16"`` -> ``"bfloat16"`` (no torch import: a dtype's
    ``str`` is ``torch.<name>``)."""
    return str(dtype).strip().removeprefix("torch.")


def compute_dtype_name(cuda: bool, bf16: bool) -> str:
    """The one dtype rule (loader, trainer precision flags, planner): fp32 on the CPU, bf16 on a GPU that
    has it, fp16 on one that does not (pre-Ampere: T4, RTX 20xx)."""
    if not cuda:
        return "float32"
    return "bfloat16" if bf16 else "float16"


__all__ = ["DTYPE_BYTES", "GiB", "KiB", "MiB", "compute_dtype_name", "dtype_name", "fmt_bytes"]
