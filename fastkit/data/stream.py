"""Streaming: data larger than RAM (or the disk) read, checked and tokenized as the trainer draws it.

``load_chat_dataset(source, streaming=True)`` (``--streaming`` on the command line) gives a
``datasets.IterableDataset``: a file, a folder of files or a Hub dataset read a few rows at a time, never whole.
:func:`check_stream` is :func:`fastkit.data.check_dataset`'s counterpart for it, one batched map that the trainer
runs as it draws rows (TRL's ``max_steps`` path; TRL packs the stream a batch at a time):

- the same row rules (:func:`fastkit.data.rules.row_problem`) and conversions (ShareGPT / Alpaca -> messages);
  a bad row raises a FastkitError naming its index in the stream, the source and the flag that skips it
  (``drop_invalid``), as a row longer than ``max_seq_length`` does (``drop_long``);
- the same tokens: a chat whose only assistant turn is the last is tokenized as TRL tokenizes prompt/completion
  (:func:`fastkit.data.formats.tokenize_rows_batch`), a multi-turn chat by :class:`~fastkit.data.chat_masks.ChatMasker`
  (every assistant turn), text rows as TRL does (EOS appended). A table decides once for all its rows (a table
  with one multi-turn chat masks every chat by assistant turn); a stream decides per row, since it cannot look
  ahead. Packing stays exact per document: TRL's packed rows carry each document's length.
- the first :data:`PEEK_ROWS` rows are checked when the trainer is built, so a wrong format, a missing chat
  template or a bad first row fails before any step;
- rows dropped (``drop_invalid`` / ``drop_long``) are logged at the 1st, 10th, 100th... drop and counted in all at
  the end of training;
- a stream's fingerprint (:func:`stream_fingerprint`, what ``resume`` compares) is each file's size and its first
  and last 64 KiB, not its type: ``resume=True`` on another file is refused naming both.

What a stream cannot do, refused when the trainer is built: ``epochs`` (no length: give ``max_steps``),
``eval_split`` (give ``eval_dataset``), and TRL's own tokenization (``assistant_only_loss``, another chat template
or text field).
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

from fastkit.errors import FastkitError

logger = logging.getLogger(__name__)

PEEK_ROWS = 256
"""Rows of a stream checked (and tokenized) when the trainer is built, before the first step."""
BATCH_ROWS = 256
"""Rows per batch of the stream's checking and tokenizing map."""


def is_stream(dataset: Any) -> bool:
    """Whether ``dataset`` is a ``datasets.IterableDataset`` (or a dict of them)."""
    try:
        from datasets import IterableDataset, IterableDatasetDict
    except ImportError:  # pragma: no cover - datasets is a dependency
        return False
    return isinstance(dataset, (IterableDataset, IterableDatasetDict))


def stream_columns(dataset, where: str = "dataset") -> list[str]:
    """The stream's column names: from its features, else from its first row (FastkitError when it has none)."""
    if dataset.column_names is not None:
        return list(dataset.column_names)
    first = next(iter(dataset.take(1)), None)
    if first is None:
        raise FastkitError(f"{where}: the stream has no rows; give at least one example.")
    return list(first)


def check_first_rows(dataset, where: str = "dataset", drop_invalid: bool = False) -> None:
    """The stream's format found from its columns (refused naming them) and its first :data:`PEEK_ROWS` rows
    checked by the row rules (refused naming the rows, unless ``drop_invalid``): before a model loads."""
    from fastkit.data.formats import detect_format
    from fastkit.data.rules import _rows_named, row_problem

    columns = stream_columns(dataset, where)
    if "input_ids" in columns:
        return
    fmt = detect_format(columns)
    problems = [(i, why) for i, row in enumerate(dataset.take(PEEK_ROWS)) if (why := row_problem(fmt, row))]
    if problems and not drop_invalid:
        bad = [i for i, _ in problems]
        raise FastkitError(f"{where}: rows {_rows_named(bad)} of the stream's first {PEEK_ROWS} cannot be trained; "
                           f"row {bad[0] + 1}: {problems[0][1]}. Fix those rows, or pass drop_invalid=True "
                           "(--drop-invalid) to skip such rows.")


class DropCount:
    """Rows a stream dropped (``drop_invalid`` / ``drop_long``), logged at the 1st, 10th, 100th, ... drop, and in
    all at the end of training (:meth:`summary`; the stream carries it as ``fastkit_dropped``)."""

    def __init__(self, where: str = "dataset", why: str = ""):
        self.count = 0
        self.rows: set[int] = set()
        self.where, self.why = where, why

    def summary(self) -> str:
        """The end-of-training line: how many rows of the stream were dropped in all (a row drawn again on a later
        pass over the stream is one row, dropped again)."""
        again = f"; {self.count} drops: the trainer drew the stream more than once" if self.count != len(self.rows) \
            else ""
        return f"{self.where}: {len(self.rows)} row(s) of the stream dropped in all ({self.why}{again})"

    def add(self, where: str, row: int, why: str) -> None:
        self.count += 1
        self.rows.add(row)
        if self.count == 10 ** int(math.log10(self.count)):
            logger.warning("fastkit: %s: %d row(s) dropped so far; latest: row %d: %s", where, self.count, row + 1,
                           why)


def _messages_of(fmt: str, row: dict, index: int) -> Any:
    """A checked row of a chat format as messages (ShareGPT / Alpaca converted)."""
    from fastkit.data.formats import alpaca_to_messages, sharegpt_to_messages

    if fmt == "sharegpt":
        return sharegpt_to_messages(row["conversations"], index)
    if fmt == "alpaca":
        return alpaca_to_messages(row)
    return row["messages"]


def _token_rows(fmt: str, rows: list[dict], tokenizer) -> list[tuple[list[int], list[int] | None]]:
    """``(input_ids, completion_mask or None)`` of checked rows, tokenized as a table of them would be."""
    from fastkit.data.chat_masks import ChatMasker
    from fastkit.data.formats import is_single_answer
    from fastkit.data.formats import tokenize_rows_batch as _tokenize_batch

    if fmt == "text":
        ids = _tokenize_batch({"text": [r["text"] for r in rows]}, tokenizer)["input_ids"]
        return [(list(x), None) for x in ids]
    if fmt == "prompt_completion":
        return _table_rows(_tokenize_batch({"prompt": [r["prompt"] for r in rows],
                                            "completion": [r["completion"] for r in rows]}, tokenizer))
    out: list[Any] = [None] * len(rows)
    single = [k for k, r in enumerate(rows) if is_single_answer(r["messages"])]
    multi = [k for k, r in enumerate(rows) if not is_single_answer(r["messages"])]
    if single:
        table = _tokenize_batch({"prompt": [rows[k]["messages"][:-1] for k in single],
                                 "completion": [rows[k]["messages"][-1:] for k in single]}, tokenizer)
        for k, pair in zip(single, _table_rows(table)):
            out[k] = pair
    if multi:
        for k, pair in zip(multi, _table_rows(ChatMasker(tokenizer).table([rows[k]["messages"] for k in multi]))):
            out[k] = pair
    return out


def _table_rows(table) -> list[tuple[list[int], list[int]]]:
    return list(zip(table.column("input_ids").to_pylist(), table.column("completion_mask").to_pylist()))


def _prepare_batch(batch: dict[str, list], indices: list[int], *, fmt: str, tokenizer, max_seq_length: int,
                   packing: bool, drop_invalid: bool, drop_long: bool, where: str, dropped: DropCount):
    """One batch of a stream -> its rows checked, converted and tokenized (``input_ids`` (+ ``completion_mask``)).

    A row that cannot train or is longer than ``max_seq_length`` raises naming its index in the stream, or is
    dropped (and counted) with ``drop_invalid`` / ``drop_long``."""
    from fastkit.data.rules import row_problem

    names = list(batch)
    rows, kept = [], []
    for k, index in enumerate(indices):
        row = {name: batch[name][k] for name in names}
        why = row_problem(fmt, row)
        if why is not None:
            if not drop_invalid:
                raise FastkitError(f"{where}: row {index + 1} of the stream cannot be trained: {why}. Fix that row, or "
                                   "pass drop_invalid=True (--drop-invalid) to skip such rows (counted in the log).")
            dropped.add(where, index, why)
            continue
        if fmt in ("sharegpt", "alpaca", "messages"):
            row = {"messages": _messages_of(fmt, row, index)}
        rows.append(row)
        kept.append(index)
    chat = fmt in ("sharegpt", "alpaca", "messages")
    out_ids, out_mask = [], []
    for index, (ids, mask) in zip(kept, _token_rows("messages" if chat else fmt, rows, tokenizer)):
        if len(ids) > max_seq_length:
            what = "packing would truncate its end" if packing else "it would be cut silently"
            why = f"{len(ids)} tokens, longer than max_seq_length={max_seq_length}"
            if not drop_long:
                raise FastkitError(f"{where}: row {index + 1} of the stream is {why}; {what}. Raise max_seq_length, or "
                                   "pass drop_long=True (--drop-long) to skip such rows (counted in the log).")
            dropped.add(where, index, why)
            continue
        out_ids.append(ids)
        out_mask.append(mask)
    if fmt == "text":
        return {"input_ids": out_ids}
    return {"input_ids": out_ids, "completion_mask": out_mask}


def _check_tokenized_batch(batch: dict[str, list], indices: list[int], *, max_seq_length: int, drop_long: bool,
                           where: str, dropped: DropCount):
    """Pre-tokenized rows of a stream: only their lengths are checked (the token columns pass through)."""
    keep = []
    for k, index in enumerate(indices):
        n = len(batch["input_ids"][k])
        if n > max_seq_length:
            why = f"{n} tokens, longer than max_seq_length={max_seq_length}"
            if not drop_long:
                raise FastkitError(f"{where}: row {index + 1} of the stream is {why}. Raise max_seq_length, or pass "
                                   "drop_long=True (--drop-long) to skip such rows.")
            dropped.add(where, index, why)
            continue
        keep.append(k)
    return {name: [values[k] for k in keep] for name, values in batch.items()}


def check_stream(dataset, tokenizer, max_seq_length: int, packing: bool = True, drop_long: bool = False,
                 drop_invalid: bool = False, where: str = "train_dataset", tokenize: bool = True):
    """A stream's rows checked and tokenized as drawn (module docstring); its first :data:`PEEK_ROWS` now."""
    from fastkit.data.chat_template import require_chat_template
    from fastkit.data.formats import detect_format

    if not tokenize:
        raise FastkitError(f"{where} is a stream: fastkit checks and tokenizes it as it is drawn, which TRL's own "
                           "tokenization (assistant_only_loss, chat_template_path, dataset_text_field, "
                           "skip_prepare_dataset) would replace. Drop those options, or load the data without "
                           "streaming.")
    columns = stream_columns(dataset, where)
    dropped = DropCount(where, " / ".join(n for n, on in (("drop_invalid", drop_invalid), ("drop_long", drop_long))
                                         if on) or "none asked")
    if "input_ids" in columns:
        out = dataset.map(_check_tokenized_batch, batched=True, batch_size=BATCH_ROWS, with_indices=True,
                          fn_kwargs=dict(max_seq_length=max_seq_length, drop_long=drop_long, where=where,
                                         dropped=dropped))
    else:
        fmt = detect_format(columns)
        if fmt != "text" and not (fmt == "prompt_completion" and _string_prompts(dataset)):
            require_chat_template(tokenizer)
        out = dataset.map(_prepare_batch, batched=True, batch_size=BATCH_ROWS, with_indices=True,
                          remove_columns=columns,
                          fn_kwargs=dict(fmt=fmt, tokenizer=tokenizer, max_seq_length=max_seq_length, packing=packing,
                                         drop_invalid=drop_invalid, drop_long=drop_long, where=where,
                                         dropped=dropped))
    _peek(out, where)
    dropped.count, dropped.rows = 0, set()  # the trainer draws the stream from its start again: counted anew
    out.fastkit_dropped = dropped  # make_trainer logs the count at the end of training
    return out


FINGERPRINT_BYTES = 1 << 16
"""Bytes read from the start and from the end of each file a stream reads, for its fingerprint."""
FINGERPRINT_ROWS = 16
"""Rows drawn for the fingerprint of a stream without local files (a Hub stream, a generator)."""


def source_files(stream) -> list[str]:
    """The files a ``datasets`` stream reads, found in its chain of example iterables (every source of an
    interleaved mix); [] for a stream that reads none (a generator) or that ``datasets`` builds otherwise."""
    files, todo = [], [getattr(stream, "_ex_iterable", None)]
    while todo:
        node = todo.pop()
        if node is None:
            continue
        kwargs = getattr(node, "kwargs", None) or {}
        listed = kwargs.get("original_files") or kwargs.get("base_files") or []
        files += [str(f) for f in listed if isinstance(f, (str, os.PathLike))]
        todo += [getattr(node, "ex_iterable", None), *(getattr(node, "ex_iterables", None) or [])]
    return list(dict.fromkeys(files))


def stream_fingerprint(stream) -> str:
    """A stream's fingerprint without reading it all: each local file's size and its first and last
    :data:`FINGERPRINT_BYTES` bytes (where the file lies is not part of it: a moved file is the same data), else its
    first :data:`FINGERPRINT_ROWS` rows. ``"stream <hash> of <what was read>"``; resume compares the hash."""
    import hashlib
    import json

    h = hashlib.blake2b(digest_size=12)
    files = source_files(stream)
    if files and all(os.path.isfile(f) for f in files):
        for f in files:
            size = os.path.getsize(f)
            with open(f, "rb") as handle:
                h.update(f"{size}:".encode() + handle.read(FINGERPRINT_BYTES))
                handle.seek(max(0, size - FINGERPRINT_BYTES))
                h.update(handle.read(FINGERPRINT_BYTES))
        what = ", ".join(f"{f} ({os.path.getsize(f)} bytes)" for f in files[:3]) + (" ..." if len(files) > 3 else "")
    else:
        for row in stream.take(FINGERPRINT_ROWS):
            h.update(json.dumps(row, sort_keys=True, default=str).encode())
        what = f"its first {FINGERPRINT_ROWS} rows"
    return f"stream {h.hexdigest()} of {what}"


def _string_prompts(dataset) -> bool:
    first = next(iter(dataset.take(1)), {})
    return isinstance(first.get("prompt"), str)


def _peek(stream, where: str) -> None:
    """The first :data:`PEEK_ROWS` rows drawn now: their checks run (and raise) before the trainer is built."""
    seen = trained = 0
    for row in stream:  # not .take(): it draws one row (so one batch) more than it gives
        seen += 1
        mask = row.get("completion_mask")
        trained += len(row["input_ids"]) if mask is None else sum(mask)
        if seen == PEEK_ROWS:
            break
    if seen == 0:
        raise FastkitError(f"{where}: the stream gave no rows to train (empty, or every one of its first rows "
                           "dropped); check the data.")
    if trained == 0:
        raise FastkitError(f"Every label is masked in the first {seen} rows of {where}: no row has a non-empty "
                           "assistant response to train on.")


__all__ = ["BATCH_ROWS", "FINGERPRINT_BYTES", "FINGERPRINT_ROWS", "PEEK_ROWS", "DropCount", "check_first_rows",
           "check_stream", "is_stream", "source_files", "stream_columns", "stream_fingerprint"]
