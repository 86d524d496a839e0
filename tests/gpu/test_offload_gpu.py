"""Offloaded checkpointing on a CUDA GPU: parity, no added syncs, less memory, any compute stream.

Run on the device machine: ``python -m pytest -m gpu tests/gpu/test_offload_gpu.py -q``.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from fastkit.families.twins import twin
from fastkit.loader import enable_checkpointing
from fastkit.patches.offload.patch import enable_offload, offload_controller
from fastkit.patches.offload.testing import OffloadTestConfig

pytestmark = pytest.mark.gpu

SHAPE = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=4, head_dim=32, intermediate_size=512)


def build(layers=4, dropout=0.1, lora=False, dtype=torch.float32, **shape):
    model = twin("llama", num_hidden_layers=layers, attention_dropout=dropout, dtype=dtype,
                 **(shape or SHAPE)).cuda().train()
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        model = get_peft_model(model, LoraConfig(r=8, target_modules="all-linear", init_lora_weights=False))
    enable_checkpointing(model, True)
    return model


def base(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def step(model, seq=1024, seed=0):
    ids = torch.randint(3, 300, (1, seq), device="cuda", generator=torch.Generator(device="cuda").manual_seed(5))
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.cuda.synchronize()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("double", [True, False], ids=["double", "single"])
def test_gpu_gradients_match_plain_checkpointing(lora, double):
    ref = [step(build(lora=lora), seed=s) for s in (0, 1)]
    model = build(lora=lora)
    mode = enable_offload(base(model), OffloadTestConfig(min_tokens=0, min_bytes=0, double_buffer=double))
    assert mode == ("double-buffer" if double else "single-buffer")
    got = [step(model, seed=s) for s in (0, 1)]
    # fp32; the recompute reads the same values (an exact copy), so differences can only come from
    # non-deterministic backward kernels (atomics in SDPA backward): a few ulp, hence the tolerance.
    for (l0, g0), (l1, g1) in zip(ref, got):
        torch.testing.assert_close(l1, l0, rtol=0, atol=0)  # forward is deterministic
        for name in g0:
            torch.testing.assert_close(g1[name], g0[name], rtol=1e-5, atol=1e-6, msg=name)
    stats = offload_controller(model).stats
    assert offload_controller(model).host.pin  # pinned host buffers
    assert stats.offloaded == 2 * 3 and stats.host_reuses == 3 and stats.device_transient == 0


def _sync_warnings(model) -> int:
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step(model)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def test_gpu_offload_adds_no_host_sync():
    plain = _sync_warnings(build())
    model = build()
    enable_offload(model, OffloadTestConfig(min_tokens=0, min_bytes=0))
    _sync_warnings(model)  # warm: buffers allocated (allocation may sync once)
    assert _sync_warnings(model) == plain


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_gpu_peak_memory_is_lower_and_buffers_are_reused(lora):
    """The claim users care about is measured on a LoRA run (frozen base: the saved layer inputs are most of
    the activation memory). On a full fine-tune the end-of-backward peak (every gradient live) must at least
    not grow: the two reload slots are let go once the last reload is out (Note: [slots end with backward])."""
    shape = dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
                 intermediate_size=2048)
    peaks = {}
    for offload in (False, True):
        model = build(layers=8, dropout=0.0, lora=lora, dtype=torch.bfloat16, **shape)
        if offload:
            assert enable_offload(base(model), OffloadTestConfig()) == "double-buffer"
        step(model, seq=4096)
        torch.cuda.reset_peak_memory_stats()
        step(model, seq=4096)
        peaks[offload] = torch.cuda.max_memory_allocated()
        if offload:
            controller = offload_controller(model)
            stats = controller.stats
            assert stats.offloaded == 2 * 7 and stats.host_allocs == 7
            assert stats.device_allocs == 2 * 2 and stats.device_releases == 2 and stats.device_transient == 0
            assert not any(controller.device.bufs.values())  # no slot held between steps
        del model
        torch.cuda.empty_cache()
    if lora:
        assert peaks[True] < peaks[False], peaks
    else:  # a held slot is 8 MiB here (4096 x 1024 bf16); 1 MiB of slack for allocator rounding
        assert peaks[True] <= peaks[False] + 2**20, peaks


def test_gpu_current_stream_is_taken_at_call_time():
    ref = step(build(dropout=0.0))
    model = build(dropout=0.0)
    enable_offload(model, OffloadTestConfig(min_tokens=0, min_bytes=0))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = step(model)
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)
    for name in ref[1]:
        torch.testing.assert_close(got[1][name], ref[1][name], rtol=1e-5, atol=1e-6, msg=name)


def test_gpu_offload_under_regions_compile_keeps_its_pipeline():
    """compile="regions" (inductor) compiles each layer below its offloaded checkpoint: the copy stream still
    offloads every layer input but the last and prefetches one layer early, the loss and every LoRA gradient stay
    within inductor's fp32 reordering of plain checkpointing (fused reductions: 1e-4), and a warm compiled step
    adds no host sync."""
    from fastkit.training.compile import compile_model

    torch._dynamo.reset()
    ref = step(build(lora=True, dropout=0.0))
    model = build(lora=True, dropout=0.0)
    assert enable_offload(base(model), OffloadTestConfig(min_tokens=0, min_bytes=0)) == "double-buffer"
    assert compile_model(model, "regions") == 4
    step(model)  # compiles
    loss, grads = step(model)
    torch.testing.assert_close(loss, ref[0], rtol=1e-4, atol=1e-4)
    for name, g in ref[1].items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-4, msg=name)
    stats = offload_controller(model).stats
    assert stats.offloaded == 2 * 3 and stats.prefetched >= 2 and stats.device_transient == 0
    assert _sync_warnings(model) == _sync_warnings(build(lora=True, dropout=0.0))
