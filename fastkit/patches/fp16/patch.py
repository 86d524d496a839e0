"""fp16 safety for bf16-trained models: the residual stream in fp32, every block computing in fp16.

What it replaces. In fp16 (a T4 has no bf16) a model trained in bf16 overflows: bf16 has fp32's range,
fp16 stops at 65,504, and the residual stream of such models grows past it over the layers ("massive
activations"), while each block's input (after its RMSNorm) and output stay small. Plain transformers
in fp16 stores the residual sum ``hidden = residual + block(norm(hidden))`` in fp16, so it becomes
``inf`` and the loss ``nan``. Measured on a twin scaled to overflow (tests/test_fp16_residual.py):
the residual stream is where it breaks first.

What this does. Each block (attention, MLP / MoE: every child of a decoder layer that is not a norm)
gets its floating inputs cast to the compute dtype (fp16, the embedding's dtype) and returns fp32, so
every residual add in every decoder layer runs in fp32 (type promotion: fp16 + fp32 -> fp32; from the
first layer's attention on, the stream is fp32) with the layer's own code unchanged; the norms read
the fp32 stream (they compute in fp32 anyway). The final norm's output returns to the compute dtype, so
the LM head, TRL's fused head and fastkit's chunked loss see what they saw before.
Attention logits in fastkit's eager per-document attention (GPT-OSS sinks) are computed in fp32 for
fp16 inputs (``patches/packing/attention.py: eager_per_doc``); SDPA / flash kernels accumulate in fp32 already.

What must not change. Results in fp32 / bf16 (the patch refuses to apply unless the embedding is fp16);
in fp16, the result equals the fp32 model's within fp16 rounding where plain fp16 gives ``inf``.
Cost: the residual stream (one ``(B, T, H)`` per layer boundary, and the checkpoints gradient
checkpointing saves) is fp32 instead of fp16: 2x those bytes (fastkit.plan counts it).
"""

from __future__ import annotations

import functools
import logging
import types

import torch

from fastkit.patches.layout import decoder

logger = logging.getLogger("fastkit")

FP16_RESIDUAL = "fp16_residual"


def _cast(x, dtype: torch.dtype):
    """Every floating tensor in ``x`` (nested tuples / lists / dicts too) cast to ``dtype``."""
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x
    if isinstance(x, (tuple, list)):
        return type(x)(_cast(v, dtype) for v in x)
    if isinstance(x, dict):
        return {k: _cast(v, dtype) for k, v in x.items()}
    return x


def _first_to(out, dtype: torch.dtype):
    """A block's output with its hidden states (the tensor, or the first item of a tuple) cast to ``dtype``."""
    if isinstance(out, torch.Tensor):
        return out.to(dtype)
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        return (out[0].to(dtype), *out[1:])
    return out


def _is_norm(module: torch.nn.Module) -> bool:
    return "norm" in type(module).__name__.lower() or isinstance(module, torch.nn.LayerNorm)


def _wrap(module: torch.nn.Module, swap, *, inputs: torch.dtype | None, output: torch.dtype | None) -> None:
    original = module.forward

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        if inputs is not None:
            args, kwargs = _cast(args, inputs), _cast(kwargs, inputs)
        out = original(*args, **kwargs)
        return out if output is None else _first_to(out, output)

    swap.setattr(module, "forward", types.MethodType(forward, module))


def _parts(model: torch.nn.Module):
    """(embedding, decoder layers, final norm) of a decoder-only LM, or None where the layout is unknown."""
    inner = decoder(model, language_model=False)
    layers = getattr(inner, "layers", None)
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    norm = getattr(inner, "norm", None)
    if not isinstance(layers, torch.nn.ModuleList) or embed is None or not isinstance(norm, torch.nn.Module):
        return None
    return embed, list(layers), norm


class Fp16ResidualPatch:
    """Patch ``"fp16_residual"`` (see the module docstring). Idempotent, revertible (fastkit.patching)."""

    name = FP16_RESIDUAL

    def check(self, model: torch.nn.Module) -> str | None:
        parts = _parts(model)
        if parts is None:
            return "no embedding / decoder layers / final norm found (layout unknown)"
        weight = getattr(parts[0], "weight", None)
        if weight is None or weight.dtype != torch.float16:
            return f"the embedding is {getattr(weight, 'dtype', None)}, not float16 (nothing to protect)"
        return None

    def apply(self, model: torch.nn.Module, swap) -> None:
        embed, layers, norm = _parts(model)
        half = embed.weight.dtype
        for layer in layers:
            for child in layer.children():
                if not _is_norm(child):  # a block: attention, MLP, MoE
                    _wrap(child, swap, inputs=half, output=torch.float32)
        _wrap(norm, swap, inputs=None, output=half)  # the head and the losses see fp16 as before


def protect_fp16(model: torch.nn.Module) -> tuple[bool, str]:
    """Apply :class:`Fp16ResidualPatch` to ``model`` (a transformers model or its PEFT wrapper)."""
    from fastkit.patching import apply_patch, unwrap

    return apply_patch(unwrap(model), Fp16ResidualPatch())


def protect_fp16_compute(model: torch.nn.Module, config, dtype: torch.dtype) -> None:
    """fp16 compute of a checkpoint not saved in fp16 (bf16-trained: fp16 overflows its residual stream):
    keep the residual stream in fp32 (:func:`protect_fp16`), and say so in the load report (``FastModel`` calls it
    after loading)."""
    saved = getattr(config, "dtype", None)  # transformers >= 4.56: torch_dtype is a (warning) alias of dtype
    if dtype != torch.float16 or saved in (torch.float16, "float16"):
        return
    from fastkit.patching import report

    ok, how = protect_fp16(model)
    rep = report(model)
    if rep is not None:
        (rep.active if ok else rep.skipped)[FP16_RESIDUAL] = how
    logger.info("fastkit: fp16 residual stream in fp32 (checkpoint saved as %s): %s", saved, how)


__all__ = ["FP16_RESIDUAL", "Fp16ResidualPatch", "protect_fp16", "protect_fp16_compute"]
