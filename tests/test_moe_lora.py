"""LoRA on experts: per-group low-rank updates equal PEFT's target_parameters LoRA, without W + B·A."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora.layer import _LoraFactorsProxy

from fastkit.errors import FastkitError
from fastkit.families.twins import twin
from fastkit.patches.moe.lora import (
    FILE_NAME,
    add_expert_lora,
    expert_lora_enabled,
    expert_lora_modules,
    expert_lora_state_dict,
    factors_from_peft,
    merge_expert_lora,
    save_expert_lora,
)
from fastkit.patches.moe.patch import MoEConfig, MoEExpertsPatch, experts_modules
from fastkit.patches.moe.peft_format import load_expert_lora
from fastkit.patching import active_patches, apply_patch, revert
from fastkit.registry import MODEL_TABLE
from fastkit.syncs import SyncCounter
from tests.helpers import assert_grads_close, forward_backward

EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _ids(t=16, b=2):
    return torch.randint(3, 300, (b, t), generator=torch.Generator().manual_seed(1))


def _peft_config(experts=True):
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                      target_parameters=EXPERT_PARAMS if experts else None)


def _randomize_b(model):
    """B is zero at init, which would make every A gradient zero: give B values so the test means something."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def _fastkit(model, mode="auto"):
    ok, how = apply_patch(model, MoEExpertsPatch(None, MoEConfig(mode=mode)))
    assert ok, how
    return model


@pytest.mark.parametrize("family,mode", [("qwen3_moe", "grouped"), ("qwen3_moe", "loop"), ("gpt_oss", "grouped"),
                                         ("qwen2_moe", "loop")])
def test_peft_target_parameters_run_per_group_without_materializing(family, mode):
    base = twin(family, num_hidden_layers=2).train()
    ref = get_peft_model(copy.deepcopy(base), _peft_config())
    _randomize_b(ref)
    ours = get_peft_model(_fastkit(copy.deepcopy(base), mode), _peft_config())
    ours.load_state_dict(ref.state_dict())
    ids = _ids()
    with mock.patch.object(_LoraFactorsProxy, "forward", autospec=True,
                           side_effect=_LoraFactorsProxy.forward) as folded:
        ref_out = forward_backward(ref, ids)
        calls_ref = folded.call_count
        folded.reset_mock()
        got = forward_backward(ours, ids)
        calls_ours = folded.call_count
    # 2 layers x 2 parameters. torch's register_parametrization evaluates W + B·A once to check its shape
    # (PEFT re-registers every forward, the result is dropped at once); transformers' paths then build it again
    # and keep it for backward. fastkit reads W and the factors instead: only the registration check remains.
    assert calls_ref == 8 and calls_ours == 4
    torch.testing.assert_close(got.logits, ref_out.logits, atol=2e-5, rtol=1e-4)
    assert len(got.grads) == 16
    assert_grads_close(got.grads, ref_out.grads, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_add_expert_lora_gradients_equal_peft_target_parameters(family):
    base = twin(family, num_hidden_layers=2).train()
    ref = get_peft_model(copy.deepcopy(base), _peft_config())
    _randomize_b(ref)
    ours = get_peft_model(copy.deepcopy(base), _peft_config(experts=False))
    names = add_expert_lora(ours, r=4, lora_alpha=8)
    assert names == [n for n, _ in experts_modules(ours.get_base_model())]
    ours.load_state_dict({k: v for k, v in ref.state_dict().items() if "experts" not in k}, strict=False)
    assert factors_from_peft(ref, ours) == 8
    ids = _ids()
    (_, l_ref, g_ref), (_, l_got, g_got) = forward_backward(ref, ids), forward_backward(ours, ids)
    torch.testing.assert_close(l_got, l_ref, atol=2e-5, rtol=1e-4)
    ours_lora = dict(expert_lora_modules(ours))
    mapped = {}  # our gradients under PEFT's names
    for name, g in g_ref.items():
        if ".experts." not in name:
            mapped[name] = g_got[name]
            continue
        # base_model.model.<experts>[.base_layer].lora_{A,B}.default.weight -> our factor
        path = name.removeprefix("base_model.model.").split(".lora_")[0]
        proj = "gate_up_proj" if path.endswith(".base_layer") else "down_proj"  # PEFT nests sorted names
        lora = ours_lora[path.removesuffix(".base_layer")]
        e = lora.lora_A_down_proj.shape[0]
        if ".lora_A." in name:
            mine = getattr(lora, f"lora_A_{proj}").grad.reshape(g.shape)  # (E, r, in) -> (r*E, in)
        else:
            mine = getattr(lora, f"lora_B_{proj}").grad.permute(1, 2, 0).reshape(g.shape)  # (E,out,r) -> (out, r*E)
        assert e == 8
        mapped[name] = mine
    assert sum(".experts." in n for n in mapped) == 8
    assert_grads_close(mapped, g_ref, atol=2e-5, rtol=1e-4)


def test_zero_init_is_identity_trainable_after_peft_and_only_lora_moves():
    base = twin("qwen3_moe", num_hidden_layers=2)
    ids = _ids()
    with torch.no_grad():
        ref_logits = base(ids).logits
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    add_expert_lora(model, r=4, lora_alpha=8)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref_logits, atol=1e-6, rtol=1e-6)
    lora_params = [p for _, lora in expert_lora_modules(model) for p in lora.parameters()]
    assert lora_params and all(p.requires_grad for p in lora_params)
    experts = [m for _, m in experts_modules(model.get_base_model())]
    assert not any(p.requires_grad for m in experts for n, p in m.named_parameters() if "fastkit_lora" not in n)
    w_before = experts[0].gate_up_proj.detach().clone()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    assert torch.equal(experts[0].gate_up_proj, w_before)
    assert any(p.abs().sum() > 0 for n, p in expert_lora_state_dict(model).items() if "lora_B" in n)


def test_save_load_merge_and_revert(tmp_path):
    base = twin("gpt_oss", num_hidden_layers=1)
    model = copy.deepcopy(base)
    add_expert_lora(model, r=4, lora_alpha=16)
    _randomize_b(model)
    ids = _ids()
    with torch.no_grad():
        want = model(ids).logits
    path = save_expert_lora(model, str(tmp_path))
    assert path.endswith(FILE_NAME)
    other = copy.deepcopy(base)
    load_expert_lora(other, str(tmp_path))
    with torch.no_grad():
        torch.testing.assert_close(other(ids).logits, want, atol=1e-6, rtol=1e-6)
        expert_lora_enabled(other, False)
        torch.testing.assert_close(other(ids).logits, base(ids).logits, atol=1e-6, rtol=1e-6)
        expert_lora_enabled(other, True)
    merged = merge_expert_lora(other)
    assert merged and "moe_lora" not in active_patches(other) and not expert_lora_modules(other)
    with torch.no_grad():
        torch.testing.assert_close(other(ids).logits, want, atol=2e-5, rtol=1e-4)
    revert(model)
    assert not expert_lora_modules(model) and not active_patches(model)


def test_dropout_on_expert_lora_applies_in_training_only():
    model = twin("mixtral", num_hidden_layers=1)
    add_expert_lora(model, r=4, lora_alpha=8, lora_dropout=0.5)
    _randomize_b(model)
    ids = _ids()
    model.eval()
    with torch.no_grad():
        a, b = model(ids).logits, model(ids).logits
    assert torch.equal(a, b)
    model.train()
    with torch.no_grad():
        c = model(ids).logits
    assert not torch.allclose(a, c)


def test_expert_lora_keeps_one_sync_per_layer_on_the_loop_path():
    model = _fastkit(twin("qwen3_moe", num_hidden_layers=2, num_experts=32), mode="loop").train()
    add_expert_lora(model, r=4, lora_alpha=8)
    _randomize_b(model)
    ids = _ids()
    with SyncCounter(profile=True) as fwd:
        out = model(ids, labels=ids)
    with SyncCounter(profile=True) as bwd:
        out.loss.backward()
    assert fwd.total == 2 and bwd.total == 0, (fwd.by_op, bwd.by_op)
    lora = expert_lora_modules(model)[0][1]
    assert lora.lora_A_gate_up_proj.grad is not None


def test_bad_arguments_and_models_are_refused(tmp_path):
    with pytest.raises(FastkitError, match="rank"):
        add_expert_lora(twin("qwen3_moe", num_hidden_layers=1), r=0)
    with pytest.raises(FastkitError, match="no @use_experts_implementation"):
        add_expert_lora(twin("llama", num_hidden_layers=1), r=4)
    with pytest.raises(FastkitError, match=FILE_NAME):
        load_expert_lora(twin("qwen3_moe", num_hidden_layers=1), str(tmp_path))


def test_peft_adapter_and_fastkit_factors_both_apply():
    """PEFT's all-linear already adapts qwen3_moe experts; fastkit runs it per group and adds its own on top."""
    from fastkit.patches.moe.lora import peft_adapts_experts

    base = _fastkit(twin("qwen3_moe", num_hidden_layers=1))
    peft_only = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    assert peft_adapts_experts(peft_only)
    _randomize_b(peft_only)
    both = copy.deepcopy(peft_only)
    add_expert_lora(both, r=4, lora_alpha=8)
    _randomize_b(both)
    both.load_state_dict(peft_only.state_dict(), strict=False)  # same PEFT factors, fastkit's B stays random
    ids = _ids()
    with torch.no_grad():
        want = peft_only(ids).logits
        assert not torch.allclose(both(ids).logits, want, atol=1e-4)
        expert_lora_enabled(both, False)
        torch.testing.assert_close(both(ids).logits, want, atol=1e-6, rtol=1e-6)
    gpt = get_peft_model(twin("gpt_oss", num_hidden_layers=1),
                         LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    assert not peft_adapts_experts(gpt)


def test_expert_lora_refuses_a_family_without_an_moe_row():
    """hunyuan_v1_moe has experts modules but no row: the census found fastkit's routing differs there, so
    add_expert_lora must not switch it on (it used to, with no check); the model is left as it was."""
    from fastkit.families.twins import twin
    from fastkit.patching import active_patches

    model = twin("hunyuan_v1_moe")
    assert experts_modules(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(FastkitError, match="no MoE row in fastkit's table"):
        add_expert_lora(model, r=4)
    assert active_patches(model) == []
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


MOE_FAMILIES = sorted(t for t, f in MODEL_TABLE.items() if f.moe)


@pytest.mark.parametrize("model_type", MOE_FAMILIES)
def test_default_lora_trains_on_every_moe_family(model_type, caplog):
    """get_peft_model's default ("all-linear") on each MoE family's twin: one forward + backward runs and every LoRA
    factor gets a gradient. Llama-4's and Phi-3.5-MoE's routers subclass nn.Linear and return (scores, indices):
    PEFT's all-linear wrapped them and the first forward failed ("'tuple' object has no attribute 'dtype'"); they are
    left out now, and never adapted. Jamba's Mamba mixer reads ``dt_proj.weight`` without calling the module, so a
    LoRA there had no gradient: its row's targets leave dt_proj out."""
    import logging

    from fastkit import FastModel
    from fastkit.training.lora import _router_linears

    caplog.set_level(logging.WARNING, logger="fastkit")  # quiet loads; pytest puts the level back after the test
    model, _ = FastModel.from_pretrained(model_type, twin=True, max_seq_length=64)
    routers = _router_linears(model)
    assert bool(routers) == (model_type in ("llama4_text", "phimoe")), routers
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False)
    ids = torch.randint(0, 100, (1, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    factors = {n: p for n, p in model.named_parameters() if "lora_" in n}
    dead = [n for n, p in factors.items() if p.grad is None]  # jamba's dt_proj, before its row left it out
    assert factors and not dead, f"{model_type}: LoRA factors that never train: {dead[:4]}"
    assert not any(n.split(".lora_")[0].endswith(r) for n in factors for r in routers), "a router got LoRA factors"
