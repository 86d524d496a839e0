"""The TrainingArguments fastkit's trainers are made with: the defaults every trainer shares
(:func:`training_args`, the one place they are written), SFT's (:func:`sft_config`), and the checks of the
distributed mode a config asks for.

Gradient checkpointing is owned by ``FastModel.get_peft_model`` / :func:`fastkit.enable_checkpointing` (plain or
offloaded); ``activation_checkpointing`` stays off so TRL does not replace it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from fastkit import checks
from fastkit.device import auto_dtype
from fastkit.distributed import ranks
from fastkit.errors import FastkitError
from fastkit.patching import active_patches, unwrap
from fastkit.training.compile import sft_without
from fastkit.training.options import DEFAULT_MAX_STEPS, TrainOptions, default_eval_steps, trackers

logger = logging.getLogger(__name__)


def _precision(model: torch.nn.Module) -> dict[str, Any]:
    """Mixed-precision flags for SFTConfig from where the model lives."""
    if model.device.type != "cuda":
        return dict(use_cpu=True, bf16=False, fp16=False)
    dtype = auto_dtype(model.device)  # T4 (sm75): no bf16, so fp16
    return dict(bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)


def _default_optim(model: torch.nn.Module) -> str:
    """Paged 8-bit AdamW (bitsandbytes) on CUDA with 4-bit weights, 32-bit AdamW elsewhere (see fastkit.plan)."""
    from fastkit.plan import default_optimizer

    base = unwrap(model)
    return default_optimizer(model.device.type, bool(getattr(base, "is_loaded_in_4bit", False)))


def training_args(options, *, report_to: list[str], cuda: bool, optim: str, precision: dict[str, bool],
                  logging_steps: int = 1, save_total_limit: int = 2, lr_scheduler_type: str = "linear",
                  warmup_steps: int | None = None, weight_decay: float = 0.0) -> dict[str, Any]:
    """The TrainingArguments values every fastkit trainer shares (``SFTConfig``, ``DPOConfig``, ``KTOConfig``,
    ``GRPOConfig``): the one place their defaults are written.

    ``options``: the run's options (``max_steps`` / ``epochs``, ``learning_rate``, ``batch_size``,
    ``gradient_accumulation_steps``, ``output_dir``, ``seed``, ``save_steps``); ``report_to`` the trackers' list;
    ``cuda``, ``optim``, ``precision``: what the model's device asks for (:func:`device_args`). Checkpointing is
    fastkit's (``activation_checkpointing=False``), a NaN loss is shown (never averaged away), the dashboard is the
    progress display (``disable_tqdm``). Warmup: ``warmup_steps``, else a tenth of the steps, at most 5.
    """
    max_steps, epochs = _run_length(options.max_steps, options.epochs)
    save_steps = options.save_steps
    return dict(
        output_dir=options.output_dir, max_steps=max_steps or -1, num_train_epochs=epochs or 1.0,
        learning_rate=options.learning_rate, per_device_train_batch_size=options.batch_size,
        gradient_accumulation_steps=options.gradient_accumulation_steps, activation_checkpointing=False,
        logging_steps=logging_steps, logging_nan_inf_filter=False, report_to=report_to, seed=options.seed,
        data_seed=options.seed,
        **({"save_strategy": "steps", "save_steps": save_steps, "save_total_limit": save_total_limit}
           if save_steps else {"save_strategy": "no"}),
        lr_scheduler_type=lr_scheduler_type,
        warmup_steps=warmup_steps if warmup_steps is not None else min(5, (max_steps or 50) // 10),
        weight_decay=weight_decay, dataloader_pin_memory=cuda, disable_tqdm=True, optim=optim, **precision,
    )


def device_args(model: torch.nn.Module) -> dict[str, Any]:
    """:func:`training_args`'s ``cuda``, ``optim`` and ``precision`` for where ``model`` lives."""
    return dict(cuda=model.device.type == "cuda", optim=_default_optim(model), precision=_precision(model))


def sft_config(options: TrainOptions, *, evaluate: bool, cuda: bool, optim: str, precision: dict[str, bool],
               max_seq_length: int | None = None, every_parameter_used: bool = False) -> dict[str, Any]:
    """The ``SFTConfig`` values of ``options``: a pure function (no model, no I/O, ``options`` untouched).

    ``evaluate``: there is an eval set; ``cuda``, ``optim``, ``precision``: what the model's device asks for
    (make_trainer reads them); ``max_seq_length``: the load's, when ``options`` leaves it None. The values every
    trainer shares are :func:`training_args`'s; ``options.sft`` wins over every default. One of ``max_steps`` /
    ``epochs`` is set (the other None); step counts that depend on an epochs run's length are finished by the
    trainer once the rows are packed. ``every_parameter_used``: every trainable parameter gets a gradient each step
    (:func:`every_parameter_used`), so DDP need not search for unused ones (``ddp_find_unused_parameters=False``;
    else the Trainer's own choice).
    """
    max_steps, _ = _run_length(options.max_steps, options.epochs)
    config = training_args(options, report_to=list(trackers(options.report_to)), cuda=cuda, optim=optim,
                           precision=precision, logging_steps=options.logging_steps or 1,
                           save_total_limit=options.save_total_limit, lr_scheduler_type=options.lr_scheduler_type,
                           warmup_steps=options.warmup_steps, weight_decay=options.weight_decay)
    config.update(
        max_length=max_seq_length or options.max_seq_length or 2048, packing=options.packing, packing_strategy="bfd",
        completion_only_loss=options.completion_only_loss,
        **({"eval_strategy": "steps", "eval_steps": options.eval_steps or default_eval_steps(max_steps or 1),
            "per_device_eval_batch_size": options.batch_size} if evaluate else {}),
        **({"ddp_find_unused_parameters": False} if every_parameter_used else {}),
    )
    if options.early_stopping_patience is not None:
        config.update(metric_for_best_model="eval_loss", greater_is_better=False)
    config.update(sft_without(options.sft))  # fastkit's compile option owns TRL's torch_compile fields
    return config


def build_sft_config(config: dict[str, Any]):
    """``trl.SFTConfig(**config)``; its refusals (an unknown scheduler or optimizer name, ...) as FastkitError."""
    import warnings

    from trl import SFTConfig

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers' deprecation notes on fields it renames
            return SFTConfig(**config)
    except (ValueError, TypeError) as exc:
        raise FastkitError(f"trl.SFTConfig refused these options: {exc}") from exc


def _run_length(max_steps, epochs) -> tuple[int | None, float | None]:
    """(max_steps, epochs) with exactly one set; neither given: 60 steps."""
    if max_steps is not None and epochs is not None:
        raise FastkitError(f"Give max_steps or epochs, not both (got max_steps={max_steps!r}, epochs={epochs!r}): "
                           "set the other to None.")
    if epochs is None:
        max_steps = DEFAULT_MAX_STEPS if max_steps is None else max_steps
        checks.check_max_steps(max_steps)
        return max_steps, None
    if isinstance(epochs, bool) or not isinstance(epochs, (int, float)) or not epochs > 0:
        raise FastkitError(f"epochs must be a positive number of passes over the data, got {epochs!r}.")
    return None, float(epochs)


def every_parameter_used(model: torch.nn.Module) -> bool:
    """True when each step gives every trainable parameter a gradient: fastkit's checkpointing is on (as the
    Trainer reasons for a checkpointed transformers model: DDP's unused-parameter search and checkpointing do
    not mix) and the model routes no tokens (a MoE expert no token reached would get no gradient)."""
    base = unwrap(model)
    routed = getattr(getattr(base, "config", None), "num_experts_per_tok", None) is not None
    return bool(getattr(base, "is_activation_checkpointing", False)) and not routed


def _log_processes(config: dict[str, Any]) -> None:
    """One line for a multi-process run: how many processes, and the unused-parameter search DDP does."""
    if ranks.world_size() == 1 or config.get("fsdp") or ranks.fsdp_asked():
        return  # FSDP: said once the Trainer made its accelerator (_fsdp_processes)
    found = config.get("ddp_find_unused_parameters")
    how = {False: "off (every trainable parameter gets a gradient each step: LoRA with fastkit's checkpointing)",
           True: "on"}.get(found, "the Trainer's choice")
    logger.info("fastkit: %d processes (DDP); find_unused_parameters %s", ranks.world_size(), how)


def check_distributed_mode(model: torch.nn.Module, config: dict[str, Any]) -> None:
    """Refuse, at start, a fastkit patch that cannot work with the chosen distributed mode."""
    fsdp = config.get("fsdp") or ""
    fsdp = " ".join(fsdp) if isinstance(fsdp, (list, tuple)) else str(fsdp)
    fsdp_config = config.get("fsdp_config") or {}
    cpu_offload = "offload" in fsdp.split() or bool(fsdp_config.get("cpu_offload") or fsdp_config.get("offload_params"))
    cpu_offload = cpu_offload or (ranks.fsdp_asked() and os.environ.get("FSDP_OFFLOAD_PARAMS", "").lower() == "true")
    _check_no_deepspeed(config)
    if cpu_offload and "offload" in active_patches(unwrap(model)):
        raise FastkitError("Activation offload (use_gradient_checkpointing='offload') and FSDP CPU offload both move "
                           "data over the same host link with pinned buffers and would fight for it. Choose one: "
                           "use_gradient_checkpointing=True with FSDP cpu_offload, or drop FSDP's cpu_offload.")


def _check_no_deepspeed(config: dict[str, Any]) -> None:
    """DeepSpeed (``accelerate launch --use_deepspeed``, ``deepspeed=...``) is refused: not tested with fastkit."""
    if config.get("deepspeed") or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        raise FastkitError("DeepSpeed is not supported by fastkit yet: it has not been tested with fastkit's patches "
                           "(ZeRO-3 replaces each parameter with an empty placeholder, which the packing, "
                           "checkpointing and LoRA patches read), and it is not installed where fastkit is tested. "
                           "Use FSDP2: `accelerate launch --config_file fsdp2.yaml -m fastkit train ...`.")


__all__ = ["build_sft_config", "check_distributed_mode", "device_args", "every_parameter_used", "sft_config",
           "training_args"]
