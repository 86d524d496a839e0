"""MoE experts in one sort: a fastkit ``ExpertsInterface`` function for every decorated family.

What it replaces. transformers 5.24 runs the experts of ~70 families through
``@use_experts_implementation``; ``config._experts_implementation`` picks the function:
``eager`` (the class's own loop: ``nonzero`` + one ``torch.where`` per hit expert, O(experts)
host syncs per layer), ``grouped_mm`` (sort + ``histc`` + grouped GEMM; where the grouped GEMM
does not run, e.g. a T4, ``transformers::grouped_mm_fallback`` reads the offsets back once per
GEMM: two syncs in forward and two in backward per layer). :class:`MoEExpertsPatch` registers
:func:`fastkit_experts_forward` under the key ``"fastkit"`` and selects it on the model's configs.

Why. One stable argsort of the flattened top-k assignments groups every (token, k) slot by
expert; offsets come from the sorted ids (no atomics); tokens are gathered once; each projection
is one grouped GEMM where it runs on the device (zero host syncs), else a loop over the counts
read back ONCE per layer per forward and kept for backward (zero syncs there). Routing weights are
applied and the top-k slots summed in fp32, without ``index_add_`` atomics. LoRA factors attached
by :mod:`fastkit.moe_lora` are applied per expert group (``x·Aᵀ·Bᵀ``), never as ``W + B·A``.

Families transformers still loops over without the decorator: DBRX (``DbrxExperts``: a
``nonzero`` + per-expert loop) and Llama-4 (``Llama4TextMoe``: every token through every expert,
a dense bmm) get the same routing through a per-instance ``forward`` swap (Note: [looped
families]); JetMoE (its own top-k gating and mixture-of-attention experts) keeps transformers' path.

What must not change. Logits and every gradient equal transformers' ``eager`` and ``grouped_mm``
paths on the same weights (fp32: to rounding; tests/test_moe.py). Tokens of one expert keep their
order (stable sort). Experts that receive no tokens get zero gradients, not None. The module's own
``_apply_gate`` (GPT-OSS interleaved clamp-SwiGLU, the default concatenated SwiGLU), ``act_fn``,
biases, ``is_transposed`` layouts and ``post_expert_norm`` are used as they are. Shared experts
(Qwen2-MoE, DeepSeek-V3) live outside the experts module and are untouched.

    model = twin("qwen3_moe")
    apply_patch(model, MoEExpertsPatch(facts_for("qwen3_moe")))   # or FastModel.patch(model)
"""

from __future__ import annotations

import logging
import os
import types
from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

from fastkit.errors import FastkitError

logger = logging.getLogger(__name__)

EXPERTS_KEY = "fastkit"
"""The key fastkit's experts function is registered under in transformers' ``ExpertsInterface``."""

_STATE_ATTR = "_fastkit_moe"  # per experts-module instance: its _LayerState (set through the Swapper)
_LORA_ATTR = "fastkit_lora"  # per experts-module child: fastkit.moe_lora.ExpertLoRA, when attached
_DEBUG_ENV = "FASTKIT_MOE_DEBUG"

_MODES = ("auto", "grouped", "loop")
_VALIDATE = ("auto", "always", "first", "off")


@dataclass
class MoEConfig:
    """How fastkit runs the experts of one model."""

    mode: str = "auto"
    """``"auto"``: grouped GEMM where it runs on this device and dtype (CUDA sm80+ bf16, CPU), else
    the host-count loop. ``"grouped"`` / ``"loop"`` force one (tests and benchmarks)."""
    validate: str = "auto"
    """Data checks (router ids in range, finite routing weights) need the host to read device values.
    ``"auto"``: every forward on the loop path (the check rides on the one count read-back, so it is
    free), only the first forward of each layer on the grouped path (one sync, once). ``"always"``:
    every forward (one sync per layer on the grouped path). ``"first"``: first forward per layer only.
    ``"off"``: never. The environment variable ``FASTKIT_MOE_DEBUG=1`` turns ``"auto"`` into ``"always"``."""

    def __post_init__(self):
        if self.mode not in _MODES:
            raise FastkitError(f"MoEConfig.mode must be one of {_MODES}, got {self.mode!r}.")
        if self.validate not in _VALIDATE:
            raise FastkitError(f"MoEConfig.validate must be one of {_VALIDATE}, got {self.validate!r}.")


@dataclass
class _LayerState:
    """Per experts-module facts the forward needs: a name for errors, the config, checked once."""

    name: str
    """Qualified module name (``model.layers.3.mlp.experts``), used in every error message."""
    config: MoEConfig = field(default_factory=MoEConfig)
    """The model's MoE settings."""
    checked: bool = False
    """The data checks passed once (``validate="auto"|"first"`` on the grouped path)."""


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
    counts: torch.Tensor
    """(E,) int64 rows per expert (what ``bincount(ids, minlength=E)`` gives), on the device."""
    host_ends: tuple[int, ...] | None = None
    """``ends`` on the host (loop path only): read back once per layer per forward."""


def route(top_k_index: torch.Tensor, num_experts: int) -> Routing:
    """Group the flattened top-k assignments by expert with ONE stable argsort. No host sync.

    Counts: ``bincount`` sizes its output from ``max(ids)`` and so reads device memory back (a sync on
    CUDA); ``searchsorted`` on the ids that are already sorted gives the same counts with no sync and
    no atomics (``counts == bincount(ids, minlength=E)`` is tested).
    """
    ids = top_k_index.reshape(-1)  # (S,) slot s = token * K + k
    perm = torch.argsort(ids, stable=True)  # (S,)
    sorted_ids = ids.index_select(0, perm)  # (S,)
    inv_perm = torch.empty_like(perm)
    inv_perm.scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))  # (S,) permutation: no duplicates
    bounds = torch.arange(1, num_experts + 1, device=ids.device, dtype=sorted_ids.dtype)  # (E,)
    ends = torch.searchsorted(sorted_ids, bounds, out_int32=True)  # (E,) rows with id <= e
    counts = torch.diff(ends, prepend=ends.new_zeros(1)).long()  # (E,)
    return Routing(perm, inv_perm, sorted_ids, ends, counts)


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


class _UnsortCombine(torch.autograd.Function):
    """``rows (S, H)`` sorted, ``weights (T, K)`` -> ``out (T, H) = sum_k w[t,k] * row(t,k)`` in fp32.

    The unsort is a gather by ``inv_perm`` and the sum over k a reshape-sum: deterministic, and
    the weights multiply in fp32 whatever the model dtype (bf16 rows are upcast per element)."""

    @staticmethod
    def forward(ctx, rows, weights, perm, inv_perm):
        t, k = weights.shape
        slots = rows.index_select(0, inv_perm).view(t, k, -1)  # (T, K, H)
        ctx.save_for_backward(slots, weights, perm)
        out = torch.einsum("tkh,tk->th", slots.float(), weights.float())  # (T, H) fp32
        return out.to(rows.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        slots, weights, perm = ctx.saved_tensors
        g = grad_out.float()  # (T, H)
        grad_slots = torch.einsum("th,tk->tkh", g, weights.float()).to(slots.dtype)  # (T, K, H)
        grad_rows = grad_slots.flatten(0, 1).index_select(0, perm)  # (S, H) sorted order
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = torch.einsum("tkh,th->tk", slots.float(), g).to(weights.dtype)  # (T, K)
        return grad_rows, grad_w, None, None


class _LoopGroupedMM(torch.autograd.Function):
    """``x (S, in) @ w[e] (in, out)`` per expert group, bounded by host-side ``ends``.

    # Note: [host counts]
    The group boundaries are Python ints read back once per layer per forward (``route`` +
    ``_read_back``) and kept on ``ctx``: the backward reuses them, so it never syncs. Experts with
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
    (``segment_reduce``, one reduction per segment: no atomics; empty experts get zeros)."""

    @staticmethod
    def forward(ctx, y, bias, sorted_ids, counts):
        ctx.save_for_backward(counts)
        return y + bias.index_select(0, sorted_ids)  # (S, out)

    @staticmethod
    def backward(ctx, grad):
        (counts,) = ctx.saved_tensors
        grad_bias = None
        if ctx.needs_input_grad[1]:
            grad_bias = torch.segment_reduce(grad, "sum", lengths=counts, axis=0)  # (E, out)
        return grad, grad_bias, None, None


# ----------------------------------------------------------------------------------------------
# Backends: which grouped GEMM runs where.
# ----------------------------------------------------------------------------------------------

_HAS_GROUPED = hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm")


def _aligned(t: torch.Tensor) -> bool:
    """grouped_mm wants every non-unit stride and the base pointer on 16 bytes."""
    item = t.element_size()
    return t.data_ptr() % 16 == 0 and all((s * item) % 16 == 0 for s, n in zip(t.stride(), t.shape) if n > 1 and s != 1)


def grouped_mm_runs(w: torch.Tensor) -> bool:
    """True when ``torch.nn.functional.grouped_mm`` runs ``rows (S, in) @ w (E, in, out)`` here with no
    host sync (the rows are fresh, contiguous tensors of width ``in``).

    CUDA: sm80+ and bf16 (other dtypes go through ATen's fallback, which copies the offsets to the
    host). CPU: torch >= 2.9 has a kernel (no device, so no sync to worry about). Elsewhere: no.
    """
    if not _HAS_GROUPED:
        return False
    if w.device.type == "cuda":
        if w.dtype != torch.bfloat16 or torch.cuda.get_device_capability(w.device) < (8, 0):
            return False
    elif w.device.type != "cpu":
        return False
    item = w.element_size()
    return 1 in w.stride()[-2:] and _aligned(w) and (w.size(-2) * item) % 16 == 0 and (w.size(-1) * item) % 16 == 0


def _grouped(x: torch.Tensor, w: torch.Tensor, routing: Routing) -> torch.Tensor:
    """``x (S, in)`` sorted rows times ``w (E, in, out)``: one grouped GEMM, no host sync."""
    fn = F.grouped_mm if hasattr(F, "grouped_mm") else torch._grouped_mm
    return fn(x, w, offs=routing.ends)  # (S, out)


def _matmul(x: torch.Tensor, w: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Per-expert ``x @ w[e]`` on the path this forward chose (host ends present: the loop)."""
    x = x.to(w.dtype)
    if routing.host_ends is not None:
        return _LoopGroupedMM.apply(x, w, routing.host_ends)  # (S, out)
    return _grouped(x, w, routing)  # (S, out)


# ----------------------------------------------------------------------------------------------
# The experts function.
# ----------------------------------------------------------------------------------------------


def _in_out(weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """Expert weight as ``(E, in, out)`` (a view)."""
    return weight if transposed else weight.transpose(-2, -1)


@dataclass
class _Proj:
    """One expert projection as the forward consumes it."""

    name: str
    """``gate_up_proj`` / ``up_proj`` / ``down_proj``."""
    weight: torch.Tensor
    """(E, in, out) view of the base weight (never ``W + B·A``)."""
    bias: torch.Tensor | None
    """(E, out) or None."""
    loras: list[tuple]
    """Updates ``(first (E, in, r), second (E, r, out), scale, dropout)``, each ``s·drop(x)·first·second``:
    PEFT's adapter and/or fastkit's ``ExpertLoRA`` (both apply when both are attached)."""


def _peft_factors(module: torch.nn.Module, name: str):
    """PEFT ``target_parameters`` LoRA active on ``module.<name>``: ``(W, lora)`` or None.

    # Note: [PEFT factors]
    PEFT's ``ParamWrapper`` registers a parametrization for the duration of its forward; reading
    ``module.<name>`` would run it and build ``W + s·lhs@rhs`` for every expert (and its full-size
    gradient in backward). With exactly one ``_LoraFactorsProxy`` on the parameter (one adapter,
    fp32/bf16/fp16 weights), the base weight is ``parametrizations[name].original`` and the update
    ``lhs@rhs`` (in the parameter's own layout) is applied per expert group instead. Anything else
    (several adapters, fp8 upcasts) is read through the parametrization, i.e. PEFT's own semantics.
    """
    plist = getattr(getattr(module, "parametrizations", None), name, None)
    if plist is None:
        return None
    mods = list(plist)
    if len(mods) != 1 or type(mods[0]).__name__ != "_LoraFactorsProxy":
        return None
    proxy = mods[0]
    lhs, rhs = proxy.lhs, proxy.rhs  # param layout: delta = lhs @ rhs
    if module.is_transposed:  # (E, in, out) = (E, in, r) @ (E, r, out)
        first, second = lhs, rhs
    else:  # (E, out, in) = (E, out, r) @ (E, r, in): in (in, out) layout, rhsᵀ then lhsᵀ
        first, second = rhs.transpose(-2, -1), lhs.transpose(-2, -1)
    # PEFT's B is (out, r·E) with the expert index fastest: its (E, ·, ·) view has no unit stride in the
    # last two dims, which grouped_mm needs. The copy is E·r·out elements, a factor r/in of the weight.
    first, second = (f if 1 in f.stride()[-2:] else f.contiguous() for f in (first, second))
    return plist.original, (first, second, proxy.scaling, torch.nn.Identity())


def _raw(module: torch.nn.Module, name: str) -> torch.Tensor:
    """The stored tensor ``name``, without running a parametrization."""
    plist = getattr(getattr(module, "parametrizations", None), name, None)
    return plist.original if plist is not None else getattr(module, name)


def _projections(module: torch.nn.Module, raw: bool = False) -> list[_Proj]:
    """The up and down projections with their bias and LoRA update (PEFT's or fastkit's)."""
    up = "gate_up_proj" if module.has_gate else "up_proj"
    fk_lora = getattr(module, _LORA_ATTR, None)
    out = []
    for name in (up, "down_proj"):
        bias = getattr(module, f"{name}_bias", None) if module.has_bias else None
        peft = None if raw else _peft_factors(module, name)
        if peft is not None:
            weight, loras = peft[0], [peft[1]]
        else:
            weight, loras = (_raw(module, name) if raw else getattr(module, name)), []
        if fk_lora is not None and fk_lora.enabled and fk_lora.factors(name) is not None:
            loras.append(fk_lora.factors(name))
        out.append(_Proj(name, _in_out(weight, module.is_transposed), bias, loras))
    return out


def _project(p: _Proj, x: torch.Tensor, routing: Routing) -> torch.Tensor:
    """One expert projection on sorted rows: base GEMM, + LoRA per group, + bias. ``(S, out)``."""
    y = _matmul(x, p.weight, routing)  # (S, out)
    for first, second, scale, dropout in p.loras:
        h = _matmul(dropout(x), first, routing)  # (S, r)
        y = y + (scale * _matmul(h, second, routing)).to(y.dtype)  # (S, out)
    if p.bias is not None:
        y = _ExpertBias.apply(y, p.bias, routing.sorted_ids, routing.counts)
    return y


def _state(module: torch.nn.Module) -> _LayerState:
    state = getattr(module, _STATE_ATTR, None)
    return state if state is not None else _LayerState(name=type(module).__name__)


def _check_shapes(state: _LayerState, module, hidden, top_k_index, top_k_weights) -> None:
    """Static checks (shapes only, never a sync)."""
    e = module.num_experts
    if top_k_index.dim() != 2 or top_k_index.shape != top_k_weights.shape or top_k_index.size(0) != hidden.size(0):
        raise FastkitError(f"{state.name}: router output shapes do not match: hidden {tuple(hidden.shape)}, "
                           f"top_k_index {tuple(top_k_index.shape)}, top_k_weights {tuple(top_k_weights.shape)}.")
    if top_k_index.dtype.is_floating_point or top_k_index.dtype == torch.bool:
        raise FastkitError(f"{state.name}: router indices must be integers, got {top_k_index.dtype}.")
    if top_k_index.size(1) > e:
        raise FastkitError(f"{state.name}: top_k={top_k_index.size(1)} is larger than num_experts={e}; "
                           "lower config.num_experts_per_tok.")


def _wants_check(state: _LayerState, loop: bool) -> bool:
    mode = state.config.validate
    if mode == "auto" and os.environ.get(_DEBUG_ENV) == "1":
        mode = "always"
    if mode == "off":
        return False
    if mode == "always" or (mode == "auto" and loop):
        return True
    return not state.checked  # "first", or "auto" on the grouped path


def _read_back(routing: Routing, weights: torch.Tensor, num_experts: int, check: bool, with_ends: bool):
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


def _raise_bad_data(state: _LayerState, num_experts: int, facts: tuple[int, int, int]) -> None:
    lo, hi, nonfinite = facts
    if lo < 0 or hi >= num_experts:
        raise FastkitError(f"{state.name}: router produced expert ids in [{lo}, {hi}], outside [0, {num_experts - 1}] "
                           "(num_experts). Check the router / config.num_experts.")
    if nonfinite:
        raise FastkitError(f"{state.name}: {nonfinite} routing weights are NaN or inf: the router logits are not "
                           "finite (diverged training, a bad learning rate, or fp16 overflow).")


def _use_loop(state: _LayerState, weights: list[torch.Tensor]) -> bool:
    """The host-count loop for this forward? (every ``(E, in, out)`` GEMM operand must suit grouped_mm)."""
    mode = state.config.mode
    if mode == "loop":
        return True
    ok = all(grouped_mm_runs(w) for w in weights)
    if mode == "grouped" and not ok:
        w = weights[0]
        raise FastkitError(f"{state.name}: MoE mode='grouped' asked for, but grouped_mm cannot run here "
                           f"({w.device.type}, {w.dtype}, shape {tuple(w.shape)}); use mode='auto'.")
    return not ok


def _routed(state: _LayerState, num_experts: int, hidden, top_k_index, top_k_weights, weights: list[torch.Tensor]):
    """Shared front half: pick the path, one sort, at most one host read-back, one gather. ``(routing, rows)``."""
    if top_k_index.size(1) > num_experts:
        raise FastkitError(f"{state.name}: top_k={top_k_index.size(1)} is larger than num_experts={num_experts}; "
                           "lower config.num_experts_per_tok.")
    loop = _use_loop(state, weights)
    routing = route(top_k_index, num_experts)  # (S,) perm, ends...
    check = _wants_check(state, loop)
    if loop or check:
        routing.host_ends, facts = _read_back(routing, top_k_weights, num_experts, check, with_ends=loop)
        if facts is not None:
            _raise_bad_data(state, num_experts, facts)
            state.checked = True
    rows = _GatherSorted.apply(hidden, routing.perm, routing.inv_perm, top_k_index.size(1))  # (S, H)
    return routing, rows


def fastkit_experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The experts forward registered as ``"fastkit"``: same signature and result as transformers'.

    ``hidden_states (T, H)``, ``top_k_index (T, K)``, ``top_k_weights (T, K)`` -> ``(T, H)``.
    """
    state = _state(self)
    _check_shapes(state, self, hidden_states, top_k_index, top_k_weights)
    if top_k_index.numel() == 0:
        return hidden_states.new_zeros(hidden_states.shape)
    projs = _projections(self)  # Note: [PEFT factors]
    operands = [w for p in projs for w in (p.weight, *(f for lora in p.loras for f in lora[:2]))]
    routing, rows = _routed(state, self.num_experts, hidden_states, top_k_index, top_k_weights, operands)
    proj = _project(projs[0], rows, routing)  # (S, 2I) or (S, I)
    proj = self._apply_gate(proj) if self.has_gate else self.act_fn(proj)  # (S, I)
    proj = _project(projs[1], proj, routing)  # (S, H)
    if self.has_post_expert_norm:
        proj = self.post_expert_norm(proj)  # row-wise: order does not matter
    return _UnsortCombine.apply(proj, top_k_weights, routing.perm, routing.inv_perm).to(hidden_states.dtype)


# ----------------------------------------------------------------------------------------------
# Families transformers still loops over (not @use_experts_implementation): per-instance forwards.
# ----------------------------------------------------------------------------------------------


def dbrx_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """``DbrxExperts.forward`` (a per-expert loop upstream) with fastkit routing.

    DBRX stores ``w1``, ``v1``, ``w2`` as ``(E·F, H)``: viewed ``(E, F, H)``, gate = x·w1ₑᵀ,
    up = x·v1ₑᵀ, out = (act(gate)·up)·w2ₑ.
    """
    state = _state(self)
    shape = hidden_states.shape
    h = hidden_states.reshape(-1, self.hidden_size)  # (T, H)
    if top_k_index.numel() == 0:
        return torch.zeros_like(h).view(shape[0], -1, self.hidden_size)
    split = (self.num_experts, self.ffn_hidden_size, self.hidden_size)
    w1, v1, w2 = (getattr(self.mlp, n).view(split) for n in ("w1", "v1", "w2"))  # (E, F, H)
    weights = (w1.transpose(-2, -1), v1.transpose(-2, -1), w2)  # (E, in, out)
    routing, rows = _routed(state, self.num_experts, h, top_k_index, top_k_weights, list(weights))
    gate = _matmul(rows, weights[0], routing)  # (S, F)
    up = _matmul(rows, weights[1], routing)  # (S, F)
    out = _matmul(self.mlp.activation_fn(gate) * up, weights[2], routing)  # (S, H)
    out = _UnsortCombine.apply(out, top_k_weights, routing.perm, routing.inv_perm)  # (T, H)
    return out.to(h.dtype).view(shape[0], -1, self.hidden_size)


def llama4_moe_forward(self, hidden_states):
    """``Llama4TextMoe.forward`` (every token through EVERY expert upstream) with fastkit routing.

    Llama-4 scales the expert INPUT by ``sigmoid(top-k logit)`` and adds the outputs unweighted; the
    E - K experts a token did not pick get a zero input upstream and give exactly zero (``silu(0)=0``),
    so running only the picked K is the same sum.
    """
    state = _state(self.experts)
    h = hidden_states.reshape(-1, self.hidden_dim)  # (T, H)
    router_scores, router_logits = self.router(h)  # (T, E) sigmoid at the top-k, 0 elsewhere
    top_k_index = torch.topk(router_logits, self.top_k, dim=1).indices  # (T, K) same ties as the router
    scores = router_scores.gather(1, top_k_index)  # (T, K)
    experts = self.experts
    weights = (experts.gate_up_proj, experts.down_proj)  # (E, H, 2I), (E, I, H): already (E, in, out)
    routing, rows = _routed(state, self.num_experts, h, top_k_index, scores, list(weights))
    sorted_scores = scores.reshape(-1).index_select(0, routing.perm)  # (S,)
    rows = rows * sorted_scores.unsqueeze(-1).to(rows.dtype)  # (S, H) input scaled, as upstream
    gate, up = _matmul(rows, weights[0], routing).chunk(2, dim=-1)  # (S, I) each
    out = _matmul(up * experts.act_fn(gate), weights[1], routing)  # (S, H)
    ones = torch.ones_like(scores)
    routed = _UnsortCombine.apply(out, ones, routing.perm, routing.inv_perm)  # (T, H) plain sum over k
    shared = self.shared_expert(h)
    return shared + routed.to(shared.dtype), router_logits


def _looped_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, object]]:
    """``(name, module, fastkit forward)`` for looped-family modules fastkit can run."""
    found = []
    for name, m in model.named_modules():
        cls = type(m).__name__
        if cls == "DbrxExperts" and hasattr(m, "mlp") and hasattr(m.mlp, "w1"):
            found.append((name, m, dbrx_experts_forward))
        elif cls == "Llama4TextMoe" and type(m.experts).__name__ == "Llama4TextExperts":
            found.append((name, m, llama4_moe_forward))
    return found


# ----------------------------------------------------------------------------------------------
# The patch.
# ----------------------------------------------------------------------------------------------


def register() -> None:
    """Add ``"fastkit"`` to transformers' global ``ExpertsInterface`` (additive, idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(EXPERTS_KEY, fastkit_experts_forward)


def is_decorated_experts(module: torch.nn.Module) -> bool:
    """True for an instance of a ``@use_experts_implementation`` class (its __init__ set these)."""
    return all(hasattr(module, a) for a in ("has_gate", "has_bias", "is_transposed", "_is_expert_parallel", "config"))


def experts_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(qualified name, module)`` of every decorated experts module in ``model``."""
    return [(n, m) for n, m in model.named_modules() if is_decorated_experts(m)]


def _why_not(name: str, module: torch.nn.Module) -> str | None:
    """Reason fastkit cannot run this experts module exactly, or None."""
    if module._is_expert_parallel:
        return f"{name}: expert parallelism (sentinel ids) is not supported; transformers' grouped_mm keeps it"
    if not isinstance(getattr(module, "num_experts", None), int):
        return f"{name}: no integer num_experts attribute"
    for p in _projections(module, raw=True):
        pname, w, bias = p.name, p.weight, p.bias
        if not isinstance(w, torch.Tensor) or w.dim() != 3 or not w.dtype.is_floating_point:
            return f"{name}.{pname}: not a floating-point (E, out, in) tensor (quantized experts are not supported)"
        if w.size(0) != module.num_experts:
            return f"{name}.{pname}: {w.size(0)} experts in the weight, num_experts={module.num_experts}"
        if module.has_bias and not isinstance(bias, torch.Tensor):
            return f"{name}.{pname}_bias: has_bias=True but no bias tensor"
    if module.has_post_expert_norm and not callable(getattr(module, "post_expert_norm", None)):
        return f"{name}: has_post_expert_norm=True but no post_expert_norm module"
    if not module.has_gate and not callable(getattr(module, "act_fn", None)):
        return f"{name}: ungated experts without act_fn"
    return None


def _top_k_of(model: torch.nn.Module) -> int | None:
    for cfg in _configs(model):
        k = getattr(cfg, "num_experts_per_tok", None) or getattr(cfg, "moe_top_k", None)
        if isinstance(k, int):
            return k
    return None


def _configs(model: torch.nn.Module) -> list:
    """Every distinct config object: the model's, its sub-configs (recursively), the experts' own."""
    seen: dict[int, object] = {}

    def visit(cfg):
        if cfg is None or id(cfg) in seen:
            return
        seen[id(cfg)] = cfg
        for key in getattr(cfg, "sub_configs", {}) or {}:
            visit(getattr(cfg, key, None))

    visit(getattr(model, "config", None))
    for _, m in experts_modules(model):
        visit(m.config)
    return list(seen.values())


class MoEExpertsPatch:
    """Select fastkit's sort-based experts function for every decorated experts module.

    ``facts`` is the model's :class:`fastkit.registry.ModelFacts` row (unused beyond the name in
    messages); ``config`` chooses the grouped/loop path and the data checks.
    """

    name = "moe"

    def __init__(self, facts=None, config: MoEConfig | None = None):
        self.facts = facts
        self.config = config or MoEConfig()

    def check(self, model: torch.nn.Module) -> str | None:
        """Why fastkit cannot run this model's experts (None: it can). Raises on an impossible config."""
        found = experts_modules(model)
        if not found and not _looped_modules(model):
            return ("no @use_experts_implementation experts module and no looped family fastkit knows "
                    "(DBRX, Llama-4); this MoE keeps transformers' path")
        k = _top_k_of(model)
        for name, m in found:
            if isinstance(k, int) and isinstance(getattr(m, "num_experts", None), int) and k > m.num_experts:
                raise FastkitError(f"{name}: top_k={k} (config.num_experts_per_tok) is larger than "
                                   f"num_experts={m.num_experts}: the router cannot pick that many experts.")
            reason = _why_not(name, m)
            if reason is not None:
                return reason
        for name, m, _ in _looped_modules(model):
            if isinstance(k, int) and k > m.num_experts:
                raise FastkitError(f"{name}: top_k={k} is larger than num_experts={m.num_experts}: the router "
                                   "cannot pick that many experts.")
        return None

    def apply(self, model: torch.nn.Module, swap) -> None:
        register()
        for cfg in _configs(model):
            # Note: [config swap] the public ``_experts_implementation`` setter recurses into sub-configs,
            # so undoing it newest-first would overwrite a sub-config's own original with its parent's.
            # Swapping the plain instance attribute behind the property on every config is exact.
            swap.setattr(cfg, "_experts_implementation_internal", EXPERTS_KEY)
        for name, m in experts_modules(model):
            swap.setattr(m, _STATE_ATTR, _LayerState(name=name, config=self.config))
        for name, m, forward in _looped_modules(model):
            # Note: [looped families] no registry to select a function by key: the instance's own forward
            # is swapped (revert deletes the instance attribute, so the class forward shows through again).
            holder = m.experts if forward is llama4_moe_forward else m
            swap.setattr(holder, _STATE_ATTR, _LayerState(name=f"{name}.experts" if holder is not m else name,
                                                          config=self.config))
            swap.setattr(m, "forward", types.MethodType(forward, m))
        logger.info("fastkit: moe: %d experts modules run sort-based routing (%s)", len(experts_modules(model)),
                    self.config.mode)


__all__ = ["EXPERTS_KEY", "dbrx_experts_forward", "llama4_moe_forward", "MoEConfig", "MoEExpertsPatch", "Routing", "experts_modules", "fastkit_experts_forward",
           "grouped_mm_runs", "is_decorated_experts", "register", "route"]
