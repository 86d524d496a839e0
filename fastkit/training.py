"""Training with TRL's ``SFTTrainer``, set up the way fastkit's patches expect, under the dashboard.

fastkit does not ship a trainer: :func:`make_trainer` returns a plain ``trl.SFTTrainer`` with
defaults that work on a 2-core CPU and on a T4 alike (precision from the device, packing on,
responses-only loss), after :func:`fastkit.data.check_dataset` has refused bad data.
:func:`fit` runs it with the live dashboard (:mod:`fastkit.dashboard`) and turns a
``KeyboardInterrupt`` into a clean stop. Chat and save: :mod:`fastkit.export`.

Gradient checkpointing is owned by ``FastModel.get_peft_model`` / :func:`fastkit.enable_checkpointing`
(plain or offloaded); ``SFTConfig.activation_checkpointing`` stays off so TRL does not replace it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from fastkit import _hf, checks
from fastkit.dashboard import MetricsCallback, TrainingMetrics, dashboard_callback
from fastkit.dashboard.render import shorten
from fastkit.data import check_dataset
from fastkit.errors import FastkitError
from fastkit.patching import active_patches, change, report, unwrap

logger = logging.getLogger(__name__)


def _precision(model: torch.nn.Module) -> dict[str, Any]:
    """Mixed-precision flags for SFTConfig from where the model lives."""
    if model.device.type != "cuda":
        return dict(use_cpu=True, bf16=False, fp16=False)
    if torch.cuda.is_bf16_supported(including_emulation=False):
        return dict(bf16=True, fp16=False)
    return dict(bf16=False, fp16=True)  # T4 (sm75): no bf16


def _default_optim(model: torch.nn.Module) -> str:
    """Paged 8-bit AdamW (bitsandbytes) on CUDA with 4-bit weights, 32-bit AdamW elsewhere (see fastkit.plan)."""
    from fastkit.plan import default_optimizer

    base = unwrap(model)
    return default_optimizer(model.device.type, bool(getattr(base, "is_loaded_in_4bit", False)))


def make_trainer(
    model: torch.nn.Module,
    tokenizer,
    train_dataset,
    *,
    max_steps: int = 60,
    learning_rate: float = 2e-4,
    batch_size: int = 1,
    gradient_accumulation_steps: int = 1,
    max_seq_length: int | None = None,
    packing: bool = True,
    completion_only_loss: bool = True,
    drop_long: bool = False,
    drop_invalid: bool = False,
    output_dir: str = "outputs",
    callbacks: Sequence[Any] = (),
    seed: int = 3407,
    eval_dataset=None,
    eval_steps: int | None = None,
    save_steps: int | None = None,
    dashboard: str = "auto",
    measure_syncs: bool = False,
    chunked_loss: bool | None = None,
    **sft_overrides: Any,
):
    """A ``trl.SFTTrainer`` for ``model`` on ``train_dataset`` (checked first, errors before any step).

    ``drop_long=True`` drops rows longer than ``max_seq_length`` (logged) instead of refusing the data;
    ``drop_invalid=True`` drops rows with nothing to train (see :func:`fastkit.data.check_dataset`).

    ``eval_dataset`` (checked like the training data) is evaluated every ``eval_steps`` steps (default:
    10 times a run) and its loss shows on the dashboard. ``save_steps`` saves a checkpoint every that
    many steps into ``output_dir`` (the 2 newest kept; ``fit(trainer, resume=True)`` continues from the
    last one); None saves none. ``dashboard`` ('auto', 'html', 'widget', 'terminal', 'none') attaches
    the dashboard callback, so a plain ``trainer.train()`` shows progress too (:func:`fit` swaps in its
    own); ``measure_syncs`` counts host-device syncs of one step on it (a debug switch).

    ``chunked_loss``: compute the loss and TRL's entropy / accuracy metrics with fastkit's chunked
    cross-entropy (:mod:`fastkit.patches.loss.patch`) instead of TRL's fused LM head; default on off CUDA
    (TRL's torch fallback holds more than the full logits there), TRL's Triton kernel on CUDA.
    """
    from trl import SFTConfig, SFTTrainer

    checks.check_max_steps(max_steps)
    if max_seq_length is not None:
        checks.check_max_seq_length(max_seq_length)
    max_seq_length = max_seq_length or getattr(tokenizer, "model_max_length", 2048)
    _check_packing_supported(model, packing)
    dataset = check_dataset(train_dataset, tokenizer, max_seq_length, packing=packing, drop_long=drop_long,
                            drop_invalid=drop_invalid)
    if save_steps is not None and save_steps < 1:
        raise FastkitError(f"save_steps must be a positive number of steps or None (no checkpoints), got {save_steps}.")
    if eval_dataset is not None:
        eval_dataset = check_dataset(eval_dataset, tokenizer, max_seq_length, packing=packing, drop_long=drop_long,
                                     drop_invalid=drop_invalid)
    dash = dashboard_callback(dashboard, examples=len(dataset), measure_syncs=measure_syncs)
    # never mix documents through a KV cache while training (fastkit.revert puts the user's value back)
    change(model, "use_cache", lambda swap: swap.setattr(unwrap(model).config, "use_cache", False))
    config = sft_config(output_dir=output_dir, max_steps=max_steps, learning_rate=learning_rate, batch_size=batch_size,
                        gradient_accumulation_steps=gradient_accumulation_steps, max_seq_length=max_seq_length,
                        packing=packing, completion_only_loss=completion_only_loss, seed=seed, save_steps=save_steps,
                        eval_steps=eval_steps if eval_dataset is not None else None, evaluate=eval_dataset is not None,
                        cuda=model.device.type == "cuda", optim=_default_optim(model), precision=_precision(model),
                        overrides=sft_overrides)
    check_distributed_mode(model, config)
    trainer = SFTTrainer(model=model, args=SFTConfig(**config), train_dataset=dataset, eval_dataset=eval_dataset,
                         processing_class=tokenizer, callbacks=list(callbacks))
    trainer.callback_handler.callbacks.insert(0, dash)  # first: trackers after it see its fastkit/... log keys
    _attach_packed_metadata(trainer)
    if chunked_loss if chunked_loss is not None else model.device.type != "cuda":
        from fastkit.patches.loss.patch import route_trainer_loss

        ok, how = route_trainer_loss(trainer)
        if not ok:
            logger.info("fastkit: chunked loss not used (%s); TRL's fused LM head computes the loss", how)
    return trainer


def sft_config(*, output_dir: str, max_steps: int, learning_rate: float, batch_size: int,
               gradient_accumulation_steps: int, max_seq_length: int, packing: bool, completion_only_loss: bool,
               seed: int, save_steps: int | None, eval_steps: int | None, evaluate: bool, cuda: bool, optim: str,
               precision: dict[str, bool], overrides: dict[str, Any]) -> dict[str, Any]:
    """The ``SFTConfig`` values :func:`make_trainer` uses: a pure function of its arguments (no model, no I/O).

    Checkpointing is fastkit's (``activation_checkpointing=False`` here); ``overrides`` (make_trainer's
    ``**sft_overrides``) win over every default.
    """
    config = dict(
        output_dir=output_dir, max_steps=max_steps, learning_rate=learning_rate,
        per_device_train_batch_size=batch_size, gradient_accumulation_steps=gradient_accumulation_steps,
        max_length=max_seq_length, packing=packing, packing_strategy="bfd",
        completion_only_loss=completion_only_loss, activation_checkpointing=False,
        logging_steps=1, report_to=[], seed=seed, data_seed=seed,
        **({"save_strategy": "steps", "save_steps": save_steps, "save_total_limit": 2} if save_steps
           else {"save_strategy": "no"}),
        **({"eval_strategy": "steps", "eval_steps": eval_steps or max(1, max_steps // 10),
            "per_device_eval_batch_size": batch_size} if evaluate else {}),
        lr_scheduler_type="linear", warmup_steps=min(5, max_steps // 10), weight_decay=0.0,
        dataloader_pin_memory=cuda, disable_tqdm=True, optim=optim, **precision,
    )
    config.update(overrides)
    return config


def check_distributed_mode(model: torch.nn.Module, config: dict[str, Any]) -> None:
    """Refuse, at start, a fastkit patch that cannot work with the chosen distributed mode."""
    fsdp = config.get("fsdp") or ""
    fsdp = " ".join(fsdp) if isinstance(fsdp, (list, tuple)) else str(fsdp)
    fsdp_config = config.get("fsdp_config") or {}
    cpu_offload = "offload" in fsdp.split() or bool(fsdp_config.get("cpu_offload") or fsdp_config.get("offload_params"))
    if cpu_offload and "offload" in active_patches(unwrap(model)):
        raise FastkitError("Activation offload (use_gradient_checkpointing='offload') and FSDP CPU offload both move "
                           "data over the same host link with pinned buffers and would fight for it. Choose one: "
                           "use_gradient_checkpointing=True with FSDP cpu_offload, or drop FSDP's cpu_offload.")


def _check_packing_supported(model: torch.nn.Module, packing: bool) -> None:
    """packing=True on a model without fastkit's packing patch would let packed documents attend to each other."""
    base = unwrap(model)
    if packing and "packing" not in active_patches(base) and getattr(base.config, "model_type", None) is not None:
        rep = report(base)
        why = "" if rep is None else next(iter(v for k, v in rep.skipped.items() if k in ("packing", "all")), "")
        raise FastkitError(f"packing=True, but model_type {base.config.model_type!r} has no active fastkit packing "
                           f"patch{f' ({why})' if why else ''}, so packed documents would attend to each other. Pass "
                           "packing=False (or load the model through FastModel with patches='auto' for a family in "
                           "fastkit's table, docs/coverage.md).")


def _attach_packed_metadata(trainer) -> None:
    """Let the packing patch see host-side document lengths (the Trainer moves tensors to the device)."""
    if "packing" not in active_patches(unwrap(trainer.model)):
        return
    from fastkit.patches.packing.patch import wrap_collator

    trainer.data_collator = wrap_collator(trainer.data_collator)


# -- running a trainer under the dashboard -----------------------------------------------------


def fit(trainer, *, view: str = "auto", title: str | None = None, warmup_steps: int = 2,
        measure_syncs: bool = False, resume: bool = False, clock=None, **train_kwargs: Any) -> TrainingMetrics:
    """Run ``trainer.train(**train_kwargs)`` with the dashboard; returns the final :class:`TrainingMetrics`.

    The trainer's own progress bar / log printer and the dashboard ``make_trainer`` attached are set
    aside while it runs (this dashboard shows the same numbers). ``measure_syncs`` counts the
    host-device syncs of one step (a debug switch). ``resume=True`` continues from the newest
    checkpoint in ``trainer.args.output_dir`` when there is one (else starts fresh).

    A ``KeyboardInterrupt`` (Ctrl-C, Jupyter's stop button) ends training
    cleanly: the summary is shown, the model keeps the weights of the last finished optimizer step
    and stays usable (gradients dropped, memory released), and the cell does not fail. Any other
    error also shows the summary, then propagates.
    """
    kwargs = dict(warmup_steps=warmup_steps, measure_syncs=measure_syncs)
    if clock is not None:
        kwargs["clock"] = clock
    attached = next((cb for cb in trainer.callback_handler.callbacks if isinstance(cb, MetricsCallback)), None)
    kwargs["examples"] = getattr(attached, "examples", None)
    callback = dashboard_callback(view, title, **kwargs)
    set_aside = [cb for cb in list(trainer.callback_handler.callbacks)
                 if _hf.is_progress_callback(cb) or isinstance(cb, MetricsCallback)]
    for cb in set_aside:
        trainer.remove_callback(cb)
    trainer.callback_handler.callbacks.insert(0, callback)  # first: trackers after it see its fastkit/... log keys
    if resume and "resume_from_checkpoint" not in train_kwargs:
        last = last_checkpoint(trainer.args.output_dir)
        if last is not None:
            logger.info("fastkit: resuming from %s", last)
            train_kwargs["resume_from_checkpoint"] = last
    try:
        trainer.train(**train_kwargs)
    except KeyboardInterrupt:
        step = _settle(trainer, callback)
        logger.warning("fastkit: training interrupted after step %d/%d; the model keeps the weights trained so far.",
                       step, callback.metrics.max_steps)
        callback.finish("interrupted", f"stopped by the user after step {step}")
    except Exception as exc:
        _settle(trainer, callback)
        callback.finish("failed", f"{type(exc).__name__}: {shorten(str(exc), 120)}")
        raise
    finally:
        trainer.remove_callback(callback)
        for cb in set_aside:  # make_trainer's dashboard back in front of the trackers, the rest at the end
            if isinstance(cb, MetricsCallback):
                trainer.callback_handler.callbacks.insert(0, cb)
            else:
                trainer.add_callback(cb)
    return callback.metrics


def last_checkpoint(output_dir: str) -> str | None:
    """The newest ``checkpoint-<step>`` folder in ``output_dir``, or None (also when the folder is missing)."""
    import os

    from transformers.trainer_utils import get_last_checkpoint

    return get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None


def _settle(trainer, callback: MetricsCallback) -> int:
    """After an interrupted step: drop half-made gradients and cached blocks so the model is usable.

    Returns the optimizer steps done (the trainer counts a step before its step-end callbacks run,
    so this can be one more than the last step the dashboard saw).
    """
    trainer.model.zero_grad(set_to_none=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    callback.metrics.step = max(callback.metrics.step, int(trainer.state.global_step))
    return callback.metrics.step


__all__ = ["check_distributed_mode", "fit", "last_checkpoint", "make_trainer"]
