"""One frozen record of a fastkit run: what the trainer was made with and what the run is, kept on the trainer.

:class:`RunRecord` holds what used to be loose ``trainer.fastkit_*`` attributes: the options the trainer was made
with, the YAML the run saves beside its checkpoints, the command that reads it back, the data the model card
names, how Ctrl-C says to continue, and what the factory decided (packing, the reference model, a stream's drop
count, GRPO's reward counts). The record is frozen; a change (the CLI naming its data, ``fit`` naming the run's
identity) is a new record through :meth:`fastkit.training.base.FastTrainerMixin.update_record`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

RESUME_HINT = "fit(trainer, resume=True)"
"""How the interrupt message says to continue a notebook's run (:attr:`RunRecord.resume_hint`)."""


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """What a fastkit trainer was made with and what its run is (read it as ``trainer.run_record``)."""

    options: Any = None
    """The options the trainer was made with (:class:`~fastkit.training.options.TrainOptions` for SFT, the run
    options of a preference / RL trainer)."""
    config: dict[str, Any] | None = None
    """The options as plain values: ``fit`` writes them to ``output_dir/fastkit_config.yaml`` (None: nothing)."""
    command: str = "train"
    """The command that reads :attr:`config` back (``train``, ``dpo``, ``kto``, ``grpo``)."""
    data: str | None = None
    """What the run folder's model card calls the training data (None: "data given in memory")."""
    resume_hint: str | None = RESUME_HINT
    """How Ctrl-C's message says to continue the run; None: a run nobody continues (no checkpoint written)."""
    examples: int | None = None
    """Training examples before packing (the dashboard's header; None: not known, a stream)."""
    log_every_step: bool = True
    """The dashboard asks for a log every step (live curves); False where the caller chose ``logging_steps``."""
    packed: bool = False
    """DPO / GRPO: the batches run as one padding-free packed row."""
    reference: str | None = None
    """DPO / KTO / GRPO: where the reference log-probs come from, in words."""
    dropped: Any = None
    """A stream's drop count (:class:`fastkit.data.stream.DropCount`) when it drops rows, logged at the end of
    training and kept in each checkpoint's run record."""
    reward_counts: Any = None
    """GRPO: the None rewards counted over the run (:class:`fastkit.training.grpo.RewardCounts`)."""
    identity: dict[str, Any] | None = None
    """The run identity ``fit`` checks a checkpoint against (the model card's run options: fastkit.export.hub)."""

    def replace(self, **changes: Any) -> RunRecord:
        """A copy with ``changes`` (names are this record's fields; another name is a TypeError)."""
        return dataclasses.replace(self, **changes)


def record_of(trainer) -> RunRecord:
    """``trainer``'s record; a trainer fastkit did not make (a plain TRL trainer) has the empty one."""
    record = getattr(trainer, "run_record", None)
    return record if isinstance(record, RunRecord) else RunRecord()


__all__ = ["RESUME_HINT", "RunRecord", "record_of"]
