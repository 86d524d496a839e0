"""Benchmarks users know: lm-evaluation-harness run on the model fastkit holds (``fastkit eval --lm-eval TASKS``).

fastkit implements no benchmark here: it delegates to lm-eval (the ``eval`` extra) so that a number is the one the
community quotes. The tasks (their data, prompts, few-shot examples, scoring and metrics) are lm-eval's own:
``lm_eval.simple_evaluate`` with lm-eval's Hugging Face wrapper (``HFLM``) around the model object fastkit already
has in memory, its LoRA adapter on (or disabled, for the base), so nothing is merged or saved first and the result
equals ``lm-eval --model hf`` on the same weights. fastkit's part is the rest: the task names and the folder of local
task files checked before any work (a FastkitError naming close names), lm-eval's results as plain numbers, and the
caller's random state left as it was (lm-eval seeds the global generators).
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import logging
import random
from pathlib import Path
from typing import Any

from fastkit.errors import FastkitError

logger = logging.getLogger(__name__)

BATCH_SIZE = 1
"""lm-eval's own default: one request at a time (no padding, so a batch cannot change a score)."""


def require() -> None:
    """A FastkitError with the install line where lm-eval is not installed."""
    from fastkit.extras import require as require_extra

    require_extra("lm_eval", "--lm-eval (lm-evaluation-harness benchmarks)")


def task_names(value: Any) -> tuple[str, ...]:
    """Task names from ``"a,b"``, ``["a", "b,c"]`` or None, stripped, in order, each once."""
    items = [value] if isinstance(value, str) else list(value or ())
    out: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise FastkitError(f"--lm-eval: task names are text, got {item!r}.")
        out += [p.strip() for p in item.split(",") if p.strip() and p.strip() not in out]
    return tuple(out)


def check_include(path: str | Path | None) -> Path | None:
    """The folder of local task YAML files, checked: it exists, is a folder and holds a ``.yaml`` file."""
    if path is None:
        return None
    folder = Path(path).expanduser()
    if not folder.exists():
        raise FastkitError(f"--lm-eval-include {path}: no such folder; give a folder of lm-eval task YAML files.")
    if not folder.is_dir():
        raise FastkitError(f"--lm-eval-include {path}: a file, not a folder; give the folder that holds it "
                           f"({folder.parent}).")
    if not any(folder.rglob("*.yaml")):
        raise FastkitError(f"--lm-eval-include {path}: holds no .yaml task file; write one (docs/eval.md shows a "
                           "local task) or leave the option out.")
    return folder


@functools.lru_cache(maxsize=8)
def _manager(include: str | None, defaults: bool):
    """lm-eval's task index (indexing its ~14,000 built-in tasks takes ~10 s, so it is built once per folder)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include, include_defaults=defaults)


def resolve(tasks: Any, include_path: str | Path | None = None):
    """The lm-eval TaskManager that knows every name in ``tasks``, checked before any model runs: lm-eval installed,
    at least one name, the include folder there, every name known (an unknown one refused with close names). Names
    found in the include folder are looked up there alone (the built-in tasks are indexed only when needed)."""
    require()
    names = task_names(tasks)
    if not names:
        raise FastkitError("--lm-eval: give at least one task name (e.g. --lm-eval hellaswag,arc_easy).")
    folder = check_include(include_path)
    if folder is not None:
        local = _manager(str(folder), False)
        if all(name in local.all_tasks for name in names):
            return local
    manager = _manager(None if folder is None else str(folder), True)
    unknown = [name for name in names if name not in manager.all_tasks]
    if unknown:
        raise FastkitError(_unknown(unknown, manager.all_tasks, folder))
    return manager


def _unknown(unknown: list[str], known: list[str], folder: Path | None) -> str:
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=5, cutoff=0.6)
        hints.append(f"{name!r}" + (f" (close: {', '.join(close)})" if close else ""))
    where = f"lm-eval's tasks or {folder}" if folder else "lm-eval's tasks"
    return (f"--lm-eval: unknown task {'; '.join(hints)}: not in {where}. `lm-eval ls tasks` lists them; a task of "
            "your own: put its YAML file in a folder and give --lm-eval-include DIR.")


def run(model, tokenizer, tasks: Any, include_path: str | Path | None = None, *, limit: int | None = None,
        batch_size: int = BATCH_SIZE) -> dict[str, dict[str, float]]:
    """lm-eval's ``tasks`` on ``model`` as it is (a PEFT model with its adapter on, or any transformers model; a run
    folder is loaded by ``fastkit eval --run``) -> ``{task: {metric: value}}``. ``include_path``: a folder of local
    task YAML files; ``limit``: rows per task (lm-eval's ``limit``); the caller's train mode and random state are left
    as they were."""
    manager = resolve(tasks, include_path)
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    was_training = model.training
    model.eval()
    try:
        with _kept_rng():
            lm = HFLM(pretrained=model, tokenizer=_own(tokenizer), batch_size=batch_size)
            out = lm_eval.simple_evaluate(model=lm, tasks=list(task_names(tasks)), task_manager=manager,
                                          limit=limit, batch_size=batch_size, log_samples=False)
    finally:
        model.train(was_training)
    return metrics(out)


def _own(tokenizer):
    """The tokenizer lm-eval may change: a copy where it has no pad token (lm-eval sets one), else itself."""
    if getattr(tokenizer, "pad_token", None) is None:
        import copy

        return copy.deepcopy(tokenizer)
    return tokenizer


def metrics(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """``simple_evaluate``'s results as ``{task: {metric: value}}``: its numbers only (no stderr, no alias); a metric
    under a filter other than lm-eval's ``none`` is named ``metric (filter)``."""
    out: dict[str, dict[str, float]] = {}
    for task, values in results["results"].items():
        row = {}
        for key, value in values.items():
            metric, _, kind = key.partition(",")
            if not kind or metric.endswith("_stderr") or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            row[metric if kind == "none" else f"{metric} ({kind})"] = float(value)
        out[task] = row
    return out


def side_by_side(base: dict[str, dict[str, float]], tuned: dict[str, dict[str, float]]):
    """``{task: {metric: (base, tuned)}}`` for the metrics both runs have."""
    return {task: {m: (base[task][m], tuned[task][m]) for m in tuned[task] if m in base.get(task, {})}
            for task in tuned}


@contextlib.contextmanager
def _kept_rng():
    """Python's, NumPy's and torch's global random states restored after lm-eval seeds them."""
    import numpy as np
    import torch

    states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])


__all__ = ["BATCH_SIZE", "check_include", "metrics", "require", "resolve", "run", "side_by_side",
           "task_names"]
