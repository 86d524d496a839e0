"""fastkit/export/gguf/modelfile.py: the Modelfile TEMPLATE, rendered by Go's text/template as Ollama renders it
(tests/ollama/render.go), equals ``apply_chat_template`` for every conversation shape and family of
tests/ollama_templates.py, the default system prompt included; what Ollama cannot render alike is said.

With CI=true a missing Go toolchain fails the Go tests (.ci/run installs Debian's golang-go); elsewhere they skip.
"""

from __future__ import annotations

import logging
import os

import pytest

from fastkit.export.gguf import modelfile as mf
from tests import ollama_templates as ot

SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def go():
    binary = ot.go_binary()
    if binary is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("no Go toolchain in CI: .ci/run must apt-get install golang-go")
        pytest.skip("no Go toolchain (apt-get install golang-go)")
    return binary


def _probe_chats() -> list[list[dict]]:
    """Every role order of up to 5 messages with a user turn, with text contents (numbered, so none repeats)."""
    with_user, _ = mf._probes()
    return [[mf._m(r, f"Message {i} ({r}): Hello, world! 12 + 30 = 42.") for i, r in enumerate(roles)]
            for roles in with_user]


@pytest.mark.parametrize("label", list(ot.FAMILIES))
def test_template_renders_the_chat_template_in_go(go, label):
    """Every shape, and every role order of up to 5 messages the chat template accepts, rendered in Go from the
    Modelfile's TEMPLATE: exactly ``apply_chat_template``'s text, except where Ollama joins two messages."""
    tok = ot.tokenizer(label)
    text = mf.modelfile(tok, "m.gguf")
    assert text is not None
    template = ot.template_of(text)
    chats = list(mf.SHAPES.values()) + _probe_chats()
    checked = 0
    for chat, got in zip(chats, ot.go_render(go, template, chats), strict=True):
        try:
            want = mf.reference(tok, chat)
        except Exception:  # the Jinja refuses this chat (Gemma: roles must alternate): nothing to match
            continue
        assert got == mf.render(mf.chat_layout(tok)[0], chat), chat  # the Python twin predicts Go
        if mf.collate(chat) == chat:
            assert got == want, (label, chat)
            checked += 1
        else:
            assert got != want  # two system messages: said in the Modelfile
            assert "two system messages: Ollama joins" in text
    assert checked >= 6


def test_smollm2_default_system_prompt_is_in_the_template(go):
    """SmolLM2's template adds its default system prompt to a chat without one; Ollama's built-in ChatML (what
    ``ollama create`` picks for it without a TEMPLATE) drops it. The TEMPLATE renders it."""
    tok = ot.tokenizer("SmolLM2-135M-Instruct")
    template = ot.template_of(mf.modelfile(tok, "m.gguf"))
    user_only, multi = mf.SHAPES["user only"], mf.SHAPES["multi-turn"]
    got = ot.go_render(go, template, [user_only, multi])
    assert got[0].startswith(f"<|im_start|>system\n{SMOLLM2_SYSTEM}<|im_end|>\n<|im_start|>user\n")
    assert got == [mf.reference(tok, user_only), mf.reference(tok, multi)]
    chatml = ("{{- range $i, $_ := .Messages }}{{- $last := eq (len (slice $.Messages $i)) 1 -}}"
              "<|im_start|>{{ .Role }}\n{{ .Content }}{{ if not $last }}<|im_end|>\n{{ end }}"
              "{{- if and (ne .Role \"assistant\") $last }}<|im_end|>\n<|im_start|>assistant\n{{ end }}{{- end }}")
    plain = ot.go_render(go, chatml, [user_only, multi])  # Ollama's ChatML, as its built-in template writes it
    assert SMOLLM2_SYSTEM not in plain[0] and plain[0] != got[0] and plain[1] != got[1]


@pytest.mark.parametrize("label", list(ot.FAMILIES))
def test_stop_list_is_the_templates_end_tokens(label):
    """PARAMETER stop: the special tokens that close an assistant turn in the template, then EOS."""
    tok = ot.tokenizer(label)
    text = mf.modelfile(tok, "m.gguf")
    stops = [line.split(" ", 2)[2].strip('"') for line in text.splitlines() if line.startswith("PARAMETER stop")]
    assert stops == ot.FAMILIES[label][1]
    closing = mf.chat_layout(tok)[0].gaps[("assistant", "user", "assistant", True, False)]
    assert closing.startswith(stops[0])  # the first stop is what the template writes right after an answer


def test_what_ollama_renders_differently_is_said():
    text = mf.modelfile(ot.tokenizer("Llama-3.1"), "m.gguf")
    notes = [line for line in text.splitlines() if line.startswith("# differs")]
    assert any("two system messages" in n for n in notes)
    assert any("a user message that starts or ends with whitespace" in n for n in notes)  # Jinja's | trim
    assert any(n.startswith("# differs from apply_chat_template: tools") for n in notes)
    assert not [n for n in mf.modelfile(ot.tokenizer("ChatML (twins)"), "m.gguf").splitlines()
                if n.startswith("# differs") and "two system" not in n]


def test_a_template_go_cannot_express_gets_no_modelfile(caplog):
    """Turn numbers (``loop.index``) and a message written twice have no TEMPLATE: no Modelfile, a warning why."""
    numbered = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + ' ' + loop.index|string + '\\n' + "
                "m['content'] + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                "{% endif %}")
    tok = ot._styled(numbered, ot._CHATML)
    assert "user 1\n" in tok.apply_chat_template([mf._m("user", "x")], tokenize=False)
    with caplog.at_level(logging.WARNING, logger="fastkit.export.gguf.modelfile"):
        assert mf.modelfile(tok, "m.gguf") is None
    assert "depends on more than the turns around it" in caplog.text
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}|{{ m['content'] }}{% endfor %}"
    assert mf.chat_layout(tok) == (None, "the chat template: it does not write each message once, in order "
                                         "(user chat)")


def test_go_string_escapes_what_go_would_read_otherwise(go):
    text = 'a "quoted" \\ back\nnew\ttab \x01 ✓ 𝄞 """ {{ .Content }}'
    assert ot.go_render(go, "{{ " + mf.go_string(text) + " }}", [[mf._m("user", "x")]]) == [text]
