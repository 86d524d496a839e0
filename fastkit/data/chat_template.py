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


__all__ = ["add_chat_template", "has_chat_template", "require_chat_template"]
