"""Packed attention kernels: attention within each document of a packed row, never a T×T mask.

Pure torch. Called by :mod:`fastkit.patches.packing.patch` (the transformers glue) with one
:class:`PackedBatch` (defined here) per forward. Every kernel takes transformers' layout — query
``(B, Hq, T, D)``, key/value ``(B, Hkv, T, Dv)`` — and returns ``(B, T, Hq, Dv)`` (what the attention
interface returns), and computes exactly what the unpatched model computes for each document alone:

- ``varlen_flash_attn``: flash-attn 2 ``flash_attn_varlen_func`` (CUDA, fp16/bf16), GQA native,
  sliding window and softcap native;
- ``varlen_torch``: ``torch.nn.attention.varlen.varlen_attn`` (CUDA sm80+, fp16/bf16, torch ≥ 2.10),
  GQA native; no dropout, no softcap, no sinks. Its keywords changed per release, so only those the
  installed signature has are passed (:func:`varlen_params`); a call needing one it lacks (a window or a
  non-default scale on 2.10) takes ``sdpa_per_doc``;
- ``sdpa_per_doc``: one ``scaled_dot_product_attention(is_causal=True)`` per document (views, no
  copies; GQA via ``enable_gqa``); a document longer than a sliding window gets a cached band mask of
  its own length only;
- ``eager_per_doc``: the eager softmax per document, for what SDPA cannot express (GPT-OSS
  attention sinks, Gemma-style logit soft-capping); masks are per document length, cached per batch.

What must not change: numerics per document (fp32 tight against unpatched), gradients through
every input (q, k, v and the sinks), the window convention of transformers (a query at ``i`` sees
keys ``j`` with ``i - W < j <= i``, i.e. flash ``window_size=(W - 1, 0)``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from fastkit.errors import FastkitError

logger = logging.getLogger(__name__)

_LOGGED: set[str] = set()


def log_once(key: str, msg: str, *args) -> None:
    """Log an explicit fallback once per process (not once per layer)."""
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.info(msg, *args)


@dataclass(eq=False)
class PackedBatch:
    """Where the documents of one packed batch are.

    Built once per forward by :mod:`fastkit.patches.packing.patch`; see Note [packed metadata lifetime] there.
    """

    rows: int
    """Batch size B (rows of the packed input)."""
    row_len: int
    """Tokens per row T."""
    lengths_host: list[list[int]] | None
    """Per-row document lengths (Python ints; each row sums to T), or None until read from ``cu_device``."""
    max_seqlen: int
    """Longest document, a Python int (varlen kernels need it on the host)."""
    cu_device: torch.Tensor | None = None
    """Cumulative lengths already on the device (TRL's ``cu_seq_lens_q``), used when host lengths are absent."""
    cu_host: torch.Tensor | None = None
    """int64 host cumulative lengths over the flattened rows: what the compiled path's operator takes
    (:mod:`fastkit.patches.packing.compiled`); built with the batch from host lengths."""
    calls: int = 0
    """Attention calls that ran with this batch (Note [attention ran per document] in patch.py)."""
    compiled_calls: torch.Tensor | None = None
    """The same count for calls inside a compiled layer (``compile="regions"``): a 0-dim int64 host tensor the
    compiled code adds to, since an int attribute would be a guard of the graph (a recompile per layer)."""
    _cache: dict = field(default_factory=dict, repr=False)

    def counted_calls(self) -> int:
        """What the per-document check needs (was any call packed?): :attr:`calls`, or where none was counted
        eagerly (every layer compiled), :attr:`compiled_calls`. An eager forward never reads the tensor, so a
        zero-sync step stays one."""
        if self.calls or self.compiled_calls is None:
            return self.calls
        return int(self.compiled_calls.numpy())  # a host tensor the compiled layers wrote: no device involved

    @property
    def lengths(self) -> list[list[int]]:
        """Per-row lengths. Reading them from a device ``cu_device`` costs one sync, once per batch."""
        if self.lengths_host is None and self.cu_device is None:
            raise FastkitError("this packed batch carries its layout only as a tensor (traced by torch.compile: "
                               "patches/packing/patch.py, Note [compiled packing]); a layer that needs the host "
                               "lengths (per-document mrope) cannot run packed under compile yet.")
        if self.lengths_host is None:
            log_once("cu_sync", "fastkit packing: document lengths read back from cu_seq_lens_q (1 host sync "
                     "per batch); wrap the collator with fastkit.patches.packing.wrap_collator to make it zero")
            self.lengths_host = [lengths_from_cu(self.cu_device.tolist(), self.row_len, "cu_seq_lens_q")]
        return self.lengths_host

    def spans(self) -> list[list[tuple[int, int]]]:
        """Per row, ``(start, length)`` of each document (host ints, cached)."""
        if "spans" not in self._cache:
            out = []
            for row in self.lengths:
                starts = np.concatenate([[0], np.cumsum(row)[:-1]]).tolist()
                out.append(list(zip(starts, row)))
            self._cache["spans"] = out
        return self._cache["spans"]

    def cu_seqlens(self, device: torch.device) -> torch.Tensor:
        """int32 cumulative lengths over the flattened ``B*T`` tokens, on ``device``: this batch's own copy.

        One asynchronous H2D copy per batch (pinned host memory on CUDA: no host sync). See Note: [private cu].
        """
        key = ("cu", device)
        if key not in self._cache:
            if self.lengths_host is None and self.cu_device is not None and self.rows == 1:
                cu = self.cu_device.to(dtype=torch.int32)
                # (num_docs + 1,): a copy even when the caller's tensor is int32 on `device` already
                cu = cu.clone() if cu.device == device else _host_to_device(cu, device)
            else:
                flat = [n for row in self.lengths for n in row]
                cu = torch.from_numpy(np.concatenate([[0], np.cumsum(flat)]).astype(np.int32))
                cu = _host_to_device(cu, device)  # (num_docs + 1,)
            self._cache[key] = cu
        return self._cache[key]

    def band_mask(self, length: int, window: int, device: torch.device) -> torch.Tensor:
        """Bool ``(L, L)`` causal sliding-window mask (True = attend) for one document length."""
        key = ("band", length, window, device)
        if key not in self._cache:
            i = torch.arange(length, device=device)
            diff = i[:, None] - i[None, :]  # (L, L): query - key
            self._cache[key] = (diff >= 0) & (diff < window)
        return self._cache[key]

    def additive_mask(self, length: int, window: int | None, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
        """Float ``(L, L)`` mask as transformers' eager: 0 where attended, ``finfo.min`` elsewhere."""
        window = window if window is not None and 0 < window < length else length
        key = ("add", length, window, dtype, device)
        if key not in self._cache:
            allowed = self.band_mask(length, window, device)
            zero = torch.zeros((), dtype=dtype, device=device)
            self._cache[key] = torch.where(allowed, zero, torch.finfo(dtype).min)  # (L, L)
        return self._cache[key]


# Note: [private cu]
# The batch owns its cumulative lengths. A caller's ``cu_seq_lens_q`` that is already int32 on the device
# would be *aliased* by ``.to(device, int32)``; a collator that refills that buffer for the next batch
# before this backward ran would move the boundaries the checkpoint recompute sees (wrong gradients,
# silently). So the device tensor is always a copy made at the first forward use. A copy from host
# lengths goes through pinned memory with ``non_blocking=True``: a pageable (or blocking) H2D copy
# makes the host wait for the stream, a sync every batch. The pinned staging block is kept alive by
# the caching host allocator until the copy's event passes.


def _host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (CPU) on ``device`` without a host sync; a copy even when ``device`` is the CPU."""
    if device.type == "cpu":
        return host.clone()
    if device.type == "cuda" and torch.cuda.is_available():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def lengths_from_cu(cu: Sequence[int], row_len: int, name: str) -> list[int]:
    """Document lengths from host cumulative lengths ``cu`` (validated against the row length)."""
    lengths = [int(b) - int(a) for a, b in zip(cu[:-1], cu[1:])]
    if not cu or int(cu[0]) != 0 or any(n <= 0 for n in lengths) or sum(lengths) != row_len:
        raise FastkitError(f"{name} must start at 0, increase strictly and end at the row length {row_len}; "
                           f"got {list(cu)[:8]}{'...' if len(cu) > 8 else ''}.")
    return lengths



def _flash_attn_varlen():
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:  # ImportError, or a broken CUDA extension
        return None
    return flash_attn_varlen_func


def _torch_varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


_VARLEN_PARAMS: dict = {}


def varlen_params(fn) -> frozenset[str]:
    """Keyword parameters of a ``varlen_attn`` (inspected once per function object, cached).

    Checked signatures (keyword-only unless said): torch 2.10 ``is_causal`` (positional-or-keyword),
    ``return_aux``; 2.11 ``return_aux, scale, window_size``; 2.13 adds ``enable_gqa``, ``seqused_k``,
    ``block_table``, ``num_splits``. tests/test_gpu_paths_on_cpu.py writes each one out.
    """
    if fn not in _VARLEN_PARAMS:
        import inspect

        _VARLEN_PARAMS[fn] = frozenset(inspect.signature(fn).parameters)
    return _VARLEN_PARAMS[fn]


def _default_scale(scaling: float | None, head_dim: int) -> bool:
    return scaling is None or abs(scaling - head_dim ** -0.5) <= 1e-6 * head_dim ** -0.5


def varlen_missing(params: frozenset[str], *, head_dim: int, scaling: float | None,
                   window_size: tuple[int, int]) -> str | None:
    """The feature this call needs that a ``varlen_attn`` with ``params`` lacks, or None when it can run."""
    if "window_size" not in params:
        if window_size != (-1, 0):
            return "window_size (sliding window)"
        if "is_causal" not in params:
            return "causal masking"
    if "scale" not in params and not _default_scale(scaling, head_dim):
        return "scale (non-default softmax scale)"
    return None


def varlen_kwargs(params: frozenset[str], *, heads_q: int, heads_kv: int, scaling: float | None,
                  window_size: tuple[int, int]) -> dict:
    """Keywords for a ``varlen_attn`` with ``params``: only those it has (see :func:`varlen_params`)."""
    kw: dict = {"window_size": window_size} if "window_size" in params else {"is_causal": True}
    if "scale" in params:
        kw["scale"] = scaling
    if "enable_gqa" in params:  # older signatures: the flash kernel takes fewer k/v heads natively
        kw["enable_gqa"] = heads_kv != heads_q
    return kw


def _capability(q: torch.Tensor) -> tuple[int, int] | None:
    """CUDA compute capability of ``q``'s device, None off CUDA (a seam: CPU tests force a T4 or an H200)."""
    return torch.cuda.get_device_capability(q.device) if q.is_cuda else None


def _varlen_shapes_ok(q: torch.Tensor, v: torch.Tensor) -> bool:
    d, dv = q.shape[-1], v.shape[-1]
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and d == dv and d <= 256 and d % 8 == 0


def pick_kernel(q: torch.Tensor, v: torch.Tensor, *, dropout: float, softcap: float | None,
                sinks: torch.Tensor | None, scaling: float | None = None, window: int | None = None,
                meta: PackedBatch | None = None) -> str:
    """The fastest exact kernel for this call (names as in the module docstring)."""
    if sinks is not None:
        log_once("sinks", "fastkit packing: attention sinks -> per-document eager attention (exact; "
                 "no varlen kernel here takes learned sinks with gradients)")
        return "eager_per_doc"
    if _varlen_shapes_ok(q, v) and _flash_attn_varlen() is not None:
        return "varlen_flash_attn"
    if softcap:
        log_once("softcap", "fastkit packing: logit soft-capping without flash-attn -> per-document eager")
        return "eager_per_doc"
    cap, fn = _capability(q), _torch_varlen()
    if _varlen_shapes_ok(q, v) and dropout == 0.0 and fn is not None and cap is not None and cap >= (8, 0):
        missing = varlen_missing(varlen_params(fn), head_dim=q.shape[-1], scaling=scaling,
                                 window_size=_window_size(window, meta))
        if missing is None:
            return "varlen_torch"
        log_once(f"varlen_{missing}", "fastkit packing: this torch's varlen_attn has no %s -> per-document SDPA",
                 missing)
    if q.is_cuda:
        log_once("sdpa_cuda", "fastkit packing: no varlen kernel for %s/%s head dims %d/%d -> per-document "
                 "SDPA", q.dtype, q.device, q.shape[-1], v.shape[-1])
    return "sdpa_per_doc"


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: PackedBatch, *,
                     scaling: float | None, dropout: float = 0.0, window: int | None = None,
                     softcap: float | None = None, sinks: torch.Tensor | None = None,
                     training: bool = False) -> torch.Tensor:
    """Attention within each document of ``meta``; returns ``(B, T, Hq, Dv)``."""
    kernel = pick_kernel(q, v, dropout=dropout, softcap=softcap, sinks=sinks, scaling=scaling, window=window,
                         meta=meta)
    if kernel == "varlen_flash_attn":
        return varlen_flash_attn(q, k, v, meta, scaling=scaling, dropout=dropout, window=window, softcap=softcap)
    if kernel == "varlen_torch":
        return varlen_torch(q, k, v, meta, scaling=scaling, window=window)
    if kernel == "eager_per_doc":
        return eager_per_doc(q, k, v, meta, scaling=scaling, dropout=dropout, window=window, softcap=softcap,
                             sinks=sinks, training=training)
    return sdpa_per_doc(q, k, v, meta, scaling=scaling, dropout=dropout, window=window)


def _flat(x: torch.Tensor) -> torch.Tensor:
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b * t, h, d)  # (B, H, T, D) -> (B*T, H, D)


def _window_size(window: int | None, meta: PackedBatch | None) -> tuple[int, int]:
    """Flash ``(left, right)``: a query at ``i`` sees keys ``i - left .. i`` (``-1``: unbounded)."""
    if window is None or window <= 0 or (meta is not None and meta.max_seqlen <= window):
        return (-1, 0)  # plain causal: no document is longer than the window
    return (window - 1, 0)


def varlen_flash_attn(q, k, v, meta: PackedBatch, *, scaling, dropout, window, softcap) -> torch.Tensor:
    """flash-attn 2 varlen over the flattened rows: one kernel launch per layer, cu_seqlens from the batch."""
    fn = _flash_attn_varlen()
    b, hq, t, _ = q.shape
    cu = meta.cu_seqlens(q.device)
    out = fn(_flat(q), _flat(k), _flat(v), cu, cu, meta.max_seqlen, meta.max_seqlen, dropout_p=dropout,
             softmax_scale=scaling, causal=True, window_size=_window_size(window, meta),
             softcap=float(softcap or 0.0))  # (B*T, Hq, Dv)
    return out.view(b, t, hq, v.shape[-1])


def varlen_torch(q, k, v, meta: PackedBatch, *, scaling, window) -> torch.Tensor:
    """``torch.nn.attention.varlen.varlen_attn`` (flash backend in torch; causal is ``window_size=(-1, 0)``)."""
    fn = _torch_varlen()
    b, hq, t, _ = q.shape
    cu = meta.cu_seqlens(q.device)
    kw = varlen_kwargs(varlen_params(fn), heads_q=hq, heads_kv=k.shape[1], scaling=scaling,
                       window_size=_window_size(window, meta))
    out = fn(_flat(q), _flat(k), _flat(v), cu, cu, meta.max_seqlen, meta.max_seqlen, **kw)  # (B*T, Hq, Dv)
    return out.view(b, t, hq, v.shape[-1])


def sdpa_per_doc(q, k, v, meta: PackedBatch, *, scaling, dropout, window) -> torch.Tensor:
    """One causal SDPA per document on views of q/k/v; outputs concatenated back in order.

    GQA is native (``enable_gqa``) on CPU and sm80+; before sm80 (T4) SDPA's memory-efficient kernel
    has no GQA, so each document's k/v are repeated instead (a copy of that document only).
    """
    n_rep = q.shape[1] // k.shape[1]
    cap = _capability(q)
    native_gqa = cap is None or cap >= (8, 0)
    gqa = n_rep > 1 and native_gqa
    rows = []
    for b, spans in enumerate(meta.spans()):
        outs = []
        for start, length in spans:
            sl = slice(start, start + length)
            qd, kd, vd = q[b:b + 1, :, sl], k[b:b + 1, :, sl], v[b:b + 1, :, sl]  # (1, H, L, D)
            if n_rep > 1 and not native_gqa:
                kd, vd = _repeat_kv(kd, n_rep), _repeat_kv(vd, n_rep)  # (1, Hq, L, D)
            if window is not None and 0 < window < length:
                mask = meta.band_mask(length, window, q.device)  # (L, L) bool, cached per batch
                outs.append(F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, dropout_p=dropout,
                                                           scale=scaling, enable_gqa=gqa))
            else:
                outs.append(F.scaled_dot_product_attention(qd, kd, vd, dropout_p=dropout, is_causal=True,
                                                           scale=scaling, enable_gqa=gqa))
        rows.append(torch.cat(outs, dim=2) if len(outs) > 1 else outs[0])  # (1, Hq, T, Dv)
    out = torch.cat(rows, dim=0) if len(rows) > 1 else rows[0]  # (B, Hq, T, Dv)
    return out.transpose(1, 2).contiguous()  # (B, T, Hq, Dv)


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    if n_rep == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)  # (B, Hkv*n_rep, T, D)


def eager_per_doc(q, k, v, meta: PackedBatch, *, scaling, dropout, window, softcap, sinks,
                  training) -> torch.Tensor:
    """The eager softmax per document, with GPT-OSS sinks and/or soft-capping (as transformers' eager)."""
    hq = q.shape[1]
    n_rep = hq // k.shape[1]
    scaling = q.shape[-1] ** -0.5 if scaling is None else scaling
    rows = []
    for b, spans in enumerate(meta.spans()):
        outs = []
        for start, length in spans:
            sl = slice(start, start + length)
            qd = q[b:b + 1, :, sl]  # (1, Hq, L, D)
            kd, vd = _repeat_kv(k[b:b + 1, :, sl], n_rep), _repeat_kv(v[b:b + 1, :, sl], n_rep)
            if qd.dtype == torch.float16:  # fp16 logits of bf16-trained models overflow: fp32 (patches/fp16/patch.py)
                qd, kd = qd.float(), kd.float()
            scores = torch.matmul(qd, kd.transpose(2, 3)) * scaling  # (1, Hq, L, L)
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            scores = scores + meta.additive_mask(length, window, scores.dtype, q.device)  # (L, L)
            if sinks is not None:
                sink = sinks.reshape(1, -1, 1, 1).expand(1, hq, length, 1).to(scores.dtype)  # (1, Hq, L, 1)
                combined = torch.cat([scores, sink], dim=-1)  # (1, Hq, L, L+1)
                combined = combined - combined.max(dim=-1, keepdim=True).values
                probs = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
            else:
                probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            probs = F.dropout(probs, p=dropout, training=training).to(vd.dtype)
            outs.append(torch.matmul(probs, vd))  # (1, Hq, L, Dv)
        rows.append(torch.cat(outs, dim=2) if len(outs) > 1 else outs[0])
    out = torch.cat(rows, dim=0) if len(rows) > 1 else rows[0]  # (B, Hq, T, Dv)
    return out.transpose(1, 2).contiguous()  # (B, T, Hq, Dv)
