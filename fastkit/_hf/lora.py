"""PEFT's LoRA layers: factors, targets, ``ParamWrapper`` experts, summed updates. Part of :mod:`fastkit._hf`
(its docstring says the rules); checked: peft 0.21.2.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


def peft_lora_factors(module: torch.nn.Module, name: str
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float] | None:
    """PEFT ``target_parameters`` LoRA parametrizing ``module.<name>`` right now: ``(W, lhs, rhs, scaling)``.

    ``W`` is the stored base tensor (``parametrizations[name].original``) and ``lhs @ rhs`` the update in
    the parameter's own layout. None unless exactly one PEFT ``_LoraFactorsProxy`` (matched by class
    name; PEFT registers it only for the duration of its ``ParamWrapper`` forward) parametrizes it.
    checked: peft 0.21.2.
    Can go when PEFT exposes a ``ParamWrapper``'s active factors publicly (``_LoraFactorsProxy`` is private and
    registered only during its forward).
    """
    plist = getattr(getattr(module, "parametrizations", None), name, None)
    if plist is None:
        return None
    mods = list(plist)
    if len(mods) != 1 or type(mods[0]).__name__ != "_LoraFactorsProxy":
        return None
    proxy = mods[0]
    return plist.original, proxy.lhs, proxy.rhs, proxy.scaling


def peft_target_matches(config: Any, module_name: str) -> bool:
    """Whether a LoRA ``config``'s ``target_modules`` selects the module named ``module_name``, matched as PEFT
    matches when it wraps a model (a list of names: the name's last parts; a string: a regex over the full name).
    ``check_target_module_exists`` lives in ``peft.tuners.tuners_utils``. checked: peft 0.21.2.
    Can go when PEFT exports the matcher from its top level (``peft.tuners.tuners_utils`` is deep)."""
    from peft.tuners.tuners_utils import check_target_module_exists

    return bool(check_target_module_exists(config, module_name))


def peft_param_wrappers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """``(qualified name, wrapper)`` of every PEFT ``ParamWrapper`` (``target_parameters`` LoRA) in ``model``.

    ``ParamWrapper`` lives in ``peft.tuners.lora.layer``. checked: peft 0.21.2.
    Can go when ``ParamWrapper`` is exported from PEFT's top level (``peft.tuners`` is deep).
    """
    from peft.tuners.lora.layer import ParamWrapper

    return ((n, m) for n, m in model.named_modules() if isinstance(m, ParamWrapper))


def peft_wrapper_chain(module: torch.nn.Module) -> tuple[list[torch.nn.Module], torch.nn.Module]:
    """The PEFT ``ParamWrapper`` s nested from ``module`` inward (PEFT puts one per adapted parameter of the same
    module, each around the last: ``experts`` -> ``down_proj``'s wrapper around ``gate_up_proj``'s) and the module
    they adapt; ``([], module)`` when ``module`` is not a ``ParamWrapper``. checked: peft 0.21.2.
    Can go when ``ParamWrapper`` is exported from PEFT's top level (``peft.tuners`` is deep).
    """
    from peft.tuners.lora.layer import ParamWrapper

    chain = []
    while isinstance(module, ParamWrapper):
        chain.append(module)
        module = module.base_layer
    return chain, module


def peft_runs_plain(wrapper: torch.nn.Module) -> bool:
    """Whether ``wrapper``'s forward is its module's forward with the parameter updated by its active adapters
    (what :func:`peft_param_update` computes): not merged, adapters not disabled (``disable_adapter()``).
    checked: peft 0.21.2.
    Can go when PEFT's ``ParamWrapper`` forward runs without ``register_parametrization`` (a graph break per call).
    """
    return not wrapper.merged and not wrapper.disable_adapters


def peft_param_update(wrapper: torch.nn.Module, weight: torch.Tensor) -> tuple[str, Any] | None:
    """What PEFT's ``ParamWrapper`` forward parametrizes its parameter (stored tensor ``weight``) with, as
    ``_activate_lora`` chooses, without registering a parametrization: None when no active adapter is on
    ``wrapper``; ``("factors", (lhs, rhs, scaling))`` where PEFT folds ONE adapter's factors in with
    ``baddbmm(W, lhs, rhs, alpha=scaling)`` (``_LoraFactorsProxy``: several experts, a dtype PEFT does not upcast);
    else ``("weight", W')``, ``W + Σ ΔW`` as ``_LoraParameterProxy`` computes it (fp8 dtypes added upcast).
    checked: peft 0.21.2.
    Can go when PEFT's ``ParamWrapper`` forward runs without ``register_parametrization`` (a graph break per call).
    """
    from peft.tuners.lora.layer import UPCAST_DTYPES, _LoraParameterProxy

    adapters = [a for a in wrapper.active_adapters if a in wrapper.lora_A]
    if not adapters:
        return None
    upcast = any(getattr(torch, name, None) == weight.dtype for name in UPCAST_DTYPES)
    if len(adapters) == 1 and wrapper.num_experts > 1 and not upcast:
        return "factors", wrapper.get_delta_factors(adapters[0])
    delta = wrapper.get_delta_weight(adapters[0])
    for adapter in adapters[1:]:
        delta = delta + wrapper.get_delta_weight(adapter)
    return "weight", _LoraParameterProxy._low_prec_add(weight, delta) if upcast else weight + delta


def peft_expert_factors(wrapper: torch.nn.Module, adapter: str = "default"
                        ) -> tuple[str, int, torch.Tensor, torch.Tensor] | None:
    """``(parameter_name, num_experts, A (r·E, in), B (out, r·E))`` of ``adapter`` on a ``ParamWrapper``,
    or None when it has no such adapter. PEFT's B has the expert index fastest in its columns.
    checked: peft 0.21.2.
    Can go when PEFT documents ``ParamWrapper``'s per-expert factor layout as public API.
    """
    if adapter not in wrapper.lora_A:
        return None
    return wrapper.parameter_name, wrapper.num_experts, wrapper.lora_A[adapter].weight, wrapper.lora_B[adapter].weight


def peft_lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """``{qualified name: layer}`` of every PEFT LoRA layer (``peft.tuners.lora.LoraLayer``: Linear, Embedding,
    ``ParamWrapper``...) in ``model``. checked: peft 0.21.2.
    Can go when ``LoraLayer`` is exported from PEFT's top level (``peft.tuners`` is deep).
    """
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def peft_delta(layer: torch.nn.Module, param: str) -> torch.Tensor | None:
    """The summed update ``Σ s·B·A`` of ``layer``'s active, unmerged adapters for its stored parameter ``param``,
    in that parameter's own layout (``get_delta_weight``); None when ``param`` is not the one ``layer`` adapts
    (a ``ParamWrapper`` adapts ``parameter_name``, other layers ``weight``) or nothing is active.
    checked: peft 0.21.2.
    Can go when PEFT offers a public summed update of a layer's active adapters for a named parameter.
    """
    from peft.tuners.lora.layer import ParamWrapper

    target = layer.parameter_name if isinstance(layer, ParamWrapper) else "weight"
    if param != target or layer.merged or layer.disable_adapters:
        return None
    own = set(layer.lora_A) | set(getattr(layer, "lora_embedding_A", {}))
    deltas = [layer.get_delta_weight(a) for a in layer.active_adapters if a in own]
    return torch.stack(deltas).sum(0) if len(deltas) > 1 else (deltas[0] if deltas else None)
