"""Packed attention as one operator ``torch.compile`` sees once: ``fastkit::packed_attention``.

What it replaces. Under ``torch.compile``, dynamo would trace the per-document kernels of
:mod:`fastkit.patches.packing.attention` with the document lengths as Python ints: one loop iteration
per document, every length a constant, so each new packed layout compiles again. The operator here takes
the layout as a tensor instead: ``cu`` (int64 on the host, ``(documents + 1,)``), the cumulative document
lengths over the flattened ``B*T`` tokens. The compiler sees an opaque call whose inputs change size
(dynamic shapes), not the loop: a packed row with other document counts or lengths, or another total
length, reuses the compiled graph.

What it does. At run time the operator reads ``cu`` on the host (a CPU tensor: no device sync), builds the
:class:`PackedBatch` and calls the same :func:`packed_attention` as eager fastkit (the same kernel choice,
the same numerics). Its backward is a second operator that recomputes the attention of the layer under
autograd and returns the gradients of q, k, v (and the GPT-OSS sinks): one extra attention forward per
layer in backward, the price of keeping the per-document loop out of the compiler's sight. Dropout would
draw a different mask in that recompute, so a training call with attention dropout is refused.

Used by the dispatcher of :mod:`fastkit.patches.packing.patch` only while dynamo traces (eager fastkit
calls the kernels directly, unchanged). What must not change: the output and every gradient equal the
eager packed path (the same kernels run on the same values).
"""

from __future__ import annotations

import numpy as np
import torch

from fastkit import _torch
from fastkit.errors import FastkitError
from fastkit.patches.packing.attention import PackedBatch, packed_attention

NO_SINKS = torch.empty(0)
"""Placeholder gradient of absent sinks (an operator returns tensors only)."""


def cu_tensor(lengths: list[list[int]], padded: bool = False) -> torch.Tensor:
    """int64 host ``(documents + 1,)``: cumulative lengths over the flattened rows (the operator's layout input).

    ``padded``: ``(B*T + 1,)`` instead, the total repeated at the end (Note [padded layout])."""
    flat = [n for row in lengths for n in row]
    cu = np.concatenate([[0], np.cumsum(flat)]).astype(np.int64)
    if padded:
        cu = np.concatenate([cu, np.full(int(cu[-1]) + 1 - cu.size, cu[-1], dtype=np.int64)])
    return torch.from_numpy(cu)


# Note: [padded layout]
# A graph compiled with dynamic shapes gives each changing size its own symbol, and dynamo makes a size dynamic
# only once it has seen it change: an exact ``cu`` of ``documents + 1`` entries next to ``T`` tokens can compile a
# third time when the document count first changes after the row length did. Padded to ``B*T + 1`` entries (the
# total repeated), the layout's size changes exactly when the row length does, so under ``dynamic=None`` any
# sequence of layouts compiles at most twice (static, then dynamic). The padding is dropped when it is read.


def batch_from_cu(cu: torch.Tensor, rows: int, row_len: int) -> PackedBatch:
    """The :class:`PackedBatch` of host ``cu`` over ``rows`` rows of ``row_len`` tokens (checked)."""
    if cu.device.type != "cpu":
        raise FastkitError(f"fastkit_cu_seqlens must be a CPU tensor (the host copy of the layout), got {cu.device}.")
    bounds = [int(b) for b in cu.tolist()]
    while len(bounds) > 2 and bounds[-2] == bounds[-1] == rows * row_len:  # Note [padded layout]
        bounds.pop()
    ends = set(range(0, rows * row_len + 1, row_len))
    if (not bounds or bounds[0] != 0 or bounds[-1] != rows * row_len or any(b <= a for a, b in zip(bounds, bounds[1:]))
            or not ends <= set(bounds)):
        raise FastkitError(f"fastkit_cu_seqlens {bounds[:8]}{'...' if len(bounds) > 8 else ''} must start at 0, "
                           f"increase strictly, end at {rows * row_len} (repeats of it may follow) and have a "
                           f"boundary at every row end ({row_len} tokens per row).")
    lengths, row, start = [], [], 0
    for a, b in zip(bounds, bounds[1:]):
        row.append(b - a)
        if b - start == row_len:
            lengths.append(row)
            row, start = [], b
    return PackedBatch(rows, row_len, lengths, max(max(r) for r in lengths), None)


def _run(q, k, v, cu, sinks, scaling, dropout, window, softcap, training, context=0) -> torch.Tensor:
    meta = batch_from_cu(cu, q.shape[0], q.shape[2])
    if 0 < context < meta.max_seqlen:
        raise FastkitError(f"fastkit_cu_seqlens: a packed document has {meta.max_seqlen} tokens, above the model's "
                           f"context (max_position_embeddings={context}); lower max_length.")
    return packed_attention(q, k, v, meta, scaling=scaling, dropout=dropout, window=window or None,
                            softcap=softcap or None, sinks=sinks, training=training)


@torch.library.custom_op("fastkit::packed_attention", mutates_args=())
def packed_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
                        sinks: torch.Tensor | None, scaling: float | None, dropout: float, window: int,
                        softcap: float, training: bool, context: int) -> torch.Tensor:
    """Attention within each document of host ``cu``: q ``(B, Hq, T, D)``, k/v ``(B, Hkv, T, Dv)`` -> ``(B, T, Hq, Dv)``

    ``window`` 0: no sliding window; ``softcap`` 0: none; ``context`` > 0: the longest document allowed."""
    out = _run(q, k, v, cu, sinks, scaling, dropout, window, softcap, training, context).contiguous()
    return out if all(out.data_ptr() != t.data_ptr() for t in (q, k, v)) else out.clone()  # the fake's layout


@packed_attention_op.register_fake
def _(q, k, v, cu, sinks, scaling, dropout, window, softcap, training, context):
    b, hq, t, _ = q.shape
    return q.new_empty(b, t, hq, v.shape[-1])


@torch.library.custom_op("fastkit::packed_attention_backward", mutates_args=())
def packed_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              cu: torch.Tensor, sinks: torch.Tensor | None, scaling: float | None, window: int,
                              softcap: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of q, k, v and the sinks (empty when there are none): the layer's attention recomputed."""
    with _torch.autograd_in_operator():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        if sinks is not None:
            leaves.append(sinks.detach().requires_grad_())
        out = _run(*leaves[:3], cu, leaves[3] if sinks is not None else None, scaling, 0.0, window, softcap, True)
        grads = torch.autograd.grad(out, leaves, grad)
    dsinks = grads[3].contiguous() if sinks is not None else NO_SINKS.to(q.device)
    return grads[0].contiguous(), grads[1].contiguous(), grads[2].contiguous(), dsinks  # the fake's layout


@packed_attention_backward.register_fake
def _(grad, q, k, v, cu, sinks, scaling, window, softcap):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            sinks.new_empty(sinks.shape) if sinks is not None else q.new_empty(0))


def _setup_context(ctx, inputs, output):
    q, k, v, cu, sinks, scaling, _dropout, window, softcap, _training, _context = inputs
    ctx.save_for_backward(q, k, v, cu, sinks)
    ctx.args = (scaling, window, softcap)


def _backward(ctx, grad):
    q, k, v, cu, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = packed_attention_backward(grad, q, k, v, cu, sinks, *ctx.args)
    return dq, dk, dv, None, dsinks if sinks is not None else None, None, None, None, None, None, None


packed_attention_op.register_autograd(_backward, setup_context=_setup_context)


def host_cu(meta: PackedBatch) -> torch.Tensor:
    """The host layout tensor of ``meta`` (built with the batch; from ``cu_device`` once: one read per batch)."""
    if meta.cu_host is None:
        meta.cu_host = cu_tensor(meta.lengths)
    return meta.cu_host


def traced_attention(query, key, value, meta: PackedBatch, *, scaling, dropout, window, softcap, sinks,
                     training) -> torch.Tensor:
    """The operator call the dispatcher makes while dynamo traces (arguments as :func:`packed_attention`).

    A traced batch (no host lengths) carries the model's context in ``max_seqlen``: the operator checks it."""
    if dropout and training:
        raise FastkitError(f"attention dropout {dropout} under torch.compile: fastkit's compiled packed attention "
                           "recomputes attention in backward and cannot replay the dropout mask. Set the model's "
                           "attention_dropout to 0, or train without compile.")
    context = meta.max_seqlen if meta.lengths_host is None else 0
    return torch.ops.fastkit.packed_attention(query, key, value, host_cu(meta), sinks, scaling, float(dropout),
                                              int(window or 0), float(softcap or 0.0), bool(training), context)


__all__ = ["batch_from_cu", "cu_tensor", "host_cu", "packed_attention_op", "traced_attention"]
