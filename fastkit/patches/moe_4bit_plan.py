"""Training peak of a MoE model with fastkit's 4-bit experts (:mod:`fastkit.patches.moe_4bit`), and the bench rows.

:func:`plan_4bit_experts` starts from :func:`fastkit.plan.plan` (``load_in_4bit=True``: NF4 linear layers and
NF4 fused experts, PEFT's merged ``W + B·A``) and changes what fastkit's 4-bit experts run changes: nothing merges
``W + B·A`` (LoRA runs per expert group), and one expert is dequantized at a time (its codes unpacked
through an int32 index and fp32 values, then cast: ~8 bytes per weight of ONE expert matrix). The model
is built from its config on the meta device (no download, no memory).

:data:`GPT_OSS_20B` and :data:`QWEN3_30B_A3B` are the published ``config.json`` values that matter here.
``fastkit bench moe`` (:mod:`fastkit.bench.moe_4bit`) times the 4-bit experts layer against 16-bit experts and
the anchor-style per-expert ``Linear4bit`` loop.
"""

from __future__ import annotations

import torch

from fastkit.plan import ALLOCATOR_SLACK, OFF_PEAK, Plan, plan, read_config
from fastkit.plan_terms import shape_of

GPT_OSS_20B = dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                   num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                   num_experts_per_tok=4, vocab_size=201088, sliding_window=128, max_position_embeddings=131072,
                   tie_word_embeddings=False, quantization_config={"quant_method": "mxfp4"})
"""openai/gpt-oss-20b config.json (the sizes, and that it ships MXFP4 experts; rope fields do not change the memory)."""
QWEN3_30B_A3B = dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     num_experts=128, num_experts_per_tok=8, vocab_size=151936, max_position_embeddings=40960,
                     norm_topk_prob=True, tie_word_embeddings=False)
"""Qwen/Qwen3-30B-A3B config.json (the sizes)."""

DEQUANT_BYTES_PER_WEIGHT = 8
"""Transient bytes per weight of the ONE expert being dequantized: int32 byte index (2) + fp32 values (4)
+ the 16-bit result (2)."""


def plan_4bit_experts(model_or_config, gpu: str | float = "t4", max_seq_length: int = 2048, r: int = 16,
                      expert_lora: bool = True, **options) -> Plan:
    """The training peak with NF4 experts run by fastkit, by component (a :class:`fastkit.plan.Plan`).

    ``expert_lora``: fastkit's per-group LoRA on the experts (in the compute dtype, as ``ExpertLoRA``
    creates it) besides PEFT's fp32 LoRA on the linear layers; False adapts the linear layers only.
    """
    if isinstance(model_or_config, dict):
        model_or_config = dict(model_or_config)  # read_config pops model_type
    config = read_config(model_or_config)
    base = plan(config, gpu=gpu, max_seq_length=max_seq_length, r=r, load_in_4bit=True, **options)
    shape = shape_of(config)
    size = (base.inputs.dtype or (torch.bfloat16 if base.budget is not None else torch.float32)).itemsize
    largest = max((i * o for i, o, n in shape.lora_dims if n > 1), default=0)  # one expert matrix
    expert_lora_params = sum(r * (i + o) * n for i, o, n in shape.lora_dims if n > 1)
    comps: dict[str, int] = {}
    for name, nbytes in base.components.items():
        if name.startswith("LoRA"):
            linear_lora = nbytes - 8 * expert_lora_params
            comps[f"LoRA r={r} on linear layers (PEFT): parameters + gradients (fp32)"] = linear_lora
            if expert_lora:
                comps[f"LoRA r={r} on experts (fastkit): parameters + gradients"] = 2 * size * expert_lora_params
        elif name.startswith("optimizer state"):
            per = nbytes // max(1, shape.lora_params(r))  # bytes per trainable parameter
            comps[name] = nbytes - (0 if expert_lora else per * expert_lora_params)
        elif "merged" in name or name.startswith("allocator slack"):
            continue  # fastkit never builds W + B·A; slack is recomputed below
        elif name.startswith("one layer's recompute"):  # without PEFT's merged W + B·A of one MoE layer
            comps[name] = nbytes - shape.expert_params_per_layer * size
        else:
            comps[name] = nbytes
    comps["one expert dequantized at a time (fastkit, fwd and bwd)"] = largest * DEQUANT_BYTES_PER_WEIGHT
    if base.budget is not None:
        peak = sum(v for k, v in comps.items() if not k.startswith(OFF_PEAK) and not k.startswith("CUDA context"))
        comps[f"allocator slack ({ALLOCATOR_SLACK:.0%})"] = int(ALLOCATOR_SLACK * peak)
    result = Plan(f"{base.model} (4-bit experts)", base.inputs, components=comps, budget=base.budget)
    if not result.fits:
        result.advice = [f"Try r={max(1, r // 2)}, LoRA on the linear layers only (expert_lora=False), "
                         "shorter rows, or a GPU with more memory."]
    return result


__all__ = ["GPT_OSS_20B", "QWEN3_30B_A3B", "plan_4bit_experts"]
