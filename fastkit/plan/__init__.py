"""Memory planning from a model's config alone (``fastkit plan MODEL``, ``fastkit.plan.plan(...)``).

    planner.py    ``plan``, ``Plan``, ``PlanInputs``, the load-time ``check_fits``
    gpus.py       the GPU table: each ``--gpu`` name's memory as torch reports it, and its source
    source.py     where the model comes from (shipped, a folder, the Hub cache, the Hub) and its config checks
    configs.py    the shipped models' config values and counted shapes (shapes.json): planned without torch
    terms.py      ``ModelShape`` and the byte terms (weights, adapters, activations, loss)
    rl.py         the DPO / GRPO passes (``plan(kind="dpo"|"grpo")``): reference pass, generation (KV cache)
    moe_4bit.py   the 4-bit-experts plan for the published MoE configs (GPT-OSS-20B, Qwen3-30B-A3B)
    memprobe.py   ``measure_peak``: the peak an actual step allocated (profiler memory events)
"""

from fastkit.plan.moe_4bit import GPT_OSS_20B, QWEN3_30B_A3B, plan_4bit_experts
from fastkit.plan.planner import (
    ALLOCATOR_SLACK,
    CUDA_CONTEXT,
    DEQUANT_BYTES_PER_WEIGHT,
    EIGHT_BIT,
    GPUS,
    NF4_BYTES,
    NF4_BYTES_NO_DOUBLE,
    OPTIMIZER_STATE_BYTES,
    REFUSE_ABOVE,
    Plan,
    PlanInputs,
    advise,
    check_fits,
    components,
    default_optimizer,
    gpu_budget,
    plan,
    prequantized_4bit,
    read_config,
)
from fastkit.plan.terms import ModelShape, shape_of

__all__ = ["ALLOCATOR_SLACK", "CUDA_CONTEXT", "DEQUANT_BYTES_PER_WEIGHT", "EIGHT_BIT", "GPT_OSS_20B", "GPUS",
           "NF4_BYTES", "NF4_BYTES_NO_DOUBLE", "OPTIMIZER_STATE_BYTES", "QWEN3_30B_A3B", "REFUSE_ABOVE",
           "ModelShape", "Plan", "PlanInputs", "advise", "check_fits", "components", "default_optimizer",
           "gpu_budget", "plan", "plan_4bit_experts", "prequantized_4bit", "read_config", "shape_of"]
