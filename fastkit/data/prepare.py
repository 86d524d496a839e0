"""The front door's last step: a dataset checked and converted into what TRL trains (``check_dataset``).

Every check here raises :class:`~fastkit.errors.FastkitError` with the field and the fix, before a
single step runs: missing columns, an empty dataset, no chat template, every label masked, rows
longer than ``max_seq_length`` -- counted as TRL tokenizes them, the EOS it appends to ``text`` and
string ``prompt``/``completion`` rows included (a row of exactly ``max_seq_length`` tokens plus that EOS
is too long: packing would cut the EOS).

Training data is turned into TRL's conversational prompt-completion form (``prompt``: the messages
before the last assistant turn, ``completion``: that turn), so ``completion_only_loss`` trains on
responses only with any chat template (no ``{% generation %}`` markers needed). Chats with several
assistant turns are tokenized instead, with a mask that trains every assistant turn
(:mod:`fastkit.data.formats`, which also reads ShareGPT and Alpaca data and previews the masks).
"""

from __future__ import annotations

import logging

from fastkit import _quiet
from fastkit.data.chat_template import require_chat_template, warn_dropped_tool_calls
from fastkit.data.formats import (
    is_single_answer,
    normalize_dataset,
    row_tokens,
    tokenize_chats,
    tokenize_rows_batch,
    with_eos,
)
from fastkit.data.read import as_dataset
from fastkit.data.rules import check_rows
from fastkit.data.stream import check_stream, is_stream
from fastkit.data.workers import data_workers, frozen_heap
from fastkit.errors import FastkitError

logger = logging.getLogger(__name__)


def to_prompt_completion(dataset):
    """``messages`` rows -> conversational ``prompt``/``completion`` (last assistant turn is the completion)."""
    columns = set(dataset.column_names)
    if {"prompt", "completion"} <= columns or "text" in columns or "input_ids" in columns:
        return dataset  # already a trainable form (check_dataset's own output included: it is idempotent)
    if "messages" not in columns:
        raise FastkitError(f"The dataset has columns {sorted(columns)}; fastkit needs one of: 'messages' (chat), "
                           "'prompt' + 'completion', or 'text'. Rename or map your columns first.")

    def split_last_turn(row):
        msgs = row["messages"]
        if not msgs or msgs[-1].get("role") != "assistant":
            return {"prompt": msgs, "completion": []}
        return {"prompt": msgs[:-1], "completion": msgs[-1:]}

    # a string 'prompt' beside 'messages' (HuggingFaceH4/no_robots) is replaced by the chat's prompt turns
    return dataset.map(split_last_turn, remove_columns=[c for c in ("messages", "prompt") if c in columns])


def to_chat_training_form(dataset, tokenizer):
    """What TRL trains: prompt/completion when each chat has one final answer, else every assistant turn.

    Chats with several assistant turns (or an answer before the last message) are tokenized by
    :func:`fastkit.data.formats.tokenize_chats` into ``input_ids`` + ``completion_mask`` that train every
    assistant turn (its end-of-turn token included) and nothing else.
    """
    if "messages" in dataset.column_names and not _all_single_answer(dataset):
        return tokenize_chats(dataset, tokenizer, data_workers(len(dataset)))
    return to_prompt_completion(dataset)


def _all_single_answer(dataset, batch_size: int = 1000) -> bool:
    """Whether every chat's only assistant turn is its last message, read a batch at a time (stops at the first
    that is not: the whole column never sits in Python at once)."""
    for batch in dataset.select_columns(["messages"]).iter(batch_size=batch_size):
        if not all(map(is_single_answer, batch["messages"])):
            return False
    return True


def tokenize_like_trl(dataset, tokenizer, num_proc: int | None = None):
    """``text`` / ``prompt``+``completion`` rows -> the ``input_ids`` (+ ``completion_mask``) TRL would make.

    TRL's ``SFTTrainer`` skips its own tokenization for a dataset that has ``input_ids`` (it builds the labels
    from ``completion_mask`` and packs), so the rows fastkit measured are the rows trained, tokenized once.
    Already tokenized data passes through.
    """
    if "input_ids" in dataset.column_names:
        return dataset
    return dataset.map(tokenize_rows_batch, batched=True, batch_size=256, fn_kwargs={"tokenizer": tokenizer},
                       remove_columns=dataset.column_names, num_proc=num_proc, desc="fastkit: tokenizing rows")


def column_counts(dataset, batch_size: int = 4096):
    """``(total, trainable)`` tokens of every pre-tokenized row, read from the Arrow columns (no Python rows).

    Total: the ``input_ids`` list lengths (their offsets only: the token values are never read). Trainable:
    ``labels`` other than -100, else the 1s of ``completion_mask``, else every token. Returns two int64 numpy
    arrays (one entry per row).
    """
    import numpy as np

    have = dataset.column_names
    mask_column = next((c for c in ("labels", "completion_mask") if c in have), None)
    totals, trained = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for batch in dataset.select_columns(["input_ids"] + ([mask_column] if mask_column else [])).with_format(
            "arrow").iter(batch_size=batch_size):
        totals.append(_list_lengths(batch["input_ids"]))
        if mask_column is None:
            trained.append(totals[-1])
        else:
            trained.append(_marked_per_row(batch[mask_column], -100 if mask_column == "labels" else 0))
    return np.concatenate(totals).astype(np.int64), np.concatenate(trained).astype(np.int64)


def _chunk_lengths(chunk):
    import numpy as np
    import pyarrow.compute as pc

    return pc.list_value_length(chunk).to_numpy(zero_copy_only=False).astype(np.int64)


def _list_lengths(column):
    """Per-row lengths of a chunked list column (its offsets only)."""
    import numpy as np

    return np.concatenate([np.zeros(0, np.int64)] + [_chunk_lengths(chunk) for chunk in column.chunks])


def _marked_per_row(column, off_value: int):
    """Per-row counts of the values other than ``off_value`` in a chunked list column (these rows' values only)."""
    import numpy as np

    out = [np.zeros(0, np.int64)]
    for chunk in column.chunks:
        bits = chunk.flatten().to_numpy(zero_copy_only=False) != off_value
        sums = np.zeros(len(bits) + 1, dtype=np.int64)
        np.cumsum(bits, out=sums[1:])
        ends = np.zeros(len(chunk) + 1, dtype=np.int64)
        np.cumsum(_chunk_lengths(chunk), out=ends[1:])
        out.append(sums[ends[1:]] - sums[ends[:-1]])
    return np.concatenate(out)


def token_counts(dataset, tokenizer, per_row, chunk: int = 1024) -> list[tuple[int, int]]:
    """(total, trainable) tokens of every row, each row tokenized once.

    Conversational prompt/completion rows go through ``apply_chat_template`` a chunk of rows at a time
    (the same call TRL makes, batched: about 2x faster than row by row); other rows use ``per_row``.
    """
    columns = set(dataset.column_names)
    if not ({"prompt", "completion"} <= columns) or columns & {"text", "input_ids"} or (
            len(dataset) and isinstance(dataset[0]["prompt"], str)):
        return [per_row(row, tokenizer) for row in dataset]
    out = []
    for start in range(0, len(dataset), chunk):
        part = dataset[start:start + chunk]
        prompts, completions = part["prompt"], part["completion"]
        p = tokenizer.apply_chat_template(prompts, add_generation_prompt=True, tokenize=True, return_dict=True)
        f = tokenizer.apply_chat_template([a + b for a, b in zip(prompts, completions)], tokenize=True,
                                          return_dict=True)
        for p_ids, f_ids, completion in zip(p["input_ids"], f["input_ids"], completions):
            out.append((len(f_ids), max(len(f_ids) - len(p_ids), 0) if completion else 0))
    return out


def _token_counts(row: dict, tokenizer) -> tuple[int, int]:
    """(total tokens, trainable tokens) of one row, as TRL will tokenize it."""
    if "input_ids" in row:  # pre-tokenized (multi-turn chats by tokenize_chats): completion_mask / labels / all
        ids, mask = row_tokens(row, tokenizer)
        return len(ids), sum(mask)
    if "text" in row:  # TRL appends the EOS token to a text (when it does not end with it), then tokenizes
        n = len(tokenizer(with_eos(row["text"], tokenizer))["input_ids"])
        return n, n
    prompt, completion = row["prompt"], row["completion"]
    if isinstance(prompt, str):  # TRL: tokenizer(prompt + completion + EOS); the completion starts where they part
        p = tokenizer(prompt)["input_ids"]
        full = tokenizer(prompt + with_eos(completion, tokenizer))["input_ids"]
        shared = next((i for i, (a, b) in enumerate(zip(p, full)) if a != b), min(len(p), len(full)))
        return len(full), len(full) - shared
    p = len(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                          return_dict=True)["input_ids"])
    full = len(tokenizer.apply_chat_template(prompt + completion, tokenize=True, return_dict=True)["input_ids"])
    return full, max(full - p, 0) if completion else 0


def check_dataset(dataset, tokenizer, max_seq_length: int, packing: bool = True, drop_long: bool = False,
                  drop_invalid: bool = False, where: str = "train_dataset", tokenize: bool = False):
    """Validate (and convert) a dataset before training; returns the prompt/completion dataset.

    ``tokenize=True`` (what :func:`fastkit.make_trainer` asks) returns the rows tokenized instead, as TRL
    tokenizes them (:func:`tokenize_like_trl`: ``input_ids`` + ``completion_mask``), so the trainer does not
    tokenize them again.

    Every row the trainer will see is measured (each row tokenized once). ``drop_long=True`` removes rows
    longer than ``max_seq_length`` (logged) instead of refusing. Chat rows that cannot train (no messages,
    non-string content, a last turn that is not the assistant's, an answer of ``None``) are refused with
    their row numbers, or dropped and counted with ``drop_invalid=True``. A plain list of dicts is accepted.
    """
    with frozen_heap():  # forked data workers share this process's pages (fastkit.data.workers)
        return _check_dataset(dataset, tokenizer, max_seq_length, packing, drop_long, drop_invalid, where, tokenize)


def _check_dataset(dataset, tokenizer, max_seq_length: int, packing: bool, drop_long: bool, drop_invalid: bool,
                   where: str, tokenize: bool):
    """:func:`check_dataset`'s work."""
    _quiet.quiet_progress_bars()  # fastkit's progress line / dashboard is the one progress display
    if is_stream(dataset):  # checked and tokenized as the trainer draws it, its first rows now
        return check_stream(dataset, tokenizer, max_seq_length, packing, drop_long, drop_invalid, where, tokenize)
    dataset = as_dataset(dataset, where=where)  # the one front door: lists, files, DataFrames, dicts, ...
    if len(dataset) == 0:
        raise FastkitError(f"{where}: the dataset is empty; give at least one example.")
    if "messages" in dataset.column_names and "text" in dataset.column_names:
        logger.info("fastkit: the dataset has both 'messages' and 'text'; training (and checking) 'messages'.")
        dataset = dataset.remove_columns(["text"])  # the column checked is the column trained
    dataset = check_rows(dataset, drop_invalid)  # every format, every row: the field and the row named
    dataset = normalize_dataset(dataset)  # ShareGPT / Alpaca -> messages; unknown columns refused here
    if "messages" in dataset.column_names or (
            "prompt" in dataset.column_names and not isinstance(dataset[0]["prompt"], str)):
        require_chat_template(tokenizer)
        warn_dropped_tool_calls(dataset, tokenizer)
    dataset = to_chat_training_form(dataset, tokenizer)
    trained_form = dataset
    tokenize = tokenize and not {"tools", "chat_template_kwargs"} & set(dataset.column_names)  # TRL's to apply
    if tokenize or "input_ids" in dataset.column_names:  # tokenized once: what fastkit measures, TRL trains
        dataset = tokenize_like_trl(dataset, tokenizer, data_workers(len(dataset)))
        totals, trainable = column_counts(dataset)
    else:
        import numpy as np

        counts = token_counts(dataset, tokenizer, _token_counts)  # every row, tokenized once
        totals, trainable = (np.array([c[i] for c in counts], dtype=np.int64).reshape(-1) for i in (0, 1))
    if drop_long:
        keep = (totals <= max_seq_length).nonzero()[0]
        if not len(keep):
            raise FastkitError(f"Every row is longer than max_seq_length={max_seq_length}; raise max_seq_length.")
        if len(keep) < len(dataset):
            logger.info("fastkit: dropped %d of %d rows longer than max_seq_length=%d", len(dataset) - len(keep),
                        len(dataset), max_seq_length)
            dataset, trained_form = dataset.select(keep), trained_form.select(keep)
            totals, trainable = totals[keep], trainable[keep]
    too_long = (totals > max_seq_length).nonzero()[0]
    if len(too_long):
        longest = int(totals[too_long].max())
        what = "packing would truncate their ends" if packing else "they would be cut silently"
        raise FastkitError(f"{len(too_long)} of {len(totals)} rows are longer than max_seq_length="
                           f"{max_seq_length} (longest {longest} tokens, row {int(too_long[0]) + 1}); {what}. Raise "
                           "max_seq_length or filter those rows out.")
    if not tokenize:
        dataset = trained_form
    if not trainable.any():
        raise FastkitError("Every label is masked: no row has a non-empty assistant response to train on "
                           "(the last message of each conversation must be an assistant turn with content).")
    return dataset


__all__ = ["check_dataset", "column_counts", "to_chat_training_form", "to_prompt_completion", "token_counts",
           "tokenize_like_trl"]
