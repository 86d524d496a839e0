"""GGUF rules of the hybrid families, whose recurrent layers (short convolutions, SSM / linear-attention state)
sit beside attention layers: LFM2 (llama.cpp's ``lfm2``: short convolutions), Qwen3-Next (``qwen3next``: gated
DeltaNet, gated attention, MoE), Qwen3.5 (``qwen35`` / ``qwen35moe``: the same DeltaNet, value heads tiled) and
Falcon-H1 / Granite 4.0-H / Nemotron-H (``falcon-h1``, ``granitehybrid``, ``nemotron_h``: Mamba2 beside attention).
Each rule is a field of the family's :class:`fastkit.registry.GGUFRules`; :mod:`fastkit.export.gguf.writer` calls the
functions here while it checks, plans and writes a file.

What must not change: llama.cpp (src/models/lfm2.cpp, qwen3next.cpp, qwen35(moe).cpp, falcon-h1.cpp,
granite-hybrid.cpp, nemotron-h.cpp) reproduces the transformers model's tokens, greedy text and logits from the file
(tests/test_llamacpp_round_trip.py), with prompts long enough that the recurrent state carries across many tokens, and
what it cannot compute is refused before anything is written.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from fastkit import registry
from fastkit.errors import FastkitError

CONV_KERNELS = ("shortconv.conv", "ssm_conv1d")
"""llama.cpp tensors of a depthwise causal convolution: ``ggml_ssm_conv`` reads them as ``(channels, kernel)`` in
f32 (llama-quant.cpp never quantizes them; its converter writes them f32)."""


def _squeeze_conv(w: torch.Tensor) -> torch.Tensor:
    return w.reshape(w.shape[0], w.shape[-1])  # nn.Conv1d depthwise (C, 1, K) -> (C, K)


def transform(gguf_name: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """How a tensor llama.cpp names ``gguf_name`` is laid out from transformers' (None: as is)."""
    if gguf_name.endswith(tuple(f"{kernel}.weight" for kernel in CONV_KERNELS)):  # not their biases
        return _squeeze_conv
    return None


def kv_heads(config, rules: registry.GGUFRules, heads: int) -> int | list[int]:
    """``head_count_kv`` as the family's graph reads it: per layer, 0 on recurrent layers
    (:attr:`GGUFRules.kv_heads_by_layer`), else the one count."""
    if not rules.kv_heads_by_layer:
        return heads
    attr, attention = rules.kv_heads_by_layer
    return [heads if kind == attention else 0 for kind in getattr(config, attr)]


def ffn_length(config, rules: registry.GGUFRules) -> int | list[int] | None:
    """The dense MLP's width (``feed_forward_length``): ``intermediate_size``, per layer with 0 on the layers without
    the MLP (:attr:`GGUFRules.ffn_by_layer`), or Lfm2MLP's adjusted width (:attr:`GGUFRules.ffn_auto_adjust`); None
    where the config has none (every layer MoE)."""
    size = getattr(config, "intermediate_size", None)
    if rules.ffn_by_layer:
        attr, mlp = rules.ffn_by_layer
        return [size if kind == mlp else 0 for kind in getattr(config, attr)]
    if not (rules.ffn_auto_adjust and size and getattr(config, "block_auto_adjust_ff_dim", False)):
        return size
    size = int(2 * size / 3)  # as transformers' Lfm2MLP computes it (the model's truth)
    if getattr(config, "block_ffn_dim_multiplier", None) is not None:
        size = int(config.block_ffn_dim_multiplier * size)
        multiple = config.block_multiple_of
        size = multiple * ((size + multiple - 1) // multiple)
    return size


def config_product(config, expr: str) -> int:
    """A config integer, or the product of several (``"mamba_n_heads·mamba_d_head"``); an attribute set to None
    counts 0 (ERNIE 4.5 without shared experts: ``moe_num_shared_experts`` None)."""
    out = 1
    for attr in expr.split("·"):
        out *= int(getattr(config, attr) or 0)
    return out


def check(config, model_type: str, rules: registry.GGUFRules) -> None:
    """What the family's llama.cpp graph takes as equal (:attr:`GGUFRules.same`), refused before any work."""
    arch = registry.gguf_row(model_type).gguf_arch
    if rules.layer_kinds:
        attr, kinds = rules.layer_kinds
        if other := sorted(set(getattr(config, attr)) - set(kinds)):
            raise FastkitError(f"save_gguf: {model_type} with config.{attr} holding {other}: llama.cpp's {arch} graph "
                               f"computes only {list(kinds)} layers; this model cannot be expressed in GGUF as is.")
    if rules.split_delta:
        _check_sections(config, model_type, arch)
    for a, b in rules.same:
        if config_product(config, a) != config_product(config, b):
            raise FastkitError(f"save_gguf: {model_type} with config.{a}={config_product(config, a)} and config.{b}="
                               f"{config_product(config, b)}: llama.cpp's {arch} graph reads both from one value; this "
                               "model cannot be expressed in GGUF as is.")


def _sections(config) -> list[int]:
    """Qwen3.5's M-RoPE sections (rotary pairs per position stream), 4 as llama.cpp reads them."""
    sections = list(dict(getattr(config, "rope_parameters", None) or {}).get("mrope_section", [11, 11, 10]))
    return [*sections, 0, 0, 0, 0][:4]


def _check_sections(config, model_type: str, arch: str) -> None:
    """ggml's M-RoPE asserts (aborting the process) unless the sections fit in the rotary dims."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = dict(getattr(config, "rope_parameters", None) or {})
    rotary = int(head_dim * (rope.get("partial_rotary_factor") or 1.0))
    if 2 * sum(_sections(config)) > rotary:
        raise FastkitError(f"save_gguf: {model_type} with rope mrope_section={_sections(config)[:3]} over {rotary} "
                           f"rotary dims: llama.cpp's {arch} rope needs the sections within the rotary pairs "
                           f"({rotary // 2}); this model cannot be expressed in GGUF as is.")


def add_kv(writer, config, arch: str, rules: registry.GGUFRules) -> None:
    """The recurrent layers' hyperparameters the family's llama.cpp graph reads."""
    if rules.recurrent_layers:
        attr, recurrent = rules.recurrent_layers
        writer.add_array(f"{arch}.attention.recurrent_layers", [kind == recurrent for kind in getattr(config, attr)])
    if rules.gated_delta:
        writer.add_ssm_conv_kernel(int(config.linear_conv_kernel_dim))
        writer.add_ssm_state_size(int(config.linear_key_head_dim))
        writer.add_ssm_group_count(int(config.linear_num_key_heads))
        writer.add_ssm_time_step_rank(int(config.linear_num_value_heads))
        writer.add_ssm_inner_size(int(config.linear_value_head_dim * config.linear_num_value_heads))
    if rules.mamba2:
        conv, inner, state, heads, groups = (config_product(config, expr) for expr in rules.mamba2_sizes)
        writer.add_ssm_conv_kernel(conv)
        writer.add_ssm_inner_size(inner)
        writer.add_ssm_state_size(state)
        writer.add_ssm_time_step_rank(heads)
        writer.add_ssm_group_count(groups)
    if rules.rope_switch:
        writer.add_rope_scaling_finetuned(getattr(config, rules.rope_switch) == "rope")
    if rules.split_delta:  # llama.cpp's qwen35 requires them; text positions make them plain rope
        writer.add_rope_dimension_sections(_sections(config))


def _neg_exp(w: torch.Tensor) -> torch.Tensor:
    return -torch.exp(w)  # A_log -> A (the decay rate llama.cpp multiplies by)


def _qkvz(config) -> tuple[Callable, Callable]:
    """``in_proj_qkvz`` ``(Nk·(2·hk + 2·r·hv), H)``, per key head ``[q, k, v, z]`` -> ``attn_qkv`` (every head's q,
    then k, then v) and ``attn_gate`` (z), as llama.cpp's converter reorders it."""
    nk, hk = config.linear_num_key_heads, config.linear_key_head_dim
    rv = config.linear_num_value_heads // nk * config.linear_value_head_dim  # value width per key head

    def parts(w: torch.Tensor) -> list[torch.Tensor]:
        per_head = w.reshape(nk, 2 * hk + 2 * rv, w.shape[-1])  # (Nk, 2hk + 2rv, H)
        return list(per_head.split([hk, hk, rv, rv], dim=1))  # q, k (Nk, hk, H); v, z (Nk, rv, H)

    def qkv(w: torch.Tensor) -> torch.Tensor:
        q, k, v, _ = parts(w)
        return torch.cat([t.reshape(-1, w.shape[-1]) for t in (q, k, v)])  # (Nk·(2hk + rv), H)

    def z(w: torch.Tensor) -> torch.Tensor:
        return parts(w)[3].reshape(-1, w.shape[-1]).contiguous()  # (Nk·rv, H)

    return qkv, z


def _tiled(config, width: int, dim: int = 0, skip: int = 0) -> Callable[[torch.Tensor], torch.Tensor]:
    """Value heads (``width`` values each) along ``dim``, after ``skip`` leading entries, from grouped by key head
    ``(Nk, r, width)`` to tiled ``(r, Nk, width)`` (:attr:`GGUFRules.split_delta`)."""
    nk = config.linear_num_key_heads
    r = config.linear_num_value_heads // nk

    def fn(w: torch.Tensor) -> torch.Tensor:
        w = w.movedim(dim, 0)
        head, v = w[:skip], w[skip:]
        v = v.reshape(nk, r, width, *v.shape[1:]).transpose(0, 1).reshape(v.shape)  # (Nk, r, d, ...) -> (r, Nk, d, ...)
        return torch.cat([head, v]).movedim(0, dim).contiguous()

    return fn


def _split_delta(leaf: str, config) -> tuple[str, Callable] | None:
    """Qwen3.5's DeltaNet tensor ``leaf`` as llama.cpp's name and layout (value heads tiled)."""
    hv, qk = config.linear_value_head_dim, 2 * config.linear_num_key_heads * config.linear_key_head_dim
    neg_exp_tiled = _tiled(config, 1)
    table = {"in_proj_qkv.weight": ("attn_qkv.weight", _tiled(config, hv, skip=qk)),  # (2·Nk·hk + Nv·hv, H)
             "in_proj_z.weight": ("attn_gate.weight", _tiled(config, hv)),  # (Nv·hv, H)
             "in_proj_b.weight": ("ssm_beta.weight", _tiled(config, 1)),  # (Nv, H)
             "in_proj_a.weight": ("ssm_alpha.weight", _tiled(config, 1)),
             "A_log": ("ssm_a", lambda w: neg_exp_tiled(_neg_exp(w))),  # (Nv,)
             "dt_bias": ("ssm_dt.bias", _tiled(config, 1)),
             "conv1d.weight": ("ssm_conv1d.weight", lambda w: _tiled(config, hv, skip=qk)(_squeeze_conv(w))),
             "norm.weight": ("ssm_norm.weight", None),  # (hv,): shared by every head
             "out_proj.weight": ("ssm_out.weight", _tiled(config, hv, dim=1))}  # (H, Nv·hv): its columns
    return table.get(leaf)


def _column(w: torch.Tensor) -> torch.Tensor:
    return w.reshape(-1, 1)  # (heads,) -> llama.cpp's {1, heads}: (heads, 1)


def _zxbcdt(config, attr: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """``in_proj`` ``(2·d_ssm + 2·G·N + heads, H)`` with each row section times its multiplier (z, x, B, C, dt)."""
    d, gn = config.mamba_d_ssm, config.mamba_n_groups * config.mamba_d_state
    sizes = [d, d, gn, gn, config.mamba_n_heads]

    def fn(w: torch.Tensor) -> torch.Tensor:
        scale = torch.cat([torch.full((n,), float(m)) for n, m in zip(sizes, getattr(config, attr), strict=True)])
        return w * scale.to(w.device)[:, None]  # (rows, H) x (rows, 1)

    return fn


def _mamba2(leaf: str, config, rules: registry.GGUFRules) -> tuple[str, Callable | None] | None:
    groups = config_product(config, rules.mamba2_sizes[4])
    table = {"A_log": ("ssm_a", lambda w: _column(_neg_exp(w))), "D": ("ssm_d", _column),
             "dt_bias": ("ssm_dt.bias", None),
             "norm.weight": ("ssm_norm.weight", lambda w: w.reshape(groups, -1)),  # (d,) -> (G, d / G)
             "in_proj.weight": ("ssm_in.weight", _zxbcdt(config, rules.zxbcdt) if rules.zxbcdt else None)}
    return table.get(leaf)


def _value(config, expr: str) -> float:
    """A config value named ``"attr"`` or ``"attr[i]"``."""
    m = re.fullmatch(r"(\w+)(?:\[(\d+)\])?", expr)
    value = getattr(config, m[1])
    return float(value[int(m[2])] if m[2] is not None else value)


def scaled(gguf_name: str, fn: Callable | None, config, rules: registry.GGUFRules) -> Callable | None:
    """``fn`` followed by the tensor's multipliers (:attr:`GGUFRules.weight_scales`)."""
    factors = next((values for suffix, values in rules.weight_scales  # whole name parts: attn_output is not output
                    if gguf_name == suffix or gguf_name.endswith(f".{suffix}")), ())
    if not factors:
        return fn
    scale = 1.0
    for expr in factors:
        scale *= _value(config, expr)
    return lambda w, f=fn: (f(w) if f else w) * scale


def pieces(hf_name: str, config, rules: registry.GGUFRules) -> list[tuple[str, Callable | None]]:
    """llama.cpp tensors of one gated DeltaNet / Mamba2 tensor (:attr:`GGUFRules.gated_delta`,
    :attr:`GGUFRules.mamba2`) that gguf-py's map does not name or lay out; ``[]`` for any other."""
    for pattern, name in rules.exact_names:
        if re.fullmatch(pattern, hf_name):
            return [(re.sub(pattern, name, hf_name), None)]
    if rules.mamba2 and (m := re.fullmatch(rf".*\.layers\.(\d+)\.{rules.mamba2_module}\.(.+)", hf_name)):
        found = _mamba2(m[2], config, rules)
        return [(f"blk.{m[1]}.{found[0]}", found[1])] if found else []
    m = re.fullmatch(r".*\.layers\.(\d+)\.linear_attn\.(.+)", hf_name)
    if m is None or not rules.gated_delta:
        return []
    blk, leaf = f"blk.{m[1]}", m[2]
    if rules.split_delta:
        found = _split_delta(leaf, config)
        return [(f"{blk}.{found[0]}", found[1])] if found else []
    if leaf == "in_proj_qkvz.weight":
        qkv, z = _qkvz(config)
        return [(f"{blk}.attn_qkv.weight", qkv), (f"{blk}.attn_gate.weight", z)]
    plain = {"in_proj_ba.weight": ("ssm_ba.weight", None), "conv1d.weight": ("ssm_conv1d.weight", _squeeze_conv),
             "dt_bias": ("ssm_dt.bias", None), "A_log": ("ssm_a", _neg_exp),
             "norm.weight": ("ssm_norm.weight", None), "out_proj.weight": ("ssm_out.weight", None)}
    if leaf not in plain:
        return []
    name, fn = plain[leaf]
    return [(f"{blk}.{name}", fn)]


__all__ = ["CONV_KERNELS", "add_kv", "check", "config_product", "ffn_length", "kv_heads", "pieces", "scaled",
           "transform"]
