"""Packed sequences through stateful layers: every document starts from a fresh state.

What it replaces. Hybrid decoders interleave attention with layers that carry state along the
sequence: short causal convolutions (LFM2's ``ShortConv``, the ``conv1d`` in front of every gated
DeltaNet / Mamba mixer), chunked gated-delta-rule linear attention (Qwen3.5, Qwen3-Next, Kimi-Linear)
and Mamba / Mamba-2 scans (Falcon-H1, Jamba, Bamba, Zamba2, Granite-4 hybrid, Nemotron-H). On a packed
row transformers 5.24 runs these layers over the whole row, so the conv window, the delta-rule state
and the SSM state of document *k* flow into document *k+1* — even when the attention mask is exact
(max |Δlogits| on tiny twins, docs/packing.md: 6e-4 … 0.6). The CUDA kernels can restart the state
(flash-linear-attention ``chunk_gated_delta_rule(cu_seqlens=)``, causal-conv1d ``causal_conv1d_fn(
seq_idx=)``, mamba-ssm ``mamba_chunk_scan_combined(seq_idx=)``), but transformers' torch fallbacks
ignore those arguments, and Mamba-1 (``selective_scan_fn``) has no varlen form at all.

What it does. The packing patch (:mod:`fastkit.patches.packing.patch`) calls :func:`check` and :func:`apply`
for every family whose registry row names ``stateful`` layer classes. ``apply`` swaps, on the
instances only:

- each decoder layer holding a stateful module: a ``forward`` that publishes the call's
  :class:`PackedBatch` for the duration of the call (Note [state context]);
- each stateful module (the mixer: ``Qwen3_5GatedDeltaNet``, ``Lfm2ShortConv``, ``FalconH1Mixer`` …):
  a ``forward`` that, for a packed batch, regroups the tokens into per-document rows — documents of
  similar length side by side, right-padded with zeros (:func:`document_groups`, waste bounded by
  ``MAX_PAD_WASTE``) — runs the family's own, unchanged forward on them, and scatters the outputs back
  (:func:`run_per_document`). A document starts at row position 0 with zero conv history and zero
  state, exactly as when it is run alone; padding only ever follows a document, and every one of these
  layers is causal, so padding never reaches a real token.

The regroup indices are built once per batch from the host lengths the packing patch already has
(Python ints → one int64 H2D copy through pinned memory, cached inside the :class:`PackedBatch`):
no host syncs, one gather and one scatter (``index_select``; backward ``index_add_``) per stateful
layer. Running the family's own forward means the CUDA kernels transformers already dispatches to
(causal-conv1d, mamba-ssm, flash-linear-attention, hub kernels) run unchanged on the regrouped rows.
On CUDA, where those kernels are installed in a checked version, a packed batch skips the regroup and
runs them once with their own varlen arguments instead (:mod:`fastkit.patches.packing.varlen`).
Packing-only keyword arguments (``cu_seq_lens_*``, ``seq_idx``, ``position_ids`` …) are not passed to
the regrouped call: they describe the packed layout, and a varlen kernel given them would apply them to
the wrong rows.

Under torch.compile the layer publishes the batch through a traced global instead (Note [traced state]) and the
module's packed call becomes one operator, ``fastkit::per_document_mixer``, that runs this same path at run time
from the host layout tensor (:mod:`fastkit.patches.packing.compiled_state`): no graph break, no recompile per layout.

What must not change: a batch that is not packed calls the original forwards with the original
arguments (identical results); for a packed batch every output and gradient of a stateful layer
equals that document run alone (fp32 tight). A model with a stateful layer the row does not name (a
``Conv1d``, or a stateful model class) is refused, so packing never silently leaks state.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from fastkit import _hf
from fastkit.errors import FastkitError
from fastkit.patches.packing import compiled_state, varlen
from fastkit.patches.packing.attention import PackedBatch, _host_to_device
from fastkit.patches.packing.compiled import host_cu
from fastkit.patching import Swapper

logger = logging.getLogger(__name__)

PACKED_KWARG = "fastkit_packed"  # the same key as fastkit.patches.packing.PACKED_KWARG (imported there)
MAX_PAD_WASTE = 2.0
"""A regrouped row set holds at most this many times the real tokens it carries (padding bound)."""

# Keyword arguments that describe the packed layout: never passed to a regrouped (per-document) call.
PACKING_ONLY_KWARGS = ("fastkit_packed", "fastkit_seq_lens", "fastkit_cu_seqlens", "cu_seq_lens_q", "cu_seq_lens_k",
                       "max_length_q", "max_length_k", "seq_idx", "position_ids", "cache_position", "cu_seqlens")
_CACHE_NAMES = ("cache", "cache_params", "past_key_values")

# Note: [state context]
# Some families call their mixer without the layer's **kwargs (Jamba: ``self.mamba(hidden_states, cache,
# attention_mask)``), so the PackedBatch cannot reach it as an argument. The decoder layer's forward does
# receive it, so the layer's wrapper sets ``_CURRENT`` for exactly the duration of that call and resets it
# in ``finally``. The gradient-checkpoint recompute calls the same layer forward with the same kwargs (the
# same PackedBatch object), so it sets the same value again: nothing outlives the call, nothing is keyed by
# tensor identity, and a forward without packing metadata sees None. A context variable (not a global)
# keeps two threads apart.
_CURRENT: contextvars.ContextVar[PackedBatch | None] = contextvars.ContextVar("fastkit_packed_state", default=None)


# ------------------------------------------------------------------------------------ pure torch / host


def document_groups(lengths: list[list[int]], max_waste: float = MAX_PAD_WASTE) -> list[list[tuple[int, int, int]]]:
    """Documents grouped into padded row sets: each group is a list of ``(row, start, length)``.

    Longest first; a group takes the next (shorter) document while its padded size
    ``count × longest`` stays within ``max_waste`` × its real tokens. Host ints only.
    """
    docs = []
    for r, row in enumerate(lengths):
        start = 0
        for n in row:
            docs.append((r, start, int(n)))
            start += int(n)
    docs.sort(key=lambda d: -d[2])  # stable: equal lengths keep their packed order
    groups: list[list[tuple[int, int, int]]] = []
    real = 0
    for d in docs:
        if groups and (len(groups[-1]) + 1) * groups[-1][0][2] <= max_waste * (real + d[2]):
            groups[-1].append(d)
            real += d[2]
        else:
            groups.append([d])
            real = d[2]
    return groups


@dataclass(eq=False)
class StatePlan:
    """Where each document's tokens go in the regrouped rows, for one batch on one device."""

    shapes: list[tuple[int, int]]
    """Per group ``(documents, padded length)``."""
    gathers: list[torch.Tensor]
    """Per group, int64 ``(documents × padded length,)`` indices into the flat ``B*T`` tokens; ``B*T`` = padding."""
    inverse: torch.Tensor
    """int64 ``(B*T,)``: each packed token's row in the concatenated group outputs."""


def build_plan(lengths: list[list[int]], rows: int, row_len: int, device: torch.device) -> StatePlan:
    """The :class:`StatePlan` of ``lengths``: numpy on the host, then one H2D copy (no host sync)."""
    pad = rows * row_len
    gathers, shapes, inverse = [], [], np.empty(pad, dtype=np.int64)
    offset = 0
    for group in document_groups(lengths):
        width = group[0][2]
        idx = np.full((len(group), width), pad, dtype=np.int64)  # (docs, L): padding points at the zero row
        for i, (r, start, n) in enumerate(group):
            flat = r * row_len + start + np.arange(n)
            idx[i, :n] = flat
            inverse[flat] = offset + i * width + np.arange(n)
        offset += idx.size
        gathers.append(idx.reshape(-1))
        shapes.append((len(group), width))
    host = torch.from_numpy(np.concatenate(gathers + [inverse]))
    dev = _host_to_device(host, device)  # one copy: (sum docs×L + B*T,)
    views, start = [], 0
    for g in gathers:
        views.append(dev[start:start + g.size])
        start += g.size
    return StatePlan(shapes, views, dev[start:])


def plan_for(meta: PackedBatch, device: torch.device) -> StatePlan:
    """This batch's plan on ``device``, built on first use and kept inside ``meta`` (its lifetime)."""
    key = ("state_plan", device)
    if key not in meta._cache:
        meta._cache[key] = build_plan(meta.lengths, meta.rows, meta.row_len, device)
    return meta._cache[key]


def run_per_document(fn: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, plan: StatePlan
                     ) -> torch.Tensor:
    """``fn`` on each document alone: ``hidden`` ``(B, T, H)`` regrouped per :class:`StatePlan`, back to ``(B, T, Ho)``.

    ``fn`` must be causal along its rows (the padding follows each document).
    """
    rows, row_len, width = hidden.shape
    flat = hidden.reshape(rows * row_len, width)  # (B*T, H)
    flat = torch.cat([flat, flat.new_zeros(1, width)])  # (B*T + 1, H): the last row is the padding
    outs = []
    for (docs, length), idx in zip(plan.shapes, plan.gathers):
        x = flat.index_select(0, idx).view(docs, length, width)  # (docs, L, H)
        y = fn(x)  # (docs, L, Ho)
        outs.append(y.reshape(docs * length, y.shape[-1]))  # (docs*L, Ho)
    out = torch.cat(outs).index_select(0, plan.inverse)  # (B*T, Ho)
    return out.view(rows, row_len, -1)  # (B, T, Ho)


# ------------------------------------------------------------------------------------------------- glue


@contextlib.contextmanager
def _published(meta: PackedBatch | None) -> Iterator[None]:
    """Publish ``meta`` to the stateful modules of one layer call; see Note [state context]."""
    if meta is None:
        yield
        return
    token = _CURRENT.set(meta)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def _make_layer_forward(original: Callable) -> Callable:
    def forward(*args, **kwargs):
        meta = kwargs.get(PACKED_KWARG)
        if torch.compiler.is_compiling():  # Note [traced state]
            global _TRACED
            outer, _TRACED = _TRACED, meta
            try:
                return original(*args, **kwargs)
            finally:
                _TRACED = outer
        with _published(meta):
            return original(*args, **kwargs)

    forward.__wrapped__ = original
    return forward


# Note: [traced state]
# Dynamo cannot trace a ContextVar (Note [state context]): read or set, it breaks the graph. While it traces a
# packed layer, the layer's PackedBatch is published in the plain global ``_TRACED`` instead, for exactly the
# duration of the layer call: dynamo traces the store and the read as part of the one graph (a side effect of the
# layer, undone in its ``finally``). A stateful module takes the batch from its keyword arguments, else from there,
# so a family whose layer drops them (Jamba) traces whole too.
_TRACED: PackedBatch | None = None


def _regrouped_kwargs(bound: dict, rows: int, row_len: int, name: str) -> dict:
    """The arguments of one per-document call: packing-only ones dropped, no mask, no cache (checked)."""
    rest = {k: v for k, v in bound.items() if k not in PACKING_ONLY_KWARGS}
    for key in _CACHE_NAMES:
        if rest.get(key) is not None:
            raise FastkitError(f"{name}: a packed batch met a cache: packed documents cannot continue a cache. "
                               "Use use_cache=False.")
    if "attention_mask" in rest:
        rest["attention_mask"] = None  # packed rows carry no padding (the packing patch checked it)
    for key, value in rest.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == (rows, row_len):
            raise FastkitError(f"{name}: per-token argument {key!r} {tuple(value.shape)} cannot be regrouped per "
                               "document by fastkit; this layer cannot run packed.")
    return rest


def _make_mixer_forward(original: Callable, name: str, kind: str = "", reason: str | None = "no varlen kind",
                        module: torch.nn.Module | None = None) -> Callable:
    """The packed forward of one stateful module: the varlen kernels where ``reason`` is None and the input
    is on CUDA (:mod:`fastkit.patches.packing.varlen`), else the per-document regroup."""
    sig = inspect.signature(original)

    def run(fn: Callable, hidden: torch.Tensor, rest: dict, meta: PackedBatch) -> torch.Tensor:
        """The packed call itself (eager, or inside ``fastkit::per_document_mixer`` at run time)."""
        cuda = varlen.on_cuda(hidden)
        varlen.log_path(name, reason, cuda)
        if reason is None and cuda:
            return varlen.run_varlen(fn, hidden, rest, meta, kind)
        return run_per_document(lambda x: _single(fn(hidden_states=x, **rest), name), hidden,
                                plan_for(meta, hidden.device))

    def forward(*args, **kwargs):
        meta = kwargs.get(PACKED_KWARG)  # else the layer's: Notes [state context], [traced state]
        if meta is None:
            meta = _TRACED if torch.compiler.is_compiling() else _CURRENT.get()
        if meta is None:
            return original(*args, **kwargs)
        bound = dict(sig.bind(*args, **kwargs).arguments)
        bound.update(bound.pop("kwargs", {}))  # the call's **kwargs (_regrouped_kwargs drops the layout's keys)
        hidden = bound.pop("hidden_states")
        rows, row_len = hidden.shape[0], hidden.shape[1]
        if (rows, row_len) != (meta.rows, meta.row_len):
            raise FastkitError(f"{name}: hidden states {tuple(hidden.shape)} do not match the packed batch "
                               f"({meta.rows}, {meta.row_len}).")
        rest = _regrouped_kwargs(bound, rows, row_len, name)
        if torch.compiler.is_compiling():  # one operator, the layout a host tensor (packing/compiled_state.py)
            out = compiled_state.traced_call(module, hidden, rest, host_cu(meta))
            if out is not None:
                return out
        return run(original, hidden, rest, meta)

    forward.__wrapped__ = original
    forward._fastkit_state_reset = True
    forward._fastkit_run = run
    return forward


def _single(out, name: str) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    raise FastkitError(f"{name} returned {type(out).__name__}, not a tensor: fastkit cannot regroup it per document.")


def stateful_modules(decoder: torch.nn.Module, names: tuple[str, ...]
                     ) -> list[tuple[torch.nn.Module, list[torch.nn.Module]]]:
    """``[(decoder layer, [its stateful modules])]`` for the modules whose class name is in ``names``."""
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        return []
    out = []
    for layer in layers:
        found = _hf.modules_of_classes(layer, names)
        if found:
            out.append((layer, found))
    return out


def check(model: torch.nn.Module, decoder: torch.nn.Module, names: tuple[str, ...]) -> str | None:
    """Why the state resets cannot make packing exact on ``model`` (None: they can, or none are needed)."""
    covered = {id(m) for _, mods in stateful_modules(decoder, names) for mod in mods for m in mod.modules()}
    if names and not covered:
        return f"none of the stateful layers {', '.join(names)} found inside the decoder's layers"
    # Only the decoder layers carry the token sequence: a Conv1d in another modality's encoder (phi4_multimodal's
    # audio embedding, run on audio features, never on the packed text) carries no state across its documents.
    layers = getattr(decoder, "layers", None)
    scope = layers if isinstance(layers, torch.nn.ModuleList) else decoder
    stray = sorted({type(m).__name__ for m in scope.modules()
                    if isinstance(m, torch.nn.Conv1d) and id(m) not in covered})
    if stray:
        return (f"a causal convolution ({', '.join(stray)}) outside the layers fastkit resets per document would "
                "carry state across packed documents")
    if _hf.is_stateful_model(model) and not names:
        return (f"{type(model).__name__} carries recurrent state along the sequence and no registry row names "
                "its stateful layers: packed documents would leak into each other")
    return None


def apply(decoder: torch.nn.Module, names: tuple[str, ...], swap: Swapper, varlen_kind: str = "") -> int:
    """Swap the per-document forwards onto the instances; returns the number of stateful modules.

    ``varlen_kind`` is the row's ``varlen`` (:mod:`fastkit.patches.packing.varlen`): whether a module may take
    the CUDA varlen kernels is decided here, once per module (installed packages and versions do not change).
    """
    count, reasons = 0, {}
    for layer, mods in stateful_modules(decoder, names):
        swap.setattr(layer, "forward", _make_layer_forward(layer.forward))
        for m in mods:
            reason = reasons.setdefault(type(m), varlen.decide(m, varlen_kind))
            forward = _make_mixer_forward(m.forward, type(m).__name__, varlen_kind, reason, m)
            swap.setattr(m, "forward", forward)
            compiled_state.register(m, decoder, forward._fastkit_run, forward.__wrapped__, swap)
            count += 1
    logger.debug("fastkit packing: state reset per document on %d stateful modules (%s); varlen kernels: %s",
                 count, ", ".join(names), {c.__name__: r or "yes, on CUDA" for c, r in reasons.items()})
    return count


__all__ = ["MAX_PAD_WASTE", "StatePlan", "apply", "build_plan", "check", "document_groups", "plan_for",
           "run_per_document", "stateful_modules"]
