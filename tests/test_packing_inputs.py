"""Packed-sequence patch: contamination traps, bad input, collators, metadata lifetime."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from fastkit import FastkitError
from fastkit.patches.packing.patch import LENGTHS_KWARG, PackedBatch, wrap_collator

try:  # shared helpers; tests/ is a package here, a plain folder elsewhere
    from tests.test_packing import LENGTHS, TIGHT, _packed, _pair, _per_doc_logits, checkpointing_on
except ImportError:  # pragma: no cover
    from test_packing import LENGTHS, TIGHT, _packed, _pair, _per_doc_logits, checkpointing_on


@pytest.mark.parametrize("trap", ["use_cache", "ones_mask", "use_cache_positions_only"])
def test_contamination_traps_attend_per_document(trap):
    base, patched = _pair("llama")
    ids, pos = _packed()
    kwargs = {
        "use_cache": dict(use_cache=True, **{LENGTHS_KWARG: LENGTHS}),
        "ones_mask": dict(use_cache=False, attention_mask=torch.ones_like(ids)),
        "use_cache_positions_only": dict(use_cache=True),
    }[trap]
    with torch.no_grad():
        want = _per_doc_logits(base, ids, LENGTHS)
        got = patched(input_ids=ids, position_ids=pos, **kwargs).logits
        upstream = base(input_ids=ids, position_ids=pos, **{k: v for k, v in kwargs.items() if k != LENGTHS_KWARG})
    torch.testing.assert_close(got, want, **TIGHT)
    assert not torch.allclose(upstream.logits, want, atol=1e-3)  # the trap is real upstream


def test_packed_batch_with_filled_cache_or_padding_raises():
    from transformers import DynamicCache

    _, patched = _pair("llama")
    ids, pos = _packed()
    with torch.no_grad():
        cache = DynamicCache(config=patched.config)
        patched(input_ids=ids[:, :4], use_cache=True, cache=cache)
        with pytest.raises(FastkitError, match="cache"):
            patched(input_ids=ids, position_ids=pos, cache=cache, use_cache=True, **{LENGTHS_KWARG: LENGTHS})
        mask = torch.ones_like(ids)
        mask[0, -1] = 0
        with pytest.raises(FastkitError, match="attention_mask"):
            patched(input_ids=ids, position_ids=pos, attention_mask=mask, **{LENGTHS_KWARG: LENGTHS})
        with pytest.raises(FastkitError, match="attention_mask"):
            patched(input_ids=ids, position_ids=pos, attention_mask=mask)


@pytest.mark.parametrize("case, field", [
    ("lengths_do_not_sum", LENGTHS_KWARG),
    ("negative_positions", "position_ids"),
    ("non_monotonic_positions", "position_ids"),
    ("rows_without_per_row_lengths", LENGTHS_KWARG),
    ("rows_with_flat_cu_seq_lens", "cu_seq_lens_q"),
    ("max_seqlen_above_context", LENGTHS_KWARG),
    ("cu_max_length_above_context", "max_length_q"),
])
def test_bad_input_names_the_field(case, field):
    _, patched = _pair("llama", max_position_embeddings=64)
    ids, pos = _packed([5, 7, 4])
    two_rows = ids.expand(2, -1)
    cu = torch.tensor([0, 5, 12, 16], dtype=torch.int32)
    bad_pos = pos.clone()
    call = {
        "lengths_do_not_sum": dict(input_ids=ids, position_ids=pos, **{LENGTHS_KWARG: [5, 7, 3]}),
        "negative_positions": dict(input_ids=ids, position_ids=bad_pos.index_fill_(1, torch.tensor([5]), -3)),
        "non_monotonic_positions": dict(input_ids=ids, position_ids=bad_pos.index_fill_(1, torch.tensor([5]), 2)),
        "rows_without_per_row_lengths": dict(input_ids=two_rows, position_ids=pos, **{LENGTHS_KWARG: [5, 7, 4]}),
        "rows_with_flat_cu_seq_lens": dict(input_ids=two_rows, position_ids=pos, cu_seq_lens_q=cu, max_length_q=7),
        "max_seqlen_above_context": dict(input_ids=torch.randint(3, 300, (1, 80)),
                                         position_ids=torch.cat([torch.arange(70), torch.arange(10)])[None],
                                         **{LENGTHS_KWARG: [70, 10]}),
        "cu_max_length_above_context": dict(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, max_length_q=65),
    }[case]
    with torch.no_grad(), pytest.raises(FastkitError, match=field):
        patched(use_cache=False, **call)


def test_two_rows_with_per_row_lengths():
    base, patched = _pair("qwen3")
    rows = [[6, 10, 4], [20]]
    ids = torch.randint(3, 300, (2, 20))
    pos = torch.stack([torch.cat([torch.arange(n) for n in r]) for r in rows])  # (2, 20)
    with torch.no_grad():
        got = patched(input_ids=ids, position_ids=pos, use_cache=False, **{LENGTHS_KWARG: rows}).logits
        got_no_pos = patched(input_ids=ids, use_cache=False, **{LENGTHS_KWARG: rows}).logits
        want = torch.cat([_per_doc_logits(base, ids[i:i + 1], r) for i, r in enumerate(rows)])
    torch.testing.assert_close(got, want, **TIGHT)
    torch.testing.assert_close(got_no_pos, want, **TIGHT)  # positions rebuilt from the lengths


def _features(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(3, 300, (n,), generator=g).tolist()} for n in lengths]


def _check_collated(batch, base, patched, lengths):
    assert batch[LENGTHS_KWARG] == [lengths] and all(isinstance(n, int) for n in batch[LENGTHS_KWARG][0])
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "seq_idx")}
    with torch.no_grad():
        got = patched(**inputs, use_cache=False).logits
        want = _per_doc_logits(base, batch["input_ids"], lengths)
    torch.testing.assert_close(got, want, **TIGHT)


@pytest.mark.parametrize("flash_kwargs", [False, True])
def test_data_collator_with_flattening(flash_kwargs):
    from transformers import DataCollatorWithFlattening

    base, patched = _pair("llama")
    lengths = [7, 3, 12]
    collator = wrap_collator(DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs))
    _check_collated(collator(_features(lengths)), base, patched, lengths)


def test_trl_padding_free_collator():
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    base, patched = _pair("qwen3")
    collator = wrap_collator(DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True, pad_to_multiple_of=8))
    ids = torch.randint(3, 300, (16,)).tolist()
    batch = collator([{"input_ids": ids[:9], "seq_lengths": [4, 5]}, {"input_ids": ids[9:], "seq_lengths": [7]}])
    assert batch["input_ids"].shape[1] == 16  # 16 real tokens, no padding needed
    _check_collated(batch, base, patched, [4, 5, 7])
    padded = collator([{"input_ids": ids[:9], "seq_lengths": [4, 5]}])  # 9 -> 16: pads are 1-token documents
    assert padded[LENGTHS_KWARG] == [[4, 5] + [1] * 7]
    assert collator.padding_free is True  # attribute access reaches the wrapped collator
    assert wrap_collator(collator) is collator


def test_metadata_lifetime(monkeypatch):
    """One object per forward, reused by the checkpoint recompute, freed after backward, never reused."""
    import fastkit.patches.packing.patch as packing

    built: list[weakref.ref] = []
    original = packing._metadata

    def recording(*args):
        meta = original(*args)
        built.append(weakref.ref(meta))
        return meta

    monkeypatch.setattr(packing, "_metadata", recording)
    seen: list[int] = []
    real_kernel = packing.kernels.packed_attention

    def spy(q, k, v, meta, **kw):
        seen.append(id(meta))
        return real_kernel(q, k, v, meta, **kw)

    monkeypatch.setattr(packing.kernels, "packed_attention", spy)
    base, patched = _pair("llama", layers=3)
    patched.train()
    checkpointing_on(patched)
    ids, pos = _packed()
    out = patched(input_ids=ids, position_ids=pos, labels=ids, use_cache=False, **{LENGTHS_KWARG: LENGTHS})
    assert len(built) == 1 and built[0]() is not None
    assert isinstance(built[0](), PackedBatch)
    out.loss.backward()
    assert len(seen) == 6 and len(set(seen)) == 1  # 3 layers forward + 3 recomputes, one object
    del out
    gc.collect()
    assert built[0]() is None  # freed with the graph

    # The same position tensor mutated in place describes a new layout: a fresh object, right answer.
    patched.eval()
    pos2 = pos.clone()
    with torch.no_grad():
        patched(input_ids=ids, position_ids=pos2, use_cache=False)
        pos2[0] = torch.cat([torch.arange(60), torch.arange(54)])
        got = patched(input_ids=ids, position_ids=pos2, use_cache=False).logits
        want = _per_doc_logits(base, ids, [60, 54])
        n_built = len(built)
        patched.generate(ids[:, :10], max_new_tokens=3, do_sample=False, pad_token_id=0)  # no packing metadata
    torch.testing.assert_close(got, want, **TIGHT)
    assert len(built) == n_built
