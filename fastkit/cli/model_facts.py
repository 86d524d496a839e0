"""What ``--model`` is, told without loading it: its ``model_type`` and its row of the family table. Shared by
``fastkit train``'s preflight and ``fastkit export`` (which loads a vision run's adapters with the vision class)."""

from __future__ import annotations

import json
import os
from pathlib import Path


def model_facts(model: str, twin: bool):
    """``(model_type, table row)`` of ``--model`` read without loading it (a local config.json, a twin's family, a
    cached Hub config); ``(None, None)`` when it cannot be told here (the load decides)."""
    from fastkit import registry

    config = Path(os.path.expanduser(model)) / "config.json"
    model_type = None
    if config.is_file():
        try:
            model_type = json.loads(config.read_text()).get("model_type")
        except (OSError, ValueError):
            return None, None
    elif twin:
        from fastkit.families.twins import twin_family

        try:
            model_type = twin_family(model)[0]
        except ValueError:
            return None, None
    else:
        try:
            from transformers import AutoConfig

            model_type = AutoConfig.from_pretrained(model).model_type
        except Exception:  # noqa: BLE001 -- not here or not readable offline: FastModel.from_pretrained says why
            return None, None
    return model_type, registry.facts_for(model_type) if isinstance(model_type, str) else None
