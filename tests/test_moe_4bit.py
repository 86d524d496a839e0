"""4-bit experts: bitsandbytes' NF4 bytes, parity with the dequantized twin, storage and memory bounds."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fastkit import FastModel, GPUOnlyError
from fastkit.errors import FastkitError
from fastkit.families.twins import twin
from fastkit.patches.moe.lora import add_expert_lora
from fastkit.patches.moe.nf4 import NF4Experts, expert_storage_bytes, quantize_experts, quantize_nf4
from fastkit.patches.moe.patch import MoEConfig, MoEExpertsPatch, attach_experts, experts_modules
from fastkit.patching import apply_patch
from fastkit.plan.memprobe import measure_peak
from tests.helpers import assert_tensors_close, forward_backward, save_twin

FAMILIES = ["gpt_oss", "qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3"]


def _ids(t=16, b=2):
    return torch.randint(3, 300, (b, t), generator=torch.Generator().manual_seed(1))


def _dequantized_copy(model4: nn.Module, model16: nn.Module) -> nn.Module:
    """``model16`` (the unquantized original) with every expert weight replaced by its dequantized value."""
    ref = copy.deepcopy(model16)
    mods = dict(ref.named_modules())
    for name, q in model4.named_modules():
        if isinstance(q, NF4Experts):
            parent, _, attr = name.rpartition(".")
            getattr(mods[parent], attr).data.copy_(q.dequantize())
    return ref


def _with_lora(model: nn.Module) -> nn.Module:
    apply_patch(model, MoEExpertsPatch(None, MoEConfig()))
    torch.manual_seed(0)  # the same A factors in every model built here
    add_expert_lora(model, r=4, lora_alpha=8)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # B starts at zero: give it values so the A gradients mean something
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def _lora_grads(step):
    return {n: g for n, g in step.grads.items() if "lora" in n}


@pytest.mark.parametrize("shape", [(4, 96, 128), (4, 128, 96)])
@pytest.mark.parametrize("double_quant", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [None, 1000], ids=["one-pass", "chunked"])
def test_nf4_bytes_and_dequant_are_bitsandbytes(shape, double_quant, dtype, chunk, monkeypatch):
    bnb = pytest.importorskip("bitsandbytes.functional")
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute

    if chunk:  # quantized a few blocks per pass (as a 531M-value GPT-OSS projection is): the same bytes
        monkeypatch.setattr("fastkit.patches.moe.nf4.CHUNK_VALUES", chunk)

    w = (torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 0.05).to(dtype)
    ours = quantize_nf4(w, 64, double_quant)
    packed, state = bnb.quantize_4bit(w, blocksize=64, compress_statistics=double_quant, quant_type="nf4")
    assert torch.equal(ours["packed"], packed.view(-1))
    if double_quant:
        assert torch.equal(ours["absmax"], state.absmax)
        assert torch.equal(ours["absmax2"], state.state2.absmax) and torch.equal(ours["code2"], state.state2.code)
        assert torch.equal(ours["offset"], state.offset)
    else:
        assert torch.equal(ours["absmax"], state.absmax)
    q = NF4Experts(w, transposed=True, double_quant=double_quant)
    absmax = bnb.dequantize_blockwise(state.absmax, state.state2) + state.offset if double_quant else state.absmax
    reference = _dequantize_4bit_compute(packed.view(-1), absmax, state.code, 64, shape, dtype)  # = the CUDA kernel
    assert torch.equal(q.dequantize(), reference)  # bit-exact, every expert
    if shape[-1] % 64 == 0:
        assert torch.equal(q.dequantize(), bnb.dequantize_4bit(packed, state))
    # Rows of another width are not compared with bnb's CPU C kernel: it has blocked per row (m, n) and misread its own
    # flat format when n % 64 != 0 on some CPUs and not others (bitsandbytes 0.50.2, the same wheel: issue 58), so
    # the reference above (its portable op, the CUDA kernel's arithmetic) is the one compared with.


def test_model_to_dtype_changes_the_compute_dtype_not_the_codes():
    q = NF4Experts(torch.randn(2, 64, 32), transposed=False)
    d32 = q.dequantize()
    q.to(torch.bfloat16)
    assert q.dtype == torch.bfloat16 and q.shape == (2, 32, 64)
    assert torch.equal(q.dequantize(), d32.to(torch.bfloat16))  # fp32 table and absmax kept: still bnb-exact


@pytest.mark.parametrize("family", FAMILIES)
def test_4bit_twin_equals_dequantized_twin_logits_and_lora_grads(family):
    original = twin(family)
    model4 = copy.deepcopy(original)
    assert quantize_experts(model4) == 2 * len(experts_modules(original))
    ref = _with_lora(_dequantized_copy(model4, original))
    model4 = _with_lora(model4)
    ids = _ids()
    got, want = forward_backward(model4, ids), forward_backward(ref, ids)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
    assert_tensors_close(_lora_grads(got), _lora_grads(want), atol=1e-5, rtol=1e-4)
    assert all(g is not None for g in got.grads.values())
    full = _with_lora(copy.deepcopy(original))  # NF4 error vs the unquantized model: reported, not hidden
    exact = forward_backward(full, ids)
    rel = float((got.logits - exact.logits).norm() / exact.logits.norm())
    w_err = _weight_error(model4, original)
    msg = (f"NF4 error {family}: expert weights rel RMS {w_err:.4f}, logits rel {rel:.4f}, "
           f"loss {got.loss:.4f} vs {exact.loss:.4f} unquantized")
    print(msg)
    assert w_err < 0.12  # NF4 on normal weights: ~0.09 relative RMS (QLoRA's 4-bit NormalFloat)
    assert abs(float(got.loss - exact.loss)) < 0.05


def _weight_error(model4: nn.Module, original: nn.Module) -> float:
    mods = dict(original.named_modules())
    num = den = 0.0
    for name, q in model4.named_modules():
        if isinstance(q, NF4Experts):
            parent, _, attr = name.rpartition(".")
            w = getattr(mods[parent], attr).detach()
            num += float((q.dequantize() - w).square().sum())
            den += float(w.square().sum())
    return (num / den) ** 0.5


@pytest.mark.parametrize("family", FAMILIES)
def test_expert_storage_under_three_tenths_of_16bit_and_frozen(family):
    model = twin(family)
    quantize_experts(model)
    stored, sixteen = expert_storage_bytes(model)
    print(f"{family}: expert storage {stored} B vs {sixteen} B in 16-bit = {stored / sixteen:.3f}x")
    assert 0 < stored <= 0.3 * sixteen
    for _, m in experts_modules(model):
        assert isinstance(m.down_proj, NF4Experts)
        assert not any(p.requires_grad for p in m.parameters())  # codes are buffers; biases frozen


def test_eval_forward_and_generate_then_train_gives_the_same_gradients():
    model = _with_lora(twin("qwen3_moe"))
    quantize_experts(model)
    ids = _ids()
    before = forward_backward(model, ids)
    model.eval()
    with torch.no_grad():
        model(ids)
        model.generate(ids[:1, :4], max_new_tokens=3, do_sample=False)
    model.train()
    after = forward_backward(model, ids)
    torch.testing.assert_close(after.logits, before.logits, atol=0, rtol=0)
    assert_tensors_close(_lora_grads(after), _lora_grads(before), atol=0, rtol=0)
    assert not any("Linear4bit" in type(m).__name__ or "Params4bit" in type(m).__name__ for m in model.modules())


def _layer(num_experts=16, size=256):
    model = twin("qwen3_moe", hidden_size=size, moe_intermediate_size=size, num_experts=num_experts,
                 num_experts_per_tok=2, num_hidden_layers=1)
    quantize_experts(model)
    experts = model.model.layers[0].mlp.experts
    attach_experts(experts, MoEConfig(dequant_group_bytes=0))  # one expert per call (groups: test_moe_4bit_groups)
    t = num_experts
    hidden = torch.randn(t, size, requires_grad=True)
    idx = torch.arange(2 * t).view(t, 2) % num_experts  # (T, K): every expert gets tokens
    return experts, hidden, idx, torch.rand(t, 2)


def test_one_layer_extra_memory_is_one_expert_and_nothing_dequantized_is_saved():
    experts, hidden, idx, weights = _layer()
    one = experts.gate_up_proj.shape[1:].numel() * 4  # one expert's gate_up, dequantized fp32
    all_e = one * experts.num_experts

    def run():
        experts(hidden, idx, weights).sum().backward()

    run()  # warm up
    peak = measure_peak(run)[1]
    print(f"one MoE layer fwd+bwd: peak extra {peak / 2**20:.2f} MiB; one expert {one / 2**20:.2f} MiB; "
          f"all {experts.num_experts} experts {all_e / 2**20:.2f} MiB")
    assert peak <= 3 * one < all_e / 4
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        experts(hidden, idx, weights)
    assert max(saved, default=0) < experts.gate_up_proj.shape[1:].numel()


def test_unsupported_combinations_fail_clearly():
    model = twin("qwen3_moe")
    experts_modules(model)[0][1]._is_expert_parallel = True
    with pytest.raises(FastkitError, match="expert parallelism"):
        quantize_experts(model)

    class DbrxExperts(nn.Module):
        pass

    with pytest.raises(FastkitError, match="no 4-bit expert layout"):
        quantize_experts(nn.Sequential(DbrxExperts()))
    experts, hidden, idx, weights = _layer(num_experts=4, size=64)
    experts._fastkit_moe.config = MoEConfig(mode="grouped")
    with pytest.raises(FastkitError, match="grouped"):
        experts(hidden, idx, weights)


@pytest.fixture(scope="module")
def saved_moe(tmp_path_factory):
    model = twin("qwen3_moe")
    return save_twin(model, tmp_path_factory.mktemp("qwen3_moe")), model


def test_load_in_4bit_on_cpu_stores_moe_experts_4bit(saved_moe):
    path, original = saved_moe
    model, _ = FastModel.from_pretrained(str(path), load_in_4bit=True, max_seq_length=64)
    stored, sixteen = expert_storage_bytes(model)
    assert 0 < stored <= 0.3 * sixteen and len(experts_modules(model)) == 2
    ref = _dequantized_copy(model, original)
    apply_patch(ref, MoEExpertsPatch(None, MoEConfig()))
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, atol=1e-5, rtol=1e-5)
    peft_model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False)  # "all-linear"
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert any("fastkit_lora" in n for n in trainable)  # 4-bit experts adapted by fastkit's per-group factors
    forward_backward(peft_model, ids)


def test_load_in_4bit_on_cpu_still_refuses_dense_models(tmp_path):
    save_twin(twin("llama"), tmp_path)
    with pytest.raises(GPUOnlyError, match="needs a CUDA GPU"):
        FastModel.from_pretrained(str(tmp_path), load_in_4bit=True)


def test_plan_for_real_configs_counts_experts_4bit_and_one_hit_group_dequantized():
    from fastkit.plan import plan, read_config
    from fastkit.plan.moe_4bit import GPT_OSS_20B, QWEN3_30B_A3B, plan_4bit_experts
    from fastkit.plan.terms import shape_of

    for config in (GPT_OSS_20B, QWEN3_30B_A3B):
        ours = plan_4bit_experts(config, gpu="t4", max_seq_length=2048, r=8)
        sixteen = plan(dict(config), gpu="t4", max_seq_length=2048, r=8, load_in_4bit=False)
        print(ours.table())
        shape = shape_of(read_config(dict(config)))
        experts16 = 2 * shape.expert_params_per_layer * (shape.layers - shape.dense_layers)
        experts = ours.components["weights: MoE experts, NF4 + absmax"]
        assert 0.25 * experts16 < experts <= 0.3 * experts16
        assert ours.total < 0.5 * sixteen.total
        assert not any("merged" in k for k in ours.components)
        dequant = ours.components["4-bit experts dequantized per hit group (fastkit, fwd and bwd)"]
        assert dequant < 0.02 * experts  # one hit group's transient (<= 64 MiB or one expert), not the layer's
    gpt = plan_4bit_experts(GPT_OSS_20B, gpu="spark", max_seq_length=2048, r=8)
    assert gpt.fits and gpt.total < 24 * 2**30  # docs/moe.md has the table by GPU


def test_plan_counts_no_peft_merge_and_expert_lora_in_compute_dtype_for_4bit_experts():
    from fastkit.plan import plan, read_config
    from fastkit.plan.moe_4bit import QWEN3_30B_A3B
    from fastkit.plan.terms import shape_of

    shape = shape_of(read_config(dict(QWEN3_30B_A3B)))
    kw = dict(gpu="l4", max_seq_length=1024, r=8)
    four, sixteen = plan(dict(QWEN3_30B_A3B), load_in_4bit=True, **kw), plan(dict(QWEN3_30B_A3B), **kw)
    def recompute(p):
        return next(v for k, v in p.components.items() if "one layer's recompute" in k)

    merged_layer = shape.expert_params_per_layer * 2  # PEFT's W + B·A of one MoE layer, bf16
    assert recompute(sixteen) - recompute(four) == merged_layer  # fastkit's 4-bit experts never build it
    on_experts = sum(8 * (i + o) * n for i, o, n in shape.lora_dims if n > 1)
    assert four.components["LoRA r=8 on experts (fastkit): parameters + gradients"] == on_experts * 2 * 2
    linear_only = plan(dict(QWEN3_30B_A3B), load_in_4bit=True, expert_lora=False, **kw)
    assert not any("on experts" in k for k in linear_only.components) and linear_only.total < four.total


def test_bench_4bit_rows_on_cpu_time_both_paths_and_count_storage():
    from benchmarks.moe import QUICK, SHAPES
    from benchmarks.moe_4bit import GROUPS, PER_EXPERT, REFERENCE, bench_4bit, table_4bit

    shape = dict(SHAPES["qwen3-30b-a3b"], **QUICK["qwen3-30b-a3b"])
    rows = bench_4bit("qwen3-30b-a3b", shape, 16, 2, torch.float32, torch.device("cpu"))
    assert [r["impl"] for r in rows] == [REFERENCE, PER_EXPERT, GROUPS]  # no Linear4bit on CPU
    ref, per, groups = rows
    assert all(len(r["fwd_bwd_ms"]) == 2 and min(r["fwd_bwd_ms"]) > 0 and r["peak_bytes"] > 0 for r in rows)
    assert 0.1 * ref["storage_bytes"] < per["storage_bytes"] == groups["storage_bytes"] <= 0.15 * ref["storage_bytes"]
    # 16-bit: grouped_mm runs on CPU (no read-back); 4-bit: the loop path's one read-back, whatever the grouping
    assert [(r["syncs_fwd"], r["syncs_bwd"]) for r in rows] == [(0, 0), (1, 0), (1, 0)]
    table = table_4bit(rows)
    assert GROUPS in table and "per-expert / hit groups" in table


def _mxfp4(w: torch.Tensor) -> torch.Tensor:
    """MXFP4 values of ``w``: e2m1 codes with one power-of-two (e8m0) scale per 32 values."""
    e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6.0])
    blocks = w.reshape(-1, 32)  # (n/32, 32)
    scale = torch.exp2(torch.floor(torch.log2(blocks.abs().amax(1, keepdim=True).clamp(min=1e-30))) - 2)
    x = (blocks / scale).clamp(-6, 6)
    q = e2m1[(x.abs().unsqueeze(-1) - e2m1).abs().argmin(-1)] * x.sign()  # (n/32, 32) nearest e2m1
    return (q * scale).view_as(w)


def test_mxfp4_to_nf4_requantization_error_is_measured():
    from fastkit.patches.moe.nf4 import requantize_error

    w = torch.randn(8, 512, 256, generator=torch.Generator().manual_seed(0)) * 0.02
    mx = _mxfp4(w)
    err = requantize_error(mx)
    print(f"MXFP4 -> NF4 requantization: rel RMS {err:.4f} vs the MXFP4 values; NF4 direct {requantize_error(w):.4f}")
    assert 0.02 < err < 0.12


def test_mxfp4_blocks_kept_dequantize_exactly_like_transformers_and_train_a_gpt_oss_twin():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from fastkit.patches.moe.nf4 import MXFP4Experts

    g = torch.Generator().manual_seed(0)
    original = twin("gpt_oss")
    model = copy.deepcopy(original)
    for _, m in experts_modules(model):
        for name in ("gate_up_proj", "down_proj"):
            e, d_in, d_out = getattr(m, name).shape  # GPT-OSS: (E, in, out); the checkpoint holds (E, out, in/32, 16)
            blocks = torch.randint(0, 256, (e, d_out, d_in // 32, 16), generator=g, dtype=torch.uint8)
            scales = torch.randint(118, 124, (e, d_out, d_in // 32), generator=g, dtype=torch.uint8)
            q = MXFP4Experts(blocks, scales, dtype=torch.float32)
            want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # (E, in, out)
            assert torch.equal(torch.stack([q.in_out(i) for i in range(e)]), want)  # exact, expert by expert
            del m._parameters[name]
            setattr(m, name, q)
    ref = copy.deepcopy(original)
    mods = dict(ref.named_modules())
    for name, q in model.named_modules():
        if isinstance(q, MXFP4Experts):
            parent, _, attr = name.rpartition(".")
            getattr(mods[parent], attr).data.copy_(torch.stack([q.in_out(i) for i in range(q.num_experts)]))
    model, ref = _with_lora(model), _with_lora(ref)
    got, want = forward_backward(model, _ids()), forward_backward(ref, _ids())
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
    assert_tensors_close(_lora_grads(got), _lora_grads(want), atol=1e-5, rtol=1e-4)
    stored, sixteen = expert_storage_bytes(model)
    print(f"MXFP4 kept: expert storage {stored / sixteen:.3f}x of 16-bit")
    assert stored <= 0.3 * sixteen
