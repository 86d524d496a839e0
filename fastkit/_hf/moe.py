"""MoE experts in transformers: the experts registry and key, decorated experts modules, the grouped_mm
fallback, the per-parameter load hook. Part of :mod:`fastkit._hf` (its docstring says the rules); checked:
:data:`fastkit._hf.CHECKED` unless an accessor says otherwise.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from unittest import mock

import torch

from fastkit.patching import Swapper

_EXPERTS = "_experts_implementation"
_EXPERTS_INTERNAL = "_experts_implementation_internal"


def register_experts_function(key: str, fn: Callable) -> None:
    """Register ``fn`` under ``key`` in ``transformers.integrations.moe.ExpertsInterface`` (additive,
    idempotent). checked: transformers 5.24, 5.25.
    Can go when ``ExpertsInterface`` is exported from a public path (``integrations.moe`` is deep).
    """
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(key, fn)


def is_decorated_experts(module: torch.nn.Module) -> bool:
    """True for an instance of a ``@use_experts_implementation`` class: its ``__init__`` sets ``has_gate``,
    ``has_bias``, ``is_transposed``, ``_is_expert_parallel`` (and the module has a ``config``).
    checked: transformers 5.24, 5.25.
    Can go when ``@use_experts_implementation`` marks its classes publicly (a base class or a flag).
    """
    return all(hasattr(module, a) for a in ("has_gate", "has_bias", "is_transposed", "_is_expert_parallel", "config"))


def is_expert_parallel(module: torch.nn.Module) -> bool:
    """Reads ``module._is_expert_parallel`` of a decorated experts module (expert parallelism puts sentinel
    ids in the router output). checked: transformers 5.24, 5.25.
    Can go when the expert-parallel flag is public.
    """
    return bool(module._is_expert_parallel)


def experts_implementation(config) -> str | None:
    """The experts key ``@use_experts_implementation`` dispatches to: reads ``config._experts_implementation``.
    checked: transformers 5.24, 5.25.
    Can go when the config's experts key is a public attribute.
    """
    return getattr(config, _EXPERTS, None)


def set_experts_implementation(config, key: str, swap: Swapper | None = None) -> None:
    """Select the experts function ``key`` on ``config``.

    With ``swap`` (a patch): writes ``config._experts_implementation_internal``, the plain instance attribute
    behind the property, on THIS config only; the caller visits every config. The public setter recurses
    into sub-configs, so undoing it newest-first would overwrite a sub-config's own original with its
    parent's (Note: [config swap] in fastkit.patches.moe.patch). Without ``swap`` (benchmarks): the property
    setter, which also sets the sub-configs. checked: transformers 5.24, 5.25.
    Can go when transformers has a public per-config setter that does not recurse into sub-configs (Note: [config
    swap]).
    """
    if swap is None:
        setattr(config, _EXPERTS, key)
    else:
        swap.setattr(config, _EXPERTS_INTERNAL, key)


def apply_gate(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The gated activation of a decorated experts module: ``module._apply_gate(x)`` ``(S, 2I) -> (S, I)``
    (GPT-OSS interleaved clamp-SwiGLU, the default concatenated SwiGLU). checked: transformers 5.24, 5.25.
    Can go when the experts' gated activation is public (``_apply_gate`` is private in 5.24).
    """
    return module._apply_gate(x)


def grouped_mm_disabled():
    """A context in which transformers' ``grouped_mm`` experts path takes its fallback (what a T4 gets):
    patches ``transformers.integrations.moe._can_use_grouped_mm`` to return False. checked: transformers 5.24, 5.25.
    Can go when transformers has a public switch for its grouped_mm fallback (tests and benchmarks use this one).
    """
    return mock.patch("transformers.integrations.moe._can_use_grouped_mm", return_value=False)



@contextlib.contextmanager
def on_param_loaded(callback: Callable[[torch.nn.Module, str], None]) -> Iterator[None]:
    """While ``from_pretrained`` runs inside this context, call ``callback(model, target_name)`` right after
    transformers sets each loaded parameter on the (meta-initialized) model.

    Wraps ``transformers.core_model_loading.set_param_for_module`` (the module global that
    ``convert_and_load_state_dict_in_model`` calls once per converted target, e.g. once per fused
    ``experts.gate_up_proj``), and sets ``HF_DEACTIVATE_ASYNC_LOAD=1`` so checkpoint tensors are read
    lazily, one target at a time (the loader's thread pool would otherwise read every tensor ahead).
    checked: transformers 5.24, 5.25.
    Can go when ``from_pretrained`` offers a public per-parameter load hook (none in 5.24).
    """
    import transformers.core_model_loading as cml

    original = cml.set_param_for_module

    def set_and_call(model, target_name, *args, **kwargs):
        original(model, target_name, *args, **kwargs)
        callback(model, target_name)

    with mock.patch.object(cml, "set_param_for_module", set_and_call), \
            mock.patch.dict(os.environ, {"HF_DEACTIVATE_ASYNC_LOAD": "1"}):
        yield
