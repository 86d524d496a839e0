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
by :mod:`fastkit.patches.moe.lora` are applied per expert group (``x·Aᵀ·Bᵀ``), never as ``W + B·A``.

Files. The math (routing, autograd pieces, grouped / loop GEMMs) is pure torch in
:mod:`fastkit.patches.moe.routing`. This file is the glue: :class:`MoEConfig`, which modules and
configs a model has, PEFT's factors, the experts forwards, :class:`MoEExpertsPatch`, and
:func:`attach_experts` for one module outside a patched model (benchmarks). Every private
transformers / PEFT name goes through :mod:`fastkit._hf`.

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

from fastkit import _hf, registry
from fastkit.errors import FastkitError
from fastkit.patches.moe.routing import (
    Projection,
    Routing,
    batched_bytes,
    check_shapes,
    gather_sorted,
    grouped_matmul,
    grouped_mm_runs,
    in_out,
    project,
    raise_bad_data,
    read_back,
    route,
    unsort_combine,
)
from fastkit.patching import change, revert

logger = logging.getLogger(__name__)

EXPERTS_KEY = "fastkit"
"""The key fastkit's experts function is registered under in transformers' ``ExpertsInterface``."""

_STATE_ATTR = "_fastkit_moe"  # per experts-module instance: its _LayerState (set through the Swapper)
LORA_ATTR = "fastkit_lora"
"""Per experts-module child holding fastkit's :class:`fastkit.patches.moe.lora.ExpertLoRA`, when attached."""
PEFT_FACTORS_ATTR = "_fastkit_peft_factors"  # {name: (W, lhs, rhs, scaling)} for one call: peft_wrapper.py
_DEBUG_ENV = "FASTKIT_MOE_DEBUG"

_MODES = ("auto", "grouped", "batched", "loop")
BATCHED_BYTES = 64 * 2**20
"""Default ``MoEConfig.batched_bytes``: 64 MiB of gathered expert weights per layer forward."""
_VALIDATE = ("auto", "always", "first", "off")


@dataclass
class MoEConfig:
    """How fastkit runs the experts of one model."""

    mode: str = "auto"
    """``"auto"`` chooses per device and shape (Note: [path choice]): grouped GEMM where it runs on this
    device and dtype (CUDA sm80+ bf16, CPU); elsewhere (a T4, fp16/fp32 on CUDA) one batched GEMM over
    per-row gathered weights when they fit ``batched_bytes`` and need no gradient (0 host syncs), else
    the host-count loop (1 read-back per layer forward). ``"grouped"`` / ``"batched"`` / ``"loop"``
    force one (tests and benchmarks)."""
    batched_bytes: int = BATCHED_BYTES
    """``mode="auto"`` off the grouped GEMM: the most bytes of gathered expert weights (rows x per-expert
    weights) one layer forward may build for the batched path; above it, the host-count loop."""
    validate: str = "auto"
    """Data checks (router ids in range, finite routing weights) need the host to read device values.
    ``"auto"``: every forward on the loop path (the check rides on the one count read-back, so it is
    free), only the first forward of each layer on the grouped path (one sync, once). ``"always"``:
    every forward (one sync per layer on the grouped path). ``"first"``: first forward per layer only.
    ``"off"``: never. The environment variable ``FASTKIT_MOE_DEBUG=1`` turns ``"auto"`` into ``"always"``."""
    dequant_group_bytes: int | None = None
    """4-bit experts: bound on the transient bytes of ONE dequantization call. The experts that received
    tokens are dequantized together, ``bound // (weights per expert x 8 bytes)`` of them per call (at
    least one; ``fastkit.patches.moe.nf4.group_size``). ``None``: ``nf4.DEQUANT_GROUP_BYTES`` (8 MiB), the
    bound ``fastkit.plan`` counts (``PlanInputs.moe_dequant_group_bytes``); ``0``: one expert per call."""

    def __post_init__(self):
        if self.mode not in _MODES:
            raise FastkitError(f"MoEConfig.mode must be one of {_MODES}, got {self.mode!r}.")
        if self.validate not in _VALIDATE:
            raise FastkitError(f"MoEConfig.validate must be one of {_VALIDATE}, got {self.validate!r}.")
        if not isinstance(self.batched_bytes, int) or self.batched_bytes < 0:
            raise FastkitError(f"MoEConfig.batched_bytes must be an int >= 0 (bytes), got {self.batched_bytes!r}.")
        if self.dequant_group_bytes is not None and (not isinstance(self.dequant_group_bytes, int)
                                                     or self.dequant_group_bytes < 0):
            raise FastkitError(f"MoEConfig.dequant_group_bytes must be None or an int >= 0 (bytes), got "
                               f"{self.dequant_group_bytes!r}.")


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
# The experts function: projections (PEFT's factors, fastkit's), per-layer state, the forward.
# ----------------------------------------------------------------------------------------------


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
    given = getattr(module, PEFT_FACTORS_ATTR, None)  # peft_wrapper.py's call: every wrapper's factors
    found = given.get(name) if given is not None else _hf.peft_lora_factors(module, name)
    if found is None:
        return None
    original, lhs, rhs, scaling = found  # param layout: delta = lhs @ rhs
    if module.is_transposed:  # (E, in, out) = (E, in, r) @ (E, r, out)
        first, second = lhs, rhs
    else:  # (E, out, in) = (E, out, r) @ (E, r, in): in (in, out) layout, rhsᵀ then lhsᵀ
        first, second = rhs.transpose(-2, -1), lhs.transpose(-2, -1)
    # PEFT's B is (out, r·E) with the expert index fastest: its (E, ·, ·) view has no unit stride in the
    # last two dims, which grouped_mm needs. The copy is E·r·out elements, a factor r/in of the weight.
    first, second = (f if 1 in f.stride()[-2:] else f.contiguous() for f in (first, second))
    return original, (first, second, scaling, torch.nn.Identity())


def runs_fastkit_experts(module: torch.nn.Module) -> bool:
    """Whether :func:`fastkit_experts_forward` runs ``module`` now (its patch applied, not reverted), and so reads
    ``PEFT_FACTORS_ATTR``. The looped families' forwards read their weights as attributes: not these."""
    return (getattr(module, _STATE_ATTR, None) is not None and is_decorated_experts(module)
            and _hf.experts_implementation(module.config) == EXPERTS_KEY)


def _raw(module: torch.nn.Module, name: str) -> torch.Tensor:
    """The stored tensor ``name``, without running a parametrization."""
    plist = getattr(getattr(module, "parametrizations", None), name, None)
    return plist.original if plist is not None else getattr(module, name)


def projection_names(module: torch.nn.Module) -> tuple[str, str]:
    """The experts module's two weight names: ``("gate_up_proj" | "up_proj", "down_proj")``."""
    return ("gate_up_proj" if module.has_gate else "up_proj", "down_proj")


def _projections(module: torch.nn.Module, raw: bool = False) -> list[Projection]:
    """The up and down projections with their bias and LoRA update (PEFT's or fastkit's)."""
    fk_lora = getattr(module, LORA_ATTR, None)
    out = []
    for name in projection_names(module):
        bias = getattr(module, f"{name}_bias", None) if module.has_bias else None
        peft = None if raw else _peft_factors(module, name)
        if peft is not None:
            weight, loras = peft[0], [peft[1]]
        else:
            weight, loras = (_raw(module, name) if raw else getattr(module, name)), []
        if fk_lora is not None and fk_lora.enabled and fk_lora.factors(name) is not None:
            loras.append(fk_lora.factors(name))
        out.append(Projection(name, in_out(weight, module.is_transposed), bias, loras))
    return out


def _state(module: torch.nn.Module) -> _LayerState:
    state = getattr(module, _STATE_ATTR, None)
    return state if state is not None else _LayerState(name=type(module).__name__)


def _wants_check(state: _LayerState, loop: bool) -> bool:
    mode = state.config.validate
    if mode == "auto" and os.environ.get(_DEBUG_ENV) == "1":
        mode = "always"
    if mode == "off":
        return False
    if mode == "always" or (mode == "auto" and loop):
        return True
    if torch.compiler.is_compiling():  # Note: [routing check under compile]
        return False
    return not state.checked  # "first", or "auto" on the grouped path


# Note: [routing check under compile]
# The first-forward check reads the routing back to the host (expert ids in range, finite weights): while dynamo
# traces, that read is a graph break, and a compiled graph has no "first" forward (the check would run in every
# step). So a traced forward skips the once-only check (an eager forward before compiling still makes it);
# validate="always" still reads
# back (a graph break per layer, as asked) and the loop path, which needs the counts, always does.


def _path(state: _LayerState, weights: list, rows: int) -> str:
    """``"grouped"`` / ``"batched"`` / ``"loop"`` for this forward (every ``(E, in, out)`` GEMM operand counts).

    # Note: [path choice]
    Measured on CPU (benchmarks/moe.py): sort + grouped GEMM beats transformers' grouped_mm, batched_mm
    and eager at every shape, and the batched form (a copy of an expert's weights per row) is the slowest
    of the three there, so wherever grouped_mm runs it is the grouped GEMM. Where it does not (sm75, or
    a dtype the CUDA kernel lacks) the choice is the loop's one read-back per layer (a sync) against the
    batched form's weight copies: batched while they stay under ``batched_bytes`` (small batches,
    generation) and the weights need no gradient (a frozen base; its backward is a plain ``bmm``).
    """
    mode = state.config.mode
    tensors = all(isinstance(w, torch.Tensor) for w in weights)  # 4-bit providers: the loop
    grouped = tensors and all(grouped_mm_runs(w) for w in weights)
    if mode == "grouped" and not grouped:
        w = weights[0]
        raise FastkitError(f"{state.name}: MoE mode='grouped' asked for, but grouped_mm cannot run here "
                           f"({w.device.type}, {w.dtype}, shape {tuple(w.shape)}); use mode='auto'.")
    if mode == "batched" and not tensors:
        raise FastkitError(f"{state.name}: MoE mode='batched' needs tensor expert weights (4-bit experts take the "
                           "loop); use mode='auto'.")
    if mode != "auto":
        return mode
    if grouped:
        return "grouped"
    frozen = tensors and not any(w.requires_grad for w in weights)
    if frozen and batched_bytes(rows, weights) <= state.config.batched_bytes:
        return "batched"
    return "loop"


def _routed(state: _LayerState, num_experts: int, hidden, top_k_index, top_k_weights, weights: list[torch.Tensor]):
    """Shared front half: pick the path, one sort, at most one host read-back, one gather. ``(routing, rows)``."""
    if top_k_index.size(1) > num_experts:
        raise FastkitError(f"{state.name}: top_k={top_k_index.size(1)} is larger than num_experts={num_experts}; "
                           "lower config.num_experts_per_tok.")
    path = _path(state, weights, top_k_index.numel())
    loop = path == "loop"
    routing = route(top_k_index, num_experts)  # (S,) perm, ends...
    routing.dequant_group_bytes = state.config.dequant_group_bytes
    routing.batched = path == "batched"
    check = _wants_check(state, loop)
    if loop or check:
        routing.host_ends, facts = read_back(routing, top_k_weights, num_experts, check, with_ends=loop)
        if facts is not None:
            raise_bad_data(state.name, num_experts, facts)
            state.checked = True
    rows = gather_sorted(hidden, routing, top_k_index.size(1))  # (S, H)
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
    check_shapes(state.name, self.num_experts, hidden_states, top_k_index, top_k_weights)
    if top_k_index.numel() == 0:
        return hidden_states.new_zeros(hidden_states.shape)
    projs = _projections(self)  # Note: [PEFT factors]
    operands = [w for p in projs for w in (p.weight, *(f for lora in p.loras for f in lora[:2]))]
    routing, rows = _routed(state, self.num_experts, hidden_states, top_k_index, top_k_weights, operands)
    proj = project(projs[0], rows, routing)  # (S, 2I) or (S, I)
    proj = _hf.apply_gate(self, proj) if self.has_gate else self.act_fn(proj)  # (S, I)
    proj = project(projs[1], proj, routing)  # (S, H)
    if self.has_post_expert_norm:
        proj = self.post_expert_norm(proj)  # row-wise: order does not matter
    return unsort_combine(proj, top_k_weights, routing).to(hidden_states.dtype)


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
    gate = grouped_matmul(rows, weights[0], routing)  # (S, F)
    up = grouped_matmul(rows, weights[1], routing)  # (S, F)
    out = grouped_matmul(self.mlp.activation_fn(gate) * up, weights[2], routing)  # (S, H)
    out = unsort_combine(out, top_k_weights, routing)  # (T, H)
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
    gate, up = grouped_matmul(rows, weights[0], routing).chunk(2, dim=-1)  # (S, I) each
    out = grouped_matmul(up * experts.act_fn(gate), weights[1], routing)  # (S, H)
    ones = torch.ones_like(scores)
    routed = unsort_combine(out, ones, routing)  # (T, H) plain sum over k
    shared = self.shared_expert(h)
    return shared + routed.to(shared.dtype), router_logits


_LOOPED_FORWARDS = {"dbrx": dbrx_experts_forward, "llama4": llama4_moe_forward}
"""``ModelFacts.looped_forward`` -> the fastkit forward that runs that row's ``looped_experts`` classes."""


def looped_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, object]]:
    """``(name, module, fastkit forward)`` for looped-family modules fastkit can run."""
    found = []
    for name, m in model.named_modules():
        kind = _hf.looped_experts_kind(m)  # the row's looped_forward (registry.looped_experts(), read now)
        if kind is not None:
            found.append((name, m, _LOOPED_FORWARDS[kind]))
    return found


# ----------------------------------------------------------------------------------------------
# The patch.
# ----------------------------------------------------------------------------------------------


def register() -> None:
    """Add ``"fastkit"`` to transformers' global ``ExpertsInterface`` (additive, idempotent)."""
    _hf.register_experts_function(EXPERTS_KEY, fastkit_experts_forward)


def is_decorated_experts(module: torch.nn.Module) -> bool:
    """True for an instance of a ``@use_experts_implementation`` class (its __init__ set the flags)."""
    return _hf.is_decorated_experts(module)


def experts_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(qualified name, module)`` of every decorated experts module in ``model``."""
    return [(n, m) for n, m in model.named_modules() if is_decorated_experts(m)]


def _why_not(name: str, module: torch.nn.Module) -> str | None:
    """Reason fastkit cannot run this experts module exactly, or None."""
    if _hf.is_expert_parallel(module):
        return f"{name}: expert parallelism (sentinel ids) is not supported; transformers' grouped_mm keeps it"
    if not isinstance(getattr(module, "num_experts", None), int):
        return f"{name}: no integer num_experts attribute"
    for p in _projections(module, raw=True):
        pname, w, bias = p.name, p.weight, p.bias
        provider = hasattr(w, "group_matmul")  # fastkit's 4-bit experts (patches/moe/nf4.py)
        if not provider and (not isinstance(w, torch.Tensor) or w.dim() != 3 or not w.dtype.is_floating_point):
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

    name = registry.MOE

    def __init__(self, facts=None, config: MoEConfig | None = None):
        self.facts = facts
        self.config = config or MoEConfig()

    def check(self, model: torch.nn.Module) -> str | None:
        """Why fastkit cannot run this model's experts (None: it can). Raises on an impossible config."""
        found = experts_modules(model)
        if not found and not looped_modules(model):
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
        for name, m, _ in looped_modules(model):
            if isinstance(k, int) and k > m.num_experts:
                raise FastkitError(f"{name}: top_k={k} is larger than num_experts={m.num_experts}: the router "
                                   "cannot pick that many experts.")
        return None

    def apply(self, model: torch.nn.Module, swap) -> None:
        register()
        for cfg in _configs(model):
            # Note: [config swap] the public experts-implementation setter recurses into sub-configs,
            # so undoing it newest-first would overwrite a sub-config's own original with its parent's.
            # Swapping the plain instance attribute behind the property on every config is exact.
            _hf.set_experts_implementation(cfg, EXPERTS_KEY, swap)
        for name, m in experts_modules(model):
            swap.setattr(m, _STATE_ATTR, _LayerState(name=name, config=self.config))
        for name, m, forward in looped_modules(model):
            # Note: [looped families] no registry to select a function by key: the instance's own forward
            # is swapped (revert deletes the instance attribute, so the class forward shows through again).
            holder = m.experts if forward is llama4_moe_forward else m
            swap.setattr(holder, _STATE_ATTR, _LayerState(name=f"{name}.experts" if holder is not m else name,
                                                          config=self.config))
            swap.setattr(m, "forward", types.MethodType(forward, m))
        logger.info("fastkit: moe: %d experts modules run sort-based routing (%s)", len(experts_modules(model)),
                    self.config.mode)


_ATTACHED = "moe_attached"  # the patching.change record attach_experts keeps on the module itself


def attach_experts(module: torch.nn.Module, config: MoEConfig | None = None, *, name: str | None = None) -> None:
    """Run ONE decorated experts module with fastkit's experts function, outside a patched model.

    For benchmarks and tests that build an experts module on its own: registers ``"fastkit"``, selects
    it on ``module.config`` (and so on every module sharing that config) and gives the module its
    per-layer state (``config``; ``name`` for error messages). Recorded on the module as the change
    ``"moe_attached"`` (:func:`fastkit.patching.change`): :func:`detach_experts` or ``fastkit.revert(module)``
    undo it. A whole model goes through :class:`MoEExpertsPatch` instead.
    """
    if not is_decorated_experts(module):
        raise FastkitError(f"{type(module).__name__} is not a @use_experts_implementation experts module.")
    register()

    def attach(swap):  # again on an attached module: same record, the first originals kept
        _hf.set_experts_implementation(module.config, EXPERTS_KEY, swap)
        swap.setattr(module, _STATE_ATTR, _LayerState(name=name or type(module).__name__,
                                                      config=config or MoEConfig()))

    change(module, _ATTACHED, attach)


def detach_experts(module: torch.nn.Module, implementation: str | None = None) -> None:
    """Undo :func:`attach_experts` (``fastkit.revert`` of its record): the experts implementation that was there
    before it is selected again and the module's fastkit state is gone. With ``implementation`` (``"eager"``,
    ``"grouped_mm"``), that one is selected on ``module.config`` afterwards."""
    revert(module, [_ATTACHED])
    if implementation is not None:
        _hf.set_experts_implementation(module.config, implementation)


__all__ = ["BATCHED_BYTES", "EXPERTS_KEY", "LORA_ATTR", "MoEConfig", "MoEExpertsPatch", "Routing", "attach_experts",
           "dbrx_experts_forward", "detach_experts", "experts_modules", "fastkit_experts_forward", "grouped_mm_runs",
           "is_decorated_experts", "llama4_moe_forward", "projection_names", "register", "route"]
