"""PEFT's parameter LoRA run without its per-call parametrization (fastkit/patches/moe/peft_wrapper.py).

Each test compares against PEFT's own ``ParamWrapper`` forward on a second model built from the same seed (same
weights, same adapters). Tolerance: the fast path runs the same operations in the same order as PEFT's proxies
(``W + ΔW`` for the router, the same factors per expert group for fastkit's experts, ``baddbmm`` for experts
fastkit does not run), so fp32 results are equal to rounding: ``TIGHT`` 1e-6 (measured 0.0 on all four families).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo as dynamo
from peft import LoraConfig, get_peft_model

import fastkit
from fastkit import FastModel, _hf
from fastkit.families.twins import twin
from fastkit.patches.moe import peft_wrapper
from fastkit.patches.moe.patch import PEFT_FACTORS_ATTR
from fastkit.patches.packing.compiled import cu_tensor
from fastkit.patches.packing.patch import CU_KWARG

TIGHT = dict(rtol=1e-6, atol=1e-6)
LENGTHS = [5, 17, 9, 33]
MOE = ["qwen3_moe", "mixtral", "olmoe", "deepseek_v3"]
"""The families whose experts (and router) PEFT's ``"all-linear"`` adapts as parameters."""


def _model(model_type: str, patch: bool = True, install: bool = True, **lora):
    model = twin(model_type, num_hidden_layers=2).float()
    if patch:
        FastModel.patch(model)
    torch.manual_seed(0)
    config = dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False) | lora
    peft = get_peft_model(model, LoraConfig(**config)).train()
    if install:
        assert peft_wrapper.install(peft) > 0
    return peft


def _inputs():
    ids = torch.randint(3, 250, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]  # (1, T)
    return dict(input_ids=ids, position_ids=pos, use_cache=False, **{CU_KWARG: cu_tensor([LENGTHS], padded=True)})


def _step(model):
    logits = model(**_inputs()).logits
    logits.pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logits.detach(), grads


def _assert_same(got, want):
    torch.testing.assert_close(got[0], want[0], **TIGHT)
    assert set(got[1]) == set(want[1]) and any("lora" in n for n in want[1])
    for name, g in want[1].items():
        torch.testing.assert_close(got[1][name], g, **TIGHT, msg=lambda m, n=name: f"{n}: {m}")


def _parametrized_during_forward(model) -> bool:
    """Whether any adapted module carried a parametrization while it ran (PEFT's path does; fastkit's does not)."""
    seen = []
    modules = {id(m): m for _, w in _hf.peft_param_wrappers(model) for m in [w.get_base_layer()]}
    hooks = [m.register_forward_pre_hook(lambda mod, args: seen.append(bool(getattr(mod, "parametrizations", None))))
             for m in modules.values()]
    with torch.no_grad():
        model(**_inputs())
    for h in hooks:
        h.remove()
    assert seen
    return any(seen)


@pytest.mark.parametrize("model_type", MOE)
def test_logits_and_every_gradient_equal_pefts_own_forward(model_type):
    want = _step(_model(model_type, install=False))
    model = _model(model_type)
    assert not _parametrized_during_forward(model)
    _assert_same(_step(model), want)


def test_experts_fastkit_does_not_run_get_the_folded_weight():
    """The moe patch reverted: transformers' experts loop reads ``gate_up_proj`` itself, so the wrapper hands it
    ``W + s·lhs@rhs`` through functional_call, not factors it would ignore."""
    want = _model("qwen3_moe", install=False)
    model = _model("qwen3_moe")
    for m in (want, model):
        fastkit.revert(m, ["moe"])
    _assert_same(_step(model), _step(want))


def test_disabled_merged_and_two_adapters_run_as_peft_does():
    want, model = _model("qwen3_moe", install=False), _model("qwen3_moe")
    with want.disable_adapter(), model.disable_adapter(), torch.no_grad():  # no LoRA: nothing trains
        torch.testing.assert_close(model(**_inputs()).logits, want(**_inputs()).logits, **TIGHT)
    for m in (want, model):  # two active adapters: PEFT sums the deltas (no factor fold): the "weight" path
        torch.manual_seed(1)
        m.add_adapter("second", LoraConfig(r=2, lora_alpha=4, target_modules="all-linear", init_lora_weights=False))
        m.base_model.set_adapter(["default", "second"])
        m.train()
    assert peft_wrapper.install(model) == 0  # installed already: the forwards read the active adapters per call
    assert not _parametrized_during_forward(model)
    _assert_same(_step(model), _step(want))
    for m in (want, model):
        m.base_model.set_adapter("default")
        m.merge_adapter()
    with torch.no_grad():
        torch.testing.assert_close(model(**_inputs()).logits, want(**_inputs()).logits, **TIGHT)


def test_install_is_idempotent_and_revert_puts_pefts_forward_back(caplog):
    model = _model("qwen3_moe")
    outer = [w for _, w in _hf.peft_param_wrappers(model) if "forward" in vars(w)]
    assert len(outer) == 4 and all(w.parameter_name in ("down_proj", "weight") for w in outer)  # 2 layers x 2
    assert peft_wrapper.install(model) == 0
    fastkit.revert(model, [peft_wrapper.CHANGE])
    assert not any("forward" in vars(w) for _, w in _hf.peft_param_wrappers(model))
    assert _parametrized_during_forward(model)
    assert not any(hasattr(m, PEFT_FACTORS_ATTR) for m in model.modules())


def test_get_peft_model_and_compile_install_it():
    model = twin("qwen3_moe", num_hidden_layers=2).float()
    FastModel.patch(model)
    peft = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False)
    assert any("forward" in vars(w) for _, w in _hf.peft_param_wrappers(peft))
    assert not _parametrized_during_forward(peft)

    from fastkit.training.compile import compile_model

    raw = _model("qwen3_moe", install=False)
    assert _parametrized_during_forward(raw)
    compile_model(raw, "model", backend="aot_eager")
    assert any("forward" in vars(w) for _, w in _hf.peft_param_wrappers(raw))


def test_compiles_without_a_break_where_pefts_own_forward_breaks():
    """The reason for the file: PEFT's parametrization breaks dynamo's graph at every wrapper call (one sparse MoE
    block here: its router and its experts; the whole packed forward is tests/test_compile_families.py's)."""
    hidden = torch.randn(1, 12, twin("qwen3_moe").config.hidden_size)

    def breaks(model) -> int:
        block = model.get_base_model().model.layers[0].mlp
        dynamo.reset()
        return dynamo.explain(block)(hidden).graph_break_count

    assert breaks(_model("qwen3_moe", install=False)) > 0
    assert breaks(_model("qwen3_moe")) == 0
