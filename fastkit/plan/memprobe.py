"""Peak tensor memory of a piece of work, measured from the allocator's events (CPU or CUDA).

On CUDA, ``torch.cuda.max_memory_allocated`` answers directly. On a CPU there are no allocator
statistics, so :func:`measure_peak` runs the work under ``torch.profiler`` with
``profile_memory=True`` and replays its allocation / free events in time order: the running sum's
maximum is the peak of live tensor bytes (what the planner in :mod:`fastkit.plan` predicts),
counted from the moment the work starts. Used by the planner's tests and the chunked-loss numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def measure_peak(fn: Callable[[], Any], device: torch.device | str = "cpu") -> tuple[Any, int]:
    """Run ``fn()``; return ``(its result, peak bytes of tensors allocated while it ran)``.

    The peak counts memory allocated (and not yet freed) since ``fn`` started; tensors that were
    alive before are not included.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = fn()
        torch.cuda.synchronize(device)
        return result, torch.cuda.max_memory_allocated(device) - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return result, peak


__all__ = ["measure_peak"]
