"""The patch mechanism: idempotent, revertible to the very same objects, atomic on failure."""

import logging

import pytest
import torch

import fastkit
from fastkit import FastModel
from fastkit.patching import active_patches, apply_patch, revert
from fastkit.twins import twin


def _snapshot(model):
    """Every module's own attributes and the config's, by identity."""
    mods = {name: dict(vars(m)) for name, m in model.named_modules()}
    return mods, dict(vars(model.config))


def _same(a, b):
    mods_a, cfg_a = a
    mods_b, cfg_b = b
    assert mods_a.keys() == mods_b.keys()
    for name in mods_a:
        assert mods_a[name].keys() == mods_b[name].keys(), name
        for k in mods_a[name]:
            assert mods_a[name][k] is mods_b[name][k], (name, k)
    assert cfg_a.keys() == cfg_b.keys()
    for k in cfg_a:
        assert cfg_a[k] is cfg_b[k] or cfg_a[k] == cfg_b[k], k


class ToyPatch:
    """Swaps attention to eager, replaces the first layer's forward, and marks the config."""

    name = "toy"

    def __init__(self, fail_after_first=False, refuse=None):
        self.fail_after_first = fail_after_first
        self.refuse = refuse

    def check(self, model):
        return self.refuse

    def apply(self, model, swap):
        swap.setattr(model.config, "_attn_implementation", "eager")
        layer = model.model.layers[0]
        original = layer.forward
        swap.setattr(layer, "forward", lambda *a, **k: original(*a, **k))
        if self.fail_after_first:
            raise RuntimeError("boom")
        swap.setattr(model.config, "fastkit_marker", 1)


def test_apply_is_idempotent_and_revert_restores_same_objects():
    model = twin("llama")
    before = _snapshot(model)
    ok, how = apply_patch(model, ToyPatch())
    assert ok and how == "applied"
    patched = _snapshot(model)
    assert model.config._attn_implementation == "eager" and model.config.fastkit_marker == 1
    ok, how = apply_patch(model, ToyPatch())
    assert ok and how == "already active"
    assert active_patches(model) == ["toy"]
    _same(_snapshot(model), patched)  # applying twice changed nothing
    assert revert(model) == ["toy"]
    assert model.config._attn_implementation == "sdpa"
    assert not hasattr(model.config, "fastkit_marker")
    assert "forward" not in vars(model.model.layers[0])
    assert active_patches(model) == []
    _same(_snapshot(model), before)


def test_failed_apply_rolls_back(caplog):
    model = twin("llama")
    before = _snapshot(model)
    with caplog.at_level(logging.WARNING):
        ok, reason = apply_patch(model, ToyPatch(fail_after_first=True))
    assert not ok and "boom" in reason
    assert "model left unchanged" in caplog.text
    _same(_snapshot(model), before)
    assert active_patches(model) == []


def test_refused_patch_leaves_model_and_says_why(caplog):
    model = twin("llama")
    before = _snapshot(model)
    with caplog.at_level(logging.INFO, logger="fastkit"):
        ok, reason = apply_patch(model, ToyPatch(refuse="not for this model"))
    assert not ok and reason == "not for this model"
    assert "toy not applied: not for this model" in caplog.text
    _same(_snapshot(model), before)


def test_unknown_model_type_loads_unpatched_with_one_message(caplog):
    """bloom has no row (ALiBi: packed rows are wrong) and fails the self-check: unpatched, one message."""
    from transformers import BloomConfig, BloomForCausalLM

    config = BloomConfig(n_layer=1, hidden_size=32, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0)
    model = BloomForCausalLM(config).eval()
    before = _snapshot(model)
    x = torch.randint(0, 64, (1, 8))
    ref = model(x).logits
    with caplog.at_level(logging.WARNING, logger="fastkit"):
        FastModel.patch(model)
    assert caplog.text.count("not in fastkit's table") == 1
    assert fastkit.report(model).skipped["all"].startswith("self-check failed (packed)")
    assert active_patches(model) == []
    mods, cfg = before
    after_mods, after_cfg = _snapshot(model)
    after_mods[""].pop("_fastkit_report")  # the report is the only thing fastkit attaches
    _same((after_mods, after_cfg), before)
    assert torch.equal(model(x).logits, ref)


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe", "gpt_oss"])
def test_fastmodel_patch_auto_is_idempotent_and_fully_revertible(model_type):
    model = twin(model_type)
    x = torch.randint(3, 259, (1, 12))
    ref = model(x).logits
    before = _snapshot(model)
    FastModel.patch(model)
    first = _snapshot(model)
    active = active_patches(model)
    assert active, fastkit.report(model)
    FastModel.patch(model)
    assert active_patches(model) == active
    second = _snapshot(model)
    second[0][""]["_fastkit_report"] = first[0][""]["_fastkit_report"]  # a fresh report object each call
    _same(second, first)
    assert sorted(fastkit.revert(model)) == sorted(active)
    after = _snapshot(model)
    after[0][""].pop("_fastkit_report")
    _same(after, before)
    torch.testing.assert_close(model(x).logits, ref, rtol=0, atol=0)


def test_deepcopy_of_a_patched_model_reverts_on_its_own():
    import copy

    model = twin("llama")
    apply_patch(model, ToyPatch())
    clone = copy.deepcopy(model)
    assert revert(clone) == ["toy"]
    assert clone.config._attn_implementation == "sdpa" and not hasattr(clone.config, "fastkit_marker")
    assert "forward" not in vars(clone.model.layers[0])
    assert active_patches(model) == ["toy"] and model.config.fastkit_marker == 1  # the original keeps its patch
