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

from fastkit.data.chat_template import add_chat_template, has_chat_template, require_chat_template
from fastkit.data.formats import FIELDS, detect_format, map_columns, normalize_dataset, preview_masks, tokenize_chat
from fastkit.data.prepare import check_dataset, to_chat_training_form, to_prompt_completion, token_counts
from fastkit.data.read import as_dataset, load_chat_dataset, read_json_rows, read_rows, rows_to_dataset
from fastkit.data.rules import check_rows, message_problem, row_problem
from fastkit.data.samples import NO_ROBOTS_SAMPLE
from fastkit.data.sources import DataSource, load_sources

__all__ = ["FIELDS", "NO_ROBOTS_SAMPLE", "DataSource", "add_chat_template", "as_dataset", "check_dataset", "check_rows",
           "detect_format", "has_chat_template", "load_chat_dataset", "load_sources", "map_columns", "message_problem",
           "normalize_dataset", "preview_masks", "read_json_rows", "read_rows",
           "require_chat_template", "row_problem", "rows_to_dataset", "to_chat_training_form", "to_prompt_completion",
           "tokenize_chat", "token_counts"]
