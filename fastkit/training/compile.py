"""``torch.compile`` for a fastkit run: ``TrainOptions.compile`` = ``off`` / ``regions`` / ``model``.

What it replaces. transformers' ``TrainingArguments.torch_compile`` (TRL's ``--torch-compile``) hands the model to
accelerate, which compiles the whole wrapped model once training starts; its backend / mode come from
``torch_compile_backend`` / ``torch_compile_mode``. fastkit owns the choice instead, so one option says what
compiles and the dashboard can keep compile time out of the rates:

- ``regions``: each decoder layer compiled: every layer has the same code, so dynamo traces one and reuses it for
  the others (fast to compile). A layer without checkpointing gets ``torch.compile`` of its ``_call_impl`` (what
  ``nn.Module.compile`` does). A checkpointed layer is compiled *below* its checkpoint: its checkpoint function
  (plain or fastkit's offloaded one) runs the compiled forward (:class:`CompiledBelowCheckpoint`), so the checkpoint
  and the offload hooks stay eager around it and the recompute in backward runs the compiled layer again. Compiling
  the layer's call instead would put the checkpoint inside the graph, where dynamo breaks on transformers' layer
  (a side effect inside the checkpoint: the whole layer ran eager, measured);
- ``model``: the model the trainer calls (the PEFT wrapper included) compiled as one.

TRL's ``torch_compile=True`` (and a ``torch_compile_backend`` / ``torch_compile_mode``, which turn it on in
transformers) folds into ``compile="model"`` (:func:`fold_trl_fields`); the backend and mode stay the ones given.

What must not change. ``compile="off"`` touches nothing; a compiled run's losses equal the eager run's (compile
fuses the same math; tests/test_compile_option.py); ``fastkit.revert`` puts the uncompiled call back (the compiled
calls are set through :func:`fastkit.patching.change`).
"""

from __future__ import annotations

import logging
from typing import Any

from fastkit.errors import FastkitError

logger = logging.getLogger(__name__)

CHOICES = ("off", "regions", "model")
"""``TrainOptions.compile``'s values."""
TRL_FIELDS = ("torch_compile", "torch_compile_backend", "torch_compile_mode")
"""SFTConfig fields that ask transformers to compile; fastkit's ``compile`` option takes them over."""
DEFAULT_BACKEND = "inductor"


def fold_trl_fields(compile: str, sft: dict[str, Any]) -> str:
    """``compile`` with TRL's compile fields in ``sft`` folded in: ``torch_compile`` True (or a backend / mode given)
    means ``compile="model"`` unless ``compile`` already says ``regions``; ``torch_compile=False`` with
    ``compile`` on is refused (two answers to one question). Backend and mode stay in ``sft`` (read by
    :func:`backend_and_mode`; never passed to SFTConfig, see :func:`sft_without`)."""
    asked = sft.get("torch_compile")
    wants = bool(asked) or any(sft.get(k) is not None for k in TRL_FIELDS[1:])
    if asked is False and compile != "off":
        raise FastkitError(f"compile={compile!r} and sft['torch_compile']=False disagree: give compile only "
                           "(off, regions or model).")
    return "model" if wants and compile == "off" else compile


def sft_without(sft: dict[str, Any]) -> dict[str, Any]:
    """``sft`` without TRL's compile fields: transformers would compile the model a second time."""
    return {k: v for k, v in sft.items() if k not in TRL_FIELDS}


def backend_and_mode(sft: dict[str, Any]) -> tuple[str, str | None]:
    """The ``torch.compile`` backend (default inductor) and mode (default None) a run's ``sft`` names."""
    return sft.get("torch_compile_backend") or DEFAULT_BACKEND, sft.get("torch_compile_mode")


def compile_model(model, how: str, backend: str = DEFAULT_BACKEND, mode: str | None = None) -> int:
    """Compile ``model`` (the module the trainer calls) as ``how`` says; returns the modules compiled (0 for off).

    Idempotent (a module compiled already is left as it is) and revertible (``fastkit.revert(model)``)."""
    from fastkit import _torch  # here, not at import: --print-config reads CHOICES without torch
    from fastkit.patches.layout import decoder_layers
    from fastkit.patches.moe import peft_wrapper
    from fastkit.patching import change, unwrap

    if how not in CHOICES:
        raise FastkitError(f"compile must be one of {', '.join(CHOICES)}, got {how!r}.")
    if how == "off":
        return 0
    targets = [model] if how == "model" else decoder_layers(model)
    if not targets:
        raise FastkitError("compile='regions' compiles each decoder layer, and this model has no decoder layers "
                           "fastkit knows: use compile='model'.")
    options = {"backend": backend, "mode": mode} if mode else {"backend": backend}
    peft_wrapper.install(model)  # a model wrapped with PEFT directly: its parameter LoRA without a graph break

    def compiled(swap) -> int:
        for module in targets:
            if _torch.compiled_call(module) is not None:  # compiled already
                continue
            if how == "regions" and _checkpointed(module):
                _compile_below_checkpoint(module, swap, options)
            elif how == "regions":  # a layer compiled alone, called from the eager model's forward
                swap.setattr(module, _torch.COMPILED_CALL_ATTR, _region_call(_torch.compile_call(module, **options)))
            else:  # what nn.Module.compile sets; __call__ runs it
                swap.setattr(module, _torch.COMPILED_CALL_ATTR, _torch.compile_call(module, **options))
        swap.setattr(unwrap(model), _torch.COMPILE_NOTE_ATTR, _describe(how, targets))  # the run's summary reads it
        return len(targets)

    count = change(model, "compile", compiled)
    logger.info("fastkit: torch.compile (%s, backend %s%s) on %d module(s)", how, backend,
                f", mode {mode}" if mode else "", count)
    return count


def _region_call(compiled):
    """A compiled region's call with transformers' output capture readable inside it
    (:func:`fastkit._hf.output_capture_for_compiled_region`)."""
    from fastkit import _hf

    def call(*args, **kwargs):
        with _hf.output_capture_for_compiled_region():
            return compiled(*args, **kwargs)

    return call


def _describe(how: str, targets: list) -> str:
    """What ``compile_model`` compiled, in the words of the run's summary."""
    if how == "model":
        return "the whole model"
    below = any(_checkpointed(layer) for layer in targets)
    return f"each decoder layer ({len(targets)}){', below its checkpoint' if below else ''}"


def _checkpointed(layer) -> bool:
    """transformers' flag: the layer runs its forward through its checkpoint function when training with grad."""
    return bool(getattr(layer, "gradient_checkpointing", False))


def _apply(function, *args):
    """``function(*args)``: what the checkpoint runs, compiled (the layer's forward is ``function``)."""
    return function(*args)


class CompiledBelowCheckpoint:
    """A checkpointed layer's checkpoint function that runs the layer's forward compiled inside the checkpoint.

    transformers calls ``checkpoint_fn(partial(forward, layer, **kwargs), *args)``; this calls
    ``checkpoint(compiled_apply, that_partial, *args)``, so what the checkpoint runs (forward and recompute) is
    one compiled function of the forward; the partial's keywords (the packed metadata among them) are its inputs."""

    def __init__(self, checkpoint, compiled_apply) -> None:
        self.checkpoint = checkpoint
        self.compiled_apply = compiled_apply

    def __call__(self, function, *args, **kwargs):
        return self.checkpoint(self.compiled_apply, function, *args, **kwargs)


def _compile_below_checkpoint(layer, swap, options) -> None:
    """Compile ``layer`` below its checkpoint (training with grad) and as a whole call otherwise (eval, no grad),
    both set through ``swap``. ``_apply``'s one code object serves every layer: one trace, reused."""
    import torch

    from fastkit import _hf, _torch

    checkpoint = _hf.checkpoint_function(layer)
    # the forward and the recompute both run the compiled region with output capture readable inside it
    below = _region_call(torch.compile(_apply, **options))
    _hf.set_checkpoint_function(layer, CompiledBelowCheckpoint(checkpoint, below), swap)
    whole_call = _region_call(_torch.compile_call(layer, **options))

    def call(*args, **kwargs):
        if _checkpointed(layer) and layer.training and torch.is_grad_enabled():  # transformers' checkpoint test
            return _torch.eager_call(layer, *args, **kwargs)  # eager checkpoint around the compiled forward
        return whole_call(*args, **kwargs)

    swap.setattr(layer, _torch.COMPILED_CALL_ATTR, call)


__all__ = ["CHOICES", "backend_and_mode", "compile_model", "fold_trl_fields", "sft_without"]
