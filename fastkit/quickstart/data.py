"""The quickstart's data: generated chat examples whose answers are one line of JSON.

Small, deterministic and offline: country capitals, opposites and sums, each answered as
``{"answer": ..., "topic": ...}``, so 20 LoRA steps visibly change how the model answers.
The held-out prompts are not in the training set.
"""

from __future__ import annotations

import json
import random
from typing import Any

CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Portugal", "Lisbon"),
    ("Peru", "Lima"), ("Chile", "Santiago"), ("Kenya", "Nairobi"), ("Egypt", "Cairo"), ("India", "New Delhi"),
    ("Canada", "Ottawa"), ("Mexico", "Mexico City"), ("Norway", "Oslo"), ("Sweden", "Stockholm"),
    ("Finland", "Helsinki"), ("Poland", "Warsaw"), ("Greece", "Athens"), ("Ireland", "Dublin"),
    ("Austria", "Vienna"), ("Hungary", "Budapest"), ("Argentina", "Buenos Aires"), ("Cuba", "Havana"),
    ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"), ("South Korea", "Seoul"), ("Russia", "Moscow"),
]
"""(country, capital) pairs: 'What is the capital of X?'."""
OPPOSITES = [("hot", "cold"), ("big", "small"), ("fast", "slow"), ("happy", "sad"), ("light", "dark"),
              ("early", "late"), ("open", "closed"), ("full", "empty"), ("strong", "weak"), ("high", "low")]
"""Word pairs, asked both ways: 'What is the opposite of X?'."""
HELDOUT_PROMPTS = ["What is the capital of Japan?", "What is 17 plus 25?", "What is the opposite of young?"]
"""Asked before and after training; none of them is in the training set."""


def _answer(answer: str, topic: str) -> str:
    return json.dumps({"answer": answer, "topic": topic})


def quickstart_records(n_arithmetic: int = 60, seed: int = 0) -> list[dict[str, Any]]:
    """Generated chat examples (deterministic): questions answered as one line of JSON."""
    rng = random.Random(seed)
    records = [(f"What is the capital of {country}?", _answer(city, "geography")) for country, city in CAPITALS]
    records += [(f"What is the opposite of {a}?", _answer(b, "language")) for a, b in OPPOSITES]
    records += [(f"What is the opposite of {b}?", _answer(a, "language")) for a, b in OPPOSITES]
    for _ in range(n_arithmetic):
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        records.append((f"What is {a} plus {b}?", _answer(str(a + b), "arithmetic")))
    rng.shuffle(records)
    return [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": r}]} for q, r in records]


def quickstart_dataset():
    """``(train, heldout_prompts)`` for the offline quickstart. Held-out prompts are not in train."""
    from datasets import Dataset

    return Dataset.from_list(quickstart_records()), list(HELDOUT_PROMPTS)


__all__ = ["CAPITALS", "HELDOUT_PROMPTS", "OPPOSITES", "quickstart_dataset", "quickstart_records"]
