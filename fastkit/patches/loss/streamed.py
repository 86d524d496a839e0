"""Cross-entropy over an lm_head that stays in host memory: the vocabulary streamed in row chunks.

Replaces :class:`fastkit.patches.loss.chunked.ChunkedCrossEntropy` when the lm_head weight ``(V, H)`` lives
on the host (:mod:`fastkit.patches.host`): there every token chunk would need the whole head on the device.
Here the chunks run over the vocabulary instead. The forward copies ``rows`` vocabulary rows at a time to
the device (double-buffered, :func:`fastkit.patches.host.rows.device_chunks`), projects all ``N`` tokens on
them (one ``(N, rows)`` fp32 block) and folds the block into running per-token statistics: the max and the
sums ``sum exp(l - m)`` and ``sum exp(l - m) * l`` (log-sum-exp and entropy, rescaled when the max grows),
the label's logit when the label falls in the chunk, and the running arg-max (first index wins, as
``argmax``). The backward streams the chunks a second time and accumulates
``grad_hidden += (softmax - onehot) * grad @ W_chunk`` from the saved log-sum-exp. Per step that is two
transfers of the head (2 x 1.08 GiB for GPT-OSS-20B in fp16) and, on the device, two row chunks and a few
``(N, rows)`` blocks instead of the head.

What must not change: the loss, ``log_probs`` (= -nll), ``entropy`` and ``is_top1`` equal the on-device
chunked cross-entropy (fp32 rounding: the sums run in another order), and the gradient of the hidden
states likewise. The head is frozen: no gradient for its weight or bias (the glue refuses a trainable head).

Pure torch (imports torch and fastkit's pure-torch row streaming only).
"""

from __future__ import annotations

import torch

from fastkit.patches.host.rows import device_chunks, row_bounds, vocab_rows

IGNORE_INDEX = -100


def _logits(hidden, w, bias, start, stop):
    logits = hidden @ w.t()  # (N, H) @ (H, C) -> (N, C), in the compute dtype
    if bias is not None:
        logits = logits + bias[start:stop].to(logits.device, non_blocking=True)
    return logits.float()


def _in_chunk(labels, start, stop):
    hit = (labels >= start) & (labels < stop)  # (N,)
    return hit, (labels - start).clamp(0, stop - start - 1).unsqueeze(1)  # (N, 1) column of the label


class StreamedCrossEntropy(torch.autograd.Function):
    """Per-token ``(nll, entropy, is_top1)`` of ``hidden @ weight.T (+ bias)``, ``weight`` streamed from the host."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, rows):
        # hidden (N, H) on the device; weight (V, H), bias (V,) on the host; labels (N,) with IGNORE_INDEX
        n = hidden.shape[0]
        f32 = dict(dtype=torch.float32, device=hidden.device)
        m = torch.full((n,), float("-inf"), **f32)  # running max logit (N,)
        s = torch.zeros(n, **f32)  # sum exp(l - m) (N,)
        t = torch.zeros(n, **f32)  # sum exp(l - m) * l (N,)
        picked = torch.zeros(n, **f32)  # the label's logit (N,)
        best_idx = torch.zeros(n, dtype=torch.long, device=hidden.device)  # running argmax (N,)
        bounds = row_bounds(weight.shape[0], rows)
        for start, stop, w in device_chunks(weight, bounds, hidden.device):
            logits = _logits(hidden, w, bias, start, stop)  # (N, C) fp32
            cmax, cidx = logits.max(dim=-1)  # (N,), (N,)
            best_idx = torch.where(cmax > m, cidx + start, best_idx)  # strict: the first maximum wins
            new_m = torch.maximum(m, cmax)
            rescale = torch.exp(m - new_m)  # (N,): 0 on the first chunk (m = -inf)
            e = torch.exp(logits - new_m.unsqueeze(1))  # (N, C)
            s = s * rescale + e.sum(dim=-1)
            t = t * rescale + torch.bmm(e.unsqueeze(1), logits.unsqueeze(2)).view(n)  # (N,1,C)@(N,C,1) -> (N,)
            m = new_m
            hit, col = _in_chunk(labels, start, stop)
            picked = torch.where(hit, logits.gather(1, col).squeeze(1), picked)  # (N, 1) -> (N,)
            del logits, e
        lse = m + torch.log(s)  # (N,)
        valid = labels != IGNORE_INDEX
        nll = torch.where(valid, lse - picked, 0.0)
        entropy = torch.where(valid, lse - t / s, 0.0)
        top1 = valid & (best_idx == labels)
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.rows = rows
        ctx.mark_non_differentiable(entropy, top1)
        return nll, entropy, top1

    @staticmethod
    def backward(ctx, grad_nll, *_):
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        scale = (grad_nll.float() * (labels != IGNORE_INDEX)).unsqueeze(1)  # (N, 1), 0 where ignored
        grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)  # (N, H)
        bounds = row_bounds(weight.shape[0], ctx.rows)
        for start, stop, w in device_chunks(weight, bounds, hidden.device):
            grad = _logits(hidden, w, bias, start, stop).sub_(lse.unsqueeze(1)).exp_()  # (N, C) softmax
            hit, col = _in_chunk(labels, start, stop)
            grad.scatter_add_(1, col, -hit.to(grad.dtype).unsqueeze(1))  # - onehot where the label is here
            grad.mul_(scale)
            grad_h += (grad.to(w.dtype) @ w).float()  # (N, C) @ (C, H) -> (N, H)
            del grad
        return grad_h.to(hidden.dtype), None, None, None, None


def streamed_token_losses(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                          bias: torch.Tensor | None = None, rows: int = 16384
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(nll, entropy, is_top1)`` per position of ``labels`` (each shaped like ``labels``), vocabulary streamed.

    ``hidden`` ``(..., H)`` is on the device, ``weight`` ``(V, H)`` (frozen) on the host; ``nll`` carries the
    gradient of ``hidden``; all three are 0 / False where the label is ``-100``.
    """
    flat_h = hidden.reshape(-1, hidden.shape[-1])  # (..., H) -> (N, H)
    flat_labels = labels.reshape(-1).to(flat_h.device)  # (...) -> (N,)
    out = StreamedCrossEntropy.apply(flat_h, weight, bias, flat_labels, rows)
    return tuple(t.view(labels.shape) for t in out)  # (N,) -> (...)


__all__ = ["StreamedCrossEntropy", "streamed_token_losses", "vocab_rows"]
