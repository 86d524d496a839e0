"""Count the device reads of every training step with ``torch.profiler`` (CPU activity), by where they come from.

:class:`StepReads` is a ``TrainerCallback``: from one ``on_step_begin`` to the next it profiles the whole
optimizer step (forward, backward, the loop's checks, clipping, the optimizer, logging, the next batch)
and sorts every read the profiler recorded: ``aten::_local_scalar_dense`` (reached from ``item``,
``is_nonzero``, ``int()``...) and the data-dependent-shape ops (``nonzero``, ``masked_select``,
``unique``, ``bincount``...). The profiler sees reads inside kernels, which a dispatch mode cannot.

Two kinds are *host* reads, not device reads, on a GPU too, and are reported apart (``excluded``):
- under ``Optimizer.step#...``: torch's AdamW keeps ``state["step"]`` as a CPU tensor unless
  ``capturable`` / ``fused``, and reads it with ``.item()`` for the bias correction; on a GPU that
  tensor is still on the CPU (bitsandbytes' 8-bit optimizers keep it as a Python int);
- under ``enumerate(DataLoader)#...``: the collator builds the batch from CPU tensors before it is moved.
Everything else on a CPU-only run would be a device read on a GPU (the tensors live on the device).
Also a ``fastkit.SyncCounter`` (dispatch mode) runs over the same window, for a second count.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch
from transformers import TrainerCallback

from fastkit.syncs import SyncCounter

_READ_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::_unique2",
             "aten::unique_dim", "aten::unique_consecutive", "aten::bincount", "aten::equal", "aten::allclose")
_HOST_SCOPES = {"Optimizer.step#": "optimizer step counter", "enumerate(DataLoader)#": "collation"}


@dataclass
class StepCount:
    """The reads of one optimizer step."""

    step: int
    """The step (``state.global_step`` after it)."""
    device: collections.Counter = field(default_factory=collections.Counter)
    """Reads that are device reads on a GPU, by the outermost op that read (``item``, ``is_nonzero``...)."""
    excluded: collections.Counter = field(default_factory=collections.Counter)
    """Host reads (see the module docstring), by scope."""
    sync_counter: int = 0
    """What ``SyncCounter`` (dispatch mode, host reads included) counted in the same window."""
    logged: bool = False
    """Whether the step ended at a log point (its reads include the log's)."""

    @property
    def total(self) -> int:
        return sum(self.device.values())


def _classify(ev) -> tuple[str, str]:
    """('device', op) or ('excluded', scope) for one read event, by its ancestors."""
    outer, parent = ev.name, ev.cpu_parent
    while parent is not None:
        for prefix, scope in _HOST_SCOPES.items():
            if parent.name.startswith(prefix):
                return "excluded", scope
        if parent.name.startswith("aten::"):
            outer = parent.name
        parent = parent.cpu_parent
    return "device", outer.split("::", 1)[1]


def count_reads(events) -> tuple[collections.Counter, collections.Counter]:
    """Device reads and excluded host reads among profiler ``events`` (an op nested in another read counts once)."""
    device: collections.Counter[str] = collections.Counter()
    excluded: collections.Counter[str] = collections.Counter()
    for ev in events:
        if ev.name not in _READ_OPS:
            continue
        parent = ev.cpu_parent
        while parent is not None and parent.name not in _READ_OPS:
            parent = parent.cpu_parent
        if parent is not None:
            continue  # e.g. nonzero's own size read
        kind, what = _classify(ev)
        (device if kind == "device" else excluded)[what] += 1
    return device, excluded


class StepReads(TrainerCallback):
    """Profile every optimizer step; ``steps`` holds one :class:`StepCount` each (a debug tool: slow)."""

    def __init__(self):
        self.steps: list[StepCount] = []
        self._open: tuple[torch.profiler.profile, SyncCounter] | None = None
        self._logged = False

    def _close(self, state) -> None:
        if self._open is None:
            return
        prof, sc = self._open
        self._open = None
        sc.__exit__(None, None, None)
        prof.__exit__(None, None, None)
        device, excluded = count_reads(prof.events())
        self.steps.append(StepCount(state.global_step, device, excluded, sc.total, self._logged))

    def on_step_begin(self, args, state, control, **kwargs):
        self._close(state)
        self._logged = False
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        prof.__enter__()
        self._open = (prof, SyncCounter().__enter__())

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._logged = True

    def on_train_end(self, args, state, control, **kwargs):
        self._close(state)

    def between_logs(self) -> list[StepCount]:
        """Steps that ended without a log (the first step is left out: it builds the optimizer state)."""
        return [s for s in self.steps[1:] if not s.logged]


__all__ = ["StepCount", "StepReads", "count_reads"]
