"""DPO on fastkit's patches: preference pairs checked at the door, chosen and rejected packed into one row.

TRL 1.16's ``DPOTrainer`` pads: its collator stacks ``[chosen_1..chosen_B, rejected_1..rejected_B]`` as ``2B``
right-padded rows, and ``DPOConfig(padding_free=True)`` is switched off with a warning ("temporarily unavailable
after a refactor"). fastkit keeps TRL's collator, loss and metrics unchanged and packs *inside the decoder call*:

- :class:`PairLengthsCollator` wraps TRL's collator and adds ``fastkit_row_lens`` — each row's real length, read
  from the collator's CPU ``attention_mask`` (Python ints, no device read);
- :func:`pack_pairs` wraps the decoder's ``forward`` (through :func:`fastkit.patching.change`, so
  ``fastkit.revert`` removes it). Given ``fastkit_row_lens`` it gathers the real tokens of all ``2B`` rows into
  ONE padding-free row ``(1, N)`` and calls the decoder with ``fastkit_seq_lens`` — fastkit's packing patch then
  runs attention per document (positions restarting at 0, no T×T mask, zero syncs) — and scatters the hidden
  states back to ``(2B, T, H)`` (zeros at padding, which TRL's fused LM head masks out). The router logits of an
  MoE model are scattered back the same way, so TRL's load-balancing loss sees the padded layout it expects.

What must not change: the DPO loss and every gradient equal the padded batch's (tests/test_preference.py,
fp32 twin, mixed lengths). The reference pass (adapter disabled, :mod:`fastkit.training.preference`) goes
through the same packed call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from fastkit.errors import FastkitError
from fastkit.patching import active_patches, change, unwrap

logger = logging.getLogger(__name__)

ROW_LENS_KWARG = "fastkit_row_lens"
"""Batch key (added by :class:`PairLengthsCollator`): the real (unpadded) length of each right-padded row."""
ROW_SPANS_KWARG = "fastkit_row_spans"
"""Decoder keyword (GRPO, :mod:`fastkit.training.grpo_pack`): ``(start, end)`` of each padded row's real tokens, a
contiguous span (a left-padded prompt followed by its right-padded completion)."""
PACK_CHANGE = "dpo_packed_pairs"
"""The :func:`fastkit.patching.change` record of the decoder wrapper (``fastkit.revert`` undoes it)."""


# ------------------------------------------------------------------------------------------ data checks


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) for m in value)


def _check_messages(value: list, where: str) -> None:
    for j, message in enumerate(value):
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise FastkitError(f"{where}[{j}] has no 'role' (got {sorted(message)}): each message needs 'role' and "
                               "'content'.")
        if not isinstance(content, str):
            raise FastkitError(f"{where}[{j}] ({role}) has no text 'content' (got {type(content).__name__}).")


def _check_side(value: Any, where: str, chat: bool) -> None:
    """One of a pair's fields: a non-empty string, or a non-empty list of messages (``chat``)."""
    if chat:
        if not _is_messages(value):
            raise FastkitError(f"{where} must be a list of messages like the first row's, got "
                               f"{type(value).__name__} {str(value)[:60]!r}.")
        _check_messages(value, where)
        return
    if not isinstance(value, str) or not value.strip():
        raise FastkitError(f"{where} must be non-empty text like the first row's, got {type(value).__name__} "
                           f"{str(value)[:60]!r}.")


def check_pair_row(row: dict, i: int, where: str = "train_dataset", chat: bool | None = None) -> bool:
    """Check one preference row; returns True when it is in chat (messages) form.

    Forms (TRL's): ``prompt`` + ``chosen`` + ``rejected`` as text, or as lists of messages (the prompt ending
    before the answer, chosen / rejected holding the assistant turn); or ``chosen`` / ``rejected`` alone as
    whole conversations sharing their first turns (TRL takes the shared turns as the prompt). ``chat``: the
    form the dataset's first row set (None: this row's ``chosen`` decides).
    """
    missing = [k for k in ("chosen", "rejected") if k not in row or row[k] is None]
    if missing:
        raise FastkitError(f"{where} row {i + 1}: no {' / '.join(repr(k) for k in missing)} field (has "
                           f"{sorted(row)}): a preference pair needs 'chosen' and 'rejected' (and usually 'prompt').")
    chat = _is_messages(row["chosen"]) if chat is None else chat
    for key in ("prompt", "chosen", "rejected"):
        if key in row and row[key] is not None:
            _check_side(row[key], f"{where} row {i + 1} field {key!r}", chat)
    if chat and row["chosen"][-1]["role"] != "assistant" or chat and row["rejected"][-1]["role"] != "assistant":
        raise FastkitError(f"{where} row {i + 1}: 'chosen' and 'rejected' must end with an assistant message (the "
                           "answers being compared).")
    if chat and "prompt" in row and row["prompt"] and row["prompt"][-1]["role"] == "assistant":
        raise FastkitError(f"{where} row {i + 1} field 'prompt' ends with an assistant message: the prompt is the "
                           "conversation before the compared answers.")
    if row["chosen"] == row["rejected"]:
        raise FastkitError(f"{where} row {i + 1}: 'chosen' and 'rejected' are the same, so the pair teaches nothing "
                           "(and DPO's loss is flat on it). Drop the row or fix the pair.")
    return chat


PAIR_COLUMNS, UNPAIRED_COLUMNS = ("chosen", "rejected"), ("completion", "label")
"""DPO's answer columns and KTO's: a data set holding both is refused (which one trains would be a guess)."""


def check_one_form(columns, where: str) -> None:
    """Refuse rows holding both DPO's (``chosen`` / ``rejected``) and KTO's (``completion`` / ``label``) columns,
    naming both sets: DPO would train on the pairs and KTO on the unpaired rows, each ignoring the other."""
    if set(PAIR_COLUMNS) <= set(columns) and set(UNPAIRED_COLUMNS) <= set(columns):
        raise FastkitError(f"{where} holds both preference pairs (columns 'chosen', 'rejected') and unpaired rows "
                           "(columns 'completion', 'label'); which to train on would be a guess: keep one set of "
                           "columns (fastkit dpo trains on pairs, fastkit kto on unpaired rows or on pairs).")


def check_pairs(dataset, tokenizer, where: str = "train_dataset") -> None:
    """Every row a usable preference pair, one form for the whole set, a chat template for chat rows
    (``tokenizer=None``: the rows only, before a model loads; ``fastkit dpo``'s preflight)."""
    if len(dataset) == 0:
        raise FastkitError(f"{where} is empty: give preference pairs (prompt, chosen, rejected).")
    check_one_form(dataset.column_names, where)
    chat = check_pair_row(dataset[0], 0, where)
    for i in range(1, len(dataset)):
        check_pair_row(dataset[i], i, where, chat)
    if chat and tokenizer is not None:
        from fastkit.data.chat_template import require_chat_template

        require_chat_template(tokenizer)


def check_tokenized_pairs(dataset, max_length: int, drop_long: bool, where: str = "train_dataset"):
    """After TRL tokenized the pairs (``prompt_ids`` / ``chosen_ids`` / ``rejected_ids``): refuse (or drop) a pair
    longer than ``max_length`` (TRL would cut it silently) and one whose answer tokenized to nothing."""
    long_rows = []
    for i, (p, c, r) in enumerate(zip(dataset["prompt_ids"], dataset["chosen_ids"], dataset["rejected_ids"])):
        if not c or not r:
            raise FastkitError(f"{where} row {i + 1}: the {'chosen' if not c else 'rejected'} answer has no tokens "
                               "after the chat template: nothing to compare.")
        if len(p) + max(len(c), len(r)) > max_length:
            long_rows.append((i, len(p) + max(len(c), len(r))))
    return drop_long_rows(dataset, long_rows, max_length, drop_long, where, measure="prompt + longer answer",
                          consequence="TRL would cut the answer", rows="preference pair")


def drop_long_rows(dataset, long_rows: list[tuple[int, int]], max_length: int, drop_long: bool, where: str, *,
                   measure: str, consequence: str, rows: str):
    """``dataset`` without ``long_rows`` (``(row, tokens)`` above ``max_length``) when ``drop_long``, else a
    FastkitError naming the first (DPO's pairs, KTO's rows); ``measure``, ``consequence``, ``rows``: the words."""
    if long_rows and not drop_long:
        i, n = long_rows[0]
        raise FastkitError(f"{where} row {i + 1} has {n} tokens ({measure}), above max_seq_length="
                           f"{max_length} ({len(long_rows)} row(s) in all); {consequence}. Raise "
                           "max_seq_length, shorten the rows, or pass drop_long=True to drop them.")
    if long_rows:
        logger.info("fastkit: dropped %d %s(s) longer than %d tokens", len(long_rows), rows, max_length)
        keep = sorted(set(range(len(dataset))) - {i for i, _ in long_rows})
        if not keep:
            raise FastkitError(f"{where}: every {rows} is longer than max_seq_length={max_length}.")
        dataset = dataset.select(keep)
    return dataset


# ------------------------------------------------------------------------------------------ packed pairs


class PairLengthsCollator:
    """TRL's preference collator plus ``fastkit_row_lens``: each right-padded row's real length (host ints)."""

    def __init__(self, collator: Callable):
        self.collator = collator

    def __call__(self, features, *args, **kwargs):
        batch = self.collator(features, *args, **kwargs)
        mask = batch["attention_mask"]
        if mask.device.type != "cpu":  # never read a device tensor back here
            raise FastkitError("PairLengthsCollator needs the collator's CPU attention_mask (before the Trainer "
                               "moves the batch).")
        lengths = mask.sum(dim=1).tolist()  # CPU: no sync
        if any(mask[i, n:].any() or not mask[i, :n].all() for i, n in enumerate(lengths)):
            raise FastkitError("preference batch: attention_mask is not right padding (TRL's collator pads right).")
        batch[ROW_LENS_KWARG] = lengths
        return batch

    def __getattr__(self, name):  # look like the wrapped collator
        return getattr(self.collator, name)


def _flat_index(spans: Sequence[tuple[int, int]], row_len: int) -> np.ndarray:
    """Positions of the real tokens (``spans``: ``[start, end)`` per row) in the flattened ``(B*T,)`` batch."""
    return np.concatenate([row * row_len + np.arange(start, end) for row, (start, end) in enumerate(spans)])


def _row_spans(kwargs: dict, rows: int, row_len: int) -> list[tuple[int, int]] | None:
    """The real-token span of each row, from ``fastkit_row_lens`` (right padding) or ``fastkit_row_spans``."""
    lengths, spans = kwargs.pop(ROW_LENS_KWARG, None), kwargs.pop(ROW_SPANS_KWARG, None)
    if lengths is None and spans is None:
        return None
    spans = [(0, n) for n in lengths] if spans is None else [tuple(s) for s in spans]
    if len(spans) != rows or any(not 0 <= a < b <= row_len for a, b in spans):
        raise FastkitError(f"{ROW_LENS_KWARG} / {ROW_SPANS_KWARG}: one non-empty span inside the row per row of "
                           f"input_ids is needed (got {spans[:4]}... for {rows} rows of {row_len} tokens).")
    return spans


def _scatter(packed: torch.Tensor, index: torch.Tensor, rows: int, row_len: int) -> torch.Tensor:
    """``(N, ...)`` values of the real tokens -> ``(rows * row_len, ...)`` with zeros at the padding."""
    out = packed.new_zeros((rows * row_len, *packed.shape[1:]))
    return out.index_copy(0, index, packed)  # differentiable: backward gathers the gradient at `index`


def _packed_forward(original: Callable) -> Callable:
    def forward(*args, **kwargs):
        if ROW_LENS_KWARG not in kwargs and ROW_SPANS_KWARG not in kwargs:
            return original(*args, **kwargs)
        input_ids = kwargs.pop("input_ids", None) if not args else args[0]
        if input_ids is None or input_ids.dim() != 2:
            raise FastkitError(f"{ROW_LENS_KWARG} / {ROW_SPANS_KWARG} pack 2-D input_ids (got "
                               f"{None if input_ids is None else tuple(input_ids.shape)}).")
        if kwargs.get("position_ids") is not None or kwargs.get("inputs_embeds") is not None:
            raise FastkitError(f"{ROW_LENS_KWARG} / {ROW_SPANS_KWARG} pack padded input_ids; position_ids / "
                               "inputs_embeds next to them are not supported.")
        rows, row_len = input_ids.shape
        spans = _row_spans(kwargs, rows, row_len)
        kwargs.pop("attention_mask", None)  # the packed row has no padding
        index = torch.from_numpy(_flat_index(spans, row_len)).to(input_ids.device, non_blocking=True)  # (N,)
        flat = input_ids.reshape(-1).index_select(0, index).unsqueeze(0)  # (1, N)
        out = original(flat, *args[1:], fastkit_seq_lens=[[b - a for a, b in spans]], **kwargs)
        hidden = out.last_hidden_state[0]  # (N, H)
        out.last_hidden_state = _scatter(hidden, index, rows, row_len).view(rows, row_len, -1)  # (2B, T, H)
        if getattr(out, "router_logits", None) is not None:  # per layer (N, E) -> (2B*T, E), as padded
            out.router_logits = tuple(_scatter(r.reshape(-1, r.shape[-1]), index, rows, row_len)
                                      for r in out.router_logits)
        return out

    forward.__wrapped__ = original
    return forward


def pack_pairs(model: torch.nn.Module) -> bool:
    """Wrap ``model``'s decoder so batches with ``fastkit_row_lens`` run as one packed row; False (nothing changed)
    when fastkit's packing patch is not active on it (padded DPO then)."""
    from fastkit.patches.layout import decoder as _decoder

    base = unwrap(model)
    if "packing" not in active_patches(base):
        return False
    inner = _decoder(base)
    if getattr(inner.forward, "_fastkit_dpo_packed", False):
        return True
    wrapped = _packed_forward(inner.forward)
    wrapped._fastkit_dpo_packed = True
    change(base, PACK_CHANGE, lambda swap: swap.setattr(inner, "forward", wrapped))
    return True


# ------------------------------------------------------------------------------------------ evaluation


def _ids(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt,
                                              return_dict=True)["input_ids"])


def _answer_logp(model: torch.nn.Module, prompt_ids: list[int], full_ids: list[int]) -> float:
    """Sum of log-probabilities of ``full_ids[len(prompt_ids):]`` given what precedes each token."""
    ids = torch.tensor([full_ids], device=model.device)  # (1, T)
    logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()  # (T-1, V)
    logp = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]  # (T-1,)
    return float(logp[len(prompt_ids) - 1:].sum())


def preference_accuracy(model: torch.nn.Module, tokenizer, pairs) -> tuple[float, float]:
    """``(accuracy, mean margin)`` on chat-form preference pairs: the share of pairs whose chosen answer the model
    gives a higher log-probability than the rejected one, and the mean of ``log p(chosen) - log p(rejected)``
    (nats). Greedy-free and deterministic; the model's train/eval mode is restored."""
    was_training, margins = model.training, []
    model.eval()
    try:
        with torch.no_grad():
            for row in pairs:
                prompt_ids = _ids(tokenizer, row["prompt"], True)
                chosen = _answer_logp(model, prompt_ids, _ids(tokenizer, row["prompt"] + row["chosen"], False))
                rejected = _answer_logp(model, prompt_ids, _ids(tokenizer, row["prompt"] + row["rejected"], False))
                margins.append(chosen - rejected)
    finally:
        model.train(was_training)
    if not margins:
        raise FastkitError("preference_accuracy: no pairs given.")
    return sum(m > 0 for m in margins) / len(margins), sum(margins) / len(margins)


__all__ = ["PACK_CHANGE", "PAIR_COLUMNS", "ROW_LENS_KWARG", "ROW_SPANS_KWARG", "UNPAIRED_COLUMNS",
           "PairLengthsCollator",
           "check_one_form", "check_pair_row", "check_pairs", "check_tokenized_pairs", "drop_long_rows", "pack_pairs",
           "preference_accuracy"]
