"""A fastkit run of a trainer: new run or resumed (only where it is the same run), its options saved beside its
checkpoints, its identity written into each checkpoint, Ctrl-C turned into a clean stop.

:func:`run` is what ``fit`` and ``trainer.train(resume=...)`` (:class:`fastkit.training.base.FastTrainerMixin`)
both do around the Trainer's own ``train``; :func:`planned_steps` / :func:`steps_per_epoch` count a run's steps.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from fastkit import _hf, checks
from fastkit.dashboard import MetricsCallback
from fastkit.dashboard.render import shorten
from fastkit.distributed import ranks
from fastkit.errors import FastkitError
from fastkit.training.identity import (
    ExtendedSchedule,
    RunGuard,
    check_resumable,
    checkpoints,
    set_aside_old_checkpoints,
)
from fastkit.training.options import write_config
from fastkit.training.record import record_of

logger = logging.getLogger(__name__)


def run(trainer, callback: MetricsCallback, *, resume: bool, extend: bool, train_kwargs: dict[str, Any],
        train: Callable[..., Any] | None = None) -> None:
    """``train(**train_kwargs)`` (default: ``trainer.train``) as a fastkit run with ``callback`` as its dashboard.

    Each run is a new run by default (``"new run"`` is logged; an earlier run's checkpoints in ``output_dir`` move to
    ``output_dir/previous-run``). ``resume=True`` continues the newest checkpoint there, only when it is this run's
    (same model, adapter config, data and hyperparameters, with optimizer state, not finished): otherwise it raises
    naming the difference (:mod:`fastkit.training.identity`); ``trainer.state.fastkit_run`` says which. The options
    the run used (``trainer.run_record.config``) are written to ``output_dir/fastkit_config.yaml``. ``extend=True``
    (with ``resume=True``) continues a run, finished or not, for the longer schedule the trainer has now: adapter,
    optimizer state and step count carry over, only the schedule's length changes
    (:class:`~fastkit.training.identity.ExtendedSchedule`). A loss or gradient norm that is not finite stops the run
    and raises, naming the step. A ``KeyboardInterrupt`` ends training cleanly (a checkpoint written to continue
    from, the model usable, the summary shown); any other error shows the summary, then propagates.
    """
    note = _resume_or_new(trainer, resume, train_kwargs, extend)
    record = record_of(trainer)
    if record.config is not None and trainer.is_world_process_zero():  # the options, beside its checkpoints
        write_config(trainer.args.output_dir, record.config, record.command)
    continued = note.startswith("continued")  # extend=True, from a checkpoint
    callback.run_note = note if continued else None
    guard = RunGuard(trainer, note)
    added = [guard, *([ExtendedSchedule()] if continued else [])]
    for cb in added:
        trainer.add_callback(cb)
    if hasattr(trainer, "update_record"):  # the run a model card names (fastkit.export.hub)
        trainer.update_record(identity=guard.identity)
    try:
        (train or trainer.train)(**train_kwargs)
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
        for cb in added:
            trainer.remove_callback(cb)


def _interrupt_checkpoint(trainer, step: int, max_steps: int) -> str:
    """After Ctrl-C at ``step`` (optimizer steps done): ``checkpoint-<step>`` written (optimizer, scheduler, RNG and
    run identity with the adapter, as a save step writes it) so that ``resume=True`` continues there; the message."""
    hint = record_of(trainer).resume_hint
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


__all__ = ["last_checkpoint", "planned_steps", "run", "steps_per_epoch"]
