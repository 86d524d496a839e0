"""The CUDA-only code paths, exercised on this CPU machine (issue 16: "GPU run ready on the first try").

- ``varlen_torch`` against the three real ``varlen_attn`` signatures (torch 2.10 / 2.11 / 2.13, written
  out below) and a CPU reference kernel with flash's window convention, through a whole model;
- ``PackedBatch.cu_seqlens``: no blocking copy, and a private copy of the caller's ``cu_seq_lens_q``;
- the pre-sm80 (T4) GQA branch of ``sdpa_per_doc``;
- the offload device slots let go once backward no longer needs them.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef

from fastkit import SyncCounter
from fastkit.patches.offload.patch import enable_offload, offload_controller
from fastkit.patches.offload.pipeline import DevicePool
from fastkit.patches.packing import attention as pa
from fastkit.patches.packing.patch import LENGTHS_KWARG, PackedBatch
from tests.test_offload import base, build, cfg, train_steps
from tests.test_packing import (
    LENGTHS,
    TIGHT,
    _assert_grads_equal,
    _grads,
    _packed,
    _pair,
    _per_doc_logits,
    checkpointing_on,
)

# ---------------------------------------------------------------------------------------- varlen_attn


def _reference(query, key, value, cu, window_size, scale, calls):
    """What flash varlen computes, per document, on the CPU: a query at ``i`` sees keys ``i-left..i+right``."""
    calls.append(dict(window_size=tuple(window_size), scale=scale, heads=(query.shape[1], key.shape[1])))
    bounds = cu.tolist()  # the kernel reads cu when it runs: forward and the checkpoint recompute alike
    left, right = window_size
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        q, k, v = (x[a:b].transpose(0, 1) for x in (query, key, value))  # (H, L, D)
        if k.shape[0] != q.shape[0]:  # flash: query head h reads k/v head h // (Hq / Hkv)
            k, v = (x.repeat_interleave(q.shape[0] // x.shape[0], 0) for x in (k, v))
        i = torch.arange(b - a)
        diff = i[:, None] - i[None, :]  # (L, L): query - key
        allowed = torch.ones_like(diff, dtype=torch.bool)
        if left >= 0:
            allowed &= diff <= left
        if right >= 0:
            allowed &= diff >= -right
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale).transpose(0, 1))
    return torch.cat(outs, 0)  # (T, Hq, Dv)


def _fakes(calls):
    """varlen_attn with each released signature (as in the real wheels), computing the CPU reference."""

    def torch_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        return _reference(query, key, value, cu_seq_q, (-1, 0) if is_causal else (-1, -1), None, calls)

    def torch_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                   window_size=(-1, -1)):
        return _reference(query, key, value, cu_seq_q, window_size, scale, calls)

    def torch_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                   window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
        if not enable_gqa and query.shape[1] != key.shape[1]:
            raise ValueError("Expect query and key/value to have the same number of heads (enable_gqa=False)")
        return _reference(query, key, value, cu_seq_q, window_size, scale, calls)

    return {"2.10": torch_2_10, "2.11": torch_2_11, "2.13": torch_2_13}


def _as_cuda_sm90(monkeypatch, fn):
    """pick_kernel's view of an H200 with ``fn`` as torch's varlen_attn (the kernel itself runs on the CPU)."""
    monkeypatch.setattr(pa, "_varlen_shapes_ok", lambda q, v: True)
    monkeypatch.setattr(pa, "_capability", lambda q: (9, 0))
    monkeypatch.setattr(pa, "_flash_attn_varlen", lambda: None)
    monkeypatch.setattr(pa, "_torch_varlen", lambda: fn)


def test_installed_varlen_signature_is_one_we_handle():
    fn = pa._torch_varlen()
    if fn is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    params = pa.varlen_params(fn)
    assert {"window_size", "scale"} <= params or "is_causal" in params, params
    kw = pa.varlen_kwargs(params, heads_q=8, heads_kv=2, scaling=0.125, window_size=(15, 0))
    inspect.signature(fn).bind(*range(7), **kw)  # every keyword we pass exists in the installed function
    if "enable_gqa" in params:
        assert kw["enable_gqa"] is True


# torch 2.10: no window_size (causal via is_causal), no scale; 2.11: no enable_gqa; 2.13: everything.
EXPECTED = {
    "2.10": {"is_causal"},
    "2.11": {"scale", "window_size"},
    "2.13": {"scale", "window_size", "enable_gqa"},
}


@pytest.mark.parametrize("version", list(EXPECTED))
def test_varlen_kwargs_follow_each_released_signature(version):
    calls = []
    fn = _fakes(calls)[version]
    params = pa.varlen_params(fn)
    kw = pa.varlen_kwargs(params, heads_q=8, heads_kv=2, scaling=None, window_size=(-1, 0))
    assert set(kw) == EXPECTED[version]
    inspect.signature(fn).bind(*range(7), **kw)


@pytest.mark.parametrize("version", list(EXPECTED))
@pytest.mark.parametrize("window, scaling", [(None, None), (None, 0.3), (16, None), (16, 8 ** -0.5)])
def test_varlen_torch_or_fallback_is_exact_for_each_signature(monkeypatch, version, window, scaling):
    """The kernel pick_kernel chooses runs with the installed signature and equals the per-document reference."""
    calls = []
    _as_cuda_sm90(monkeypatch, _fakes(calls)[version])
    meta = PackedBatch(rows=2, row_len=40, lengths_host=[[10, 30], [40]], max_seqlen=40)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 40, 8, generator=g) for h in (8, 2, 2))
    kernel = pa.pick_kernel(q, v, dropout=0.0, softcap=None, sinks=None, scaling=scaling, window=window, meta=meta)
    needs = {"window": window is not None, "scale": scaling not in (None, 8 ** -0.5)}
    lacks = {"2.10": {"window", "scale"}, "2.11": set(), "2.13": set()}[version]
    assert kernel == ("sdpa_per_doc" if any(needs[f] for f in lacks) else "varlen_torch")
    got = pa.packed_attention(q, k, v, meta, scaling=scaling, window=window)
    want = pa.sdpa_per_doc(q, k, v, meta, scaling=scaling, dropout=0.0, window=window)
    torch.testing.assert_close(got, want, **TIGHT)
    if kernel == "varlen_torch":
        left = window - 1 if window else -1
        assert calls == [dict(window_size=(left, 0), scale=scaling if version != "2.10" else None, heads=(8, 2))]
    else:
        assert calls == []


@pytest.mark.parametrize("version", ["2.11", "2.13"])
def test_sliding_window_is_exact_through_a_model_on_the_varlen_path(monkeypatch, version):
    """fp32, a document (70) longer than mistral's window (64): an off-by-one window moves these logits."""
    calls = []
    _as_cuda_sm90(monkeypatch, _fakes(calls)[version])
    base_model, patched = _pair("mistral")
    assert base_model.config.sliding_window == 64 and max(LENGTHS) > 64
    ids, pos = _packed()
    with torch.no_grad():
        want = _per_doc_logits(base_model, ids, LENGTHS)
        got = patched(input_ids=ids, position_ids=pos, use_cache=False, **{LENGTHS_KWARG: LENGTHS}).logits
    assert calls and all(c["window_size"] == (63, 0) for c in calls)
    torch.testing.assert_close(got, want, **TIGHT)


# ---------------------------------------------------------------------------------------- cu_seqlens


def test_cu_seqlens_copy_to_a_device_does_not_block():
    """'meta' stands in for CUDA: a blocking H2D copy is a stream sync per batch (SyncCounter counts it)."""
    meta = PackedBatch(rows=2, row_len=40, lengths_host=[[10, 30], [40]], max_seqlen=40)
    with SyncCounter() as sc:
        cu = meta.cu_seqlens(torch.device("meta"))
    assert sc.total == 0, dict(sc.by_op)
    assert cu.dtype == torch.int32 and cu.shape == (4,)
    with SyncCounter() as blocking:
        torch.zeros(3).to("meta")
    assert blocking.total == 1  # the counter does see a blocking one


def test_cu_seqlens_owns_its_copy_of_the_callers_tensor():
    caller = torch.tensor([0, 10, 40], dtype=torch.int32)
    meta = PackedBatch(rows=1, row_len=40, lengths_host=None, max_seqlen=30, cu_device=caller)
    cu = meta.cu_seqlens(torch.device("cpu"))
    assert cu.untyped_storage().data_ptr() != caller.untyped_storage().data_ptr()
    caller.copy_(torch.tensor([0, 20, 40], dtype=torch.int32))  # the collator refills its buffer
    assert meta.cu_seqlens(torch.device("cpu")).tolist() == [0, 10, 40]


def test_collator_reusing_its_cu_buffer_before_backward_changes_nothing(monkeypatch):
    """TRL kwargs, checkpointing, the varlen path: the recompute sees this batch's boundaries, not the next's."""
    calls = []
    _as_cuda_sm90(monkeypatch, _fakes(calls)["2.13"])
    _, patched = _pair("qwen3")
    patched.train()
    checkpointing_on(patched)
    ids, pos = _packed()
    cu_of = lambda lengths: torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    other = [20, 2, 9, 39, 1, 53]  # another batch's boundaries, same total
    runs = {}
    for mutate in (False, True):
        model = copy.deepcopy(patched)
        buffer = cu_of(LENGTHS)
        out = model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False, cu_seq_lens_q=buffer,
                    max_length_q=max(LENGTHS))
        if mutate:
            buffer.copy_(cu_of(other))
        out.loss.backward()
        runs[mutate] = _grads(model)
    assert len(calls) == 2 * 2 * 2  # 2 layers, forward + recompute, 2 runs: the varlen path ran
    _assert_grads_equal(runs[True], runs[False])


# ---------------------------------------------------------------------------------------- T4 GQA branch


def test_pre_sm80_gqa_repeat_groups_heads_like_transformers(monkeypatch):
    """On a T4 SDPA gets k/v repeated per document; query head h must read kv head h // n_rep."""
    repeats = []
    real_repeat = pa._repeat_kv
    monkeypatch.setattr(pa, "_capability", lambda q: (7, 5))
    monkeypatch.setattr(pa, "_repeat_kv", lambda x, n: repeats.append(n) or real_repeat(x, n))
    lengths = [[3, 20, 9], [32]]
    meta = PackedBatch(rows=2, row_len=32, lengths_host=lengths, max_seqlen=32)
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(2, 8, 32, 8, generator=g), torch.randn(2, 2, 32, 8, generator=g), \
        torch.randn(2, 2, 32, 8, generator=g)
    for window in (None, 8):
        repeats.clear()
        got = pa.sdpa_per_doc(q, k, v, meta, scaling=0.3, dropout=0.0, window=window)
        assert repeats and set(repeats) == {4}  # the T4 branch ran (k and v, per document)
        want = []
        for b, row in enumerate(lengths):
            start, outs = 0, []
            for n in row:
                sl = slice(start, start + n)
                kd, vd = (x[b:b + 1, :, sl].repeat_interleave(4, 1) for x in (k, v))  # transformers' repeat_kv
                mask = torch.ones(n, n, dtype=torch.bool).tril()
                if window:
                    mask &= ~torch.ones(n, n, dtype=torch.bool).tril(-window)
                outs.append(F.scaled_dot_product_attention(q[b:b + 1, :, sl], kd, vd, attn_mask=mask, scale=0.3))
                start += n
            want.append(torch.cat(outs, 2))
        torch.testing.assert_close(got, torch.cat(want).transpose(1, 2), **TIGHT)


# ---------------------------------------------------------------------------------------- offload slots


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_offload_device_slots_are_let_go_when_backward_is_done(monkeypatch, lora):
    """A full fine-tune's end-of-backward peak (all gradients live) must not also hold the two reload slots."""
    slots = []
    real_acquire = DevicePool.acquire

    def spy(self, numel, dtype):
        buf = real_acquire(self, numel, dtype)
        slots.append(StorageWeakRef(buf.untyped_storage()))
        return buf

    monkeypatch.setattr(DevicePool, "acquire", spy)
    model = build(lora=lora)
    enable_offload(base(model), cfg())
    train_steps(model, steps=2)
    pool = offload_controller(model).device
    assert slots and not any(pool.bufs.values())
    assert all(ref.expired() for ref in slots)  # no device slot memory left after backward
    assert pool.stats.device_releases == 2
