"""Packed stateful layers on CUDA: one call of the varlen kernels transformers already uses, not a regroup.

What it replaces. :mod:`fastkit.patches.packing.state` makes every stateful layer exact under packing by
regrouping the tokens into per-document rows (one gather, one padded call, one scatter per layer). On CUDA,
where the packages these mixers rely on are installed, transformers 5.24 already calls their kernels
(resolved once at import, see ``fastkit._hf.VARLEN_KERNELS``) and forwards the mixer's ``**kwargs`` to
them, filtered by each kernel's signature. Those kernels restart the state themselves when told where
documents start, so a packed batch runs in one call: the mixer's unchanged forward on the batch flattened
to one row ``(1, B*T, H)`` (documents never cross a row boundary, and every other op of the mixer is
per token), with

- ``seq_idx``: int32 ``(1, B*T)``, the document index of every token → causal-conv1d ``causal_conv1d_fn``
  (the conv window never reads another document; channel-last input, which these mixers give) and
  mamba-ssm ``mamba_chunk_scan_combined`` / ``mamba_split_conv1d_scan_combined`` (SSM state restarts);
- ``cu_seq_lens_q``: int64 ``(N+1,)`` cumulative lengths (transformers hands it to flash-linear-attention's
  ``chunk_gated_delta_rule(cu_seqlens=)``), with ``chunk_indices`` int64 ``(NT, 2)`` = ``[document, chunk
  within it]`` for fla's chunk size, built on the host: fla 0.6.0 would otherwise derive them from
  ``cu_seqlens`` (a device read, or with ``cu_seqlens_cpu`` a blocking host-to-device copy) in every layer.
  ``cu_seqlens_cpu`` (host) is passed as well, as fla documents it.

All of it comes from the batch's host lengths: one numpy build, one H2D copy through pinned memory
(``_host_to_device``), cached in the :class:`PackedBatch` like the regroup plan: no host syncs, shared by
every layer and by the checkpoint recompute.

Dispatch (per mixer, decided at patch time, logged once per class and path): the row's ``varlen`` kind,
transformers in the checked range, every kernel of that kind resolved to its package (not the torch
reference), each package version in the checked range (``fastkit._hf.VARLEN_PACKAGES``); then at call time
the hidden states on CUDA. Anything else takes the per-document regroup, which is exact everywhere.
Mamba-1 (Jamba: ``selective_scan_fn`` has no ``seq_idx``) and Kimi delta attention (fla 0.6.0 ``chunk_kda``
takes no ``chunk_indices``: its varlen path costs a blocking copy per batch) stay on the regroup.

What must not change: the varlen path computes what each document alone computes (the kernels' own varlen
semantics; tests/test_packing_varlen.py proves the dispatch against fakes with those semantics on the CPU,
tests/gpu/test_packing_varlen_gpu.py the real kernels against the regroup); an unpacked batch never gets
here; nothing is passed that the mixer's kernels do not take.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from fastkit import _hf
from fastkit.patches.packing.attention import PackedBatch, _host_to_device, log_once

logger = logging.getLogger(__name__)

FLA_CHUNK = 64
"""fla's ``chunk_gated_delta_rule`` chunk size: its default, which transformers 5.24 does not override."""


@dataclass(eq=False)
class VarlenArgs:
    """The varlen kernel arguments of one packed batch on one device."""

    seq_idx: torch.Tensor
    """int32 ``(1, B*T)``: document index of every token of the flattened batch."""
    cu_seqlens: torch.Tensor
    """int64 ``(N+1,)``: cumulative document lengths over the flattened batch."""
    chunk_indices: torch.Tensor
    """int64 ``(NT, 2)``: ``[document, chunk within the document]`` per ``FLA_CHUNK``-token chunk."""
    cu_seqlens_cpu: torch.Tensor
    """``cu_seqlens`` on the host."""

    def kwargs(self, kind: str) -> dict:
        """What a mixer of ``kind`` receives (transformers passes each kernel the ones it takes)."""
        if kind == "gated_delta":
            return dict(seq_idx=self.seq_idx, cu_seq_lens_q=self.cu_seqlens, chunk_indices=self.chunk_indices,
                        cu_seqlens_cpu=self.cu_seqlens_cpu)
        return dict(seq_idx=self.seq_idx)


def host_arrays(lengths: list[list[int]], chunk: int = FLA_CHUNK) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(cu_seqlens (N+1,), seq_idx (B*T,), chunk_indices (NT, 2))`` as int64 numpy, from host lengths."""
    flat = np.array([n for row in lengths for n in row], dtype=np.int64)  # (N,)
    cu = np.concatenate([[0], np.cumsum(flat)]).astype(np.int64)  # (N+1,)
    seq_idx = np.repeat(np.arange(flat.size, dtype=np.int64), flat)  # (B*T,)
    chunks = -(-flat // chunk)  # (N,): ceil(n / chunk)
    doc = np.repeat(np.arange(flat.size, dtype=np.int64), chunks)  # (NT,)
    first = np.concatenate([[0], np.cumsum(chunks)[:-1]]).astype(np.int64)  # (N,): first chunk of each doc
    within = np.arange(doc.size, dtype=np.int64) - first[doc]  # (NT,)
    return cu, seq_idx, np.stack([doc, within], axis=1)  # (NT, 2)


def varlen_args(meta: PackedBatch, device: torch.device) -> VarlenArgs:
    """This batch's :class:`VarlenArgs` on ``device``: built on first use, kept in ``meta`` (its lifetime)."""
    key = ("varlen", device)
    if key not in meta._cache:
        cu, seq_idx, chunks = host_arrays(meta.lengths)
        dev = _host_to_device(torch.from_numpy(np.concatenate([cu, seq_idx, chunks.reshape(-1)])), device)
        n, t = cu.size, seq_idx.size
        meta._cache[key] = VarlenArgs(
            seq_idx=dev[n:n + t].to(torch.int32).view(1, t),  # (1, B*T): a device cast, no host read
            cu_seqlens=dev[:n],  # (N+1,)
            chunk_indices=dev[n + t:].view(-1, 2),  # (NT, 2)
            cu_seqlens_cpu=torch.from_numpy(cu))
    return meta._cache[key]


def on_cuda(t: torch.Tensor) -> bool:
    """Whether ``t`` lives where the varlen kernels run (the CPU tests emulate it)."""
    return t.is_cuda


def decide(module: torch.nn.Module, kind: str) -> str | None:
    """Why ``module`` cannot take the varlen kernels (None: it can, for CUDA inputs)."""
    if not kind:
        return "its family has no varlen kernel in fastkit (Mamba-1 scan, Kimi delta attention)"
    return _hf.varlen_unavailable(type(module), kind)


def run_varlen(fn: Callable, hidden: torch.Tensor, rest: dict, meta: PackedBatch, kind: str) -> torch.Tensor:
    """The mixer ``fn`` on the packed batch flattened to one row, with the kernels' varlen arguments."""
    rows, row_len, width = hidden.shape
    extra = varlen_args(meta, hidden.device).kwargs(kind)
    out = fn(hidden_states=hidden.reshape(1, rows * row_len, width), **rest, **extra)  # (1, B*T, Ho)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"stateful layer returned {type(out).__name__}, not a tensor")
    return out.view(rows, row_len, -1)  # (B, T, Ho)


def log_path(name: str, reason: str | None, cuda: bool) -> None:
    """Log once per class and path which one a packed batch of this layer took."""
    if reason is None and cuda:
        log_once(f"varlen:{name}", "fastkit packing: %s restarts per document inside the varlen kernels "
                 "(seq_idx / cu_seqlens)", name)
    else:
        why = reason or "inputs not on CUDA"
        log_once(f"regroup:{name}:{why}", "fastkit packing: %s restarts per document by the per-document regroup "
                 "(%s)", name, why)


__all__ = ["FLA_CHUNK", "VarlenArgs", "decide", "host_arrays", "log_path", "on_cuda", "run_varlen", "varlen_args"]
