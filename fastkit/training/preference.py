"""Preference tuning (DPO, KTO) and reasoning RL (GRPO) with TRL's own trainers on fastkit's model.

:func:`make_dpo_trainer` returns a ``trl.DPOTrainer``, :func:`make_kto_trainer` a ``trl.KTOTrainer`` (unpaired
feedback: :mod:`fastkit.training.kto`), :func:`make_grpo_trainer` a ``trl.GRPOTrainer`` — TRL's
classes, unchanged, with fastkit's defaults around them (the same as :func:`fastkit.training.make_trainer`'s:
precision and optimizer from the device, ``use_cpu`` on a CPU, checkpointing owned by fastkit, the dashboard
attached) and their data checked at the door (:mod:`fastkit.training.dpo`, :mod:`fastkit.training.grpo`).
:func:`fastkit.fit` runs either under the dashboard with the same new-run / resume rules as SFT.

The reference model is the same PEFT model with its adapter disabled — no second model copy and no copy of the
adapter: TRL 1.16's DPOTrainer (and KTOTrainer) copies a PEFT model's adapter into a frozen ``"ref"`` adapter;
when that adapter is still at its initialization (LoRA B all zero: a fresh ``get_peft_model``) the copy equals the
base model, so fastkit deletes it and TRL falls back to ``disable_adapter()``. A trained adapter (DPO after SFT)
keeps TRL's ``"ref"`` copy (the SFT model is the reference). GRPOTrainer disables the adapter itself.

DPO packs each batch's chosen and rejected rows into one padding-free row through fastkit's packing patch
(:mod:`fastkit.training.dpo`); GRPO generates with transformers' ``generate`` (TRL's default; TRL's vLLM mode,
``use_vllm=True``, is TRL's and passes through untouched).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, KTOConfig, KTOTrainer

from fastkit import checks
from fastkit.dashboard.views import VIEWS
from fastkit.data.read import as_dataset
from fastkit.errors import FastkitError
from fastkit.patching import change, unwrap
from fastkit.training import dpo, grpo, grpo_pack, kto
from fastkit.training.args import check_distributed_mode, device_args, training_args
from fastkit.training.base import FastTrainerMixin
from fastkit.training.card import data_name
from fastkit.training.options import DEFAULT_MAX_STEPS, check_report_to, default_eval_steps
from fastkit.training.record import RunRecord

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RunOptions:
    """What every fastkit trainer takes, DPO and GRPO alike (make_trainer's names and meanings)."""

    max_steps: int | None = None
    """Optimizer steps (None with epochs None: 60)."""
    epochs: float | None = None
    """Passes over the data instead of max_steps."""
    learning_rate: float = 5e-5
    """AdamW learning rate (LoRA; TRL's 1e-6 default is for full fine-tuning)."""
    batch_size: int = 1
    """DPO: pairs per device step. GRPO: prompts per device step (each generates num_generations completions)."""
    gradient_accumulation_steps: int = 1
    """Device steps per optimizer step."""
    output_dir: str = "outputs"
    """Checkpoints and logs."""
    seed: int = 3407
    """Seed of the run (data order, sampling)."""
    save_steps: int | None = None
    """Save a checkpoint every that many steps (2 kept); None saves none."""
    report_to: str | Sequence[str] = "none"
    """Trackers: 'none', 'tensorboard', 'wandb', 'trackio' (each only when installed)."""
    dashboard: str = "auto"
    """'auto', 'html', 'widget', 'terminal', 'none'."""

    def check(self) -> None:
        checks.check_positive("learning_rate", self.learning_rate, integer=False)
        checks.check_positive("batch_size", self.batch_size)
        checks.check_positive("gradient_accumulation_steps", self.gradient_accumulation_steps)
        checks.check_positive("save_steps", self.save_steps, allow_none=True)
        checks.check_non_negative_int("seed", self.seed)
        checks.check_choice("dashboard", self.dashboard, VIEWS)
        checks.check_save_target(self.output_dir, "output_dir")


def _base_config(model: torch.nn.Module, run: RunOptions, overrides: dict[str, Any], config_cls) -> dict[str, Any]:
    """The TrainingArguments values of a DPO / KTO / GRPO run: the ones every trainer shares
    (:func:`~fastkit.training.args.training_args`), then the caller's ``config_cls`` fields (refused by name when
    they are not its fields)."""
    checks.check_known_options(config_cls.__name__, overrides, {f.name for f in dataclasses.fields(config_cls)})
    config = training_args(run, report_to=check_report_to(run.report_to), **device_args(model))
    config.update(overrides)
    return config


def _record(run: RunOptions, overrides: dict[str, Any], examples: int | None = None) -> RunRecord:
    """A preference / RL run's record: its options, the dashboard's examples, a log every step unless the caller
    chose ``logging_steps``."""
    return RunRecord(options=run, examples=examples, log_every_step="logging_steps" not in overrides)


class FastDPOTrainer(FastTrainerMixin, DPOTrainer):
    """:func:`make_dpo_trainer`'s trainer: TRL's ``DPOTrainer`` whose reference is the same model with its adapter
    disabled (:func:`use_disabled_adapter_as_reference`), the pairs TRL tokenized checked against
    ``max_seq_length`` (``drop_long``: dropped instead), and each batch's chosen and rejected rows run as one
    padding-free packed row where fastkit's packing patch is active (``packing``)."""

    def __init__(self, *args: Any, max_seq_length: int, drop_long: bool = False, packing: bool = True,
                 **kwargs: Any):
        self._limits, self._packing = (max_seq_length, drop_long), packing
        super().__init__(*args, **kwargs)

    def finish(self) -> None:
        self.update_record(reference=use_disabled_adapter_as_reference(self))
        _checked_tokenized(self, self._check_rows)
        packed = self._packing and dpo.pack_pairs(self.model)
        if self._packing and not packed:
            logger.info("fastkit: DPO pairs padded (no active fastkit packing patch on this model)")
        if packed:
            self.data_collator = dpo.PairLengthsCollator(self.data_collator)
        self.update_record(data=data_name(self.train_dataset), packed=packed)

    def _check_rows(self) -> None:
        self.train_dataset = dpo.check_tokenized_pairs(self.train_dataset, *self._limits)


class FastKTOTrainer(FastTrainerMixin, KTOTrainer):
    """:func:`make_kto_trainer`'s trainer: TRL's ``KTOTrainer`` with the reference as DPO's, the rows TRL tokenized
    checked against ``max_seq_length`` (``drop_long``: dropped instead; both labels in each device batch's reach),
    and the KL rows (a neighbour's completion) cut at ``max_seq_length`` too."""

    def __init__(self, *args: Any, max_seq_length: int, drop_long: bool = False, **kwargs: Any):
        self._limits = (max_seq_length, drop_long)
        super().__init__(*args, **kwargs)

    def finish(self) -> None:
        self.update_record(reference=use_disabled_adapter_as_reference(self))
        _checked_tokenized(self, self._check_rows)
        self.args.max_length = self.data_collator.max_length = self._limits[0]  # KL rows (a neighbour's completion)
        self.update_record(data=data_name(self.train_dataset), examples=len(self.train_dataset))

    def _check_rows(self) -> None:
        batch = self.run_record.options.batch_size
        self.train_dataset = kto.check_tokenized_rows(self.train_dataset, *self._limits, batch)
        if self.eval_dataset is not None:
            self.eval_dataset = kto.check_tokenized_rows(self.eval_dataset, *self._limits, batch, "eval_dataset",
                                                         both_labels=False)


class FastGRPOTrainer(FastTrainerMixin, grpo.CountedRewards, grpo_pack.PackedLogps, GRPOTrainer):
    """:func:`make_grpo_trainer`'s trainer: TRL's ``GRPOTrainer`` with fastkit's checkpointing kept through TRL's
    no-grad passes, its None rewards counted (:class:`~fastkit.training.grpo.CountedRewards`), and its log-prob
    passes on packed rows where fastkit's packing patch is active (``packing``:
    :class:`~fastkit.training.grpo_pack.PackedLogps`)."""

    def __init__(self, *args: Any, packing: bool = True, **kwargs: Any):
        self._packing = packing
        super().__init__(*args, **kwargs)

    def finish(self) -> None:
        keep_fastkit_checkpointing(self.model)
        how = "none (beta=0)" if not self.args.beta else "the same model with its adapter disabled"
        self.update_record(data=data_name(self.train_dataset), reference=how)
        grpo.watch_rewards(self)  # None rewards counted; batches no function scored refused (grpo's module docs)
        packed = self._packing and grpo_pack.pack_logps(self)
        if self._packing and not packed:
            logger.info("fastkit: GRPO log-prob passes padded (no active fastkit packing patch on this model)")
        self.update_record(packed=packed)


def keep_fastkit_checkpointing(model: torch.nn.Module) -> None:
    """Make TRL's ``disable_gradient_checkpointing`` (around its no-grad reference / old-policy passes) a no-op.

    Under ``torch.no_grad`` checkpointing saves nothing anyway, but TRL turns it back on with
    ``gradient_checkpointing_enable(args.gradient_checkpointing_kwargs)``, which replaces every layer's checkpoint
    function: fastkit's offloaded checkpoint would be gone after the first reference pass. TRL reads
    ``model.is_gradient_checkpointing``; an instance attribute False on the trainer's model (through
    :func:`fastkit.patching.change`, so ``fastkit.revert`` removes it) keeps fastkit's checkpointing as it is.
    """
    change(model, "trl_keeps_checkpointing", lambda swap: swap.setattr(model, "is_gradient_checkpointing", False))


def _check_peft(model: torch.nn.Module, what: str) -> None:
    if not hasattr(model, "peft_config"):
        raise FastkitError(f"{what} trains a LoRA adapter: wrap the model first with FastModel.get_peft_model(model, "
                           "...) (the reference model is then the same model with its adapter disabled, no copy).")


def _adapter_is_fresh(model: torch.nn.Module, adapter: str = "default") -> bool:
    """True when every LoRA B of ``adapter`` is zero (a fresh adapter: the model equals its base). One read."""
    tag = f".{adapter}."
    bs = [p for n, p in model.named_parameters() if "lora_B" in n and tag in n]
    if not bs:
        return False
    return not bool(torch.stack([b.detach().abs().max() for b in bs]).max() > 0)


def use_disabled_adapter_as_reference(trainer) -> str:
    """Drop TRL's ``"ref"`` adapter copy when the adapter is fresh (then disabling it gives the same reference).

    Returns how the reference log-probs are computed, in words (also logged)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    if "ref" not in getattr(model, "peft_config", {}):
        how = "the same model with its adapter disabled"
    elif _adapter_is_fresh(model):
        model.delete_adapter("ref")
        model.set_adapter("default")
        how = "the same model with its adapter disabled (fresh adapter: TRL's 'ref' adapter copy dropped)"
    else:
        how = "a frozen copy of the trained adapter ('ref', TRL's; the base weights are shared)"
    logger.info("fastkit: reference log-probs from %s", how)
    return how


def _drop_old_reference(model: torch.nn.Module) -> None:
    """An earlier DPOTrainer's / KTOTrainer's frozen ``"ref"`` adapter off the model (TRL refuses to add a second
    one; the new trainer copies the adapter as it is now)."""
    if "ref" in getattr(model, "peft_config", {}):
        model.delete_adapter("ref")
        model.set_adapter("default")
        logger.info("fastkit: an earlier trainer's 'ref' adapter removed; the reference is the adapter now")


def make_dpo_trainer(model: torch.nn.Module, tokenizer, train_dataset, *, beta: float = 0.1,
                     max_seq_length: int | None = None, packing: bool = True, drop_long: bool = False,
                     eval_dataset=None, callbacks: Sequence[Any] = (), **options: Any):
    """A ``trl.DPOTrainer`` for a fastkit LoRA model on preference pairs (checked first, errors before any step).

    ``train_dataset``: rows of ``prompt`` / ``chosen`` / ``rejected`` as text or as lists of messages (or
    ``chosen`` / ``rejected`` as whole conversations), anything :func:`fastkit.data.read.as_dataset` reads.
    ``beta``: DPO's KL strength (TRL's default 0.1). ``packing=True`` (default where fastkit's packing patch is
    active) runs each batch's chosen and rejected rows as one padding-free packed row, exact against the padded
    batch; False pads like TRL. ``drop_long=True`` drops pairs above ``max_seq_length`` instead of refusing them.
    The run options (``max_steps`` / ``epochs``, ``learning_rate``, ``batch_size``, ...) are :class:`RunOptions`;
    anything else is a ``DPOConfig`` field (refused by name when it is not one).
    """
    run, overrides = _split_options(options)
    _check_peft(model, "make_dpo_trainer")
    checks.check_positive("beta", beta, integer=False)
    checks.check_bool("packing", packing)
    checks.check_bool("drop_long", drop_long)
    max_seq_length = _max_length(tokenizer, max_seq_length, model)
    dataset = as_dataset(train_dataset)
    dpo.check_pairs(dataset, tokenizer)
    if eval_dataset is not None:
        eval_dataset = as_dataset(eval_dataset, where="eval_dataset")
        dpo.check_pairs(eval_dataset, tokenizer, "eval_dataset")
    config = _base_config(model, run, overrides, DPOConfig)
    config.update(beta=beta, max_length=max_seq_length, **_eval_config(eval_dataset, run, overrides))
    return _reference_free_trainer(FastDPOTrainer, DPOConfig, config, model, tokenizer, (dataset, eval_dataset),
                                   callbacks, record=_record(run, overrides, len(dataset)),
                                   max_seq_length=max_seq_length, drop_long=drop_long, packing=packing)


def make_kto_trainer(model: torch.nn.Module, tokenizer, train_dataset, *, beta: float = 0.1,
                     desirable_weight: float = 1.0, undesirable_weight: float = 1.0, max_seq_length: int | None = None,
                     drop_long: bool = False, eval_dataset=None, callbacks: Sequence[Any] = (), **options: Any):
    """A ``trl.KTOTrainer`` for a fastkit LoRA model on unpaired feedback (checked first, errors before any step).

    ``train_dataset``: rows of ``prompt`` / ``completion`` / ``label`` (True: a desirable completion; 1 / 0 read as
    True / False), text or lists of messages, anything :func:`fastkit.data.read.as_dataset` reads; preference pairs
    (``prompt`` / ``chosen`` / ``rejected``) are unpaired first. Both labels must occur (:mod:`fastkit.training.kto`).
    ``beta``: KTO's KL strength (TRL's default 0.1); ``desirable_weight`` / ``undesirable_weight``: the weights of
    the two kinds of rows' losses (TRL logs the range it recommends when the labels are imbalanced). The reference
    is the same model with its adapter disabled, as for :func:`make_dpo_trainer`. Rows are padded (no packing).
    ``batch_size`` defaults to 2: KTO estimates its KL baseline from each row's prompt with its batch neighbour's
    completion, so TRL needs at least 2 rows per device step (and reads the rows in order). ``drop_long=True`` drops
    rows above ``max_seq_length`` instead of refusing them. Other run options as :func:`make_dpo_trainer`; anything
    else is a ``KTOConfig`` field (refused by name when it is not one).
    """
    run, overrides = _split_options({"batch_size": 2, **options})
    _check_kto_options(model, run, overrides, beta, desirable_weight, undesirable_weight, drop_long)
    max_seq_length = _max_length(tokenizer, max_seq_length, model)
    dataset = kto.check_rows(kto.unpaired(as_dataset(train_dataset)), tokenizer)
    if eval_dataset is not None:
        eval_dataset = as_dataset(eval_dataset, where="eval_dataset")
        eval_dataset = kto.check_rows(kto.unpaired(eval_dataset, "eval_dataset"), tokenizer, "eval_dataset", False)
    config = _base_config(model, run, overrides, KTOConfig)
    config.update(beta=beta, desirable_weight=desirable_weight, undesirable_weight=undesirable_weight,
                  max_length=None, **_eval_config(eval_dataset, run, overrides))  # lengths: checked below
    return _reference_free_trainer(FastKTOTrainer, KTOConfig, config, model, tokenizer, (dataset, eval_dataset),
                                   callbacks, record=_record(run, overrides), max_seq_length=max_seq_length,
                                   drop_long=drop_long)


def _reference_free_trainer(trainer_cls, config_cls, config: dict[str, Any], model: torch.nn.Module, tokenizer,
                            data, callbacks: Sequence[Any], **kwargs: Any):
    """fastkit's DPO / KTO trainer on ``model`` with no second model (``data``: train, eval or None): the reference is
    the same model with its adapter disabled (:func:`use_disabled_adapter_as_reference`); the KV cache off while
    training; ``kwargs``: the trainer class's own."""
    check_distributed_mode(model, config)
    change(model, "use_cache", lambda swap: swap.setattr(unwrap(model).config, "use_cache", False))
    _drop_old_reference(model)
    return trainer_cls(model=model, args=config_cls(**config), train_dataset=data[0], eval_dataset=data[1],
                       processing_class=tokenizer, callbacks=list(callbacks), **kwargs)


def _checked_tokenized(trainer, check: Callable[[], None]) -> None:
    """``check()`` on the rows TRL tokenized (a refusal leaves the model as it came in: TRL's reference adapter
    dropped), then fastkit's checkpointing put back (TRL's init set transformers' own)."""
    try:
        check()
    except FastkitError:
        _drop_old_reference(trainer.model)
        raise
    keep_fastkit_checkpointing(trainer.model)


def _check_kto_options(model, run: RunOptions, overrides: dict[str, Any], beta, desirable_weight, undesirable_weight,
                       drop_long) -> None:
    _check_peft(model, "make_kto_trainer")
    checks.check_positive("beta", beta, integer=False)
    checks.check_positive("desirable_weight", desirable_weight, integer=False)
    checks.check_positive("undesirable_weight", undesirable_weight, integer=False)
    checks.check_bool("drop_long", drop_long)
    if overrides.get("loss_type", "kto") != "apo_zero_unpaired" and run.batch_size < 2:
        raise FastkitError(f"batch_size={run.batch_size}: KTO estimates its KL baseline from each row's prompt with "
                           "another row's completion of the same device batch: give batch_size >= 2 (or "
                           "loss_type='apo_zero_unpaired', which has no KL term).")


def make_grpo_trainer(model: torch.nn.Module, tokenizer, train_dataset, *, reward_funcs, num_generations: int = 4,
                      max_completion_length: int = 256, beta: float = 0.04, temperature: float = 1.0,
                      max_prompt_length: int | None = None, packing: bool = True, callbacks: Sequence[Any] = (),
                      **options: Any):
    """A ``trl.GRPOTrainer`` for a fastkit LoRA model on prompts (checked first), with the reward functions wrapped
    so that one that raises, returns None or the wrong number of rewards names itself and the row.

    ``train_dataset``: a ``prompt`` column (text, or a list of messages ending with the user's turn) and any
    columns the reward functions read by name (``answer`` for :func:`fastkit.training.rewards.exact_answer`):
    a reward function's required keyword argument that is not a column is refused before any generation.
    ``num_generations`` completions per prompt (G), each at most ``max_completion_length`` tokens, generated by
    transformers' ``generate``. ``beta``: KL strength against the reference (the adapter disabled), 0 turns the
    reference pass and the KL metric off. ``max_prompt_length``: refuse longer prompts (default: the tokenizer's
    ``model_max_length`` less ``max_completion_length``). ``packing=True`` (default where fastkit's packing patch is
    active) runs the policy's and the reference's log-prob passes on one padding-free packed row
    (:mod:`fastkit.training.grpo_pack`), exact against the padded rows; False pads like TRL. Run options as for
    :func:`make_dpo_trainer`
    (``batch_size`` counts prompts); anything else is a ``GRPOConfig`` field.
    """
    run, overrides = _split_options(options)
    _check_peft(model, "make_grpo_trainer")
    checks.check_positive("num_generations", num_generations)
    checks.check_positive("max_completion_length", max_completion_length)
    checks.check_positive("temperature", temperature, integer=False)
    checks.check_bool("packing", packing)
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or beta < 0:
        raise FastkitError(f"beta must be a number >= 0 (0: no reference pass, no KL), got {beta!r}.")
    if num_generations < 2:
        raise FastkitError(f"num_generations={num_generations}: GRPO compares completions of the same prompt, give "
                           "at least 2.")
    funcs = grpo.wrap_reward_funcs(reward_funcs)
    dataset = as_dataset(train_dataset)
    limit = max_prompt_length or _prompt_room(_max_length(tokenizer, None, model), max_completion_length)
    grpo.check_prompts(dataset, tokenizer, funcs, limit)
    config = _base_config(model, run, overrides, GRPOConfig)
    prompts_per_step = config["per_device_train_batch_size"]
    config.update(per_device_train_batch_size=prompts_per_step * num_generations, num_generations=num_generations,
                  max_completion_length=max_completion_length, beta=float(beta), temperature=temperature,
                  generation_kwargs={"use_cache": True, **(overrides.get("generation_kwargs") or {})})
    check_distributed_mode(model, config)
    change(model, "use_cache", lambda swap: swap.setattr(unwrap(model).config, "use_cache", False))
    return FastGRPOTrainer(model=model, args=GRPOConfig(**config), train_dataset=dataset, processing_class=tokenizer,
                           reward_funcs=funcs, callbacks=list(callbacks), packing=packing,
                           record=_record(run, overrides, len(dataset)))


def _prompt_room(context: int, max_completion_length: int) -> int:
    """Tokens left for a GRPO prompt in the model's ``context`` after ``max_completion_length``; a FastkitError
    when none are."""
    if max_completion_length >= context:
        raise FastkitError(f"max_completion_length={max_completion_length} leaves no room for a prompt within the "
                           f"model's {context} tokens (max_seq_length): lower max_completion_length, raise "
                           "max_seq_length, or give max_prompt_length.")
    return context - max_completion_length


def _split_options(options: dict[str, Any]) -> tuple[RunOptions, dict[str, Any]]:
    names = {f.name for f in dataclasses.fields(RunOptions)}
    run = RunOptions(**{k: v for k, v in options.items() if k in names})
    run.check()
    return run, {k: v for k, v in options.items() if k not in names}


def _max_length(tokenizer, max_seq_length: int | None, model: torch.nn.Module | None = None) -> int:
    """The length limit of a preference run: the one given, else the length the model was loaded with (what SFT's
    make_trainer takes: ``report(model).max_seq_length``), else the tokenizer's ``model_max_length`` (capped)."""
    if max_seq_length is not None:
        checks.check_max_seq_length(max_seq_length)
        return max_seq_length
    from fastkit.patching import report

    loaded = report(unwrap(model)) if model is not None else None
    if loaded is not None and loaded.max_seq_length:
        return int(loaded.max_seq_length)
    return min(int(getattr(tokenizer, "model_max_length", 2048) or 2048), 1 << 20)


def _eval_config(eval_dataset, run: RunOptions, overrides: dict[str, Any]) -> dict[str, Any]:
    if eval_dataset is None:
        return {}
    steps = overrides.get("eval_steps") or default_eval_steps(run.max_steps or DEFAULT_MAX_STEPS)
    return {"eval_strategy": "steps", "eval_steps": steps, "per_device_eval_batch_size": run.batch_size}


__all__ = ["FastDPOTrainer", "FastGRPOTrainer", "FastKTOTrainer", "RunOptions", "make_dpo_trainer", "make_grpo_trainer",
           "make_kto_trainer", "use_disabled_adapter_as_reference"]
