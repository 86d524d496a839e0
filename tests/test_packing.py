"""Packed-sequence patch: exactness, zero syncs, the contamination traps, bad input, collators, lifetime.

Every model here is a random fp32 twin; "unpatched" is the same weights without fastkit.
"""

from __future__ import annotations

import copy

import pytest
import torch

from fastkit.families.twins import twin
from fastkit.loader import FastModel
from fastkit.patches.packing.patch import LENGTHS_KWARG, PackedBatch
from fastkit.patching import active_patches, revert
from tests.helpers import assert_grads_close, grads_of

# Covers: a 1-token document, a document longer than mistral's window (64) and gpt_oss's (16).
LENGTHS = [5, 17, 9, 70, 1, 12]
FAMILIES = ["llama", "qwen3", "mistral", "gpt_oss", "qwen3_moe"]
TIGHT = dict(rtol=1e-5, atol=1e-5)  # fp32 on CPU: summation order differs between kernels (~1e-7 here)


def _pair(model_type: str, layers: int = 2, **overrides):
    """(unpatched, patched) twins with identical weights; only the packing patch is applied."""
    base = twin(model_type, num_hidden_layers=layers, **overrides)
    patched = copy.deepcopy(base)
    FastModel.patch(patched, patches=["packing"])
    assert active_patches(patched) == ["packing"]
    return base, patched


def checkpointing_on(model):
    """Non-reentrant activation checkpointing on every decoder layer (what fastkit's loader turns on)."""
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


def _packed(lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 300, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]  # (1, T)
    return ids, pos


def _per_doc_logits(model, ids, lengths):
    out, start = [], 0
    for n in lengths:
        out.append(model(input_ids=ids[:, start:start + n], use_cache=False).logits)
        start += n
    return torch.cat(out, dim=1)  # (1, T, V)


def _grads(model):
    return {n: g.clone() for n, g in grads_of(model).items() if g is not None}


def _assert_grads_equal(got: dict, want: dict):
    """Every gradient equal to fp32 rounding: max error <= 1e-5 of that tensor's largest entry.

    (Per-document and dense-mask kernels sum in different orders; measured ~3e-7 relative.)
    """
    assert_grads_close(got, want, rtol=1e-5, atol=1e-7, per="tensor")


@pytest.mark.parametrize("model_type", FAMILIES + ["qwen2_moe", "mixtral", "olmoe", "deepseek_v3"])
def test_packed_logits_equal_each_document_alone(model_type):
    base, patched = _pair(model_type)
    ids, pos = _packed()
    with torch.no_grad():
        want = _per_doc_logits(base, ids, LENGTHS)
        got = patched(input_ids=ids, position_ids=pos, use_cache=False, **{LENGTHS_KWARG: LENGTHS}).logits
        got_from_positions = patched(input_ids=ids, position_ids=pos, use_cache=False).logits
    torch.testing.assert_close(got, want, **TIGHT)
    torch.testing.assert_close(got_from_positions, want, **TIGHT)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_logits_and_every_gradient_match_unpatched(model_type):
    """Patched packed step vs unpatched: the packed batch (llama/qwen3/mistral/qwen3_moe, where transformers
    detects packing) and each document run alone (all, including gpt_oss whose upstream mask mixes documents)."""
    base, patched = _pair(model_type)
    base.train(), patched.train()
    ids, pos = _packed()
    weight = torch.randn(1, ids.shape[1], base.config.vocab_size)  # loss = <logits, weight>: tests every logit

    logits = patched(input_ids=ids, position_ids=pos, use_cache=False, **{LENGTHS_KWARG: LENGTHS}).logits
    (logits * weight).sum().backward()
    got = _grads(patched)

    ref_docs = _per_doc_logits(base, ids, LENGTHS)
    (ref_docs * weight).sum().backward()
    torch.testing.assert_close(logits, ref_docs, **TIGHT)
    _assert_grads_equal(got, _grads(base))

    if model_type != "gpt_oss":
        base.zero_grad()
        ref_packed = base(input_ids=ids, position_ids=pos, use_cache=False).logits
        (ref_packed * weight).sum().backward()
        torch.testing.assert_close(logits, ref_packed, **TIGHT)
        _assert_grads_equal(got, _grads(base))


def test_gradient_checkpointing_reuses_metadata_and_matches():
    base, patched = _pair("mistral")
    for m in (base, patched):
        m.train()
        checkpointing_on(m)
    ids, pos = _packed()
    out = patched(input_ids=ids, position_ids=pos, labels=ids, use_cache=False, **{LENGTHS_KWARG: LENGTHS})
    out.loss.backward()
    ref = base(input_ids=ids, position_ids=pos, labels=ids, use_cache=False)
    ref.loss.backward()
    torch.testing.assert_close(out.loss, ref.loss, **TIGHT)
    _assert_grads_equal(_grads(patched), _grads(base))


def test_unpacked_batches_are_bitwise_unpatched():
    """Padded batches, plain batches and generation with a cache go through the original backend and mask."""
    base, patched = _pair("qwen3")
    ids = torch.randint(3, 300, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    with torch.no_grad():
        for kwargs in (dict(attention_mask=mask), dict(), dict(attention_mask=torch.ones_like(mask))):
            assert torch.equal(patched(input_ids=ids, **kwargs).logits, base(input_ids=ids, **kwargs).logits)
    gen = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(patched.generate(ids, **gen), base.generate(ids, **gen))


def test_patch_is_revertible_and_refuses_what_it_cannot_do():
    base, patched = _pair("llama")
    original_forward = base.model.forward.__func__
    assert patched.config._attn_implementation == "fastkit_sdpa"
    assert revert(patched) == ["packing"]
    assert patched.config._attn_implementation == "sdpa"
    assert "forward" not in vars(patched.model) and patched.model.forward.__func__ is original_forward

    from fastkit.patches.packing.patch import PackedAttentionPatch
    from fastkit.registry import facts_for

    other = twin("llama")
    other.config._attn_implementation = "flex_attention"
    assert "flex_attention" in PackedAttentionPatch(facts_for("llama")).check(other)
    other.config._attn_implementation = "sdpa"
    other.config.is_causal = False
    assert "bidirectional" in PackedAttentionPatch(facts_for("llama")).check(other)


def test_kernels_agree_with_dense_reference():
    """sdpa_per_doc and eager_per_doc (sliding window, GQA, softcap) against a dense block-diagonal reference."""
    from fastkit.patches.packing.attention import eager_per_doc, sdpa_per_doc

    lengths = [[3, 20, 9], [32]]
    meta = PackedBatch(rows=2, row_len=32, lengths_host=lengths, max_seqlen=32)
    q, k, v = torch.randn(2, 4, 32, 8), torch.randn(2, 2, 32, 8), torch.randn(2, 2, 32, 8)
    doc = torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(r)]) for r in lengths])  # (B, T)
    idx = torch.arange(32)
    for window, softcap in ((None, None), (8, None), (None, 5.0), (8, 5.0)):
        allowed = (doc[:, :, None] == doc[:, None, :]) & (idx[:, None] >= idx[None, :])  # (B, T, T)
        if window:
            allowed &= idx[:, None] - idx[None, :] < window
        kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        scores = q @ kr.transpose(-1, -2) * 0.3
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        ref = (scores.masked_fill(~allowed[:, None], float("-inf")).softmax(-1) @ vr).transpose(1, 2)
        got = eager_per_doc(q, k, v, meta, scaling=0.3, dropout=0.0, window=window, softcap=softcap, sinks=None,
                            training=False)
        torch.testing.assert_close(got, ref, **TIGHT)
        if not softcap:
            torch.testing.assert_close(sdpa_per_doc(q, k, v, meta, scaling=0.3, dropout=0.0, window=window), ref,
                                       **TIGHT)


def test_lora_gradients_match_through_peft():
    """The usual fine-tuning stack: fastkit patch, then PEFT LoRA with checkpointing; LoRA grads match per document."""
    base, patched = _pair("qwen3")
    lora = dict(r=4, lora_alpha=8, target_modules="all-linear", use_gradient_checkpointing=True,
                init_lora_weights=False)  # B != 0, so every LoRA gradient is non-trivial
    base_peft = FastModel.get_peft_model(base, **lora)
    peft = FastModel.get_peft_model(patched, **lora)
    for m in (base_peft, peft):
        m.train()
    ids, pos = _packed()
    weight = torch.randn(1, ids.shape[1], base.config.vocab_size)
    got = peft(input_ids=ids, position_ids=pos, use_cache=False, **{LENGTHS_KWARG: LENGTHS}).logits
    (got * weight).sum().backward()
    want = _per_doc_logits(base_peft, ids, LENGTHS)
    (want * weight).sum().backward()
    torch.testing.assert_close(got, want, **TIGHT)
    lora_grads = {n: g for n, g in _grads(peft).items() if "lora_" in n}
    assert lora_grads
    _assert_grads_equal(lora_grads, {n: g for n, g in _grads(base_peft).items() if "lora_" in n})


def test_flash_delegation_sees_the_original_key():
    """Non-packed calls on a flash model reach transformers' flash function with the original key."""
    from fastkit._hf import AttentionView

    model = twin("llama")
    attn = model.model.layers[0].self_attn
    view = AttentionView(attn, "flash_attention_2")
    assert view.config._attn_implementation == "flash_attention_2"
    assert view.config.num_attention_heads == model.config.num_attention_heads
    assert view.layer_idx == 0 and view.is_causal and next(view.modules()) is attn


def test_varlen_torch_call_is_well_formed_on_meta_tensors(monkeypatch):
    """torch's varlen_attn (CUDA-only kernels) accepts our layout and wires autograd: checked on 'meta' tensors.

    The window is causal, exactly: flash ``(W - 1, 0)`` for a document longer than W, ``(-1, 0)`` otherwise
    (``(-1, -1)``, varlen_attn's default, is bidirectional)."""
    import functools

    from fastkit.patches.packing import attention as pa

    real, seen = pa._torch_varlen(), []

    @functools.wraps(real)
    def spy(*args, **kwargs):
        seen.append(kwargs.get("window_size", "causal" if kwargs.get("is_causal") else None))
        return real(*args, **kwargs)

    monkeypatch.setattr(pa, "_torch_varlen", lambda: spy)
    meta = PackedBatch(rows=2, row_len=40, lengths_host=[[10, 30], [40]], max_seqlen=40)
    q = torch.empty(2, 8, 40, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    k = torch.empty(2, 2, 40, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    v = torch.empty(2, 2, 40, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    meta._cache[("cu", q.device)] = torch.empty(4, dtype=torch.int32, device="meta")
    out = pa.varlen_torch(q, k, v, meta, scaling=0.125, window=16)
    assert out.shape == (2, 40, 8, 64)
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    for window in (None, 40, 64):  # no window, or none shorter than the longest document: plain causal
        pa.varlen_torch(q, k, v, meta, scaling=0.125, window=window)
    assert seen == [(15, 0), (-1, 0), (-1, 0), (-1, 0)]
    assert meta.cu_seqlens(torch.device("cpu")).tolist() == [0, 10, 40, 80]  # flattened over rows, int32
