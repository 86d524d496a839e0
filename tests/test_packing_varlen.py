"""The varlen dispatch of packed stateful layers, proven on the CPU with fake kernels.

No GPU here, and causal-conv1d / flash-linear-attention / mamba-ssm need one. So each test installs fake
packages whose functions implement the libraries' documented varlen semantics in pure torch, and lets
transformers' own ``use_kernel_func_from_hub_with_fallback`` resolve them exactly as it resolves the real
ones at import (the same kwarg filtering, the same "torch reference refuses seq_idx" rule):

- ``causal_conv1d_fn(x, weight, bias, seq_idx=, activation=)``: causal-conv1d 1.7.0's reference
  (``causal_conv1d_ref``): a window tap reads only tokens of the same ``seq_idx``; it asserts what the CUDA
  kernel TORCH_CHECKs: channel-last ``x`` (``x.stride(1) == 1``), int32 contiguous ``seq_idx (B, T)``;
- ``chunk_gated_delta_rule(..., cu_seqlens=, cu_seqlens_cpu=, chunk_indices=)``: batch 1, transformers'
  ``torch_chunk_gated_delta_rule`` on each ``cu_seqlens`` segment; asserts ``chunk_indices`` is fla's
  ``[document, chunk]`` table for chunk 64 and ``cu_seqlens_cpu`` equals ``cu_seqlens``;
- ``mamba_chunk_scan_combined(..., seq_idx=)``: transformers' torch ``mamba2_chunk_scan`` per run of equal
  ``seq_idx``; ``mamba_split_conv1d_scan_combined``: records its ``seq_idx`` and returns None (transformers'
  "no fused kernel" answer), so the unfused kernels run; the fused one is covered by the GPU test.

A fake's own reads of its arguments are the kernel's device-side reads: they run outside the sync
counter (``_kernel_side``). The rest of the forward and backward is counted: 0 syncs.
"""

from __future__ import annotations

import copy
import logging
import math
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _disable_current_modes

from fastkit import _hf
from fastkit.families.twins import HYBRID_FAMILIES, twin
from fastkit.loader import FastModel
from fastkit.patches.packing import LENGTHS_KWARG, varlen
from fastkit.patches.packing import attention as packing_attention
from fastkit.patches.packing import state as packing_state
from fastkit.registry import facts_for
from fastkit.syncs import SyncCounter
from tests.helpers import assert_grads_close
from tests.test_packing_state import LENGTHS, TIGHT, _batch, _per_doc, _step

VARLEN_FAMILIES = [f for f in HYBRID_FAMILIES if facts_for(f).varlen]
_TOLIST = torch.Tensor.tolist  # the real one: SyncCounter wraps it to count host reads
# the package function each modeling-module global resolves to (transformers 5.24's decorator arguments)
_PACKAGE_NAME = {"causal_conv1d_fn": "causal_conv1d_fn", "torch_chunk_gated_delta_rule": "chunk_gated_delta_rule",
                 "mamba2_chunk_scan": "mamba_chunk_scan_combined",
                 "mamba2_split_conv1d_scan_combined": "mamba_split_conv1d_scan_combined"}
VERSIONS = {"fla": "0.6.0", "causal_conv1d": "1.7.0", "mamba_ssm": "2.3.2.post1"}


def _kernel_side(t: torch.Tensor) -> list:
    """A fake kernel reading its argument: on a GPU that read happens on the device, not the host."""
    with _disable_current_modes():
        return _TOLIST(t.detach())


def fla_chunk_indices(cu: list[int], chunk: int = 64) -> list[list[int]]:
    """fla 0.6.0 ``prepare_chunk_indices``: ``[document, chunk within it]`` for every ``chunk``-token chunk."""
    return [[i, j] for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])) for j in range(math.ceil((b - a) / chunk))]


class Fakes:
    """Fake kernel packages for one modeling module; ``calls`` records the varlen arguments each got."""

    def __init__(self, mixer_cls: type):
        self.calls: list[tuple[str, dict]] = []
        self.ref = {name: _hf.kernel_reference(mixer_cls, name) for name in _PACKAGE_NAME
                    if _hf.kernel_global(mixer_cls, name) is not None}

    def varlen_calls(self, kernel: str) -> list[dict]:
        return [kw for k, kw in self.calls if k == kernel and kw]

    def causal_conv1d_fn(self, x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                         final_states_out=None, activation=None):
        batch, dim, seqlen = x.shape
        width = weight.shape[1]
        if seq_idx is not None:
            assert x.stride(1) == 1 and x.stride(2) > 1, "causal-conv1d: seq_idx needs channel-last x"
            assert seq_idx.dtype == torch.int32 and seq_idx.is_contiguous() and seq_idx.shape == (batch, seqlen)
            assert initial_states is None and not return_final_states
            self.calls.append(("conv", dict(seq_idx=_kernel_side(seq_idx))))
        ids = seq_idx if seq_idx is not None else torch.zeros(batch, seqlen, dtype=torch.int32)
        xw = F.pad(x, (width - 1, 0)).unfold(-1, width, 1)  # (B, D, T, W)
        idw = torch.cat([ids.new_full((batch, width - 1), -1), ids], -1).unfold(-1, width, 1)  # (B, T, W)
        same = (idw == ids.unsqueeze(-1)).unsqueeze(1)  # (B, 1, T, W): taps inside the token's own document
        out = (xw * same * weight.view(1, dim, 1, width)).sum(-1)  # (B, D, T)
        if bias is not None:
            out = out + bias.view(1, dim, 1)
        return F.silu(out) if activation in ("silu", "swish") else out

    def chunk_gated_delta_rule(self, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None,
                               chunk_indices=None, **kwargs):
        ref = self.ref["torch_chunk_gated_delta_rule"]
        if cu_seqlens is None:
            return ref(q, k, v, g=g, beta=beta, initial_state=initial_state, output_final_state=output_final_state,
                       use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        assert q.shape[0] == 1, "fla: batch 1 with cu_seqlens"
        assert initial_state is None and scale is None and not output_final_state
        cu = _kernel_side(cu_seqlens)
        self.calls.append(("gdn", dict(cu_seqlens=cu, chunk_indices=_kernel_side(chunk_indices),
                                       cu_seqlens_cpu=_kernel_side(cu_seqlens_cpu))))
        outs = [ref(q[:, a:b], k[:, a:b], v[:, a:b], g=g[:, a:b], beta=beta[:, a:b],
                    use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)[0] for a, b in zip(cu[:-1], cu[1:])]
        return torch.cat(outs, dim=1), None

    def mamba_chunk_scan_combined(self, x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                                  initial_states=None, seq_idx=None, cu_seqlens=None, dt_softplus=False,
                                  dt_limit=(0.0, float("inf")), return_final_states=False,
                                  return_varlen_states=False):
        ref = self.ref["mamba2_chunk_scan"]
        common = dict(D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)
        if seq_idx is None:
            return ref(x, dt, A, B, C, chunk_size, initial_states=initial_states,
                       return_final_states=return_final_states, **common)
        assert x.shape[0] == 1 and seq_idx.dtype == torch.int32 and seq_idx.shape == x.shape[:2]
        assert initial_states is None and not return_final_states and z is None
        ids = _kernel_side(seq_idx)[0]
        self.calls.append(("scan", dict(seq_idx=[ids])))
        starts = [t for t in range(len(ids)) if t == 0 or ids[t] != ids[t - 1]] + [len(ids)]
        outs = [ref(x[:, a:b], dt[:, a:b], A, B[:, a:b], C[:, a:b], chunk_size, **common)
                for a, b in zip(starts[:-1], starts[1:])]
        return torch.cat(outs, dim=1)

    def mamba_split_conv1d_scan_combined(self, zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                                         initial_states=None, seq_idx=None, **kwargs):
        self.calls.append(("fused", dict(seq_idx=_kernel_side(seq_idx)) if seq_idx is not None else {}))
        return None


def install(monkeypatch, model_type: str, versions: dict | None = None, skip: tuple[str, ...] = ()) -> Fakes:
    """Fake packages for ``model_type``'s kernels, resolved by transformers' own decorator; returns the fakes."""
    from transformers.integrations import hub_kernels
    from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

    mixer_cls = _mixer_class(model_type)
    module = sys.modules[mixer_cls.__module__]
    fakes = Fakes(mixer_cls)
    versions = {**VERSIONS, **(versions or {})}
    for name, package in _hf.VARLEN_KERNELS[facts_for(model_type).varlen]:
        if package in skip:
            continue
        fake_pkg = sys.modules.get(package)
        if not getattr(fake_pkg, "_fastkit_fake", False):
            fake_pkg = types.ModuleType(package)
            fake_pkg._fastkit_fake, fake_pkg.__version__ = True, versions[package]
            monkeypatch.setitem(sys.modules, package, fake_pkg)
        setattr(fake_pkg, _PACKAGE_NAME[name], getattr(fakes, _PACKAGE_NAME[name]))
        # transformers 5.25 sends a package's calls on CPU tensors to the torch reference (and refuses seq_idx
        # there): the fakes run on the CPU, so their packages are unlisted, as "runs on every device".
        monkeypatch.delitem(getattr(hub_kernels, "_PACKAGE_SUPPORTED_DEVICES", {}), package, raising=False)
        wrapper = use_kernel_func_from_hub_with_fallback(_PACKAGE_NAME[name], package)(fakes.ref[name])
        monkeypatch.setattr(module, name, wrapper)
    return fakes


def _mixer_class(model_type: str) -> type:
    model = twin(model_type)
    names = facts_for(model_type).stateful
    return next(type(m) for m in model.modules() if type(m).__name__ in names)


def _no_regroup(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the per-document regroup ran although the varlen kernels were available")

    monkeypatch.setattr(packing_state, "run_per_document", refuse)


def _pair(model_type):
    base = twin(model_type)
    patched = copy.deepcopy(base)
    FastModel.patch(patched, patches=["packing"])
    return base, patched


def _expected(lengths=LENGTHS):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu, [[i for i, n in enumerate(lengths) for _ in range(n)]]


@pytest.mark.parametrize("model_type", VARLEN_FAMILIES)
def test_varlen_kernels_get_the_boundaries_and_match_the_per_document_path(model_type, monkeypatch):
    """Logits equal each document run alone; logits and every gradient equal fastkit's per-document regroup
    (proven against each document alone in test_packing_state) on the same model; 0 syncs."""
    fakes = install(monkeypatch, model_type)
    base, patched = _pair(model_type)
    ids, pos, w = _batch()

    def packed():
        return patched(input_ids=ids, position_ids=pos, use_cache=False, **{LENGTHS_KWARG: [LENGTHS]}).logits

    alone = _per_doc(base, ids, LENGTHS).detach()
    want, want_g = _step(patched, packed, w)  # inputs on the CPU: the regroup
    assert not any(kw for _, kw in fakes.calls)  # one document per call: no varlen arguments anywhere
    monkeypatch.setattr(varlen, "on_cuda", lambda t: True)
    _no_regroup(monkeypatch)
    with SyncCounter(profile=True) as syncs:
        got, got_g = _step(patched, packed, w)
    torch.testing.assert_close(got, alone, **TIGHT)
    torch.testing.assert_close(got, want, **TIGHT)
    # per tensor, 5e-5 of its largest entry: the two paths differ only in summation order (flattened rows,
    # conv taps), which depends on the CPU's SIMD width (1.5e-5 seen on A_log on one Xeon, below 1e-5 on
    # another); each-document-alone is 10x farther on gated DeltaNet's decay parameters (GRADS there)
    assert_grads_close(got_g, want_g, rtol=5e-5, atol=1e-7, per="tensor")
    assert syncs.total == 0, syncs.by_op
    cu, seq_idx = _expected()
    kind = facts_for(model_type).varlen
    conv = fakes.varlen_calls("conv")
    assert conv and all(kw["seq_idx"] == seq_idx for kw in conv)
    if kind == "gated_delta":
        gdn = fakes.varlen_calls("gdn")
        assert gdn and all(kw == dict(cu_seqlens=cu, chunk_indices=fla_chunk_indices(cu), cu_seqlens_cpu=cu)
                           for kw in gdn)
    if kind == "mamba2":
        scan = fakes.varlen_calls("scan")
        assert scan and all(kw["seq_idx"] == seq_idx for kw in scan)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "lfm2", "bamba"])
def test_an_off_by_one_boundary_goes_red(model_type, monkeypatch):
    """The break: the first boundary one token late in cu_seqlens / seq_idx / chunk_indices must show."""
    install(monkeypatch, model_type)
    monkeypatch.setattr(varlen, "on_cuda", lambda t: True)
    base, patched = _pair(model_type)
    real = varlen.host_arrays
    monkeypatch.setattr(varlen, "host_arrays", lambda lengths, **kw: real([[row[0] + 1, row[1] - 1, *row[2:]]
                                                                          for row in lengths], **kw))
    ids, pos, _ = _batch()
    with torch.no_grad():
        want = _per_doc(base, ids, LENGTHS)
        got = patched(input_ids=ids, position_ids=pos, use_cache=False, **{LENGTHS_KWARG: [LENGTHS]}).logits
    assert (got - want).abs().max().item() > 1e-4


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "bamba"])
def test_two_rows_run_as_one_varlen_row_and_training_hands_the_fused_kernel_seq_idx(model_type, monkeypatch):
    """Documents of two packed rows, flattened into one kernel row; in training mode Mamba-2 mixers call
    mamba-ssm's fused split-conv-scan first: it must get the same ``seq_idx``."""
    fakes = install(monkeypatch, model_type)
    monkeypatch.setattr(varlen, "on_cuda", lambda t: True)
    base, patched = _pair(model_type)
    for model in (base, patched):
        model.train()
    _no_regroup(monkeypatch)
    rows = [[30, 2, 16], [5, 40, 3]]
    ids = torch.randint(3, 300, (2, 48), generator=torch.Generator().manual_seed(1))
    pos = torch.stack([torch.cat([torch.arange(n) for n in r]) for r in rows])  # (2, T)
    with torch.no_grad():
        want = torch.cat([_per_doc(base, ids[i:i + 1], r) for i, r in enumerate(rows)])
        fakes.calls.clear()
        got = patched(input_ids=ids, position_ids=pos, use_cache=False, **{LENGTHS_KWARG: rows}).logits
    torch.testing.assert_close(got, want, **TIGHT)
    cu, seq_idx = _expected([n for r in rows for n in r])
    assert fakes.varlen_calls("conv") and all(kw["seq_idx"] == seq_idx for kw in fakes.varlen_calls("conv"))
    if model_type == "bamba":
        assert [kw["seq_idx"] for kw in fakes.varlen_calls("fused")] == [seq_idx]
    else:
        assert [kw["cu_seqlens"] for kw in fakes.varlen_calls("gdn")] == [cu]


def test_host_arrays_are_fla_and_causal_conv1d_layouts():
    lengths = [[64, 65, 1], [130]]
    cu, seq_idx, chunks = varlen.host_arrays(lengths)
    assert cu.tolist() == [0, 64, 129, 130, 260]
    assert seq_idx.tolist() == [0] * 64 + [1] * 65 + [2] + [3] * 130
    assert chunks.tolist() == fla_chunk_indices(cu.tolist()) == [[0, 0], [1, 0], [1, 1], [2, 0], [3, 0], [3, 1],
                                                                  [3, 2]]


def _fallback_case(monkeypatch, case: str) -> Fakes:
    if case == "old fla":
        return install(monkeypatch, "qwen3_5_text", versions={"fla": "0.5.0"})
    if case == "no mamba-ssm":
        return install(monkeypatch, "bamba", skip=("mamba_ssm",))
    if case == "transformers unchecked":
        monkeypatch.setattr(_hf, "VARLEN_TRANSFORMERS", ("4.0", "4.1"))  # a range no installed release is in
        return install(monkeypatch, "lfm2")
    return install(monkeypatch, "lfm2")  # "not on CUDA": on_cuda stays False


@pytest.mark.parametrize("case, model_type, why", [
    ("old fla", "qwen3_5_text", "fla 0.5.0 outside the checked range"),
    ("no mamba-ssm", "bamba", "mamba2_chunk_scan runs transformers' torch reference"),
    ("transformers unchecked", "lfm2", "not checked"),
    ("not on CUDA", "lfm2", "inputs not on CUDA"),
])
def test_a_failed_check_takes_the_per_document_regroup_and_says_why(case, model_type, why, monkeypatch, caplog):
    fakes = _fallback_case(monkeypatch, case)
    if case != "not on CUDA":
        monkeypatch.setattr(varlen, "on_cuda", lambda t: True)
    base, patched = _pair(model_type)
    ids, pos, _ = _batch()
    monkeypatch.setattr(packing_attention, "_LOGGED", set())  # log_once: a fresh process
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="fastkit"):
        want = _per_doc(base, ids, LENGTHS)
        got = patched(input_ids=ids, position_ids=pos, use_cache=False, **{LENGTHS_KWARG: [LENGTHS]}).logits
    torch.testing.assert_close(got, want, **TIGHT)
    assert not any(kw for _, kw in fakes.calls)  # no kernel got varlen arguments: the regroup ran
    assert any("per-document regroup" in r.getMessage() and why in r.getMessage() for r in caplog.records), \
        [r.getMessage() for r in caplog.records]


def test_the_varlen_path_is_logged_once(monkeypatch, caplog):
    install(monkeypatch, "lfm2")
    monkeypatch.setattr(varlen, "on_cuda", lambda t: True)
    _, patched = _pair("lfm2")
    ids, pos, _ = _batch()
    monkeypatch.setattr(packing_attention, "_LOGGED", set())
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="fastkit"):
        for _ in range(2):
            patched(input_ids=ids, position_ids=pos, use_cache=False, **{LENGTHS_KWARG: [LENGTHS]})
    said = [r.getMessage() for r in caplog.records if "Lfm2ShortConv" in r.getMessage()]
    assert said == ["fastkit packing: Lfm2ShortConv restarts per document inside the varlen kernels "
                    "(seq_idx / cu_seqlens)"]


def test_families_without_a_varlen_kernel_say_so():
    assert {f for f in HYBRID_FAMILIES if not facts_for(f).varlen} == {"jamba", "kimi_linear"}
    assert "no varlen kernel" in varlen.decide(torch.nn.Linear(1, 1), "")


def test_the_hybrid_cuda_extra_pins_the_checked_ranges():
    from pathlib import Path

    import tomllib

    extra = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["hybrid-cuda"]
    want = [f"{dists[-1]}>={lo},<{hi}" for dists, lo, hi in _hf.VARLEN_PACKAGES.values()]
    assert sorted(extra) == sorted(want)
