"""The patch mechanism: idempotent, revertible to the very same objects, atomic on failure."""

import logging

import pytest
import torch

import fastkit
from fastkit import FastModel
from fastkit.families.twins import twin
from fastkit.patching import active_patches, apply_patch, revert


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
    after_mods[""].pop("_fastkit_report")  # the report, and the record of the packed-batch guard
    after_mods[""].pop("_fastkit_patches")  # (its hook: test_revert_removes_the_packed_batch_guard_hook)
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


# -- revert compares CONTENTS: hook functions, parameter objects and data, config values, experts key ----------
def _contents(model):
    """What revert must restore, by content: each module's own attributes (by identity), the functions in every
    hook dict, each parameter / buffer (object and values), the config's values and the experts implementation."""
    from fastkit import _hf, _torch

    mods = {}
    for name, m in model.named_modules():
        dicts = _torch.module_dicts(m)
        own = {k: v for k, v in dicts["__dict__"].items() if not (k in dicts and k != "__dict__")}
        hooks = {k: list(d.values()) for k, d in dicts.items() if "hooks" in k}
        tensors = {k: (t, None if t is None else t.detach().clone())
                   for k, t in [*dicts["_parameters"].items(), *dicts["_buffers"].items()]}
        grads = {k: v.requires_grad for k, v in dicts["_parameters"].items() if v is not None}
        mods[name] = (own, hooks, tensors, grads)
    config = {k: v for k, v in vars(model.config).items() if not k.startswith("_fastkit")}
    return mods, config, _hf.experts_implementation(model.config)


def _assert_restored(after, before):
    mods_a, cfg_a, experts_a = after
    mods_b, cfg_b, experts_b = before
    assert mods_a.keys() == mods_b.keys()
    for name in mods_b:
        own_a, hooks_a, tensors_a, grads_a = mods_a[name]
        own_b, hooks_b, tensors_b, grads_b = mods_b[name]
        own_a = {k: v for k, v in own_a.items() if k != "_fastkit_report"}  # the load report stays (by design)
        assert own_a.keys() == own_b.keys(), (name, set(own_a) ^ set(own_b))
        assert all(own_a[k] is own_b[k] for k in own_b), name
        assert hooks_a.keys() == hooks_b.keys() and all(
            len(hooks_a[k]) == len(hooks_b[k]) and all(x is y for x, y in zip(hooks_a[k], hooks_b[k]))
            for k in hooks_b), (name, {k: hooks_a[k] for k in hooks_a if hooks_a[k] != hooks_b.get(k)})
        assert tensors_a.keys() == tensors_b.keys(), (name, set(tensors_a) ^ set(tensors_b))
        for k, (t, data) in tensors_b.items():
            assert tensors_a[k][0] is t and (data is None or torch.equal(tensors_a[k][1], data)), (name, k)
        assert grads_a == grads_b, name
    assert cfg_a.keys() == cfg_b.keys() and all(cfg_a[k] is cfg_b[k] or cfg_a[k] == cfg_b[k] for k in cfg_b), \
        {k: (cfg_a.get(k), cfg_b[k]) for k in cfg_b if cfg_a.get(k) != cfg_b[k]}
    assert experts_a == experts_b


def test_revert_removes_the_packed_batch_guard_hook():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).eval()
    before = _contents(model)
    FastModel.patch(model, patches=None)  # no patch, but the packed-batch guard's forward pre-hook
    assert any(_contents(model)[0][k][1]["_forward_pre_hooks"] for k in before[0]), "the guard was not installed"
    fastkit.revert(model)
    _assert_restored(_contents(model), before)


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_revert_undoes_patches_guard_checkpointing_and_use_cache(model_type):
    from fastkit.loader import enable_checkpointing
    from fastkit.patching import change

    model = twin(model_type)
    model.config.use_cache = True
    before = _contents(model)
    FastModel.patch(model, patches=[])  # no patch: the guard goes on the decoder
    FastModel.patch(model)
    enable_checkpointing(model, True)
    change(model, "use_cache", lambda swap: swap.setattr(model.config, "use_cache", False))  # as make_trainer does
    assert model.config.use_cache is False and any(getattr(m, "gradient_checkpointing", False)
                                                   for m in model.modules())
    fastkit.revert(model)
    assert model.config.use_cache is True
    _assert_restored(_contents(model), before)


def test_detach_experts_restores_the_original_implementation():
    from fastkit import _hf
    from fastkit.patches.moe import MoEConfig, attach_experts, detach_experts, experts_modules

    model = twin("qwen3_moe")
    _hf.set_experts_implementation(model.config, "grouped_mm")
    _, experts = experts_modules(model)[0]
    attach_experts(experts, MoEConfig(validate="off"))
    attach_experts(experts, MoEConfig(validate="off"))  # twice: the original is still the one before the first
    assert _hf.experts_implementation(experts.config) == "fastkit"
    detach_experts(experts)
    assert _hf.experts_implementation(experts.config) == "grouped_mm"
    assert "_fastkit_moe" not in vars(experts) and "_fastkit_patches" not in vars(experts)


def test_revert_undoes_attach_experts_like_any_change():
    """attach_experts is a patching.change on the module: fastkit.revert restores the config's own value and
    drops the module's state, compared by content like every patch."""
    from fastkit import _hf, revert
    from fastkit.patches.moe import MoEConfig, attach_experts, experts_modules

    model = twin("qwen3_moe")
    _, experts = experts_modules(model)[0]
    before = _contents(experts)
    own = dict(vars(experts.config))
    attach_experts(experts, MoEConfig(validate="off"), name="one")
    assert _hf.experts_implementation(experts.config) == "fastkit" and vars(experts)["_fastkit_moe"].name == "one"
    revert(experts)
    assert dict(vars(experts.config)) == own
    _assert_restored(_contents(experts), before)


def test_revert_dequantizes_4bit_experts_back_to_parameters():
    from fastkit.patches.moe import experts_modules, quantize_experts
    from fastkit.patches.moe.nf4 import NF4Experts
    from fastkit.patching import change

    model = twin("qwen3_moe")
    before = {f"{n}.{k}": (p.shape, p.dtype, p.requires_grad, p.detach().clone())
              for n, m in experts_modules(model) for k, p in m.named_parameters(recurse=False)}
    change(model, "4bit_experts", lambda swap: quantize_experts(model, swap=swap))
    stored = {f"{n}.{k}": q.dequantize() for n, m in experts_modules(model) for k, q in m.named_children()
              if isinstance(q, NF4Experts)}
    assert stored
    fastkit.revert(model)
    assert not any(isinstance(m, NF4Experts) for m in model.modules())
    after = {f"{n}.{k}": p for n, m in experts_modules(model) for k, p in m.named_parameters(recurse=False)}
    assert after.keys() == before.keys()
    for k, (shape, dtype, grad, data) in before.items():
        p = after[k]
        assert isinstance(p, torch.nn.Parameter) and (p.shape, p.dtype, p.requires_grad) == (shape, dtype, grad), k
        # the 16-bit original is gone by design (4-bit saves its memory): revert gives the NF4-rounded values
        assert torch.equal(p.detach(), stored[k]) if k in stored else torch.equal(p.detach(), data), k


class _WrapForward:
    """Wraps one layer's forward (as packing and the host embedding both wrap the decoder's)."""

    def __init__(self, name, layer=0):
        self.name, self.layer = name, layer

    def check(self, model):
        return None

    def apply(self, model, swap):
        layer = model.model.layers[self.layer]
        inner = layer.forward
        swap.setattr(layer, "forward", lambda *a, **k: inner(*a, **k))


def test_reverting_one_patch_also_reverts_what_was_stacked_on_it(caplog):
    """Undoing only the older of two wrappers of one attribute used to drop the newer wrapper, and undoing
    the newer one afterwards brought the older one back. Now the newer one goes with it, and it is said."""
    model = twin("llama", num_hidden_layers=2)
    before = _snapshot(model)
    apply_patch(model, _WrapForward("inner"))
    apply_patch(model, _WrapForward("other_layer", layer=1))  # touches nothing "inner" touched
    apply_patch(model, _WrapForward("outer"))
    with caplog.at_level(logging.INFO, logger="fastkit"):
        assert revert(model, ["inner"]) == ["inner", "outer"]
    assert "reverting inner also reverts outer" in caplog.text
    assert active_patches(model) == ["other_layer"]
    assert "forward" not in vars(model.model.layers[0])
    assert revert(model) == ["other_layer"]
    _same(_snapshot(model), before)
    apply_patch(model, _WrapForward("inner"))
    apply_patch(model, _WrapForward("outer"))
    assert revert(model, ["outer"]) == ["outer"]  # the newer one alone: the older one stays
    assert active_patches(model) == ["inner"] and "forward" in vars(model.model.layers[0])
