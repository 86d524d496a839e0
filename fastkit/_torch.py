"""Compat layer for torch: every private or version-fragile torch name fastkit uses, in one file.

Each accessor says the torch versions it was checked on, the upstream issue where there is one, and
when it can go. Nothing else in fastkit may reach a torch private name (tests/test_hf_compat.py scans
every file for underscore attributes on objects that are not fastkit's). This file imports torch only,
so the pure-torch files (patches/*/routing.py, pipeline.py, ...) may use it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

# nn.Module's own dicts that a patch may change: parameters, buffers, submodules, and every hook dict.
# checked: torch 2.10-2.13 (names unchanged since 2.0; missing ones are skipped). Stays: torch has no
# public API that lists or removes a hook without its RemovableHandle, and a handle does not survive
# deepcopy (it holds a weak reference to the ORIGINAL module's dict).
_MODULE_DICTS = ("_parameters", "_buffers", "_modules", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs",
                 "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_hooks",
                 "_backward_pre_hooks", "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                 "_load_state_dict_post_hooks")


def module_dicts(module: torch.nn.Module) -> dict[str, dict]:
    """The module's ``__dict__`` and its parameter / buffer / submodule / hook dicts, by name (live objects)."""
    own = vars(module)
    return {"__dict__": own, **{k: own[k] for k in _MODULE_DICTS if isinstance(own.get(k), dict)}}


def forward_pre_hooks(module: torch.nn.Module) -> list[Callable]:
    """The functions registered with ``register_forward_pre_hook`` on ``module``, in order.
    checked: torch 2.10-2.13 (``Module._forward_pre_hooks``). Stays: no public accessor."""
    return list(module._forward_pre_hooks.values())


def storage_use_count(storage: torch.UntypedStorage) -> int:
    """How many references the C++ side holds to ``storage`` (``torch._C._storage_Use_Count``).

    checked: torch 2.10-2.13. Stays until torch exposes a public use count (none planned; torchtune's
    ``OffloadActivations`` reads the same private for the same reason: is a pinned buffer still read).
    """
    return torch._C._storage_Use_Count(storage._cdata)


def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the current backward pass ends (``Variable._execution_engine.queue_callback``).

    checked: torch 2.10-2.13. Only valid inside a backward (a hook or an autograd Function's backward).
    Stays: no public equivalent (pytorch/pytorch#102356 asks for one; FSDP uses this private too).
    """
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def grouped_mm_function() -> Callable | None:
    """``torch.nn.functional.grouped_mm`` (public from torch 2.10; pyproject's floor is torch>=2.11), or None where
    the build has none (then routing takes its loop path). checked: torch 2.11 (the GPU machine), 2.13. The private
    ``torch._grouped_mm`` of torch 2.8-2.9 is no longer reached: dead under the declared floor. Can go when every
    supported build has ``F.grouped_mm`` on every device (routing.py would then call it directly).
    """
    return getattr(F, "grouped_mm", None)


_AUTOGRAD_KEYS = ("AutogradFunctionality", "AutogradOther", "AutogradCPU", "AutogradCUDA", "AutogradNestedTensor",
                  "ADInplaceOrView")


@contextlib.contextmanager
def autograd_in_operator() -> Iterator[None]:
    """Record autograd inside the kernel of a ``torch.library`` custom operator (which runs with the autograd
    dispatch keys excluded): lets an operator's backward recompute its forward under autograd.

    checked: torch 2.13 (``torch._C._ForceDispatchKeyGuard``, ``_dispatch_tls_local_*_set``; the keys that do not
    exist in a build are skipped). ``torch.func.vjp`` would do it publicly, but not through an
    ``autograd.Function`` without ``setup_context`` (flash-attn's varlen function). Can go when torch.library
    offers a public way to differentiate inside an operator.
    """
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for name in _AUTOGRAD_KEYS:
        key = getattr(torch._C.DispatchKey, name, None)
        if key is not None:
            exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        yield


__all__ = ["autograd_in_operator", "forward_pre_hooks", "grouped_mm_function", "module_dicts",
           "queue_backward_callback", "storage_use_count"]


# nn.Module.compile(**options) sets ``_compiled_call_impl = torch.compile(self._call_impl, **options)``, which
# ``__call__`` then runs; it has no public way to undo it or to ask whether a module is compiled. checked: torch
# 2.13. Stays while nn.Module.compile is the only in-place compile (fastkit.training.compile sets the same attribute
# through a Swapper, so fastkit.revert takes it back).
COMPILED_CALL_ATTR = "_compiled_call_impl"
COMPILE_NOTE_ATTR = "fastkit_compiled"
"""The model's attribute (set by fastkit.training.compile, revertible) saying what is compiled: the summary's line."""


def compiled_call(module: torch.nn.Module) -> Callable | None:
    """The compiled call ``module.__call__`` runs (``nn.Module.compile``'s), or None when it is not compiled."""
    return getattr(module, COMPILED_CALL_ATTR, None)


def eager_call(module: torch.nn.Module, *args, **kwargs):
    """``module``'s call as ``__call__`` runs it when not compiled (hooks included), bypassing a compiled call."""
    return module._call_impl(*args, **kwargs)


def compile_call(module: torch.nn.Module, **options) -> Callable:
    """``torch.compile`` of ``module``'s call, what ``nn.Module.compile(**options)`` stores (not stored here)."""
    return torch.compile(module._call_impl, **options)


def with_tensors(module: torch.nn.Module, tensors: dict[str, torch.Tensor]):
    """Context manager: ``module``'s parameters / buffers named in ``tensors`` replaced by them for its duration,
    without calling the module (``torch.func.functional_call`` would call it: its instance forward, not the one
    the caller wants to run). checked: torch 2.13 (``torch.nn.utils.stateless._reparametrize_module``, what
    ``functional_call`` uses). Can go when torch offers the reparametrization alone publicly."""
    return torch.nn.utils.stateless._reparametrize_module(module, tensors)
