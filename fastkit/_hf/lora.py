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
