"""Test-only seams, in one module: nothing here is for a training run.

:class:`OffloadTestConfig` is :class:`fastkit.patches.offload.OffloadConfig` plus the knobs the tests and
the time-model benchmark turn: run the offload pipeline on a CPU model with the worker-thread copy
stream, slow and poison its copies, record copy / compute spans. A user's ``OffloadConfig`` has none of
them, so no notebook can switch them on by accident.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastkit.patches.offload.patch import OffloadConfig
from fastkit.patches.offload.streams import Throttle


@dataclass
class OffloadTestConfig(OffloadConfig):
    """An :class:`OffloadConfig` with the pipeline's test seams."""

    force_cpu_stream: bool = False
    """Run the pipeline on a CPU model with the worker-thread copy stream (tests, benchmarks)."""
    throttle: Throttle | None = None
    """CPU stream only: slow, poisoning copies (race tests, the time-model benchmark)."""
    trace: bool = False
    """Record copy and compute spans (``controller.streams.trace``) for the overlap test."""


__all__ = ["OffloadTestConfig", "Throttle"]
