"""Packed stateful layers on CUDA: the real varlen kernels against fastkit's per-document regroup.

Each test skips without CUDA or without its library (flash-linear-attention is carried to the device machine,
tests/gpu/wheels.txt; causal-conv1d and mamba-ssm are CUDA builds nobody carries, so the model-level tests
run where a user has them installed).

- fla: fastkit's host-built ``chunk_indices`` is the table fla's ``prepare_chunk_indices`` derives (equal);
  ``chunk_gated_delta_rule`` given it equals fla given only ``cu_seqlens`` and each document run alone;
  forward and backward make no synchronizing CUDA call (``torch.cuda.set_sync_debug_mode("error")``).
- causal-conv1d: ``causal_conv1d_fn(seq_idx=)`` on channel-last input equals each document alone.
- every family with a varlen kind whose packages are all here: the patched twin's varlen path equals its
  regroup path (logits, every gradient) in training mode (mamba-ssm's fused split-conv-scan kernel) and
  eval mode, 0 syncs counted and none seen by the CUDA sync debug mode.

Tolerances: bf16 kernel-level checks use the packing GPU test's 2e-2 (bf16 output rounding). The model-level
twins run in fp32, where the triton kernels of fla / mamba-ssm may use tf32 dots (10-bit mantissa, ~1e-3
relative per product); 5e-3 on logits and 2e-2 of each gradient tensor's largest entry is a few tf32 ulps,
while a leak across documents moves logits by 1e-2 … 0.5 (docs/packing.md).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util

import pytest
import torch

from fastkit import SyncCounter
from fastkit.families.twins import HYBRID_FAMILIES, twin
from fastkit.loader import FastModel
from fastkit.patches.packing import LENGTHS_KWARG, varlen
from fastkit.patches.packing.attention import PackedBatch
from fastkit.registry import facts_for
from tests.helpers import assert_grads_close

pytestmark = pytest.mark.gpu

LENGTHS = [5, 17, 9, 300, 1, 12, 168]  # documents across and inside fla's 64-token chunks
BF16 = dict(rtol=2e-2, atol=2e-2)
PACKAGES = {"gated_delta": ("fla", "causal_conv1d"), "short_conv": ("causal_conv1d",),
            "mamba2": ("causal_conv1d", "mamba_ssm")}


def _have(*packages: str) -> bool:
    return all(importlib.util.find_spec(p) is not None for p in packages)


def _missing(*packages: str) -> bool:
    """Skip for a missing library only where there is CUDA; without it the gpu marker's "needs a CUDA GPU"
    skip applies (the rehearsal checks that every GPU test skipped for want of CUDA, and nothing else)."""
    return torch.cuda.is_available() and not _have(*packages)


@contextlib.contextmanager
def _no_cuda_sync():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _args(lengths, device="cuda"):
    meta = PackedBatch(rows=1, row_len=sum(lengths), lengths_host=[lengths], max_seqlen=max(lengths))
    return varlen.varlen_args(meta, torch.device(device))


@pytest.mark.skipif(_missing("fla"), reason="flash-linear-attention not installed")
def test_fla_takes_fastkit_chunk_indices_without_a_sync():
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.utils import prepare_chunk_indices

    args = _args(LENGTHS)
    assert torch.equal(prepare_chunk_indices(args.cu_seqlens, varlen.FLA_CHUNK), args.chunk_indices)
    g = torch.Generator(device="cuda").manual_seed(0)
    t, h, hv, d = sum(LENGTHS), 2, 4, 64
    q, k = (torch.randn(1, t, h, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(1, t, hv, d, device="cuda", generator=g, dtype=torch.bfloat16)
    gate = torch.nn.functional.logsigmoid(torch.randn(1, t, hv, device="cuda", generator=g))
    beta = torch.rand(1, t, hv, device="cuda", generator=g).sigmoid().to(torch.bfloat16)
    inputs = [x.requires_grad_() for x in (q, k, v, gate, beta)]

    def run(**kw):
        for x in inputs:
            x.grad = None
        o, _ = chunk_gated_delta_rule(*inputs, use_qk_l2norm_in_kernel=True, **kw)
        o.float().square().sum().backward()
        return o.detach(), [x.grad.clone() for x in inputs]

    fastkit = dict(cu_seqlens=args.cu_seqlens, chunk_indices=args.chunk_indices, cu_seqlens_cpu=args.cu_seqlens_cpu)
    run(**fastkit)  # triton autotunes on the first call (that one synchronizes)
    with _no_cuda_sync():
        got, got_g = run(**fastkit)
    want, want_g = run(cu_seqlens=args.cu_seqlens)  # fla derives the same table itself (with a sync)
    torch.testing.assert_close(got, want, **BF16)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b, **BF16)
    cu = args.cu_seqlens_cpu.tolist()
    alone = torch.cat([chunk_gated_delta_rule(*(x[:, a:b].detach() for x in inputs), use_qk_l2norm_in_kernel=True)[0]
                       for a, b in zip(cu[:-1], cu[1:])], dim=1)
    torch.testing.assert_close(got.float(), alone.float(), **BF16)


@pytest.mark.skipif(_missing("causal_conv1d"), reason="causal-conv1d not installed")
def test_causal_conv1d_seq_idx_restarts_at_each_document():
    from causal_conv1d import causal_conv1d_fn

    args = _args(LENGTHS)
    t, dim = sum(LENGTHS), 64
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, t, dim, device="cuda", generator=g).transpose(1, 2)  # (1, D, T), channel-last
    weight = torch.randn(dim, 4, device="cuda", generator=g)
    got = causal_conv1d_fn(x, weight, None, seq_idx=args.seq_idx, activation="silu")
    cu = args.cu_seqlens_cpu.tolist()
    alone = torch.cat([causal_conv1d_fn(x[:, :, a:b].contiguous(), weight, None, activation="silu")
                       for a, b in zip(cu[:-1], cu[1:])], dim=2)
    torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)


def _families():
    return [pytest.param(f, mode, marks=pytest.mark.skipif(_missing(*PACKAGES[facts_for(f).varlen]),
                                                           reason=" + ".join(PACKAGES[facts_for(f).varlen])
                                                           + " not installed"))
            for f in HYBRID_FAMILIES if facts_for(f).varlen for mode in ("train", "eval")]


@pytest.mark.parametrize("model_type, mode", _families())
def test_real_varlen_kernels_equal_the_regroup(model_type, mode, monkeypatch):
    model = copy.deepcopy(twin(model_type)).cuda()
    FastModel.patch(model, patches=["packing"])
    model.train(mode == "train")
    mixer = next(m for m in model.modules() if type(m).__name__ in facts_for(model_type).stateful)
    reason = varlen.decide(mixer, facts_for(model_type).varlen)
    if reason is not None:
        pytest.skip(reason)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 300, (1, sum(LENGTHS)), generator=g).cuda()
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None].cuda()  # (1, T)
    w = torch.randn(1, sum(LENGTHS), model.config.vocab_size, generator=g).cuda()

    def step():
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, position_ids=pos, use_cache=False, **{LENGTHS_KWARG: [LENGTHS]}).logits
        (logits * w).sum().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    monkeypatch.setattr(varlen, "on_cuda", lambda t: False)  # the per-document regroup, same kernels
    want, want_g = step()
    monkeypatch.undo()
    step()  # triton autotuning
    with SyncCounter() as syncs, _no_cuda_sync():
        got, got_g = step()
    torch.testing.assert_close(got, want, rtol=5e-3, atol=5e-3)
    assert_grads_close(got_g, want_g, rtol=2e-2, atol=1e-6, per="tensor")
    assert syncs.total == 0, syncs.by_op
