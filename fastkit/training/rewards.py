"""Reward functions to start GRPO from: plain functions with TRL's signature.

Each takes ``completions`` (a list: strings for text prompts, or ``[{"role": "assistant", "content": ...}]`` for
chat prompts), any dataset columns it needs by name (``answer``), and ``**kwargs`` (TRL passes ``prompts``,
``completion_ids`` and the other columns too), and returns one float per completion::

    from fastkit.training.rewards import exact_answer, format_reward
    trainer = make_grpo_trainer(model, tokenizer, math_set, reward_funcs=[format_reward, exact_answer])

The reasoning format they expect is ``<think> ... </think> <answer> ... </answer>``
(:data:`REASONING_SYSTEM_PROMPT` asks for it). Copy one and change it: they are meant to be read.
"""

from __future__ import annotations

import re
from typing import Any

REASONING_SYSTEM_PROMPT = ("Think about the problem inside <think> </think>, then give only the final answer inside "
                           "<answer> </answer>.")
"""A system prompt asking for the format :func:`format_reward` and :func:`exact_answer` check."""

_FORMAT = re.compile(r"^\s*<think>.+?</think>\s*<answer>.+?</answer>\s*$", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def completion_text(completion: Any) -> str:
    """The text of one completion: a string as is, a chat completion's message contents joined."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return str(completion.get("content", ""))
    return "".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in completion)


def format_reward(completions: list, **kwargs: Any) -> list[float]:
    """1.0 when the completion is exactly ``<think>...</think>`` then ``<answer>...</answer>`` (whitespace around
    them allowed, both non-empty, nothing after), else 0.0."""
    return [1.0 if _FORMAT.match(completion_text(c)) else 0.0 for c in completions]


def tags_reward(completions: list, **kwargs: Any) -> list[float]:
    """Partial credit while the format is being learnt: 0.25 for each of ``<think>``, ``</think>``, ``<answer>``,
    ``</answer>`` that appears exactly once (1.0 for all four)."""
    tags = ("<think>", "</think>", "<answer>", "</answer>")
    return [sum(0.25 for t in tags if completion_text(c).count(t) == 1) for c in completions]


def extract_answer(text: str) -> str | None:
    """The final answer in ``text``: the content of its last ``<answer>...</answer>``, else its last number,
    else None."""
    tagged = _ANSWER.findall(text)
    if tagged:
        return tagged[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def normalize_answer(answer: Any) -> str:
    """An answer in a comparable form: a number without thousands separators, trailing zeros or a '$'
    ("1,000.50" -> "1000.5", "3.0" -> "3"); other text lower-cased with spaces collapsed and a final '.' dropped."""
    text = str(answer).strip().strip("$").strip()
    plain = text.replace(",", "")
    if re.fullmatch(r"-?\d+(?:\.\d+)?|-?\.\d+", plain):
        value = float(plain)
        return str(int(value)) if value.is_integer() else repr(value)
    return " ".join(text.lower().rstrip(".").split())


def exact_answer(completions: list, answer: list, **kwargs: Any) -> list[float]:
    """1.0 when the completion's final answer (:func:`extract_answer`) equals the row's ``answer`` column after
    :func:`normalize_answer` (so "1,000" matches "1000" and "3.0" matches "3"), else 0.0."""
    out = []
    for c, want in zip(completions, answer, strict=True):
        got = extract_answer(completion_text(c))
        out.append(1.0 if got is not None and normalize_answer(got) == normalize_answer(want) else 0.0)
    return out


def length_reward(completions: list, completion_ids: list | None = None, target_tokens: int = 200,
                  **kwargs: Any) -> list[float]:
    """1.0 at ``target_tokens`` tokens (``completion_ids``; characters / 4 when TRL gives none), falling linearly
    to 0.0 at zero tokens and at twice the target: keeps answers from growing (or shrinking) without bound.
    Change the target with ``functools.partial(length_reward, target_tokens=100)``."""
    if target_tokens <= 0:
        raise ValueError(f"target_tokens must be positive, got {target_tokens}")
    lengths = ([len(ids) for ids in completion_ids] if completion_ids is not None
               else [len(completion_text(c)) / 4 for c in completions])
    return [max(0.0, 1.0 - abs(n - target_tokens) / target_tokens) for n in lengths]


__all__ = ["REASONING_SYSTEM_PROMPT", "completion_text", "exact_answer", "extract_answer", "format_reward",
           "length_reward", "normalize_answer", "tags_reward"]
