"""What every fastkit trainer is on top of TRL's: :class:`FastTrainerMixin`.

TRL-style, the trainer class owns its run: made with a frozen :class:`~fastkit.training.record.RunRecord` (the
options, the YAML a run saves, the data its model card names, how Ctrl-C says to continue...), it attaches the live
dashboard first among its callbacks (trackers after it see its fastkit/... log keys), gives FSDP back on CPU
processes, writes the run folder's model card with fastkit's sentence (:class:`~fastkit.training.card.ModelCardMixin`),
and its ``train(resume=..., extend=...)`` is a fastkit run (:func:`fastkit.training.session.run`: new run or resumed,
Ctrl-C a clean stop). Each trainer's own finishing (collators, loss routing, the reference model, packing) is its
:meth:`~FastTrainerMixin.finish` override. The classes: ``FastSFTTrainer`` (:mod:`fastkit.training.trainer`),
``FastDPOTrainer`` / ``FastKTOTrainer`` / ``FastGRPOTrainer`` (:mod:`fastkit.training.preference`).
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback

from fastkit import _hf
from fastkit.dashboard import MetricsCallback, dashboard_callback
from fastkit.distributed import ranks
from fastkit.training import session
from fastkit.training.card import ModelCardMixin
from fastkit.training.record import RunRecord

logger = logging.getLogger(__name__)


class FastTrainerMixin(ModelCardMixin):
    """fastkit's run on top of a TRL trainer class: ``class FastDPOTrainer(FastTrainerMixin, trl.DPOTrainer)``.

    ``record`` (keyword) is the run's :class:`~fastkit.training.record.RunRecord`; every other argument is the TRL
    trainer's own."""

    def __init__(self, *args: Any, record: RunRecord, **kwargs: Any):
        self.run_record = record
        super().__init__(*args, **kwargs)
        _fsdp_processes(self)
        self.finish()
        self.callback_handler.callbacks.insert(0, self.dashboard())  # first: trackers see its fastkit/... keys
        if record.dropped is not None:
            self.add_callback(_Dropped(record.dropped))

    def finish(self) -> None:
        """The trainer's own finishing after TRL's ``__init__`` (a subclass's override); nothing here."""

    def dashboard(self) -> MetricsCallback:
        """The live dashboard the trainer runs with (``fit`` swaps in its own view while it runs)."""
        record = self.run_record
        return dashboard_callback(record.options.dashboard, examples=record.examples,
                                  log_every_step=record.log_every_step)

    def update_record(self, **changes: Any) -> RunRecord:
        """The run's record with ``changes`` (its field names): the CLI names its data and config, ``fit`` the run
        identity. Returns the new record."""
        self.run_record = self.run_record.replace(**changes)
        return self.run_record

    def train(self, *args: Any, resume: bool | None = None, extend: bool = False, **kwargs: Any):
        """TRL's ``train``; with ``resume`` (True / False) a fastkit run under the attached dashboard: new run or
        resumed, Ctrl-C a clean stop (:func:`fastkit.training.session.run`), returning the dashboard's
        :class:`~fastkit.dashboard.TrainingMetrics` (``fit`` does the same under its own view)."""
        if resume is None and not extend:
            return super().train(*args, **kwargs)
        callback = next(cb for cb in self.callback_handler.callbacks if isinstance(cb, MetricsCallback))
        train_kwargs = dict(zip(("resume_from_checkpoint", "trial", "ignore_keys_for_eval"), args), **kwargs)
        session.run(self, callback, resume=bool(resume), extend=extend, train_kwargs=train_kwargs,
                    train=super().train)
        return callback.metrics

    # What readers of a trainer's run facts found on it before the record (notebooks print fastkit_reference).
    @property
    def fastkit_reference(self) -> str | None:
        return self.run_record.reference

    @property
    def fastkit_packed(self) -> bool:
        return self.run_record.packed

    @property
    def fastkit_identity(self) -> dict[str, Any] | None:
        return self.run_record.identity


class _Dropped(TrainerCallback):
    """A stream read with drop_invalid / drop_long: the rows it dropped in all, logged at the end of training."""

    def __init__(self, dropped):
        self.dropped = dropped

    def on_train_end(self, args, state, control, **kwargs):
        logger.log(logging.WARNING if self.dropped.count else logging.INFO, "fastkit: %s", self.dropped.summary())


def _fsdp_processes(trainer) -> None:
    """``accelerate launch --use_fsdp`` on CPU processes: accelerate drops the FSDP plugin there and the Trainer
    would run DDP without a word (issue 43); fastkit gives it back (FSDP2 over gloo), and says which one runs."""
    if _hf.fsdp_dropped_on_cpu(trainer):
        _hf.fsdp_on_cpu(trainer)
    if trainer.is_fsdp_enabled:
        plugin = trainer.accelerator.state.fsdp_plugin
        logger.info("fastkit: %d processes (FSDP%s)", ranks.world_size(), plugin.fsdp_version)


__all__ = ["FastTrainerMixin"]
