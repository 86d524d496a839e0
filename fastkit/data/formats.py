"""The data formats users bring, turned into one form; exact loss masks on every assistant turn; a preview.

Formats (detected from the columns, in this order):

- ``messages``: ``[{"role": ..., "content": ...}, ...]`` (OpenAI / TRL conversational);
- ``conversations``: ShareGPT, ``[{"from": "human" | "gpt" | "system", "value": ...}, ...]``;
- ``instruction`` + ``output`` (+ optional ``input``, ``system``): Alpaca;
- ``prompt`` + ``completion``: strings or message lists (TRL prompt-completion);
- ``text``: plain language modeling (every token trained).

ShareGPT and Alpaca become ``messages``; the other three stay as they are.

Multi-turn chats train on EVERY assistant turn: :func:`tokenize_chat` renders the conversation with
the tokenizer's chat template and cuts each assistant turn's characters out of it by rendering the
prefixes (``messages[:i]`` with the generation prompt, ``messages[:i + 1]`` without), so a turn's
span is exactly what the template writes for that message, end-of-turn token included, and nothing
of the system/user/tool turns or the ``<|im_start|>assistant`` header. The result is TRL's
pre-tokenized form (``input_ids`` + ``completion_mask``): ``SFTTrainer`` turns the mask into labels
(-100 elsewhere) and packs it like any other row. How that stays cheap at scale (2k renders for k assistant
turns, straight to the compiled template where provably the same, one batched tokenizer call with offsets):
:mod:`fastkit.data.chat_masks`. A template that renders earlier turns differently
from the last one (Qwen3 drops past reasoning) is not prefix-preserving; TRL's training template for
it (``trl.get_training_chat_template``) is used instead when TRL ships one, else the data is refused.
"""

from __future__ import annotations

import html as _html
import logging
from typing import Any

from fastkit.data.chat_masks import ChatMasker, ChatRenderer, chat_spans, pieces_mask, token_starts_mask
from fastkit.errors import FastkitError

logger = logging.getLogger(__name__)

FORMATS = ("messages", "sharegpt", "alpaca", "prompt_completion", "text")
"""Names :func:`detect_format` returns."""
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "model": "assistant", "chatgpt": "assistant", "system": "system", "tool": "tool",
                  "function_response": "tool", "observation": "tool"}
"""ShareGPT ``from`` values -> chat roles."""
FIELDS = ("messages", "conversations", "prompt", "completion", "instruction", "input", "output", "system", "text")
"""The fields of the accepted formats: the targets a column mapping (``columns={"prompt": "question"}``) may name.
``system`` is Alpaca's system prompt; mapped onto any chat source it becomes the chat's first (system) turn."""


def detect_format(columns: list[str] | set[str]) -> str:
    """Which of :data:`FORMATS` a dataset with these columns is in; FastkitError naming the columns if none."""
    cols = set(columns)
    if "messages" in cols:
        return "messages"
    if "conversations" in cols:
        return "sharegpt"
    if {"instruction", "output"} <= cols:
        return "alpaca"
    if {"prompt", "completion"} <= cols:
        return "prompt_completion"
    if "text" in cols:
        return "text"
    raise FastkitError(
        f"The dataset has columns {sorted(cols)}; fastkit reads one of: 'messages' (chat, role/content), "
        "'conversations' (ShareGPT, from/value), 'instruction' + 'output' (+ 'input', Alpaca), 'prompt' + "
        "'completion', or 'text'. Rename or map your columns to one of these first.")


def check_columns(columns: Any, where: str) -> dict[str, str]:
    """A column mapping (field -> the data's column) checked: a dict, fields of :data:`FIELDS`, column names."""
    if not isinstance(columns, dict) or not columns:
        raise FastkitError(f"{where}: columns must be a mapping of fastkit field -> your column, such as "
                           f"{{'prompt': 'question', 'completion': 'answer'}}, got {columns!r:.80}.")
    for target, column in columns.items():
        if target not in FIELDS:
            raise FastkitError(f"{where}: columns maps {target!r}, which is not a field fastkit reads; map your "
                               f"columns onto: {', '.join(FIELDS)} (e.g. prompt: question, completion: answer).")
        if not isinstance(column, str) or not column:
            raise FastkitError(f"{where}: columns maps {target!r} to {column!r}; give the name of one of your "
                               "data's columns.")
    targets = list(columns.values())
    twice = next((c for c in targets if targets.count(c) > 1), None)
    if twice is not None:  # one column as two fields (a prompt that is its own answer): a slip, not a format
        both = [t for t, c in columns.items() if c == twice]
        raise FastkitError(f"{where}: columns maps column {twice!r} to both {both[0]!r} and {both[1]!r}; map each "
                           "column to one field.")
    return dict(columns)


def map_columns(dataset, columns: dict[str, str], where: str, have: list[str] | None = None):
    """``dataset`` with its columns renamed to fastkit's fields (``{"prompt": "question"}``: the column ``question``
    becomes ``prompt``). Columns not mapped are kept only when they already carry a field's name (a mapped
    ``question`` file keeps its ``completion``); others are dropped. A mapped column the data lacks is refused,
    naming the columns it has (``have``: the columns, for a stream whose features are not known)."""
    columns = check_columns(columns, where)
    have = dataset.column_names if have is None else have  # a stream's columns come from its first row
    for target, column in columns.items():
        if column not in have:
            raise FastkitError(f"{where}: columns maps {target!r} to column {column!r}, which the data does not "
                               f"have (its columns: {', '.join(map(repr, have))}). Fix the mapping.")
    keep = [c for c in have if c in FIELDS and c not in columns and c not in columns.values()]
    drop = [c for c in have if c not in keep]
    return dataset.map(lambda row: {t: row[c] for t, c in columns.items()}, remove_columns=drop)


def sharegpt_to_messages(conversations: list[dict[str, Any]], row: int = 0) -> list[dict[str, str]]:
    """ShareGPT turns (``from``/``value``; role/content also accepted) -> chat messages."""
    messages = []
    for turn in conversations:
        speaker = turn.get("from", turn.get("role"))
        role = SHAREGPT_ROLES.get(str(speaker).lower())
        if role is None:
            raise FastkitError(f"conversations row {row + 1}: unknown speaker from={speaker!r}; expected one of "
                               f"{sorted(SHAREGPT_ROLES)}. Map it to 'human', 'gpt' or 'system' first.")
        value = turn.get("value", turn.get("content"))
        if not isinstance(value, str):  # None / missing / a tool call only: never train it as an empty answer
            raise FastkitError(f"conversations row {row + 1}: the {role} turn's value is {value!r:.40}, not a string. "
                               "Fix or drop that row (fastkit.data.check_dataset(..., drop_invalid=True)).")
        messages.append({"role": role, "content": value})
    return messages


def alpaca_to_messages(row: dict[str, Any]) -> list[dict[str, str]]:
    """An Alpaca row -> ``[system?, user: instruction (+ blank line + input), assistant: output]``."""
    user = row["instruction"] if not row.get("input") else f"{row['instruction']}\n\n{row['input']}"
    messages = [{"role": "system", "content": row["system"]}] if row.get("system") else []
    return messages + [{"role": "user", "content": user}, {"role": "assistant", "content": row["output"]}]


def normalize_dataset(dataset):
    """``dataset`` in one of the trainable forms: ``messages``, ``prompt``/``completion`` or ``text``.

    ShareGPT and Alpaca rows become ``messages`` (other columns dropped); anything else is refused
    with the columns seen. Already-tokenized data (``input_ids``) passes through.
    """
    if "input_ids" in dataset.column_names:
        return dataset
    fmt = detect_format(dataset.column_names)
    if fmt == "sharegpt":
        return dataset.map(lambda row, i: {"messages": sharegpt_to_messages(row["conversations"], i)},
                           with_indices=True, remove_columns=dataset.column_names)
    if fmt == "alpaca":
        return dataset.map(lambda row: {"messages": alpaca_to_messages(row)}, remove_columns=dataset.column_names)
    return dataset


def is_single_answer(messages: list[dict[str, Any]]) -> bool:
    """True when the only assistant turn is the last message (prompt/completion loses nothing)."""
    roles = [m.get("role") for m in messages]
    return bool(roles) and roles[-1] == "assistant" and roles.count("assistant") == 1


def _render(tokenizer, messages: list[dict], template: str | None, generation_prompt: bool = False) -> str:
    if not messages:
        return ""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                         chat_template=template)


def assistant_spans(messages: list[dict], tokenizer, template: str | None = None
                    ) -> tuple[str, list[tuple[int, int]]] | None:
    """``(text, [(start, end) char span of each assistant turn])``; None if the template is not prefix-preserving."""
    return chat_spans(messages, ChatRenderer(tokenizer, template))


def _token_mask(text: str, spans: list[tuple[int, int]], tokenizer) -> tuple[list[int], list[int]]:
    """Token ids of ``text`` and 1 for each token that starts inside a span (0 elsewhere)."""
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), token_starts_mask(enc["offset_mapping"], spans).tolist()
    ids, mask = pieces_mask(text, spans, tokenizer)
    return ids, mask.tolist()


def tokenize_chat(messages: list[dict], tokenizer) -> dict[str, list[int]]:
    """``{"input_ids", "completion_mask"}`` of one conversation: 1 on every assistant turn's tokens, 0 elsewhere.

    Refused (FastkitError) when the tokenizer's template is not prefix-preserving and TRL ships no training
    template for it (see :mod:`fastkit.data.chat_masks`)."""
    _, ids, mask = ChatMasker(tokenizer).arrays([messages])
    return {"input_ids": ids.tolist(), "completion_mask": mask.tolist()}


def _tokenize_chats_batch(batch: dict[str, list], tokenizer):
    """A batch of chats -> an Arrow table of ``input_ids`` + ``completion_mask`` (no Python list per token)."""
    return ChatMasker(tokenizer).table(batch["messages"])


def tokenize_chats(dataset, tokenizer, num_proc: int | None = None):
    """A ``messages`` dataset -> TRL's pre-tokenized ``input_ids`` + ``completion_mask`` (every assistant turn)."""
    return dataset.map(_tokenize_chats_batch, batched=True, batch_size=256, fn_kwargs={"tokenizer": tokenizer},
                       remove_columns=dataset.column_names, num_proc=num_proc, desc="fastkit: tokenizing chats")


def row_tokens(row: dict[str, Any], tokenizer) -> tuple[list[int], list[int]]:
    """``(input_ids, trained 0/1 per token)`` of one row in any trainable form, as fastkit trains it."""
    if "input_ids" in row:
        ids = list(row["input_ids"])
        if "labels" in row:
            return ids, [int(label != -100) for label in row["labels"]]
        return ids, list(row.get("completion_mask") or [1] * len(ids))
    if "messages" in row:
        out = tokenize_chat(row["messages"], tokenizer)
        return out["input_ids"], out["completion_mask"]
    if "prompt" in row:
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, str):  # TRL appends EOS to plain-text completions and texts
            p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            c = tokenizer(_with_eos(completion, tokenizer), add_special_tokens=False)["input_ids"]
            return p + c, [0] * len(p) + [1] * len(c)
        # as TRL trains it: everything the template writes after the prompt's generation prompt
        start = len(_render(tokenizer, list(prompt), None, generation_prompt=True))
        full = _render(tokenizer, list(prompt) + list(completion), None)
        return _token_mask(full, [(start, len(full))], tokenizer)
    ids = tokenizer(_with_eos(row["text"], tokenizer), add_special_tokens=False)["input_ids"]
    return ids, [1] * len(ids)


def with_eos(text: str, tokenizer) -> str:
    """``text`` as TRL trains it: the tokenizer's EOS token appended unless it already ends with it."""
    eos = tokenizer.eos_token or ""
    return text if text.endswith(eos) else text + eos


_with_eos = with_eos  # the name rows_tokens used


def tokenize_rows_batch(batch: dict[str, list], tokenizer):
    """A batch of ``text`` or ``prompt``/``completion`` rows tokenized as TRL's ``SFTTrainer`` tokenizes them.

    text: ``tokenizer(text + EOS)``; string prompt/completion: ``tokenizer(prompt)`` and
    ``tokenizer(prompt + completion + EOS)``; message lists: ``apply_chat_template(prompt,
    add_generation_prompt=True)`` and ``apply_chat_template(prompt + completion)``. The completion starts where
    the two token lists part (TRL's ``common_prefix_length``); ``completion_mask`` is 1 from there on.
    """
    if "text" in batch:
        return {"input_ids": tokenizer([with_eos(t, tokenizer) for t in batch["text"]])["input_ids"]}
    prompts, completions = batch["prompt"], batch["completion"]
    if prompts and isinstance(prompts[0], str):
        p_ids = tokenizer(prompts)["input_ids"]
        f_ids = tokenizer([p + with_eos(c, tokenizer) for p, c in zip(prompts, completions)])["input_ids"]
    else:
        p_ids = tokenizer.apply_chat_template(prompts, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"]
        f_ids = tokenizer.apply_chat_template([a + b for a, b in zip(prompts, completions)], tokenize=True,
                                              return_dict=True)["input_ids"]
    from itertools import chain

    import numpy as np

    from fastkit.data.chat_masks import token_table

    offsets = np.zeros(len(f_ids) + 1, dtype=np.int64)
    np.cumsum([len(f) for f in f_ids], out=offsets[1:])
    mask = np.zeros(int(offsets[-1]), dtype=np.int64)
    for start, p, f in zip(offsets, p_ids, f_ids):
        shared = next((i for i, (a, b) in enumerate(zip(p, f)) if a != b), min(len(p), len(f)))
        mask[start + shared:start + len(f)] = 1
    ids = np.fromiter(chain.from_iterable(f_ids), dtype=np.int64, count=int(offsets[-1]))
    return token_table(offsets, ids, mask)


def render_mask(ids: list[int], mask: list[int], tokenizer, html: bool = False) -> str:
    """The tokens as text with trained runs in ``[brackets]`` (or green ``<mark>`` spans when ``html``)."""
    runs: list[tuple[int, list[int]]] = []
    for tok, bit in zip(ids, mask):
        if runs and runs[-1][0] == bit:
            runs[-1][1].append(tok)
        else:
            runs.append((bit, [tok]))
    parts = []
    for bit, toks in runs:
        text = tokenizer.decode(toks, skip_special_tokens=False)
        if html:
            text = _html.escape(text)
            parts.append(f'<mark style="background:#c8f7c5">{text}</mark>' if bit else f'<span style="color:#888">'
                         f'{text}</span>')
        else:
            parts.append(f"[{text}]" if bit else text)
    body = "".join(parts)
    return f'<pre style="white-space:pre-wrap">{body}</pre>' if html else body


def preview_masks(dataset, tokenizer, n: int = 1, html: bool = False) -> str:
    """Which tokens of the first ``n`` rows are trained: trained text in ``[brackets]`` (or HTML highlights).

    Takes the data in any format :func:`detect_format` knows (or as :func:`fastkit.data.check_dataset`
    returns it). In a notebook: ``IPython.display.HTML(preview_masks(ds, tok, html=True))``.
    """
    from datasets import Dataset

    if isinstance(dataset, (list, tuple)):
        dataset = Dataset.from_list(list(dataset))
    dataset = normalize_dataset(dataset)
    rows = []
    for i in range(min(n, len(dataset))):
        ids, mask = row_tokens(dataset[i], tokenizer)
        head = f"row {i}: {sum(mask)} of {len(ids)} tokens trained"
        body = render_mask(ids, mask, tokenizer, html=html)
        rows.append(f"<p><b>{_html.escape(head)}</b></p>{body}" if html else f"--- {head}\n{body}")
    return "\n".join(rows)


__all__ = ["FIELDS", "FORMATS", "SHAREGPT_ROLES", "alpaca_to_messages", "assistant_spans", "check_columns",
           "detect_format", "map_columns",
           "is_single_answer", "normalize_dataset", "preview_masks", "render_mask", "row_tokens",
           "sharegpt_to_messages", "tokenize_chat", "tokenize_chats"]
