"""NF4 for the linear layers of a model whose experts another quantizer owns (GPT-OSS: MXFP4 experts).

transformers applies one quantizer per load: GPT-OSS's MXFP4 checkpoint goes through the MXFP4 quantizer
(fastkit keeps its experts 4-bit while loading, ``patches/moe_4bit_load.py``), so bitsandbytes never sees
its attention linears, which stayed 16-bit (1.19 GiB on GPT-OSS-20B). :func:`quantize_linears_4bit`
replaces every ``nn.Linear`` inside the decoder layers (attention q/k/v/o; not the LM head, not the
embeddings, not routers or experts, which are not ``nn.Linear``) by bitsandbytes' ``Linear4bit``
(NF4, double quantization, the compute dtype given): the same layer ``BitsAndBytesConfig(load_in_4bit)``
builds, so PEFT adapts it as usual and ``fastkit.plan`` counts it as NF4. Frozen: these are base weights.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    inner = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    layers = getattr(inner, "layers", None)
    return list(layers) if isinstance(layers, torch.nn.ModuleList) else []


def _to_4bit(linear: torch.nn.Linear, compute_dtype: torch.dtype) -> torch.nn.Module:
    import bitsandbytes as bnb

    device = linear.weight.device
    q = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                          compute_dtype=compute_dtype, quant_type="nf4", compress_statistics=True, device="meta")
    q.weight = bnb.nn.Params4bit(linear.weight.data.to("cpu"), requires_grad=False, quant_type="nf4",
                                 compress_statistics=True)
    if linear.bias is not None:
        q.bias = torch.nn.Parameter(linear.bias.data.to(compute_dtype), requires_grad=False)
    return q.to(device)  # Params4bit quantizes when it moves to its device


def quantize_linears_4bit(model: torch.nn.Module, compute_dtype: torch.dtype | None = None) -> int:
    """Replace the ``nn.Linear`` layers of every decoder layer by NF4 ``Linear4bit``; returns how many."""
    compute_dtype = compute_dtype or next(model.parameters()).dtype
    count = 0
    for layer in _decoder_layers(model):
        for parent in layer.modules():
            for name, child in list(parent.named_children()):
                if type(child) is torch.nn.Linear:
                    setattr(parent, name, _to_4bit(child, compute_dtype))
                    count += 1
    logger.info("fastkit: %d linear layers stored NF4 beside the 4-bit experts", count)
    return count


__all__ = ["quantize_linears_4bit"]
