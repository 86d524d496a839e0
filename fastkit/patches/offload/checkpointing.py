"""Gradient checkpointing on a model, through :mod:`fastkit.patching`: plain (transformers' own switch, recorded for
revert) or ``"offload"`` (the checkpointed layer inputs in pinned host memory, :mod:`fastkit.patches.offload.patch`).
``get_peft_model`` turns it on; ``fastkit.enable_checkpointing`` is the switch for full fine-tuning."""

from __future__ import annotations

import torch

from fastkit import _hf
from fastkit.errors import FastkitError
from fastkit.patches.offload.patch import enable_offload
from fastkit.patching import change, unwrap


def enable_checkpointing(model: torch.nn.Module, mode: bool | str = True, offload_config=None) -> str:
    """Turn on gradient checkpointing: ``True``, ``"offload"`` or ``False``. Returns the mode in effect.

    Also the switch for full fine-tuning (no LoRA): ``enable_checkpointing(model, "offload")``.
    """
    if mode not in (True, False, "offload"):
        raise FastkitError(f"use_gradient_checkpointing must be True, False or 'offload', got {mode!r}.")
    if mode is False:
        return "off"
    base = unwrap(model)

    def turn_on(swap):  # transformers' own switch, its per-layer flags and input-grad hooks recorded for revert
        swap.record(model, lambda: _hf.enable_activation_checkpointing(base))
        if hasattr(model, "enable_input_require_grads"):
            swap.record(model, model.enable_input_require_grads)

    change(base, "checkpointing", turn_on)
    if mode == "offload":
        return enable_offload(base, offload_config)
    return "checkpoint"


__all__ = ["enable_checkpointing"]
