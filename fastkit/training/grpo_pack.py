"""GRPO's log-prob passes on one packed row: prompt + completion of every generation as its own document.

TRL 1.16's ``GRPOTrainer`` scores completions with ``_get_per_token_logps_and_entropies``: the policy's pass (with
backward) in ``_compute_loss``, and the no-grad reference pass (``beta > 0``; the adapter disabled) and the
``old_per_token_logps`` pass in ``_generate_and_score_completions``. Each runs the model on padded rows
``[left-padded prompt | right-padded completion]`` (``(R, P + C)``, ``attention_mask`` marking the real tokens) and
reads the log-probs of the completion positions through TRL's fused LM head.

Where fastkit's packing patch is active, :class:`PackedLogps` (a mixin of ``FastGRPOTrainer``; :func:`pack_logps`
turns it on) runs those passes on ONE padding-free row instead: each
row's real tokens (one contiguous span: its prompt, then its completion up to the EOS) are gathered into a
``(1, N)`` row and the decoder is called with the spans' lengths, so fastkit's packing patch restarts positions
at 0 and runs attention per document (no ``T x T`` mask, zero syncs); the hidden states are scattered back to
``(R, P + C, H)``, zeros at padding, where TRL's fused LM head and loss read them (padding is masked there) —
the same decoder wrapper as DPO's (:func:`fastkit.training.dpo.pack_pairs`).

The spans come from the host, never from the device masks:

- TRL's ``_generate`` returns the prompt and completion token ids as Python lists (it decodes them for the
  rewards); :meth:`PackedLogps.record_rows` records each row's prompt length and attended completion length there (a
  completion ``mask_truncated_completions`` masks attends with none of its tokens, as TRL's mask says);
- ``_generate_and_score_completions`` adds them to its output as a list (``fastkit_row_lengths``), which TRL's
  ``shuffle_sequence_dict`` / ``split_tensor_dict`` permute and split with the rows;
- in each pass the prompt width is ``input_ids.shape[1] - logits_to_keep`` (shapes, not values), so a row's span is
  ``[P - prompt_len, P + completion_len)``.

# Note: [grpo spans lifetime]
The recorded lengths describe the generation batch of the ``_generate`` call that made them and live on the
trainer only while ``_generate_and_score_completions`` runs (its reference / old-log-prob passes use them, rows
in TRL's order); afterwards they travel inside the batch dict, so a training step reads the lengths of exactly
the rows it got (after TRL's shuffle and split). A pass whose row count differs, or any multimodal input, runs
padded as TRL does. On a CPU mask the spans are checked against ``attention_mask`` (free there; on a GPU that read
would be a sync, so the check is the tests' job).

What must not change: GRPO's loss and every gradient equal the padded step's (tests/test_grpo_pack.py, fp32 twin,
left-padded prompts and completions of different lengths).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from fastkit import _hf
from fastkit.errors import FastkitError
from fastkit.training import dpo

logger = logging.getLogger(__name__)

ROWS_KEY = "fastkit_row_lengths"
"""Key of the generation-batch dict: per row ``(prompt tokens, attended completion tokens)``, host ints."""
_PASS_KWARGS = frozenset({"compute_entropy", "compute_aux_loss"})
"""Keywords of ``_get_per_token_logps_and_entropies`` that a text-only pass may set; any other (images) non-None:
padded, as TRL."""


def _attended(trainer, completion: list[int]) -> int:
    """Completion tokens the attention mask keeps: all of them, or none where TRL's ``mask_truncated_completions``
    masks a completion that ran out of tokens (``GRPOTrainer._generate_and_score_completions``, the same rule)."""
    if getattr(trainer, "mask_truncated_completions", False) and completion:
        eos_and_pad = [*trainer.eos_token_ids, _hf.grpo_tokenizer(trainer).pad_token_id]
        if completion[-1] not in eos_and_pad:
            return 0
    return len(completion)


def _check_spans(attention_mask: torch.Tensor, spans: list[tuple[int, int]]) -> None:
    """On a CPU mask (no device read): each span is exactly the row's ones."""
    if attention_mask.device.type != "cpu":
        return
    want = torch.zeros_like(attention_mask, dtype=torch.bool)
    for row, (start, end) in enumerate(spans):
        want[row, start:end] = True
    if not torch.equal(want, attention_mask.bool()):
        raise FastkitError("GRPO packing: the recorded prompt / completion lengths do not match TRL's attention_mask "
                           "(a TRL change?); make_grpo_trainer(packing=False) runs the padded passes.")


class PackedLogps:
    """Mixin over ``trl.GRPOTrainer``: its four log-prob methods, packed once :func:`pack_logps` turned packing on
    (``_packs_logps``); until then (or with ``packing=False``) each is TRL's own, unchanged."""

    _packs_logps = False
    _fastkit_rows: list[tuple[int, int]] | None = None  # see Note: [grpo spans lifetime]

    def record_rows(self, out):
        """Keep each generated row's (prompt, attended completion) lengths from ``_generate``'s host lists."""
        if self._packs_logps:
            prompt_ids, completion_ids = out[0], out[1]
            self._fastkit_rows = [(len(p), _attended(self, c)) for p, c in zip(prompt_ids, completion_ids,
                                                                              strict=True)]
        return out

    def _generate(self, prompts):
        return self.record_rows(super()._generate(prompts))

    def _generate_and_score_completions(self, inputs):
        if not self._packs_logps:
            return super()._generate_and_score_completions(inputs)
        self._fastkit_rows = None  # set by _generate inside
        try:
            output = super()._generate_and_score_completions(inputs)
            rows = self._fastkit_rows
            if rows is not None and len(rows) == output["prompt_ids"].shape[0]:
                output[ROWS_KEY] = rows
        finally:
            self._fastkit_rows = None
        return output

    def _compute_loss(self, model, inputs):
        if ROWS_KEY not in inputs:
            return super()._compute_loss(model, inputs)
        self._fastkit_rows = inputs[ROWS_KEY]
        try:
            return super()._compute_loss(model, {k: v for k, v in inputs.items() if k != ROWS_KEY})
        finally:
            self._fastkit_rows = None

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           **kwargs: Any):
        rows = self._fastkit_rows
        extra = [k for k, v in kwargs.items() if k not in _PASS_KWARGS and v is not None]
        if not self._packs_logps or rows is None or len(rows) != input_ids.size(0) or extra:
            return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                              batch_size, **kwargs)
        prompt_width = input_ids.size(1) - logits_to_keep
        spans = [(prompt_width - p, prompt_width + c) for p, c in rows]  # [start, end) of each row's real tokens
        _check_spans(attention_mask, spans)
        step = batch_size or input_ids.size(0)
        parts = []
        for start in range(0, input_ids.size(0), step):  # TRL's chunks, each one packed row
            end = start + step
            packed = functools.partial(model, **{dpo.ROW_SPANS_KWARG: spans[start:end]})
            parts.append(super()._get_per_token_logps_and_entropies(packed, input_ids[start:end],
                                                                    attention_mask[start:end], logits_to_keep, None,
                                                                    **kwargs))
        logp = torch.cat([p[0] for p in parts], dim=0)  # (R, C)
        entropy = torch.cat([p[1] for p in parts], dim=0) if parts[0][1] is not None else None
        aux = torch.stack([p[2] for p in parts]).mean() if parts[0][2] is not None else None  # TRL: mean of chunks
        return logp, entropy, aux


_METHODS = ("_generate", "_generate_and_score_completions", "_compute_loss", "_get_per_token_logps_and_entropies")
"""TRL's methods :class:`PackedLogps` overrides."""


def pack_logps(trainer: PackedLogps) -> bool:
    """Turn on packed log-prob passes for ``trainer`` (a :class:`PackedLogps` ``trl.GRPOTrainer``); False (nothing
    changed) when fastkit's packing patch is not active on its model (padded, as TRL)."""
    if not dpo.pack_pairs(trainer.model):
        return False
    for name in _METHODS:
        if not callable(getattr(super(PackedLogps, trainer), name, None)):
            raise FastkitError(f"GRPO packing: GRPOTrainer.{name} is missing (a TRL change?); pass packing=False.")
    trainer._packs_logps = True
    return True


__all__ = ["ROWS_KEY", "PackedLogps", "pack_logps"]
