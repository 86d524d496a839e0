"""The processes of a ``torchrun`` / ``accelerate launch`` job: one reports, every one ends the same way.

Which process is which is accelerate's :class:`~accelerate.PartialState` (a project dependency; it sets up the
process group from the launcher's environment, as the Trainer does later). One process, the main one
(rank 0), prints, draws the dashboard, saves, verifies, exports and uploads; the other ranks' ``fastkit``
loggers are at WARNING (:func:`quiet_replicas`), so a job shows one set of lines.

How a failure reaches every rank, without a timeout deciding it:

- steps that every rank runs with no collective in flight (``fastkit train``'s checks before the model loads)
  and steps only the main process runs (the saves) go through :func:`agreed`: afterwards every rank gathers
  every rank's outcome, and each one raises the first failing rank's error (:class:`OtherRankFailed` on the
  ranks it did not happen on), so the exit status is the same on every rank and the message is that rank's.
  The gather runs over a gloo group of its own whose timeout is :data:`WAIT` (a save of a large model with
  GGUF exports and an upload can take longer than the training process group's ``ddp_timeout``);
- an error during training, while the other ranks may be inside a collective of the step, is not gathered
  (a gather there would be matched against the step's all-reduce and hang): the failing rank exits, its peers'
  collectives fail as its connections close, and ``torchrun`` ends the remaining ranks (its own failure
  propagation) and exits non-zero.
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from fastkit.errors import FastkitError

logger = logging.getLogger(__name__)

WAIT = timedelta(days=7)
"""How long :func:`agreed` lets the other ranks wait for the main process (its saves): a week, i.e. no limit a
run can reach; a rank that dies ends the wait at once (its connection closes)."""

_group: list[Any] = []  # the gloo group of :func:`agreed`, made on first use (every rank makes it at the same point)
_ending: list[Any] = []  # :func:`_end_groups` once registered with atexit (the first multi-process state())


class OtherRankFailed(Exception):
    """Raised on every rank but the one that failed, by :func:`agreed`: the failing rank's error, by name."""

    fastkit_agreed = True

    def __init__(self, rank: int, kind: str, message: str, bad_input: bool, interrupted: bool):
        super().__init__(message)
        self.rank, self.kind, self.message = rank, kind, message
        self.bad_input, self.interrupted = bad_input, interrupted


def state():
    """accelerate's ``PartialState`` (made on first call; under a launcher it joins the process group: NCCL with
    this rank's GPU where CUDA is, gloo on the CPU, as the Trainer's own state for ``use_cpu=True``)."""
    import torch
    from accelerate import PartialState

    partial = PartialState(cpu=not torch.cuda.is_available())
    if partial.num_processes > 1 and not _ending:
        _ending.append(atexit.register(_end_groups))
    return partial


def _end_groups() -> None:
    """Destroy :func:`agreed`'s group and the job's process group while the interpreter is still whole.

    A process that exits with a gloo group alive can abort in interpreter finalization ("terminate called without an
    active exception", SIGABRT: gloo's worker threads still hold work whose tensors need the GIL), so a job whose
    ranks all finished exits non-zero now and then. torch does not do this at exit itself
    (https://github.com/pytorch/pytorch/pull/179291, abandoned; drop this when torch destroys groups at exit)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return
    try:
        while _group:
            dist.destroy_process_group(_group.pop())
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 -- at exit: a group a peer's death already broke is no reason to fail
        logger.debug("process groups not destroyed at exit: %s", exc)


def is_main() -> bool:
    """True on the process that reports and saves (rank 0; the only process of a plain run)."""
    return bool(state().is_main_process)


def world_size() -> int:
    """How many processes the job has (1 for a plain run)."""
    return int(state().num_processes)


def fsdp_asked() -> bool:
    """True when the launcher asked for FSDP (``accelerate launch --use_fsdp`` or a config with
    ``distributed_type: FSDP``: both set ``ACCELERATE_USE_FSDP=true``)."""
    import os

    return os.environ.get("ACCELERATE_USE_FSDP", "false").strip().lower() in ("true", "1", "yes")


def quiet_replicas() -> None:
    """The ``fastkit`` loggers at WARNING on every rank but the main one (their warnings still show)."""
    if not is_main():
        logging.getLogger("fastkit").setLevel(logging.WARNING)


def agreed(fn: Callable[..., Any], *args: Any, main_only: bool = False, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` on every rank (``main_only``: on the main process; the others wait for it), then
    every rank learns every rank's outcome: all go on, or each raises the first failing rank's error (its own
    exception on that rank, :class:`OtherRankFailed` on the others). Returns ``fn``'s result (None on the ranks
    that did not run it). A plain run calls ``fn`` and nothing else."""
    if world_size() == 1:
        return fn(*args, **kwargs)
    result, failure = None, None
    if is_main() or not main_only:
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:  # KeyboardInterrupt too: the others must not wait on
            failure = exc
    outcomes = _gather(None if failure is None else _describe(failure))
    first = next(((rank, o) for rank, o in enumerate(outcomes) if o is not None), None)
    if first is None:
        return result
    rank, outcome = first
    error = failure if rank == state().process_index and failure is not None else OtherRankFailed(rank, *outcome)
    error.fastkit_agreed = True  # every rank knows it: the main process reports it (the CLI's error line)
    raise error


def reported_elsewhere(exc: BaseException) -> bool:
    """True for an error :func:`agreed` shared, on a rank that is not the main one: the main process reports it."""
    return bool(getattr(exc, "fastkit_agreed", False)) and not is_main()


def _describe(exc: BaseException) -> tuple[str, str, bool, bool]:
    """(type name, message, bad input, interrupted): what the other ranks need to end the same way."""
    bad_input = isinstance(exc, (FastkitError, FileNotFoundError))
    if isinstance(exc, OtherRankFailed):
        return exc.kind, exc.message, exc.bad_input, exc.interrupted
    return type(exc).__name__, str(exc), bad_input, isinstance(exc, KeyboardInterrupt)


def _gather(outcome: Any) -> list[Any]:
    """Every rank's ``outcome``, by rank, over :func:`_wait_group`."""
    import torch.distributed as dist

    outcomes: list[Any] = [None] * world_size()
    dist.all_gather_object(outcomes, outcome, group=_wait_group())
    return outcomes


def _wait_group():
    """A gloo group of every rank with the :data:`WAIT` timeout (objects travel on the host, also under NCCL)."""
    import torch.distributed as dist

    if not _group:
        _group.append(dist.new_group(backend="gloo", timeout=WAIT))
    return _group[0]


__all__ = ["WAIT", "OtherRankFailed", "agreed", "is_main", "quiet_replicas", "reported_elsewhere", "state",
           "world_size"]
