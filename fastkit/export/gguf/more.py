"""GGUF rules of the dense families added in the gguf-more round that need more than a flag in
:mod:`fastkit.export.gguf.writer`: per-layer scalars that llama.cpp reads as metadata arrays, not tensors
(:attr:`fastkit.registry.GGUFRules.layer_arrays`: Apertus's xIELU activation, src/models/apertus.cpp).

What must not change: llama.cpp reproduces the transformers model's tokens, greedy text and logits from the file
(tests/test_llamacpp_round_trip.py); a model missing a layer's value is refused before anything is written.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from fastkit import registry
from fastkit.errors import FastkitError
from fastkit.patching import unwrap


def is_layer_array(name: str, rules: registry.GGUFRules) -> bool:
    """``name`` (a cleaned transformers parameter name) is written into a metadata array, not as a tensor."""
    return any(re.search(pattern, name) for pattern, _ in rules.layer_arrays)


def _clean(name: str) -> str:
    name = re.sub(r"\.modules_to_save\.[^.]+\.", ".", name)  # PEFT wrappers, as gguf._clean
    return name.replace(".base_layer", "")


def layer_arrays(model: torch.nn.Module, rules: registry.GGUFRules) -> list[tuple[str, list[float]]]:
    """``(gguf-py writer method, one value per layer)`` for every :attr:`GGUFRules.layer_arrays` entry, read off the
    model's parameters and buffers (one scalar each)."""
    if not rules.layer_arrays:
        return []
    base = unwrap(model)
    layers = base.config.num_hidden_layers
    named = [(_clean(n), t) for n, t in [*base.named_parameters(), *base.named_buffers()]]
    out = []
    for pattern, method in rules.layer_arrays:
        values: dict[int, float] = {}
        for name, t in named:
            if re.search(pattern, name) and (m := re.search(r"\.layers\.(\d+)\.", name)):
                values[int(m[1])] = float(t.detach().float().reshape(-1)[0])
        if sorted(values) != list(range(layers)):
            raise FastkitError(f"save_gguf: {pattern!r} found in layers {sorted(values)} of {layers}; llama.cpp needs "
                               "one value per layer. Nothing was written.")
        out.append((method, [values[i] for i in range(layers)]))
    return out


def transform(gname: str, rules: registry.GGUFRules, config) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The layout change a family's tensor ``gname`` (llama.cpp's name, no suffix) needs, or None: GPT-NeoX's per-head
    fused qkv (:attr:`GGUFRules.qkv_per_head`), GPT-2's ``(in, out)`` Conv1D weights (:attr:`GGUFRules.transposed`)."""
    if rules.qkv_per_head and gname.endswith("attn_qkv"):
        return _qkv_from_heads(config.num_attention_heads)
    if gname.rpartition(".")[2] in rules.transposed:
        return _out_in
    return None


def _out_in(w: torch.Tensor) -> torch.Tensor:
    return w.transpose(0, 1).contiguous() if w.dim() == 2 else w  # Conv1D (in, out) -> (out, in); biases as they are


def _qkv_from_heads(heads: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(w: torch.Tensor) -> torch.Tensor:
        # (H·3·D, ...) -> (H, 3, D, ...) -> (3, H, D, ...) -> (3·H·D, ...)
        return w.reshape(heads, 3, w.shape[0] // heads // 3, *w.shape[1:]).transpose(0, 1).reshape(w.shape)
    return fn


def add_kv(writer, config, rules: registry.GGUFRules) -> None:
    """The booleans the family's graph reads (:attr:`GGUFRules.config_flags`), an MLP width not in intermediate_size
    (:attr:`GGUFRules.ffn_length`)."""
    for method, attr in rules.config_flags:
        getattr(writer, method)(bool(getattr(config, attr)))
    if rules.ffn_length:
        writer.add_feed_forward_length(int(getattr(config, rules.ffn_length) or 4 * config.hidden_size))


__all__ = ["add_kv", "is_layer_array", "layer_arrays", "transform"]
