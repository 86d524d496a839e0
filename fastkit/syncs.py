"""Count host-device synchronizations, on any device, CPU included.

On a GPU, some operations make the host wait for the device: reading a value back
(``.item()``, ``.tolist()``, ``bool(t)``), or an op whose *output shape* depends on data
(``nonzero``, boolean indexing, ``unique``, ``masked_select``, ``repeat_interleave`` without
``output_size``, ``bincount`` without a known size...). On a CPU they cost nothing, which is why
they creep in unnoticed. :class:`SyncCounter` counts them by op identity with a
``TorchDispatchMode`` (plus Python-level hooks for conversions that bypass the dispatcher), so a
test on this CPU machine can assert "zero syncs per step" for code that will run on a GPU.

Counted as one sync each:
- ``aten._local_scalar_dense`` (``.item()``, ``bool(t)``, ``int(t)``, ``float(t)``, ``if t:``);
- data-dependent-shape ops: ``nonzero``, ``argwhere``, ``masked_select``, ``unique*``,
  ``repeat_interleave(Tensor)`` without ``output_size``, ``bincount``, ``equal``, ``allclose``,
  indexing with a boolean mask (``x[mask]``, ``x[mask] = v``);
- ``Tensor.tolist()`` and ``Tensor.numpy()`` (they never reach the dispatcher on CPU);
- a blocking copy between the CPU and another device, either way (``.cpu()``, ``.to("cuda")``): torch
  synchronizes the stream after a blocking copy. ``non_blocking=True`` copies are not counted (D2H: the
  host only waits when it reads the result; H2D from pinned memory: no wait). Tests use the ``meta``
  device as the "other device" on a CPU-only machine.

A composite op is counted once at the outermost counted op (``t.nonzero()`` is 1, although
``nonzero`` may read its size internally).

What the dispatch mode cannot see: reads *inside* a backend kernel (``segment_reduce(unsafe=False)``
calls ``.item()`` in C++, below the Python dispatch mode). ``SyncCounter(profile=True)`` also runs
``torch.profiler`` (CPU activity) and counts the profiler's ``aten::_local_scalar_dense`` / ``aten::nonzero``
events that are not under an op the mode counted, as ``by_op["profiler:<op>"]``. On a GPU, use
``torch.cuda.set_sync_debug_mode("error")`` as well: it sees every synchronizing CUDA call.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Ops whose presence means "the host waits for the device" (output shape or value read back).
_SYNC_PACKETS = {
    aten._local_scalar_dense,
    aten.nonzero,
    aten.argwhere,
    aten.masked_select,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
    aten.unique_dim_consecutive,
    aten.bincount,
    aten.equal,
    aten.allclose,
}

# Indexing ops that sync when an index is a boolean mask (``x[mask]``, ``x[mask] = v``).
_INDEX_PACKETS = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}


def _is_sync(func, args, kwargs) -> bool:
    packet = func.overloadpacket
    if packet in _SYNC_PACKETS:
        return True
    if packet in _INDEX_PACKETS:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)
    if packet is aten.repeat_interleave and func is not aten.repeat_interleave.self_int:
        return kwargs.get("output_size") is None and (len(args) < 4 or args[3] is None)
    if packet in (aten._to_copy, aten.copy_):
        if kwargs.get("non_blocking") or (packet is aten.copy_ and len(args) > 2 and args[2]):
            return False  # an async copy (into pinned memory) does not block the host; its reader's wait does
        src = args[1] if packet is aten.copy_ else args[0]
        dst_device = (args[0].device if packet is aten.copy_ else kwargs.get("device"))
        if not isinstance(src, torch.Tensor) or dst_device is None:
            return False
        return (src.device.type == "cpu") != (torch.device(dst_device).type == "cpu")  # crosses the host line
    return False


# Profiler events that block the host when they run on a GPU (``aten::item`` is not listed: it always
# calls ``_local_scalar_dense``, which is). Marked ranges: ops the dispatch mode already counted.
_PROFILED_SYNCS = ("aten::_local_scalar_dense", "aten::nonzero")
_COUNTED_RANGE = "fastkit::counted_sync"
# Ops whose *CPU* kernel reads values on the host but whose CUDA kernel does not (``_grouped_mm``: the CPU
# fallback loops over the offsets; CUDA reads them on the device). Reads under them are not GPU syncs.
_CPU_KERNEL_READS = ("aten::_grouped_mm",)


def _has_counted_range(ev) -> bool:
    return any(c.name == _COUNTED_RANGE or _has_counted_range(c) for c in ev.cpu_children)


def _missed_by_mode(events) -> collections.Counter:
    """Profiler sync events the dispatch mode did not count, by op name.

    An op the mode counted shows up as ``aten::op`` (recorded before the Python dispatch key runs the
    mode) -> the marked range -> ``aten::op`` again (the real kernel): both are covered, the outer one by
    the range below it, the inner ones by the range above them.
    """
    missed: collections.Counter[str] = collections.Counter()
    for ev in events:
        if ev.name not in _PROFILED_SYNCS:
            continue
        parent = ev.cpu_parent
        while parent is not None and parent.name != _COUNTED_RANGE and parent.name not in _CPU_KERNEL_READS:
            parent = parent.cpu_parent
        if parent is None and not _has_counted_range(ev):
            missed["profiler:" + ev.name.split("::", 1)[1]] += 1
    return missed


class SyncCounter(TorchDispatchMode):
    """Context manager counting host-device syncs by op name.

    >>> with SyncCounter() as sc:
    ...     torch.tensor([1, 0, 2]).nonzero()
    >>> sc.total
    1

    ``sc.by_op`` maps op names to counts, ``sc.events`` keeps (op, short stack) when
    ``record_stacks=True`` to find where a sync comes from. ``profile=True`` adds what only a profiler
    sees (reads inside backend kernels) as ``"profiler:<op>"`` entries, counted once the block exits.
    """

    def __init__(self, record_stacks: bool = False, profile: bool = False):
        super().__init__()
        self.profile = profile
        self._profiler = None
        self.by_op: collections.Counter[str] = collections.Counter()
        self.events: list[tuple[str, str]] = []
        self.record_stacks = record_stacks
        self._depth = 0
        self._restore: list[tuple[object, str, Callable]] = []

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def _count(self, name: str) -> None:
        self.by_op[name] += 1
        if self.record_stacks:
            import traceback

            self.events.append((name, "".join(traceback.format_stack(limit=8)[:-2])))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        counted = self._depth == 0 and _is_sync(func, args, kwargs)
        if counted:
            self._count(str(func.overloadpacket.__name__))
            self._depth += 1
        try:
            if counted and self._profiler is not None:
                with torch.profiler.record_function(_COUNTED_RANGE):
                    return func(*args, **kwargs)
            return func(*args, **kwargs)
        finally:
            if counted:
                self._depth -= 1

    def _wrap_conversion(self, name: str) -> None:
        original = getattr(torch.Tensor, name)
        counter = self

        def wrapped(t, *a, **kw):
            counter._count(name)
            counter._depth += 1  # the read-back inside is the same sync, do not count it twice
            try:
                if counter._profiler is not None:
                    with torch.profiler.record_function(_COUNTED_RANGE):
                        return original(t, *a, **kw)
                return original(t, *a, **kw)
            finally:
                counter._depth -= 1

        setattr(torch.Tensor, name, wrapped)
        self._restore.append((torch.Tensor, name, original))

    def __enter__(self):
        for name in ("tolist", "numpy"):
            self._wrap_conversion(name)
        if self.profile:
            self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self._profiler.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for target, name, original in reversed(self._restore):
                setattr(target, name, original)
            self._restore.clear()
            if self._profiler is not None:
                profiler, self._profiler = self._profiler, None
                profiler.__exit__(None, None, None)
                self.by_op.update(_missed_by_mode(profiler.events()))


@contextmanager
def count_syncs(record_stacks: bool = False, profile: bool = False):
    """Functional spelling of :class:`SyncCounter`."""
    with SyncCounter(record_stacks=record_stacks, profile=profile) as sc:
        yield sc
