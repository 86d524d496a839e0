"""fastkit.patches.moe.patch: sort-based experts equal transformers' eager and grouped_mm paths, ≤ 1 sync per layer."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch

from fastkit.errors import FastkitError
from fastkit.families.twins import twin
from fastkit.loader import FastModel
from fastkit.patches.moe.patch import EXPERTS_KEY, MoEConfig, MoEExpertsPatch, experts_modules, route
from fastkit.patching import active_patches, apply_patch, revert
from fastkit.registry import facts_for
from fastkit.syncs import SyncCounter
from tests.helpers import assert_grads_close, forward_backward

MOE_FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss"]
EXPERTS_FIELD = {"qwen3_moe": "num_experts", "gpt_oss": "num_local_experts"}


def _ids(t=24, b=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (b, t), generator=g)


def _with_impl(base, impl):
    m = copy.deepcopy(base)
    m.config._experts_implementation = impl
    return m


def _fastkit(base, mode="auto", validate="auto"):
    m = copy.deepcopy(base)
    ok, how = apply_patch(m, MoEExpertsPatch(facts_for(m.config.model_type), MoEConfig(mode=mode, validate=validate)))
    assert ok, how
    return m


def _assert_same(ref, got, atol=2e-5, rtol=1e-4):
    torch.testing.assert_close(got.logits, ref.logits, atol=atol, rtol=rtol)
    # fp32: a different (deterministic) summation order of the top-k slots and of the bias segments
    # moves results by a few ulps; 2e-5 absolute is ~100 ulps of these O(1) values.
    assert_grads_close(got.grads, ref.grads, atol=atol, rtol=rtol)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_logits_and_every_grad_equal_eager_and_grouped_mm(family):
    base = twin(family, num_hidden_layers=2).train()
    ids = _ids()
    eager = forward_backward(_with_impl(base, "eager"), ids)
    grouped = forward_backward(_with_impl(base, "grouped_mm"), ids)
    _assert_same(eager, grouped)  # transformers' two paths agree with each other
    for mode in ("grouped", "batched", "loop"):
        got = forward_backward(_fastkit(base, mode), ids)
        _assert_same(eager, got)
        _assert_same(grouped, got)


def test_route_one_sort_counts_equal_bincount_and_order_is_stable():
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(0, 16, (50, 4), generator=g)
    idx[:, 1] = (idx[:, 0] + 1) % 16  # distinct per token, like top-k
    r = route(idx, 16)
    flat = idx.reshape(-1)
    torch.testing.assert_close(r.counts, torch.bincount(flat, minlength=16))
    assert r.counts[5:].sum() + r.counts[:5].sum() == flat.numel()
    torch.testing.assert_close(r.ends.long(), torch.cumsum(r.counts, 0))
    assert torch.equal(r.sorted_ids, flat[r.perm])
    assert torch.all(r.sorted_ids[1:] >= r.sorted_ids[:-1])
    assert torch.equal(r.perm[r.inv_perm], torch.arange(flat.numel()))
    for e in range(16):  # tokens of one expert keep their order
        rows = r.perm[r.sorted_ids == e]
        assert torch.all(rows[1:] > rows[:-1])


def test_route_has_no_sync_and_counts_without_bincount():
    idx = torch.randint(0, 32, (64, 2))
    with SyncCounter() as sc:
        route(idx, 32)
    assert sc.total == 0, sc.by_op


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("mode", ["grouped", "loop"])
def test_experts_without_tokens_get_zero_grads(family, mode):
    model = _fastkit(twin(family, num_hidden_layers=1), mode)
    name, experts = experts_modules(model)[0]
    e = experts.num_experts
    h = torch.randn(10, model.config.hidden_size)
    idx = torch.stack([torch.arange(10) % 3, 3 + torch.arange(10) % 2], dim=1)  # experts 0..4 only
    w = torch.softmax(torch.randn(10, 2), -1)
    experts(h, idx, w).square().sum().backward()
    for pname, p in experts.named_parameters():
        assert p.grad is not None, f"{name}.{pname}"
        assert torch.all(p.grad[5:] == 0), pname
        assert p.grad[:5].abs().sum() > 0, pname
    assert e == 8


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("num_experts", [8, 32, 128])
def test_syncs_eager_is_O_experts_fastkit_at_most_one_per_layer(family, num_experts):
    layers = 2
    base = twin(family, num_hidden_layers=layers, **{EXPERTS_FIELD[family]: num_experts}).train()
    ids = _ids(t=32)

    def count(model, warm=False):
        if warm:
            model(ids)
        # profile=True: also counts host reads inside backend kernels (segment_reduce's safe mode had 2 per
        # call in the GPT-OSS bias backward), which the dispatch mode alone cannot see.
        with SyncCounter(profile=True) as fwd:
            out = model(ids, labels=ids)
        with SyncCounter(profile=True) as bwd:
            out.loss.backward()
        return fwd, bwd

    eager = _with_impl(base, "eager")
    seen = []
    for _, mod in experts_modules(eager):
        mod.register_forward_pre_hook(lambda mod, args: seen.append(args[1]))
    with torch.no_grad(), SyncCounter() as eager_f:
        eager(ids)
    hit = sum(int((torch.bincount(idx.reshape(-1), minlength=num_experts) > 0).sum()) for idx in seen)
    # eager: one nonzero per layer plus scalar reads for every expert that got tokens
    assert eager_f.total >= hit >= min(num_experts, 16) * layers // 2, (eager_f.by_op, hit)
    loop_f, loop_b = count(_fastkit(base, "loop"))
    assert loop_f.total == layers and dict(loop_f.by_op) == {"tolist": layers}, loop_f.by_op
    assert loop_b.total == 0, loop_b.by_op
    grouped_f, grouped_b = count(_fastkit(base, "grouped"), warm=True)  # first forward validates once
    assert grouped_f.total == 0 and grouped_b.total == 0, (grouped_f.by_op, grouped_b.by_op)


def test_transformers_fallback_reads_offsets_four_times_per_layer():
    """What a T4 gets from transformers (grouped_mm unavailable): 2 syncs fwd + 2 bwd per layer."""
    base = twin("qwen3_moe", num_hidden_layers=2).train()
    m = _with_impl(base, "grouped_mm")
    ids = _ids()
    with mock.patch("transformers.integrations.moe._can_use_grouped_mm", return_value=False):
        with SyncCounter() as f:
            out = m(ids, labels=ids)
        with SyncCounter() as b:
            out.loss.backward()
    assert f.by_op["tolist"] == 4 and b.by_op["tolist"] == 4


def test_first_forward_validation_on_grouped_path_then_none(monkeypatch):
    m = _fastkit(twin("qwen3_moe", num_hidden_layers=2), "grouped")
    ids = _ids()
    with SyncCounter() as first:
        m(ids)
    with SyncCounter() as second:
        m(ids)
    assert first.total == 2 and second.total == 0
    monkeypatch.setenv("FASTKIT_MOE_DEBUG", "1")
    with SyncCounter() as debug:
        m(ids)
    assert debug.total == 2
    off = _fastkit(twin("qwen3_moe", num_hidden_layers=2), "grouped", validate="off")
    with SyncCounter() as sc:
        off(ids)
    assert sc.total == 0


@pytest.mark.parametrize("mode", ["grouped", "loop"])
def test_router_ids_out_of_range_name_the_layer(mode):
    m = _fastkit(twin("qwen3_moe", num_hidden_layers=2), mode)
    name, experts = experts_modules(m)[1]
    h = torch.randn(6, m.config.hidden_size)
    w = torch.full((6, 2), 0.5)
    for bad in (8, -1):
        idx = torch.zeros(6, 2, dtype=torch.long)
        idx[3, 1] = bad
        with pytest.raises(FastkitError, match=rf"{name}: router produced expert ids"):
            experts(h, idx, w)


@pytest.mark.parametrize("mode", ["grouped", "loop"])
def test_nan_router_logits_name_the_layer(mode):
    m = _fastkit(twin("qwen3_moe", num_hidden_layers=2), mode)
    with torch.no_grad():
        m.model.layers[1].mlp.gate.weight[0, 0] = float("nan")
    with pytest.raises(FastkitError, match=r"model\.layers\.1\.mlp\.experts: \d+ routing weights are NaN"):
        m(_ids())


def test_top_k_larger_than_num_experts_is_refused_naming_the_layer():
    m = twin("qwen3_moe", num_hidden_layers=1)
    m.config.num_experts_per_tok = 9
    with pytest.raises(FastkitError, match=r"model\.layers\.0\.mlp\.experts: top_k=9 .* num_experts=8"):
        FastModel.patch(m)
    assert "moe" not in active_patches(m)
    m2 = _fastkit(twin("qwen3_moe", num_hidden_layers=1))
    name, experts = experts_modules(m2)[0]
    with pytest.raises(FastkitError, match=rf"{name}: top_k=9 is larger than num_experts=8"):
        experts(torch.randn(2, 64), torch.zeros(2, 9, dtype=torch.long), torch.ones(2, 9))


def test_patch_selects_key_on_every_config_and_reverts_exactly():
    m = twin("qwen3_moe", num_hidden_layers=2)
    before = m.config._experts_implementation
    FastModel.patch(m)
    assert "moe" in active_patches(m)
    assert m.config._experts_implementation == EXPERTS_KEY
    assert all(mod.config._experts_implementation == EXPERTS_KEY for _, mod in experts_modules(m))
    revert(m)
    assert m.config._experts_implementation == before
    assert not any(hasattr(mod, "_fastkit_moe") for _, mod in experts_modules(m))


def test_check_refuses_dense_models_and_expert_parallel():
    dense = twin("llama", num_hidden_layers=1)
    ok, why = apply_patch(dense, MoEExpertsPatch(facts_for("llama")))
    assert not ok and "no @use_experts_implementation" in why
    m = twin("mixtral", num_hidden_layers=1)
    experts_modules(m)[0][1]._is_expert_parallel = True
    ok, why = apply_patch(m, MoEExpertsPatch(facts_for("mixtral")))
    assert not ok and "expert parallelism" in why and m.config._experts_implementation == "grouped_mm"


def test_shared_experts_stay_outside_and_are_untouched():
    for family, attr in (("qwen2_moe", "shared_expert"), ("deepseek_v3", "shared_experts")):
        m = _fastkit(twin(family, num_hidden_layers=2))
        blocks = [mod for _, mod in m.named_modules() if hasattr(mod, attr) and hasattr(mod, "experts")]
        assert blocks, family
        for block in blocks:
            assert not any(n.startswith("experts") for n, _ in getattr(block, attr).named_modules())
            assert type(getattr(block, attr)).forward is type(getattr(block, attr)).__dict__["forward"]


def test_empty_batch_returns_zeros():
    m = _fastkit(twin("gpt_oss", num_hidden_layers=1))
    _, experts = experts_modules(m)[0]
    out = experts(torch.randn(0, 64), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    assert out.shape == (0, 64)


def test_bad_config_values_are_refused():
    with pytest.raises(FastkitError, match="mode"):
        MoEConfig(mode="fast")
    with pytest.raises(FastkitError, match="validate"):
        MoEConfig(validate="sometimes")


def test_moe_patch_under_nonreentrant_checkpointing_matches_plain():
    """The first-forward data check must not change what autograd saves: the checkpoint recompute
    skips it, and torch.utils.checkpoint refuses a recompute that saves a different tensor count."""
    from fastkit.families.twins import twin

    grads = []
    for checkpointing in (False, True):
        model = twin("qwen3_moe", num_hidden_layers=2).train()
        FastModel.patch(model, patches=["moe"])
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        x = torch.randint(3, 259, (1, 24))
        grads.append(forward_backward(model, x).grads)
    assert_grads_close(grads[1], grads[0], rtol=0, atol=1e-6)


def _frozen_layer_syncs(model, ids):
    with SyncCounter(profile=True) as fwd:
        model(ids)
    return fwd


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_auto_off_grouped_mm_picks_batched_for_small_frozen_layers_else_the_loop(family):
    """Note: [path choice]. Where grouped_mm cannot run (a T4), auto takes the 0-sync batched form for frozen
    experts under ``batched_bytes`` and the loop (1 read-back per layer) above it or when weights train."""
    import fastkit.patches.moe.patch as moe_patch

    base = twin(family, num_hidden_layers=2).eval().requires_grad_(False)
    ids = _ids(t=16)
    ref = _with_impl(base, "eager")(ids).logits
    with mock.patch.object(moe_patch, "grouped_mm_runs", return_value=False):
        small = _fastkit(base, validate="off")
        got = small(ids).logits
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
        assert _frozen_layer_syncs(small, ids).total == 0  # batched: no read-back at all
        tight = copy.deepcopy(base)
        apply_patch(tight, MoEExpertsPatch(None, MoEConfig(validate="off", batched_bytes=1024)))
        assert dict(_frozen_layer_syncs(tight, ids).by_op) == {"tolist": 2}  # the loop: one per layer
        torch.testing.assert_close(tight(ids).logits, ref, atol=2e-5, rtol=1e-4)
        training = _fastkit(base.requires_grad_(True), validate="off")  # trainable experts: never batched
        assert dict(_frozen_layer_syncs(training, ids).by_op) == {"tolist": 2}


def test_batched_bytes_is_checked():
    with pytest.raises(FastkitError, match="batched_bytes"):
        MoEConfig(batched_bytes=-1)
