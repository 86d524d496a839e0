"""Training data, in the order a dataset goes through it: read -> row rules -> formats -> prepared for TRL.

    read.py           ``load_chat_dataset`` and ``as_dataset``: rows, files (line numbers in errors), DataFrames,
                      dicts of columns, Datasets, Hub ids -> one ``Dataset``
    rules.py          one row rule per format (``row_problem``), ``check_rows``: the rows, the field, the fix
    formats.py        ShareGPT / Alpaca / messages detection and conversion, multi-turn masks, ``preview_masks``
    chat_template.py  ``has_chat_template`` / ``require_chat_template`` / ``add_chat_template``
    samples.py        the offline datasets by name: ``"sample"`` (:data:`NO_ROBOTS_SAMPLE`) and ``"quickstart"``
    sources.py        ``DataSource`` and ``load_sources``: several datasets mixed (weights, row caps, column mapping)
    prepare.py        ``check_dataset``: the front door's last step (converted to prompt/completion or
                      tokenized multi-turn rows, token counts, lengths, every-label-masked)

``from fastkit.data import load_chat_dataset`` (and the other names below) is the public path.
"""

from fastkit._lazy import exports as _exports

_LAZY = {
    "add_chat_template": "chat_template", "has_chat_template": "chat_template", "require_chat_template":
    "chat_template",
    "FIELDS": "formats", "detect_format": "formats", "map_columns": "formats", "normalize_dataset": "formats",
    "preview_masks": "formats", "tokenize_chat": "formats",
    "check_dataset": "prepare", "to_chat_training_form": "prepare", "to_prompt_completion": "prepare", "token_counts":
    "prepare",
    "as_dataset": "read", "load_chat_dataset": "read", "read_json_rows": "read", "read_rows": "read", "rows_to_dataset":
    "read",
    "check_rows": "rules", "message_problem": "rules", "row_problem": "rules",
    "NO_ROBOTS_SAMPLE": "samples",
    "DataSource": "sources", "load_sources": "sources",
}
"""Each public name -> its module, imported when first used (fastkit._lazy)."""
__getattr__, __dir__ = _exports(globals(), "fastkit.data", _LAZY)

__all__ = ["FIELDS", "NO_ROBOTS_SAMPLE", "DataSource", "add_chat_template", "as_dataset", "check_dataset", "check_rows",
           "detect_format", "has_chat_template", "load_chat_dataset", "load_sources", "map_columns", "message_problem",
           "normalize_dataset", "preview_masks", "read_json_rows", "read_rows",
           "require_chat_template", "row_problem", "rows_to_dataset", "to_chat_training_form", "to_prompt_completion",
           "tokenize_chat", "token_counts"]
