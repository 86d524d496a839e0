"""Cross-entropy over the LM head without full-row logits: forward and backward chunk by chunk.

Replaces ``logits = hidden @ W.T`` (``(N, V)``, 1.2 GB in fp32 for 2k tokens of Qwen3's 151,936-token
vocabulary, plus as much again for its log-softmax and gradient) followed by ``F.cross_entropy``.
Here the forward projects ``chunk`` tokens at a time, keeps only each token's log-sum-exp and
target logit, and frees the chunk; the backward recomputes each chunk's logits from the saved
hidden states and weight, turns them into ``softmax - onehot`` in place, and folds them into the
gradients of the hidden states (and of the weight/bias when they train). Peak extra memory is one
``(chunk, V)`` fp32 block instead of several ``(N, V)`` ones.

What must not change: the loss and every gradient equal ``F.cross_entropy(logits.float(), labels,
ignore_index=-100, reduction="sum") / divisor`` (fp32 tight); ``divisor`` is ``num_items_in_batch``
when the trainer passes it (gradient accumulation), else the count of non-ignored labels.

Pure torch (imports torch only). The glue that routes a model's loss here is
:mod:`fastkit.patches.loss.patch`.
"""

from __future__ import annotations

import torch

from fastkit.patches.sizes import CHUNK_BYTES  # the planner counts the same chunk

IGNORE_INDEX = -100


def chunk_tokens(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk so that one chunk's fp32 logits take at most ``chunk_bytes``."""
    return max(1, chunk_bytes // (4 * vocab_size))


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    logits = hidden @ weight.t()  # (C, H) @ (H, V) -> (C, V), in the compute dtype
    if bias is not None:
        logits = logits + bias
    return logits.float()


class ChunkedCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of ``hidden @ weight.T (+ bias)`` against ``labels`` (0 where ignored).

    Also returns, without gradient, each token's entropy and whether its label is the top-1 logit
    (the metrics TRL's SFTTrainer logs), computed from the same chunks.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk):
        # hidden (N, H), weight (V, H), bias (V,) or None, labels (N,) with IGNORE_INDEX
        n = hidden.shape[0]
        nll = hidden.new_zeros(n, dtype=torch.float32)  # (N,)
        entropy = hidden.new_zeros(n, dtype=torch.float32)  # (N,)
        top1 = torch.zeros(n, dtype=torch.bool, device=hidden.device)  # (N,)
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            logits = _chunk_logits(hidden[start:stop], weight, bias)  # (C, V) fp32
            target = labels[start:stop]  # (C,)
            valid = target != IGNORE_INDEX  # (C,)
            lse = torch.logsumexp(logits, dim=-1)  # (C,)
            picked = logits.gather(1, target.clamp(min=0).unsqueeze(1)).squeeze(1)  # (C, 1) -> (C,)
            nll[start:stop] = torch.where(valid, lse - picked, 0.0)
            top1[start:stop] = valid & (logits.argmax(dim=-1) == target)
            logits.sub_(lse.unsqueeze(1))  # (C, V) log-probabilities, in place
            ent = -logits.exp().mul_(logits).sum(dim=-1)  # (C,): one (C, V) temporary
            entropy[start:stop] = torch.where(valid, ent, 0.0)
            del logits
        ctx.save_for_backward(hidden, weight, bias, labels)
        ctx.chunk = chunk
        ctx.mark_non_differentiable(entropy, top1)
        return nll, entropy, top1

    @staticmethod
    def backward(ctx, grad_nll, *_):
        hidden, weight, bias, labels = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if need_b else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            stop = min(start + ctx.chunk, hidden.shape[0])
            h = hidden[start:stop]  # (C, H)
            target = labels[start:stop]  # (C,)
            scale = (grad_nll[start:stop].float() * (target != IGNORE_INDEX)).unsqueeze(1)  # (C, 1), 0 if ignored
            grad = _chunk_logits(h, weight, bias).softmax(dim=-1)  # (C, V) fp32, recomputed
            grad.scatter_add_(1, target.clamp(min=0).unsqueeze(1), grad.new_full((stop - start, 1), -1.0))  # -onehot
            grad.mul_(scale)
            if need_h:
                grad_h[start:stop] = (grad.to(weight.dtype) @ weight).to(hidden.dtype)  # (C, V) @ (V, H) -> (C, H)
            if need_w:
                grad_w.addmm_(grad.t(), h.float())  # (V, C) @ (C, H) -> (V, H)
            if need_b:
                grad_b.add_(grad.sum(0))  # (V,)
            del grad
        grad_w = grad_w.to(weight.dtype) if need_w else None
        grad_b = grad_b.to(bias.dtype) if need_b else None
        return grad_h, grad_w, grad_b, None, None


def token_losses(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: torch.Tensor | None = None,
                 chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(nll, entropy, is_top1)`` per position of ``labels`` (each shaped like ``labels``), chunk by chunk.

    ``nll`` carries the gradient; all three are 0 / False where the label is ``-100``.
    """
    flat_h = hidden.reshape(-1, hidden.shape[-1])  # (..., H) -> (N, H)
    flat_labels = labels.reshape(-1).to(flat_h.device)  # (...) -> (N,)
    out = ChunkedCrossEntropy.apply(flat_h, weight, bias, flat_labels, chunk or chunk_tokens(weight.shape[0]))
    return tuple(t.view(labels.shape) for t in out)  # (N,) -> (...)


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                          bias: torch.Tensor | None = None, num_items_in_batch=None,
                          chunk: int | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy of ``hidden @ weight.T`` over non-ignored ``labels``, chunk by chunk.

    ``hidden`` is ``(..., H)`` and ``labels`` the matching ``(...)`` targets, already aligned (shifted)
    with the hidden states; ``-100`` marks positions without loss. ``num_items_in_batch`` (the trainer's
    token count across gradient-accumulation steps) replaces the local count as the divisor.
    """
    nll, _, _ = token_losses(hidden, weight, labels, bias=bias, chunk=chunk)
    if num_items_in_batch is None:
        divisor = (labels != IGNORE_INDEX).sum().clamp(min=1)
    else:
        divisor = torch.as_tensor(num_items_in_batch, device=nll.device)
    return nll.sum() / divisor.to(nll.device, torch.float32)


def shift_for_next_token(labels: torch.Tensor) -> torch.Tensor:
    """Labels aligned with the hidden state that predicts them: ``labels[:, 1:]`` then one ``-100``."""
    pad = labels.new_full((*labels.shape[:-1], 1), IGNORE_INDEX)  # (B, 1)
    return torch.cat([labels[..., 1:], pad], dim=-1)  # (B, S)


__all__ = ["CHUNK_BYTES", "ChunkedCrossEntropy", "chunk_tokens", "chunked_cross_entropy", "shift_for_next_token",
           "token_losses"]
