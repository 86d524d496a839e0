"""Stateful layers under torch.compile: ``fastkit::per_document_mixer`` (fastkit/patches/packing/compiled_state.py).

The per-family proof (0 graph breaks, compiled logits and every LoRA gradient equal eager, 20 layouts compile at most
twice) is tests/test_compile_families.py; here, what the operator itself promises: one key for the modules of one
structure (a layer compiled once serves every layer), none shared between two models, nothing left on a reverted
model, dropout refused, a module the operator cannot find named, and the traced path really taken (broken on
purpose, the breaks come back).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo as dynamo

from fastkit import FastModel, revert
from fastkit.errors import FastkitError
from fastkit.families.twins import twin
from fastkit.patches.packing import compiled_state
from fastkit.patches.packing.patch import CU_KWARG
from tests.test_compile_families import LENGTHS, _layout, _lora_model


def _mixers(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if compiled_state.KEY_ATTR in vars(m)]


def test_modules_of_one_structure_share_one_key_and_models_do_not():
    kinds = ["linear_attention"] * 3 + ["full_attention"]
    first = twin("qwen3_next", num_hidden_layers=4, layer_types=kinds)
    FastModel.patch(first)
    second = twin("qwen3_next", num_hidden_layers=4, layer_types=kinds)
    FastModel.patch(second)
    keys = [vars(m)[compiled_state.KEY_ATTR] for m in _mixers(first)]
    assert len(keys) >= 2 and len(set(keys)) == 1  # every linear-attention layer: one trace for all
    assert not set(keys) & {vars(m)[compiled_state.KEY_ATTR] for m in _mixers(second)}


def test_layers_of_one_key_run_with_their_own_settings():
    """Three linear-attention layers share a key (one trace), but PEFT's alpha_pattern gives layer 0 another LoRA
    scaling: each call runs the module whose tensors it was given, so compiled logits and gradients equal eager."""
    from tests.test_compile_families import TIGHT, assert_matches_over_layouts

    kinds = ["linear_attention"] * 3 + ["full_attention"]
    model = _lora_model("qwen3_next", layers=4, config={"layer_types": kinds},
                        alpha_pattern={"model.layers.0.linear_attn.in_proj_qkvz": 64})
    mixers = _mixers(model)
    assert len({vars(m)[compiled_state.KEY_ATTR] for m in mixers}) == 1
    scales = {m.in_proj_qkvz.scaling["default"] for m in mixers}
    assert len(scales) == 2, scales  # the pattern took: two scalings under one key
    dynamo.reset()
    assert_matches_over_layouts(torch.compile(model, backend="aot_eager"), model, seed=3, layouts=3, tol=TIGHT)


def test_revert_leaves_no_key_and_the_modules_own_forward():
    model = twin("lfm2")
    before = {name: set(vars(m)) for name, m in model.named_modules() if name}  # the root keeps fastkit's report
    FastModel.patch(model)
    assert _mixers(model)
    revert(model)
    assert not _mixers(model)
    assert {name: set(vars(m)) for name, m in model.named_modules() if name} == before


def test_dropout_inside_a_stateful_module_keeps_the_eager_regroup(monkeypatch):
    """The backward recomputes the module, which cannot replay a dropout mask: with LoRA dropout on the mixer's
    projections the traced call declines (the eager regroup runs, with its breaks); in eval (no dropout) the
    operator runs again, and the compiled logits equal eager."""
    model = _lora_model("lfm2", lora_dropout=0.1)
    ids, pos, cu = _layout(LENGTHS)
    assert _breaks(model, ids, pos, cu, monkeypatch) > 0
    model.eval()
    assert _breaks(model, ids, pos, cu, monkeypatch) == 0
    with torch.no_grad():
        want = model(input_ids=ids, position_ids=pos, use_cache=False, **{CU_KWARG: cu}).logits
        dynamo.reset()
        got = torch.compile(model, backend="aot_eager")(input_ids=ids, position_ids=pos, use_cache=False,
                                                        **{CU_KWARG: cu}).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _breaks(model, ids, pos, cu, monkeypatch) -> int:
    from fastkit.patches.packing import attention as packing_attention

    monkeypatch.setattr(packing_attention, "_LOGGED", set())  # log_once breaks only the first time: as in a new process
    dynamo.reset()
    explained = dynamo.explain(lambda i, p, c: model(input_ids=i, position_ids=p, use_cache=False,
                                                     **{CU_KWARG: c}).logits)(ids, pos, cu)
    return explained.graph_break_count


def test_a_key_without_a_live_module_is_named():
    with pytest.raises(FastkitError, match="no live module for 'Gone-0-0'"):
        torch.ops.fastkit.per_document_mixer(torch.zeros(1, 4, 8), torch.tensor([0, 4]), [], [], "Gone-0-0", "")


def test_without_the_operator_the_breaks_come_back(monkeypatch):
    """The traced path is what removes the breaks: with it declined (the eager regroup traced instead), dynamo breaks
    again (the per-module log, host lengths), so the 0 in tests/test_compile_families.py is this operator's."""
    model = _lora_model("lfm2")
    ids, pos, cu = _layout(LENGTHS)
    assert _breaks(model, ids, pos, cu, monkeypatch) == 0
    monkeypatch.setattr(compiled_state, "traced_call", lambda *args: None)
    assert _breaks(model, ids, pos, cu, monkeypatch) > 0
