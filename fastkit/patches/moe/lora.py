"""LoRA on MoE experts, applied per expert group: ``y += s · (x·Aₑᵀ)·Bₑᵀ``, never ``W + B·A``.

What it replaces. PEFT 0.21 adapts a 3-D expert tensor through ``LoraConfig(target_parameters=...)``:
a parametrization that rebuilds ``W + s·B·A`` for EVERY expert on EVERY forward (a second tensor
the size of the whole expert stack, plus its gradient in backward), whether an expert got tokens or
not. :func:`add_expert_lora` instead attaches an :class:`ExpertLoRA` child to each decorated experts
module (``A [E, r, in]``, ``B [E, out, r]``, B zero-initialised, A like PEFT's kaiming-uniform), and
fastkit's experts function (:mod:`fastkit.patches.moe.patch`) adds the low-rank term on the sorted rows of each
expert group with the same grouped GEMM / host-count loop as the base weight: ``O(S·r·(in+out))``
work and ``O(S·r)`` activations, no ``E·in·out`` temporaries.

What must not change. With the same factors, logits and gradients equal PEFT's
``target_parameters`` LoRA (tests/test_moe_lora.py, which copies PEFT's factors with
:func:`factors_from_peft`). The patch is a :mod:`fastkit.patching` patch named ``registry.MOE_LORA``:
revert removes the factors and leaves the base weights untouched.

Composing with PEFT (``target_modules="all-linear"`` for attention and dense MLPs)::

    peft_model = get_peft_model(model, LoraConfig(r=16, lora_alpha=16, target_modules="all-linear"))
    add_expert_lora(peft_model, r=16, lora_alpha=16)      # AFTER get_peft_model: PEFT freezes
                                                          # every parameter that is not its own
    ...train...
    peft_model.save_pretrained(out)                       # PEFT's adapters
    save_expert_lora(peft_model, out)                     # + out/fastkit_expert_lora.safetensors
    load_expert_lora(other_peft_model, out)               # (peft_format.py) attaches and fills the factors

``peft_model.disable_adapter()`` does not switch these factors off; use
``expert_lora_enabled(model, False)``. PEFT 0.21's ``target_modules="all-linear"`` already adapts the
experts of qwen3_moe, mixtral, olmoe and deepseek_v3 (its v4->v5 conversion); fastkit's ``moe`` patch
runs that adapter per expert group too (see ``fastkit.patches.moe.patch``, Note: [PEFT factors]), so check
:func:`peft_adapts_experts` before adding a second update.
"""

from __future__ import annotations

import json
import logging
import math
import os

import torch
from torch import nn

from fastkit import _hf, registry
from fastkit.errors import FastkitError
from fastkit.patches.moe.patch import LORA_ATTR, MoEExpertsPatch, experts_modules, projection_names
from fastkit.patches.moe.routing import in_out
from fastkit.patching import active_patches, apply_patch, revert, unwrap

logger = logging.getLogger(__name__)

PATCH_NAME = registry.MOE_LORA
FILE_NAME = "fastkit_expert_lora.safetensors"


class ExpertLoRA(nn.Module):
    """Low-rank factors for the projections of ONE experts module.

    Parameters are named ``lora_A_<proj>`` ``(E, r, in)`` and ``lora_B_<proj>`` ``(E, out, r)`` where
    ``(in, out)`` are the projection's math dims (for GPT-OSS ``gate_up_proj``, ``out`` keeps the
    interleaved gate/up column order, since the update is added before ``_apply_gate``).
    """

    def __init__(self, experts: nn.Module, r: int, lora_alpha: float, lora_dropout: float = 0.0,
                 use_rslora: bool = False, dtype: torch.dtype | None = None):
        super().__init__()
        self.r = r
        self.lora_alpha = lora_alpha
        self.scaling = lora_alpha / math.sqrt(r) if use_rslora else lora_alpha / r
        self.use_rslora = use_rslora
        self.dropout = nn.Dropout(lora_dropout) if lora_dropout > 0 else nn.Identity()
        self.enabled = True
        self.targets = projection_names(experts)
        for name in self.targets:
            w = in_out(getattr(experts, name), experts.is_transposed)  # (E, in, out)
            e, d_in, d_out = w.shape
            kw = dict(device=w.device, dtype=dtype or w.dtype)
            a = torch.empty(e, r, d_in, **kw)  # (E, r, in)
            bound = 1.0 / math.sqrt(d_in)  # PEFT: kaiming_uniform_(a=sqrt(5)) on (r*E, in)
            nn.init.uniform_(a, -bound, bound)
            setattr(self, f"lora_A_{name}", nn.Parameter(a))
            setattr(self, f"lora_B_{name}", nn.Parameter(torch.zeros(e, d_out, r, **kw)))  # (E, out, r)

    def factors(self, name: str):
        """``(Aᵀ (E, in, r), Bᵀ (E, r, out), scaling, dropout)`` for projection ``name`` (None if untargeted):
        the experts function adds ``scaling · dropout(x)·Aₑᵀ·Bₑᵀ`` per expert group."""
        if name not in self.targets:
            return None
        a, b = getattr(self, f"lora_A_{name}"), getattr(self, f"lora_B_{name}")
        return a.transpose(-2, -1), b.transpose(-2, -1), self.scaling, self.dropout

    def delta(self, name: str) -> torch.Tensor:
        """``s · B·A`` as ``(E, out, in)`` (only for merging; the forward never builds it)."""
        a, b = getattr(self, f"lora_A_{name}"), getattr(self, f"lora_B_{name}")
        return self.scaling * torch.bmm(b, a)  # (E, out, r) @ (E, r, in)

    def extra_repr(self) -> str:
        return f"r={self.r}, lora_alpha={self.lora_alpha}, targets={self.targets}"


class ExpertLoRAPatch:
    """Attach :class:`ExpertLoRA` to every decorated experts module (revertible)."""

    name = PATCH_NAME

    def __init__(self, r: int, lora_alpha: float, lora_dropout: float = 0.0, use_rslora: bool = False,
                 dtype: torch.dtype | None = None):
        self.kwargs = dict(r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, use_rslora=use_rslora, dtype=dtype)

    def check(self, model: nn.Module) -> str | None:
        if not experts_modules(model):
            return "no @use_experts_implementation experts module"
        if registry.MOE not in active_patches(model):
            return (f"the fastkit {registry.MOE!r} patch is not active (transformers' experts paths would ignore "
                    "the factors)")
        return None

    def apply(self, model: nn.Module, swap) -> None:
        for _, m in experts_modules(model):
            swap.setattr(m, LORA_ATTR, ExpertLoRA(m, **self.kwargs))


def _ensure_moe_patch(base: nn.Module) -> None:
    if registry.MOE in active_patches(base):  # the loader applied it from a row (or a self-verified twin)
        return
    model_type = getattr(base.config, "model_type", "")
    facts = registry.facts_for(model_type)
    if facts is None or not facts.moe:  # the census found rowless types where fastkit's routing differs
        raise FastkitError(
            f"LoRA on experts needs fastkit's MoE routing patch, and model_type {model_type!r} has no MoE row in "
            "fastkit's table (docs/coverage.md), so that routing is not proven equal to transformers' for it. "
            "Load the model with FastModel.from_pretrained (it checks an unknown family on a tiny twin first), "
            "or train LoRA on the linear layers only (get_peft_model without the experts).")
    ok, why = apply_patch(base, MoEExpertsPatch(facts))
    if not ok:
        raise FastkitError(f"LoRA on experts needs fastkit's MoE patch, which does not apply here: {why}.")


def check_expert_lora_options(r, lora_alpha, lora_dropout, use_rslora, dtype) -> None:
    """The checks ``get_peft_model`` makes (the same messages), before anything is attached."""
    from fastkit.checks import check_lora_options

    check_lora_options(r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, target_modules="all-linear",
                       bias="none", use_gradient_checkpointing=False)
    if not isinstance(use_rslora, bool):
        raise FastkitError(f"use_rslora must be True or False, got {use_rslora!r}.")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise FastkitError(f"dtype must be None or a floating torch.dtype (torch.float32, torch.bfloat16), got "
                           f"{dtype!r}.")


def add_expert_lora(model: nn.Module, r: int = 16, lora_alpha: float = 16, lora_dropout: float = 0.0,
                    use_rslora: bool = False, dtype: torch.dtype | None = None) -> list[str]:
    """Attach trainable LoRA factors to every experts module; returns their qualified names.

    Works on a plain transformers model or a PEFT model (call it after ``get_peft_model``, which
    freezes everything it did not create). Applies fastkit's ``moe`` patch first if needed. Calling it
    again keeps the existing factors and marks them trainable again.
    """
    check_expert_lora_options(r, lora_alpha, lora_dropout, use_rslora, dtype)
    base = unwrap(model)
    if not experts_modules(base):
        raise FastkitError(f"{type(base).__name__} has no @use_experts_implementation experts module to adapt.")
    _ensure_moe_patch(base)
    ok, why = apply_patch(base, ExpertLoRAPatch(r, lora_alpha, lora_dropout, use_rslora, dtype))
    if not ok:
        raise FastkitError(f"Could not attach expert LoRA: {why}.")
    names = []
    for name, m in experts_modules(base):
        for p in getattr(m, LORA_ATTR).parameters():
            p.requires_grad_(True)
        names.append(name)
    logger.info("fastkit: expert LoRA r=%d on %d experts modules", r, len(names))
    return names


def peft_adapts_experts(model: nn.Module) -> bool:
    """True when a PEFT adapter already wraps an experts parameter (``target_parameters``; PEFT 0.21 adds
    the experts by itself for ``target_modules="all-linear"`` on qwen3_moe, mixtral, olmoe, deepseek_v3).
    fastkit's ``moe`` patch then runs that adapter per expert group; :func:`add_expert_lora` on top
    would add a second, independent update."""
    experts = {e for _, e in experts_modules(unwrap(model))}
    return any(w.get_base_layer() in experts for _, w in _hf.peft_param_wrappers(unwrap(model)))


def expert_lora_modules(model: nn.Module) -> list[tuple[str, ExpertLoRA]]:
    """``(experts module name, ExpertLoRA)`` for every attached factor set."""
    return [(n, getattr(m, LORA_ATTR)) for n, m in experts_modules(unwrap(model))
            if isinstance(getattr(m, LORA_ATTR, None), ExpertLoRA)]


def expert_lora_enabled(model: nn.Module, enabled: bool) -> None:
    """Switch the expert factors on or off (PEFT's ``disable_adapter`` does not reach them)."""
    for _, lora in expert_lora_modules(model):
        lora.enabled = enabled


def expert_lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The factors, keyed ``<experts module>.fastkit_lora.lora_{A,B}_<proj>`` (base-model names)."""
    return {f"{n}.{LORA_ATTR}.{k}": v.detach() for n, lora in expert_lora_modules(model)
            for k, v in lora.state_dict().items()}


def save_expert_lora(model: nn.Module, directory: str) -> str:
    """Write the factors (and r / alpha / dropout / rslora) to ``directory/fastkit_expert_lora.safetensors``."""
    from safetensors.torch import save_file

    mods = expert_lora_modules(model)
    if not mods:
        raise FastkitError("No expert LoRA attached to this model (call add_expert_lora first).")
    lora = mods[0][1]
    drop = lora.dropout.p if isinstance(lora.dropout, nn.Dropout) else 0.0
    meta = dict(r=lora.r, lora_alpha=lora.lora_alpha, lora_dropout=drop, use_rslora=lora.use_rslora)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, FILE_NAME)
    save_file({k: v.contiguous().cpu() for k, v in expert_lora_state_dict(model).items()}, path,
              metadata={"fastkit_expert_lora": json.dumps(meta)})
    return path


@torch.no_grad()
def merge_expert_lora(model: nn.Module) -> list[str]:
    """Fold ``s·B·A`` into the expert weights and remove the factors (for export). Returns module names."""
    base = unwrap(model)
    four_bit = [f"{name}.{proj}" for name, proj in expert_deltas(base, compute=False)
                if not isinstance(getattr(dict(experts_modules(base))[name], proj), torch.Tensor)]
    if four_bit:
        raise FastkitError(f"merge_expert_lora: {four_bit[0]} is stored 4-bit; adding the update to 4-bit codes "
                           "would round it away. save_merged merges into the dequantized experts instead.")
    merged = []
    for name, m in experts_modules(base):
        lora = getattr(m, LORA_ATTR, None)
        if not isinstance(lora, ExpertLoRA):
            continue
        for proj in lora.targets:
            w = getattr(m, proj)  # (E, out, in), or (E, in, out) when transposed
            d = lora.delta(proj)  # (E, out, in)
            w.add_((d.transpose(-2, -1) if m.is_transposed else d).to(w.dtype))
        merged.append(name)
    revert(base, [PATCH_NAME])
    return merged


def expert_deltas(model: nn.Module, compute: bool = True) -> dict[tuple[str, str], torch.Tensor | None]:
    """``{(experts module name, projection): s·B·A}`` in the weight's stored layout (None when not ``compute``)."""
    out = {}
    for name, m in experts_modules(unwrap(model)):
        lora = getattr(m, LORA_ATTR, None)
        if isinstance(lora, ExpertLoRA):
            for proj in lora.targets:
                d = lora.delta(proj).detach() if compute else None  # (E, out, in)
                out[(name, proj)] = d.transpose(-2, -1) if d is not None and m.is_transposed else d
    return out


def add_expert_deltas(model: nn.Module, deltas: dict[tuple[str, str], torch.Tensor]) -> None:
    """Add :func:`expert_deltas` to plain expert weights; 4-bit ones (:class:`NF4Experts`) are dequantized first."""
    modules = dict(unwrap(model).named_modules())
    for (name, proj), delta in deltas.items():
        m = modules[name]
        w = getattr(m, proj)
        if not isinstance(w, torch.Tensor):  # NF4Experts: the values it holds, as a plain parameter
            full = w.dequantize()  # (E, a, b) stored layout
            delattr(m, proj)
            m.register_parameter(proj, nn.Parameter(full, requires_grad=False))
            w = getattr(m, proj)
        with torch.no_grad():
            w.add_(delta.to(device=w.device, dtype=w.dtype))


def factors_from_peft(peft_model: nn.Module, model: nn.Module) -> int:
    """Copy PEFT ``target_parameters`` LoRA factors (adapter ``default``) into ``model``'s expert LoRA.

    PEFT stores ``lora_A`` as ``(r·E, in)`` and ``lora_B`` as ``(out, r·E)`` with the expert index
    fastest in B's columns; mapped here to ``A (E, r, in)`` and ``B (E, out, r)``. Returns the number
    of tensors copied. Used by the equivalence tests and to migrate PEFT adapters.
    """
    ours = dict(expert_lora_modules(model))
    copied = 0
    for name, mod in _hf.peft_param_wrappers(unwrap(peft_model)):
        found = _hf.peft_expert_factors(mod, "default")
        if found is None:
            continue
        parameter_name, e, a, b = found  # a (r*E, in), b (out, r*E)
        experts_name = name
        while experts_name.endswith(".base_layer"):
            experts_name = experts_name[: -len(".base_layer")]
        lora = ours.get(experts_name)
        if lora is None:
            continue
        with torch.no_grad():
            getattr(lora, f"lora_A_{parameter_name}").copy_(a.reshape(e, -1, a.shape[-1]))  # (E, r, in)
            getattr(lora, f"lora_B_{parameter_name}").copy_(
                b.reshape(b.shape[0], -1, e).permute(2, 0, 1))  # (E, out, r)
        copied += 2
    return copied


__all__ = ["ExpertLoRA", "ExpertLoRAPatch", "add_expert_lora", "expert_lora_enabled", "expert_lora_modules",
           "expert_lora_state_dict", "factors_from_peft", "merge_expert_lora",
           "peft_adapts_experts", "save_expert_lora"]
