"""4-bit experts on a CUDA GPU: one GPT-OSS-20B-shaped experts layer, peak memory vs the estimate, parity, timing."""

from __future__ import annotations

import copy
import statistics

import pytest
import torch

from fastkit.patches.moe import MoEConfig, attach_experts
from fastkit.patches.moe_4bit import NF4Experts, quantize_experts
from fastkit.patches.moe_4bit_plan import DEQUANT_BYTES_PER_WEIGHT, GPT_OSS_20B, bench_rows_4bit

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


def test_bench_rows_4bit_on_gpu_prints_the_side_by_side():
    experts, h, idx, w = _gpt_oss_layer(tokens=1024)
    rows = bench_rows_4bit(experts, h, idx, w.requires_grad_(True), reps=3)
    for r in rows:
        print(f"{r['impl']}: {statistics.median(r['fwd_bwd_ms']):.1f} ms fwd+bwd, peak {r['peak_mib']:.0f} MiB")
    assert rows[0]["impl"] == "fastkit 16-bit experts"
