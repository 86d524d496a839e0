"""Glue: route a causal LM's training loss through :mod:`fastkit.patches.loss.chunked`.

``model(input_ids, labels=...)`` in transformers projects every position through the LM head and
hands fp32 logits to ``loss_function``. With :func:`enable_chunked_loss`, a call that has ``labels``
and builds a graph (training) runs the backbone, then the chunked cross-entropy over the LM head:
no full-row logits exist, and ``outputs.logits`` is ``None``. Calls without labels, under
``torch.no_grad()`` (eval, generation) or with options the chunked loss does not cover (MoE router
logits) run the original forward unchanged.

Under TRL's ``SFTTrainer`` (1.16) the trainer installs its own fused LM head
(``add_fused_lm_head``: tiles of 4096 tokens x 32768 vocabulary) and calls
``model(..., fused_lm_head=True)``, reading per-token ``log_probs`` (for the loss), ``entropy``,
``is_top1`` and ``label_mask`` (for its metrics). This patch answers that call too, from the same
chunks: applied after the trainer is built (``fastkit.make_trainer(chunked_loss=...)`` does it), it
replaces TRL's head; other calls still reach TRL's wrapper. On a CPU TRL's torch fallback peaks above
the full fp32 logits (docs/plan.md); on CUDA its Triton kernel is the default.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass

import torch
from transformers.utils import ModelOutput

from fastkit.patches.loss.chunked import IGNORE_INDEX, chunked_cross_entropy, shift_for_next_token, token_losses
from fastkit.patches.loss.streamed import streamed_token_losses
from fastkit.patching import apply_patch, unwrap

CHUNKED_LOSS = "chunked_loss"


@dataclass
class ChunkedLossOutput(ModelOutput):
    """What ``model(..., labels=..., fused_lm_head=True)`` returns (the fields TRL's SFTTrainer reads)."""

    loss: torch.Tensor | None = None
    """Mean next-token NLL over non-ignored labels (or divided by ``num_items_in_batch``)."""
    log_probs: torch.Tensor | None = None
    """``(B, S-1)`` log-probability of each next-token label (0 where ignored), with gradient."""
    entropy: torch.Tensor | None = None
    """``(B, S-1)`` entropy of each next-token distribution (0 where ignored), no gradient."""
    is_top1: torch.Tensor | None = None
    """``(B, S-1)`` whether the label is the most likely token."""
    label_mask: torch.Tensor | None = None
    """``(B, S-1)`` whether the label is not -100."""
    aux_loss: torch.Tensor | None = None
    """Unused (MoE router logits go to the original forward)."""


class ChunkedLossPatch:
    """Instance-level ``forward`` swap of a ``*ForCausalLM`` (revertible through :mod:`fastkit.patching`)."""

    name = CHUNKED_LOSS

    def __init__(self, chunk: int | None = None):
        self.chunk = chunk
        """Tokens per chunk (None: a ~128 MiB fp32 block, see ``chunked_loss.chunk_tokens``)."""

    def check(self, model: torch.nn.Module) -> str | None:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if type(head) is not torch.nn.Linear:
            return "the LM head is not a plain nn.Linear"
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        for attr in ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier"):
            if getattr(config, attr, None) not in (None, 1, 1.0):
                return f"config.{attr} transforms the logits"
        if getattr(model, "base_model", model) is model:
            return "no backbone attribute (base_model) to run without the LM head"
        return None

    def apply(self, model: torch.nn.Module, swap) -> None:
        original = model.forward
        chunk = self.chunk

        @functools.wraps(type(model).forward)
        def forward(self, *args, labels=None, num_items_in_batch=None, fused_lm_head=False, **kwargs):
            if fused_lm_head and labels is not None and not args and "shift_labels" not in kwargs \
                    and not kwargs.get("output_router_logits"):
                return _fused_forward(self, labels, num_items_in_batch, chunk, kwargs)
            if fused_lm_head:  # a call this patch does not cover: the head it wraps (TRL's) answers
                kwargs["fused_lm_head"] = True
            if (labels is None and "shift_labels" not in kwargs) or not torch.is_grad_enabled() or args \
                    or kwargs.get("output_router_logits"):
                if labels is not None:
                    kwargs["labels"] = labels
                if num_items_in_batch is not None:
                    kwargs["num_items_in_batch"] = num_items_in_batch
                return original(*args, **kwargs)
            return _chunked_forward(self, labels, num_items_in_batch, chunk, kwargs)

        swap.setattr(model, "forward", types.MethodType(forward, model))


def _chunked_forward(model, labels, num_items_in_batch, chunk, kwargs):
    from transformers.modeling_outputs import CausalLMOutputWithPast

    shift_labels = kwargs.pop("shift_labels", None)
    kwargs.pop("logits_to_keep", None)
    kwargs["use_cache"] = False
    outputs = model.base_model(**kwargs)
    head = model.get_output_embeddings()
    targets = shift_labels if shift_labels is not None else shift_for_next_token(labels)  # (B, S)
    if head_rows(head, 1) is None:
        hidden = outputs.last_hidden_state.to(head.weight.device)  # (B, S, H)
        loss = chunked_cross_entropy(hidden, head.weight, targets, bias=head.bias,
                                     num_items_in_batch=num_items_in_batch, chunk=chunk)
    else:  # the head stays on the host: stream its vocabulary (patches/host, loss/streamed.py)
        nll, _, _ = _token_losses(head, outputs.last_hidden_state, targets, chunk)
        loss = nll.sum() / _divisor(targets != IGNORE_INDEX, num_items_in_batch, nll.device)
    return CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=outputs.hidden_states,
                                  attentions=outputs.attentions)


def _fused_forward(model, labels, num_items_in_batch, chunk, kwargs) -> ChunkedLossOutput:
    kwargs["use_cache"] = False
    outputs = model.base_model(**kwargs)
    head = model.get_output_embeddings()
    hidden = outputs.last_hidden_state[:, :-1]  # (B, S-1, H)
    targets = labels[:, 1:].to(hidden.device)  # (B, S-1)
    nll, entropy, top1 = _token_losses(head, hidden, targets, chunk)
    mask = targets != IGNORE_INDEX
    divisor = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    return ChunkedLossOutput(loss=nll.sum() / divisor, log_probs=-nll, entropy=entropy, is_top1=top1,
                             label_mask=mask)


def head_rows(head, tokens: int) -> int | None:
    """Vocabulary rows per streamed chunk when the head is kept on the host (:mod:`fastkit.patches.host`), else None."""
    from fastkit.patches.host.patch import head_rows as rows  # the host patch imports this package's chunk sizes

    return rows(head, tokens)


def _token_losses(head, hidden, targets, chunk):
    """Per-token ``(nll, entropy, is_top1)``: token chunks over a device head, or the vocabulary streamed from a
    head kept on the host (:mod:`fastkit.patches.host`; ``chunk`` is then not used)."""
    rows = head_rows(head, hidden.numel() // hidden.shape[-1])
    if rows is None:
        hidden, targets = hidden.to(head.weight.device), targets.to(head.weight.device)
        return token_losses(hidden, head.weight, targets, bias=head.bias, chunk=chunk)
    return streamed_token_losses(hidden, head.weight, targets.to(hidden.device), bias=head.bias, rows=rows)


def _divisor(mask, num_items_in_batch, device):
    if num_items_in_batch is None:
        return mask.sum().clamp(min=1).to(device, torch.float32)
    return torch.as_tensor(num_items_in_batch, device=device).to(torch.float32)


def enable_chunked_loss(model: torch.nn.Module, chunk: int | None = None) -> tuple[bool, str]:
    """Compute ``model``'s training loss chunk by chunk (see the module docstring). Idempotent, revertible."""
    return apply_patch(unwrap(model), ChunkedLossPatch(chunk))


def route_trainer_loss(trainer) -> tuple[bool, str]:
    """Make ``trainer`` (a TRL SFTTrainer, already built) compute its loss with this patch, on top of TRL's head."""
    from fastkit.patching import revert

    base = unwrap(trainer.model)
    revert(base, [CHUNKED_LOSS])  # applied before TRL wrapped the forward: re-apply on top of it
    return apply_patch(base, ChunkedLossPatch())


__all__ = ["CHUNKED_LOSS", "ChunkedLossOutput", "ChunkedLossPatch", "enable_chunked_loss", "route_trainer_loss"]
