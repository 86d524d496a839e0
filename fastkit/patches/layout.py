"""Where a transformers causal LM keeps its decoder: the one lookup the patches, the census guard and the DPO pass read.

A text model's decoder stack is the attribute its ``base_model_prefix`` names (``model.model``); a vision-language
model's language model is what its ``get_decoder()`` returns (``model.model.language_model``). The packing patch
and the packed-batch guard patch the language model (``language_model=True``); the 4-bit linears and the fp16
residual stream go by the text layout alone (``language_model=False``: a vision-language wrapper has no ``layers``
of its own there, so they leave it as it is).
"""

from __future__ import annotations

import torch


def decoder(model: torch.nn.Module, language_model: bool = True) -> torch.nn.Module | None:
    """The decoder module of ``model`` (unwrapped), or None: ``get_decoder()`` first when ``language_model``, then
    the attribute ``base_model_prefix`` names."""
    inner = None
    if language_model:
        get = getattr(model, "get_decoder", None)
        inner = get() if callable(get) else None
    if inner is None:
        inner = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    return inner if isinstance(inner, torch.nn.Module) else None


def decoder_layers(model: torch.nn.Module, language_model: bool = True) -> list[torch.nn.Module]:
    """The decoder's layers (its ``layers`` ModuleList), or ``[]`` where it has none."""
    layers = getattr(decoder(model, language_model), "layers", None)
    return list(layers) if isinstance(layers, torch.nn.ModuleList) else []


__all__ = ["decoder", "decoder_layers"]
