"""Packed rows on multi-axis rope (mrope) vision-language models: Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE.

What mrope needs. Image tokens get 3-D positions (time, height, width from the image's grid) and the text after an
image continues from the largest of them, so a document's positions are not ``arange(len)``: the model computes
them itself (``get_rope_index``) over the whole row, which in a packed row would continue each document from the
one before it. transformers' own packed layout for these models is ``position_ids`` of shape ``(4, B, T)``: row 0
the text positions (they restart at each document; its mask code reads packing from them), rows 1-3 the 3-D rope
indices; the text model splits them (``text_position_ids = position_ids[0]``).

What this module does. :func:`wrap_rope_owner` wraps the forward of the multimodal model that owns
``get_rope_index`` (``model.model``) on the instance: for a packed batch (the same detection as the decoder's:
fastkit's per-row lengths, TRL's ``cu_seq_lens_q``, or 1-D ``position_ids`` restarting at 0) it computes each
document's 3-D rope indices with the model's own ``get_rope_index`` as if the document were alone (every
document is one row of a right-padded batch with its attention mask, images consumed in order), writes them
back at the document's place, and passes ``(4, B, T)`` positions down; the decoder's packed attention
(:mod:`fastkit.patches.packing.patch`) reads the document boundaries from row 0. The vision tower already encodes
each image on its own (per-image ``cu_seqlens``), so image features do not depend on the packing. Any other call
(not packed, or ``(3|4, B, T)`` positions given by the caller) reaches the original forward unchanged.

Why restart per document rather than keep the row's running positions: rope is relative, so shifting every position
of a document by one constant leaves its attention unchanged in exact arithmetic, but only equal numbers give the
document alone's logits bit for bit (measured: 0.0 difference on the Qwen2.5-VL and Qwen3-VL twins). What must be
right is the 3-D layout itself: image tokens at their grid's (time, height, width), text after an image continuing
from the largest of them; 1-D positions in its place change the logits (the proof test goes red).

Proof: tests/test_vision_patches.py (each document's logits and every LoRA gradient equal to the document alone).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from fastkit.errors import FastkitError
from fastkit.patches.packing.attention import PackedBatch


def rope_owner(model: torch.nn.Module, language_model: str) -> torch.nn.Module | None:
    """The module holding ``get_rope_index`` and the language model (``model.model``), or None."""
    parent = language_model.rpartition(".")[0]
    try:
        owner = model.get_submodule(parent) if parent else model
    except AttributeError:
        return None
    return owner if callable(getattr(owner, "get_rope_index", None)) else None


def _token_types(owner: torch.nn.Module, input_ids: torch.Tensor, given: torch.Tensor | None) -> torch.Tensor:
    """``mm_token_type_ids`` (text 0, image 1, video 2) as the processor writes them; derived from the ids when the
    collator dropped them."""
    if given is not None:
        return given
    config = owner.config
    types = torch.zeros_like(input_ids)
    types[input_ids == config.image_token_id] = 1
    types[input_ids == config.video_token_id] = 2
    return types


def packed_positions(owner: torch.nn.Module, meta: PackedBatch, call: dict) -> torch.Tensor:
    """``(4, B, T)`` positions of a packed batch: text positions restarting per document, then each document's 3-D
    rope indices computed alone (one ``get_rope_index`` call, every document a row of a right-padded batch)."""
    ids = call["input_ids"]
    types = _token_types(owner, ids, call.get("mm_token_type_ids"))
    docs = [(r, s, n) for r, row in enumerate(meta.spans()) for s, n in row]
    longest = max(n for _, _, n in docs)
    doc_ids = ids.new_zeros(len(docs), longest)  # (D, longest): one document per row, right-padded
    doc_types, doc_mask = torch.zeros_like(doc_ids), torch.zeros_like(doc_ids)
    for i, (r, s, n) in enumerate(docs):
        doc_ids[i, :n], doc_types[i, :n], doc_mask[i, :n] = ids[r, s:s + n], types[r, s:s + n], 1
    extra = {k: call[k] for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts") if call.get(k) is not None}
    rope, _ = owner.get_rope_index(doc_ids, mm_token_type_ids=doc_types, attention_mask=doc_mask, **extra)
    out = ids.new_zeros(4, meta.rows, meta.row_len)  # (4, B, T): text row, then (time, height, width)
    for i, (r, s, n) in enumerate(docs):
        out[0, r, s:s + n] = torch.arange(n, device=ids.device)
        out[1:, r, s:s + n] = rope[:, i, :n]
    return out


def wrap_rope_owner(original: Callable, owner: torch.nn.Module, text_config,
                    build_metadata: Callable, forward_args: Callable) -> Callable:
    """The owner's forward: packed batches get per-document mrope positions (module docstring), others pass as is."""
    sig = inspect.signature(original)

    def forward(*args, **kwargs):
        call = forward_args(sig, args, kwargs)
        given = call.get("position_ids")
        if given is not None and given.dim() == 3:  # the caller's own (3|4, B, T) positions
            return original(*args, **kwargs)
        meta = build_metadata(text_config, call)
        if meta is None:
            return original(*args, **kwargs)
        if call.get("input_ids") is None:
            raise FastkitError("packed batch on an mrope model without input_ids: the 3-D rope positions are "
                               "computed from the image tokens; pass input_ids (not inputs_embeds).")
        if list(sig.parameters).index("position_ids") < len(args):
            raise FastkitError("position_ids was passed positionally to a packed mrope forward; pass it by keyword.")
        kwargs["position_ids"] = packed_positions(owner, meta, call)
        return original(*args, **kwargs)

    forward.__wrapped__ = original
    forward._fastkit_packing = True
    return forward


__all__ = ["packed_positions", "rope_owner", "wrap_rope_owner"]
