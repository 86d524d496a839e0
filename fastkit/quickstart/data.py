"""The quickstart's data: generated chat examples whose answers are one line of JSON, with correct facts.

Small, deterministic and offline: country capitals, opposites and sums, each answered as
``{"topic": ..., "answer": "<a full sentence>"}``. The sentence restates the question the way the
model answers on its own ("The capital of France is Paris."), so training changes the FORMAT and
nothing else: a bare ``{"answer": "Paris"}`` teaches "a capital from this list goes here" and the
model starts answering Osaka for Japan. Every fact in the training set is right, and the held-out
questions (:data:`HELDOUT_FACTS`, facts the base model knows) measure both format and facts.
"""

from __future__ import annotations

import json
import re

from fastkit.data.samples import CAPITALS, OPPOSITES, quickstart_records
from fastkit.data.samples import quickstart_heldout as heldout_records

HELDOUT_FACTS = {
    "What is the capital of Japan?": "Tokyo",
    "What is the capital of China?": "Beijing",
    "What is the capital of Australia?": "Canberra",
    "What is the capital of the United Kingdom?": "London",
    "What is the opposite of young?": "old",
    "What is the opposite of wet?": "dry",
}
"""Held-out question -> the word a correct answer contains; none of them is in the training set."""
HELDOUT_PROMPTS = list(HELDOUT_FACTS)
"""Asked before and after training; none of them is in the training set."""
TOPIC_KEYS = ("topic", "answer")
"""The keys of a well-formed answer, in this order."""


def follows_format(answer: str) -> bool:
    """True when ``answer`` is exactly one JSON object with the keys ``topic`` and ``answer``."""
    try:
        parsed = json.loads(answer)
    except json.JSONDecodeError:
        return False
    return isinstance(parsed, dict) and set(parsed) == set(TOPIC_KEYS)


def states_fact(answer: str, expected: str) -> bool:
    """True when ``answer`` contains the expected word (case-insensitive, whole word)."""
    return re.search(rf"\b{re.escape(expected)}\b", answer, flags=re.IGNORECASE) is not None


def score(answers: dict[str, str]) -> tuple[int, int]:
    """``(answers in the format, answers with the right fact)`` over :data:`HELDOUT_FACTS`."""
    fmt = sum(follows_format(answers[q]) for q in HELDOUT_FACTS if q in answers)
    facts = sum(states_fact(answers[q], word) for q, word in HELDOUT_FACTS.items() if q in answers)
    return fmt, facts


def quickstart_dataset():
    """``(train, heldout_prompts)`` for the offline quickstart. Held-out prompts are not in train."""
    from datasets import Dataset

    return Dataset.from_list(quickstart_records()), list(HELDOUT_PROMPTS)


__all__ = ["CAPITALS", "HELDOUT_FACTS", "HELDOUT_PROMPTS", "OPPOSITES", "follows_format", "heldout_records",
           "quickstart_dataset", "quickstart_records", "score", "states_fact"]
