"""The offload pipeline: pack/unpack hooks, reused host and device buffers, one-layer-early reloads.

Pure torch (no transformers): :mod:`fastkit.patches.offload.patch` decides whether and where to run it and
swaps it into a model's checkpointed layers; this file is the ordering and lifetime logic, written
against :class:`fastkit.patches.offload.streams.CopyStreams` so the CPU copy stream tests the very code a GPU
runs (tests/test_offload.py, tests/test_offload_races.py).

What it does. :class:`OffloadedCheckpoint` runs a layer's own ``torch.utils.checkpoint`` call inside
saved-tensor hooks (:class:`OffloadController` ``pack`` / ``unpack``) that:

- forward: copy the layer input into a reused host buffer on the copy stream and drop the device
  copy (the allocator frees it once the copy is done);
- backward: when layer ``i`` is unpacked (its recompute is about to start), start copying the
  input of layer ``i-1`` -- the next one autograd will recompute -- into the other of two reused
  device buffers, so that copy overlaps layer ``i``'s recompute + backward; then swap.

Only the *storage* of the saved input changes, so gradients are bitwise those of plain checkpointing.

What must not change: the tensor handed to the recompute has the input's shape, dtype, device and
values; no host sync inside a layer (events and stream waits only; the CPU stream blocks the host
because the host *is* its compute stream). The Notes below say why each buffer may be read or
rewritten when it is.

Time model (L offloaded layers, reload c and backward g per layer): single buffer ~ L*(c+g),
double buffer ~ c + (L-1)*max(c, g) + g. Checked in ``fastkit bench offload`` (docs/offload.md).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.autograd.graph import saved_tensors_hooks

from fastkit import _torch
from fastkit.patches.offload.streams import CopyStreams, Span
from fastkit.units import fmt_bytes

logger = logging.getLogger(__name__)



class PipelineConfig(Protocol):
    """What the pipeline reads from its config (:class:`fastkit.patches.offload.OffloadConfig` is one)."""

    min_tokens: int
    """Keep a layer input on the device below this many tokens."""
    min_bytes: int
    """Keep a layer input on the device below this many bytes."""
    skip_last_layer: bool
    """Keep the last checkpointed layer's input on the device."""
    pin_memory: bool
    """Use page-locked host buffers where pinning works."""

    def check_host_ram(self, nbytes: int, held: int) -> None:
        """Raise if ``nbytes`` more of host RAM (``held`` already in buffers) cannot be spared."""


@dataclass
class OffloadStats:
    """Counters of what the pipeline did (tests read them; the bench reports them)."""

    offloaded: int = 0
    """Layer inputs copied to host memory."""
    kept: Counter = field(default_factory=Counter)
    """Layer inputs left on the device, by reason."""
    host_allocs: int = 0
    """Host buffers allocated (the first step, or a longer sequence)."""
    host_reuses: int = 0
    """Host buffers reused."""
    device_allocs: int = 0
    """Pooled device buffers allocated."""
    device_reuses: int = 0
    """Pooled device buffers reused."""
    device_transient: int = 0
    """Reloads that found every pooled device buffer still in use and allocated a fresh one."""
    device_releases: int = 0
    """Times the pool let go of its device buffers (once per backward, after the last reload)."""
    prefetched: int = 0
    """Reloads started one layer early (double buffer)."""
    on_demand: int = 0
    """Reloads started only when the layer was unpacked (single buffer, or an unpredicted order)."""


# --------------------------------------------------------------------------------------------
# Buffers
# --------------------------------------------------------------------------------------------


def _capacity(numel: int) -> int:
    """Round up to 1/8 of the next power of two, so slightly longer batches reuse a buffer."""
    if numel <= 8:
        return max(numel, 1)
    step = 1 << max(0, numel.bit_length() - 4)
    return -(-numel // step) * step


def _other_readers(buf: torch.Tensor) -> int:
    """References to ``buf``'s storage besides ``buf`` itself (views held by autograd, copies in flight)."""
    storage = buf.untyped_storage()  # this temporary Python object holds one reference too
    return _torch.storage_use_count(storage) - 2


class HostPool:
    """Flat host buffers by dtype, reused across layers and steps. Thread-safe.

    See Note: [host buffer reuse].
    """

    def __init__(self, streams: CopyStreams, config: PipelineConfig, budget: int) -> None:
        self.streams = streams
        self.config = config
        self.budget = budget
        self.pin = config.pin_memory and streams.can_pin()
        self.free: dict[torch.dtype, list[torch.Tensor]] = {}
        self.total = 0
        self.stats: OffloadStats | None = None
        # Re-entrant: an Entry's finalizer (release) can run from garbage collection inside acquire.
        self._lock = threading.RLock()

    def acquire(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A buffer of at least ``numel`` elements, or None when the budget is spent."""
        with self._lock:
            free = self.free.setdefault(dtype, [])
            fits = [b for b in free if b.numel() >= numel]
            if fits:
                buf = min(fits, key=torch.Tensor.numel)
                free.remove(buf)
                self.stats.host_reuses += 1
                return buf
            cap = _capacity(numel)
            nbytes = cap * torch.empty((), dtype=dtype).element_size()
            if self.total + nbytes > self.budget:
                return None
            self.config.check_host_ram(nbytes, self.total)
            buf = self._allocate(cap, dtype)
            self.total += nbytes
            self.stats.host_allocs += 1
            return buf

    def release(self, buf: torch.Tensor) -> None:
        with self._lock:
            self.free.setdefault(buf.dtype, []).append(buf)

    def _allocate(self, cap: int, dtype: torch.dtype) -> torch.Tensor:
        if self.pin:
            try:
                return self.streams.empty_host(cap, dtype, pin=True)
            except RuntimeError as exc:
                self.pin = False
                logger.warning("fastkit offload: pinned host memory unavailable (%s; WSL caps it at 1-2 GB); "
                               "using pageable memory, reloads will be slower", exc)
        return self.streams.empty_host(cap, dtype, pin=False)


class DevicePool:
    """Device buffers for reloads, ``slots`` per (device, dtype), reused across layers and steps.

    See Note: [device slot reuse].
    """

    def __init__(self, streams: CopyStreams, slots: int) -> None:
        self.streams = streams
        self.slots = slots
        self.bufs: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        self.stats: OffloadStats | None = None

    def acquire(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        bufs = self.bufs.setdefault((self.streams.device, dtype), [])
        for i, buf in enumerate(bufs):
            if _other_readers(buf) == 0:
                if buf.numel() < numel:  # a longer batch: grow this slot
                    bufs[i] = buf = self.streams.empty_device(_capacity(numel), dtype)
                    self.stats.device_allocs += 1
                else:
                    self.stats.device_reuses += 1
                return buf
        buf = self.streams.empty_device(_capacity(numel), dtype)
        if len(bufs) < self.slots:
            bufs.append(buf)
            self.stats.device_allocs += 1
        else:
            self.stats.device_transient += 1
            logger.debug("fastkit offload: every device slot is still read; reloading into a fresh buffer")
        return buf

    def release(self) -> None:
        """Drop the pool's references to its slots (Note: [slots end with backward])."""
        if any(self.bufs.values()):
            self.bufs.clear()
            self.stats.device_releases += 1


# --------------------------------------------------------------------------------------------
# The pipeline
# --------------------------------------------------------------------------------------------


class Entry:
    """What autograd saves for one checkpointed layer input (the pack hook's return value)."""

    __slots__ = ("layer", "shape", "dtype", "numel", "device_tensor", "host", "fetch", "prev", "__weakref__")

    def __init__(self, layer: int, x: torch.Tensor, prev: Callable[[], Entry | None]) -> None:
        self.layer = layer
        self.shape, self.dtype, self.numel = x.shape, x.dtype, x.numel()
        self.device_tensor: torch.Tensor | None = None  # kept on the device
        self.host: torch.Tensor | None = None  # offloaded: flat host buffer
        self.fetch: tuple[torch.Tensor, Any] | None = None  # reload issued: (device view, event)
        self.prev = prev  # weakref to the entry packed just before (the next one backward needs)


def _dead() -> None:
    return None


def _earlier_offloaded(entry: Entry) -> Entry | None:
    """The closest entry packed before ``entry`` whose input is on the host (kept inputs need no reload)."""
    prev = entry.prev()
    while prev is not None and prev.host is None:
        prev = prev.prev()
    return prev


class OffloadController:
    """Pack/unpack hooks, the two pools and the prefetch decision for one model."""

    def __init__(self, streams: CopyStreams, config: PipelineConfig, n_layers: int, double_buffer: bool,
                 host_budget: int) -> None:
        self.streams = streams
        self.config = config
        self.n_layers = n_layers
        self.double_buffer = double_buffer
        self.stats = OffloadStats()
        self.host = HostPool(streams, config, host_budget)
        self.device = DevicePool(streams, 2 if double_buffer else 1)
        self.host.stats = self.device.stats = self.stats
        self._last: Callable[[], Entry | None] = _dead
        self._open_compute: Span | None = None
        self._lock = threading.RLock()
        self._logged: set[str] = set()

    # -- forward ---------------------------------------------------------------------------

    def new_chain(self) -> None:
        """A new forward pass starts at the first checkpointed layer."""
        self._last = _dead

    def pack(self, layer: int, x: torch.Tensor) -> Entry | torch.Tensor:
        if x.numel() == 0:  # See Note: [empty saved tensors]
            return x
        with self._lock:
            entry = Entry(layer, x, self._last)
            self._last = weakref.ref(entry)
            reason = self._keep_reason(layer, x)
            host = None if reason else self.host.acquire(entry.numel, x.dtype)
            if host is None:
                reason = reason or self._over_budget(x)
                entry.device_tensor = x.detach()
                self.stats.kept[reason] += 1
                return entry
            entry.host = host
            weakref.finalize(entry, self.host.release, host)  # See Note: [host buffer reuse]
            # See Note: [copy after produce] and Note: [cross-stream lifetime].
            self.streams.copy(host[: entry.numel].view(x.shape), x.detach(), "d2h", layer)
            self.stats.offloaded += 1
            return entry

    def _keep_reason(self, layer: int, x: torch.Tensor) -> str | None:
        cfg = self.config
        if x.device != self.streams.device:
            return "not on the offload device"
        if cfg.skip_last_layer and layer == self.n_layers - 1:
            return "last layer (needed first in backward)"
        if x.dim() == 0 or not x.is_contiguous() or x.layout != torch.strided:
            return "not a dense contiguous tensor"
        if x.numel() * x.element_size() < cfg.min_bytes:
            return f"below min_bytes={cfg.min_bytes}"
        if x.numel() // max(x.shape[-1], 1) < cfg.min_tokens:
            return f"below min_tokens={cfg.min_tokens}"
        return None

    def _over_budget(self, x: torch.Tensor) -> str:
        reason = "host buffer budget spent"
        if reason not in self._logged:
            self._logged.add(reason)
            logger.warning("fastkit offload: host staging buffers reached the %s budget "
                           "(OffloadConfig.pinned_budget_bytes); layers past it keep their %s input on the "
                           "device (plain checkpointing for those layers)", fmt_bytes(self.host.budget),
                           fmt_bytes(x.numel() * x.element_size()))
        return reason

    # -- backward --------------------------------------------------------------------------

    def unpack(self, entry: Entry | torch.Tensor) -> torch.Tensor:
        if not isinstance(entry, Entry):  # an empty tensor packed as itself: Note [empty saved tensors]
            return entry
        with self._lock:
            self._trace_end_compute()
            out = self._take(entry)
            if _earlier_offloaded(entry) is None:  # the chain's last reload is out: Note [slots end with backward]
                self.device.release()
            self._trace_start_compute(entry.layer)
            return out

    def _take(self, entry: Entry) -> torch.Tensor:
        """The device tensor for ``entry``, ready to read on the current stream; starts the next reload."""
        if entry.device_tensor is not None:
            self._prefetch_before(entry)
            return entry.device_tensor
        if entry.fetch is None:
            self._reload(entry)
            self.stats.on_demand += 1
        view, event = entry.fetch
        entry.fetch = None  # the slot is now held by whatever autograd keeps of `view`
        self._prefetch_before(entry)
        self.streams.wait(event)  # See Note: [read after fill]
        return view

    def _reload(self, entry: Entry) -> None:
        """Issue the host->device copy of ``entry`` into a free device slot."""
        slot = self.device.acquire(entry.numel, entry.dtype)
        view = slot[: entry.numel].view(entry.shape)
        # See Note: [device slot reuse]: the copy stream waits for the compute queued so far.
        event = self.streams.copy(view, entry.host[: entry.numel].view(entry.shape), "h2d", entry.layer)
        entry.fetch = (view, event)

    def _prefetch_before(self, entry: Entry) -> None:
        """Double buffer: start reloading the input of the layer backward needs next.

        See Note: [which layer is next].
        """
        if not self.double_buffer:
            return
        prev = _earlier_offloaded(entry)
        if prev is not None and prev.fetch is None:
            self._reload(prev)
            self.stats.prefetched += 1

    def _trace_end_compute(self) -> None:
        """Tracing only: the previous layer's recompute + backward ended (the next unpack began)."""
        span, self._open_compute = self._open_compute, None
        if span is not None:
            span.end = time.perf_counter()
            self.streams.trace.add(span)

    def _trace_start_compute(self, layer: int) -> None:
        """Tracing only: layer ``layer``'s recompute starts now; the last one is closed at backward's end."""
        if self.streams.trace is None:
            return
        now = time.perf_counter()
        self._open_compute = Span("compute", layer, now, now)
        _torch.queue_backward_callback(self._trace_end_compute)


# Note: [copy after produce]
# A layer input is written by kernels on the compute stream. The device->host copy runs on the
# copy stream, so before issuing it the copy stream waits for the compute stream *as it is at call
# time* (``wait_stream(current_stream())``): every kernel that produced the input is queued before
# that point. The current stream is read per call because the autograd engine runs backward on
# its own thread with its own current stream, and a user may train under ``torch.cuda.stream(s)``.
# On the CPU stream the host thread is the compute stream and has already finished the producer.

# Note: [cross-stream lifetime]
# After the forward copy is issued the pack hook keeps no reference to the device input, so the
# device memory is freed as soon as the model drops it -- but the copy stream may still be reading
# it. CUDA: ``record_stream(copy_stream)`` tells the caching allocator not to hand that block to
# other work until the copy stream passes the current point (that is "free the device copy once
# the copy is done", without a host sync). CPU: the worker's job holds the reference and drops it
# after the copy. The same applies to the device slot written by a reload.

# Note: [host buffer reuse]
# A host buffer belongs to one Entry (the object autograd saves) and returns to the pool when that
# Entry is garbage-collected (after its layer's backward, or when the graph is dropped unused).
# Its reload copy may still be queued then. It is safe to hand the buffer to a new forward copy at
# once because both copies are on the same copy stream, which runs copies in issue order: the new
# write cannot overtake the pending read. The host never reads a host buffer itself.

# Note: [device slot reuse]
# Reloads land in pooled device buffers. A slot is reusable only when nothing else references its
# storage: not a reload still pending (the Entry's ``fetch`` holds a view), not a copy in flight
# (the CPU worker holds the view), not the recompute graph of an earlier layer (autograd's saved
# tensors hold views until their backward node runs). That is checked on the storage's reference
# count, so correctness never depends on the order autograd happens to run nodes in; when every
# slot is busy a fresh buffer is used (``stats.device_transient``). The host-side count says the
# readers are *queued*, not finished, on the GPU: the reload copy therefore waits for the compute
# stream as of the reload call (Note: [copy after produce]), which has queued those readers.

# Note: [slots end with backward]
# Once the first-layer entry of a chain (no earlier offloaded entry left) has been handed its tensor, no
# reload of this backward is left, and the pool drops its slots. Memory is not freed under anyone: the
# recompute still holds its view (autograd's saved tensors), and the allocator frees the block when that
# view dies -- after layer 0's backward, before the optimizer step. Keeping the slots to the next step
# instead would add both of them to the end-of-backward peak, where a full fine-tune's gradients all live.
# The next backward allocates them again (from the caching allocator's free blocks, no cudaMalloc).

# Note: [read after fill]
# The recompute may only read a slot after its reload copy completed: ``unpack`` makes the current
# compute stream wait for the copy's event before returning the view. CUDA: a stream wait, the
# host continues (no sync inside a layer). CPU: the host blocks until the worker has copied.

# Note: [which layer is next]
# Backward visits checkpointed layers in reverse forward order, and a layer's input is unpacked
# right before its recompute. Each Entry links to the one packed just before it in the same
# forward (chains restart at layer 0), so when layer i is unpacked the reload of layer i-1 starts
# and overlaps layer i's recompute + backward. If autograd ever asks in another order the unpack
# simply reloads on demand: the prediction affects speed, never values.


# Note: [empty saved tensors]
# torch 2.11's checkpoint saves an empty ``(0,)`` dummy tensor beside the layer input (2.13 does
# not). It holds no data, so it is packed as itself: no Entry, no host buffer, no place in the
# reload chain (it must not count as a layer input, or the one-layer-early prefetch would pair
# the wrong tensors and the kept/offloaded counts would double), and unpack hands it back as is.


class OffloadedCheckpoint:
    """Drop-in for a layer's checkpoint function (transformers' ``_gradient_checkpointing_func``, swapped by
    :class:`fastkit.patches.offload.OffloadPatch`): the same checkpoint call, its saved input offloaded."""

    def __init__(self, original: Callable, controller: OffloadController, layer: int) -> None:
        self.original = original
        self.controller = controller
        self.layer = layer

    def __call__(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        if self.layer == 0:
            self.controller.new_chain()
        pack = functools.partial(self.controller.pack, self.layer)
        with saved_tensors_hooks(pack, self.controller.unpack):
            return self.original(function, *args, **kwargs)

