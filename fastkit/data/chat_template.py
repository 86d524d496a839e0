"""A chat template for a base model's tokenizer: the model's own, or one cloned with TRL's ``clone_chat_template``.

Chat data needs ``tokenizer.chat_template``. Instruct checkpoints ship one; base checkpoints often do
not. :func:`add_chat_template` keeps a template that is there and otherwise copies one from a
``source`` tokenizer (an instruct sibling such as ``"Qwen/Qwen3-0.6B"``, or a local folder) with
``trl.clone_chat_template``, which also adds the source's special tokens, sets its EOS token on the
tokenizer and the model's generation config, and resizes the embeddings to the new vocabulary.
Call it before ``FastModel.get_peft_model``: the resized embeddings must exist before LoRA wraps them.
"""

from __future__ import annotations

import logging

from fastkit.errors import FastkitError

logger = logging.getLogger(__name__)


def has_chat_template(tokenizer) -> bool:
    """Whether ``tokenizer`` can format chat messages (a non-empty ``chat_template``): the one test of it."""
    return getattr(tokenizer, "chat_template", None) not in (None, "")


def require_chat_template(tokenizer) -> None:
    """Raise a clear error if ``tokenizer`` cannot format chat messages."""
    if not has_chat_template(tokenizer):
        raise FastkitError("This tokenizer has no chat template, but the data is chat messages (a base model?). "
                           "Give it the template of an instruct model of the same family before LoRA: "
                           "model, tokenizer = fastkit.add_chat_template(model, tokenizer, \"<instruct model id>\") "
                           "(TRL's clone_chat_template), or give plain 'text' data.")


_PROBE_CALL = "fastkit_probe_call"


def renders_tool_calls(tokenizer) -> bool:
    """Whether the chat template writes an assistant turn's ``tool_calls`` into the text (a template that raises on
    one counts as rendering it: that error, not this check, is what the user sees)."""
    call = {"type": "function", "function": {"name": _PROBE_CALL, "arguments": {"x": 1}}}
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    try:
        text = tokenizer.apply_chat_template(chat, tokenize=False)
    except Exception:  # noqa: BLE001 -- any template error: not this check's to report
        return True
    return _PROBE_CALL in str(text)


def _has_tool_calls(dataset) -> bool:
    """Whether the ``messages`` feature has a ``tool_calls`` field at all (read from the schema, no row read)."""
    feature = dataset.features.get("messages") if getattr(dataset, "features", None) else None
    inner = feature[0] if isinstance(feature, list) and feature else getattr(feature, "feature", None)
    return isinstance(inner, dict) and "tool_calls" in inner


def _call_only(messages) -> bool:
    return any(m.get("role") == "assistant" and m.get("tool_calls") and not (m.get("content") or "").strip()
               for m in messages or ())


def warn_dropped_tool_calls(dataset, tokenizer) -> int:
    """Rule (issue 44): an assistant turn that is a tool call with empty content, under a chat template that does not
    render ``tool_calls``, trains only its end-of-turn token. Such rows are kept and counted: one warning per
    dataset, with the count and the first row. A template that renders the call: no warning. Returns the count."""
    if "messages" not in getattr(dataset, "column_names", ()) or not _has_tool_calls(dataset):
        return 0
    if renders_tool_calls(tokenizer):
        return 0
    batches = dataset.select_columns(["messages"]).iter(batch_size=1024)  # a batch at a time in memory
    rows = [i for i, m in enumerate(m for b in batches for m in b["messages"]) if _call_only(m)]
    if rows:
        logger.warning("fastkit: %d of %d rows have an assistant tool call with empty content that the chat template "
                       "does not render (first: row %d): those turns train only the end-of-turn token. Use a chat "
                       "template that renders tool_calls (the model's own), write the call into the content, or drop "
                       "those rows.", len(rows), len(dataset), rows[0] + 1)
    return len(rows)


def add_chat_template(model, tokenizer, source: str | None = None, resize_to_multiple_of: int | None = 64):
    """``(model, tokenizer)`` with a chat template: the tokenizer's own if it has one, else cloned from ``source``.

    Raises :class:`~fastkit.errors.FastkitError` when the tokenizer has none and no ``source`` is given,
    or when ``source`` cannot be read (offline without it cached, a wrong id).
    """
    if has_chat_template(tokenizer):
        logger.info("fastkit: the tokenizer has its own chat template; kept")
        return model, tokenizer
    if not source:
        raise FastkitError("This tokenizer has no chat template (a base model?). Give it one from an instruct "
                           "model of the same family: model, tokenizer = fastkit.add_chat_template(model, tokenizer, "
                           "\"<instruct model id or folder>\") (TRL's clone_chat_template), or train on plain "
                           "'text' rows.")
    from trl import clone_chat_template

    try:
        model, tokenizer, added = clone_chat_template(model, tokenizer, source,
                                                      resize_to_multiple_of=resize_to_multiple_of)
    except (OSError, ValueError) as exc:
        raise FastkitError(f"add_chat_template: could not read a tokenizer from {source!r} ({exc}). Pass a Hub id "
                           "you can download, or a local folder holding tokenizer files.") from exc
    logger.info("fastkit: chat template cloned from %s (%d tokens added, embeddings resized to %d)", source,
                len(added), model.get_input_embeddings().weight.shape[0])
    return model, tokenizer


__all__ = ["add_chat_template", "has_chat_template", "renders_tool_calls", "require_chat_template",
           "warn_dropped_tool_calls"]
