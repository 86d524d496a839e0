"""MoE on a CUDA GPU: bf16 parity with transformers, zero syncs on the grouped path, bitsandbytes facts."""

from __future__ import annotations

import contextlib
import copy
from unittest import mock

import pytest
import torch

from fastkit.families.twins import twin
from fastkit.patches.moe import patch as moe
from fastkit.patches.moe.lora import add_expert_lora
from fastkit.patches.moe.patch import MoEConfig, MoEExpertsPatch, attach_experts, experts_modules, grouped_mm_runs
from fastkit.patching import apply_patch
from fastkit.syncs import SyncCounter

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


def _shared_routing(experts, config, tokens=256, device="cuda", dtype=torch.bfloat16, seed=0):
    """Inputs of one experts call, routing computed ONCE: ``hidden (T, H)``, ``top_k_index (T, K)``, weights."""
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(tokens, config.hidden_size, device=device, dtype=dtype, generator=g)
    router = torch.randn(tokens, experts.num_experts, device=device, generator=g)  # (T, E)
    top, index = router.topk(config.num_experts_per_tok, dim=-1)  # (T, K)
    return hidden, index, top.softmax(-1).to(dtype)


def _experts_step(experts, hidden, index, weights, grad):
    """Output and gradients (hidden, routing weights, every parameter) of one experts call, as fp32."""
    experts.zero_grad(set_to_none=True)
    h, w = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
    out = experts(h, index, w)  # (T, H)
    out.backward(grad)
    grads = {n: p.grad.float() for n, p in experts.named_parameters() if p.grad is not None}
    return out.float(), {"hidden": h.grad.float(), "weights": w.grad.float(), **grads}


def experts_parity(family, device="cuda", dtype=torch.bfloat16, tol=3e-2):
    """fastkit vs transformers' grouped_mm on ONE experts module with the SAME routing (no top-k near-tie flips:
    whole-model bf16 runs route layer 2 from layer 1's rounded output, and a flipped choice is not an error)."""
    model = twin(family, num_hidden_layers=2, dtype=dtype).to(device).train()
    _, experts = experts_modules(model)[0]
    hidden, index, weights = _shared_routing(experts, model.config, device=device, dtype=dtype)
    grad = torch.randn_like(hidden)
    ref = copy.deepcopy(experts)
    ref.config._experts_implementation = "grouped_mm"
    want = _experts_step(ref, hidden, index, weights, grad)
    for mode in ("auto", "loop"):
        mine = copy.deepcopy(experts)
        attach_experts(mine, MoEConfig(mode=mode))
        with mock.patch.object(moe, "_routed", wraps=moe._routed) as spy:
            got = _experts_step(mine, hidden, index, weights, grad)
        assert spy.call_count == 1  # fastkit's experts function ran (not transformers')
        # bf16 has 8 mantissa bits: one rounding of a different (fp32-accumulated) top-k sum moves an output
        # by <= 2^-8 relative; a few such roundings in one experts call stay well inside 3e-2 of the max.
        scale = want[0].abs().max()
        assert (got[0] - want[0]).abs().max() <= tol * scale, (family, mode)
        assert want[1].keys() == got[1].keys()
        for n, g in want[1].items():
            assert (got[1][n] - g).abs().max() <= tol * g.abs().max().clamp_min(1e-6), (family, mode, n)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_bf16_parity_with_grouped_mm_same_routing(family):
    experts_parity(family)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_bf16_whole_model_parity_with_grouped_mm(family):
    """Whole models (no GPT-OSS: its 32-expert router has near-ties that bf16 rounding flips, see above)."""
    base = _gpu_twin(family)
    ids = torch.randint(3, 300, (2, 64), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
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
    torch.cuda.synchronize()
    with SyncCounter(profile=True) as fwd, _sync_is_error():
        out = model(ids, labels=ids)
    with SyncCounter(profile=True) as bwd, _sync_is_error():
        out.loss.backward()
    assert fwd.total == 0 and bwd.total == 0, (fwd.by_op, bwd.by_op)


def test_gpt_oss_bias_backward_has_no_sync_on_cuda():
    """Expert biases: their gradient (a per-expert segment sum) must not read the lengths on the host."""
    model = _fastkit(_gpu_twin("gpt_oss", num_local_experts=32))
    ids = torch.randint(3, 300, (2, 64), device="cuda")
    model(ids)  # first forward validates once per layer
    out = model(ids, labels=ids)
    torch.cuda.synchronize()
    with SyncCounter(profile=True) as bwd, _sync_is_error():
        out.loss.backward()
    assert bwd.total == 0, bwd.by_op


@contextlib.contextmanager
def _sync_is_error():
    """Any synchronizing CUDA call raises (sees what neither the dispatch mode nor the profiler can)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_loop_path_one_sync_per_layer_on_cuda():
    model = _fastkit(_gpu_twin("gpt_oss", num_local_experts=32), mode="loop")
    add_expert_lora(model, r=8, lora_alpha=16)
    ids = torch.randint(3, 300, (2, 64), device="cuda")
    with SyncCounter() as fwd:
        out = model(ids, labels=ids)
    with SyncCounter() as bwd:
        out.loss.backward()
    assert fwd.total == 2 and bwd.total == 0, (fwd.by_op, bwd.by_op)


def test_bitsandbytes_4bit_keeps_experts_in_bf16_and_fastkit_runs_them(monkeypatch):
    """bnb quantizes nn.Linear only: 3-D expert tensors stay bf16; attention is 4-bit; fastkit still applies."""
    bnb = pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from fastkit.families.twins import twin_config

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
    ids = torch.randint(3, 300, (1, 32), device="cuda")
    routed = []
    real_routed = moe._routed

    def spy(*args, **kwargs):  # fastkit's experts function calls this once per layer per forward
        routed.append(args[0].name)
        return real_routed(*args, **kwargs)

    monkeypatch.setattr(moe, "_routed", spy)
    with torch.no_grad():
        before = q(ids).logits.float()
    assert len(routed) == 2, routed  # both layers ran fastkit's experts, not transformers'
    add_expert_lora(q, r=8, lora_alpha=16)
    factors = [p for _, m in experts_modules(q) for p in getattr(m, moe.LORA_ATTR).parameters()]
    assert factors
    with torch.no_grad():
        # B = 0 at init: an identity (to bf16 rounding: the LoRA operands may pick another GEMM path)
        assert (q(ids).logits.float() - before).abs().max() <= 2e-2
        for p in factors:  # B != 0: the adapter must now move the output by far more than rounding
            p.normal_(0.0, 0.2)
        after = q(ids).logits.float()
    assert (after - before).abs().max() > 0.1, "expert LoRA factors are not applied"
    routed.clear()
    q(ids, labels=ids).loss.backward()
    assert len(routed) == 2
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in factors)
