"""Row rules for chat datasets: every row that would train nothing or the wrong thing is named.

One rule per format (:func:`row_problem`): ``messages`` (:func:`message_problem`), ShareGPT, Alpaca,
prompt/completion, text. :func:`check_rows` refuses the rows that break it (naming the rows, the field and
what is wrong), or drops and counts them on request. No file reading here (:mod:`fastkit.data.read`).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastkit.data.formats import SHAREGPT_ROLES
from fastkit.errors import FastkitError

logger = logging.getLogger(__name__)


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "list", dict: "object"}.get(type(value), type(value).__name__)


def _rows_named(rows: Sequence[int], limit: int = 8) -> str:
    """Row indices as a user names them: counted from 1 (row 1 is a file's first row, a .jsonl's line 1)."""
    shown = ", ".join(str(r + 1) for r in rows[:limit])
    return shown + (f" ... ({len(rows)} rows)" if len(rows) > limit else "")


def lone_surrogate(text: str) -> str | None:
    """The first lone surrogate code point in ``text`` (``'\\ud83d'``), or None: UTF-8 cannot encode one, so no
    tokenizer can (it comes from a badly decoded emoji or a JSON ``\\ud83d`` escape without its pair)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return ascii(text[exc.start])
    return None


SHAREGPT_SPELLINGS = {k: v for k, v in SHAREGPT_ROLES.items() if k != v}
"""Roles ShareGPT spells its own way (``human``, ``gpt``, ...): refused in a ``messages`` row, where the chat template
would render them as they are (``<|im_start|>human``) and the assistant mask would miss them (``gpt``)."""


def message_problem(messages: Any) -> str | None:
    """Why one row's ``messages`` would train nothing or the wrong thing, or None if it is fine."""
    if messages is None:
        return "messages is missing (None)"
    if not isinstance(messages, (list, tuple)) or not messages:
        return f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r:.60}"
    for j, msg in enumerate(messages):
        if not isinstance(msg, dict) or "role" not in msg:
            return f"messages[{j}] is not a {{'role', 'content'}} dict"
        if not isinstance(msg["role"], str) or not msg["role"]:
            return f"messages[{j}].role is {msg['role']!r}, not a role name such as 'user' or 'assistant'"
        if msg["role"] in SHAREGPT_SPELLINGS:
            return (f"messages[{j}].role is {msg['role']!r}, ShareGPT's spelling of "
                    f"{SHAREGPT_SPELLINGS[msg['role']]!r}: a messages row uses the chat roles ('system', 'user', "
                    "'assistant', 'tool'; a conversations row with from/value reads ShareGPT's)")
        content = msg.get("content")
        if content is None:
            what = "the assistant answer" if msg.get("role") == "assistant" else f"messages[{j}].content"
            return f"{what} is None (it would train as an empty answer)"
        if not isinstance(content, str):
            kind = "content parts (a list)" if isinstance(content, list) else type(content).__name__
            return (f"messages[{j}].content is {kind}, not a string; join text parts into one string "
                    "(images are not supported)")
        if lone_surrogate(content):
            return (f"messages[{j}].content holds a lone surrogate character ({lone_surrogate(content)}), which no "
                    "tokenizer can encode (a badly decoded emoji); fix the text")
        if msg["role"] == "assistant" and not content.strip() and not msg.get("tool_calls"):
            return (f"messages[{j}] is an empty assistant turn: it would train only the end-of-turn token; write the "
                    "answer or drop the turn")
    if messages[-1].get("role") != "assistant":
        return f"the last turn is {messages[-1].get('role')!r}, not 'assistant' (nothing to train on)"
    return None


def _text_problem(value: Any, field: str, empty_ok: bool = False) -> str | None:
    if value is None:
        return f"{field} is missing (None)"
    if not isinstance(value, str):
        kind = "a list" if isinstance(value, list) else type(value).__name__
        return f"{field} is {kind}, not a string"
    if not empty_ok and not value.strip():
        return f"{field} is empty (nothing to train on)"
    if lone_surrogate(value):
        return (f"{field} holds a lone surrogate character ({lone_surrogate(value)}), which no tokenizer can encode "
                "(a badly decoded emoji); fix the text")
    return None


def prompt_completion_problem(row: dict) -> str | None:
    """Why a ``prompt``/``completion`` row cannot train: both strings, or both message lists."""
    prompt, completion = row.get("prompt"), row.get("completion")
    if isinstance(prompt, list) or isinstance(completion, list):
        if not (isinstance(prompt, list) and isinstance(completion, list)):
            return (f"prompt is {_kind(prompt)} but completion is {_kind(completion)}; give both as strings or "
                    "both as message lists")
        if not completion:
            return "completion is an empty message list (nothing to train on)"
        why = message_problem(list(prompt) + list(completion)) if prompt else message_problem(completion)
        return f"prompt + completion: {why}" if why else None
    return _text_problem(prompt, "prompt", empty_ok=True) or _text_problem(completion, "completion")


def sharegpt_problem(conversations: Any) -> str | None:
    """Why a ShareGPT ``conversations`` row cannot train (a None / missing / tool-call-only answer included)."""
    from fastkit.data.formats import SHAREGPT_ROLES

    if not isinstance(conversations, list) or not conversations:
        return f"conversations must be a non-empty list of {{'from', 'value'}} dicts, got {conversations!r:.60}"
    for j, turn in enumerate(conversations):
        if not isinstance(turn, dict):
            return f"conversations[{j}] is a {type(turn).__name__}, not a {{'from', 'value'}} dict"
        speaker = turn.get("from", turn.get("role"))
        if not isinstance(speaker, str) or speaker.lower() not in SHAREGPT_ROLES:
            return (f"conversations[{j}].from is {speaker!r}; expected one of {sorted(SHAREGPT_ROLES)} (map it to "
                    "'human', 'gpt' or 'system' first)")
        value = turn.get("value", turn.get("content"))
        if value is None:
            extra = sorted(set(turn) - {"from", "role", "value", "content"})
            also = f" (only {extra}: tool-call-only turns have no text to train)" if extra else ""
            return f"conversations[{j}].value is missing or None{also}"
        if not isinstance(value, str):
            return f"conversations[{j}].value is {_kind(value)}, not a string"
    last = conversations[-1].get("from", conversations[-1].get("role")).lower()
    if SHAREGPT_ROLES[last] != "assistant":
        return f"the last turn is from {last!r}, not the model (nothing to train on)"
    if not conversations[-1].get("value", conversations[-1].get("content")).strip():
        return "the last answer is empty (it would train an empty answer)"
    return None


def alpaca_problem(row: dict) -> str | None:
    return (_text_problem(row.get("instruction"), "instruction") or _text_problem(row.get("output"), "output")
            or (None if row.get("input") is None else _text_problem(row["input"], "input", empty_ok=True))
            or (None if row.get("system") is None else _text_problem(row["system"], "system", empty_ok=True)))


def row_problem(fmt: str, row: dict) -> str | None:
    """Why one row of a dataset in format ``fmt`` (:data:`fastkit.data.formats.FORMATS`) cannot train, or None."""
    if fmt == "messages":
        return message_problem(row.get("messages"))
    if fmt == "sharegpt":
        return sharegpt_problem(row.get("conversations"))
    if fmt == "alpaca":
        return alpaca_problem(row)
    if fmt == "prompt_completion":
        return prompt_completion_problem(row)
    return _text_problem(row.get("text"), "text")


FORMAT_COLUMNS = {"messages": ("messages",), "sharegpt": ("conversations",),
                  "alpaca": ("instruction", "output", "input", "system"), "prompt_completion": ("prompt", "completion"),
                  "text": ("text",)}
"""The columns :func:`row_problem` reads, per format (only these are decoded from the table)."""


RULES_KEY = hashlib.sha1(Path(__file__).read_bytes()).hexdigest()[:16]
"""This module's source as a key of :func:`find_problems`' cached map: a table checked by other rules (an update of
fastkit) is checked again, not answered from the ``datasets`` cache."""


def _problems_batch(batch: dict[str, list], indices: list[int], fmt: str, rules: str = "") -> dict[str, list]:
    """One batch of rows -> only its untrainable rows: ``{"row": [index], "why": [reason]}`` (0..len(batch) rows).
    ``rules``: :data:`RULES_KEY`, there for the cache's fingerprint only."""
    names = list(batch)
    rows: list[int] = []
    whys: list[str] = []
    for k, i in enumerate(indices):
        why = row_problem(fmt, {name: batch[name][k] for name in names})
        if why:
            rows.append(i)
            whys.append(why)
    return {"row": rows, "why": whys}


def find_problems(dataset, fmt: str, num_proc: int | None = None) -> list[tuple[int, str]]:
    """``(row index, why)`` of every row of ``dataset`` (in format ``fmt``) that cannot train, in row order.

    A batched ``Dataset.map`` over the columns the rule reads: only the bad rows come out of it, so a clean
    table of any size leaves an empty result (cached by the table's fingerprint like any other map).
    """
    from datasets import Features, Value

    columns = [c for c in FORMAT_COLUMNS[fmt] if c in dataset.column_names]
    if len(dataset) == 0 or not columns:
        return [(i, why) for i, row in enumerate(dataset) if (why := row_problem(fmt, row))]
    table = dataset.select_columns(columns)
    found = table.map(_problems_batch, batched=True, batch_size=1000, with_indices=True,
                      fn_kwargs={"fmt": fmt, "rules": RULES_KEY}, remove_columns=columns, num_proc=num_proc,
                      desc="fastkit: checking rows",
                      features=Features({"row": Value("int64"), "why": Value("string")}))
    return sorted(zip(found["row"], found["why"]))


def check_rows(dataset, drop_invalid: bool = False):
    """Refuse (or, with ``drop_invalid=True``, drop and count) rows that cannot train, in any format.

    The same rule for every format: each row is checked by :func:`row_problem` (a batched map over the
    table, :func:`find_problems`), the message names the rows, the field and what is wrong with it.
    """
    from fastkit.data.formats import detect_format
    from fastkit.data.workers import data_workers, frozen_heap

    if "input_ids" in dataset.column_names:
        return dataset
    fmt = detect_format(dataset.column_names)
    name = {"sharegpt": "conversations", "prompt_completion": "prompt/completion", "alpaca": "alpaca"}.get(fmt, fmt)
    with frozen_heap():  # forked workers share this process's pages (fastkit.data.workers)
        problems = find_problems(dataset, fmt, data_workers(len(dataset)))
    if not problems:
        return dataset
    rows = [i for i, _ in problems]
    if not drop_invalid:
        every = "Every label is masked: " if len(rows) == len(dataset) else ""
        raise FastkitError(f"{every}{name}: {len(rows)} of {len(dataset)} rows cannot be trained (rows "
                           f"{_rows_named(rows)}); row {rows[0] + 1}: {problems[0][1]}. Fix those rows, or pass "
                           "drop_invalid=True to drop them (the count is logged).")
    bad = set(rows)
    kept = dataset.select([i for i in range(len(dataset)) if i not in bad])
    logger.warning("fastkit: dropped %d of %d rows that cannot be trained (rows %s); first: row %d: %s",
                   len(rows), len(dataset), _rows_named(rows), rows[0] + 1, problems[0][1])
    if len(kept) == 0:
        raise FastkitError(f"{name}: every row was dropped as untrainable (drop_invalid=True); fix the data.")
    return kept


check_messages = check_rows  # the old name (messages rows only, before every format was checked)


__all__ = ["FORMAT_COLUMNS", "check_messages", "check_rows", "find_problems", "lone_surrogate", "message_problem",
           "row_problem"]
