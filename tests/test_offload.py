"""Offloaded checkpointing is plain checkpointing, bitwise: parity, races, trace, fallbacks, revert.

Every model here runs the CPU copy stream (``force_cpu_stream=True``): the same pipeline code as on
a GPU, with a worker thread doing the copies, a throttle that makes copies slow and poisons their
destination first (a read of a half-filled or reused buffer turns into NaN or wrong gradients).
"""

from __future__ import annotations

import logging

import pytest
import torch

from fastkit.errors import FastkitError
from fastkit.families.twins import twin
from fastkit.loader import enable_checkpointing
from fastkit.patches.offload.patch import (
    OffloadConfig,
    OffloadedCheckpoint,
    OffloadPatch,
    check_host_budget,
    checkpointed_layers,
    decide,
    enable_offload,
    offload_active,
    offload_controller,
)
from fastkit.patches.offload.pipeline import HostPool
from fastkit.patches.offload.streams import CpuStreams, Throttle
from fastkit.patches.offload.testing import OffloadTestConfig
from fastkit.patching import active_patches, apply_patch, revert

LAYERS = 4


def cfg(**kw) -> OffloadConfig:
    """Offload everything (tiny twins are far below the production size thresholds)."""
    base = dict(min_tokens=0, min_bytes=0, force_cpu_stream=True, throttle=Throttle(0.002, poison=True))
    base.update(kw)
    return OffloadTestConfig(**base)


def build(model_type="llama", lora=False, layers=LAYERS, dropout=0.2, **overrides):
    """A twin in train mode with dropout on, plain non-reentrant checkpointing enabled."""
    model = twin(model_type, num_hidden_layers=layers, attention_dropout=dropout, **overrides).train()
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules="all-linear",
                                                 init_lora_weights=False))
    assert enable_checkpointing(model, True) == "checkpoint"
    return model


def base(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def batch(rows=2, seq=48, seed=7):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 300, (rows, seq), generator=g)
    return dict(input_ids=ids, labels=ids)


def train_steps(model, steps=2, **inputs):
    """Loss and every gradient per step; the RNG is reseeded per step so dropout masks are comparable."""
    inputs = inputs or batch()
    out = []
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(100 + step)
        loss = model(**inputs).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        out.append((loss.detach(), grads))
    return out


def assert_bitwise(ref, got):
    for (l0, g0), (l1, g1) in zip(ref, got):
        assert torch.equal(l0, l1), (l0, l1)
        assert g0.keys() == g1.keys() and len(g0) > 0
        for name in g0:
            assert torch.equal(g0[name], g1[name]), name


# --------------------------------------------------------------------------------------------
# Parity: bitwise equal to plain checkpointing (fp32 CPU), dropout on, LoRA and full fine-tune
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("double", [True, False], ids=["double", "single"])
def test_gradients_bitwise_equal_plain_checkpointing(model_type, lora, double):
    ref = train_steps(build(model_type, lora))
    model = build(model_type, lora)
    mode = enable_offload(base(model), cfg(double_buffer=double))
    assert mode == ("double-buffer" if double else "single-buffer")
    got = train_steps(model)
    assert_bitwise(ref, got)
    stats = offload_controller(model).stats
    assert stats.offloaded == 2 * (LAYERS - 1)  # every layer but the last, both steps
    assert stats.kept == {"last layer (needed first in backward)": 2}
    assert stats.host_allocs == LAYERS - 1 and stats.host_reuses == LAYERS - 1  # step 2 reuses step 1's
    # slots are allocated per backward and let go after its last reload (Note: [slots end with backward])
    assert stats.device_allocs == 2 * (2 if double else 1) and stats.device_transient == 0
    assert stats.device_releases == 2
    if double:
        assert stats.prefetched == 2 * (LAYERS - 1) and stats.on_demand == 0
    else:
        assert stats.prefetched == 0 and stats.on_demand == 2 * (LAYERS - 1)


class _SaveEmpty(torch.autograd.Function):
    """What torch 2.11's checkpoint does beside the layer input: autograd saves an empty ``(0,)`` tensor."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(torch.empty((0,)))
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        assert ctx.saved_tensors[0].shape == (0,)  # handed back as it was packed
        return grad


def _saving_empty(inner):
    """A checkpoint function that saves an extra empty tensor inside the checkpoint call, as torch 2.11 does."""

    def checkpoint(function, hidden, *args, **kwargs):
        return inner(function, _SaveEmpty.apply(hidden), *args, **kwargs)

    return checkpoint


def test_empty_saved_tensor_of_torch_2_11_is_passed_through():
    # torch 2.11 saves a (0,) dummy per checkpoint: it must neither divide by zero (numel // shape[-1]) nor join
    # the reload chain and inflate the counts (Note: [empty saved tensors] in offload_pipeline).
    ref_model = build("llama", lora=True)
    for layer in checkpointed_layers(base(ref_model)):
        layer._gradient_checkpointing_func = _saving_empty(layer._gradient_checkpointing_func)
    ref = train_steps(ref_model)
    model = build("llama", lora=True)
    assert enable_offload(base(model), cfg()) == "double-buffer"
    for layer in checkpointed_layers(base(model)):  # inside the offload's saved-tensor hooks
        layer._gradient_checkpointing_func.original = _saving_empty(layer._gradient_checkpointing_func.original)
    assert_bitwise(ref, train_steps(model))
    stats = offload_controller(model).stats
    assert stats.offloaded == 2 * (LAYERS - 1) and stats.prefetched == 2 * (LAYERS - 1)
    assert stats.kept == {"last layer (needed first in backward)": 2} and stats.on_demand == 0


def test_dropout_is_live_so_parity_proves_rng_replay():
    # Same weights, same inputs, different RNG: the losses differ, so the dropout masks matter and the
    # bitwise parity above holds only because the recompute replays the forward's RNG state.
    model = build("llama", lora=True)
    torch.manual_seed(1)
    a = model(**batch()).loss
    torch.manual_seed(2)
    b = model(**batch()).loss
    assert not torch.equal(a, b)


def test_gradient_accumulation_and_retain_graph():
    # Two micro-batches accumulate into .grad; a retained graph is backwarded twice (the host copy
    # must outlive the first reload).
    def run(offload):
        model = build("qwen3")
        if offload:
            enable_offload(model, cfg())
        model.zero_grad()
        for seed in (1, 2):
            torch.manual_seed(seed)
            model(**batch(seed=seed)).loss.backward()
        torch.manual_seed(3)
        loss = model(**batch(seed=3)).loss
        loss.backward(retain_graph=True)
        loss.backward()
        return [(loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})]

    assert_bitwise(run(False), run(True))


# --------------------------------------------------------------------------------------------
# Packed batches: metadata kwargs reach the recompute untouched, no extra syncs
# --------------------------------------------------------------------------------------------


def packed_batch():
    lens = [20, 12, 16]
    ids = torch.randint(3, 300, (1, sum(lens)), generator=torch.Generator().manual_seed(3))
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    cu = torch.tensor([0, 20, 32, 48], dtype=torch.int32)
    return dict(input_ids=ids, labels=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                max_length_q=20, max_length_k=20)


@pytest.mark.parametrize("packing_patch", [False, True], ids=["upstream", "fastkit-packing"])
def test_packed_metadata_reaches_the_recompute_and_no_sync_is_added(packing_patch):
    from fastkit.loader import FastModel
    from fastkit.syncs import SyncCounter

    key = "fastkit_packed" if packing_patch else "cu_seq_lens_q"

    def run(offload):
        model = build("llama", dropout=0.0)
        if packing_patch:
            FastModel.patch(model, max_seq_length=64, patches=["packing"])
        if offload:
            enable_offload(model, cfg())
        seen = []
        for layer in checkpointed_layers(model):
            layer.self_attn.register_forward_pre_hook(
                lambda mod, args, kwargs: seen.append(kwargs.get(key)), with_kwargs=True)
        inputs = packed_batch()
        model.zero_grad()
        with SyncCounter() as sc:
            loss = model(**inputs).loss
            loss.backward()
        return loss, seen, sc.total, {n: p.grad for n, p in model.named_parameters()}

    l0, seen0, syncs0, g0 = run(False)
    l1, seen1, syncs1, g1 = run(True)
    assert len(seen1) == 2 * LAYERS and seen1[0] is not None  # forward + recompute of every layer
    assert all(s is seen1[0] for s in seen1)  # the very same metadata object in forward and recompute
    assert syncs1 == syncs0  # offload adds no host sync
    if packing_patch:  # at most the one per-batch read of cu_seq_lens (zero with wrap_collator), none per layer
        assert syncs1 <= 1
    assert_bitwise([(l0, g0)], [(l1, g1)])


# --------------------------------------------------------------------------------------------
# Revert, idempotence, what is skipped and why
# --------------------------------------------------------------------------------------------


def test_revert_restores_plain_checkpointing_exactly():
    model = build()
    originals = [layer._gradient_checkpointing_func for layer in checkpointed_layers(model)]
    assert enable_offload(model, cfg()) == "double-buffer"
    assert enable_offload(model, cfg()) == "double-buffer"  # idempotent
    assert active_patches(model) == ["offload"]
    assert all(isinstance(layer._gradient_checkpointing_func, OffloadedCheckpoint)
               for layer in checkpointed_layers(model))
    train_steps(model, steps=1)
    assert offload_active(model)
    model.activation_checkpointing_enable({"use_reentrant": False})  # what Trainer does if told to
    assert not offload_active(model)  # detected: the offload was silently replaced
    assert revert(model) == ["offload"]
    assert all(layer._gradient_checkpointing_func is f for layer, f in zip(checkpointed_layers(model), originals))
    assert offload_controller(model) is None and active_patches(model) == []
    assert_bitwise(train_steps(build(), steps=1), train_steps(model, steps=1))


def test_cpu_only_machine_trains_with_plain_checkpointing(caplog):
    model = build()
    with caplog.at_level(logging.WARNING, logger="fastkit"):
        mode = enable_offload(model)  # no force_cpu_stream: a user on a CPU machine
    assert mode.startswith("checkpoint (offload skipped: no CUDA device")
    assert "training with plain gradient checkpointing" in caplog.text
    assert active_patches(model) == [] and offload_controller(model) is None
    with caplog.at_level(logging.WARNING, logger="fastkit"):
        assert enable_checkpointing(build(), "offload").startswith("checkpoint (offload skipped")


def test_small_activations_and_short_sequences_stay_on_device():
    model = build()
    enable_offload(model, OffloadTestConfig(force_cpu_stream=True))  # production thresholds: 512 tokens, 1 MiB
    ref = train_steps(build(), steps=1)
    assert_bitwise(ref, train_steps(model, steps=1))
    stats = offload_controller(model).stats
    assert stats.offloaded == 0 and sum(stats.kept.values()) == LAYERS
    assert stats.kept["below min_bytes=1048576"] == LAYERS - 1
    enable = build()
    enable_offload(enable, cfg(min_tokens=512))
    train_steps(enable, steps=1)
    assert offload_controller(enable).stats.kept["below min_tokens=512"] == LAYERS - 1


def test_pinned_budget_falls_back_per_layer(caplog):
    one = 2 * 48 * 64 * 4  # bytes of one layer input (2 rows x 48 tokens x hidden 64, fp32)
    model = build()
    enable_offload(model, cfg(pinned_budget_bytes=2 * one))
    with caplog.at_level(logging.WARNING, logger="fastkit"):
        got = train_steps(model)
    assert_bitwise(train_steps(build()), got)
    stats = offload_controller(model).stats
    assert stats.offloaded == 2 * 2 and stats.kept["host buffer budget spent"] == 2
    budget_logs = [r.getMessage() for r in caplog.records if "budget" in r.getMessage()]
    assert len(budget_logs) == 1  # logged once, with the numbers
    assert "reached the 48.0 KiB budget" in budget_logs[0] and "their 24.0 KiB input" in budget_logs[0]


def test_host_ram_check_raises_before_training_with_the_numbers():
    model = build()
    with pytest.raises(FastkitError, match=r"needs [\d.]+ GiB of host RAM \(3 layers x 10000000000 tokens"):
        enable_offload(model, cfg(expected_tokens=10**10))
    assert active_patches(model) == []  # nothing applied
    assert check_host_budget(model, 1000, OffloadTestConfig()) == 3 * 1000 * 64 * 4


def test_host_pool_runtime_ram_check_and_pin_fallback(monkeypatch, caplog):
    class PinFails(CpuStreams):
        def can_pin(self):
            return True

        def empty_host(self, numel, dtype, pin):
            if pin:
                raise RuntimeError("cudaHostAlloc failed")
            return super().empty_host(numel, dtype, pin)

    from fastkit.patches.offload.pipeline import OffloadStats

    pool = HostPool(PinFails(), OffloadTestConfig(), budget=10**11)
    pool.stats = OffloadStats()
    with caplog.at_level(logging.WARNING, logger="fastkit"):
        buf = pool.acquire(1000, torch.float32)
    assert pool.pin is False and buf.numel() >= 1000 and "pageable" in caplog.text
    monkeypatch.setattr("fastkit.patches.offload.patch.host_ram", lambda: (3 * 1024**3, 16 * 1024**3))
    with pytest.raises(FastkitError, match="another .* MiB of host RAM"):
        pool.acquire(300 * 1024**2, torch.float32)  # 1.2 GiB > 3 GiB available - 2 GiB reserve


def test_decide_on_gpus(monkeypatch):
    from types import SimpleNamespace

    model = build()
    monkeypatch.setattr("fastkit.patches.offload.patch._model_device", lambda m: torch.device("cuda", 0))
    props = SimpleNamespace(name="NVIDIA GB10", is_integrated=True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (100 * 1024**3, 128 * 1024**3))
    d = decide(model, OffloadTestConfig())
    assert d.mode == "checkpoint" and "unified memory" in d.reason
    props.is_integrated, props.name = False, "Tesla T4"
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (512 * 1024**2, 15 * 1024**3))
    d = decide(model, OffloadTestConfig())
    assert d.mode == "single-buffer" and "headroom" in d.reason
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (10 * 1024**3, 15 * 1024**3))
    assert decide(model, OffloadTestConfig()).mode == "double-buffer"
    assert decide(model, OffloadTestConfig(double_buffer=False)).mode == "single-buffer"
    with pytest.raises(FastkitError, match="force_cpu_stream"):
        decide(model, OffloadTestConfig(force_cpu_stream=True))


def test_refuses_without_checkpointing_or_with_reentrant_checkpointing():
    plain = twin("llama", num_hidden_layers=2).train()
    ok, why = apply_patch(plain, OffloadPatch(cfg()))
    assert not ok and "not enabled" in why
    reentrant = twin("llama", num_hidden_layers=2).train()
    reentrant.activation_checkpointing_enable({"use_reentrant": True})
    ok, why = apply_patch(reentrant, OffloadPatch(cfg()))
    assert not ok and "use_reentrant=False" in why
    save_on_cpu = twin("llama", num_hidden_layers=2).train()
    save_on_cpu.activation_checkpointing_enable({"use_reentrant": False}, offload=True)
    ok, why = apply_patch(save_on_cpu, OffloadPatch(cfg()))
    assert not ok and "offload=True" in why


# --------------------------------------------------------------------------------------------
# Benchmark smoke test
# --------------------------------------------------------------------------------------------


def test_bench_offload_quick(tmp_path, capsys):
    from benchmarks.offload import main

    assert main(["--quick", "--out", str(tmp_path)]) == 0
    md, printed = (tmp_path / "bench_offload.md").read_text(), capsys.readouterr().out
    import importlib.util

    has_plot = importlib.util.find_spec("matplotlib") is not None  # absent in the GPU rehearsal's env
    assert (tmp_path / "bench_offload.png").exists() == has_plot
    assert has_plot or "plot skipped" in printed
    for row in ("no checkpointing", "plain checkpointing", "transformers offload=True", "TRL activation_offloading",
                "fastkit single buffer", "fastkit double buffer", "c+(L-1)max(c,g)+g"):
        assert row in md
    assert "| fastkit double buffer | n/a" not in md and "| fastkit single buffer | n/a" not in md
    assert md in printed


def test_the_users_offload_config_has_no_test_seams():
    """force_cpu_stream / throttle / trace live in fastkit.patches.offload.testing.OffloadTestConfig, not in the user's
    config."""
    from dataclasses import fields

    seams = {"force_cpu_stream", "throttle", "trace"}
    assert not seams & {f.name for f in fields(OffloadConfig)}
    assert seams <= {f.name for f in fields(OffloadTestConfig)}
