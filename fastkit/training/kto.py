"""KTO's data, checked at the door (:func:`fastkit.training.preference.make_kto_trainer`, ``fastkit kto``).

KTO (TRL 1.16's ``KTOTrainer``) learns from *unpaired* feedback: each row is one ``prompt``, one ``completion`` and a
``label`` saying whether the completion is desirable (True) or undesirable (False). The prompt and completion are
text, or lists of chat messages (the prompt ending before the answer, the completion holding the assistant turn).
Preference pairs (``prompt`` / ``chosen`` / ``rejected``, :mod:`fastkit.training.dpo`'s form) are accepted too and
unpaired first (each pair -> a desirable and an undesirable row, side by side).

Labels: Python / NumPy bools, the integers 0 and 1 (a Parquet column of 0/1), or those as text, any case
(``"true"`` / ``"false"`` / ``"1"`` / ``"0"``: a CSV file's column is read as text); the column becomes bool.
Anything else (``"yes"``, 2, 0.5, an empty cell) is refused naming the row; a null label is "null 'label' in row N".

A data set holding both KTO's columns (``completion`` / ``label``) and DPO's (``chosen`` / ``rejected``) is refused
naming both (:func:`fastkit.training.dpo.check_one_form`): which set to train on would be a guess.

Refused before any step, naming the row: a missing ``prompt`` / ``completion`` / ``label``, a field in the other
form than the first row's, a message without ``role`` / text ``content``, a completion that does not end with an
assistant turn (chat), a prompt that does, an empty completion (as text, or no tokens after the chat template), a
training set whose rows all carry one label (KTO weighs desirable against undesirable completions: with one kind
only TRL trains anyway, and only pushes every completion up, or down, against its KL baseline — use SFT for
desirable-only data), a row longer than ``max_seq_length`` (TRL would drop a row whose prompt fills it and cut the
others silently; ``drop_long=True`` drops and counts them instead).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from fastkit.errors import FastkitError
from fastkit.training.dpo import _check_side, _is_messages, check_one_form, check_pairs, drop_long_rows

logger = logging.getLogger(__name__)

COLUMNS = ("prompt", "completion", "label")
"""KTO's unpaired form: what every row holds."""


LABEL_TEXTS = {"true": True, "false": False, "1": True, "0": False}
"""A label written as text (a CSV column is read as text): these words, any case, spaces around them ignored."""


def label_value(value: Any, where: str) -> bool:
    """A row's ``label`` as a bool: True / False (Python or NumPy), the integers 1 / 0, or those as text
    (:data:`LABEL_TEXTS`: ``"true"``, ``"0"``, ...: a CSV file's column)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in LABEL_TEXTS:
        return LABEL_TEXTS[value.strip().lower()]
    raise FastkitError(f"{where} field 'label' must be true or false (or 1 / 0): whether the completion is desirable, "
                       f"got {type(value).__name__} {value!r:.40}.")


def check_row(row: dict, i: int, where: str = "train_dataset", chat: bool | None = None) -> tuple[bool, bool]:
    """Check one unpaired row; returns ``(chat, label)``. ``chat``: the form the first row set (None: this row's
    ``completion`` decides)."""
    missing = [k for k in COLUMNS if k not in row]
    if missing:
        raise FastkitError(f"{where} row {i + 1}: no {' / '.join(repr(k) for k in missing)} field (has {sorted(row)}): "
                           "a KTO row needs 'prompt', 'completion' and 'label' (true: a desirable completion).")
    null = [k for k in COLUMNS if row[k] is None]
    if null:
        raise FastkitError(f"{where} row {i + 1}: null {' / '.join(repr(k) for k in null)} (empty or left out in "
                           "that row): a KTO row needs a 'prompt', a 'completion' and a 'label' (true: a desirable "
                           "completion).")
    label = label_value(row["label"], f"{where} row {i + 1}")
    chat = _is_messages(row["completion"]) if chat is None else chat
    for key in ("prompt", "completion"):
        _check_side(row[key], f"{where} row {i + 1} field {key!r}", chat)
    if chat and row["completion"][-1]["role"] != "assistant":
        raise FastkitError(f"{where} row {i + 1} field 'completion' must end with an assistant message (the answer "
                           "being judged).")
    if chat and row["prompt"][-1]["role"] == "assistant":
        raise FastkitError(f"{where} row {i + 1} field 'prompt' ends with an assistant message: the prompt is the "
                           "conversation before the judged answer.")
    return chat, label


def unpaired(dataset, where: str = "train_dataset"):
    """KTO's rows: ``dataset`` itself, or its preference pairs (checked as DPO's) unpaired into two rows each, side
    by side (KTO reads its rows in order: each batch then holds both labels)."""
    check_one_form(dataset.column_names, where)
    if len(dataset) == 0 or "completion" in dataset.column_names or "chosen" not in dataset.column_names:
        return dataset
    check_pairs(dataset, None, where)
    if "prompt" not in dataset.column_names:
        raise FastkitError(f"{where}: preference pairs without a 'prompt' column; KTO unpairs pairs of prompt / "
                           "chosen / rejected: give the prompt as its own column.")
    logger.info("fastkit: KTO unpaired %d preference pairs into %d rows (chosen: label true, rejected: false)",
                len(dataset), 2 * len(dataset))
    return dataset.map(_unpair, batched=True, remove_columns=dataset.column_names)


def _unpair(batch: dict) -> dict:
    """``n`` pairs -> ``2n`` rows: chosen (label true) then rejected (label false) of each pair."""
    rows = zip(batch["prompt"], batch["chosen"], batch["rejected"])
    out = [(p, answer, label) for p, c, r in rows for answer, label in ((c, True), (r, False))]
    return {"prompt": [p for p, _, _ in out], "completion": [a for _, a, _ in out], "label": [x for _, _, x in out]}


def check_rows(dataset, tokenizer, where: str = "train_dataset", both_labels: bool = True):
    """Every row a usable KTO row in one form, both labels present (``both_labels``), a chat template for chat rows
    (``tokenizer=None``: the rows only, before a model loads; ``fastkit kto``'s preflight). Returns the dataset with
    a bool ``label`` column (0 / 1 cast)."""
    if len(dataset) == 0:
        raise FastkitError(f"{where} is empty: give rows of prompt, completion and label.")
    chat, label = check_row(dataset[0], 0, where)
    labels = [label]
    for i in range(1, len(dataset)):
        labels.append(check_row(dataset[i], i, where, chat)[1])
    if both_labels:
        check_both_labels(labels, where)
    if chat and tokenizer is not None:
        from fastkit.data.chat_template import require_chat_template

        require_chat_template(tokenizer)
    return _bool_labels(dataset)


def check_both_labels(labels, where: str) -> None:
    desirable = sum(bool(x) for x in labels)
    if desirable in (0, len(labels)):
        kind = "desirable (label true)" if desirable else "undesirable (label false)"
        raise FastkitError(f"{where}: all {len(labels)} rows are {kind}. KTO weighs desirable against undesirable "
                           "completions; give rows of both labels (for desirable-only data, fastkit train / "
                           "make_trainer is SFT).")


def _bool_labels(dataset):
    if dataset.features["label"].dtype == "bool":
        return dataset
    from datasets import Value

    logger.info("fastkit: KTO labels %s read as false / true",
                "'false' / 'true' or '0' / '1' (text)" if dataset.features["label"].dtype == "string" else "0 / 1")
    features = dataset.features.copy()
    features["label"] = Value("bool")
    return dataset.map(lambda batch: {"label": [label_value(x, "label") for x in batch["label"]]}, batched=True,
                       features=features)  # each label checked row by row before


def check_tokenized_rows(dataset, max_length: int, drop_long: bool, batch_size: int, where: str = "train_dataset",
                         both_labels: bool = True):
    """After TRL tokenized the rows (``prompt_ids`` / ``completion_ids``, TRL's ``max_length`` off): refuse (or drop)
    a row longer than ``max_length`` and one whose completion tokenized to nothing. Dropping rows re-pairs KTO's
    KL completions (each row with its batch neighbour's completion, as TRL pairs them)."""
    long_rows = []
    for i, (p, c) in enumerate(zip(dataset["prompt_ids"], dataset["completion_ids"])):
        if not c:
            raise FastkitError(f"{where} row {i + 1}: the completion has no tokens after the chat template: nothing "
                               "to judge.")
        if len(p) + len(c) > max_length:
            long_rows.append((i, len(p) + len(c)))
    if not long_rows:
        return dataset
    dataset = drop_long_rows(dataset, long_rows, max_length, drop_long, where, measure="prompt + completion",
                             consequence="TRL would cut or drop it silently", rows="KTO row")
    if both_labels:
        check_both_labels(dataset["label"], f"{where} (after dropping the long rows)")
    if "KL_completion_ids" in dataset.column_names:
        dataset = dataset.map(_rotate, batched=True, batch_size=batch_size)
    return dataset


def _rotate(batch: dict) -> dict:
    """KTO's KL completions of one batch: ``(x_1, y_n), (x_2, y_1), ..., (x_n, y_{n-1})`` (TRL's pairing)."""
    completions = batch["completion_ids"]
    batch["KL_completion_ids"] = [completions[-1], *completions[:-1]]
    return batch


__all__ = ["COLUMNS", "check_both_labels", "check_row", "check_rows", "check_tokenized_rows", "label_value",
           "unpaired"]
