"""MoE on a CUDA GPU: bf16 parity with transformers, zero syncs on the grouped path, bitsandbytes facts."""

from __future__ import annotations

import copy

import pytest
import torch

from fastkit.patches.moe import MoEConfig, MoEExpertsPatch, experts_modules, grouped_mm_runs
from fastkit.patches.moe_lora import add_expert_lora
from fastkit.patching import apply_patch
from fastkit.syncs import SyncCounter
from fastkit.twins import twin

pytestmark = pytest.mark.gpu


def _gpu_twin(family, **kw):
    return twin(family, num_hidden_layers=2, dtype=torch.bfloat16, **kw).cuda().train()


def _fastkit(model, mode="auto"):
    assert apply_patch(model, MoEExpertsPatch(None, MoEConfig(mode=mode)))[0]
    return model


def _run(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    out.loss.backward()
    return out.logits.float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_bf16_parity_with_grouped_mm(family):
    base = _gpu_twin(family)
    ids = torch.randint(3, 300, (2, 64), device="cuda")
    ref = copy.deepcopy(base)
    ref.config._experts_implementation = "grouped_mm"
    want = _run(ref, ids)
    for mode in ("auto", "loop"):
        got = _run(_fastkit(copy.deepcopy(base), mode), ids)
        # bf16 has 8 mantissa bits: one rounding of a different (fp32-accumulated) top-k sum moves a value
        # by <= 2^-8 relative; through 2 layers and the LM head that is ~1e-2 on O(1) logits.
        torch.testing.assert_close(got[0], want[0], atol=3e-2, rtol=3e-2)
        for n, g in want[1].items():
            scale = g.abs().max().clamp_min(1e-6)
            assert (got[1][n] - g).abs().max() / scale < 5e-2, n


def test_grouped_path_runs_and_has_no_sync_on_cuda():
    model = _fastkit(_gpu_twin("qwen3_moe", num_experts=128))
    _, experts = experts_modules(model)[0]
    assert grouped_mm_runs(experts.gate_up_proj.transpose(-2, -1))  # sm80+ bf16
    ids = torch.randint(3, 300, (2, 64), device="cuda")
    model(ids)  # first forward validates once per layer
    with SyncCounter() as fwd:
        out = model(ids, labels=ids)
    with SyncCounter() as bwd:
        out.loss.backward()
    assert fwd.total == 0 and bwd.total == 0, (fwd.by_op, bwd.by_op)


def test_loop_path_one_sync_per_layer_on_cuda():
    model = _fastkit(_gpu_twin("gpt_oss", num_local_experts=32), mode="loop")
    add_expert_lora(model, r=8, lora_alpha=16)
    ids = torch.randint(3, 300, (2, 64), device="cuda")
    with SyncCounter() as fwd:
        out = model(ids, labels=ids)
    with SyncCounter() as bwd:
        out.loss.backward()
    assert fwd.total == 2 and bwd.total == 0, (fwd.by_op, bwd.by_op)


def test_bitsandbytes_4bit_keeps_experts_in_bf16_and_fastkit_runs_them():
    """bnb quantizes nn.Linear only: 3-D expert tensors stay bf16; attention is 4-bit; fastkit still applies."""
    bnb = pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from fastkit.twins import twin_config

    cfg = twin_config("qwen3_moe", num_hidden_layers=2)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    path = "/tmp/fastkit_moe_bnb_twin"
    model.save_pretrained(path)
    q = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map={"": 0},
                                             quantization_config=BitsAndBytesConfig(load_in_4bit=True))
    assert isinstance(q.model.layers[0].self_attn.q_proj, bnb.nn.Linear4bit)
    _, experts = experts_modules(q)[0]
    assert experts.gate_up_proj.dtype == torch.bfloat16
    _fastkit(q)
    add_expert_lora(q, r=8, lora_alpha=16)
    ids = torch.randint(3, 300, (1, 32), device="cuda")
    q(ids, labels=ids).loss.backward()
