"""The offline datasets fastkit ships, by the names ``--data`` and :func:`fastkit.data.load_sources` know.

- ``"sample"``: :data:`NO_ROBOTS_SAMPLE`, 16 chats in HuggingFaceH4/no_robots' schema (``prompt``, ``prompt_id``,
  ``messages`` with system / user / assistant turns, ``category``), 5 of them multi-turn, written for fastkit (not
  rows of no_robots): ``fastkit train --data sample``, and what CI trains the CLI and notebooks on.
- ``"quickstart"``: :func:`quickstart_records`, the quickstart's generated chats (capitals, opposites, sums), each
  answered as one line of JSON with a true sentence (:mod:`fastkit.quickstart.data` explains why, and scores it).
- ``"quickstart-heldout"``: :func:`quickstart_heldout`, 16 rows of that task the quickstart does not train on
  (``fastkit eval --data quickstart-heldout``).

They live in the data layer so the data front door resolves the names without importing the quickstart (which
imports the trainer: an upward import).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

NO_ROBOTS_SAMPLE = Path(__file__).with_name("no_robots_sample.jsonl")
"""The shipped no_robots-shaped chats (multi-turn rows included), a .jsonl file."""

CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Portugal", "Lisbon"),
    ("Peru", "Lima"), ("Chile", "Santiago"), ("Kenya", "Nairobi"), ("Egypt", "Cairo"), ("India", "New Delhi"),
    ("Canada", "Ottawa"), ("Mexico", "Mexico City"), ("Norway", "Oslo"), ("Sweden", "Stockholm"),
    ("Finland", "Helsinki"), ("Poland", "Warsaw"), ("Greece", "Athens"), ("Ireland", "Dublin"),
    ("Austria", "Vienna"), ("Hungary", "Budapest"), ("Nepal", "Kathmandu"), ("Cuba", "Havana"),
    ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"), ("South Korea", "Seoul"), ("Russia", "Moscow"),
]
"""(country, capital) pairs: 'What is the capital of X?'. Each row fits 128 tokens of the byte-level twin tokenizer."""
OPPOSITES = [("hot", "cold"), ("big", "small"), ("fast", "slow"), ("happy", "sad"), ("light", "dark"),
              ("early", "late"), ("open", "closed"), ("full", "empty"), ("strong", "weak"), ("high", "low")]
"""Word pairs, asked both ways: 'What is the opposite of X?'."""


def answer_json(sentence: str, topic: str) -> str:
    """A quickstart answer: one line of JSON, {"topic": ..., "answer": sentence}."""
    return json.dumps({"topic": topic, "answer": sentence})


def quickstart_records(n_arithmetic: int = 60, seed: int = 0) -> list[dict[str, Any]]:
    """Generated chat examples (deterministic): questions answered as one line of JSON with a true sentence."""
    rng = random.Random(seed)
    records = [(f"What is the capital of {country}?", answer_json(f"The capital of {country} is {city}.", "geography"))
               for country, city in CAPITALS]
    for x, y in OPPOSITES + [(b, a) for a, b in OPPOSITES]:
        records.append((f"What is the opposite of {x}?", answer_json(f"The opposite of {x} is {y}.", "language")))
    for _ in range(n_arithmetic):
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        records.append((f"What is {a} plus {b}?", answer_json(f"{a} plus {b} is {a + b}.", "arithmetic")))
    rng.shuffle(records)
    return [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": r}]} for q, r in records]


def quickstart_heldout(n_arithmetic: int = 10, seed: int = 1) -> list[dict]:
    """Held-out rows of the quickstart's format task, answered in its format: six facts the base model knows
    (:data:`fastkit.quickstart.data.HELDOUT_FACTS`) and ``n_arithmetic`` sums the training set does not ask (for
    ``fastkit.evaluate`` / ``fastkit eval --data quickstart-heldout``; ``fastkit.quickstart.data.heldout_records``)."""
    facts = {"What is the capital of Japan?": "The capital of Japan is Tokyo.",
             "What is the capital of China?": "The capital of China is Beijing.",
             "What is the capital of Australia?": "The capital of Australia is Canberra.",
             "What is the capital of the United Kingdom?": "The capital of the United Kingdom is London.",
             "What is the opposite of young?": "The opposite of young is old.",
             "What is the opposite of wet?": "The opposite of wet is dry."}
    pairs = [(q, answer_json(s, "geography" if "capital" in q else "language")) for q, s in facts.items()]
    trained = {r["messages"][0]["content"] for r in quickstart_records()}
    rng = random.Random(seed)
    while len(pairs) < len(facts) + n_arithmetic:
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        question = f"What is {a} plus {b}?"
        if question not in trained and question not in dict(pairs):
            pairs.append((question, answer_json(f"{a} plus {b} is {a + b}.", "arithmetic")))
    return [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in pairs]


OFFLINE_NAMES = {"sample": "16 chats in HuggingFaceH4/no_robots' schema, multi-turn rows included",
                 "quickstart": "the quickstart's generated chats (answers in one line of JSON)",
                 "quickstart-heldout": "16 rows of the quickstart's task it does not train on (fastkit eval)"}
"""The names a data source may give instead of a path, and what each is."""


def offline_source(name: str):
    """The ``datasets.Dataset`` or file path an offline name stands for (:data:`OFFLINE_NAMES`), or None."""
    if name == "sample":
        return NO_ROBOTS_SAMPLE
    if name == "quickstart":
        from datasets import Dataset

        return Dataset.from_list(quickstart_records())
    if name == "quickstart-heldout":
        from datasets import Dataset

        return Dataset.from_list(quickstart_heldout())
    return None


__all__ = ["CAPITALS", "NO_ROBOTS_SAMPLE", "OFFLINE_NAMES", "OPPOSITES", "answer_json", "offline_source",
           "quickstart_heldout", "quickstart_records"]
