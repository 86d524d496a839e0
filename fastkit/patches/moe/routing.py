"""MoE routing math: one stable sort, per-expert GEMMs, an fp32 combine. Pure torch.

:mod:`fastkit.patches.moe.patch` (the glue: which modules, which config, PEFT's factors) runs every MoE
experts forward through these pieces:

- :func:`route`: ONE stable argsort of the flattened top-k assignments groups every (token, k) slot
  by expert; offsets come from the sorted ids with ``searchsorted`` (no ``bincount``, no atomics, no
  host sync);
- :func:`gather_sorted`: tokens gathered once into sorted rows; backward sums the K copies with a
  reshape-sum (deterministic);
- :func:`grouped_matmul`: each projection is one grouped GEMM where :func:`grouped_mm_runs` (zero
  host syncs), else a loop over the counts read back ONCE per layer per forward and kept for
  backward (Note: [host counts]);
- :func:`project`: base GEMM, + LoRA per expert group (``x·Aᵀ·Bᵀ``, never ``W + B·A``), + a
  per-expert bias with a segment-sum gradient;
- :func:`unsort_combine`: routing weights applied and the top-k slots summed in fp32, without
  ``index_add_`` atomics;
- :func:`read_back`, :func:`check_shapes`, :func:`raise_bad_data`: the one host read of a layer (loop
  path counts, data checks) and the errors it can lead to.

What must not change. Tokens of one expert keep their order (stable sort); experts that receive no
tokens get zero gradients, not None; the loop path's backward never syncs; results equal
transformers' ``eager`` and ``grouped_mm`` experts paths (tests/test_moe.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from fastkit import _torch
from fastkit.errors import FastkitError

# ----------------------------------------------------------------------------------------------
# Routing: one stable sort, offsets from the sorted ids.
# ----------------------------------------------------------------------------------------------


@dataclass
class Routing:
    """The (token, k) slots of one layer grouped by expert. ``S = T * K`` slots."""

    perm: torch.Tensor
    """(S,) slot index of each sorted row; slots of one expert stay in token order (stable sort)."""
    inv_perm: torch.Tensor
    """(S,) sorted row of each slot: ``perm[inv_perm] == arange(S)``."""
    sorted_ids: torch.Tensor
    """(S,) expert id of each sorted row (non-decreasing)."""
    ends: torch.Tensor
    """(E,) int32 end row of each expert's group (inclusive prefix sum of the counts)."""
    host_ends: tuple[int, ...] | None = None
    """``ends`` on the host (loop path only): read back once per layer per forward."""
    batched: bool = False
    """Run each projection as ONE batched GEMM over per-row gathered weights (:func:`batched_bytes`)."""
    dequant_group_bytes: int | None = None
    """Bound on one hit group's dequantization (4-bit weight providers; ``MoEConfig.dequant_group_bytes``)."""

    @functools.cached_property
    def counts(self) -> torch.Tensor:
        """(E,) int64 rows per expert (what ``bincount(ids, minlength=E)`` gives), on the device. Built on
        demand (only a per-expert bias's gradient needs it): one ``diff`` of ``ends``, no sync."""
        return torch.diff(self.ends, prepend=self.ends.new_zeros(1)).long()


_BOUNDS: dict[tuple, torch.Tensor] = {}  # (E, device, dtype) -> arange(1, E + 1): built once per shape


def _bounds(num_experts: int, like: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():  # one op in the graph; filling the cache there would be a guard (a recompile)
        return torch.arange(1, num_experts + 1, device=like.device, dtype=like.dtype)  # (E,)
    key = (num_experts, like.device, like.dtype)
    b = _BOUNDS.get(key)
    if b is None:
        b = _BOUNDS[key] = torch.arange(1, num_experts + 1, device=like.device, dtype=like.dtype)  # (E,)
    return b


def route(top_k_index: torch.Tensor, num_experts: int) -> Routing:
    """Group the flattened top-k assignments by expert with ONE stable sort. No host sync.

    Offsets: ``bincount`` sizes its output from ``max(ids)`` and so reads device memory back (a sync on
    CUDA); ``searchsorted`` on the ids that are already sorted gives the inclusive ends with no sync and
    no atomics (``counts == bincount(ids, minlength=E)`` is tested).
    """
    ids = top_k_index.reshape(-1)  # (S,) slot s = token * K + k
    sorted_ids, perm = torch.sort(ids, stable=True)  # (S,), (S,): values and order in one kernel
    inv_perm = torch.empty_like(perm)
    inv_perm.scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))  # (S,) permutation: no duplicates
    ends = torch.searchsorted(sorted_ids, _bounds(num_experts, sorted_ids), out_int32=True)  # (E,) rows with id <= e
    return Routing(perm, inv_perm, sorted_ids, ends)


# ----------------------------------------------------------------------------------------------
# Autograd pieces: gather once, combine in fp32, loop GEMM with host counts, per-expert bias.
# ----------------------------------------------------------------------------------------------


class _GatherSorted(torch.autograd.Function):
    """``hidden (T, H) -> rows (S, H)`` in sorted order. Backward sums the K copies of each token
    with a gather + reshape-sum (no ``index_add_`` atomics, so deterministic)."""

    @staticmethod
    def forward(ctx, hidden, perm, inv_perm, top_k):
        ctx.save_for_backward(inv_perm)
        ctx.shape = (hidden.size(0), top_k, hidden.size(1))
        token_of_row = torch.div(perm, top_k, rounding_mode="floor")  # (S,)
        return hidden.index_select(0, token_of_row)  # (S, H)

    @staticmethod
    def backward(ctx, grad_rows):
        (inv_perm,) = ctx.saved_tensors
        grad_slots = grad_rows.index_select(0, inv_perm)  # (S, H) back in slot order t*K + k
        return grad_slots.view(ctx.shape).sum(1), None, None, None  # (T, H)


class _LoopGroupedMM(torch.autograd.Function):
    """``x (S, in) @ w[e] (in, out)`` per expert group, bounded by host-side ``ends``.

    # Note: [host counts]
    The group boundaries are Python ints read back once per layer per forward (``route`` +
    ``read_back``) and kept on ``ctx``: the backward reuses them, so it never syncs. Experts with
    no rows keep the zeros ``grad_w`` starts from (zero gradients, not None).
    """

    @staticmethod
    def forward(ctx, x, w, host_ends):
        out = x.new_empty(x.size(0), w.size(-1))  # (S, out)
        start = 0
        for e, end in enumerate(host_ends):
            if end > start:
                torch.mm(x[start:end], w[e], out=out[start:end])  # (n_e, in) @ (in, out)
            start = end
        ctx.save_for_backward(x, w)
        ctx.host_ends = host_ends
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, w = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None  # every row lies in one group
        grad_w = x.new_zeros(w.shape) if ctx.needs_input_grad[1] else None  # (E, in, out)
        start = 0
        for e, end in enumerate(ctx.host_ends):  # Note: [host counts]
            if end > start:
                g = grad_out[start:end]  # (n_e, out)
                if grad_x is not None:
                    torch.mm(g, w[e].t(), out=grad_x[start:end])  # (n_e, in)
                if grad_w is not None:
                    torch.mm(x[start:end].t(), g, out=grad_w[e])  # (in, out)
            start = end
        return grad_x, grad_w, None


class _ExpertBias(torch.autograd.Function):
    """``y (S, out) + bias[sorted_ids]``. The bias gradient is a per-expert segment sum
    (``segment_reduce(unsafe=True)``, one reduction per segment: no atomics, no host read; empty experts
    get zeros)."""

    @staticmethod
    def forward(ctx, y, bias, sorted_ids, counts):
        ctx.save_for_backward(counts)
        return y + bias.index_select(0, sorted_ids)  # (S, out)

    @staticmethod
    def backward(ctx, grad):
        (counts,) = ctx.saved_tensors
        grad_bias = None
        if ctx.needs_input_grad[1]:
            # (S, out) -> (E, out). unsafe=True: the safe mode checks the lengths with two host reads *inside*
            # the kernel (a sync a dispatch mode cannot see); counts come from route(): >= 0, summing to S.
            grad_bias = torch.segment_reduce(grad, "sum", lengths=counts, axis=0, unsafe=True)
        return grad, grad_bias, None, None


# ----------------------------------------------------------------------------------------------
# Backends: which grouped GEMM runs where.
# ----------------------------------------------------------------------------------------------

_GROUPED_MM = _torch.grouped_mm_function()


def grouped_mm_runs(w: torch.Tensor) -> bool:
    """True when ``torch.nn.functional.grouped_mm`` runs ``rows (S, in) @ w (E, in, out)`` here with no
    host sync (the rows are fresh, contiguous tensors of width ``in``).

    CUDA: sm80+ and bf16 (other dtypes go through ATen's fallback, which copies the offsets to the
    host). CPU: torch >= 2.9 has a kernel (no device, so no sync to worry about). Elsewhere: no.
    The answer depends only on the layout, so it is kept per (device, dtype, shape, strides, alignment).
    """
    if _GROUPED_MM is None:
        return False
    if torch.compiler.is_compiling():  # no pointer to read (a parameter's storage is allocator-aligned), no cache
        return _grouped_mm_runs.__wrapped__(w.device, w.dtype, tuple(w.shape), w.stride(), w.element_size(), True)
    return _grouped_mm_runs(w.device, w.dtype, tuple(w.shape), w.stride(), w.element_size(), w.data_ptr() % 16 == 0)


@functools.lru_cache(maxsize=256)
def _grouped_mm_runs(device, dtype, shape, stride, item, ptr_aligned) -> bool:
    if device.type == "cuda":
        if dtype != torch.bfloat16 or torch.cuda.get_device_capability(device) < (8, 0):
            return False
    elif device.type != "cpu":
        return False
    strides_ok = all((s * item) % 16 == 0 for s, n in zip(stride, shape) if n > 1 and s != 1)
    return (1 in stride[-2:] and ptr_aligned and strides_ok and (shape[-2] * item) % 16 == 0
            and (shape[-1] * item) % 16 == 0)


def _grouped(x: torch.Tensor, w: torch.Tensor, routing: Routing) -> torch.Tensor:
    """``x (S, in)`` sorted rows times ``w (E, in, out)``: one grouped GEMM, no host sync."""
    if x.dtype != torch.bfloat16 and torch.compiler.is_compiling():  # Note: [grouped GEMM under compile]
        return torch.ops.fastkit.grouped_mm(x, w, routing.ends)  # (S, out)
    return _GROUPED_MM(x, w, offs=routing.ends)  # (S, out)


# Note: [grouped GEMM under compile]
# torch's fake (shape) kernel of grouped_mm accepts bf16 only, while its CPU kernel runs every float dtype: an fp32
# (or fp16) model that takes the grouped path eagerly fails in the first compiled forward. While dynamo traces, the
# GEMM is therefore the operator below, whose kernel is the same ``grouped_mm`` (the same values as eager) and whose
# backward is the two grouped GEMMs of its derivative (rows: ``grad @ w[e]^T``; weights: ``x_e^T @ grad_e``, groups
# along the reduced dimension). bf16 keeps torch's own op (its fake kernel runs, inductor may lower it).


@torch.library.custom_op("fastkit::grouped_mm", mutates_args=())
def grouped_mm_op(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``x (S, in)`` rows grouped by ``ends (E,)`` times ``w (E, in, out)`` -> ``(S, out)`` (grouped_mm's kernel)."""
    return _GROUPED_MM(x, w, offs=ends)


@grouped_mm_op.register_fake
def _(x, w, ends):
    return x.new_empty(x.size(0), w.size(-1))


def _grouped_mm_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _grouped_mm_backward(ctx, grad):
    x, w, ends = ctx.saved_tensors
    grad = grad.contiguous()
    grad_x = torch.ops.fastkit.grouped_mm(grad, w.transpose(-2, -1), ends) if ctx.needs_input_grad[0] else None
    grad_w = torch.ops.fastkit.grouped_mm_weight(x, grad, ends) if ctx.needs_input_grad[1] else None
    return grad_x, grad_w, None


@torch.library.custom_op("fastkit::grouped_mm_weight", mutates_args=())
def grouped_mm_weight(x: torch.Tensor, grad: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Per group ``x_e^T (in, n_e) @ grad_e (n_e, out)`` -> ``(E, in, out)`` (zeros for an empty group)."""
    return _GROUPED_MM(x.t(), grad, offs=ends)


@grouped_mm_weight.register_fake
def _(x, grad, ends):
    return x.new_empty(ends.size(0), x.size(1), grad.size(1))


grouped_mm_op.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


def batched_bytes(rows: int, weights: list[torch.Tensor]) -> int:
    """Bytes the batched path gathers: every sorted row gets its own copy of each ``(in, out)`` weight."""
    return rows * sum(w[0].numel() * w.element_size() for w in weights)


def _batched(x: torch.Tensor, w: torch.Tensor, routing: Routing) -> torch.Tensor:
    """``x (S, in)`` sorted rows times their own expert's ``w (in, out)``: one ``bmm``, no host sync.
    Only for weights that need no gradient (an ``index_select`` backward would add rows with atomics)."""
    per_row = w.index_select(0, routing.sorted_ids)  # (S, in, out)
    return torch.bmm(x.unsqueeze(1), per_row).squeeze(1)  # (S, 1, in) @ (S, in, out) -> (S, out)


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Per-expert ``x @ w[e]`` on the path this forward chose (host ends present: the loop; ``batched``:
    one bmm over gathered weights; else one grouped GEMM).

    ``w`` may be a weight provider instead of a tensor (``fastkit.patches.moe.nf4.NF4Experts``): an object
    with ``group_matmul(x, host_ends, max_bytes)`` that materializes one group of hit experts at a time
    (at most ``max_bytes`` of transient); it always takes the loop.
    """
    if not isinstance(w, torch.Tensor):
        return w.group_matmul(x, routing.host_ends, routing.dequant_group_bytes)  # (S, out)
    x = x.to(w.dtype)
    if routing.host_ends is not None:
        return _LoopGroupedMM.apply(x, w, routing.host_ends)  # (S, out)
    if routing.batched:
        return _batched(x, w, routing)  # (S, out)
    return _grouped(x, w, routing)  # (S, out)


# ----------------------------------------------------------------------------------------------
# What the experts forwards call.
# ----------------------------------------------------------------------------------------------


def gather_sorted(hidden: torch.Tensor, routing: Routing, top_k: int) -> torch.Tensor:
    """``hidden (T, H) -> rows (S, H)`` in ``routing``'s sorted order (token ``s // K`` for slot ``s``).

    # Note: [plain ops off CUDA]
    On CUDA the gather's backward must not be ``index_select``'s (an ``index_add_`` with K duplicate
    indices per token: float atomics, a different rounding from run to run), so it is
    :class:`_GatherSorted` (a reshape-sum). Elsewhere ``index_add_`` runs its indices in order
    (deterministic) and the plain op saves the Python autograd node (measured: that overhead is most of
    what separates the two at small shapes on a CPU).
    """
    if hidden.device.type != "cuda":
        return hidden.index_select(0, torch.div(routing.perm, top_k, rounding_mode="floor"))  # (S, H)
    return _GatherSorted.apply(hidden, routing.perm, routing.inv_perm, top_k)


def unsort_combine(rows: torch.Tensor, weights: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Sorted ``rows (S, H)`` and ``weights (T, K)`` -> ``(T, H) = sum_k w[t,k] * row(t,k)``, in fp32.

    Plain ops: the unsort gathers by ``inv_perm``, a permutation, so its backward's ``index_add_``
    writes every row once (no two atomics meet: deterministic on every device); the sum over k is a
    reshape-sum. Rows and weights are multiplied and summed in fp32 whatever the model dtype.
    """
    t, k = weights.shape
    slots = rows.index_select(0, routing.inv_perm).view(t, k, -1)  # (T, K, H) slot order
    if slots.dtype == torch.float32 and weights.dtype == torch.float32:
        return (slots * weights.unsqueeze(-1)).sum(1)  # (T, H)
    return (slots.float() * weights.float().unsqueeze(-1)).sum(1).to(rows.dtype)  # (T, H) summed in fp32


def in_out(weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """Expert weight as ``(E, in, out)`` (a view). A weight provider (not a tensor) already is."""
    if not isinstance(weight, torch.Tensor):
        return weight
    return weight if transposed else weight.transpose(-2, -1)


@dataclass
class Projection:
    """One expert projection as the forward consumes it."""

    name: str
    """``gate_up_proj`` / ``up_proj`` / ``down_proj``."""
    weight: torch.Tensor
    """(E, in, out) view of the base weight (never ``W + B·A``), or a weight provider (4-bit experts)."""
    bias: torch.Tensor | None
    """(E, out) or None."""
    loras: list[tuple]
    """Updates ``(first (E, in, r), second (E, r, out), scale, dropout)``, each ``s·drop(x)·first·second``:
    PEFT's adapter and/or fastkit's ``ExpertLoRA`` (both apply when both are attached)."""


def project(p: Projection, x: torch.Tensor, routing: Routing) -> torch.Tensor:
    """One expert projection on sorted rows: base GEMM, + LoRA per group, + bias. ``(S, out)``."""
    y = grouped_matmul(x, p.weight, routing)  # (S, out)
    for first, second, scale, dropout in p.loras:
        h = grouped_matmul(dropout(x), first, routing)  # (S, r)
        y = y + (scale * grouped_matmul(h, second, routing)).to(y.dtype)  # (S, out)
    if p.bias is not None and p.bias.requires_grad and torch.is_grad_enabled():
        y = _ExpertBias.apply(y, p.bias, routing.sorted_ids, routing.counts)
    elif p.bias is not None:  # a frozen bias: no gradient to segment-sum, so no autograd node of ours
        y = y + p.bias.index_select(0, routing.sorted_ids)  # (S, out)
    return y


def read_back(routing: Routing, weights: torch.Tensor, num_experts: int, check: bool, with_ends: bool):
    """ONE host read of what this layer needs: the group ends (loop path) and the data checks.

    Returns ``(host_ends | None, (min_id, max_id, n_nonfinite) | None)``.
    """
    parts = [routing.ends.long()] if with_ends else []
    if check:
        # detached: isfinite is composite (abs, ==) and would save a tensor for backward in the first
        # forward only, so a checkpoint recompute (which skips the check) would not match it.
        bad = (~torch.isfinite(weights.detach())).sum().view(1)
        parts += [routing.sorted_ids[:1].long(), routing.sorted_ids[-1:].long(), bad]
    host = torch.cat(parts).tolist()  # the one sync of this layer's forward
    ends = tuple(host[:num_experts]) if with_ends else None
    return ends, (tuple(host[-3:]) if check else None)


def check_shapes(name: str, num_experts: int, hidden, top_k_index, top_k_weights) -> None:
    """Static checks of the router output (shapes only, never a sync); ``name`` starts every message."""
    e = num_experts
    if top_k_index.dim() != 2 or top_k_index.shape != top_k_weights.shape or top_k_index.size(0) != hidden.size(0):
        raise FastkitError(f"{name}: router output shapes do not match: hidden {tuple(hidden.shape)}, "
                           f"top_k_index {tuple(top_k_index.shape)}, top_k_weights {tuple(top_k_weights.shape)}.")
    if top_k_index.dtype.is_floating_point or top_k_index.dtype == torch.bool:
        raise FastkitError(f"{name}: router indices must be integers, got {top_k_index.dtype}.")
    if top_k_index.size(1) > e:
        raise FastkitError(f"{name}: top_k={top_k_index.size(1)} is larger than num_experts={e}; "
                           "lower config.num_experts_per_tok.")


def raise_bad_data(name: str, num_experts: int, facts: tuple[int, int, int]) -> None:
    """Raise on what :func:`read_back` found: expert ids out of range, non-finite routing weights."""
    lo, hi, nonfinite = facts
    if lo < 0 or hi >= num_experts:
        raise FastkitError(f"{name}: router produced expert ids in [{lo}, {hi}], outside [0, {num_experts - 1}] "
                           "(num_experts). Check the router / config.num_experts.")
    if nonfinite:
        raise FastkitError(f"{name}: {nonfinite} routing weights are NaN or inf: the router logits are not "
                           "finite (diverged training, a bad learning rate, or fp16 overflow).")


__all__ = ["Projection", "Routing", "batched_bytes", "check_shapes", "gather_sorted", "grouped_matmul",
           "grouped_mm_runs", "in_out", "project", "raise_bad_data", "read_back", "route", "unsort_combine"]
