"""Training with TRL's ``SFTTrainer``, set up the way fastkit's patches expect, under the dashboard.

:func:`make_trainer` returns a :class:`fastkit.training.trainer.ZeroSyncSFTTrainer` (``trl.SFTTrainer`` with the same
arguments and logs, and no host-device sync between log points: docs/step.md) with
defaults that work on a 2-core CPU and on a T4 alike (precision from the device, packing on,
responses-only loss), after :func:`fastkit.data.check_dataset` has refused bad data.
:func:`fit` runs it with the live dashboard (:mod:`fastkit.dashboard`) and turns a
``KeyboardInterrupt`` into a clean stop. Chat and save: :mod:`fastkit.export`.

Gradient checkpointing is owned by ``FastModel.get_peft_model`` / :func:`fastkit.enable_checkpointing`
(plain or offloaded); ``SFTConfig.activation_checkpointing`` stays off so TRL does not replace it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

from fastkit import _hf, checks
from fastkit.dashboard import MetricsCallback, TrainingMetrics, dashboard_callback
from fastkit.dashboard.render import shorten
from fastkit.dashboard.views import VIEWS
from fastkit.data import check_dataset
from fastkit.data.read import stream_source
from fastkit.data.stream import is_stream
from fastkit.data.vision import VisionCollator, fetch_images, is_processor
from fastkit.data.workers import data_workers, frozen_heap
from fastkit.device import auto_dtype
from fastkit.distributed import ranks
from fastkit.errors import FastkitError
from fastkit.families.twins import twin_source
from fastkit.patching import active_patches, change, report, unwrap
from fastkit.training.identity import (
    ExtendedSchedule,
    RunGuard,
    check_resumable,
    checkpoints,
    set_aside_old_checkpoints,
)
from fastkit.training.options import (
    DEFAULT_MAX_STEPS,
    TRACKERS,
    TrainOptions,
    available_trackers,
    check_report_to,
    default_eval_steps,
    trackers,
    write_config,
)

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


def make_trainer(
    model: torch.nn.Module,
    tokenizer,
    train_dataset,
    options: TrainOptions | None = None,
    *,
    eval_dataset=None,
    callbacks: Sequence[Any] = (),
    **kwargs: Any,
):
    """A ``trl.SFTTrainer`` (a :class:`~fastkit.training.trainer.ZeroSyncSFTTrainer`) for ``model`` on ``train_dataset``
    (checked first, errors before any step), set up by ``options``
    (:class:`~fastkit.training.options.TrainOptions`: every knob with its help text and default).

    ``make_trainer(model, tok, data, max_steps=100, warmup_ratio=0.1)`` is the same as
    ``make_trainer(model, tok, data, options=TrainOptions(max_steps=100, sft={"warmup_ratio": 0.1}))``: keyword
    arguments are TrainOptions fields (or their SFTConfig names, e.g. ``num_train_epochs``) or any other
    ``trl.SFTConfig`` field; given with ``options`` they change those options.

    Length: ``max_steps`` optimizer steps or ``epochs`` passes over the data, one of them (neither:
    60 steps). :func:`run_coverage` says how much of the data that is.
    ``report_to``: 'none' (default), or 'tensorboard', 'wandb', 'trackio' (one or a list), each only
    when installed (refused with the pip command otherwise).
    ``eval_split``: hold out that fraction (0 < x < 1) or number of rows of ``train_dataset`` as the
    eval set (seeded), instead of passing ``eval_dataset``.

    ``drop_long=True`` drops rows longer than ``max_seq_length`` (logged) instead of refusing the data;
    ``drop_invalid=True`` drops rows with nothing to train (see :func:`fastkit.data.check_dataset`).

    ``eval_dataset`` (checked like the training data) is evaluated every ``eval_steps`` steps and after the last
    (default: about 5 times a run, at most every 10 steps: :func:`~fastkit.training.options.default_eval_steps`) and
    its loss shows on the dashboard; ``early_stopping_patience`` stops the run when that
    loss has not improved for that many evaluations. ``save_steps`` saves a checkpoint every that many steps
    into ``output_dir`` (the ``save_total_limit`` newest kept; ``fit(trainer, resume=True)`` continues from the
    last one); None saves none. ``dashboard`` ('auto', 'html', 'widget', 'terminal', 'none') attaches
    the dashboard callback, so a plain ``trainer.train()`` shows progress too (:func:`fit` swaps in its
    own); ``measure_syncs`` counts host-device syncs of one step on it (a debug switch).

    ``chunked_loss``: compute the loss and TRL's entropy / accuracy metrics with fastkit's chunked
    cross-entropy (:mod:`fastkit.patches.loss.patch`) instead of TRL's fused LM head; default on off CUDA
    (TRL's torch fallback holds more than the full logits there), TRL's Triton kernel on CUDA.
    """
    from fastkit.training.trainer import ZeroSyncSFTTrainer

    ranks.quiet_replicas()  # torchrun / accelerate launch: one process reports
    options = _options(options, kwargs)
    max_steps, epochs = _run_length(options.max_steps, options.epochs)
    if is_processor(tokenizer):  # image + text rows: what does not apply to them, before anything is read
        check_vision_options(options)
    if options.streaming and not is_stream(train_dataset):  # a path, a Hub id or rows, read as the trainer draws
        train_dataset = stream_source(train_dataset, where="train_dataset")
    check_stream_options(train_dataset, options, epochs)
    checks.check_save_target(options.output_dir, "output_dir")
    _check_eval_options(options, eval_dataset)
    loaded = report(model)  # the load's max_seq_length, checked there (Note: [max_seq_length] in fastkit.loader)
    max_seq_length = options.max_seq_length or (loaded.max_seq_length if loaded is not None else 2048)
    if options.max_seq_length is not None:  # above the model's context: positions past it were never trained
        checks.check_max_seq_length(max_seq_length, getattr(unwrap(model), "config", None))
    _check_packing_supported(model, options.packing)
    evaluate = eval_dataset is not None or bool(options.eval_split)
    config = sft_config(options, evaluate=evaluate, cuda=model.device.type == "cuda", optim=_default_optim(model),
                        precision=_precision(model), max_seq_length=max_seq_length,
                        every_parameter_used=every_parameter_used(model))
    _log_processes(config)
    check_distributed_mode(model, config)
    args = build_sft_config(config)  # SFTConfig's own checks, before the data is read
    if is_processor(tokenizer):  # a vision-language model: image + text rows, its processor collates them
        return _vision_trainer(model, tokenizer, (train_dataset, eval_dataset), args, options, callbacks,
                               max_seq_length)
    given_eval = eval_dataset
    with frozen_heap():  # forked data workers share this process's pages (fastkit.data.workers)
        dataset, eval_dataset = _checked_data(options, train_dataset, eval_dataset, tokenizer, max_seq_length,
                                              tokenize=_pre_tokenize(args))
    rows = None if is_stream(dataset) else len(dataset)  # a stream's length is not known ahead
    for given, checked, where in ((train_dataset, dataset, "train_dataset"), (given_eval, eval_dataset,
                                                                              "eval_dataset")):
        if _arrives_tokenized(given):  # fastkit's own tokenization used this model's tokenizer
            _check_token_ids(checked, model, where)
    if args.dataset_num_proc is None and rows is not None:  # TRL's labels / packing passes: the cores there are
        args.dataset_num_proc = data_workers(rows)
    # never mix documents through a KV cache while training (fastkit.revert puts the user's value back)
    change(model, "use_cache", lambda swap: swap.setattr(unwrap(model).config, "use_cache", False))
    with frozen_heap():  # TRL's passes fork dataset_num_proc workers too
        trainer = ZeroSyncSFTTrainer(model=model, args=args, train_dataset=dataset, eval_dataset=eval_dataset,
                                     processing_class=tokenizer, callbacks=[*callbacks, *_early_stopping(options)])
    _attach_run(trainer, options, rows)
    _count_drops(trainer, dataset)
    _epoch_steps(trainer, options, eval_dataset is not None)  # now that the packed rows are known
    _attach_packed_metadata(trainer)
    _name_in_model_card(trainer, train_dataset)
    _route_loss(trainer, model, _host_weights_in_trainer(trainer, options.chunked_loss))
    return trainer


def _vision_trainer(model, processor, data, args, options: TrainOptions, callbacks, max_seq_length: int):
    """The SFT trainer of a vision-language model: ``data`` = (train, eval or None) rows checked
    (:func:`fastkit.data.vision.rows_within`; ``eval_split`` rows held out of train, seeded), then handed to TRL as
    they are, collated by the processor with the loss on assistant turns only; the dashboard attached and the
    options kept as for text (:func:`fit` runs it)."""
    from fastkit.training.trainer import ZeroSyncSFTTrainer

    rows, eval_rows = _vision_rows(data, processor, options, max_seq_length)
    if options.packing:  # the family's packing patch is active, but this collator pads
        logger.info("fastkit: packing=True: image + text rows are collated as padded rows, one example each")
    args.remove_unused_columns = False  # the collator reads messages and images
    args.dataset_kwargs = {**(args.dataset_kwargs or {}), "skip_prepare_dataset": True}
    change(model, "use_cache", lambda swap: swap.setattr(unwrap(model).config, "use_cache", False))
    # the rows stay Python objects (PIL images), the datasets hold their indices into train + eval rows; the
    # digests make the run's data fingerprint (resume checks it)
    train = _row_indices(rows, 0)
    held = _row_indices(eval_rows, len(rows)) if eval_rows else None
    trainer = ZeroSyncSFTTrainer(model=model, args=args, train_dataset=train, eval_dataset=held,
                                 processing_class=processor,
                                 data_collator=VisionCollator(processor, max_seq_length, rows + eval_rows),
                                 callbacks=[*callbacks, *_early_stopping(options)])
    _attach_run(trainer, options, len(rows))
    _epoch_steps(trainer, options, held is not None)
    _name_in_model_card(trainer, data[0])
    return trainer


def check_vision_options(options: TrainOptions) -> None:
    """What does not apply to image + text rows, refused before they are read (packing: the model's own check)."""
    if options.streaming:
        raise FastkitError("streaming=True: image + text rows are read whole (each row's images are checked before "
                           "any step); drop streaming=True.")
    if options.drop_invalid:
        raise FastkitError("drop_invalid=True applies to text rows; a bad image + text row is refused by name: fix "
                           "or remove it and drop drop_invalid=True.")


def _vision_rows(data, processor, options: TrainOptions, max_seq_length: int) -> tuple[list, list]:
    """(train rows, eval rows) read (a file: :func:`~fastkit.data.vision.read_image_rows`), URLs fetched, checked
    (``drop_long`` drops the long ones), ``eval_split`` rows held out of train (seeded)."""
    train, held = (_image_rows(d, where) for d, where in zip(data, ("train_dataset", "eval_dataset")))
    train = _within(train, processor, options, max_seq_length, "train_dataset")
    if held is not None:
        return train, _within(held, processor, options, max_seq_length, "eval_dataset")
    return split_rows(train, options.eval_split, options.seed)


def _image_rows(data, where: str) -> list | None:
    from fastkit.data.vision import read_image_rows

    if data is None:
        return None
    if isinstance(data, (str, os.PathLike)):  # an image-row file, else anything as_dataset reads
        from fastkit.data.read import as_dataset

        read = read_image_rows(data, where)
        data = read if read is not None else as_dataset(data, where=where)
    return fetch_images(list(data))  # every URL fetched once, before any step


def _within(rows: list, processor, options: TrainOptions, max_seq_length: int, where: str) -> list:
    from fastkit.data.vision import rows_within

    return [row for row, _ in rows_within(rows, processor, max_seq_length, where=where, drop_long=options.drop_long)]


def split_rows(rows: list, eval_split: float | int, seed: int) -> tuple[list, list]:
    """(train, eval): ``eval_split`` rows (a fraction or a count) of ``rows`` held out, seeded; no split: (rows, [])."""
    if not eval_split:
        return rows, []
    import random

    held = set(random.Random(seed).sample(range(len(rows)), _eval_count(eval_split, len(rows))))
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]


def _row_indices(rows: list, start: int):
    """The Dataset a vision trainer iterates: each row's index into the collator's rows, and its content digest."""
    from datasets import Dataset

    from fastkit.data.vision import ROW_KEY, row_digest

    return Dataset.from_dict({ROW_KEY: list(range(start, start + len(rows))),
                              "fastkit_row_digest": [row_digest(r) for r in rows]})


def _epoch_steps(trainer, options: TrainOptions, evaluate: bool) -> None:
    """An ``epochs`` run's step counts that depend on its length (known once the trainer holds the rows)."""
    if options.epochs is None:
        return
    total = planned_steps(trainer)
    trainer.args.warmup_steps = options.warmup_steps if options.warmup_steps is not None else min(5, total // 10)
    if evaluate and options.eval_steps is None:
        trainer.args.eval_steps = default_eval_steps(total)


def _attach_run(trainer, options: TrainOptions, rows: int | None) -> None:
    """The live dashboard (first among the callbacks: trackers after it see its fastkit/... log keys) and the
    options :func:`fit` saves as output_dir/fastkit_config.yaml. The dashboard asks for a log every step (live
    curves) unless the caller chose logging_steps: then it wins. FSDP given back on CPU processes
    (:func:`_fsdp_processes`)."""
    _fsdp_processes(trainer)
    dash = dashboard_callback(options.dashboard, examples=rows, measure_syncs=options.measure_syncs,
                              log_every_step=options.logging_steps is None)
    trainer.callback_handler.callbacks.insert(0, dash)
    trainer.fastkit_options = options
    trainer.fastkit_config = {**options.to_dict()}


def _count_drops(trainer, dataset) -> None:
    """A stream read with drop_invalid / drop_long: the rows it dropped in all, logged at the end of training."""
    dropped = getattr(dataset, "fastkit_dropped", None)
    if dropped is None or dropped.why == "none asked":
        return
    from transformers import TrainerCallback

    class _Dropped(TrainerCallback):
        def on_train_end(self, args, state, control, **kwargs):
            logger.log(logging.WARNING if dropped.count else logging.INFO, "fastkit: %s", dropped.summary())

    trainer.add_callback(_Dropped())
    trainer.fastkit_dropped = dropped


def every_parameter_used(model: torch.nn.Module) -> bool:
    """True when each step gives every trainable parameter a gradient: fastkit's checkpointing is on (as the
    Trainer reasons for a checkpointed transformers model: DDP's unused-parameter search and checkpointing do
    not mix) and the model routes no tokens (a MoE expert no token reached would get no gradient)."""
    base = unwrap(model)
    routed = getattr(getattr(base, "config", None), "num_experts_per_tok", None) is not None
    return bool(getattr(base, "is_activation_checkpointing", False)) and not routed


def _fsdp_processes(trainer) -> None:
    """``accelerate launch --use_fsdp`` on CPU processes: accelerate drops the FSDP plugin there and the Trainer
    would run DDP without a word (issue 43); fastkit gives it back (FSDP2 over gloo), and says which one runs."""
    if _hf.fsdp_dropped_on_cpu(trainer):
        _hf.fsdp_on_cpu(trainer)
    if trainer.is_fsdp_enabled:
        plugin = trainer.accelerator.state.fsdp_plugin
        logger.info("fastkit: %d processes (FSDP%s)", ranks.world_size(), plugin.fsdp_version)


def _log_processes(config: dict[str, Any]) -> None:
    """One line for a multi-process run: how many processes, and the unused-parameter search DDP does."""
    if ranks.world_size() == 1 or config.get("fsdp") or ranks.fsdp_asked():
        return  # FSDP: said once the Trainer made its accelerator (_fsdp_processes)
    found = config.get("ddp_find_unused_parameters")
    how = {False: "off (every trainable parameter gets a gradient each step: LoRA with fastkit's checkpointing)",
           True: "on"}.get(found, "the Trainer's choice")
    logger.info("fastkit: %d processes (DDP); find_unused_parameters %s", ranks.world_size(), how)


def _options(options: TrainOptions | None, kwargs: dict[str, Any]) -> TrainOptions:
    """The run's options: ``options`` with the keyword arguments applied (one code path for both forms)."""
    if options is not None and not isinstance(options, TrainOptions):
        raise FastkitError(f"make_trainer(options=...) takes a fastkit.TrainOptions, got {type(options).__name__}; "
                           "pass keyword arguments, or TrainOptions(**them).")
    if options is None or kwargs:
        options = TrainOptions.from_kwargs(options, **kwargs)
    options.check()  # again: a field may have been assigned since the options were made
    return options


def _arrives_tokenized(data: Any) -> bool:
    """Whether the caller's data came with its own ``input_ids`` (a Dataset, a dict of columns or dict rows)."""
    if isinstance(data, dict):
        return "input_ids" in data
    if isinstance(data, (list, tuple)):
        return bool(data) and isinstance(data[0], dict) and "input_ids" in data[0]
    return "input_ids" in (getattr(data, "column_names", None) or ())


def _check_token_ids(dataset, model: torch.nn.Module, where: str) -> None:
    """Pre-tokenized rows' ids within the model's embedding rows (an id past them is an IndexError mid-step). Read
    only for data that arrived tokenized: the scan pages the token columns in."""
    if dataset is None or is_stream(dataset) or "input_ids" not in dataset.column_names or len(dataset) == 0:
        return
    import pyarrow.compute as pc

    rows = unwrap(model).get_input_embeddings().weight.shape[0]
    low, high = 0, 0
    for batch in dataset.select_columns(["input_ids"]).with_format("arrow").iter(batch_size=8192):
        ids = pc.list_flatten(batch["input_ids"])
        if len(ids):
            found = pc.min_max(ids)
            low, high = min(low, found["min"].as_py()), max(high, found["max"].as_py())
    if low < 0 or high >= rows:
        bad = high if high >= rows else low
        raise FastkitError(f"{where}: a token id {bad} is outside the model's vocabulary (ids 0 to {rows - 1}): the "
                           "rows were tokenized by another tokenizer. Tokenize them with this model's tokenizer, or "
                           "give the text and let fastkit tokenize it.")


def check_stream_options(train_dataset, options: TrainOptions, epochs: float | None) -> None:
    """What a stream (an IterableDataset: its length unknown) cannot do, refused before any work."""
    if not is_stream(train_dataset):
        return
    if epochs is not None:
        raise FastkitError(f"epochs={epochs:g} needs the data's length, which a stream (streaming=True, an "
                           "IterableDataset) does not know ahead; give max_steps instead.")
    if options.eval_split:
        raise FastkitError("eval_split holds rows out of a dataset whose length is known, and the training data is "
                           "a stream (streaming=True): give make_trainer an eval_dataset (a file, a Dataset or a "
                           "stream) instead, or train without streaming.")


def _check_eval_options(options: TrainOptions, eval_dataset) -> None:
    """Options that need an eval set, refused without one (before any work)."""
    has_eval = eval_dataset is not None or bool(options.eval_split)
    if options.eval_steps is not None and not has_eval:
        raise FastkitError("eval_steps is set but there is no eval set: give eval_dataset or eval_split "
                           "(or drop eval_steps).")
    if options.early_stopping_patience is not None and not has_eval:
        raise FastkitError("early_stopping_patience watches the eval loss, but there is no eval set: give "
                           "eval_dataset or eval_split (or drop early_stopping_patience).")
    if eval_dataset is not None and options.eval_split:
        raise FastkitError("Give eval_dataset or eval_split, not both.")


def _pre_tokenize(args) -> bool:
    """Whether fastkit hands TRL its rows tokenized (as TRL would tokenize them, so TRL skips it): unless TRL's own
    tokenization differs from plain rows' (assistant-only masks, another chat template, another text field)."""
    return not (args.assistant_only_loss or getattr(args, "chat_template_path", None)
                or args.dataset_text_field != "text" or (args.dataset_kwargs or {}).get("skip_prepare_dataset"))


def _checked_data(options: TrainOptions, train_dataset, eval_dataset, tokenizer, max_seq_length: int,
                  tokenize: bool = False):
    """(train, eval) checked by :func:`fastkit.data.check_dataset`; ``eval_split`` rows held out of train.
    ``tokenize``: both returned tokenized (``check_dataset(tokenize=True)``)."""
    check = dict(packing=options.packing, drop_long=options.drop_long, drop_invalid=options.drop_invalid,
                 tokenize=tokenize)
    dataset = check_dataset(train_dataset, tokenizer, max_seq_length, **check)
    dataset, split = _split_eval(dataset, None, options.eval_split, options.seed)
    if eval_dataset is not None:
        return dataset, check_dataset(eval_dataset, tokenizer, max_seq_length, where="eval_dataset", **check)
    return dataset, split


def _early_stopping(options: TrainOptions) -> list[Any]:
    """transformers' EarlyStoppingCallback on the eval loss, when ``early_stopping_patience`` is set."""
    if options.early_stopping_patience is None:
        return []
    from transformers import EarlyStoppingCallback

    return [EarlyStoppingCallback(options.early_stopping_patience, options.early_stopping_threshold)]


def _route_loss(trainer, model: torch.nn.Module, chunked_loss: bool | None) -> None:
    """fastkit's chunked loss where asked (default: off CUDA), else TRL's fused LM head."""
    if not (chunked_loss if chunked_loss is not None else model.device.type != "cuda"):
        return
    from fastkit.patches.loss.patch import route_trainer_loss

    ok, how = route_trainer_loss(trainer)
    if not ok and chunked_loss is True and "host_lm_head" in active_patches(unwrap(trainer.model)):
        raise FastkitError(f"The lm_head is kept on the host, but fastkit's chunked loss (which streams it) cannot "
                           f"apply: {how}. Keep the head on the GPU (get_peft_model(host_weights="
                           "fastkit.HostWeights(lm_head=False))).")
    if not ok:
        logger.info("fastkit: chunked loss not used (%s); TRL's fused LM head computes the loss", how)


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


def sft_config(options: TrainOptions, *, evaluate: bool, cuda: bool, optim: str, precision: dict[str, bool],
               max_seq_length: int | None = None, every_parameter_used: bool = False) -> dict[str, Any]:
    """The ``SFTConfig`` values of ``options``: a pure function (no model, no I/O, ``options`` untouched).

    ``evaluate``: there is an eval set; ``cuda``, ``optim``, ``precision``: what the model's device asks for
    (make_trainer reads them); ``max_seq_length``: the load's, when ``options`` leaves it None. Checkpointing is
    fastkit's (``activation_checkpointing=False`` here); ``options.sft`` wins over every default. One of
    ``max_steps`` / ``epochs`` is set (the other None); step counts that depend on an epochs run's length are
    finished in make_trainer once the rows are packed. ``every_parameter_used``: every trainable parameter gets a
    gradient each step (:func:`every_parameter_used`), so DDP need not search for unused ones
    (``ddp_find_unused_parameters=False``; else the Trainer's own choice).
    """
    max_steps, epochs = _run_length(options.max_steps, options.epochs)
    batch, save_steps = options.batch_size, options.save_steps
    warmup = options.warmup_steps if options.warmup_steps is not None else min(5, (max_steps or 50) // 10)
    config = dict(
        output_dir=options.output_dir, max_steps=max_steps or -1, num_train_epochs=epochs or 1.0,
        learning_rate=options.learning_rate, per_device_train_batch_size=batch,
        gradient_accumulation_steps=options.gradient_accumulation_steps,
        max_length=max_seq_length or options.max_seq_length or 2048, packing=options.packing, packing_strategy="bfd",
        completion_only_loss=options.completion_only_loss, activation_checkpointing=False,
        logging_steps=options.logging_steps or 1, logging_nan_inf_filter=False,
        report_to=list(trackers(options.report_to)), seed=options.seed, data_seed=options.seed,
        **({"save_strategy": "steps", "save_steps": save_steps, "save_total_limit": options.save_total_limit}
           if save_steps else {"save_strategy": "no"}),
        **({"eval_strategy": "steps", "eval_steps": options.eval_steps or default_eval_steps(max_steps or 1),
            "per_device_eval_batch_size": batch} if evaluate else {}),
        lr_scheduler_type=options.lr_scheduler_type, warmup_steps=warmup, weight_decay=options.weight_decay,
        dataloader_pin_memory=cuda, disable_tqdm=True, optim=optim, **precision,
        **({"ddp_find_unused_parameters": False} if every_parameter_used else {}),
    )
    if options.early_stopping_patience is not None:
        config.update(metric_for_best_model="eval_loss", greater_is_better=False)
    config.update(options.sft)
    return config


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


def _split_eval(dataset, eval_dataset, eval_split: float | int, seed: int):
    """(train, eval): ``eval_split`` rows (a fraction or a count) of ``dataset`` held out, seeded."""
    if not eval_split:
        return dataset, eval_dataset
    if eval_dataset is not None:
        raise FastkitError("Give eval_dataset or eval_split, not both.")
    split = dataset.train_test_split(test_size=_eval_count(eval_split, len(dataset)), seed=seed, shuffle=True)
    return split["train"], split["test"]


def _eval_count(eval_split: float | int, n: int) -> int:
    """Rows ``eval_split`` (a fraction or a count) holds out of ``n``; a FastkitError unless each side keeps one."""
    count = round(eval_split * n) if isinstance(eval_split, float) and eval_split < 1 else eval_split
    if isinstance(eval_split, bool) or not isinstance(count, int) or not 1 <= count < n:
        raise FastkitError(f"eval_split must be a fraction in (0, 1) or a row count in [1, {n - 1}] of the "
                           f"{n} training rows (at least one row each side), got {eval_split!r}.")
    return count


def planned_steps(trainer) -> int:
    """Optimizer steps ``trainer.train()`` will run: ``max_steps``, or the epochs over the packed rows."""
    import math

    args = trainer.args
    if args.max_steps and args.max_steps > 0:
        return int(args.max_steps)
    return max(1, math.ceil(steps_per_epoch(trainer) * args.num_train_epochs))


def steps_per_epoch(trainer) -> int:
    """Optimizer steps in one pass over the (packed) training rows."""
    import math

    args = trainer.args
    per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * max(1, args.world_size)
    return max(1, math.ceil(len(trainer.train_dataset) / per_step))


def run_coverage(trainer) -> str:
    """One line: how much of the training data one run sees (steps, rows per step, share of an epoch)."""
    args = trainer.args
    per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * max(1, args.world_size)
    steps = planned_steps(trainer)
    unit = f"packed row{'s' if per_step > 1 else ''} of ≤{args.max_length:,} tokens" if args.packing else "row"
    if is_stream(trainer.train_dataset):
        return (f"One run: {steps:,} steps × {per_step} {unit} = {steps * per_step:,} rows drawn from a stream "
                "(its length is not known ahead; a stream that ends before then is read again from its start).")
    rows = len(trainer.train_dataset)
    epochs = steps * per_step / rows
    attached = next((cb for cb in trainer.callback_handler.callbacks if isinstance(cb, MetricsCallback)), None)
    examples = getattr(attached, "examples", None)
    line = f"One run: {steps:,} steps × {per_step} {unit} = {steps * per_step:,} of {rows:,} rows"
    if epochs < 1:
        seen = f", ~{epochs * examples:,.0f} of {examples:,} examples" if examples and args.packing else ""
        return f"{line}: {100 * epochs:.1f}% of one epoch{seen}. More steps (max_steps) or epochs see more."
    return f"{line}: {epochs:.2f} epochs" + (f" over {examples:,} examples." if examples else ".")


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


CARD_LINE = "This model is a fine-tuned version of "
"""The sentence of TRL's model card (trl/templates/lm_model_card.md, TRL 1.16) that names the base model and data."""


NO_HUB_MODEL = 'model="None"'
"""TRL's quick-start line names ``hub_model_id``, None for a run not pushed: the card names the adapters' folder."""


def data_name(source) -> str | None:
    """What the model card calls the training data: a path or Hub id as given, a Hub dataset's name, else None."""
    if isinstance(source, (str, os.PathLike)):
        return str(source)
    return getattr(getattr(source, "info", None), "dataset_name", None) or None


def model_card_sentence(base: str | None, data: str | None) -> str:
    """fastkit's line for the run folder's README.md: a Hub id links to the Hub, a local folder or file is named."""
    def named(what: str | None, kind: str) -> str:
        if not what:
            return "a model built in memory" if kind == "models" else "data given in memory"
        if kind == "models" and twin_source(what) is not None:
            return f"a tiny random twin of `{twin_source(what)}` (a smoke test, not a trained model of it)"
        local = os.path.exists(what) or what.startswith((".", "/", "~"))
        hub = "" if kind == "models" else "datasets/"
        return f"`{what}`" if local or what.count("/") != 1 else f"[{what}](https://huggingface.co/{hub}{what})"

    return f"{CARD_LINE}{named(base, 'models')}, trained on {named(data, 'datasets')} with fastkit."


CARD_MARKER = "<!-- fastkit: this model card was written by fastkit; a later run in this folder replaces it -->"
"""The last line of the run folder's README.md fastkit writes: a README.md without it is the user's, and kept."""


def is_fastkit_card(text: str) -> bool:
    """Whether a run folder's README.md is fastkit's model card: its marker, or (a card from before the marker)
    fastkit's sentence naming the base model and data."""
    return CARD_MARKER in text or any(ln.startswith(CARD_LINE) and ln.rstrip().endswith("with fastkit.")
                                      for ln in text.splitlines())


def _name_in_model_card(trainer, train_dataset) -> None:
    """TRL's card says "fine-tuned version of [None]" for a model loaded from a folder, and names no data: after
    TRL writes it, its sentence names the base model (Hub id or folder) and the data (``trainer.fastkit_data``
    when set, as the CLI does with ``--data``, else the dataset's path or Hub name), and fastkit's marker ends it.

    The rule for a run folder's README.md: TRL writes its card there at every checkpoint and at the end; fastkit
    lets it replace only a card fastkit wrote (:func:`is_fastkit_card`). A README.md of the user's (or any other
    tool's, a plain TRL card included) is kept byte for byte and the card is not written (said once a run)."""
    original = trainer.create_model_card
    trainer.fastkit_data = data_name(train_dataset)

    def create_model_card(*args, **kwargs):
        card = os.path.join(trainer.args.output_dir, "README.md")
        if _users_card(trainer, card):
            return
        original(*args, **kwargs)
        if not os.path.isfile(card):
            return
        base = str(getattr(unwrap(trainer.model).config, "_name_or_path", "") or "") or None
        line = model_card_sentence(base, trainer.fastkit_data)
        with open(card, encoding="utf-8") as f:
            text = f.read()
        lora = os.path.join(trainer.args.output_dir, "lora")  # where fastkit train / save_lora put the adapters
        lines = [line if ln.startswith(CARD_LINE) else ln.replace(NO_HUB_MODEL, f"model={json.dumps(lora)}")
                 for ln in text.splitlines()]
        with open(card, "w", encoding="utf-8") as f:
            f.write("\n".join(ln for ln in lines if ln != CARD_MARKER) + "\n\n" + CARD_MARKER + "\n")

    trainer.create_model_card = create_model_card


def _users_card(trainer, card: str) -> bool:
    """True (said once per trainer) when ``card`` exists and is not fastkit's: it is kept, no card is written."""
    if not os.path.lexists(card):
        return False
    try:
        with open(card, encoding="utf-8", errors="replace") as f:
            ours = os.path.isfile(card) and not os.path.islink(card) and is_fastkit_card(f.read(1 << 20))
    except OSError:
        ours = False
    if not ours and not getattr(trainer, "fastkit_card_kept", False):
        trainer.fastkit_card_kept = True
        logger.warning("fastkit: %s is not a model card fastkit wrote: kept as it is, the run's model card is not "
                       "written (move it away to get one)", card)
    return not ours


def _attach_packed_metadata(trainer) -> None:
    """Let the packing patch see host-side document lengths (the Trainer moves tensors to the device)."""
    if "packing" not in active_patches(unwrap(trainer.model)):
        return
    from fastkit.patches.packing.patch import wrap_collator

    trainer.data_collator = wrap_collator(trainer.data_collator)


def _host_weights_in_trainer(trainer, chunked_loss: bool | None) -> bool | None:
    """Host weights (:mod:`fastkit.patches.host`): the collator carries the host token ids for the embedding,
    and a host lm_head needs fastkit's chunked loss (TRL's kernel reads the head on the device)."""
    from fastkit.patches.host import HOST_EMBEDDING, HOST_LM_HEAD, wrap_collator

    active = active_patches(unwrap(trainer.model))
    if HOST_EMBEDDING in active:
        trainer.data_collator = wrap_collator(trainer.data_collator)
    if HOST_LM_HEAD not in active:
        return chunked_loss
    if chunked_loss is False:
        raise FastkitError("chunked_loss=False, but the lm_head is kept on the host (HostWeights(lm_head=True)): "
                           "only fastkit's chunked loss streams it. Drop chunked_loss=False, or keep the head on the "
                           "GPU (get_peft_model(host_weights=fastkit.HostWeights(lm_head=False))).")
    return True


# -- running a trainer under the dashboard -----------------------------------------------------


def fit(trainer, *, view: str = "auto", title: str | None = None, warmup_steps: int = 2,
        measure_syncs: bool = False, resume: bool = False, extend: bool = False, clock=None,
        **train_kwargs: Any) -> TrainingMetrics:
    """Run ``trainer.train(**train_kwargs)`` with the dashboard; returns the final :class:`TrainingMetrics`.

    The trainer's own progress bar / log printer and the dashboard ``make_trainer`` attached are set
    aside while it runs (this dashboard shows the same numbers). ``measure_syncs`` counts the
    host-device syncs of one step (a debug switch).

    Each run is a new run by default (``"new run"`` is logged; an earlier run's checkpoints in
    ``output_dir`` move to ``output_dir/previous-run``). ``resume=True`` continues the newest checkpoint
    there, only when it is this run's (same model, adapter config, data and hyperparameters, with
    optimizer state, not finished): otherwise it raises naming the difference
    (:mod:`fastkit.training.identity`). ``trainer.state.fastkit_run`` says which ("resumed from checkpoint-N").
    The options the run used (``trainer.fastkit_config``) are written to ``output_dir/fastkit_config.yaml``.
    ``extend=True`` (with ``resume=True``) continues a run, finished or not, for the longer schedule the trainer
    has now (its ``max_steps`` / epochs): adapter, optimizer state and step count carry over, only the schedule's
    length changes (step N+1 on trains at the rate a fresh run of the new length has there, warmup included:
    :class:`~fastkit.training.identity.ExtendedSchedule`); the dashboard says "continued from checkpoint-N, schedule
    extended to M steps".
    A loss or gradient norm that is not finite stops the run and raises, naming the step (and on fp16
    the likely cause).

    A ``KeyboardInterrupt`` (Ctrl-C, Jupyter's stop button) ends training
    cleanly: the summary is shown, the model keeps the weights of the last finished optimizer step
    and stays usable (gradients dropped, memory released), and the cell does not fail. Any other
    error also shows the summary, then propagates.

    Under ``torchrun`` / ``accelerate launch`` every rank calls ``fit``: the main process draws the dashboard, moves
    an earlier run's checkpoints (the others wait) and writes the config; the returned status is the same on
    every rank (:mod:`fastkit.ranks`).
    """
    checks.check_choice("view", view, VIEWS)
    checks.check_non_negative_int("warmup_steps", warmup_steps)
    checks.check_bool("measure_syncs", measure_syncs)
    checks.check_known_options("fit", train_kwargs, ("resume_from_checkpoint", "trial", "ignore_keys_for_eval"))
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
    note = _resume_or_new(trainer, resume, train_kwargs, extend)
    config = getattr(trainer, "fastkit_config", None)
    if config is not None and trainer.is_world_process_zero():  # the options this run used, beside its checkpoints
        write_config(trainer.args.output_dir, config, getattr(trainer, "fastkit_command", "train"))
    continued = note.startswith("continued")  # extend=True, from a checkpoint
    callback.run_note = note if continued else None
    guard = RunGuard(trainer, note)
    added = [guard, *([ExtendedSchedule()] if continued else [])]
    for cb in added:
        trainer.add_callback(cb)
    trainer.fastkit_identity = guard.identity  # the run a model card names (fastkit.export.hub)
    try:
        trainer.train(**train_kwargs)
        if guard.problem:
            raise FastkitError(guard.problem)
    except KeyboardInterrupt:
        step = _settle(trainer, callback)
        logger.warning("fastkit: %s", _interrupt_checkpoint(trainer, step, callback.metrics.max_steps))
        callback.finish("interrupted", f"stopped by the user after step {step}")
    except Exception as exc:
        _settle(trainer, callback)
        callback.finish("failed", f"{type(exc).__name__}: {shorten(str(exc), 120)}")
        raise
    finally:
        for cb in (callback, *added):
            trainer.remove_callback(cb)
        for cb in set_aside:  # make_trainer's dashboard back in front of the trackers, the rest at the end
            if isinstance(cb, MetricsCallback):
                trainer.callback_handler.callbacks.insert(0, cb)
            else:
                trainer.add_callback(cb)
    return callback.metrics


RESUME_HINT = "fit(trainer, resume=True)"
"""How :func:`fit`'s interrupt message says to continue; the CLI sets ``trainer.fastkit_resume_hint`` to its command
(None: a run nobody continues, no checkpoint written)."""


def _interrupt_checkpoint(trainer, step: int, max_steps: int) -> str:
    """After Ctrl-C at ``step`` (optimizer steps done): ``checkpoint-<step>`` written (optimizer, scheduler, RNG and
    run identity with the adapter, as a save step writes it) so that ``resume=True`` continues there; the message."""
    hint = getattr(trainer, "fastkit_resume_hint", RESUME_HINT)
    if step == 0:
        return "interrupted before the first step; nothing was trained and there is nothing to continue."
    if hint is None:  # a run nobody continues (the quickstart)
        return f"interrupted at step {step}/{max_steps}; the model keeps the weights trained so far."
    if ranks.world_size() > 1:  # a checkpoint is written by every rank together; they were not stopped together
        last = last_checkpoint(trainer.args.output_dir)
        where = f"the newest checkpoint is {os.path.basename(last)}" if last else "no checkpoint was written"
        return (f"interrupted at step {step}/{max_steps} ({ranks.world_size()} processes: {where}); the model keeps "
                "the weights trained so far.")
    folder = os.path.join(trainer.args.output_dir, f"checkpoint-{step}")
    if not os.path.isdir(folder):  # a save step may have written it already
        folder = _hf.save_checkpoint(trainer)
    return (f"interrupted at step {step}/{max_steps}; {os.path.basename(folder)} written ({folder}); continue "
            f"with: {hint}")


def _resume_or_new(trainer, resume: bool, train_kwargs: dict, extend: bool = False) -> str:
    """Which run this is (logged, and on ``trainer.state.fastkit_run``): refuses a checkpoint of another run."""
    if not isinstance(resume, bool):
        raise FastkitError(f"fit(resume={resume!r}): give True (continue this run's newest checkpoint) or False.")
    checks.check_bool("extend", extend)
    if extend and not resume:
        raise FastkitError("fit(extend=True) continues a run's checkpoint for a longer schedule: pass resume=True "
                           "with it (and the longer max_steps / epochs in make_trainer).")
    trainer.args.logging_nan_inf_filter = False  # a NaN loss is shown (and stops the run), never averaged away
    given = train_kwargs.get("resume_from_checkpoint")
    if given not in (None, False):  # trainer.train's own argument: checked the same way
        last = last_checkpoint(trainer.args.output_dir) if given is True else str(given)
        if last is None or not os.path.isdir(last):
            raise FastkitError(f"resume_from_checkpoint={given!r}: no checkpoint folder there.")
    elif not resume:  # the main process moves the old checkpoints; the others wait for it
        ranks.agreed(set_aside_old_checkpoints, trainer.args.output_dir, main_only=True)
        logger.info("fastkit: new run")
        return "new run"
    else:
        last = last_checkpoint(trainer.args.output_dir)
        if last is None:
            logger.info("fastkit: new run (resume=True, but no checkpoint in %s yet)", trainer.args.output_dir)
            return "new run"
    total = planned_steps(trainer) if extend else None
    check_resumable(trainer, last, extend_to=total)
    train_kwargs["resume_from_checkpoint"] = last
    name = os.path.basename(os.path.normpath(last))
    note = f"continued from {name}, schedule extended to {total:,} steps" if extend else f"resumed from {name}"
    logger.info("fastkit: %s", note)
    return note


def last_checkpoint(output_dir: str) -> str | None:
    """The newest ``checkpoint-<step>`` folder in ``output_dir``, or None (also when the folder is missing)."""
    found = checkpoints(output_dir)
    return str(found[-1]) if found else None


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


__all__ = ["TRACKERS", "available_trackers", "build_sft_config", "check_distributed_mode", "check_report_to",
           "check_vision_options", "every_parameter_used", "fit", "last_checkpoint", "make_trainer", "planned_steps",
           "run_coverage", "split_rows", "steps_per_epoch"]
