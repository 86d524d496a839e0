"""Upstream classes recognized by what they are: by class name where the family's modeling module is only imported
with the model (the table's rows name them), by ``isinstance`` where the class imports (bitsandbytes). Part of
:mod:`fastkit._hf` (its docstring says the rules).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fastkit import registry

# Upstream classes recognized by what they are (isinstance where the class imports, its name where the
# family's module is only imported with the model). checked: transformers 5.24, 5.25, peft 0.21.2,
# bitsandbytes 0.50.2, tokenizers 0.22. Stays while the families have no shared interface to test for.

# The class lists are the table's (``ModelFacts.looped_experts`` / ``looped_forward`` / ``no_4bit_experts``), read
# at call time; here only what each fastkit looped forward needs of the module it is handed.
_LOOPED_SHAPE: dict[str, Callable[[torch.nn.Module], bool]] = {
    "dbrx": lambda m: hasattr(getattr(m, "mlp", None), "w1"),  # (E·F, H) w1 / v1 / w2 on module.mlp
    "llama4": lambda m: hasattr(getattr(m, "experts", None), "gate_up_proj"),  # fused (E, H, 2I) under .experts
}


def class_name_in(module: Any, names: tuple[str, ...]) -> bool:
    """``module``'s class is one of ``names`` (registry rows name a family's modules, e.g. its stateful layers;
    the family's modeling module is only imported with the model, so its classes are matched by name).
    checked: transformers 5.24, 5.25 (the class names in the table's rows). Can go when the families share a public
    interface fastkit can ``isinstance`` (their modeling modules import only with the model today).
    """
    return type(module).__name__ in names


def is_bnb_linear(module: Any) -> bool:
    """A bitsandbytes ``Linear4bit`` / ``Linear8bitLt`` (False when bitsandbytes does not import).
    checked: bitsandbytes 0.50.2. Can go when bitsandbytes imports everywhere without a GPU build (the guarded
    import is the fragile part), or transformers offers a public quantized-linear test.
    """
    try:
        import bitsandbytes.nn as bnb
    except Exception:  # noqa: BLE001 - no bitsandbytes (or no GPU build): nothing can be a bnb layer
        return False
    return isinstance(module, (bnb.Linear4bit, bnb.Linear8bitLt))


def is_fused_experts_class(module: torch.nn.Module) -> bool:
    """A fused 3-D experts module by its class name (``...Experts``), decorated or not.
    checked: transformers 5.24, 5.25. Can go when every fused experts class carries ``@use_experts_implementation``
    (then :func:`is_decorated_experts` answers alone).
    """
    return type(module).__name__.endswith("Experts")


def looped_experts_kind(module: torch.nn.Module) -> str | None:
    """The ``looped_forward`` of the table row listing ``module``'s class in ``looped_experts`` (``"dbrx"``:
    ``DbrxExperts`` with ``mlp.w1``; ``"llama4"``: ``Llama4TextMoe`` over fused ``experts.gate_up_proj``), when
    the module has what that forward reads; else None. checked: transformers 5.24, 5.25 (dbrx, llama4 modeling files).
    Can go when DBRX and Llama-4 experts use ``@use_experts_implementation`` upstream (then the rows'
    ``looped_experts`` go too).
    """
    kind = registry.looped_experts().get(type(module).__name__)
    shape_ok = _LOOPED_SHAPE.get(kind or "")
    return kind if shape_ok is not None and shape_ok(module) else None


def modules_of_classes(module: torch.nn.Module, names: tuple[str, ...]) -> list[torch.nn.Module]:
    """The submodules of ``module`` whose class is one of ``names`` (a row's ``stateful`` layer classes).
    checked: transformers 5.24, 5.25 (the ``stateful`` classes of the hybrid rows). Can go when the stateful layers
    share a public base class upstream (matched by name today).
    """
    return [m for m in module.modules() if type(m).__name__ in names]


def has_no_4bit_layout(module: torch.nn.Module) -> bool:
    """Experts fastkit cannot store 4-bit: a class some table row lists in ``no_4bit_experts`` (DBRX, Llama-4,
    JetMoE today), or transformers' own ``Mxfp4`` modules. checked: transformers 5.24, 5.25.
    Can go when fastkit has a 4-bit layout for every experts class the table lists (then only the ``Mxfp4`` test
    stays, or that too when transformers' MXFP4 modules are public).
    """
    cls = type(module).__name__
    return cls in registry.no_4bit_experts() or cls.startswith("Mxfp4")
