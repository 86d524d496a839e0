"""The cheap multi-turn mask (fastkit.data.chat_masks) is byte for byte the mask of the reference algorithm.

The reference below is the algorithm fastkit shipped before (2k + 1 renders through ``apply_chat_template``
per chat with k assistant turns, one tokenizer call per chat, a Python test per token), kept here verbatim.
Every template TRL ships (and fastkit's twins' own) x many conversations (system prompts, tools, tool calls,
1-5 assistant turns, empty / whitespace / unicode / special-token content, None-valued keys) x the test
tokenizers: the same ``input_ids``, the same ``completion_mask``, or the same refusal. The shortcuts' fallbacks
are shown taken where their assumption fails.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest

from fastkit import FastkitError
from fastkit.data import chat_masks
from fastkit.data.chat_masks import ChatMasker, ChatRenderer
from fastkit.data.formats import tokenize_chat
from fastkit.families import twins
from fastkit.families.twins import CHATML_TEMPLATE, GEMMA_TEMPLATE, twin_tokenizer


# ---- the reference: fastkit's algorithm before chat_masks, verbatim -------------------------------------------
def _render(tokenizer, messages, template, generation_prompt=False):
    if not messages:
        return ""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                         chat_template=template)


def _assistant_spans(messages, tokenizer, template=None):
    text = _render(tokenizer, messages, template)
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = _render(tokenizer, messages[:i], template, generation_prompt=True)
        upto = _render(tokenizer, messages[: i + 1], template)
        if not (upto.startswith(before) and text.startswith(upto)):
            return None
        spans.append((len(before), len(upto)))
    return text, spans


def _training_template(tokenizer):
    try:
        from trl import get_training_chat_template

        return get_training_chat_template(tokenizer)
    except Exception:
        return None


def _token_mask(text, spans, tokenizer):
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        mask = [int(any(s <= start < e for s, e in spans)) for start, _ in enc["offset_mapping"]]
        return list(enc["input_ids"]), mask
    ids, mask, pos = [], [], 0
    for s, e in spans + [(len(text), len(text))]:
        for piece, bit in ((text[pos:s], 0), (text[s:e], 1)):
            piece_ids = tokenizer(piece, add_special_tokens=False)["input_ids"] if piece else []
            ids += piece_ids
            mask += [bit] * len(piece_ids)
        pos = e
    return ids, mask


def reference_tokenize_chat(messages, tokenizer):
    found = _assistant_spans(messages, tokenizer)
    if found is None:
        template = _training_template(tokenizer)
        found = _assistant_spans(messages, tokenizer, template) if template else None
        if found is None:
            raise FastkitError("not prefix-preserving")
    text, spans = found
    ids, mask = _token_mask(text, spans, tokenizer)
    return {"input_ids": ids, "completion_mask": mask}


# ---- conversations ----------------------------------------------------------------------------------------------
ODD = ["", " ", "\n", "  two  spaces  ", "trailing\n\n", "ünïcødé ✓ 中文 🙂", "<|im_end|> inside", "<end_of_turn>",
       "{{ not jinja }}", "tab\tand\r\nCRLF", "a" * 300]
TOOL_CALL = [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]


def conversations(n: int, seed: int = 0) -> list[list[dict]]:
    """``n`` chats: an optional system prompt, 1-5 (user, assistant) exchanges, some tool turns, odd contents,
    None-valued keys (as Arrow fills the keys other rows have)."""
    rng = random.Random(seed)

    def content() -> str:
        return rng.choice(ODD) if rng.random() < 0.3 else " ".join(rng.choice(["hi", "ok", "fox", "42", "x."])
                                                                  for _ in range(rng.randint(1, 12)))

    out = []
    for _ in range(n):
        chat = [{"role": "system", "content": content()}] if rng.random() < 0.6 else []
        for _ in range(rng.randint(1, 5)):
            chat.append({"role": "user", "content": content(), "name": None})
            if rng.random() < 0.15:
                chat.append({"role": "assistant", "content": "", "tool_calls": TOOL_CALL})
                chat.append({"role": "tool", "content": "3", "tool_calls": None})
            chat.append({"role": "assistant", "content": content(), "tool_calls": None})
        out.append(chat)
    return out


def _outcome(fn, messages, tokenizer):
    try:
        return fn(copy.deepcopy(messages), tokenizer)
    except Exception as e:  # a template refusing a conversation: the same refusal both ways
        return type(e).__name__


TRL_TEMPLATES = sorted((Path(__import__("trl").__file__).parent / "chat_templates").glob("*.jinja"))


def _templates():
    yield "chatml (twin)", CHATML_TEMPLATE
    yield "gemma (twin)", GEMMA_TEMPLATE
    for path in TRL_TEMPLATES:
        yield path.stem, path.read_text()


@pytest.fixture(scope="module")
def chats():
    return conversations(24) + [
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
        [{"role": "assistant", "content": "first"}, {"role": "user", "content": "q"},
         {"role": "assistant", "content": "a"}],
        [{"role": "system", "content": ""}, {"role": "user", "content": ""}, {"role": "assistant", "content": ""},
         {"role": "user", "content": ""}, {"role": "assistant", "content": ""}],
    ]


@pytest.mark.parametrize("name,template", list(_templates()), ids=[n for n, _ in _templates()])
def test_every_shipped_template_masks_as_the_reference(name, template, chats):
    tok = twin_tokenizer()
    tok.chat_template = template
    agreed = 0
    for messages in chats:
        got, expected = _outcome(tokenize_chat, messages, tok), _outcome(reference_tokenize_chat, messages, tok)
        if isinstance(expected, str) and expected == "FastkitError":
            assert got == "FastkitError", messages
            continue
        assert got == expected, messages
        agreed += not isinstance(expected, str)
    print(f"{name}: {agreed} of {len(chats)} masked alike")
    if name in ("chatml (twin)", "qwen2_5", "llama3"):
        assert agreed >= len(chats) - 2  # these take (nearly) every conversation: the comparison is not vacuous


@pytest.mark.parametrize("make", [twins.twin_bpe_tokenizer, twins.twin_spm_tokenizer,
                                  lambda: twins.twin_spm_tokenizer(True)], ids=["bpe", "spm (gemma)", "spm (llama-2)"])
def test_other_test_tokenizers_mask_as_the_reference(make, chats):
    tok = make()
    for template in (tok.chat_template, CHATML_TEMPLATE):
        tok.chat_template = template
        for messages in chats:
            assert _outcome(tokenize_chat, messages, tok) == _outcome(reference_tokenize_chat, messages, tok)


def test_a_batch_is_the_rows_one_by_one(chats):
    """The batched path (one tokenizer call, Arrow columns from numpy) is each row's own result."""
    tok = twin_tokenizer()
    table = ChatMasker(tok).table(chats)
    assert str(table.schema.field("input_ids").type) == "list<item: int64>"
    for r, messages in enumerate(chats):
        expected = reference_tokenize_chat(messages, tok)
        assert table["input_ids"][r].as_py() == expected["input_ids"]
        assert table["completion_mask"][r].as_py() == expected["completion_mask"]


def _counting(monkeypatch) -> dict[str, int]:
    """Renders by way (``api``: apply_chat_template, ``direct``: the compiled template) from now on."""
    counts = {"api": 0, "direct": 0}
    for way in counts:
        original = getattr(ChatRenderer, f"_{way}")

        def spy(self, *args, _way=way, _original=original):
            counts[_way] += 1
            return _original(self, *args)

        monkeypatch.setattr(ChatRenderer, f"_{way}", spy)
    return counts


def test_direct_renders_are_taken_and_2k_renders_suffice(chats, monkeypatch):
    tok = twin_tokenizer()
    renderer = ChatRenderer(tok)
    assert renderer.direct
    counts = _counting(monkeypatch)  # after the probe: a plain chat renders without apply_chat_template
    messages = chats[0]
    k = sum(m["role"] == "assistant" for m in messages)
    chat_masks.chat_spans(messages, renderer)
    assert counts == {"api": 0, "direct": 2 * k}


@pytest.mark.parametrize("why", ["reasoning field", "not plain JSON", "own apply_chat_template", "probe differs"])
def test_the_fallback_is_taken_where_a_shortcut_assumption_fails(why, monkeypatch, chats):
    """Each assumption broken once: the renders go through apply_chat_template, and the mask is still exact."""
    tok = twin_tokenizer()
    messages = copy.deepcopy(chats[3])
    if why == "reasoning field":
        messages[-1]["reasoning_content"] = "because"
    elif why == "not plain JSON":
        messages[0] = dict(messages[0], content=type("Text", (str,), {})("a str subclass"))
    elif why == "own apply_chat_template":
        base = type(tok)

        def own(self, *args, **kwargs):  # a wrapper around the base's, as a subclass might write
            return base.apply_chat_template(self, *args, **kwargs)

        tok = type("OwnRendering", (base,), {"apply_chat_template": own})(
            tokenizer_object=tok.backend_tokenizer, eos_token="<|im_end|>", bos_token="<|im_start|>")
        tok.chat_template = CHATML_TEMPLATE
    else:  # a transformers release that hands the template one more variable than the direct render passes
        import transformers.tokenization_utils_base as tub

        render = tub.render_jinja_template
        monkeypatch.setattr(tub, "render_jinja_template", lambda *a, **kw: render(*a, **kw, extra="!"))
        monkeypatch.setattr(chat_masks, "_probed", {})
        tok.chat_template = "{{ extra }}" + CHATML_TEMPLATE
    expected = _outcome(reference_tokenize_chat, messages, tok)
    assert not isinstance(expected, str)  # a conversation that masks: the comparison is not vacuous
    assert ChatRenderer(tok).direct is (why in ("reasoning field", "not plain JSON"))  # the probe, once
    counts = _counting(monkeypatch)
    assert _outcome(tokenize_chat, messages, tok) == expected
    k = sum(m["role"] == "assistant" for m in messages)
    assert counts == {"api": 2 * k, "direct": 0}  # every render of this chat went through apply_chat_template


def test_a_template_not_prefix_preserving_is_still_refused():
    tok = twin_tokenizer()
    tok.chat_template = CHATML_TEMPLATE.replace("message['content']", "(message['content'] if loop.last else 'x')")
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
            {"role": "user", "content": "q2"}, {"role": "assistant", "content": "b"}]
    with pytest.raises(FastkitError, match="not prefix-preserving"):
        tokenize_chat(chat, tok)
