"""NF4 for the linear layers of a model whose experts another quantizer owns (GPT-OSS: MXFP4 experts).

transformers applies one quantizer per load: GPT-OSS's MXFP4 checkpoint goes through the MXFP4 quantizer
(fastkit keeps its experts 4-bit while loading, ``patches/moe/loading.py``), so bitsandbytes never sees
its attention linears, which stayed 16-bit (1.19 GiB on GPT-OSS-20B). :func:`quantize_linears_4bit`
replaces every ``nn.Linear`` inside the decoder layers (attention q/k/v/o; not the LM head, not the
embeddings, not routers or experts, which are not ``nn.Linear``) by bitsandbytes' ``Linear4bit``
(NF4, double quantization, the compute dtype given): the same layer ``BitsAndBytesConfig(load_in_4bit)``
builds, so PEFT adapts it as usual and ``fastkit.plan`` counts it as NF4. Frozen: these are base weights.

The swap is a :func:`fastkit.patching.change` (``"4bit_linears"``): ``fastkit.revert`` puts the very
``nn.Linear`` objects (and their weight ``Parameter`` objects) back, holding the NF4 layer's dequantized
values. The 16-bit values themselves are not kept while quantized (that is the memory saved), as for the
4-bit experts (``nf4.quantize_experts``).
"""

from __future__ import annotations

import logging

import torch

from fastkit.patches.layout import decoder_layers
from fastkit.patching import Swapper, change

logger = logging.getLogger(__name__)


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


def _dequantized(q: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    import bitsandbytes.functional as bf

    return bf.dequantize_4bit(q.weight.data, q.weight.quant_state).to(dtype)  # (out, in)


def _swap_in(parent: torch.nn.Module, name: str, linear: torch.nn.Linear, q: torch.nn.Module, swap: Swapper) -> None:
    """``parent.<name> = q`` through ``swap``; ``linear`` keeps its objects but drops its 16-bit values, which
    revert refills from ``q`` (newest first: refilled, then put back). The weight and ``q`` are the undo's
    arguments, not a closure's: a deepcopy's revert refills the copy's weight, not the original's."""
    swap.setattr(parent, name, q)
    weight = linear.weight
    dtype = weight.dtype
    weight.data = torch.empty(0, dtype=dtype, device=weight.device)  # q holds the values now (NF4)
    swap.on_undo(_refill, weight, q, dtype)


def _refill(weight: torch.nn.Parameter, q: torch.nn.Module, dtype: torch.dtype) -> None:
    weight.data = _dequantized(q, dtype)


def _quantize_all(model: torch.nn.Module, compute_dtype: torch.dtype, swap: Swapper) -> int:
    count = 0
    for layer in decoder_layers(model, language_model=False):
        for parent in layer.modules():
            for name, child in list(parent.named_children()):
                if type(child) is torch.nn.Linear:
                    _swap_in(parent, name, child, _to_4bit(child, compute_dtype), swap)
                    count += 1
    return count


def quantize_linears_4bit(model: torch.nn.Module, compute_dtype: torch.dtype | None = None) -> int:
    """Replace the ``nn.Linear`` layers of every decoder layer by NF4 ``Linear4bit``; returns how many.

    Recorded as the change ``"4bit_linears"``: ``fastkit.revert(model)`` restores the ``nn.Linear`` modules.
    """
    compute_dtype = compute_dtype or next(model.parameters()).dtype
    count = change(model, "4bit_linears", lambda swap: _quantize_all(model, compute_dtype, swap))
    logger.info("fastkit: %d linear layers stored NF4 beside the 4-bit experts", count)
    return count


__all__ = ["quantize_linears_4bit"]
