"""Exact assistant-turn masks for multi-turn chats, a batch of conversations at a time.

A turn's trained span is what the chat template writes for that message: it starts where the rendering of
the messages before it with the generation prompt ends (``messages[:i]``, ``add_generation_prompt=True``) and
ends where the rendering of ``messages[:i + 1]`` ends. So a chat with k assistant turns needs those prefix
renders; the whole conversation's rendering (one more) is the last turn's end, so 2k renders in all.

What makes it cheap, without changing a token or a mask bit:

- renders go straight to the template that ``apply_chat_template`` compiles, with the variables it passes
  (``messages`` with None-valued keys dropped, the special tokens, ``add_generation_prompt``), skipping its
  per-call copies of the messages. That shortcut is taken only where it is provably the same: the tokenizer
  does not override ``apply_chat_template``, the messages are plain JSON (dicts, lists, strings, numbers),
  carry no reasoning field (transformers aliases those), and, once per tokenizer and template, a probe set of
  conversations renders byte for byte as ``apply_chat_template`` renders it. Anything else renders through
  ``apply_chat_template`` itself (:attr:`ChatRenderer.direct` says which, per conversation :meth:`~ChatRenderer.
  render`);
- a fast tokenizer encodes the batch's texts in one call with character offsets, and a token is trained when
  its first character lies in a span (numpy, not a Python loop per token); the columns go to Arrow as
  ``list<int64>`` arrays built from numpy, with no Python list per row.

A slow tokenizer tokenizes each trained / untrained piece on its own, as before.
"""

from __future__ import annotations

import logging
from itertools import chain
from typing import Any

from fastkit.errors import FastkitError

logger = logging.getLogger(__name__)

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
"""Message keys transformers copies under each other's names before rendering (its ``_alias_reasoning_fields``):
a conversation with one of them is rendered through ``apply_chat_template``."""
PROBES = (
    [{"role": "system", "content": "S"}, {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
     {"role": "user", "content": "q2"}, {"role": "assistant", "content": " a2\n"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}],
)
"""Conversations rendered both ways once per tokenizer and template before the direct path is trusted (a probe
the template refuses through ``apply_chat_template`` must be refused the same way, and one must render)."""
NOT_PREFIX_PRESERVING = (
    "This tokenizer's chat template renders earlier turns differently from the last one (it is not "
    "prefix-preserving), so the assistant turns of a multi-turn chat cannot be cut out exactly. Either "
    "set tokenizer.chat_template to a prefix-preserving template, or pass each conversation as "
    "'prompt' (messages before the answer) + 'completion' (the answer) rows.")
_probed: dict[tuple, bool] = {}


def _is_plain(value: Any) -> bool:
    """Whether ``value`` is plain JSON data (what transformers' own copy of the template data leaves as it is)."""
    kind = type(value)
    if kind is str or kind is int or kind is float or kind is bool or value is None:
        return True
    if kind is list:
        return all(_is_plain(v) for v in value)
    if kind is dict:
        return all(type(k) is str and _is_plain(v) for k, v in value.items())
    return False


def _plain_messages(messages: Any) -> list[dict] | None:
    """The messages as ``apply_chat_template`` hands them to the template (None-valued keys dropped), or None
    where the direct render could differ from it (not plain JSON, a reasoning field, not a list of dicts)."""
    if type(messages) is not list:
        return None
    out = []
    for message in messages:
        if type(message) is not dict or not _is_plain(message):
            return None
        if any(message.get(field) is not None for field in REASONING_FIELDS):
            return None
        out.append({k: v for k, v in message.items() if v is not None})
    return out


class ChatRenderer:
    """``tokenizer.apply_chat_template(messages, tokenize=False, ...)`` with ``chat_template=template``, cheaply.

    :meth:`render` returns exactly what ``apply_chat_template`` returns (``""`` for no messages);
    :attr:`direct` is False when every render goes through ``apply_chat_template`` (see the module's notes).
    """

    def __init__(self, tokenizer, template: str | None = None):
        self.tokenizer, self.template = tokenizer, template
        self.compiled, self.variables = None, {}
        self.direct = self._direct_possible() and self._probe()

    def _direct_possible(self) -> bool:
        try:
            from transformers.tokenization_utils_base import PreTrainedTokenizerBase
            from transformers.utils.chat_template_utils import _compile_jinja_template

            own = type(self.tokenizer).apply_chat_template is not PreTrainedTokenizerBase.apply_chat_template
            if own or "apply_chat_template" in vars(self.tokenizer):
                return False  # a tokenizer with its own chat rendering (Mistral's, a processor's, a wrapper)
            source = self.tokenizer.get_chat_template(self.template, None)
            self.compiled = _compile_jinja_template(source)
            self.variables = dict(self.tokenizer.special_tokens_map)
            self.key = (type(self.tokenizer), source, repr(sorted(self.variables.items())))
        except Exception:  # another transformers layout: render through the public API
            return False
        return _is_plain(self.variables)

    def _probe(self) -> bool:
        """Once per tokenizer class, template and special tokens: the probes render the same both ways."""
        if self.key not in _probed:
            outcomes = [self._agree(list(p), gen) for p in PROBES for gen in (False, True)]
            _probed[self.key] = None not in outcomes and True in outcomes
            if not _probed[self.key]:
                logger.debug("fastkit: chat template rendered through apply_chat_template (the probe differed)")
        return _probed[self.key]

    def _agree(self, messages: list[dict], generation_prompt: bool) -> bool | None:
        """True: both ways render the same; False: both refuse it alike; None: they differ."""
        try:
            expected = self._api(messages, generation_prompt)
        except Exception as refused:  # the template's raise_exception (roles must alternate, ...)
            try:
                self._direct(messages, generation_prompt)
            except type(refused):
                return False
            return None
        try:
            return True if self._direct(messages, generation_prompt) == expected else None
        except Exception:
            return None

    def _direct(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.compiled.render(messages=messages, tools=None, documents=None,
                                    add_generation_prompt=generation_prompt, **self.variables)

    def _api(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                  chat_template=self.template)

    def renders(self, messages: Any):
        """A function ``(n, generation_prompt) -> rendering of messages[:n]`` for one conversation."""
        plain = _plain_messages(messages) if self.direct else None
        if plain is None:
            return lambda n, gen: self._api(messages[:n], gen) if n else ""
        return lambda n, gen: self._direct(plain[:n], gen) if n else ""


def chat_spans(messages: Any, renderer: ChatRenderer) -> tuple[str, list[tuple[int, int]]] | None:
    """``(text, [(start, end) char span of each assistant turn])``; None if the template is not
    prefix-preserving for this conversation (an earlier turn renders unlike itself as the last one)."""
    render = renderer.renders(messages)
    n = len(messages)
    text = render(n, False)
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = render(i, True)
        upto = text if i == n - 1 else render(i + 1, False)
        if not (upto.startswith(before) and text.startswith(upto)):
            return None
        spans.append((len(before), len(upto)))
    return text, spans


def _training_template(tokenizer) -> str | None:
    """TRL's prefix-preserving training template for this tokenizer's template, if TRL ships one."""
    try:
        from trl import get_training_chat_template

        return get_training_chat_template(tokenizer)
    except Exception:  # TRL knows only a fixed list of templates; any other one raises
        return None


class ChatMasker:
    """Tokenizes conversations into ``input_ids`` + ``completion_mask`` (1 on every assistant turn's tokens)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.renderer = ChatRenderer(tokenizer)
        self._training = None  # TRL's training template's renderer, made the first time a chat needs it

    def spans(self, messages: Any) -> tuple[str, list[tuple[int, int]]]:
        """The text and assistant spans, with TRL's training template where the tokenizer's own is not
        prefix-preserving for this chat; FastkitError when neither can cut the turns out exactly."""
        found = chat_spans(messages, self.renderer)
        if found is None:
            if self._training is None:
                template = _training_template(self.tokenizer)
                self._training = ChatRenderer(self.tokenizer, template) if template else False
            found = chat_spans(messages, self._training) if self._training else None
            if found is None:
                raise FastkitError(NOT_PREFIX_PRESERVING)
        return found

    def arrays(self, conversations: list) -> tuple[Any, Any, Any]:
        """``(offsets, ids, mask)`` numpy arrays: row r's tokens are ``ids[offsets[r]:offsets[r + 1]]``."""
        import numpy as np

        found = [self.spans(messages) for messages in conversations]
        if not found:
            empty = np.zeros(0, np.int64)
            return np.zeros(1, np.int64), empty, empty
        if getattr(self.tokenizer, "is_fast", False):
            enc = self.tokenizer([text for text, _ in found], add_special_tokens=False, return_offsets_mapping=True)
            rows = [(ids, token_starts_mask(offsets, spans)) for ids, offsets, (_, spans) in
                    zip(enc["input_ids"], enc["offset_mapping"], found)]
        else:
            rows = [pieces_mask(text, spans, self.tokenizer) for text, spans in found]
        lengths = np.fromiter((len(ids) for ids, _ in rows), dtype=np.int64, count=len(rows))
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        ids = np.fromiter(chain.from_iterable(row for row, _ in rows), dtype=np.int64, count=int(offsets[-1]))
        return offsets, ids, np.concatenate([m for _, m in rows])

    def table(self, conversations: list):
        """The batch as an Arrow table (:func:`token_table`)."""
        return token_table(*self.arrays(conversations))


def token_table(offsets, ids, mask):
    """``input_ids`` + ``completion_mask`` as ``list<int64>`` Arrow columns built from numpy (row r: tokens
    ``offsets[r]`` to ``offsets[r + 1]`` of ``ids`` and ``mask``), with no Python list per token."""
    import numpy as np
    import pyarrow as pa

    starts = pa.array(offsets.astype(np.int32))  # (rows + 1,)
    return pa.table({"input_ids": pa.ListArray.from_arrays(starts, pa.array(ids)),
                     "completion_mask": pa.ListArray.from_arrays(starts, pa.array(mask))})


def token_starts_mask(offsets: list, spans: list[tuple[int, int]]):
    """1 for each token whose first character lies in a span, 0 elsewhere (int64 numpy)."""
    import numpy as np

    starts = np.fromiter((start for start, _ in offsets), dtype=np.int64, count=len(offsets))
    bits = np.zeros(len(offsets), dtype=bool)
    for s, e in spans:
        bits |= (starts >= s) & (starts < e)
    return bits.astype(np.int64)


def pieces_mask(text: str, spans: list[tuple[int, int]], tokenizer):
    """A slow tokenizer: each untrained / trained piece tokenized on its own; (ids, int64 mask)."""
    import numpy as np

    ids, mask, pos = [], [], 0
    for s, e in spans + [(len(text), len(text))]:
        for piece, bit in ((text[pos:s], 0), (text[s:e], 1)):
            piece_ids = tokenizer(piece, add_special_tokens=False)["input_ids"] if piece else []
            ids += piece_ids
            mask += [bit] * len(piece_ids)
        pos = e
    return ids, np.asarray(mask, dtype=np.int64)


__all__ = ["ChatMasker", "ChatRenderer", "NOT_PREFIX_PRESERVING", "chat_spans", "pieces_mask",
           "token_starts_mask", "token_table"]
