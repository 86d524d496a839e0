"""Small shipped sets for preference tuning and reasoning RL: generated in code, deterministic, offline.

- :func:`math_dataset`: grade-school word problems (sums, differences, products) as chat prompts with an
  ``answer`` column (digits only), for GRPO with :func:`fastkit.training.rewards.exact_answer`; the system
  prompt asks for the ``<think>`` / ``<answer>`` format :func:`fastkit.training.rewards.format_reward` checks.
- :func:`preference_dataset`: pairs whose ``chosen`` answer states the right fact (capitals, sums, opposites)
  and whose ``rejected`` answer, in the same words, a wrong one — so a pair differs in the fact alone, not in
  length or style. Held-out pairs (:func:`preference_dataset` ``split="heldout"``) ask about facts the training
  pairs never mention.

Every fact is right (checked by the tests); every row fits 128 tokens of the byte-level twin tokenizer.
"""

from __future__ import annotations

import random
from typing import Any

from fastkit.quickstart.data import CAPITALS, OPPOSITES
from fastkit.training.rewards import REASONING_SYSTEM_PROMPT

HELDOUT_CAPITALS = [("Japan", "Tokyo"), ("China", "Beijing"), ("Australia", "Canberra"), ("Brazil", "Brasilia"),
                    ("Argentina", "Buenos Aires"), ("Turkey", "Ankara")]
"""Capitals asked only in the held-out pairs."""
HELDOUT_OPPOSITES = [("young", "old"), ("wet", "dry"), ("rich", "poor"), ("soft", "hard")]
"""Opposites asked only in the held-out pairs."""

_ITEMS = ("apples", "books", "coins", "pencils", "stamps", "marbles", "cards", "shells")
_NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana")


def _problem(rng: random.Random) -> tuple[str, int]:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    kind = rng.choice(("add", "sub", "mul"))
    if kind == "add":
        a, b = rng.randint(2, 40), rng.randint(2, 40)
        return f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?", a + b
    if kind == "sub":
        a = rng.randint(10, 60)
        b = rng.randint(1, a - 1)
        return f"{name} has {a} {item} and gives away {b}. How many {item} are left?", a - b
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return f"{name} buys {a} boxes with {b} {item} in each. How many {item} is that?", a * b


def math_records(n: int = 48, seed: int = 0, system_prompt: str | None = REASONING_SYSTEM_PROMPT) -> list[dict]:
    """``n`` word problems: ``{"prompt": [system?, user], "answer": "<digits>"}`` (deterministic for a seed)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        question, answer = _problem(rng)
        prompt = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": question}]
        rows.append({"prompt": prompt, "answer": str(answer)})
    return rows


def math_dataset(n: int = 48, seed: int = 0, system_prompt: str | None = REASONING_SYSTEM_PROMPT):
    """:func:`math_records` as a ``datasets.Dataset`` (columns ``prompt``, ``answer``)."""
    from datasets import Dataset

    return Dataset.from_list(math_records(n, seed, system_prompt))


def _wrong_city(rng: random.Random, city: str) -> str:
    return rng.choice([c for _, c in CAPITALS + HELDOUT_CAPITALS if c != city])


def _pair(question: str, chosen: str, rejected: str) -> dict[str, Any]:
    return {"prompt": [{"role": "user", "content": question}],
            "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}]}


def _capital_pairs(rng: random.Random, capitals) -> list[dict]:
    return [_pair(f"What is the capital of {country}?", f"The capital of {country} is {city}.",
                  f"The capital of {country} is {_wrong_city(rng, city)}.") for country, city in capitals]


def _opposite_pairs(rng: random.Random, opposites) -> list[dict]:
    words = [w for pair in OPPOSITES + HELDOUT_OPPOSITES for w in pair]
    return [_pair(f"What is the opposite of {x}?", f"The opposite of {x} is {y}.",
                  f"The opposite of {x} is {rng.choice([w for w in words if w not in (x, y)])}.")
            for x, y in opposites]


def _sum_pairs(rng: random.Random, n: int, low: int, high: int) -> list[dict]:
    rows = []
    for _ in range(n):
        a, b = rng.randint(low, high), rng.randint(low, high)
        wrong = a + b + rng.choice((-10, -2, -1, 1, 2, 10))
        rows.append(_pair(f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}.", f"{a} plus {b} is {wrong}."))
    return rows


def preference_records(split: str = "train", seed: int = 0) -> list[dict]:
    """Preference pairs (chat form: ``prompt``, ``chosen``, ``rejected``); ``split`` 'train' (56 pairs) or
    'heldout' (16 pairs about capitals, opposites and sums the training pairs never ask)."""
    rng = random.Random(seed if split == "train" else seed + 1)
    if split == "train":
        rows = (_capital_pairs(rng, CAPITALS) + _opposite_pairs(rng, OPPOSITES + [(b, a) for a, b in OPPOSITES])
                + _sum_pairs(rng, 10, 2, 30))
    elif split == "heldout":
        rows = (_capital_pairs(rng, HELDOUT_CAPITALS) + _opposite_pairs(rng, HELDOUT_OPPOSITES)
                + _sum_pairs(rng, 6, 31, 60))
    else:
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    rng.shuffle(rows)
    return rows


def preference_dataset(split: str = "train", seed: int = 0):
    """:func:`preference_records` as a ``datasets.Dataset``."""
    from datasets import Dataset

    return Dataset.from_list(preference_records(split, seed))


__all__ = ["HELDOUT_CAPITALS", "HELDOUT_OPPOSITES", "math_dataset", "math_records", "preference_dataset",
           "preference_records"]
