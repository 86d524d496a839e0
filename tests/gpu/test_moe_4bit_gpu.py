"""4-bit experts on a CUDA GPU: one GPT-OSS-20B-shaped experts layer, peak memory vs the estimate, parity, timing."""

from __future__ import annotations

import copy

import pytest
import torch

from fastkit.patches.moe.nf4 import NF4Experts, quantize_experts
from fastkit.patches.moe.patch import MoEConfig, attach_experts
from fastkit.plan.moe_4bit import DEQUANT_BYTES_PER_WEIGHT, GPT_OSS_20B

pytestmark = pytest.mark.gpu


def _gpt_oss_layer(tokens=2048):
    from transformers import CONFIG_MAPPING
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    kw = dict(GPT_OSS_20B)
    config = CONFIG_MAPPING[kw.pop("model_type")](**kw)
    torch.manual_seed(0)
    with torch.device("cuda"):
        experts = GptOssExperts(config).to(torch.bfloat16).requires_grad_(False)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.02)
    g = torch.Generator(device="cuda").manual_seed(1)
    h = torch.randn(tokens, config.hidden_size, device="cuda", dtype=torch.bfloat16, generator=g)
    logits = torch.randn(tokens, config.num_local_experts, device="cuda", generator=g)
    w, idx = torch.topk(torch.softmax(logits, -1), config.num_experts_per_tok, dim=-1)
    return experts, h.requires_grad_(True), idx, (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)


def test_gpt_oss_layer_4bit_peak_is_one_expert_and_matches_dequantized():
    experts, h, idx, w = _gpt_oss_layer()
    four = copy.deepcopy(experts)
    holder = torch.nn.Module()
    holder.experts = four
    quantize_experts(holder)
    with torch.no_grad():  # the reference: the same layer with the dequantized weights, in 16-bit
        for name in ("gate_up_proj", "down_proj"):
            getattr(experts, name).copy_(getattr(four, name).dequantize())
    attach_experts(experts, MoEConfig(mode="loop", validate="off"))
    attach_experts(four, MoEConfig(validate="off"))
    want = experts(h, idx, w)
    want.float().square().mean().backward()
    grad_want, h.grad = h.grad, None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got = four(h, idx, w)
    got.float().square().mean().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    one = max(m.shape[1:].numel() for m in four.modules() if isinstance(m, NF4Experts))
    s = idx.numel()
    acts = s * (2 * 2880 + 2880 + 2880) * 2 * 4  # rows, gate_up out, act, down out (bf16) and their grads, generous
    print(f"GPT-OSS-20B experts layer, 2048 tokens: peak extra {peak / 2**20:.0f} MiB, one expert dequantized "
          f"{one * DEQUANT_BYTES_PER_WEIGHT / 2**20:.0f} MiB (estimate), activations bound {acts / 2**20:.0f} MiB")
    assert peak <= acts + one * DEQUANT_BYTES_PER_WEIGHT
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)  # bf16: same weights, the loop vs the loop
    torch.testing.assert_close(h.grad, grad_want, atol=2e-2, rtol=2e-2)


def test_bench_4bit_on_gpu_runs_the_three_paths_side_by_side():
    from benchmarks.moe import SHAPES
    from benchmarks.moe_4bit import GROUPS, LOOP, PER_EXPERT, REFERENCE, bench_4bit, table_4bit

    rows = bench_4bit("gpt-oss-20b", SHAPES["gpt-oss-20b"], 1024, 3, torch.bfloat16, torch.device("cuda"))
    print(table_4bit(rows))
    assert [r["impl"] for r in rows] == [REFERENCE, PER_EXPERT, GROUPS, LOOP]
    ref, _, four, loop = rows
    assert four["storage_bytes"] <= 0.3 * ref["storage_bytes"] and loop["storage_bytes"] <= 0.3 * ref["storage_bytes"]
    assert all(len(r["fwd_bwd_ms"]) == 3 and min(r["fwd_bwd_ms"]) > 0 for r in rows)


def test_load_in_4bit_on_cuda_stores_experts_as_read(tmp_path):
    """qwen3_moe through bitsandbytes' device_map load: experts NF4 on the GPU, quantized as they arrive."""
    from fastkit import FastModel
    from fastkit.families.twins import twin
    from fastkit.patches.moe.patch import experts_modules
    from tests.helpers import forward_backward, save_twin

    path = save_twin(twin("qwen3_moe", num_hidden_layers=4).to(torch.bfloat16), tmp_path)
    torch.cuda.reset_peak_memory_stats()
    model, _ = FastModel.from_pretrained(path, load_in_4bit=True, max_seq_length=64)
    assert all(isinstance(m.gate_up_proj, NF4Experts) and m.gate_up_proj.device.type == "cuda"
               for _, m in experts_modules(model))
    peft = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False)
    step = forward_backward(peft, torch.randint(3, 300, (2, 32), device="cuda"))
    assert torch.isfinite(step.loss) and any("fastkit_lora" in n for n in step.grads)


def test_gpt_oss_mxfp4_checkpoint_on_cuda_keeps_exact_values(tmp_path):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from fastkit import FastModel
    from fastkit.patches.moe.nf4 import MXFP4Experts
    from fastkit.patches.moe.patch import experts_modules
    from tests.test_moe_4bit_load import _mxfp4_checkpoint

    path = _mxfp4_checkpoint(tmp_path)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map={"": 0},
                                               quantization_config=Mxfp4Config(dequantize=True))
    model, _ = FastModel.from_pretrained(str(path), load_in_4bit=True, max_seq_length=64, dtype=torch.bfloat16)
    mods = dict(ref.named_modules())
    for name, m in experts_modules(model):
        q = m.gate_up_proj
        assert isinstance(q, MXFP4Experts) and q.device.type == "cuda", name
        want = mods[name].gate_up_proj
        assert torch.equal(torch.stack([q.in_out(i) for i in range(q.num_experts)]), want.to(q.device))


def test_bitsandbytes_cuda_kernel_gives_the_torch_bits_and_the_per_expert_bits(monkeypatch):
    """On CUDA NF4 groups go through bitsandbytes' ``dequantize_4bit``: the same values as the pure-torch path,
    and a GPT-OSS-20B-shaped layer (8192 tokens) gives the per-expert path's output and grad_x bit for bit."""
    pytest.importorskip("bitsandbytes")
    from fastkit.patches.moe import nf4

    torch.manual_seed(0)
    q = NF4Experts(torch.randn(8, 128, 192, device="cuda") * 0.05, transposed=False).to(torch.bfloat16)
    groups = [(0,), (1, 2, 3), (0, 2, 7), tuple(range(8))]
    kernel = {ids: q.dequant(ids) for ids in groups}
    monkeypatch.setattr(nf4, "BNB_DEVICES", ())
    for ids in groups:
        assert torch.equal(q.dequant(ids), kernel[ids]), ids  # bnb CUDA kernel == torch (== bnb reference)
    monkeypatch.undo()
    experts, h, idx, w = _gpt_oss_layer(tokens=8192)
    holder = torch.nn.Module()
    holder.experts = experts
    quantize_experts(holder)
    per = copy.copy(experts)  # same NF4 modules, its own per-layer state
    attach_experts(experts, MoEConfig(validate="off"))
    attach_experts(per, MoEConfig(validate="off", dequant_group_bytes=0))
    results = []
    for m in (experts, per):
        out = m(h, idx, w)
        results.append((out.detach(), torch.autograd.grad(out.float().square().mean(), h)[0]))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
