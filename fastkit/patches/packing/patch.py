"""Packed sequences: document metadata once per batch, zero host syncs, no T×T mask.

What it replaces. For a packed row (several documents concatenated, positions restarting at 0),
transformers 5.24 builds a dense ``(B, 1, T, T)`` mask once per forward on sdpa/eager
(``masking_utils.find_packed_sequence_indices``: one host sync; 64 MiB at 8k tokens; the mask turns
off ``is_causal``), and on the flash path given only ``position_ids`` recomputes the boundaries in
every layer (2–3 syncs per layer, doubled by gradient checkpointing). With ``use_cache=True`` or an
all-ones ``attention_mask`` it skips packing detection and documents silently attend to each other
(and GPT-OSS never passes ``position_ids`` to its mask builder, so it always mixes them).

What it does. :class:`PackedAttentionPatch` (registry name ``"packing"``) registers two attention
keys in transformers' ``AttentionInterface`` and wraps the decoder's ``forward`` on the instance:

- ``fastkit_<orig>`` (permanent ``config._attn_implementation``): for a batch that is not packed it
  calls the original backend with the original backend's mask function — bit-for-bit the unpatched
  model (padded batches, generation with a cache, eval);
- ``fastkit_packed_<orig>``: selected only for the duration of a packed forward; it has no mask
  function, so every ``create_*_mask`` returns ``None`` at once (no T×T mask, no sync). Attention runs
  per document with the fastest exact kernel (:mod:`fastkit.patches.packing.attention`, pure torch).

Stateful layers (a registry row with ``stateful`` layer classes: linear attention, causal conv, SSM) restart
their state at each document start from the same :class:`PackedBatch` (:mod:`fastkit.patches.packing.state`);
a model with a stateful layer its row does not name is refused.

Every private transformers name (the config's attention key, the attention registries' global
mappings, a family's own eager function) is reached through :mod:`fastkit._hf`.

A :class:`PackedBatch` is built once per forward from host-side lengths (``wrap_collator`` puts them
in the batch as Python ints; TRL's ``cu_seq_lens_q``/``max_length_q`` also work) and reaches every
layer through ``**kwargs`` — also the gradient-checkpoint recompute. See Note [packed metadata lifetime].

What must not change: the logits and every gradient of a non-packed batch (identical calls), and
for a packed batch each document's logits equal the document run alone. Anything the patch cannot
make exact is refused in ``check`` (the model stays as it was) or raises :class:`FastkitError`.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import inspect
import itertools
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fastkit import _hf, registry
from fastkit.errors import FastkitError
from fastkit.patches.layout import decoder
from fastkit.patches.packing import attention as kernels
from fastkit.patches.packing import compiled as packed_compiled
from fastkit.patches.packing import mrope as packing_mrope
from fastkit.patches.packing import state as packing_state
from fastkit.patches.packing.attention import PackedBatch, lengths_from_cu, log_once
from fastkit.patching import Swapper

logger = logging.getLogger(__name__)

PACKED_KWARG = packing_state.PACKED_KWARG
"""Forward kwarg carrying the :class:`PackedBatch` from the decoder down to the attention function."""
LENGTHS_KWARG = "fastkit_seq_lens"
"""Batch key (added by :func:`wrap_collator`): per-row document lengths as Python ints."""
CU_KWARG = "fastkit_cu_seqlens"
"""Forward kwarg: the same layout as an int64 CPU tensor of cumulative lengths over the flattened ``B*T`` tokens
(a boundary at every row end), optionally padded to ``B*T + 1`` entries by repeating the total
(``compiled.cu_tensor(lengths, padded=True)``); under ``torch.compile`` a new layout then reuses the compiled graph
(padded: at most two compiles for any sequence of layouts, compiled.py Note [padded layout])."""
SUPPORTED_BACKENDS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")
_NOT_PASSED = object()
"""Default of the dispatcher's ``sliding_window``: tells "not passed" from "passed as None" (full attention)."""

# Attention calls seen during the packed forward that is running now: "packed" (with the PackedBatch)
# and "plain" (without it). See Note [attention ran per document].
_CALLS: contextvars.ContextVar[collections.Counter | None] = contextvars.ContextVar("fastkit_packed_calls",
                                                                                   default=None)

# Note: [attention ran per document]
# Packing is exact only if EVERY attention call of a packed forward runs per document. A decoder layer
# that drops **kwargs (nemotron, stablelm in transformers 5.24) calls attention without the PackedBatch;
# under the packed key there is then no mask either, so its documents attend to each other silently. A
# family that computes attention without AttentionInterface never reaches fastkit at all. So the packed
# forward counts the calls of fastkit's dispatcher (host ints, no sync) and raises when one ran without
# the metadata or none ran. The gradient-checkpoint recompute replays the same calls with the same kwargs.

# Note: [packed metadata lifetime]
# One PackedBatch per decoder forward call, never cached anywhere else:
# - it is built inside the wrapped decoder forward from that call's inputs (host-side lengths), and
#   handed to the layers only as a keyword argument of that call;
# - gradient checkpointing stores the layer's kwargs in a ``functools.partial`` for the recompute, so the
#   recompute reuses the *same* object (no rebuild, no sync) and the object lives exactly as long as the
#   autograd graph of that step; it is freed when backward frees the graph (or when the output is dropped);
# - derived things (device cu_seqlens, per-length band masks) are cached lazily *inside* the object, so
#   they share its lifetime;
# - there is no cache keyed by tensor identity, data_ptr, shape or model: an input tensor mutated in place,
#   two models interleaved, eval between train steps, or generation can never see another batch's metadata.
#   A forward without packing metadata gets none (PACKED_KWARG absent) and runs the original backend.


# ----------------------------------------------------------------------------------------------- host side


def lengths_from_positions(position_ids: np.ndarray, attention_mask: np.ndarray | None = None
                           ) -> list[list[int]] | None:
    """Per-row document lengths from host ``position_ids`` ``(B, T)``; None if no row is packed.

    A document starts where the position does not continue the previous one (+1) and must restart at 0.
    Raises :class:`FastkitError` for negative or non-monotonic positions, or for packed rows next to a
    padding ``attention_mask`` (ambiguous: give lengths instead).
    """
    pos = np.asarray(position_ids)
    valid = np.ones_like(pos, dtype=bool) if attention_mask is None else np.asarray(attention_mask).astype(bool)
    breaks = (np.diff(pos, axis=-1) != 1) & valid[:, 1:] & valid[:, :-1]  # (B, T-1)
    if not breaks.any():
        return None
    if not valid.all():
        raise FastkitError("position_ids restart inside a row that also has padding in attention_mask: this packed "
                           "layout is ambiguous. Drop the attention_mask (padding-free) or pass per-document lengths "
                           f"('{LENGTHS_KWARG}', see fastkit.patches.packing.wrap_collator).")
    if (pos < 0).any():
        raise FastkitError("position_ids must be non-negative in a packed batch.")
    out = []
    for row, row_breaks in zip(pos, breaks):
        starts = np.flatnonzero(row_breaks) + 1  # first token of each later document
        if (row[starts] != 0).any():
            bad = int(starts[row[starts] != 0][0])
            raise FastkitError(f"position_ids are non-monotonic at token {bad} (value {int(row[bad])}): inside a "
                               "document positions must increase by 1, and each packed document must restart at 0.")
        out.append(np.diff(np.concatenate([[0], starts, [pos.shape[-1]]])).tolist())
    return out


def _check_lengths(lengths: Any, rows: int, row_len: int) -> list[list[int]]:
    name = LENGTHS_KWARG
    if isinstance(lengths, np.ndarray) or (isinstance(lengths, torch.Tensor) and lengths.device.type == "cpu"):
        lengths = lengths.tolist()  # host arrays only (a device tensor here would cost a sync: give ints)
    if not isinstance(lengths, (list, tuple)) or not lengths:
        raise FastkitError(f"{name} must be a list of document lengths per row, got {type(lengths).__name__}.")
    if all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) for n in lengths):
        if rows != 1:
            raise FastkitError(f"{name}: the batch has {rows} rows but one flat list of lengths; give one list "
                               "of document lengths per row.")
        lengths = [lengths]
    if len(lengths) != rows:
        raise FastkitError(f"{name} has {len(lengths)} rows of lengths for a batch of {rows} rows.")
    out = []
    for r, row in enumerate(lengths):
        row = [int(n) for n in row]
        if any(n <= 0 for n in row) or sum(row) != row_len:
            raise FastkitError(f"{name}[{r}] = {row[:8]}{'...' if len(row) > 8 else ''} must be positive lengths "
                               f"that sum to the row length {row_len} (they sum to {sum(row)}).")
        out.append(row)
    return out


class PackedCollator:
    """Wraps a collator so each packed batch also carries its document lengths as Python ints.

    Works with TRL's padding-free collator (``cu_seq_lens_q``) and with transformers'
    ``DataCollatorWithFlattening`` (``position_ids``, with or without flash kwargs). The lengths are
    read from CPU tensors here, in the data loader, so the model never reads them back from the device.
    Batches that are not packed pass through unchanged. Picklable (data-loader workers).
    """

    def __init__(self, collator: Callable):
        self.collator = collator

    def __call__(self, features, *args, **kwargs):
        batch = self.collator(features, *args, **kwargs)
        if batch.get(LENGTHS_KWARG) is not None:  # lengths from the inner collator: check them against positions
            ids = batch.get("input_ids", batch.get("inputs_embeds"))
            given = _check_lengths(batch[LENGTHS_KWARG], ids.shape[0], ids.shape[1])
            check_consistent(given, LENGTHS_KWARG, batch.get("position_ids"), batch.get("max_length_q"))
            return batch
        lengths = batch_lengths(batch)
        if lengths is not None:
            batch[LENGTHS_KWARG] = lengths
        return batch

    def __getattr__(self, name):  # look like the wrapped collator (e.g. TRL reads .padding_free)
        if name == "collator":
            raise AttributeError(name)
        return getattr(self.collator, name)


def wrap_collator(collator: Callable) -> PackedCollator:
    """Return ``collator`` wrapped to add ``fastkit_seq_lens`` (per-row lengths, Python ints) to packed batches."""
    return collator if isinstance(collator, PackedCollator) else PackedCollator(collator)


def batch_lengths(batch: dict) -> list[list[int]] | None:
    """Per-row document lengths of a collated CPU batch, or None if it is not packed."""
    ids = batch.get("input_ids", batch.get("inputs_embeds"))
    if ids is None:
        return None
    rows, row_len = ids.shape[0], ids.shape[1]
    cu = batch.get("cu_seq_lens_q")
    if cu is not None and rows == 1:
        lengths = [lengths_from_cu(torch.as_tensor(cu).cpu().tolist(), row_len, "cu_seq_lens_q")]
        check_consistent(lengths, "cu_seq_lens_q", batch.get("position_ids"), batch.get("max_length_q"))
        return lengths
    pos = batch.get("position_ids")
    if pos is None:
        return None
    mask = batch.get("attention_mask")
    pos = torch.as_tensor(pos).cpu().expand(rows, row_len)
    return lengths_from_positions(pos.numpy(), None if mask is None else torch.as_tensor(mask).cpu().numpy())


def check_consistent(lengths: list[list[int]], field_name: str, position_ids: Any, max_length_q: Any) -> None:
    """Packed metadata that contradicts itself raises, naming both fields.

    Attention follows ``lengths`` and RoPE follows ``position_ids``: they must describe the same
    documents, and ``max_length_q`` must be the longest. Runs on the collator's CPU batch (in the data
    loader); the model side passes ``position_ids=None`` and checks only Python ints (no sync).
    """
    if isinstance(max_length_q, (int, np.integer)) and int(max_length_q) != max(max(r) for r in lengths):
        raise FastkitError(f"max_length_q={int(max_length_q)} disagrees with {field_name}, whose longest document "
                           f"has {max(max(r) for r in lengths)} tokens; max_length_q must be that longest length.")
    if isinstance(position_ids, torch.Tensor) and position_ids.device.type != "cpu":
        return
    if position_ids is None:
        return
    rows, row_len = len(lengths), sum(lengths[0])
    pos = np.asarray(torch.as_tensor(position_ids).cpu().expand(rows, row_len))
    from_pos = lengths_from_positions(pos) or [[row_len]] * rows
    for r, (a, b) in enumerate(zip(lengths, from_pos)):
        if list(a) != list(b):
            raise FastkitError(f"{field_name} and position_ids disagree in row {r}: {field_name} gives documents "
                               f"{list(a)[:8]}, position_ids restart at 0 for documents {list(b)[:8]}. Attention "
                               "would follow one and RoPE the other; build both from the same documents.")


# ---------------------------------------------------------------------------------------------- model side


def _forward_args(sig: inspect.Signature, args: tuple, kwargs: dict) -> dict:
    bound = sig.bind_partial(*args, **kwargs).arguments
    extra = bound.pop("kwargs", {})
    return {**bound, **extra}


def _from_positions(position_ids: torch.Tensor, attention_mask: torch.Tensor | None, rows: int,
                    row_len: int) -> list[list[int]] | None:
    """Derive lengths from device position_ids: one host sync, once per batch (not per layer)."""
    pos = position_ids.expand(rows, row_len)
    if attention_mask is not None:
        pos = torch.stack([pos, attention_mask.to(pos.dtype)])  # (2, B, T)
    host = np.asarray(pos.tolist())
    return lengths_from_positions(host[0], host[1]) if attention_mask is not None else lengths_from_positions(host)


def _text_positions(positions: torch.Tensor | None) -> torch.Tensor | None:
    """The 1-D text positions ``(B, T)`` document boundaries are read from: ``position_ids`` itself, or row 0 of
    mrope's ``(4, B, T)`` (text positions, then the 3-D rope rows: transformers' own packed layout for Qwen-VL);
    None for mrope's ``(3, B, T)`` alone (no text row: not a packed batch to fastkit, as to transformers)."""
    if positions is None or positions.dim() < 3:
        return positions
    return positions[0] if positions.shape[0] == 4 else None


def build_metadata(config, call: dict) -> PackedBatch | None:
    """The :class:`PackedBatch` for one decoder call, or None when the batch is not packed."""
    ref = call.get("input_ids") if call.get("input_ids") is not None else call.get("inputs_embeds")
    if ref is None or ref.dim() < 2:
        return None
    rows, row_len = ref.shape[0], ref.shape[1]
    cache = call.get("cache", call.get("past_key_values"))
    past = cache.get_seq_length() if cache is not None else 0
    mask, positions = call.get("attention_mask"), _text_positions(call.get("position_ids"))
    if isinstance(mask, dict) or (isinstance(mask, torch.Tensor) and mask.dim() != 2):
        return None  # a prepared mask (generate, custom): the caller decided, leave it alone
    host, cu = call.get(LENGTHS_KWARG), call.get("cu_seq_lens_q")
    if host is None and call.get(CU_KWARG) is not None:  # the layout as a host tensor: read here, no device sync
        host = packed_compiled.batch_from_cu(call[CU_KWARG], rows, row_len).lengths
    if host is None and cu is None:
        if positions is None or row_len < 2 or past:
            return None
        lengths = _from_positions(positions, mask, rows, row_len)
        return None if lengths is None else _metadata(config, rows, row_len, lengths, None, call)
    if past:
        raise FastkitError(f"A packed batch ({LENGTHS_KWARG}/cu_seq_lens_q) was given with a non-empty cache "
                           f"({past} cached tokens): packed documents cannot continue a cache. Use use_cache=False.")
    if mask is not None and not bool(mask.all()):  # one sync, only when a mask is passed next to lengths
        raise FastkitError(f"attention_mask has padding next to packed lengths ({LENGTHS_KWARG}/cu_seq_lens_q): "
                           "drop attention_mask (padding-free batches carry no mask).")
    if host is not None:
        lengths = _check_lengths(host, rows, row_len)
        check_consistent(lengths, LENGTHS_KWARG, None, call.get("max_length_q"))  # Python ints only: no sync
        return _metadata(config, rows, row_len, lengths, None, call)
    if rows != 1:
        raise FastkitError(f"cu_seq_lens_q describes one flattened row but the batch has {rows} rows; pass "
                           f"per-row lengths as '{LENGTHS_KWARG}' (fastkit.patches.packing.wrap_collator).")
    return _metadata(config, rows, row_len, None, cu, call)


def _metadata(config, rows, row_len, lengths, cu, call) -> PackedBatch:
    if lengths is not None:
        max_seqlen, field_name = max(max(r) for r in lengths), LENGTHS_KWARG
    else:
        max_seqlen, field_name = call.get("max_length_q"), "max_length_q"
        if not isinstance(max_seqlen, int):
            raise FastkitError("max_length_q must be a Python int next to cu_seq_lens_q (TRL's padding-free "
                               f"collator gives one), got {type(max_seqlen).__name__}.")
    context = getattr(config, "max_position_embeddings", None)
    if context is not None and max_seqlen > context:
        raise FastkitError(f"{field_name}: a packed document has {max_seqlen} tokens, above the model's context "
                           f"(max_position_embeddings={context}); lower max_length.")
    # for compiled layers (regions: this forward is eager); traced itself (host-lengths families), unpadded: the
    # padding reads a length as a Python int, a graph break
    cu_host = None if lengths is None else packed_compiled.cu_tensor(lengths, padded=not torch.compiler.is_compiling())
    return PackedBatch(rows, row_len, lengths, max_seqlen, cu, cu_host=cu_host,
                       compiled_calls=torch.zeros((), dtype=torch.int64))


@contextlib.contextmanager
def _attn_key(config, key: str):
    """Select ``key`` for the duration of one packed forward; see Note [packed attention key]."""
    # Note: [packed attention key]
    # The packed key has no AttentionMaskInterface entry, so masking_utils returns None at its very
    # first check: no T×T mask, no find_packed_sequence_indices sync. The key is restored before the
    # call returns; the gradient-checkpoint recompute then runs under the permanent fastkit_<orig> key,
    # whose attention function is the same dispatcher and finds the PackedBatch in its kwargs.
    # The config is shared by the decoder's modules only, so this is per model (not thread-safe for two
    # threads running the same model at once, like any module state).
    previous = _hf.attn_implementation(config)
    _hf.set_attn_implementation(config, key)
    try:
        yield
    finally:
        _hf.set_attn_implementation(config, previous)


def _make_decoder_forward(original: Callable, config, packed_key: str, host_lengths: bool = False) -> Callable:
    """``host_lengths``: the model has layers that need the host lengths (per-document mrope), so a traced forward
    builds them too (graph breaks, a compile per layout) instead of a tensor-only layout. Stateful layers do not:
    under compile they run as one operator reading the host layout tensor (packing/compiled_state.py)."""
    sig = inspect.signature(original)

    def forward(*args, **kwargs):
        call = _forward_args(sig, args, kwargs)
        meta = _traced_metadata(config, call) if torch.compiler.is_compiling() and not host_lengths else None
        traced = meta is not None
        meta = meta or build_metadata(config, call)
        if meta is None:
            return original(*args, **kwargs)
        _packed_kwargs(sig, args, kwargs, call, meta)
        if traced:  # no ContextVar: the dispatcher checks each call as it is traced
            with _attn_key(config, packed_key):
                out = original(*args, **kwargs)
            _check_calls(0, meta.calls)
            return out
        calls = collections.Counter()
        token = _CALLS.set(calls)
        try:
            with _attn_key(config, packed_key):
                out = original(*args, **kwargs)
        finally:
            _CALLS.reset(token)
        _check_calls(calls["plain"], meta.counted_calls())
        return out

    forward.__wrapped__ = original
    forward._fastkit_packing = True
    return forward


def _packed_kwargs(sig: inspect.Signature, args: tuple, kwargs: dict, call: dict, meta: PackedBatch) -> None:
    """The decoder's keyword arguments for a packed call: the metadata, no cache, positions restarting per document."""
    kwargs[PACKED_KWARG] = meta
    if call.get("use_cache"):  # a cache would hold every document: return none
        log_once("packed_cache", "fastkit packing: use_cache=True ignored for a packed batch (a KV cache would "
                 "hold every document and the next step would attend across them); no cache is returned.")
    if "use_cache" in sig.parameters and "use_cache" not in list(sig.parameters)[:len(args)]:
        kwargs["use_cache"] = False
    if call.get("position_ids") is None:  # lengths without positions: each document restarts at 0
        if "position_ids" in sig.parameters and list(sig.parameters).index("position_ids") < len(args):
            raise FastkitError("position_ids=None was passed positionally next to packed lengths; pass "
                               "position_ids (or pass it by keyword).")
        kwargs["position_ids"] = _positions(meta, call)


def _traced_metadata(config, call: dict) -> PackedBatch | None:
    """While dynamo traces: the batch's layout as a host tensor only (Note [compiled packing]); None where the
    call needs the eager path (no packed lengths given, a mask or a cache next to them: correct, not graph-free)."""
    ref = call.get("input_ids") if call.get("input_ids") is not None else call.get("inputs_embeds")
    if ref is None or ref.dim() < 2 or call.get("attention_mask") is not None:
        return None
    if call.get("cache", call.get("past_key_values")) is not None:
        return None
    rows, row_len = ref.shape[0], ref.shape[1]
    host, cu, device_cu = call.get(LENGTHS_KWARG), call.get(CU_KWARG), call.get("cu_seq_lens_q")
    if cu is None and host is not None:
        flat = [n for row in _check_lengths(host, rows, row_len) for n in row]
        cu = torch.tensor([0, *itertools.accumulate(flat)], dtype=torch.int64)
    elif cu is None and device_cu is not None and rows == 1:
        cu = device_cu.to("cpu", torch.int64)  # one read per batch, as eager (wrap_collator makes it none)
    if cu is None:
        return None
    context = getattr(config, "max_position_embeddings", None)
    return PackedBatch(rows, row_len, None, context if isinstance(context, int) else 0, None, cu_host=cu)


# Note: [compiled packing]
# While dynamo traces the decoder (torch.compile of the model), the packed layout must not become Python
# ints: every length would be a constant of the graph and each new layout a recompile. So the traced
# forward keeps it as the host tensor ``cu_host`` (``fastkit_cu_seqlens`` as given, or built from the
# lengths), positions are computed from it with tensor ops, and attention runs as one operator
# (``fastkit::packed_attention``, packing/compiled.py) that reads the tensor at run time. There
# ``max_seqlen`` holds the model's context (checked at run time by the operator) and ``lengths`` is
# unavailable. The per-document check (Note [attention ran per document]) becomes a trace-time check: the
# dispatcher raises at once when a call reaches it without the metadata while the packed key is selected
# (dynamo cannot trace the ContextVar), and the traced forward raises when no call carried the metadata.
# Gradient-checkpoint recompute, eval and unpacked batches take the paths they take eagerly.


def _check_calls(plain: int, packed: int) -> None:
    """Raise unless every attention call of a packed forward ran per document (Note [attention ran per document])."""
    if plain:
        raise FastkitError(f"packed batch: {plain} of {plain + packed} attention calls "
                           "ran without the packed metadata (a decoder layer drops **kwargs), so their documents "
                           "would attend to each other. This family cannot train packed: use packing=False.")
    if not packed:
        raise FastkitError("packed batch: no attention call reached fastkit's attention function (this family "
                           "computes attention without transformers' AttentionInterface), so documents would attend "
                           "to each other. This family cannot train packed: use packing=False.")


def _positions(meta: PackedBatch, call: dict) -> torch.Tensor:
    ref = call.get("input_ids") if call.get("input_ids") is not None else call["inputs_embeds"]
    if meta.lengths_host is None and meta.cu_host is not None:  # traced: tensor ops on the host layout
        cu = meta.cu_host
        idx = torch.arange(meta.rows * meta.row_len, dtype=cu.dtype)  # (B*T,)
        doc = torch.searchsorted(cu, idx, right=True) - 1  # each token's document
        return (idx - cu[doc]).view(meta.rows, meta.row_len).to(ref.device)  # (B, T)
    pos = [np.arange(n) for row in meta.lengths for n in row]
    return torch.from_numpy(np.concatenate(pos)).view(meta.rows, meta.row_len).to(ref.device)  # (B, T)


# ------------------------------------------------------------------------------------------ attention fns


def make_dispatcher(orig: str) -> Callable:
    """The attention function registered under both fastkit keys for an original backend ``orig``."""

    def fastkit_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                          scaling: float | None = None, sliding_window: Any = _NOT_PASSED,
                          softcap: float | None = None, s_aux: torch.Tensor | None = None, **kwargs):
        meta = kwargs.pop(PACKED_KWARG, None)
        kwargs.pop(LENGTHS_KWARG, None)
        kwargs.pop(CU_KWARG, None)
        _count_call(module, meta)
        if meta is None:  # the very call the original backend would get
            target = _hf.AttentionView(module, orig) if orig.startswith("flash") else module
            extra = {k: v for k, v in (("sliding_window", sliding_window), ("softcap", softcap), ("s_aux", s_aux))
                     if v is not None and v is not _NOT_PASSED}
            return _hf.attention_function(module, orig)(target, query, key, value, attention_mask,
                                                        dropout=dropout, scaling=scaling, **extra, **kwargs)
        if query.shape[2] != key.shape[2]:
            raise FastkitError("A packed batch met cached keys (query and key lengths differ): packed documents "
                               "cannot continue a cache. Use use_cache=False.")
        if sliding_window is _NOT_PASSED:  # the family did not say (qwen2_moe): the layer's own attribute
            sliding_window = getattr(module, "sliding_window", None)
        # passed as None = full attention on this layer (exaone4, kolibri1 keep a window attribute on every layer)
        # while dynamo traces: one operator the compiler sees once (Note [compiled packing])
        attend = packed_compiled.traced_attention if torch.compiler.is_compiling() else kernels.packed_attention
        out = attend(query, key, value, meta, scaling=scaling, dropout=dropout, window=sliding_window,
                     softcap=softcap, sinks=s_aux, training=module.training)
        return out, None

    fastkit_attention.__name__ = f"fastkit_attention_{orig}"
    return fastkit_attention


def _count_call(module, meta: PackedBatch | None) -> None:
    """Count one attention call for Note [attention ran per document]; while dynamo traces, a call without the
    metadata under the packed key raises at once (Note [compiled packing])."""
    if meta is not None:
        if torch.compiler.is_compiling() and meta.compiled_calls is not None:  # a compiled layer, eager decoder
            meta.compiled_calls.add_(1)  # a tensor op in the graph, not a guard on a count (a compile per layer)
        else:
            meta.calls += 1
    elif torch.compiler.is_compiling():
        key = getattr(getattr(module, "config", None), "_attn_implementation", None)
        if isinstance(key, str) and key.startswith("fastkit_packed_"):
            _check_calls(1, 0)
    else:
        calls = _CALLS.get()
        if calls is not None:
            calls["plain"] += 1


def register_keys(orig: str) -> tuple[str, str]:
    """Register ``fastkit_<orig>`` (with the original mask) and ``fastkit_packed_<orig>`` (no mask)."""
    permanent, packed = f"fastkit_{orig}", f"fastkit_packed_{orig}"
    if not _hf.attention_registered(permanent):
        fn = make_dispatcher(orig)
        _hf.register_attention(permanent, fn, mask_like=orig)
        _hf.register_attention(packed, fn)
    return permanent, packed


# ------------------------------------------------------------------------------------------------- patch


def _decoder_config(model: torch.nn.Module, inner: torch.nn.Module | None, facts) -> Any:
    """The config the decoder runs under: the model's own, or, on a vision-language row, its language model's text
    config (the vision tower keeps its own attention); None: no decoder to patch."""
    config = getattr(inner, "config", None)
    if inner is None or config is None:
        return None
    if config is model.config:
        return config
    vision = getattr(facts, "vision", None)
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else None
    if vision is not None and config is text:
        return config
    return None


class PackedAttentionPatch:
    """Registry patch ``"packing"``: packed batches attend per document with metadata built once per batch."""

    name = registry.PACKING

    def __init__(self, facts=None):
        self.facts = facts

    def check(self, model: torch.nn.Module) -> str | None:
        if self.facts is not None and not self.facts.packing:
            return f"{self.facts.model_type}: packed attention not supported for this family"
        inner = decoder(model)
        config = _decoder_config(model, inner, self.facts)
        if config is None:
            return "no decoder module sharing the model's config"
        orig = _hf.attn_implementation(config)
        if orig not in SUPPORTED_BACKENDS:
            return f"attention backend {orig!r} is not one fastkit can delegate to ({', '.join(SUPPORTED_BACKENDS)})"
        if getattr(config, "is_causal", True) is False:
            return "bidirectional attention (config.is_causal=False)"
        if "kwargs" not in inspect.signature(inner.forward).parameters:
            return "the decoder forward takes no **kwargs (metadata cannot reach the layers)"
        if self._mrope() and self._rope_owner(model) is None:
            return "mrope: no module owning get_rope_index next to the language model (per-document 3-D positions)"
        return packing_state.check(model, inner, self._stateful())

    def _mrope(self) -> bool:
        vision = getattr(self.facts, "vision", None)
        return vision is not None and vision.rope == registry.MROPE

    def _rope_owner(self, model: torch.nn.Module) -> torch.nn.Module | None:
        return packing_mrope.rope_owner(model, self.facts.vision.language_model)

    def _stateful(self) -> tuple[str, ...]:
        return tuple(getattr(self.facts, "stateful", ()) or ())

    def apply(self, model: torch.nn.Module, swap: Swapper) -> None:
        inner = decoder(model)
        config = _decoder_config(model, inner, self.facts)
        permanent, packed = register_keys(_hf.attn_implementation(config))
        _hf.set_attn_implementation(config, permanent, swap)
        host_lengths = self._mrope()
        swap.setattr(inner, "forward", _make_decoder_forward(inner.forward, config, packed, host_lengths))
        if self._mrope():  # per-document 3-D rope positions, (4, B, T) down to the decoder (packing/mrope.py)
            owner = self._rope_owner(model)
            swap.setattr(owner, "forward", packing_mrope.wrap_rope_owner(owner.forward, owner, config, build_metadata,
                                                                         _forward_args))
        if self._stateful():  # recurrent / conv / SSM layers restart at each document (packing/state.py)
            packing_state.apply(inner, self._stateful(), swap, getattr(self.facts, "varlen", ""))
        logger.debug("fastkit packing: %s -> %s (packed batches: %s)", type(model).__name__, permanent, packed)


__all__ = ["LENGTHS_KWARG", "PACKED_KWARG", "PackedAttentionPatch", "PackedBatch", "PackedCollator", "batch_lengths",
           "build_metadata", "lengths_from_positions", "wrap_collator"]
