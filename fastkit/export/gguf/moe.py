"""GGUF rules of the MoE / MLA families beyond the Qwen / Mixtral / GPT-OSS layouts: OLMoE, GraniteMoE(Shared),
ERNIE-4.5 MoE (``ernie4_5-moe``: leading dense layers, shared experts, softmax routing with a selection bias),
DeepSeek-V2 / V3 and GLM-4.7-Flash (llama.cpp's ``deepseek2``: multi-head latent attention, leading dense layers,
shared experts, sigmoid routing with a selection bias, expert groups, YaRN), GLM-4.5 and Solar Open (``glm4moe``),
MiniMax-M2 (``minimax-m2``). Each rule is a field of the family's :class:`fastkit.registry.GGUFRules`;
:mod:`fastkit.export.gguf.writer` calls the functions here while it checks, plans and writes a file.

What must not change: llama.cpp (src/models/deepseek2.cpp, glm4-moe.cpp, olmoe.cpp, granite.cpp, minimax-m2.cpp,
ernie4-5-moe.cpp, and ``build_moe_ffn`` in src/llama-graph.cpp) reproduces the transformers model's tokens, greedy
text and logits from the file (tests/test_llamacpp_round_trip.py), and what it cannot compute is refused before
anything is written.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from fastkit import registry
from fastkit.errors import FastkitError
from fastkit.export.gguf.hybrid import config_product
from fastkit.patching import unwrap

_GATING = {"softmax": "SOFTMAX", "sigmoid": "SIGMOID"}
"""``GGUFRules.gating`` -> gguf-py's ``ExpertGatingFuncType`` member."""


def renamed(name: str, rules: registry.GGUFRules) -> str:
    """A transformers tensor name in the spelling gguf-py's map knows (:attr:`GGUFRules.renames`)."""
    for pattern, replacement in rules.renames:
        name = re.sub(pattern, replacement, name)
    return name


def buffer_tensors(model: torch.nn.Module, rules: registry.GGUFRules) -> list[tuple[str, Callable, torch.Size]]:
    """``(name, load, shape)`` of the buffers the family writes as tensors (:attr:`GGUFRules.buffers`)."""
    if not rules.buffers:
        return []
    out = []
    for name, b in unwrap(model).named_buffers():
        if name.rpartition(".")[2] in rules.buffers:
            out.append((name, lambda b=b: b.detach().float().cpu(), b.shape))  # named as in the model
    return out


def dense_lead(config, rules: registry.GGUFRules) -> int:
    """How many leading layers have a dense MLP and no experts (:attr:`GGUFRules.dense_lead`)."""
    value = (getattr(config, rules.dense_lead, 0) or 0) if rules.dense_lead else 0
    if isinstance(value, (list, tuple)):  # per-layer kinds ("dense" / "sparse"): the dense ones first
        return next((i for i, kind in enumerate(value) if kind != "dense"), len(value))
    return int(value)


def _check_moe_last(config, model_type: str, rules: registry.GGUFRules, arch: str) -> None:
    """Experts through the last layer (:attr:`GGUFRules.moe_last`), as the graph has them."""
    last = getattr(config, rules.moe_last, None)
    if last is not None and last not in (-1, config.num_hidden_layers - 1):
        raise FastkitError(f"save_gguf: {model_type} with config.{rules.moe_last}={last} (of "
                           f"{config.num_hidden_layers} layers): llama.cpp's {arch} graph has experts in every layer "
                           "after the leading dense ones, through the last; this model cannot be expressed in GGUF "
                           "as is.")


def _groups_restrict(config) -> bool:
    """The router picks experts only within the best ``topk_group`` of ``n_group`` groups."""
    n_group, topk_group = getattr(config, "n_group", None) or 1, getattr(config, "topk_group", None) or 1
    return n_group > 1 and topk_group < n_group and getattr(config, "topk_method", None) != "greedy"


def check_family(config, model_type: str, rules: registry.GGUFRules) -> None:
    """What the family's llama.cpp graph hard-codes (the MoE fields of its GGUFRules), refused before any work."""
    arch = registry.gguf_row(model_type).gguf_arch
    if rules.mha_only and config.num_key_value_heads != config.num_attention_heads:
        raise FastkitError(f"save_gguf: {model_type} with config.num_key_value_heads={config.num_key_value_heads} "
                           f"(of {config.num_attention_heads} heads): llama.cpp's {arch} graph normalizes keys over "
                           "all heads' width (attn_k_norm is hidden_size wide); this model cannot be expressed in "
                           "GGUF as is.")
    kinds = getattr(config, rules.dense_lead, None) if rules.dense_lead else None
    if isinstance(kinds, (list, tuple)) and "dense" in kinds[dense_lead(config, rules):]:
        raise FastkitError(f"save_gguf: {model_type} with config.{rules.dense_lead}={list(kinds)}: llama.cpp's {arch} "
                           "graph has dense-MLP layers only before the first MoE layer; this model cannot be "
                           "expressed in GGUF as is.")
    if rules.moe_last:
        _check_moe_last(config, model_type, rules, arch)
    if rules.mla:
        _check_mla_yarn(config, model_type, arch)
    if _groups_restrict(config):
        if not rules.expert_groups:
            method = getattr(config, "topk_method", None)
            raise FastkitError(f"save_gguf: {model_type} with config.topk_method={method!r} (n_group={config.n_group}"
                               f", topk_group={config.topk_group}): llama.cpp's {arch} graph does not route within "
                               "groups this way (where llama.cpp has groups, it scores one by the sum of its top-2 "
                               "experts); this model cannot be expressed in GGUF as is.")


def _yarn(config) -> dict | None:
    rope = dict(getattr(config, "rope_parameters", None) or {})
    return rope if rope.get("rope_type") == "yarn" else None


def _check_mla_yarn(config, model_type: str, arch: str) -> None:
    """YaRN as src/llama-context.cpp and deepseek2.cpp compute it for MLA: cos/sin x ``get_mscale(f, m) /
    get_mscale(f, mscale_all_dim)`` and the attention scale x ``get_mscale(f, m)^2`` with llama.cpp's ``m`` =
    ``mscale_all_dim`` (1 where that is 1); transformers: cos/sin x the same ratio with the config's ``mscale``, the
    scale x ``get_mscale(f, mscale_all_dim)^2``. Equal only when ``mscale == mscale_all_dim`` (DeepSeek's configs: 1.0
    and 1.0 for V3, 0.707 and 0.707 for V2-Lite) and no explicit ``attention_factor``."""
    rope = _yarn(config)
    if rope is None:
        return
    keys = {k: rope.get(k) for k in ("mscale", "mscale_all_dim", "attention_factor")}
    if not keys["mscale_all_dim"] or keys["mscale"] != keys["mscale_all_dim"] or keys["attention_factor"] is not None:
        raise FastkitError(f"save_gguf: {model_type} with YaRN rope {keys}: llama.cpp's {arch} graph computes YaRN's "
                           "attention scaling only for mscale == mscale_all_dim and no attention_factor; this model "
                           "cannot be expressed in GGUF as is.")


def head_lengths(config, rules: registry.GGUFRules, head_dim: int, rope_dim: int) -> tuple[int, int, int, int]:
    """``(KV heads, key length, value length, rope dimensions)`` as the file states them; for MLA those of the latent
    llama.cpp attends over (one KV head of ``kv_lora_rank + qk_rope_head_dim`` / ``kv_lora_rank``)."""
    if not rules.mla:
        kv_heads = rules.kv_heads or getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return kv_heads, head_dim, head_dim, rope_dim
    rank, rope = config.kv_lora_rank, config.qk_rope_head_dim
    return 1, rank + rope, rank, rope


def add_kv(writer, config, rules: registry.GGUFRules) -> None:
    """The MoE / MLA hyperparameters the family's llama.cpp graph reads."""
    import gguf

    if rules.gating:
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType[_GATING[rules.gating]])
    if rules.router_renorm == "config":
        writer.add_expert_weights_norm(bool(getattr(config, "norm_topk_prob", False)))
    if rules.dense_lead:
        writer.add_leading_dense_block_count(dense_lead(config, rules))
    for method, attr in rules.config_ints:
        getattr(writer, method)(config_product(config, attr))
    if rules.expert_groups and _groups_restrict(config):
        writer.add_expert_group_count(int(config.n_group))
        writer.add_expert_group_used_count(int(config.topk_group))
    if rules.mla and _yarn(config) is not None:  # llama.cpp divides it by 0.1 again (as its converter writes it)
        writer.add_rope_scaling_yarn_log_mul(0.1 * float(_yarn(config)["mscale_all_dim"]))
    if rules.mla:
        writer.add_q_lora_rank(int(config.q_lora_rank or 0))  # 0: a plain q_proj (attn_q), as V2-Lite
        writer.add_kv_lora_rank(int(config.kv_lora_rank))
        writer.add_key_length_mla(int(config.qk_nope_head_dim + config.qk_rope_head_dim))
        writer.add_value_length_mla(int(config.v_head_dim))


def split_pieces(hf_name: str, config, rules: registry.GGUFRules) -> list[tuple[str, Callable]]:
    """llama.cpp tensors cut out of one transformers tensor where the family fuses what llama.cpp keeps apart: MLA's
    ``kv_b_proj`` (:func:`mla_kv_b_pieces`) and :attr:`GGUFRules.fused_halves`; ``[]`` for any other tensor."""
    m = re.fullmatch(r".*\.layers\.(\d+)\.(.+)\.weight", hf_name)
    if m is None:
        return []
    if rules.mla and m[2] == "self_attn.kv_b_proj":
        return mla_kv_b_pieces(f"blk.{m[1]}", config)
    for module, first, second in rules.fused_halves:
        if m[2] == module:
            return [(f"blk.{m[1]}.{first}.weight", lambda w: w[: w.shape[0] // 2]),  # (2S, H) -> (S, H) each
                    (f"blk.{m[1]}.{second}.weight", lambda w: w[w.shape[0] // 2:])]
    return []


def mla_kv_b_pieces(block: str, config) -> list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]]:
    """``kv_b_proj`` ``(H·(nope+v), kv_lora_rank)`` as llama.cpp's absorbed MLA reads it: ``attn_k_b`` ``(H, rank,
    nope)`` (each head's key rows, transposed) and ``attn_v_b`` ``(H, v, rank)``."""
    heads, nope, v = config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim

    def k_b(w: torch.Tensor) -> torch.Tensor:
        per_head = w.reshape(heads, nope + v, w.shape[-1])  # (H, nope+v, rank)
        return per_head[:, :nope].transpose(1, 2).contiguous()  # (H, rank, nope)

    def v_b(w: torch.Tensor) -> torch.Tensor:
        per_head = w.reshape(heads, nope + v, w.shape[-1])  # (H, nope+v, rank)
        return per_head[:, nope:].contiguous()  # (H, v, rank)

    return [(f"{block}.attn_k_b.weight", k_b), (f"{block}.attn_v_b.weight", v_b)]


__all__ = ["add_kv", "buffer_tensors", "check_family", "dense_lead", "head_lengths", "mla_kv_b_pieces",
           "renamed", "split_pieces"]
