"""Training with TRL's ``SFTTrainer``, set up the way fastkit's patches expect, under the dashboard: the notebook API.

:func:`make_trainer` returns a :class:`fastkit.training.trainer.FastSFTTrainer` (``trl.SFTTrainer`` with the same
arguments and logs, no host-device sync between log points: docs/step.md; the run's facts in one
:class:`~fastkit.training.record.RunRecord`) with defaults that work on a 2-core CPU and on a T4 alike (precision
from the device, packing on, responses-only loss), after :func:`fastkit.data.check_dataset` has refused bad data.
:func:`fit` runs it with the live dashboard (:mod:`fastkit.dashboard`) as a fastkit run (new run or resumed, Ctrl-C
a clean stop: :mod:`fastkit.training.session`). Chat and save: :mod:`fastkit.export`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import torch

from fastkit import checks
from fastkit.dashboard import MetricsCallback, TrainingMetrics, dashboard_callback
from fastkit.dashboard.views import VIEWS
from fastkit.data.read import stream_source
from fastkit.data.stream import is_stream
from fastkit.data.vision import is_processor
from fastkit.data.workers import data_workers, frozen_heap
from fastkit.distributed import ranks
from fastkit.errors import FastkitError
from fastkit.patching import change, report, unwrap
from fastkit.training import session
from fastkit.training.args import (  # noqa: F401  (_default_optim, _precision, sft_config: their import path)
    _default_optim,
    _log_processes,
    _precision,
    _run_length,
    build_sft_config,
    check_distributed_mode,
    every_parameter_used,
    sft_config,
)
from fastkit.training.card import data_name
from fastkit.training.options import TRACKERS, TrainOptions, available_trackers, check_report_to  # noqa: F401
from fastkit.training.record import RunRecord, record_of
from fastkit.training.session import last_checkpoint, planned_steps, steps_per_epoch  # noqa: F401
from fastkit.training.sft_data import (  # noqa: F401  (_check_packing_supported: its import path)
    _arrives_tokenized,
    _check_eval_options,
    _check_packing_supported,
    _check_token_ids,
    _checked_data,
    _early_stopping,
    _pre_tokenize,
    check_stream_options,
)
from fastkit.training.vision import check_vision_options, split_rows, vision_trainer  # noqa: F401

logger = logging.getLogger(__name__)


def make_trainer(model: torch.nn.Module, tokenizer, train_dataset, options: TrainOptions | None = None, *,
                 eval_dataset=None, callbacks: Sequence[Any] = (), **kwargs: Any):
    """A ``trl.SFTTrainer`` (a :class:`~fastkit.training.trainer.FastSFTTrainer`) for ``model`` on ``train_dataset``
    (checked first, errors before any step), set up by ``options`` (:class:`~fastkit.training.options.TrainOptions`:
    every knob with its help text and default: length, trackers, eval set and early stopping, checkpoints, dropping
    long or invalid rows, the dashboard, the chunked loss).

    ``make_trainer(model, tok, data, max_steps=100, warmup_ratio=0.1)`` is the same as
    ``make_trainer(model, tok, data, options=TrainOptions(max_steps=100, sft={"warmup_ratio": 0.1}))``: keyword
    arguments are TrainOptions fields (or their SFTConfig names, e.g. ``num_train_epochs``) or any other
    ``trl.SFTConfig`` field; given with ``options`` they change those options. ``eval_dataset`` is checked like the
    training data (or ``eval_split`` holds rows of it out); ``callbacks`` join the dashboard. :func:`run_coverage`
    says how much of the data a run sees; :func:`fit` runs it.
    """
    ranks.quiet_replicas()  # torchrun / accelerate launch: one process reports
    options = _options(options, kwargs)
    train_dataset, max_seq_length, args = _checked_run(model, tokenizer, train_dataset, eval_dataset, options)
    if is_processor(tokenizer):  # a vision-language model: image + text rows, its processor collates them
        return vision_trainer(model, tokenizer, (train_dataset, eval_dataset), args, options, callbacks,
                              max_seq_length)
    return _text_trainer(model, tokenizer, (train_dataset, eval_dataset), args, options, callbacks, max_seq_length)


def _checked_run(model: torch.nn.Module, tokenizer, train_dataset, eval_dataset, options: TrainOptions):
    """(train_dataset, max_seq_length, SFTConfig): every option checked against the model and the data's kind, before
    the data is read (a stream asked for by ``streaming`` opened)."""
    _, epochs = _run_length(options.max_steps, options.epochs)
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
    return train_dataset, max_seq_length, build_sft_config(config)  # SFTConfig's own checks, before the data


def _text_trainer(model: torch.nn.Module, tokenizer, data, args, options: TrainOptions, callbacks,
                  max_seq_length: int):
    """The SFT trainer of text rows: ``data`` = (train, eval or None) checked and tokenized once (fastkit's
    tokenization, which TRL then skips), pre-tokenized rows' ids checked against the model's vocabulary."""
    from fastkit.training.trainer import FastSFTTrainer

    with frozen_heap():  # forked data workers share this process's pages (fastkit.data.workers)
        dataset, eval_dataset = _checked_data(options, *data, tokenizer, max_seq_length, tokenize=_pre_tokenize(args))
    rows = None if is_stream(dataset) else len(dataset)  # a stream's length is not known ahead
    for given, checked, where in zip(data, (dataset, eval_dataset), ("train_dataset", "eval_dataset")):
        if _arrives_tokenized(given):  # fastkit's own tokenization used this model's tokenizer
            _check_token_ids(checked, model, where)
    if args.dataset_num_proc is None and rows is not None:  # TRL's labels / packing passes: the cores there are
        args.dataset_num_proc = data_workers(rows)
    # never mix documents through a KV cache while training (fastkit.revert puts the user's value back)
    change(model, "use_cache", lambda swap: swap.setattr(unwrap(model).config, "use_cache", False))
    dropped = getattr(dataset, "fastkit_dropped", None)  # a stream's drops (fastkit.data.stream.check_stream)
    record = RunRecord(options=options, config=options.to_dict(), data=data_name(data[0]), examples=rows,
                       log_every_step=options.logging_steps is None,
                       dropped=None if dropped is None or dropped.why == "none asked" else dropped)
    with frozen_heap():  # TRL's passes fork dataset_num_proc workers too
        return FastSFTTrainer(model=model, args=args, train_dataset=dataset, eval_dataset=eval_dataset,
                              processing_class=tokenizer, callbacks=[*callbacks, *_early_stopping(options)],
                              record=record)


def _options(options: TrainOptions | None, kwargs: dict[str, Any]) -> TrainOptions:
    """The run's options: ``options`` with the keyword arguments applied (one code path for both forms)."""
    if options is not None and not isinstance(options, TrainOptions):
        raise FastkitError(f"make_trainer(options=...) takes a fastkit.TrainOptions, got {type(options).__name__}; "
                           "pass keyword arguments, or TrainOptions(**them).")
    if options is None or kwargs:
        options = TrainOptions.from_kwargs(options, **kwargs)
    options.check()  # again: a field may have been assigned since the options were made
    return options


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
    examples = getattr(_attached(trainer), "examples", None)
    line = f"One run: {steps:,} steps × {per_step} {unit} = {steps * per_step:,} of {rows:,} rows"
    if epochs < 1:
        seen = f", ~{epochs * examples:,.0f} of {examples:,} examples" if examples and args.packing else ""
        return f"{line}: {100 * epochs:.1f}% of one epoch{seen}. More steps (max_steps) or epochs see more."
    return f"{line}: {epochs:.2f} epochs" + (f" over {examples:,} examples." if examples else ".")


# -- running a trainer under the dashboard -----------------------------------------------------


def fit(trainer, *, view: str = "auto", title: str | None = None, warmup_steps: int = 2,
        measure_syncs: bool = False, resume: bool = False, extend: bool = False, compare: bool | None = None,
        clock=None, **train_kwargs: Any) -> TrainingMetrics:
    """Run ``trainer.train(**train_kwargs)`` with the dashboard (``view``); returns the final :class:`TrainingMetrics`.
    The trainer's own progress bar / log printer and the dashboard ``make_trainer`` attached are set aside while it
    runs; ``measure_syncs`` counts the host-device syncs of one step (a debug switch).

    A new run by default (an earlier run's checkpoints in ``output_dir`` move to ``output_dir/previous-run``);
    ``resume=True`` continues this run's newest checkpoint, refusing another run's by naming the difference;
    ``extend=True`` (with ``resume=True``) continues it for the longer schedule the trainer has now. A loss that is
    not finite stops the run and raises. Ctrl-C (Jupyter's stop button) ends training cleanly: a checkpoint to
    continue from, the model usable, the cell not failed (:func:`fastkit.training.session.run`: the whole rule).
    Every rank of a ``torchrun`` job calls ``fit`` and gets the same status. ``compare`` (default: the run's option):
    base and tuned on the eval set after a finished run (:func:`fastkit.evaluate`), ``metrics.comparison``.
    """
    checks.check_choice("view", view, VIEWS)
    checks.check_non_negative_int("warmup_steps", warmup_steps)
    checks.check_bool("measure_syncs", measure_syncs)
    checks.check_known_options("fit", train_kwargs, ("resume_from_checkpoint", "trial", "ignore_keys_for_eval"))
    callback = dashboard_callback(view, title, warmup_steps=warmup_steps, measure_syncs=measure_syncs,
                                  examples=getattr(_attached(trainer), "examples", None),
                                  **({"clock": clock} if clock is not None else {}))
    compare = _compares(trainer, compare)
    with _in_front(trainer, callback):
        session.run(trainer, callback, resume=resume, extend=extend, train_kwargs=train_kwargs)
    if compare and callback.metrics.status == "finished" and ranks.is_main():
        from fastkit.evaluation import evaluate_run

        callback.metrics.comparison = evaluate_run(trainer)
    return callback.metrics


def _compares(trainer, compare: bool | None) -> bool:
    """fit's ``compare``, else the run's option; refused before training when there is no eval set to compare on."""
    options = record_of(trainer).options
    if compare is None:
        compare = bool(getattr(options, "compare", False))
    checks.check_bool("compare", compare)
    if compare and getattr(trainer, "eval_dataset", None) is None:
        raise FastkitError("fit(compare=True) compares base and tuned on held-out rows, but the trainer has no eval "
                           "set: make it with eval_split=0.05 (or a number of rows) or eval_dataset=...")
    return compare


def _attached(trainer) -> MetricsCallback | None:
    """The dashboard make_trainer attached, if any."""
    return next((cb for cb in trainer.callback_handler.callbacks if isinstance(cb, MetricsCallback)), None)


@contextlib.contextmanager
def _in_front(trainer, callback: MetricsCallback):
    """``callback`` first among the trainer's callbacks (trackers after it see its fastkit/... log keys) while it
    runs; the progress bar / log printer and make_trainer's dashboard set aside, then put back (the dashboard in
    front of the trackers, the rest at the end)."""
    from fastkit import _hf

    set_aside = [cb for cb in list(trainer.callback_handler.callbacks)
                 if _hf.is_progress_callback(cb) or isinstance(cb, MetricsCallback)]
    for cb in set_aside:
        trainer.remove_callback(cb)
    trainer.callback_handler.callbacks.insert(0, callback)
    try:
        yield
    finally:
        trainer.remove_callback(callback)
        for cb in set_aside:
            if isinstance(cb, MetricsCallback):
                trainer.callback_handler.callbacks.insert(0, cb)
            else:
                trainer.add_callback(cb)


__all__ = ["TRACKERS", "available_trackers", "build_sft_config", "check_distributed_mode", "check_report_to",
           "check_vision_options", "every_parameter_used", "fit", "last_checkpoint", "make_trainer", "planned_steps",
           "run_coverage", "split_rows", "steps_per_epoch"]
