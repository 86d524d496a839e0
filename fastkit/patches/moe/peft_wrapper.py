"""PEFT's parameter LoRA (``ParamWrapper``) called without a parametrization: no graph break under torch.compile.

What it replaces. PEFT 0.21 adapts a *parameter* (``LoraConfig(target_parameters=...)``; ``"all-linear"`` on
qwen3_moe, mixtral, olmoe, deepseek_v3 adapts the router's ``weight`` and the experts' ``gate_up_proj`` /
``down_proj`` this way) with a ``ParamWrapper`` whose forward registers a ``torch.nn.utils.parametrize``
parametrization on the adapted module, calls the module, and removes the parametrization again: on every call.
Registering swaps the module's class and ``set_``s the parameter, which dynamo cannot trace: a graph break per
wrapper call (19 in a 2-layer qwen3_moe twin's packed forward, the whole routing and experts path eager), and a
class swap per call eagerly.

Why this way. :func:`install` gives the outermost wrapper of each chain (PEFT nests one wrapper per adapted
parameter around the same module) an instance ``forward`` that computes what the parametrizations would have put
in place and calls the module with it:

- experts fastkit's experts function runs (:func:`fastkit.patches.moe.patch.runs_fastkit_experts`): the factors
  go to it as ``PEFT_FACTORS_ATTR`` for the call, and it applies them per expert group, as it already did with
  PEFT's registered factors (Note: [PEFT factors] in patch.py): no ``W + B·A`` per expert;
- any other module (a router, experts fastkit does not run, several adapters, fp8 upcasts): the updated tensor,
  computed as PEFT's proxies compute it (:func:`fastkit._hf.peft_param_update`), replaces the parameter for the
  call through ``torch.func.functional_call``, which dynamo traces.

What must not change. Logits and every gradient equal PEFT's own forward on the same adapters (fp32: to
rounding; tests/test_peft_wrapper.py). A wrapper that is merged or disabled (``disable_adapter()``), a call given
``adapter_names``, and a chain whose module has a parametrization of its own or two wrappers on one parameter
run PEFT's forward as it is. Installed by ``FastModel.get_peft_model`` and by ``compile`` (a model wrapped with
PEFT directly), recorded as the change ``"peft_wrapper"``: ``fastkit.revert`` deletes the instance forwards.
"""

from __future__ import annotations

import logging
import types

import torch

from fastkit import _hf
from fastkit.patches.moe.patch import PEFT_FACTORS_ATTR, runs_fastkit_experts
from fastkit.patching import attr_is_own, change

logger = logging.getLogger(__name__)

CHANGE = "peft_wrapper"


def install(model: torch.nn.Module) -> int:
    """Run every PEFT ``ParamWrapper`` chain of ``model`` without a parametrization (module docstring); returns
    how many chains now do. Idempotent; ``fastkit.revert(model)`` undoes it."""
    wrappers = [w for _, w in _hf.peft_param_wrappers(model)]
    if not wrappers:
        return 0
    inner = {id(w.base_layer) for w in wrappers}
    outermost = [w for w in wrappers if id(w) not in inner]

    def apply(swap) -> int:
        count = 0
        for wrapper in outermost:
            if attr_is_own(wrapper, "forward"):  # installed already, or another hook's forward: left as it is
                continue
            reason = _why_not(*_hf.peft_wrapper_chain(wrapper))
            if reason is not None:
                logger.info("fastkit: PEFT's parameter LoRA on %s keeps its parametrization: %s",
                            type(wrapper.get_base_layer()).__name__, reason)
                continue
            swap.setattr(wrapper, "forward", types.MethodType(_forward, wrapper))
            count += 1
        return count

    count = change(model, CHANGE, apply)
    if count:
        logger.info("fastkit: PEFT's parameter LoRA: %d wrapper chain(s) run without a parametrization "
                    "(torch.compile traces them whole)", count)
    return count


def _why_not(chain: list[torch.nn.Module], module: torch.nn.Module) -> str | None:
    names = [w.parameter_name for w in chain]
    if len(set(names)) != len(names):
        return f"two adapters wrap the parameter {names[0]!r} separately"
    if getattr(module, "parametrizations", None):
        return "the module has a parametrization of its own"
    return None


def _forward(self, x, *args, **kwargs):
    """The outermost ``ParamWrapper``'s forward: its chain's updates computed, the adapted module called once."""
    chain, module = _hf.peft_wrapper_chain(self)
    if "adapter_names" in kwargs or not all(_hf.peft_runs_plain(w) for w in chain):
        return type(self).forward(self, x, *args, **kwargs)  # PEFT's own (mixed batches refused there)
    per_group = runs_fastkit_experts(module)
    weights, factors = {}, {}
    for wrapper in chain:
        name = wrapper.parameter_name
        weight = getattr(module, name)  # the stored parameter: nothing parametrizes it here
        update = _hf.peft_param_update(wrapper, weight)
        if update is None:
            continue
        kind, value = update
        if kind == "factors" and per_group:
            factors[name] = (weight, *value)  # (W, lhs, rhs, scaling): delta = scaling · lhs @ rhs
        elif kind == "factors":
            weights[name] = _folded(weight, *value)
        else:
            weights[name] = value
    return _call(module, weights, factors, (x, *args), kwargs)


def _folded(weight: torch.Tensor, lhs: torch.Tensor, rhs: torch.Tensor, scaling: float) -> torch.Tensor:
    """``W + scaling · lhs @ rhs`` in W's dtype, as PEFT's ``_LoraFactorsProxy`` folds it: ``(E, a, b)``."""
    with torch.autocast(device_type=weight.device.type, enabled=False):
        return torch.baddbmm(weight, lhs, rhs, alpha=scaling)


def _call(module: torch.nn.Module, weights: dict, factors: dict, args: tuple, kwargs: dict):
    """``module(*args, **kwargs)`` with ``weights`` in place of its parameters and ``factors`` for its experts
    function, both for this call only."""
    if factors:
        setattr(module, PEFT_FACTORS_ATTR, factors)
    try:
        if weights:
            return torch.func.functional_call(module, weights, args, kwargs)
        return module(*args, **kwargs)
    finally:
        if factors:
            delattr(module, PEFT_FACTORS_ATTR)


__all__ = ["CHANGE", "install"]
