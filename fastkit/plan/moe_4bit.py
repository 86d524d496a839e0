"""Training peak of a MoE model with fastkit's 4-bit experts (:mod:`fastkit.patches.moe.nf4`): the real configs.

:func:`fastkit.plan.plan` itself counts what fastkit's 4-bit experts change when ``load_in_4bit=True`` on a
MoE: experts stored NF4 (or MXFP4), no PEFT ``W + B·A`` merge (LoRA runs per expert group in the compute
dtype), one hit group of experts dequantized at a time (``PlanInputs.moe_dequant_group_bytes``, 8 MiB by
default: ~8 bytes per weight of as many expert matrices as fit, at least one). :func:`plan_4bit_experts`
is that call with the experts' LoRA switch spelled out, and :data:`GPT_OSS_20B` / :data:`QWEN3_30B_A3B` are
the published ``config.json`` values that matter (built on the meta device: no download, no memory).
``python -m benchmarks moe`` (``benchmarks/moe_4bit.py``) times the 4-bit experts layer against 16-bit experts and
the anchor-style per-expert ``Linear4bit`` loop.
"""

from __future__ import annotations

from fastkit.plan.moe_4bit_configs import GPT_OSS_20B, QWEN3_30B_A3B
from fastkit.plan.planner import DEQUANT_BYTES_PER_WEIGHT, Plan, plan


def plan_4bit_experts(model_or_config, gpu: str | float = "t4", max_seq_length: int = 2048, r: int = 16,
                      expert_lora: bool = True, **options) -> Plan:
    """The training peak with NF4 experts run by fastkit, by component (a :class:`fastkit.plan.Plan`).

    ``expert_lora``: fastkit's per-group LoRA on the experts (in the compute dtype, as ``ExpertLoRA``
    creates it) besides PEFT's fp32 LoRA on the linear layers; False adapts the linear layers only.
    """
    base = plan(dict(model_or_config) if isinstance(model_or_config, dict) else model_or_config, gpu=gpu,
                max_seq_length=max_seq_length, r=r, load_in_4bit=True, expert_lora=expert_lora, **options)
    base.model = f"{base.model} (4-bit experts)"
    return base


__all__ = ["DEQUANT_BYTES_PER_WEIGHT", "GPT_OSS_20B", "QWEN3_30B_A3B", "plan_4bit_experts"]
