"""The one place that changes a model: idempotent, revertible, atomic patches.

Every fastkit optimization is a :class:`Patch`. A patch never edits a class or a module
global; it swaps attributes on *instances* (a module's ``forward``, a config's
``_attn_implementation``, a layer's ``_gradient_checkpointing_func``) through a
:class:`Swapper`, which remembers the exact original object. The same ``Swapper`` registers
forward hooks (:meth:`Swapper.hook`), replaces parameters (:meth:`Swapper.parameter`), flips
``requires_grad`` (:meth:`Swapper.requires_grad`) and records what an upstream call changes on a
model (:meth:`Swapper.record`: gradient checkpointing). Changes that are not optimizations (the
packed-batch guard, ``use_cache=False`` for training, 4-bit experts and the NF4 linears beside them,
checkpointing, one experts module attached on its own) go through :func:`change`: recorded like a
patch, undone by :func:`revert`, not listed by :func:`active_patches`. A submodule swapped through
:meth:`Swapper.setattr` (``parent.q_proj = Linear4bit(...)``) is put back as the very module object.
Functions that transformers looks up by name (attention, experts) are added to its own registries
(``AttentionInterface``, ``ExpertsInterface``) under fastkit keys; adding a new key changes nothing
for models that do not select it, so those registrations are left in place on revert. Patches reach those private
transformers / PEFT names only through :mod:`fastkit._hf`, which takes the ``Swapper`` for writes.

Per-model state lives here too: the records of active patches and the load report sit on the
transformers model, and :func:`unwrap` is the one place that looks through a PEFT wrapper to it
(every function here that takes a model accepts either).

Guarantees (tests/test_patching.py proves each):
- idempotent: applying a patch that is already active changes nothing;
- revertible: :func:`revert` restores the very objects that were there (``is``, not ``==``): instance
  attributes, hook dicts, parameter dicts and config values compared by content;
- atomic: a patch whose ``check`` refuses, or whose ``apply`` raises half-way, leaves the model
  exactly as it was and logs why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from fastkit import _torch

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
    """Attach fastkit's load report (:class:`fastkit.families.patch.LoadReport`) to the transformers model."""
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
    """An attribute set on an instance (``setattr``): undo sets the original back or deletes it."""

    target: Any
    attr: str
    original: Any  # _MISSING when the instance had no own attribute (class default showed through)

    def undo(self) -> None:
        if self.original is _MISSING:
            if attr_is_own(self.target, self.attr):
                delattr(self.target, self.attr)
        else:
            setattr(self.target, self.attr, self.original)


@dataclass
class _Entry:
    """A key of a dict that belongs to a module (hooks, parameters, buffers, submodules, ``__dict__``).

    The dict is held, not the module: a deepcopy of the patched model copies it with the model, so the
    copy's revert edits the copy's dict.
    """

    mapping: dict
    key: Any
    original: Any  # _MISSING: the key was added

    def undo(self) -> None:
        if self.original is _MISSING:
            self.mapping.pop(self.key, None)
        else:
            self.mapping[self.key] = self.original


@dataclass
class _Undo:
    """An undo step that is a call (``restore(*args)``), e.g. putting back a parameter that was quantized away.

    The modules and tensors it acts on are ``args``, not a closure's cells: a deepcopy of the patched model copies
    them with the model (as :class:`_Entry`'s dict), so the copy's revert edits the copy, never the original.
    """

    restore: Callable[..., None]
    args: tuple = ()

    def undo(self) -> None:
        self.restore(*self.args)


@dataclass
class Swapper:
    """Records every change a patch makes, so :func:`revert` can put the originals back."""

    patch_name: str
    swaps: list = field(default_factory=list)
    listed: bool = True
    """Shown by :func:`active_patches` (a patch); False for a :func:`change`."""

    def setattr(self, target: Any, attr: str, value: Any) -> None:
        """Set ``target.attr = value``, remembering the original object the first time."""
        if not any(isinstance(s, _Swap) and s.target is target and s.attr == attr for s in self.swaps):
            self.swaps.append(_Swap(target, attr, _original(target, attr)))
        setattr(target, attr, value)

    def hook(self, module: torch.nn.Module, fn: Callable, *, with_kwargs: bool = False) -> None:
        """Register ``fn`` as a forward pre-hook of ``module``; revert removes it (and only it)."""
        self.record(module, lambda: module.register_forward_pre_hook(fn, with_kwargs=with_kwargs), recurse=False)

    def parameter(self, module: torch.nn.Module, name: str, value: Any,
                  restore: Callable[[], Any] | None = None) -> None:
        """Replace parameter ``module.<name>`` by ``value`` (a tensor subclass or a module holding its storage).

        Revert puts back the original ``Parameter`` object, or, when the original must not be kept
        (4-bit experts drop their 16-bit weight to save memory), what ``restore()`` builds.
        """
        params = _torch.module_dicts(module)["_parameters"]
        original = params.get(name)
        if original is None:
            raise ValueError(f"{type(module).__name__} has no parameter {name!r} to replace")
        keep = original if restore is None else None
        del params[name]
        setattr(module, name, value)
        self.swaps.append(_Undo(_put_back_parameter, (module, name, keep, restore)))

    def on_undo(self, restore: Callable[..., None], *args: Any) -> None:
        """Run ``restore(*args)`` on revert (in newest-first order with the other changes). Pass the modules it
        edits as ``args`` (see :class:`_Undo`): a closure over them would edit the original from a deepcopy."""
        self.swaps.append(_Undo(restore, args))

    def requires_grad(self, tensor: torch.Tensor, flag: bool) -> None:
        """``tensor.requires_grad_(flag)``, undone by revert."""
        before = tensor.requires_grad
        tensor.requires_grad_(flag)
        self.swaps.append(_Undo(torch.Tensor.requires_grad_, (tensor, before)))

    def record(self, root: torch.nn.Module, fn: Callable[[], Any], *, recurse: bool = True) -> Any:
        """Run ``fn`` (an upstream call that edits modules under ``root``) and record what it changed.

        Every module's own attributes and its parameter, buffer, submodule and hook dicts are compared
        before and after; revert restores each changed entry (and removes each added one).
        """
        modules = list(root.modules()) if recurse else [root]
        before = [(m, {k: dict(d) for k, d in _torch.module_dicts(m).items()}) for m in modules]
        result = fn()
        for m, old in before:
            for kind, d in _torch.module_dicts(m).items():
                was = old[kind]
                for key in [k for k in d if k not in was or d[k] is not was[k]] + [k for k in was if k not in d]:
                    self.swaps.append(_Entry(d, key, was.get(key, _MISSING)))
        return result

    def touched(self) -> set[tuple[int, Any]]:
        """``(id of the object or dict, attribute or key)`` of every attribute / dict entry this patch set."""
        out = set()
        for s in self.swaps:
            if isinstance(s, _Swap):
                out.add((id(s.target), s.attr))
            elif isinstance(s, _Entry):
                out.add((id(s.mapping), s.key))
        return out

    def undo(self) -> None:
        """Restore the originals, newest first."""
        for s in reversed(self.swaps):
            s.undo()
        self.swaps.clear()


def _put_back_parameter(module: torch.nn.Module, name: str, keep: Any, restore: Callable[[], Any] | None) -> None:
    """:meth:`Swapper.parameter`'s revert: the original parameter (``keep``), or what ``restore()`` builds."""
    for attr in ("_modules", "_buffers", "__dict__"):
        _torch.module_dicts(module)[attr].pop(name, None)
    module.register_parameter(name, keep if keep is not None else restore())


def attr_is_own(target: Any, attr: str) -> bool:
    """True if ``attr`` lives in the instance (or nn.Module's parameter/buffer/module dicts)."""
    if hasattr(target, "__dict__") and attr in vars(target):
        return True
    if isinstance(target, torch.nn.Module):
        own = _torch.module_dicts(target)
        return any(attr in own.get(k, ()) for k in ("_parameters", "_buffers", "_modules"))
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
    return [n for n, s in getattr(unwrap(model), _STATE_ATTR, {}).items() if s.listed]


def change(model: torch.nn.Module, name: str, fn: Callable[[Swapper], Any]) -> Any:
    """Make a change that is not a patch (``fn(swap)``) through the mechanism, so :func:`revert` undoes it.

    Calling it again under the same ``name`` adds to the same record (an attribute keeps its first
    original). A failure half-way is rolled back (only this call's part) and re-raised. Returns ``fn``'s result.
    """
    model = unwrap(model)
    state: dict[str, Swapper] = dict(getattr(model, _STATE_ATTR, {}))
    swap = state.get(name) or Swapper(name, listed=False)
    done = len(swap.swaps)
    try:
        result = fn(swap)
    except Exception:
        tail, swap.swaps = swap.swaps[done:], swap.swaps[:done]
        for s in reversed(tail):
            s.undo()
        raise
    if swap.swaps:
        state[name] = swap
        object.__setattr__(model, _STATE_ATTR, state)
    return result


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


def _with_later_overlaps(state: dict[str, Swapper], wanted: list[str]) -> list[str]:
    """``wanted`` plus every newer patch that set an attribute one of them set too.

    Two patches may wrap the same attribute (packing and the host embedding both wrap the decoder's
    ``forward``): the newer one's wrapper calls the older one's. Undoing only the older one would put back
    the original under the newer one's record, and undoing the newer one later would bring the older
    wrapper back. So reverting a patch also reverts, newest first, what was stacked on it (and says so).
    """
    order = list(state)
    out = set(wanted)
    touched = set().union(*(state[n].touched() for n in wanted)) if wanted else set()
    for name in order[min((order.index(n) for n in wanted), default=len(order)):]:
        if name not in out and state[name].touched() & touched:
            out.add(name)
            touched |= state[name].touched()
            logger.info("fastkit: reverting %s also reverts %s, which changed the same attribute after it",
                        ", ".join(wanted), name)
    return [n for n in order if n in out]


def revert(model: torch.nn.Module, names: Iterable[str] | None = None) -> list[str]:
    """Undo fastkit patches on ``model`` (all of them, or only ``names``), newest first.

    Returns the names of the patches reverted; everything :func:`change` recorded is undone too (all of
    it, or the records named in ``names``). After reverting everything the model carries no fastkit
    state. A PEFT wrapper is looked through (``fastkit.revert`` is this function).
    """
    model = unwrap(model)
    state: dict[str, Swapper] = dict(getattr(model, _STATE_ATTR, {}))
    wanted = list(state) if names is None else _with_later_overlaps(state, [n for n in names if n in state])
    listed = [n for n in wanted if state[n].listed]
    for name in reversed([n for n in state if n in wanted]):
        state.pop(name).undo()
    if state:
        object.__setattr__(model, _STATE_ATTR, state)
    elif _STATE_ATTR in vars(model):
        object.__delattr__(model, _STATE_ATTR)
    return listed
