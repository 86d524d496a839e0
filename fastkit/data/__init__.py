"""Training data: loading, format conversion and the checks that run before any step.

    load.py      ``load_chat_dataset``, ``to_prompt_completion``, ``check_dataset`` (the front door)
    formats.py   ShareGPT / Alpaca / messages detection and conversion, multi-turn masks, ``preview_masks``
    checks.py    row-level checks: JSON reading, message shapes, token counts

``from fastkit.data import load_chat_dataset`` (and the other names below) is the public path.
"""

from fastkit.data.formats import detect_format, normalize_dataset, preview_masks, tokenize_chat
from fastkit.data.load import (
           check_dataset,
           load_chat_dataset,
           to_chat_training_form,
           to_prompt_completion,
)

__all__ = ["check_dataset", "detect_format", "load_chat_dataset", "normalize_dataset",
           "preview_masks", "to_chat_training_form", "to_prompt_completion", "tokenize_chat"]
