"""The one place that changes a model: idempotent, revertible, atomic patches.

Every fastkit optimization is a :class:`Patch`. A patch never edits a class or a module
global; it swaps attributes on *instances* (a module's ``forward``, a config's
``_attn_implementation``, a layer's ``_gradient_checkpointing_func``) through a
:class:`Swapper`, which remembers the exact original object. Functions that transformers looks up
by name (attention, experts) are added to its own registries (``AttentionInterface``,
``ExpertsInterface``) under fastkit keys; adding a new key changes nothing for models that do not
select it, so those registrations are left in place on revert. Patches reach those private
transformers / PEFT names only through :mod:`fastkit._hf`, which takes the ``Swapper`` for writes.

Per-model state lives here too: the records of active patches and the load report sit on the
transformers model, and :func:`unwrap` is the one place that looks through a PEFT wrapper to it
(every function here that takes a model accepts either).

Guarantees (tests/test_patching.py proves each):
- idempotent: applying a patch that is already active changes nothing;
- revertible: :func:`revert` restores the very objects that were there (``is``, not ``==``);
- atomic: a patch whose ``check`` refuses, or whose ``apply`` raises half-way, leaves the model
  exactly as it was and logs why.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

logger = logging.getLogger(__name__)

class _Missing:
    """Marks "the instance had no own attribute". One object, also after copy/deepcopy/pickle of a
    patched model (whose records are copied with it), so ``is _MISSING`` keeps working on the copy."""

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return "_MISSING"

    def __repr__(self):
        return "<missing>"


_MISSING = _Missing()
_STATE_ATTR = "_fastkit_patches"
_REPORT_ATTR = "_fastkit_report"


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a PEFT wrapper (``get_base_model()``), or ``model`` itself."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def set_report(model: torch.nn.Module, report: Any) -> None:
    """Attach fastkit's load report (:class:`fastkit.loader.LoadReport`) to the transformers model."""
    object.__setattr__(unwrap(model), _REPORT_ATTR, report)


def report(model: torch.nn.Module) -> Any:
    """The load report of a fastkit-loaded (or fastkit-patched) model, or None."""
    return getattr(unwrap(model), _REPORT_ATTR, None)


class Patch(Protocol):
    """What a patch file exposes. ``name`` is unique; ``check`` returns why it cannot apply."""

    name: str

    def check(self, model: torch.nn.Module) -> str | None:
        """Return ``None`` if the patch applies to ``model``, else a short human reason."""

    def apply(self, model: torch.nn.Module, swap: Swapper) -> None:
        """Make every change through ``swap`` so that it can be reverted."""


@dataclass
class _Swap:
    target: Any
    attr: str
    original: Any  # _MISSING when the instance had no own attribute (class default showed through)


@dataclass
class Swapper:
    """Records every attribute a patch changes, so :func:`revert` can put the originals back."""

    patch_name: str
    swaps: list[_Swap] = field(default_factory=list)

    def setattr(self, target: Any, attr: str, value: Any) -> None:
        """Set ``target.attr = value``, remembering the original object the first time."""
        if not any(s.target is target and s.attr == attr for s in self.swaps):
            self.swaps.append(_Swap(target, attr, _original(target, attr)))
        setattr(target, attr, value)

    def undo(self) -> None:
        """Restore the originals, newest first."""
        for s in reversed(self.swaps):
            if s.original is _MISSING:
                if attr_is_own(s.target, s.attr):
                    delattr(s.target, s.attr)
            else:
                setattr(s.target, s.attr, s.original)
        self.swaps.clear()


def attr_is_own(target: Any, attr: str) -> bool:
    """True if ``attr`` lives in the instance (or nn.Module's parameter/buffer/module dicts)."""
    if hasattr(target, "__dict__") and attr in vars(target):
        return True
    if isinstance(target, torch.nn.Module):
        return attr in target._parameters or attr in target._buffers or attr in target._modules
    return False


def _original(target: Any, attr: str) -> Any:
    if attr_is_own(target, attr):
        return getattr(target, attr)
    # A property (e.g. PreTrainedConfig._attn_implementation) stores its value elsewhere: restore by setattr.
    if isinstance(getattr(type(target), attr, None), property):
        return getattr(target, attr)
    return _MISSING


def active_patches(model: torch.nn.Module) -> list[str]:
    """Names of the fastkit patches active on ``model``, in the order they were applied."""
    return list(getattr(unwrap(model), _STATE_ATTR, {}))


def apply_patch(model: torch.nn.Module, patch: Patch) -> tuple[bool, str]:
    """Apply ``patch`` to ``model`` once. Returns ``(active, reason)``.

    ``active`` is True when the patch is (now or already) active. When it cannot apply, the model is
    left untouched and ``reason`` says why (also logged). The patch sees the transformers model
    (a PEFT wrapper is looked through).
    """
    model = unwrap(model)
    state: dict[str, Swapper] = getattr(model, _STATE_ATTR, {})
    if patch.name in state:
        return True, "already active"
    reason = patch.check(model)
    if reason is not None:
        logger.info("fastkit: %s not applied: %s (model unchanged)", patch.name, reason)
        return False, reason
    swap = Swapper(patch.name)
    try:
        patch.apply(model, swap)
    except Exception as exc:  # atomic: any failure rolls back what was already swapped
        swap.undo()
        logger.warning("fastkit: %s failed to apply (%s: %s); model left unchanged", patch.name,
                       type(exc).__name__, exc)
        return False, f"failed: {type(exc).__name__}: {exc}"
    state = dict(state)
    state[patch.name] = swap
    object.__setattr__(model, _STATE_ATTR, state)
    return True, "applied"


def revert(model: torch.nn.Module, names: Iterable[str] | None = None) -> list[str]:
    """Undo fastkit patches on ``model`` (all of them, or only ``names``), newest first.

    Returns the names reverted. After reverting everything the model carries no fastkit state. A PEFT
    wrapper is looked through (``fastkit.revert`` is this function).
    """
    model = unwrap(model)
    state: dict[str, Swapper] = dict(getattr(model, _STATE_ATTR, {}))
    wanted = list(state) if names is None else [n for n in names if n in state]
    for name in reversed([n for n in state if n in wanted]):
        state.pop(name).undo()
    if state:
        object.__setattr__(model, _STATE_ATTR, state)
    elif _STATE_ATTR in vars(model):
        object.__delattr__(model, _STATE_ATTR)
    return wanted
