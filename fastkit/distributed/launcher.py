"""``fastkit.launch(train_fn, num_processes=2)``: several processes from a notebook (Kaggle's 2 x T4), through
accelerate's ``notebook_launcher``.

Each process runs ``train_fn(*args)`` (forked: a function defined in the notebook works); accelerate's state and
the process group are made inside it, by fastkit or the Trainer, as under ``torchrun``. The main process (rank 0)
prints, draws the dashboard and saves (:mod:`fastkit.distributed.ranks`); the dashboard is drawn as text lines
(``FASTKIT_DASHBOARD=terminal``), which a forked process can print into the notebook. What ``train_fn`` returns on
rank 0 is returned here (when it can be pickled; the model and trainer stay in the processes: save from inside
``train_fn``).
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastkit import _hf, checks
from fastkit.errors import FastkitError

logger = logging.getLogger("fastkit")

FSDP2_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP"}
"""What ``launch(..., fsdp=True)`` sets for the processes: FSDP2, one shard unit per decoder layer (what
``accelerate launch --config_file fsdp2.yaml`` sets from docs/fsdp2.yaml)."""


def launch(train_fn: Callable[..., Any], *args: Any, num_processes: int | None = None, fsdp: bool = False,
           port: int | None = None, mixed_precision: str = "no") -> Any:
    """Run ``train_fn(*args)`` on ``num_processes`` processes (default: one per CUDA GPU) and return rank 0's result.

    ``fsdp=True``: FSDP2 (:data:`FSDP2_ENV`), else DDP. ``port``: the rendezvous port on this machine (default: a
    free one). One process (or no GPU and ``num_processes`` not given): ``train_fn(*args)`` here, as it is.
    Load the model inside ``train_fn``: nothing that makes accelerate's state (``make_trainer``, ``fit``) may have
    run in the notebook before (restart the kernel), or the processes would inherit a one-process state.
    """
    if not callable(train_fn):
        raise FastkitError(f"fastkit.launch: train_fn must be a function, got {type(train_fn).__name__}.")
    num_processes = _processes(num_processes)
    checks.check_bool("fsdp", fsdp)
    if num_processes == 1:
        return train_fn(*args)
    if _hf.accelerate_state_made():
        raise FastkitError("fastkit.launch: accelerate's state was already made in this notebook (a make_trainer, fit "
                           "or Accelerator ran here), so the processes would inherit one process's state. Restart the "
                           "kernel and call fastkit.launch first, with the model loaded inside train_fn.")
    with tempfile.TemporaryDirectory(prefix="fastkit-launch-") as folder:
        result = Path(folder) / "rank0.pkl"
        try:
            _start(_rank0(train_fn, result), args, num_processes, fsdp, port or _free_port(), mixed_precision)
        except Exception as exc:  # noqa: BLE001 -- torch's ChildFailedError: said as what the process raised
            failed, ours = _failures(Path(folder))
            if not failed:
                raise
            error = FastkitError(f"fastkit.launch: {failed}")
            if ours:  # fastkit's own refusals say all there is; torch's page of launcher frames would bury them
                raise error from None
            raise error from exc
        return pickle.loads(result.read_bytes()) if result.is_file() else None


def _processes(num_processes: int | None) -> int:
    if num_processes is None:
        import torch

        return max(1, torch.cuda.device_count())
    checks.check_positive("num_processes", num_processes)
    return num_processes


def _start(fn: Callable[..., Any], args: tuple, num_processes: int, fsdp: bool, port: int,
           mixed_precision: str) -> None:
    from accelerate import notebook_launcher
    from accelerate.utils import patch_environment

    env = {"FASTKIT_DASHBOARD": os.environ.get("FASTKIT_DASHBOARD", "terminal"), **(FSDP2_ENV if fsdp else {})}
    with patch_environment(**env):
        notebook_launcher(fn, args, num_processes=num_processes, use_port=str(port), master_addr="127.0.0.1",
                          mixed_precision=mixed_precision)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _failures(folder: Path) -> tuple[str, bool]:
    """What each failed process raised (``failed-<rank>.txt``, written by :func:`_rank0`'s wrapper), one line per
    process, the first to fail first (``""`` when none wrote one: a process died without a Python exception), and
    whether every one was a :class:`FastkitError` (a refusal whose message says what to do)."""
    files = sorted(folder.glob("failed-*.txt"), key=lambda f: f.stat().st_mtime_ns)
    lines = [f.read_text().split("\n", 1) for f in files]  # [ours flag, "Type: message"]
    said = "\n".join(f"process {f.stem.split('-')[1]} raised {text}" for f, (_, text) in zip(files, lines))
    return said, bool(lines) and all(flag == "1" for flag, _ in lines)


def _rank0(fn: Callable[..., Any], path: Path) -> Callable[..., None]:
    """``fn`` in each process; rank 0 writes what it returned to ``path`` (pickled, when it can be)."""

    @functools.wraps(fn)  # torch's elastic launch names the run after the function
    def run(*args: Any) -> None:
        rank = os.environ.get("RANK", "0")
        try:
            value = fn(*args)
        except BaseException as exc:
            ours = int(isinstance(exc, FastkitError) or getattr(exc, "fastkit_agreed", False))
            (path.parent / f"failed-{rank}.txt").write_text(f"{ours}\n{type(exc).__name__}: {exc}")
            raise
        if rank != "0":
            return
        try:
            path.write_bytes(pickle.dumps(value))
        except Exception as exc:  # noqa: BLE001 -- a model, a trainer: not returned, said once
            logger.warning("fastkit.launch: rank 0's result (%s) cannot be pickled (%s); None is returned. Save "
                           "from inside train_fn.", type(value).__name__, exc)

    return run


__all__ = ["FSDP2_ENV", "launch"]
