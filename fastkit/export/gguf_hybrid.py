"""GGUF rules of the hybrid families, whose recurrent layers (short convolutions, SSM / linear-attention state)
sit beside attention layers: LFM2 (llama.cpp's ``lfm2``). Each rule is a field of the family's
:class:`fastkit.registry.GGUFRules`; :mod:`fastkit.export.gguf` calls the functions here while it checks, plans and
writes a file.

What must not change: llama.cpp (src/models/lfm2.cpp) reproduces the transformers model's tokens, greedy text and
logits from the file (tests/test_llamacpp_round_trip.py), with prompts long enough that the recurrent state carries
across many tokens, and what it cannot compute is refused before anything is written.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fastkit import registry

CONV_KERNELS = ("shortconv.conv", "ssm_conv1d")
"""llama.cpp tensors of a depthwise causal convolution: ``ggml_ssm_conv`` reads them as ``(channels, kernel)`` in
f32 (llama-quant.cpp never quantizes them; its converter writes them f32)."""


def _squeeze_conv(w: torch.Tensor) -> torch.Tensor:
    return w.reshape(w.shape[0], w.shape[-1])  # nn.Conv1d depthwise (C, 1, K) -> (C, K)


def transform(gguf_name: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """How a tensor llama.cpp names ``gguf_name`` is laid out from transformers' (None: as is)."""
    if gguf_name.endswith(CONV_KERNELS):
        return _squeeze_conv
    return None


def kv_heads(config, rules: registry.GGUFRules, heads: int) -> int | list[int]:
    """``head_count_kv`` as the family's graph reads it: per layer, 0 on recurrent layers
    (:attr:`GGUFRules.kv_heads_by_layer`), else the one count."""
    if not rules.kv_heads_by_layer:
        return heads
    attr, attention = rules.kv_heads_by_layer
    return [heads if kind == attention else 0 for kind in getattr(config, attr)]


def ffn_length(config, rules: registry.GGUFRules) -> int | None:
    """The dense MLP's width (``feed_forward_length``): ``intermediate_size``, or Lfm2MLP's adjusted width
    (:attr:`GGUFRules.ffn_auto_adjust`); None where the config has none (every layer MoE)."""
    size = getattr(config, "intermediate_size", None)
    if not (rules.ffn_auto_adjust and size and getattr(config, "block_auto_adjust_ff_dim", False)):
        return size
    size = int(2 * size / 3)  # as transformers' Lfm2MLP computes it (the model's truth)
    if getattr(config, "block_ffn_dim_multiplier", None) is not None:
        size = int(config.block_ffn_dim_multiplier * size)
        multiple = config.block_multiple_of
        size = multiple * ((size + multiple - 1) // multiple)
    return size


__all__ = ["CONV_KERNELS", "ffn_length", "kv_heads", "transform"]
