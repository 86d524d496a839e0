"""A copy stream and its events, on CUDA or on the CPU, for :mod:`fastkit.patches.offload.pipeline`.

The offload pipeline (copy a layer's input to host memory in forward, bring it back one layer
ahead in backward) is ordering and lifetime logic: which copy may start when, which buffer may be
read or rewritten when. That logic must not depend on CUDA, or it could only be tested on a GPU.
This module gives it one small interface, :class:`CopyStreams`, with two implementations:

- :class:`CudaStreams`: a side ``torch.cuda.Stream`` for copies, ``torch.cuda.Event`` per copy,
  the compute stream read with ``torch.cuda.current_stream`` *at call time* (the autograd engine
  runs backward on its own thread and stream, so a stream captured at construction would be wrong).
- :class:`CpuStreams`: a worker thread that performs the copies in FIFO order (like a stream),
  ``threading.Event`` per copy. The host thread is the "compute stream": it is synchronous, so
  "wait for an event" blocks it. An optional :class:`Throttle` makes copies slow (known cost ``c``)
  and poisons the destination first, so that reading a buffer before its copy finished, or
  rewriting a buffer something still reads, shows up as NaN in the gradients. A :class:`Trace`
  records copy and compute spans for the overlap test and the time-model benchmark.

What must not change: copies on one :class:`CopyStreams` run in the order issued (the host-buffer
reuse argument in :mod:`fastkit.patches.offload.pipeline` relies on it), and ``copy`` keeps its source and
destination alive until the copy is done.
"""

from __future__ import annotations

import math
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Throttle:
    """Make the CPU copy stream slow and hostile, for tests and the time-model benchmark."""

    seconds_per_copy: float = 0.0
    """Fixed delay added to every copy (the known copy cost ``c`` of the time model)."""
    directions: tuple[str, ...] = ("d2h", "h2d")
    """Which copies the delay applies to: ``"d2h"`` (forward offload), ``"h2d"`` (backward reload)."""
    poison: bool = True
    """Fill the destination with NaN (or -1 for integer dtypes) before the delay, so any read of a
    half-filled buffer, or of a buffer rewritten while still in use, corrupts the result visibly."""


@dataclass
class Span:
    """One interval in a :class:`Trace`: a copy on the copy stream or a compute phase on the host."""

    kind: str
    """``"d2h"``, ``"h2d"`` (copies) or ``"compute"`` (a layer's recompute + backward)."""
    tag: Any
    """Who it belongs to: the checkpointed layer index."""
    start: float
    """``time.perf_counter()`` at the start."""
    end: float
    """``time.perf_counter()`` at the end."""
    buffer: int = -1
    """``data_ptr()`` of the buffer written (copies only)."""


@dataclass
class Trace:
    """Thread-safe list of :class:`Span` (filled only when tracing is on)."""

    spans: list[Span] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, span: Span) -> None:
        with self._lock:
            self.spans.append(span)

    def of(self, kind: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.kind == kind]

    def clear(self) -> None:
        with self._lock:
            self.spans.clear()


class CopyStreams:
    """A copy stream next to the compute stream. Subclasses implement the five primitives."""

    device: torch.device
    """Where activations live (the tensors being offloaded)."""
    trace: Trace | None = None
    """Spans of copies (and, from the caller, compute), or None when not tracing."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor, kind: str, tag: Any = None) -> Any:
        """Enqueue ``dst.copy_(src)`` on the copy stream after all work already queued on the current
        compute stream; keep both alive until it is done. Returns an event that completes with it."""
        raise NotImplementedError

    def wait(self, event: Any) -> None:
        """Make the *current* compute stream wait for ``event`` (never blocks a CUDA host thread)."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Block the host until every issued copy is done (benchmarks and tests only)."""
        raise NotImplementedError

    def empty_host(self, numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        """A flat host buffer (pinned when ``pin``; raises RuntimeError if pinning fails)."""
        return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=pin)

    def empty_device(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat buffer on :attr:`device`, allocated on the current compute stream."""
        return torch.empty(numel, dtype=dtype, device=self.device)

    def can_pin(self) -> bool:
        """Whether page-locked host memory can be allocated here."""
        return False


class CudaStreams(CopyStreams):
    """Copies on a side CUDA stream; the compute stream is whatever is current when called."""

    def __init__(self, device: torch.device, trace: bool = False) -> None:
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device)
        self.trace = Trace() if trace else None

    def copy(self, dst: torch.Tensor, src: torch.Tensor, kind: str, tag: Any = None) -> torch.cuda.Event:
        # See Note: [copy after produce] in fastkit/patches/offload_pipeline.py: wait for the compute stream *now*.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        # See Note: [cross-stream lifetime]: device memory used on the copy stream is not handed to
        # other work by the caching allocator until this stream has passed this point.
        for t in (dst, src):
            if t.is_cuda:
                t.record_stream(self.stream)
        return event

    def wait(self, event: torch.cuda.Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def synchronize(self) -> None:
        self.stream.synchronize()

    def can_pin(self) -> bool:
        try:
            torch.empty(1, pin_memory=True)
            return True
        except RuntimeError:
            return False


def _poison(t: torch.Tensor) -> None:
    t.fill_(math.nan if t.is_floating_point() else -1)


def _worker(jobs: queue.SimpleQueue, throttle: Throttle | None, trace: Trace | None) -> None:
    """Run copies in FIFO order until a ``None`` job arrives. Holds no reference to the streams object."""
    while True:
        job = jobs.get()
        if job is None:
            return
        dst, src, kind, tag, event, errors = job
        try:
            start = time.perf_counter()
            if throttle is not None and kind in throttle.directions:
                if throttle.poison:
                    _poison(dst)
                time.sleep(throttle.seconds_per_copy)
            dst.copy_(src)
            if trace is not None:
                trace.add(Span(kind, tag, start, time.perf_counter(), dst.data_ptr()))
        except BaseException as exc:  # surfaced on the host at the next wait()
            errors.append(exc)
        finally:
            del dst, src, job  # See Note: [cross-stream lifetime]: drop the refs only once copied
            event.set()


class CpuStreams(CopyStreams):
    """The CPU twin of :class:`CudaStreams`: a worker thread is the copy stream.

    The host thread plays the compute stream. It is synchronous, so everything it "queued" has
    already run when it calls :meth:`copy` (``wait_stream`` is a no-op) and :meth:`wait` blocks it
    until the worker has passed the event, which is what a CUDA stream-wait guarantees to the GPU.
    """

    def __init__(self, throttle: Throttle | None = None, trace: bool = False) -> None:
        self.device = torch.device("cpu")
        self.throttle = throttle
        self.trace = Trace() if trace else None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._errors: list[BaseException] = []
        self._last: threading.Event | None = None
        worker = threading.Thread(target=_worker, args=(self._jobs, throttle, self.trace),
                                  name="fastkit-copy-stream", daemon=True)
        worker.start()
        weakref.finalize(self, self._jobs.put, None)  # stop the worker when this object goes away

    def copy(self, dst: torch.Tensor, src: torch.Tensor, kind: str, tag: Any = None) -> threading.Event:
        event = threading.Event()
        self._jobs.put((dst, src, kind, tag, event, self._errors))
        self._last = event
        return event

    def wait(self, event: threading.Event) -> None:
        event.wait()
        self._raise_errors()

    def synchronize(self) -> None:
        if self._last is not None:
            self.wait(self._last)

    def _raise_errors(self) -> None:
        if self._errors:
            exc = self._errors.pop(0)
            raise RuntimeError(f"fastkit copy stream: a copy failed: {exc}") from exc


__all__ = ["CopyStreams", "CpuStreams", "CudaStreams", "Span", "Throttle", "Trace"]
