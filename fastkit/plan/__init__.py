"""Memory planning from a model's config alone (``fastkit plan MODEL``, ``fastkit.plan.plan(...)``).

    planner.py    ``plan``, ``auto_plan``, the load-time ``check_fits``: the entry points, from config to verdict
    peak.py       the byte model's assembly: ``PlanInputs`` and ``components`` (bytes at the step's peak)
    search.py     the longest row that fits (``max_seq_length="max"``) and GRPO's largest G / completion length
    report.py     ``Plan``: the table ``fastkit plan`` prints, the verdict, and ``advise`` (the knobs that fit)
    gpus.py       the GPU table: each ``--gpu`` name's memory as torch reports it, and its source; ``gpu_budget``
    source.py     where the model comes from (shipped, a folder, the Hub cache, the Hub) and its config checks
    configs.py    the shipped models' config values and counted shapes (shapes.json): planned without torch
    terms.py      ``ModelShape`` and the byte terms (weights, adapters, activations, loss)
    rl.py         the DPO / GRPO passes (``plan(kind="dpo"|"grpo")``): reference pass, generation (KV cache)
    moe_4bit.py   the 4-bit-experts plan for the published MoE configs (GPT-OSS-20B, Qwen3-30B-A3B)
    memprobe.py   ``measure_peak``: the peak an actual step allocated (profiler memory events)
"""

from fastkit.patches.sizes import DEQUANT_BYTES_PER_WEIGHT
from fastkit.plan.gpus import GPUS, gpu_budget
from fastkit.plan.moe_4bit import GPT_OSS_20B, QWEN3_30B_A3B, plan_4bit_experts
from fastkit.plan.peak import (
    ALLOCATOR_SLACK,
    CUDA_CONTEXT,
    EIGHT_BIT,
    NF4_BYTES,
    NF4_BYTES_NO_DOUBLE,
    OPTIMIZER_STATE_BYTES,
    PlanInputs,
    components,
    default_optimizer,
)
from fastkit.plan.planner import REFUSE_ABOVE, check_fits, plan, prequantized_4bit
from fastkit.plan.report import Plan, advise
from fastkit.plan.source import read_config
from fastkit.plan.terms import ModelShape, shape_of

__all__ = ["ALLOCATOR_SLACK", "CUDA_CONTEXT", "DEQUANT_BYTES_PER_WEIGHT", "EIGHT_BIT", "GPT_OSS_20B", "GPUS",
           "NF4_BYTES", "NF4_BYTES_NO_DOUBLE", "OPTIMIZER_STATE_BYTES", "QWEN3_30B_A3B", "REFUSE_ABOVE",
           "ModelShape", "Plan", "PlanInputs", "advise", "check_fits", "components", "default_optimizer",
           "gpu_budget", "plan", "plan_4bit_experts", "prequantized_4bit", "read_config", "shape_of"]
