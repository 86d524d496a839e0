"""Ordering proofs for the offload pipeline on the CPU copy stream: overlap, races, mutations.

A throttled copy stream (slow copies that poison their destination first) and a slowed compute
(a sleep in every attention call, also during the recompute) make every ordering mistake visible:
reading a device buffer before its copy finished, or rewriting one the recompute still reads,
turns into NaN or wrong gradients, and into a violated invariant of the recorded trace.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from fastkit.patches.offload.patch import checkpointed_layers, enable_offload, offload_controller
from fastkit.patches.offload.pipeline import DevicePool
from fastkit.patches.offload.streams import CpuStreams, Throttle
from tests.test_offload import LAYERS, assert_bitwise, base, build, cfg, train_steps


def slow_compute(model, seconds):
    for layer in checkpointed_layers(model):
        layer.self_attn.register_forward_pre_hook(lambda *a: time.sleep(seconds))


def traced_step(model, config):
    enable_offload(base(model), config)
    trace = offload_controller(model).streams.trace
    train_steps(model, steps=1)  # warm: buffers allocated
    trace.clear()
    got = train_steps(model, steps=1)
    return got, trace


def by_layer(spans):
    out = {}
    for s in spans:
        assert s.tag not in out, "one span per layer per step"
        out[s.tag] = s
    return out


def check_trace_invariants(trace):
    """Read after fill; host buffer filled before read back; a slot rewritten only after its reader ended."""
    d2h, h2d, comp = by_layer(trace.of("d2h")), by_layer(trace.of("h2d")), by_layer(trace.of("compute"))
    assert set(h2d) == set(d2h) == set(range(LAYERS - 1)) and set(comp) == set(range(LAYERS))
    for layer, w in h2d.items():
        assert d2h[layer].end <= w.start  # the reload reads a filled host buffer
        assert w.end <= comp[layer].start  # the recompute reads a filled device buffer
    writes = sorted(h2d.values(), key=lambda s: s.start)
    for i, w in enumerate(writes):
        later = [x for x in writes[i + 1:] if x.buffer == w.buffer]
        if later:  # the slot is rewritten only after the layer that read it finished its backward
            assert later[0].start >= comp[w.tag].end


def test_trace_shows_copy_of_layer_i_minus_1_overlapping_compute_of_layer_i():
    ref = train_steps(build(), steps=1)
    model = build()
    slow_compute(model, 0.02)
    got, trace = traced_step(model, cfg(throttle=Throttle(0.05, directions=("h2d",)), trace=True))
    assert_bitwise(ref, got)
    check_trace_invariants(trace)
    h2d, comp = by_layer(trace.of("h2d")), by_layer(trace.of("compute"))
    for i in range(1, LAYERS):
        copy, compute = h2d[i - 1], comp[i]
        assert copy.start < compute.end and copy.end > compute.start, (i, copy, compute)


def test_single_buffer_trace_has_no_overlap():
    model = build()
    _, trace = traced_step(model, cfg(double_buffer=False, throttle=Throttle(0.01, directions=("h2d",)),
                                      trace=True))
    check_trace_invariants(trace)
    h2d, comp = by_layer(trace.of("h2d")), by_layer(trace.of("compute"))
    for i in range(1, LAYERS):
        assert h2d[i - 1].start >= comp[i].end  # each reload starts only once the layer above finished


@pytest.mark.parametrize("copy_s,compute_s", [(0.03, 0.0), (0.0, 0.02)], ids=["slow-copy", "slow-compute"])
@pytest.mark.parametrize("double", [True, False], ids=["double", "single"])
def test_races_never_read_early_or_after_reuse(copy_s, compute_s, double):
    ref = train_steps(build("qwen3", lora=True), steps=1)
    model = build("qwen3", lora=True)
    slow_compute(base(model), compute_s)
    got, trace = traced_step(model, cfg(double_buffer=double, throttle=Throttle(copy_s, poison=True),
                                              trace=True))
    assert_bitwise(ref, got)
    check_trace_invariants(trace)


def _lazy_copies(monkeypatch) -> None:
    """A copy stream whose reloads happen only when waited on: each h2d copy poisons its destination at issue
    and copies in ``wait(event)``. Ordering is then a fact, not a race: a read that waits sees the data, a read
    that does not sees the poison, whatever the machine's load (no thread, no sleep)."""
    from fastkit.patches.offload.streams import _poison

    def copy(self, dst, src, kind, tag=None):
        event = threading.Event()
        if kind == "h2d":
            _poison(dst)
            self.__dict__.setdefault("_lazy", {})[event] = (dst, src)
        else:
            dst.copy_(src)
            event.set()
        self._last = event
        return event

    def wait(self, event):
        dst, src = self.__dict__.setdefault("_lazy", {}).pop(event, (None, None))
        if dst is not None:
            dst.copy_(src)
        event.set()

    monkeypatch.setattr(CpuStreams, "copy", copy)
    monkeypatch.setattr(CpuStreams, "wait", wait)


@pytest.mark.parametrize("double", [False, True], ids=["single", "double"])
def test_mutation_missing_wait_is_caught(monkeypatch, double):
    # The race detector works: without the stream wait the recompute reads a poisoned buffer. The copy stream
    # copies only when waited on, so the outcome does not depend on timing or load.
    ref = train_steps(build(), steps=1)
    _lazy_copies(monkeypatch)
    model = build()
    enable_offload(model, cfg(double_buffer=double))
    (_, waited), = train_steps(model, steps=1)  # with its waits, the lazy stream gives the exact gradients
    assert all(torch.equal(ref[0][1][n], g) for n, g in waited.items())
    monkeypatch.setattr(CpuStreams, "wait", lambda self, event: None)  # the mutation: no wait before the read
    model = build()
    enable_offload(model, cfg(double_buffer=double))
    (loss, grads), = train_steps(model, steps=1)
    assert not all(torch.equal(ref[0][1][n], g) for n, g in grads.items())


def test_mutation_reusing_a_busy_slot_is_caught(monkeypatch):
    # The reference-count guard matters: a slot handed out while the recompute still reads it is corrupted.
    ref = train_steps(build(), steps=1)
    model = build()
    enable_offload(model, cfg(throttle=Throttle(0.03, poison=True)))
    monkeypatch.setattr("fastkit.patches.offload.pipeline._other_readers", lambda buf: 0)
    monkeypatch.setattr(DevicePool, "acquire", lambda self, n, dtype: _first_slot(self, n, dtype))
    try:
        (loss, grads), = train_steps(model, steps=1)
        offload_controller(model).streams.synchronize()
    except RuntimeError as exc:  # the corrupted slot met autograd's own in-place check first (load decides which)
        assert "modifying its input in place" in str(exc), exc
        return
    assert not all(torch.equal(ref[0][1][n], g) for n, g in grads.items())


def _first_slot(pool, numel, dtype):
    bufs = pool.bufs.setdefault((pool.streams.device, dtype), [])
    if not bufs:
        bufs.append(pool.streams.empty_device(numel, dtype))
    return bufs[0]  # always the same buffer: current and prefetched layers collide


