"""The CPU copy stream behaves like a CUDA stream: FIFO, events, lifetimes, errors surfaced."""

import gc
import threading

import pytest
import torch

from fastkit.patches.offload.streams import CpuStreams, Throttle


def test_copies_run_in_issue_order_and_wait_means_done():
    streams = CpuStreams(throttle=Throttle(0.005, poison=True), trace=True)
    dst = torch.empty(1000)
    srcs = [torch.full((1000,), float(i)) for i in range(5)]
    events = [streams.copy(dst, s, "h2d", tag=i) for i, s in enumerate(srcs)]
    streams.wait(events[-1])
    assert all(e.is_set() for e in events)  # FIFO: the last done means all done
    assert torch.equal(dst, srcs[-1])
    spans = streams.trace.of("h2d")
    assert [s.tag for s in spans] == list(range(5))
    assert all(a.end <= b.start for a, b in zip(spans, spans[1:]))  # one at a time, in order
    assert {s.buffer for s in spans} == {dst.data_ptr()}


def test_copy_keeps_source_alive_until_done():
    streams = CpuStreams(throttle=Throttle(0.02, poison=False))
    dst = torch.empty(4096)
    src = torch.arange(4096, dtype=torch.float32)
    expected = src.clone()
    event = streams.copy(dst, src, "d2h")
    del src  # the caller drops its reference at once, like the pack hook does
    gc.collect()
    streams.wait(event)
    assert torch.equal(dst, expected)


def test_poison_fills_the_destination_before_the_delay():
    # The worker poisons, sleeps, then copies: a copy whose event is still pending has NaN in it
    # (the race tests in test_offload.py rely on this to make an early read visible).
    release = threading.Event()

    streams = CpuStreams(throttle=Throttle(0.0, poison=True))
    dst = torch.zeros(8)
    src = torch.full((8,), 3.0)
    seen = []

    def fake_copy_(other):  # runs on the worker after the poison: look, then wait for the test
        seen.append(dst.clone())
        release.wait(10)
        return torch.Tensor.copy_(dst, other)

    class Dst(torch.Tensor):
        pass

    view = dst.as_subclass(Dst)
    view.copy_ = fake_copy_
    event = streams.copy(view, src, "h2d")
    while not seen:
        release.wait(0.001)
    assert torch.isnan(seen[0]).all()
    assert not event.is_set()  # not done: a reader must wait
    release.set()
    streams.wait(event)
    assert torch.equal(dst, src)


def test_throttle_only_slows_the_chosen_direction():
    streams = CpuStreams(throttle=Throttle(0.05, directions=("h2d",), poison=True), trace=True)
    a, b = torch.empty(16), torch.empty(16)
    streams.copy(a, torch.ones(16), "d2h")
    streams.copy(b, torch.ones(16), "h2d")
    streams.synchronize()
    d2h, h2d = streams.trace.of("d2h")[0], streams.trace.of("h2d")[0]
    assert torch.equal(a, torch.ones(16)) and torch.equal(b, torch.ones(16))
    assert h2d.end - h2d.start >= 0.05  # the sleep is part of the span (a lower bound, not a timing claim)
    assert d2h.end <= h2d.start


def test_a_failed_copy_raises_on_wait_and_the_stream_keeps_working():
    streams = CpuStreams()
    bad = streams.copy(torch.empty(3), torch.ones(4), "h2d")  # shape mismatch inside the worker
    with pytest.raises(RuntimeError, match="copy failed"):
        streams.wait(bad)
    dst = torch.empty(4)
    streams.wait(streams.copy(dst, torch.ones(4), "h2d"))
    assert torch.equal(dst, torch.ones(4))


def test_worker_stops_when_the_streams_object_goes_away():
    before = {t.ident for t in threading.enumerate() if t.name == "fastkit-copy-stream"}
    streams = CpuStreams()
    streams.wait(streams.copy(torch.empty(2), torch.ones(2), "h2d"))
    mine = [t for t in threading.enumerate() if t.name == "fastkit-copy-stream" and t.ident not in before]
    assert len(mine) == 1
    del streams
    gc.collect()
    mine[0].join(timeout=10)
    assert not mine[0].is_alive()


def test_cpu_streams_cannot_pin_and_allocate_pageable_buffers():
    streams = CpuStreams()
    assert streams.can_pin() is False
    assert streams.empty_host(10, torch.bfloat16, pin=False).dtype == torch.bfloat16
    assert streams.empty_device(10, torch.float32).device.type == "cpu"
