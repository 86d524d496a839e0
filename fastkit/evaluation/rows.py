"""Held-out rows as an evaluation reads them: the tokens fastkit trains on, split at the last answer.

Every trainable row form (chat messages, prompt/completion, text, already tokenized with a completion mask or labels)
becomes ``(input_ids, trained mask)`` exactly as training tokenizes it (``fastkit.data.formats.row_tokens``), so the
loss is the training loss on rows the model did not see, and a row the run tokenized is not tokenized again. The
prompt is every token before the last trained span (the chat template's assistant header included), the reference
answer is that span: generating from the prompt's ids asks the model exactly what training taught it to answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastkit.errors import FastkitError


@dataclass(frozen=True)
class EvalRow:
    """One held-out row, tokenized as training tokenizes it."""

    index: int
    """Its place in the data, counted from 1 (as fastkit's data errors count rows)."""
    input_ids: list[int]
    """The whole row's tokens."""
    mask: list[int]
    """1 where training computes the loss (the answers), 0 elsewhere."""
    answer_start: int
    """Where the last trained span starts; 0 for a row trained as a whole (plain text: no prompt to answer)."""
    answer_end: int
    """Where the last trained span ends (exclusive)."""

    @property
    def prompt_ids(self) -> list[int]:
        """The tokens a generated answer continues (empty for a plain-text row)."""
        return self.input_ids[:self.answer_start]

    @property
    def reference_ids(self) -> list[int]:
        """The last answer's tokens, as the data gives it."""
        return self.input_ids[self.answer_start:self.answer_end]


def last_span(mask: list[int]) -> tuple[int, int]:
    """``(start, end)`` of the last run of 1s in ``mask``; ``(0, 0)`` when there is none."""
    end = len(mask)
    while end and not mask[end - 1]:
        end -= 1
    start = end
    while start and mask[start - 1]:
        start -= 1
    return start, end


def unpacked(data, max_rows: int | None = None) -> list[dict]:
    """A run's packed eval set (rows with ``seq_lengths``: several documents each) as one row per document, with the
    run's own tokens and labels (nothing re-tokenized); other data as its rows. At most ``max_rows``."""
    columns = getattr(data, "column_names", None) or (list(data[0]) if len(data) else [])
    if "seq_lengths" not in columns:
        return [dict(data[i]) for i in range(len(data) if max_rows is None else min(len(data), max_rows))]
    out: list[dict] = []
    for i in range(len(data)):
        row, start = data[i], 0
        for n in row["seq_lengths"]:  # [doc lengths]: consecutive slices of the packed row
            doc = {"input_ids": row["input_ids"][start:start + n]}
            for key in ("labels", "completion_mask"):
                if key in row:
                    doc[key] = row[key][start:start + n]
            out.append(doc)
            start += n
            if max_rows is not None and len(out) >= max_rows:
                return out
    return out


def eval_rows(data, tokenizer, max_rows: int | None = None) -> list[EvalRow]:
    """The first ``max_rows`` rows of ``data`` (a Dataset or a list of rows) as :class:`EvalRow`. Rows with nothing
    trained are refused by name (they have no answer to score)."""
    from fastkit.data.formats import row_tokens

    data = unpacked(data, max_rows)
    n = len(data)
    if n == 0:
        raise FastkitError("evaluate: the held-out data has no rows; pass rows the run did not train on "
                           "(the run's eval split, or a file of them).")
    out = []
    for i in range(n):
        ids, mask = row_tokens(data[i], tokenizer)
        start, end = last_span(mask)
        if end == 0:
            raise FastkitError(f"evaluate: row {i + 1} trains no token (its answer is empty or masked out); "
                               "held-out rows need an answer to score.")
        out.append(EvalRow(i + 1, list(ids), list(mask), start, end))
    return out


__all__ = ["EvalRow", "eval_rows", "last_span", "unpacked"]
