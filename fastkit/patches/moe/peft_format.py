"""fastkit's expert LoRA factors in PEFT's own format (``LoraConfig(target_parameters=...)``), both ways.

Why. fastkit trains expert LoRA as per-group factors (:mod:`fastkit.patches.moe.lora`): ``A (E, r, in)``,
``B (E, out, r)``. PEFT, vLLM and TGI read expert adapters as PEFT's ``ParamWrapper`` tensors:
``lora_A (r·E, in)`` and ``lora_B (out, r·E)`` with the expert index fastest in B's columns, keyed by
the wrapper's module path (two parameters of one experts module nest: ``experts`` and
``experts.base_layer``). :func:`add_to_peft_adapter` converts the factors exactly (a reshape and a
permute, no arithmetic) into an adapter folder PEFT just wrote, and :func:`factors_from_adapter` reads
them back into fastkit's factors.

What must not change. ``PeftModel.from_pretrained`` on a plain transformers model gives the fastkit
model's logits (tests/test_adapters_portable.py), and the factors survive save -> load bit for bit.
The wrapper paths come from PEFT itself (it wraps a meta-device skeleton of the model), never from a
guess at its nesting order.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re

import torch

from fastkit import _hf
from fastkit.errors import FastkitError
from fastkit.patches.moe.lora import (
    FILE_NAME,
    PATCH_NAME,
    add_expert_lora,
    expert_lora_modules,
    expert_lora_state_dict,
    peft_adapts_experts,
)
from fastkit.patches.moe.patch import LORA_ATTR
from fastkit.patching import revert, unwrap

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."


def peft_wrapper_paths(model: torch.nn.Module, targets: list[str]) -> dict[str, str]:
    """``{"<experts>.<param>": PEFT wrapper path}`` for ``targets`` (full parameter names), as PEFT nests them.

    PEFT wraps a meta-device copy of ``model``'s architecture (no memory, no weights).
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(unwrap(model).config)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    wrapped = get_peft_model(skeleton, LoraConfig(r=1, target_modules=[], target_parameters=list(targets)))
    return {f"{name.replace('.base_layer', '').removeprefix(_PREFIX)}.{w.parameter_name}": name
            for name, w in _hf.peft_param_wrappers(wrapped)}


def _peft_alpha(scaling: float, r: int, use_rslora: bool) -> float:
    """The ``lora_alpha`` that gives PEFT's wrapper the scaling ``scaling`` at rank ``r``."""
    return scaling * (math.sqrt(r) if use_rslora else r)


def add_to_peft_adapter(model: torch.nn.Module, directory: str) -> list[str]:
    """Add ``model``'s fastkit expert factors to the PEFT adapter saved in ``directory``; returns the targets.

    Writes them as ``target_parameters`` LoRA: the tensors into ``adapter_model.safetensors`` and the
    parameter names (plus ``rank_pattern`` / ``alpha_pattern`` where the experts' rank or scaling
    differs from the adapter's) into ``adapter_config.json``.
    """
    from safetensors.torch import load_file, save_file


    mods = expert_lora_modules(model)
    if not mods:
        return []
    config_path, weights_path = os.path.join(directory, CONFIG_FILE), os.path.join(directory, WEIGHTS_FILE)
    if not (os.path.exists(config_path) and os.path.exists(weights_path)):
        raise FastkitError(f"No PEFT adapter in {directory!r} to add the expert factors to "
                           "(save the PEFT model there first).")
    from fastkit.checks import read_adapter_config

    config = read_adapter_config(directory, "load_lora")

    if peft_adapts_experts(model):
        raise FastkitError(f"{config_path} already adapts expert parameters {config['target_parameters'][:2]}; "
                           "fastkit expert LoRA cannot be added on top of PEFT's own expert adapter.")
    targets = [f"{name}.{proj}" for name, lora in mods for proj in lora.targets]
    # PEFT's own parameter targets that wrap something else (e.g. the router's gate.weight next to 4-bit
    # experts) stay; names that would match the experts are ours now
    others = [t for t in config.get("target_parameters") or [] if not any(_names(x, t) for x in targets)]
    final = sorted(targets) + others
    paths = peft_wrapper_paths(model, final)  # the nesting PEFT will build from the config written below
    tensors = load_file(weights_path)
    for key in ("rank_pattern", "alpha_pattern"):  # PEFT's own patterns for the experts no longer apply: ours do
        config[key] = {k: v for k, v in (config.get(key) or {}).items()
                       if not any(re.match(rf"(.*\.)?({k})$", t) for t in targets)}
    rank, alpha = config["rank_pattern"], config["alpha_pattern"]
    rslora = bool(config.get("use_rslora", False))
    for name, lora in mods:
        for proj in lora.targets:
            key, wrapper = f"{name}.{proj}", paths[f"{name}.{proj}"]
            a, b = getattr(lora, f"lora_A_{proj}").detach(), getattr(lora, f"lora_B_{proj}").detach()
            e, r, d_in = a.shape  # A (E, r, in)
            tensors[f"{wrapper}.lora_A.weight"] = a.reshape(e * r, d_in).contiguous().cpu()  # (r·E, in)
            tensors[f"{wrapper}.lora_B.weight"] = (
                b.permute(1, 2, 0).reshape(b.shape[1], r * e).contiguous().cpu())  # (E, out, r) -> (out, r·E)
            if r != config["r"]:
                rank[key] = r
            if not math.isclose(_peft_alpha(lora.scaling, r, rslora), config["lora_alpha"], rel_tol=1e-12):
                alpha[key] = _peft_alpha(lora.scaling, r, rslora)
    config["target_parameters"] = final
    save_file(tensors, weights_path, metadata={"format": "pt"})
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    return targets


def factors_from_adapter(directory: str) -> tuple[dict, dict[str, dict[str, torch.Tensor]]] | None:
    """Read the expert adapters of a PEFT folder: ``(hyper-parameters, {experts: {lora_A_<p>: (E, r, in),
    lora_B_<p>: (E, out, r)}})``, or None when its config has no ``target_parameters``.

    The wrapper paths are resolved lazily by :func:`load_into`, which knows the model.
    """
    from safetensors.torch import load_file

    config_path = os.path.join(directory, CONFIG_FILE)
    if not os.path.exists(config_path):
        return None
    from fastkit.checks import read_adapter_config

    config = read_adapter_config(directory, "load_lora")
    if not config.get("target_parameters"):
        return None
    return config, load_file(os.path.join(directory, WEIGHTS_FILE))


def _pattern(patterns: dict, key: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first pattern matching the end of ``key``."""
    return next((v for k, v in patterns.items() if re.match(rf"(.*\.)?({k})$", key)), default)


def _names(param: str, target: str) -> bool:
    """Whether ``target_parameters`` entry ``target`` names the full parameter name ``param`` (dotted suffix)."""
    return param == target or param.endswith(f".{target}")


def expert_targets(model: torch.nn.Module, targets: list[str]) -> list[str]:
    """The entries of a ``target_parameters`` list that name an expert projection fastkit's expert LoRA adapts
    (the rest, e.g. a router's ``gate.weight``, are PEFT's to load)."""
    from fastkit.patches.moe.patch import experts_modules, projection_names

    projections = [f"{name}.{proj}" for name, m in experts_modules(unwrap(model)) for proj in projection_names(m)]
    return [t for t in targets if any(_names(p, t) for p in projections)]


def load_into(model: torch.nn.Module, directory: str, targets: list[str] | None = None) -> list[str]:
    """Attach fastkit expert LoRA to ``model`` and fill it from the PEFT ``target_parameters`` adapter in
    ``directory`` (the inverse of :func:`add_to_peft_adapter`). Returns the experts module names.
    ``targets``: load only these expert projections (see :func:`expert_targets`); default all of the adapter's.

    Names, ranks and tensor keys are checked before the factors are attached; a shape that does not fit
    detaches them again (the model is left as it was) and raises. An adapter fastkit's factors cannot hold
    (a router target, ranks differing per projection) raises; ``PeftModel.from_pretrained`` loads it,
    and fastkit's ``moe`` patch runs PEFT's expert adapters per expert group as well.
    """
    from fastkit.patches.moe.patch import experts_modules, projection_names

    found = factors_from_adapter(directory)
    if found is None:
        raise FastkitError(f"{directory!r} has no PEFT expert adapter (adapter_config.json without "
                           "target_parameters).")
    config, tensors = found
    paths = peft_wrapper_paths(model, list(config["target_parameters"]))
    if targets is not None:  # only these (the caller loads the other parameter adapters through PEFT)
        paths = {k: v for k, v in paths.items() if any(_names(k, t) for t in targets)}
    experts = {name: projection_names(m) for name, m in experts_modules(unwrap(model))}
    if not paths:
        raise FastkitError(f"{directory}: target_parameters {config['target_parameters'][:3]} match no parameter "
                           "of this model.")
    hyper = set()
    for key in paths:
        name, _, proj = key.rpartition(".")
        if proj not in experts.get(name, ()):
            raise FastkitError(f"{directory}: {key} is not an expert projection fastkit's expert LoRA adapts; load "
                               "this adapter with peft.PeftModel.from_pretrained instead.")
        hyper.add((_pattern(config.get("rank_pattern") or {}, key, config["r"]),
                   _pattern(config.get("alpha_pattern") or {}, key, config["lora_alpha"])))
    if len(hyper) != 1:
        raise FastkitError(f"{directory}: expert projections use several (rank, alpha) pairs {sorted(hyper)}; "
                           "fastkit's expert LoRA has one; load it with peft.PeftModel.from_pretrained instead.")
    (r, alpha), = hyper
    missing = [f"{w}.lora_{ab}.weight" for w in paths.values() for ab in "AB" if f"{w}.lora_{ab}.weight" not in tensors]
    if missing:
        raise FastkitError(f"{directory}: the adapter file lacks {missing[:3]} (a truncated or foreign adapter).")
    names = add_expert_lora(model, r=r, lora_alpha=alpha, use_rslora=bool(config.get("use_rslora", False)))
    try:
        _fill(dict(expert_lora_modules(model)), paths, tensors)
    except Exception:  # shapes that do not fit this model: detach again, the model is as it was
        revert(model, [PATCH_NAME])
        raise
    return names


def _fill(own: dict, paths: dict[str, str], tensors: dict[str, torch.Tensor]) -> None:
    """Copy PEFT's ``(r·E, in)`` / ``(out, r·E)`` factors into fastkit's ``(E, r, in)`` / ``(E, out, r)``."""
    for key, wrapper in paths.items():
        name, _, proj = key.rpartition(".")
        a_peft = tensors[f"{wrapper}.lora_A.weight"]  # (r·E, in)
        b_peft = tensors[f"{wrapper}.lora_B.weight"]  # (out, r·E)
        a_ours, b_ours = getattr(own[name], f"lora_A_{proj}"), getattr(own[name], f"lora_B_{proj}")
        e = a_ours.shape[0]
        with torch.no_grad():
            a_ours.copy_(a_peft.reshape(e, -1, a_peft.shape[-1]))  # (E, r, in)
            b_ours.copy_(b_peft.reshape(b_peft.shape[0], -1, e).permute(2, 0, 1))  # (E, out, r)


__all__ = ["add_to_peft_adapter", "expert_targets", "factors_from_adapter", "load_expert_lora", "load_into",
           "peft_wrapper_paths"]


def load_expert_lora(model: torch.nn.Module, directory: str) -> list[str]:
    """Attach expert LoRA with the saved hyper-parameters and load the saved factors (strict).

    Reads ``fastkit_expert_lora.safetensors`` or, without it, the PEFT ``target_parameters`` expert adapter
    that ``fastkit.export.save_lora`` writes (:mod:`fastkit.patches.moe.peft_format`).
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = os.path.join(directory, FILE_NAME)
    if not os.path.exists(path) and factors_from_adapter(directory) is not None:
        return load_into(model, directory)
    if not os.path.exists(path):
        raise FastkitError(f"No {FILE_NAME} in {directory!r} (save it with fastkit.patches.moe.lora.save_expert_lora).")
    with safe_open(path, framework="pt") as f:
        meta = json.loads(f.metadata()["fastkit_expert_lora"])
    tensors = load_file(path)
    names = add_expert_lora(model, **meta)
    own = dict(expert_lora_modules(model))
    expected = set(expert_lora_state_dict(model))
    if set(tensors) != expected:  # the names are known once attached: detach again, so the model is unchanged
        revert(model, [PATCH_NAME])
        missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise FastkitError(f"{path}: factors do not match this model (missing {missing[:3]}, unexpected {extra[:3]}).")
    for key, value in tensors.items():
        mod_name, _, pname = key.rpartition(f".{LORA_ATTR}.")
        with torch.no_grad():
            getattr(own[mod_name], pname).copy_(value)
    return names
