"""Stateful layers as one operator ``torch.compile`` sees once: ``fastkit::per_document_mixer``.

What it replaces. Eager fastkit runs a stateful module (a gated DeltaNet, a short convolution, a Mamba mixer) on
each packed document alone by regrouping the tokens from the host lengths (:mod:`fastkit.patches.packing.state`):
how many row groups, each of how many documents and how long, are Python ints of the batch. Traced by dynamo,
those ints become constants of the graph (a recompile per layout) and the state context and the per-module log
break it (6-7 breaks in a 2-layer hybrid twin).

What it does. While dynamo traces, the module's packed forward becomes one call of this operator with the layout as
the host tensor ``cu`` (as ``fastkit::packed_attention`` takes it, packing/compiled.py), the hidden states and the
module's own tensors (trainable ones apart: they get gradients). At run time the operator rebuilds the layout,
and runs the module's unchanged forward per document exactly as eager fastkit does (the same regroup, or the CUDA
varlen kernels where eager takes them), the module's tensors swapped for the ones it was given
(``fastkit._torch.with_tensors``, what ``torch.func.functional_call`` does without calling the module). Its backward
is a second operator that recomputes the module under autograd and returns the gradients of the hidden states and of
the trainable tensors: one more forward of each stateful module in backward, the price of keeping the
data-dependent regroup out of the compiler's sight (the attention operator pays the same).

The module is found by a key stored on it when the patch applies (its class, its decoder and a hash of its
structure), equal for the modules of one structure, so a layer compiled once (``compile="regions"``) serves them all
without a guard on which layer it is; at run time the module of the key whose own tensors the call was given runs
(its settings, e.g. PEFT's per-layer scaling, are its own). A trainable tensor the module never uses (Jamba's mixer
reads ``dt_proj.weight`` itself, bypassing a LoRA there) gets a zero gradient, where eager leaves none.

Dropout inside the module in training (a LoRA dropout on its projections) would draw another mask in the recompute:
such a module keeps the eager regroup under compile (exact, with its graph breaks).

What must not change: outputs and every gradient equal eager fastkit's per-document path (the same code on the same
values); a module whose call carries tensors other than the hidden states keeps the eager path.
"""

from __future__ import annotations

import ast
import hashlib
import weakref
from collections.abc import Callable

import torch

from fastkit import _torch
from fastkit.errors import FastkitError
from fastkit.patching import Swapper

KEY_ATTR = "_fastkit_mixer_key"
"""The stateful module's key into :data:`_MODULES` (set by :func:`register`)."""
ORIGINAL_ATTR = "_fastkit_mixer_original"
"""The module's forward from before the packing patch (what runs on each document)."""
_MODULES: dict[str, list[weakref.ref]] = {}
"""key -> the modules of that key (the one whose tensors a call was given runs it: :func:`_module`)."""
_FOUND: dict[tuple[str, int], weakref.ref] = {}
"""(key, the first given tensor's data pointer) -> the module :func:`_module` found for it."""
_RUN: dict[str, Callable] = {}
"""key -> ``run(original, hidden, rest)``: the eager packed path of that module (set by :func:`register`)."""
_SCALARS = (bool, int, float, str, type(None))


def _settings(module: torch.nn.Module) -> list[str]:
    """The plain settings of every submodule (not ``layer_idx``: it only addresses a cache, never passed here)."""
    out = []
    for name, sub in module.named_modules():
        plain = {k: v for k, v in vars(sub).items() if not k.startswith("_") and k not in ("layer_idx", "training")
                 and (isinstance(v, _SCALARS) or (isinstance(v, dict) and all(isinstance(x, _SCALARS)
                                                                               for x in v.values())))}
        out.append(f"{name}:{type(sub).__qualname__}:{sorted(plain.items(), key=lambda kv: kv[0])!r}")
    return out


def structure_key(module: torch.nn.Module, owner: torch.nn.Module) -> str:
    """``Class-<owner id>-<hash>``: equal for modules of one model with the same structure and settings."""
    parts = _settings(module) + [f"{n}:{tuple(t.shape)}:{t.dtype}" for n, t in _tensors(module)]
    digest = hashlib.sha1("\n".join(parts).encode()).hexdigest()[:12]
    return f"{type(module).__name__}-{id(owner):x}-{digest}"


def register(module: torch.nn.Module, owner: torch.nn.Module, run: Callable, original: Callable,
             swap: Swapper) -> str:
    """Give ``module`` its key and its own forward (kept on it: revert removes them) and make it the one the operator
    runs for that key; ``run(original, hidden, rest, meta)`` is its eager packed path."""
    key = structure_key(module, owner)
    _MODULES[key] = [r for r in _MODULES.get(key, []) if r() is not None and r() is not module] + [weakref.ref(module)]
    _RUN[key] = run
    swap.setattr(module, KEY_ATTR, key)
    swap.setattr(module, ORIGINAL_ATTR, original)
    return key


def _tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(module.named_parameters()) + list(module.named_buffers())


def _module(key: str, given: list[torch.Tensor]) -> torch.nn.Module:
    """The module of ``key`` whose own tensors are ``given`` (same storage: the compiled graph passes the parameters
    themselves, the backward their detached aliases); settings such as PEFT's per-layer scaling are read off it.
    Found once per tensor storage (:data:`_FOUND`, checked on every use: a module moved since is looked up again)."""
    live = [m for m in (r() for r in _MODULES.get(key, [])) if m is not None]
    if not live:
        raise FastkitError(f"fastkit::per_document_mixer: no live module for {key!r} (the model it was compiled for "
                           "is gone); compile the model you train again.")
    if not given:
        return live[0]
    first = given[0]
    found = _FOUND.get((key, first.data_ptr()), lambda: None)()
    for module in ([found] if found is not None else []) + live:
        trainable, frozen = _split(module)
        own = (trainable or frozen)[0]  # what the call's ``given[0]`` is (traced_call passes them so)
        if own.data_ptr() == first.data_ptr() and own.shape == first.shape:
            _FOUND[(key, first.data_ptr())] = weakref.ref(module)
            return module
    raise FastkitError(f"fastkit::per_document_mixer: the tensors given are none of {key!r}'s modules' own (moved or "
                       "copied after compiling?); compile the model you train again.")


def _call(key: str, hidden: torch.Tensor, cu: torch.Tensor, trainable: list[torch.Tensor],
          frozen: list[torch.Tensor], rest_json: str) -> torch.Tensor:
    """The eager packed path of ``key``'s module on ``hidden``, with the tensors given in place of its own."""
    from fastkit.patches.packing.compiled import batch_from_cu

    module = _module(key, trainable or frozen)
    own = _tensors(module)  # (name, tensor), trainable and frozen in the order _split gives them
    names = [n for n, t in own if t.requires_grad] + [n for n, t in own if not t.requires_grad]
    if (sum(t.requires_grad for _, t in own), len(own)) != (len(trainable), len(trainable) + len(frozen)):
        raise FastkitError(f"fastkit::per_document_mixer: {type(module).__name__}'s trainable / frozen tensors are not "
                           f"the {len(trainable)} / {len(frozen)} the call gave (requires_grad changed after "
                           "compiling?); compile the model you train again.")
    params = dict(zip(names, [*trainable, *frozen], strict=True))
    meta = batch_from_cu(cu, hidden.shape[0], hidden.shape[1])
    rest = decode_rest(rest_json)
    original = module.__dict__[ORIGINAL_ATTR]  # the module's own forward, bound to ``module``
    with _torch.with_tensors(module, params):
        out = _RUN[key](original, hidden, rest, meta)
    if out.shape != hidden.shape:
        raise FastkitError(f"{type(module).__name__}: output {tuple(out.shape)} is not shaped as its input "
                           f"{tuple(hidden.shape)}; fastkit's compiled per-document operator cannot run it.")
    return out


def _split(module: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(trainable tensors, frozen tensors)`` of ``module`` in :func:`_tensors` order."""
    tensors = [t for _, t in _tensors(module)]
    return [t for t in tensors if t.requires_grad], [t for t in tensors if not t.requires_grad]


@torch.library.custom_op("fastkit::per_document_mixer", mutates_args=())
def per_document_mixer(hidden: torch.Tensor, cu: torch.Tensor, trainable: list[torch.Tensor],
                       frozen: list[torch.Tensor], key: str, rest_json: str) -> torch.Tensor:
    """``key``'s stateful module on each document of host ``cu`` alone: hidden ``(B, T, H)`` -> ``(B, T, H)``."""
    out = _call(key, hidden, cu, trainable, frozen, rest_json).contiguous()
    return out if out.data_ptr() != hidden.data_ptr() else out.clone()  # never an alias of an input


@per_document_mixer.register_fake
def _(hidden, cu, trainable, frozen, key, rest_json):
    return hidden.new_empty(hidden.shape)


@torch.library.custom_op("fastkit::per_document_mixer_backward", mutates_args=())
def per_document_mixer_backward(grad: torch.Tensor, hidden: torch.Tensor, cu: torch.Tensor,
                                trainable: list[torch.Tensor], frozen: list[torch.Tensor], key: str,
                                rest_json: str) -> list[torch.Tensor]:
    """``[d hidden, *d trainable]``: the module recomputed per document under autograd."""
    with _torch.autograd_in_operator():
        leaves = [hidden.detach().requires_grad_()] + [t.detach().requires_grad_() for t in trainable]
        out = _call(key, leaves[0], cu, leaves[1:], [t.detach() for t in frozen], rest_json)
        grads = torch.autograd.grad(out, leaves, grad, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g.contiguous() for g, x in zip(grads, leaves, strict=True)]


@per_document_mixer_backward.register_fake
def _(grad, hidden, cu, trainable, frozen, key, rest_json):
    return [hidden.new_empty(hidden.shape)] + [t.new_empty(t.shape) for t in trainable]


def _setup_context(ctx, inputs, output):
    hidden, cu, trainable, frozen, key, rest_json = inputs
    ctx.save_for_backward(hidden, cu, *trainable, *frozen)
    ctx.sizes, ctx.args = (len(trainable), len(frozen)), (key, rest_json)


def _backward(ctx, grad):
    hidden, cu, *tensors = ctx.saved_tensors
    n = ctx.sizes[0]
    grads = per_document_mixer_backward(grad, hidden, cu, tensors[:n], tensors[n:], *ctx.args)
    return grads[0], None, list(grads[1:]), [None] * ctx.sizes[1], None, None


per_document_mixer.register_autograd(_backward, setup_context=_setup_context)


def traced_call(module: torch.nn.Module, hidden: torch.Tensor, rest: dict, cu: torch.Tensor) -> torch.Tensor | None:
    """The operator call a traced packed forward makes; None where it cannot (the eager path runs: it breaks)."""
    key = module.__dict__.get(KEY_ATTR)
    if key is None or not all(isinstance(v, _SCALARS) for v in rest.values()):
        return None
    if module.training and any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in module.modules()):
        return None  # the backward's recompute would draw another mask: the eager regroup runs (a graph break)
    trainable, frozen = _split(module)
    return torch.ops.fastkit.per_document_mixer(hidden, cu, trainable, frozen, key, encode_rest(rest))


def encode_rest(rest: dict) -> str:
    """The call's other (scalar) arguments as one string constant: ``name=repr;...`` (dynamo folds it)."""
    return ";".join(f"{k}={v!r}" for k, v in sorted(rest.items()))


def decode_rest(text: str) -> dict:
    """:func:`encode_rest` undone."""
    pairs = (item.split("=", 1) for item in text.split(";") if item)
    return {k: ast.literal_eval(v) for k, v in pairs}


__all__ = ["KEY_ATTR", "per_document_mixer", "register", "structure_key", "traced_call"]
