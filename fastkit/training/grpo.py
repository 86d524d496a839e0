"""GRPO's front door: prompts checked before any generation, reward functions that name themselves when they fail.

:func:`check_prompts` refuses, naming the row and field, a row without a usable ``prompt``, a prompt that ends with
an assistant turn, one longer than ``max_prompt_length`` tokens, and a column a reward function needs by name
(``answer``) that the data lacks or leaves empty. :func:`wrap_reward_funcs` wraps each plain reward function in a
:class:`CheckedReward`: TRL's signature (``prompts``, ``completions``, ``completion_ids``, the dataset's columns as
keyword lists), TRL's name for it (``rewards/<name>/mean`` in the logs), and a :class:`FastkitError` naming the
function and the row when it raises, returns None, returns the wrong number of rewards, or a reward that is not
a finite number (None for one completion stays TRL's "not applicable": NaN, left out of the mean).

The rule for reward values: a number (int, float, NumPy / torch scalar) is trained on; None is TRL's "not
applicable" and is *counted* (:class:`RewardCounts`: per function, and the completions no function scored, which
TRL gives advantage 0 and so never trains on), logged when it first happens and summed up at the end of the run;
a batch in which no function scored any completion is warned about, and :data:`UNSCORED_BATCHES` such batches in a
row end the run with a FastkitError naming the functions (an adapter trained on nothing would otherwise be saved
and "verified"). NaN, inf, a bool, a string or any other type, the wrong number of values, no list at all, or an
exception are refused at once, naming the function, the value and the completion.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

from fastkit.errors import FastkitError

logger = logging.getLogger(__name__)

UNSCORED_BATCHES = 3
"""Batches of completions in a row that no reward function scored (every value None) before the run is refused."""
TRL_REWARD_ARGS = frozenset({"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric",
                             "environments"})
"""Keyword arguments TRL 1.16's GRPOTrainer gives every reward function besides the dataset's columns."""


def reward_name(fn: Callable) -> str:
    """TRL's display name for a reward function (a partial's inner function, a class instance's class)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", type(fn).__name__)


def needed_columns(fn: Callable) -> list[str]:
    """Keyword arguments ``fn`` requires (no default) that TRL does not supply: dataset columns."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in sig.parameters.values()
            if p.kind in kinds and p.default is inspect.Parameter.empty and p.name not in TRL_REWARD_ARGS]


class CheckedReward:
    """A reward function with fastkit's checks around each call (see the module docstring)."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self.__name__ = reward_name(fn)
        self.__doc__ = getattr(fn, "__doc__", None)

    def __call__(self, prompts: list, completions: list, **kwargs: Any) -> list[float | None]:
        n = len(completions)
        try:
            out = self.fn(prompts=prompts, completions=completions, **kwargs)
        except (Exception, SystemExit) as exc:  # sys.exit() in a reward would end the run without a word
            row = self._failing_row(prompts, completions, kwargs)
            where = f" on completion {row} (prompt {_short(prompts[row])})" if row is not None else ""
            raise FastkitError(f"reward function {self.__name__!r} raised {type(exc).__name__}: {exc}{where}.") from exc
        if out is None:
            raise FastkitError(f"reward function {self.__name__!r} returned None for a batch of {n} completions: it "
                               "must return a list with one float per completion (a missing `return`?).")
        if isinstance(out, (list, tuple)) or hasattr(out, "tolist"):  # a list, tuple, numpy array or tensor
            out = list(out.tolist() if hasattr(out, "tolist") else out)
        if not isinstance(out, list) or len(out) != n:
            got = f"{len(out)} values" if isinstance(out, list) else type(out).__name__
            raise FastkitError(f"reward function {self.__name__!r} returned {got} for {n} completions: it must return "
                               "one float per completion, in order.")
        for i, value in enumerate(out):
            _check_value(self.__name__, value, i, prompts)
        return [None if v is None else float(v) for v in out]

    def _failing_row(self, prompts: list, completions: list, kwargs: dict) -> int | None:
        """The first completion the function fails on alone (it is called row by row to find it)."""
        n = len(completions)
        for i in range(n):
            one = {k: v[i:i + 1] if isinstance(v, list) and len(v) == n else v for k, v in kwargs.items()}
            try:
                self.fn(prompts=prompts[i:i + 1], completions=completions[i:i + 1], **one)
            except (Exception, SystemExit):
                return i
        return None


def _check_value(name: str, value: Any, i: int, prompts: list) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise FastkitError(f"reward function {name!r} returned {type(value).__name__} {str(value)[:40]!r} for "
                           f"completion {i} (prompt {_short(prompts[i])}): rewards must be numbers (or None).")
    if not math.isfinite(float(value)):
        raise FastkitError(f"reward function {name!r} returned {value} for completion {i} (prompt "
                           f"{_short(prompts[i])}): rewards must be finite.")


def _short(prompt: Any) -> str:
    if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):
        prompt = prompt[-1].get("content", "")
    return repr(str(prompt)[:60])


def wrap_reward_funcs(reward_funcs) -> list:
    """Each reward function wrapped in :class:`CheckedReward`; reward models, model ids and async functions are
    left to TRL as they are."""
    from trl.trainer.utils import is_async_callable

    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    if not funcs:
        raise FastkitError("reward_funcs is empty: give at least one reward function (fastkit.training.rewards has "
                           "format_reward, exact_answer, length_reward).")
    out = []
    for fn in funcs:
        if not callable(fn) and not isinstance(fn, str):
            raise FastkitError(f"reward_funcs: {fn!r} is not callable; give functions "
                               "f(prompts, completions, **columns) -> list[float].")
        keep = isinstance(fn, (CheckedReward, str)) or hasattr(fn, "config") or is_async_callable(fn)
        out.append(fn if keep else CheckedReward(fn))
    names = [reward_name(f) for f in out if not isinstance(f, str)]
    if len(set(names)) != len(names):
        raise FastkitError(f"reward_funcs has two functions named the same ({names}); the dashboard and logs tell them "
                           "apart by name: rename one.")
    return out


class RewardCounts:
    """None rewards counted across a run (see the module docstring): per function, and the completions that no
    function scored; :data:`UNSCORED_BATCHES` wholly unscored batches in a row raise a FastkitError."""

    def __init__(self, names: list[str]):
        self.names = names
        self.none = [0] * len(names)
        self.completions = self.unscored = self.in_row = 0

    def add(self, rewards) -> None:
        """One batch's ``(completions, functions)`` rewards, NaN where a function returned None (TRL's form, gathered
        from every process, so every rank counts and refuses alike)."""
        import torch

        missing = torch.isnan(rewards.detach().float()).cpu()
        n = missing.shape[0]
        unscored = int(missing.all(dim=1).sum())
        self.completions += n
        self.unscored += unscored
        self.none = [a + int(b) for a, b in zip(self.none, missing.sum(dim=0).tolist())]
        self.in_row = self.in_row + 1 if n and unscored == n else 0
        if self.in_row >= UNSCORED_BATCHES:
            raise FastkitError(f"reward function(s) {self._named()} returned None for every completion of "
                               f"{self.in_row} batches in a row: GRPO has nothing to learn from (every advantage is "
                               "0, the adapter would not move). Make them return a number for the completions they "
                               "can judge (None means 'not applicable').")
        if unscored and self.unscored == unscored:  # the first time: said at once, summed up at the end
            logger.warning("fastkit: %d of %d completions got None from every reward function (%s): their advantage "
                           "is 0, they are not trained on (counted; summed up at the end of the run)", unscored, n,
                           self._named())

    def _named(self) -> str:
        return ", ".join(repr(name) for name in self.names)

    def summary(self) -> str | None:
        """One line of the run's None counts, or None when every function scored every completion."""
        if not any(self.none):
            return None
        per = "; ".join(f"{name!r} None for {k} of {self.completions}" + (" (every one: never applicable?)"
                                                                            if k == self.completions else "")
                        for name, k in zip(self.names, self.none) if k)
        return (f"GRPO rewards over the run: {per}; {self.unscored} of {self.completions} completions scored by no "
                "function (advantage 0, not trained on)")


class CountedRewards:
    """A ``trl.GRPOTrainer`` (the class this mixes into) that counts the None rewards as it scores each training batch
    into ``run_record.reward_counts`` (:class:`RewardCounts`, started by :func:`watch_rewards`)."""

    def _calculate_rewards(self, *args: Any, **kwargs: Any):
        rewards = super()._calculate_rewards(*args, **kwargs)
        counts = self.run_record.reward_counts
        if counts is not None and self.model.training:  # evaluation batches are not trained on
            counts.add(rewards)
        return rewards


def watch_rewards(trainer) -> RewardCounts:
    """Start counting the None rewards of ``trainer`` (a :class:`CountedRewards` trainer): the counts on its record
    (``run_record.reward_counts``), logged at the end of training."""
    from transformers import TrainerCallback

    counts = RewardCounts([reward_name(f) if not isinstance(f, str) else f for f in trainer.reward_funcs])

    class _Summary(TrainerCallback):
        def on_train_end(self, args, state, control, **kwargs):
            line = counts.summary()
            if line:
                logger.warning("fastkit: %s", line)

    trainer.add_callback(_Summary())
    trainer.update_record(reward_counts=counts)
    return counts


def _check_prompt(prompt: Any, i: int, dataset: str = "train_dataset") -> None:
    where = f"{dataset} row {i + 1} field 'prompt'"
    if isinstance(prompt, str):
        if not prompt.strip():
            raise FastkitError(f"{where} is empty.")
        return
    if not (isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt)):
        raise FastkitError(f"{where} must be text or a list of messages, got {type(prompt).__name__} "
                           f"{str(prompt)[:60]!r}.")
    for j, m in enumerate(prompt):
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise FastkitError(f"{where}[{j}] needs text 'role' and 'content' (got {sorted(m)}).")
    if prompt[-1]["role"] == "assistant":
        raise FastkitError(f"{where} ends with an assistant message: GRPO generates the assistant's answer, so the "
                           "prompt ends with the user's turn.")


def _prompt_length(tokenizer, prompt: Any) -> int:
    if isinstance(prompt, str):
        return len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    return len(tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True, return_dict=True)
               ["input_ids"])


def check_prompts(dataset, tokenizer, reward_funcs: Sequence, max_prompt_length: int,
                  where: str = "train_dataset") -> None:
    """Every row a usable GRPO prompt, every column a reward function needs present and filled (see the module)."""
    chat = check_prompt_rows(dataset, reward_funcs, where)
    if chat:
        from fastkit.data.chat_template import require_chat_template

        require_chat_template(tokenizer)
    for i, prompt in enumerate(dataset["prompt"]):
        n = _prompt_length(tokenizer, prompt)
        if n > max_prompt_length:
            raise FastkitError(f"{where} row {i + 1}: the prompt has {n} tokens, above max_prompt_length="
                               f"{max_prompt_length} (the context less max_completion_length). Shorten it or raise "
                               "max_prompt_length.")


def check_prompt_rows(dataset, reward_funcs: Sequence, where: str = "train_dataset") -> bool:
    """What :func:`check_prompts` checks without a tokenizer (``fastkit grpo``'s preflight, before the model loads):
    the prompts' form and the reward functions' columns. Returns True for chat (message list) prompts."""
    if len(dataset) == 0:
        raise FastkitError(f"{where} is empty: give prompts (a 'prompt' column).")
    if "prompt" not in dataset.column_names:
        raise FastkitError(f"{where} has no 'prompt' column (columns: {dataset.column_names}): GRPO generates "
                           "answers to prompts.")
    for fn in reward_funcs:
        _check_reward_columns(dataset, fn, where)
    chat = any(isinstance(p, list) for p in dataset["prompt"])
    for i, prompt in enumerate(dataset["prompt"]):
        _check_prompt(prompt, i, where)
        if isinstance(prompt, list) != chat:
            raise FastkitError(f"{where} row {i + 1}: prompts mix text and chat messages; use one form.")
    return chat


def _check_reward_columns(dataset, fn, where: str) -> None:
    inner = fn.fn if isinstance(fn, CheckedReward) else fn
    for col in needed_columns(inner) if callable(inner) else []:
        if col not in dataset.column_names:
            raise FastkitError(f"reward function {reward_name(inner)!r} needs the column {col!r}, but "
                               f"{where} has {dataset.column_names}: add it (or give it a default).")
        for i, value in enumerate(dataset[col]):
            if value is None or isinstance(value, str) and not value.strip():
                raise FastkitError(f"{where} row {i + 1} field {col!r} is empty; reward function "
                                   f"{reward_name(inner)!r} reads it.")


def answer_scores(model, tokenizer, dataset, reward_funcs: Sequence, max_new_tokens: int = 256,
                  **chat_kwargs: Any) -> dict[str, float]:
    """Mean reward per function of the model's greedy answers to ``dataset``'s prompts (through
    :func:`fastkit.export.chat`), the other columns given to the reward functions as in training."""
    from fastkit.export import chat

    rows = list(dataset)
    answers = [chat(model, tokenizer, row["prompt"], max_new_tokens=max_new_tokens, stream=False, **chat_kwargs)
               for row in rows]
    chat_form = bool(rows) and isinstance(rows[0]["prompt"], list)
    completions = [[{"role": "assistant", "content": a}] if chat_form else a for a in answers]
    columns = {k: [row[k] for row in rows] for k in (rows[0] if rows else {}) if k != "prompt"}
    scores = {}
    for fn in wrap_reward_funcs(reward_funcs):
        values = fn(prompts=[row["prompt"] for row in rows], completions=completions, **columns)
        scores[reward_name(fn)] = sum(v for v in values if v is not None) / max(1, len(values))
    return scores


__all__ = ["TRL_REWARD_ARGS", "UNSCORED_BATCHES", "CheckedReward", "CountedRewards", "RewardCounts", "answer_scores",
           "check_prompt_rows", "check_prompts", "needed_columns", "reward_name", "watch_rewards", "wrap_reward_funcs"]
