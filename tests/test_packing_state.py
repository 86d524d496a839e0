"""Packing through stateful layers (linear attention, causal conv, SSM): each packed document restarts its state.

For every hybrid family: a random fp32 twin, one packed row of documents vs each document run alone on
the same weights (unpatched): logits and every gradient equal; plain transformers shown wrong on the same
input; no host syncs added; revert restores the model. ``test_without_the_reset_packing_leaks`` removes
the per-document regrouping (each row becomes one "document") and shows every family going wrong, so the
reset — not the attention patch — is what makes them exact.

``python -m tests.test_packing_state`` prints the table of docs/packing.md (measured, not asserted).
"""

from __future__ import annotations

import copy

import pytest
import torch

from fastkit.errors import FastkitError
from fastkit.families.twins import HYBRID_FAMILIES, twin
from fastkit.loader import FastModel
from fastkit.patches.packing import LENGTHS_KWARG, PackedAttentionPatch
from fastkit.patches.packing import state as packing_state
from fastkit.patching import active_patches, apply_patch, revert
from fastkit.registry import ModelFacts, facts_for
from fastkit.syncs import SyncCounter
from tests.helpers import assert_grads_close, assert_tensors_close

# A document longer than the gated-delta chunk (64) and the Mamba-2 twin chunk (8), a 1-token document.
LENGTHS = [70, 9, 1, 23]
TIGHT = dict(rtol=1e-5, atol=1e-5)  # fp32 CPU: per-document vs regrouped rows sum in other orders (~2e-7 seen)
# Gradients: max error <= 1e-4 of each tensor's largest entry. The decay parameters of gated DeltaNet
# (A_log, dt_bias) sum ~T terms of both signs through exp(cumsum): measured 7.6e-5 relative in an fp32
# twin and 1.4e-7 in an fp64 twin (bounded there by the delta-rule kernel's own fp32 cast), so the fp32
# gap is rounding, not state; a real leak moves gradients by 1e-2 and more. Mamba families: ~5e-7.
GRADS = dict(rtol=1e-4, atol=1e-7, per="tensor")


def _pair(model_type: str, **overrides):
    """(unpatched, patched) twins with identical weights; only the packing patch is applied."""
    base = twin(model_type, **overrides)
    patched = copy.deepcopy(base)
    FastModel.patch(patched, patches=["packing"])
    assert active_patches(patched) == ["packing"]
    return base, patched


def _batch(lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 300, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]  # (1, T)
    weights = torch.randn(1, sum(lengths), 320, generator=g)  # (1, T, V): a fixed linear loss on the logits
    return ids, pos, weights


def _per_doc(model, ids, lengths):
    return torch.cat([model(input_ids=c, use_cache=False).logits for c in ids.split(lengths, dim=1)], dim=1)


def _step(model, run, weights):
    """Logits and every gradient of ``sum(logits * weights)`` (the same functional packed and per document)."""
    model.zero_grad(set_to_none=True)
    logits = run()
    (logits * weights).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def measure(model_type: str, lengths=LENGTHS) -> dict:
    """Packed vs per-document on one twin: plain and fastkit logits error, gradient error, syncs."""
    base, patched = _pair(model_type)
    ids, pos, w = _batch(lengths)
    want, want_g = _step(base, lambda: _per_doc(base, ids, lengths), w)
    with torch.no_grad():
        plain = base(input_ids=ids, position_ids=pos, use_cache=False).logits
    with SyncCounter() as syncs:
        got, got_g = _step(patched, lambda: patched(input_ids=ids, position_ids=pos, use_cache=False,
                                                    **{LENGTHS_KWARG: [lengths]}).logits, w)
    with SyncCounter() as unpacked_syncs:  # the same model on one unpacked row: what any step costs
        _step(patched, lambda: patched(input_ids=ids, use_cache=False).logits, w)
    grad_err = max((got_g[n] - g).abs().max().item() / max(g.abs().max().item(), 1e-30)
                   for n, g in want_g.items())  # worst tensor, relative to its largest entry
    return dict(model_type=model_type, plain=(plain - want).abs().max().item(),
                fastkit=(got - want).abs().max().item(), grad=grad_err, syncs=syncs.total,
                unpacked_syncs=unpacked_syncs.total, got=got, want=want, got_g=got_g, want_g=want_g,
                base=base, patched=patched, batch=(ids, pos, w))


@pytest.mark.parametrize("model_type", HYBRID_FAMILIES)
def test_packed_equals_each_document_alone(model_type):
    m = measure(model_type)
    torch.testing.assert_close(m["got"], m["want"], **TIGHT)
    assert_grads_close(m["got_g"], m["want_g"], **GRADS)
    assert m["plain"] > 1e-4, f"plain transformers was expected to leak state here (max |dlogits| {m['plain']:.3g})"
    assert m["syncs"] == 0  # the packed step (fwd + bwd) has no host sync at all (an unpacked one has 1: the mask)
    assert facts_for(m["patched"].config.model_type).stateful  # the row names the layers that reset


@pytest.mark.parametrize("model_type", HYBRID_FAMILIES)
def test_without_the_reset_packing_leaks(model_type, monkeypatch):
    """The break: every row regrouped as one document (no state reset) must go red for every family."""
    base, patched = _pair(model_type)
    ids, pos, _ = _batch()
    monkeypatch.setattr(packing_state, "document_groups",
                        lambda lengths, **kw: [[(r, 0, sum(row)) for r, row in enumerate(lengths)]])
    with torch.no_grad():
        want = _per_doc(base, ids, LENGTHS)
        got = patched(input_ids=ids, position_ids=pos, use_cache=False, **{LENGTHS_KWARG: [LENGTHS]}).logits
    assert (got - want).abs().max().item() > 1e-4


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "jamba", "lfm2"])
def test_revert_restores_the_model_and_unpacked_batches_are_untouched(model_type):
    base, patched = _pair(model_type)
    ids, pos, _ = _batch()
    mask = torch.ones_like(ids)
    mask[:, :5] = 0  # a left-padded, unpacked batch: the original forwards, bit for bit
    with torch.no_grad():
        torch.testing.assert_close(patched(input_ids=ids, attention_mask=mask, use_cache=False).logits,
                                   base(input_ids=ids, attention_mask=mask, use_cache=False).logits, rtol=0, atol=0)
    wrapped = [m for m in patched.modules() if "forward" in vars(m)]
    assert any(getattr(m.forward, "_fastkit_state_reset", False) for m in wrapped)
    revert(patched)
    assert not [m for m in patched.modules() if "forward" in vars(m)]
    with torch.no_grad():
        torch.testing.assert_close(patched(input_ids=ids, position_ids=pos, use_cache=False).logits,
                                   base(input_ids=ids, position_ids=pos, use_cache=False).logits, rtol=0, atol=0)


def test_gradient_checkpointing_recompute_resets_too():
    """Non-reentrant checkpointing recomputes each layer in backward: the reset must hold there as well."""
    base, patched = _pair("qwen3_5_text", num_hidden_layers=4,
                          layer_types=["linear_attention"] * 3 + ["full_attention"])
    for model in (base, patched):
        model.train()
    patched.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids, pos, w = _batch()
    want, want_g = _step(base, lambda: _per_doc(base, ids, LENGTHS), w)
    with SyncCounter() as syncs:
        got, got_g = _step(patched, lambda: patched(input_ids=ids, position_ids=pos, use_cache=False,
                                                    **{LENGTHS_KWARG: [LENGTHS]}).logits, w)
    torch.testing.assert_close(got, want, **TIGHT)
    assert_grads_close(got_g, want_g, **GRADS)
    assert syncs.total == 0


def test_two_rows_and_lengths_from_positions():
    """Two packed rows (documents regrouped across rows) and lengths derived from position_ids (1 sync, counted)."""
    base, patched = _pair("falcon_h1")
    rows = [[30, 2, 16], [5, 40, 3]]
    ids = torch.randint(3, 300, (2, 48), generator=torch.Generator().manual_seed(1))
    pos = torch.stack([torch.cat([torch.arange(n) for n in r]) for r in rows])  # (2, T)
    with torch.no_grad():
        want = torch.cat([_per_doc(base, ids[i:i + 1], r) for i, r in enumerate(rows)])
        got = patched(input_ids=ids, position_ids=pos, use_cache=False, **{LENGTHS_KWARG: rows}).logits
        got_pos = patched(input_ids=ids, position_ids=pos, use_cache=False).logits
    torch.testing.assert_close(got, want, **TIGHT)
    torch.testing.assert_close(got_pos, want, **TIGHT)


def test_document_groups_bound_the_padding():
    groups = packing_state.document_groups([[500, 3, 4, 5, 6], [7, 480, 1]])
    assert sorted(d for g in groups for d in g) == sorted(
        [(0, 0, 500), (0, 500, 3), (0, 503, 4), (0, 507, 5), (0, 512, 6), (1, 0, 7), (1, 7, 480), (1, 487, 1)])
    for g in groups:
        assert len(g) * g[0][2] <= packing_state.MAX_PAD_WASTE * sum(d[2] for d in g) or len(g) == 1
    assert [d[2] for d in groups[0]][:2] == [500, 480]  # the two long documents share one row set


def test_refused_when_the_row_does_not_name_the_stateful_layers(monkeypatch):
    """A hybrid model under a row without ``stateful`` is refused (left as it was), never silently packed."""
    for model_type in ("qwen3_5_text", "lfm2", "jamba"):
        model = twin(model_type)
        ok, reason = apply_patch(model, PackedAttentionPatch(ModelFacts(model_type)))
        assert not ok and "causal convolution (Conv1d)" in reason, reason
        assert not active_patches(model) and not [m for m in model.modules() if "forward" in vars(m)]
    # a stateful model class without convolutions (RWKV-like) is refused by its class flag
    monkeypatch.setattr(packing_state._hf, "is_stateful_model", lambda model: True)
    ok, reason = apply_patch(twin("llama"), PackedAttentionPatch(ModelFacts("llama")))
    assert not ok and "carries recurrent state" in reason, reason


def test_a_cache_in_a_packed_batch_is_an_error():
    _, patched = _pair("lfm2")
    mixer = next(m for m in patched.modules() if type(m).__name__ == "Lfm2ShortConv")
    meta = packing_state.PackedBatch(1, 4, [[2, 2]], 2)
    with pytest.raises(FastkitError, match="cache"):
        mixer(torch.zeros(1, 4, 64), cache=object(), fastkit_packed=meta)


def _sft_losses(packed: bool, docs: list[list[int]], steps: int) -> tuple[list[float], dict]:
    """AdamW steps of qwen3_5 cycling over ``docs`` (3 per step): fastkit on TRL's padding-free rows, or plain
    transformers on TRL's padded batches (the correct alternative a user has today)."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from fastkit.patches.packing import wrap_collator

    model = twin("qwen3_5_text", num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"])
    model.train()
    if packed:
        FastModel.patch(model, patches=["packing"])
        collate = wrap_collator(DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True))
    else:
        collate = DataCollatorForLanguageModeling(pad_token_id=0)
    # eps=1e-4, not 1e-8: Adam's m/sqrt(v) turns an entry whose gradient is ~0 into a step of ~lr whatever the
    # sign of its rounding noise, so with eps=1e-8 two exact runs differ by a whole step on such entries (seen:
    # 1.8e-4 on in_proj_a after 12 steps on one machine, 5.5e-5 on another). eps=1e-4 bounds that amplification.
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-4)
    losses = []
    for step in range(steps):
        batch = collate([{"input_ids": d} for d in docs[3 * (step % 3):3 * (step % 3) + 3]])  # 9 docs
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_sft_losses_packed_fastkit_match_unpacked_plain_transformers():
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(3, 300, (int(n),), generator=g).tolist() for n in torch.randint(8, 70, (9,), generator=g)]
    want, want_w = _sft_losses(False, docs, steps=12)
    got, got_w = _sft_losses(True, docs, steps=12)
    print("losses per step (plain unpacked / fastkit packed):", [f"{a:.5f}/{b:.5f}" for a, b in zip(want, got)])
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-5)
    assert want[-1] < want[0] - 0.5  # it learns (the same 9 documents come back: it memorizes them)
    # Weights to 1e-4 (3% of one lr=3e-3 step), with the optimizer's eps chosen so rounding noise is not amplified.
    assert_tensors_close(got_w, want_w, rtol=1e-4, atol=1e-4, what="weight")


def _no_reset_error(model_type: str) -> float:
    """max |dlogits| of fastkit packing with the state reset removed (the break): the state leak alone."""
    real = packing_state.document_groups
    packing_state.document_groups = lambda lengths, **kw: [[(r, 0, sum(row)) for r, row in enumerate(lengths)]]
    try:
        base, patched = _pair(model_type)
        ids, pos, _ = _batch()
        with torch.no_grad():
            want = _per_doc(base, ids, LENGTHS)
            got = patched(input_ids=ids, position_ids=pos, use_cache=False, **{LENGTHS_KWARG: [LENGTHS]}).logits
        return (got - want).abs().max().item()
    finally:
        packing_state.document_groups = real


if __name__ == "__main__":  # the docs/packing.md table
    print("| family | plain transformers packed error | fastkit packed error | gradient error (rel.) | syncs "
          "(fwd+bwd, packed / unpacked) | fastkit without the reset (break) |")
    print("|---|---|---|---|---|---|")
    for family in HYBRID_FAMILIES:
        r = measure(family)
        print(f"| {family} | {r['plain']:.2g} | {r['fastkit']:.1e} | {r['grad']:.1e} | {r['syncs']} / "
              f"{r['unpacked_syncs']} | {_no_reset_error(family):.2g} |", flush=True)
