"""Every private or version-fragile name of transformers, TRL and PEFT that fastkit touches, in one package.

Why. fastkit patches *instances* of transformers models: it selects attention and experts functions
by key, swaps per-layer checkpoint functions, and reads PEFT's LoRA factors without running PEFT's
parametrization. The names it needs for that are private (a leading underscore), sit in deep module
paths, or are matched by class name, so any upstream release may rename them. Each one is reached
here through one small function whose docstring says what it reads or writes, on which versions
that was checked (``checked:``) and when it can go (``Can go when``: the upstream change that makes it
unnecessary), as TRL's ``_compat.py`` does. ``tests/test_hf_compat.py`` calls every function on tiny
twins, so an upstream rename fails that test under the accessor's name; it also checks that each
docstring has both lines and that no other fastkit file uses these names.

What must not change. Writes that a patch must revert take the patch's
:class:`fastkit.patching.Swapper` (``swap``) and go through ``swap.setattr``, so ``revert`` restores the
very object that was there; without ``swap`` the write is plain (benchmarks, the temporary key of one
packed forward). transformers, TRL and PEFT are imported inside the functions: ``import fastkit``
imports none of them.

checked: transformers 5.24, 5.25, trl 1.16, peft 0.21.2 (every function below, unless it says otherwise).

Where. Every accessor is served from here (``from fastkit import _hf; _hf.name``), each defined in its room:

    models.py       models and configs: auto mappings, stateful models, the attention key, checkpointing
    moe.py          MoE experts: the experts registry and key, decorated experts, the per-parameter load hook
    classes.py      upstream classes recognized by name (the table's rows name them) or by isinstance
    hub_kernels.py  the stateful layers' hub kernels and the kernel packages' versions
    lora.py         PEFT's LoRA layers
    trainer.py      the Trainer, TRL's trainers, accelerate, the progress printers
    data.py         pandas, datasets, tokenizer.json, processors

The varlen gate (:data:`VARLEN_TRANSFORMERS`, :func:`varlen_unavailable`) lives here: it reads the range at call
time from this package, where a test narrows it.
"""

from __future__ import annotations

from fastkit._hf.classes import (
    class_name_in,
    has_no_4bit_layout,
    is_bnb_linear,
    is_fused_experts_class,
    looped_experts_kind,
    modules_of_classes,
)
from fastkit._hf.data import (  # noqa: F401  (BYTE_LEVEL: its import path)
    BYTE_LEVEL,
    byte_level_bpe,
    has_json_feature,
    is_pandas_dataframe,
    processor_class,
)
from fastkit._hf.hub_kernels import (
    VARLEN_KERNELS,
    VARLEN_PACKAGES,
    hub_function,
    kernel_global,
    kernel_reference,
    package_version,
    resolved_kernel,
)
from fastkit._hf.lora import (
    peft_delta,
    peft_expert_factors,
    peft_lora_factors,
    peft_lora_layers,
    peft_param_update,
    peft_param_wrappers,
    peft_runs_plain,
    peft_target_matches,
    peft_wrapper_chain,
)
from fastkit._hf.models import (
    AttentionView,
    attention_function,
    attention_registered,
    attn_implementation,
    checkpoint_function,
    checkpointed_layers,
    enable_activation_checkpointing,
    has_causal_lm_head,
    has_masked_lm_head,
    is_stateful_model,
    output_capture_for_compiled_region,
    quiet_gguf_reader,
    register_attention,
    set_attn_implementation,
    set_checkpoint_function,
)
from fastkit._hf.moe import (
    apply_gate,
    experts_implementation,
    grouped_mm_disabled,
    is_decorated_experts,
    is_expert_parallel,
    on_param_loaded,
    register_experts_function,
    set_experts_implementation,
)
from fastkit._hf.trainer import (  # noqa: F401  (PROGRESS_CALLBACKS: its import path)
    PROGRESS_CALLBACKS,
    accelerate_state_made,
    fsdp_dropped_on_cpu,
    fsdp_on_cpu,
    grpo_tokenizer,
    is_progress_callback,
    prepare_inputs,
    save_checkpoint,
    set_sft_token_total,
    sft_metrics,
    sft_token_total,
    sft_tp_size,
    steps_since_log,
    trainer_loss_accumulator,
)

CHECKED = "transformers 5.24, 5.25, trl 1.16, peft 0.21.2"
"""The versions every accessor here was checked on (``tests/test_hf_compat.py`` runs them)."""

VARLEN_TRANSFORMERS = ("5.24", "5.26")
"""transformers versions ``[lo, hi)`` whose hybrid mixers were read as above (kwargs forwarded, conv layout)."""


def _in_range(version: str | None, lo: str, hi: str) -> bool:
    from packaging.version import InvalidVersion, Version

    try:
        return version is not None and Version(lo) <= Version(version) < Version(hi)
    except InvalidVersion:
        return False


def varlen_unavailable(module_cls: type, kind: str) -> str | None:
    """Why a mixer of ``kind`` cannot take the varlen kernels here (None: it can, on a CUDA tensor).
    checked: transformers 5.24.0, 5.25.0 and the package ranges in :data:`VARLEN_PACKAGES`. Can go when transformers
    says which implementation it resolved (then only the version table stays).
    """
    import transformers

    if kind not in VARLEN_KERNELS:
        return "no varlen kernel for this layer in fastkit"
    lo, hi = VARLEN_TRANSFORMERS
    if not _in_range(transformers.__version__, lo, hi):
        return f"transformers {transformers.__version__} not checked (varlen read on [{lo}, {hi}))"
    for name, package in VARLEN_KERNELS[kind]:
        if resolved_kernel(module_cls, name) is None:
            return f"{name} runs transformers' torch reference: {package} is not importable"
        version = package_version(package)
        _, lo, hi = VARLEN_PACKAGES[package]
        if not _in_range(version, lo, hi):
            return f"{package} {version} outside the checked range [{lo}, {hi})"
    return None


__all__ = [
    "CHECKED", "AttentionView", "accelerate_state_made", "apply_gate", "attention_function", "attention_registered",
    "attn_implementation", "byte_level_bpe", "class_name_in", "fsdp_dropped_on_cpu", "fsdp_on_cpu", "grpo_tokenizer",
    "has_json_feature", "has_masked_lm_head",
    "has_no_4bit_layout", "is_bnb_linear",
    "is_fused_experts_class", "is_pandas_dataframe", "is_progress_callback", "looped_experts_kind",
    "modules_of_classes", "package_version", "quiet_gguf_reader", "resolved_kernel", "varlen_unavailable",
    "hub_function", "kernel_global", "kernel_reference",
    "checkpoint_function", "checkpointed_layers", "enable_activation_checkpointing", "experts_implementation",
    "grouped_mm_disabled", "has_causal_lm_head", "is_decorated_experts", "is_expert_parallel", "is_stateful_model",
    "on_param_loaded", "output_capture_for_compiled_region", "processor_class",
    "peft_delta",
    "peft_expert_factors", "peft_lora_factors", "peft_lora_layers", "peft_param_update", "peft_param_wrappers",
    "peft_runs_plain", "peft_target_matches", "peft_wrapper_chain",
    "prepare_inputs",
    "register_attention", "register_experts_function", "set_attn_implementation", "set_checkpoint_function",
    "set_experts_implementation", "set_sft_token_total", "sft_metrics", "sft_token_total", "sft_tp_size",
    "save_checkpoint", "steps_since_log", "trainer_loss_accumulator",
]
