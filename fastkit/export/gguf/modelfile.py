"""The Ollama ``Modelfile`` written beside a GGUF: a TEMPLATE that renders what ``apply_chat_template`` renders.

Why a TEMPLATE. Ollama never runs the GGUF's Jinja template: ``ollama create`` picks the built-in Go template whose
Jinja source is nearest (server/create.go ``detectChatTemplate``, ``template.Named``). For SmolLM2 that is plain
ChatML, which drops its default system prompt; the fine-tuned model then sees prompts it was never trained on.

How. The chat template is rendered (``apply_chat_template``) on probe chats of every role order Ollama can pass
(system / user / assistant, no role twice in a row: Ollama's ``template.collate`` joins such messages before any
template runs), each message a unique marker, and cut at the markers. What lies between two messages must depend
only on the two roles and on whether the second is the last message (:class:`ChatLayout`); then the TEMPLATE
(Go ``text/template``, Ollama's ``.Messages`` with ``.Role`` / ``.Content``) writes those texts, and renders
every probe exactly. A template that needs more (a message rendered twice, text that depends on an earlier turn)
gets no Modelfile, with the reason logged: no near-miss is written.

What still differs is said, in the Modelfile (``#`` lines) and in the log (:func:`differences`): Ollama joins
consecutive messages of one role with a blank line (two system messages in a row), Go cannot trim or split a
message (Jinja's ``| trim``, Qwen3's ``</think>`` split), tool definitions and calls are not written, and a
date the template takes from the clock is the export day's. ``tests/test_modelfile.py`` renders each TEMPLATE
with Go itself (Debian's golang-go) against ``apply_chat_template``; the table is in docs/export.md.

What must not change. The BOS token a tokenizer adds itself (``tokenizer.ggml.add_bos_token``) is left out of the
TEMPLATE, as llama.cpp (and so Ollama) adds it when it tokenizes the prompt.
"""

from __future__ import annotations

import itertools
import json
import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
"""The roles the TEMPLATE writes (tool messages are not written: :func:`differences`)."""
START, END = "", ""
"""The previous role of the first message, and the role after the last one, in :attr:`ChatLayout.gaps`."""


def _m(role: str, content: str) -> dict:
    return {"role": role, "content": content}


SHAPES: dict[str, list[dict]] = {
    "user only": [_m("user", "What is the capital of Peru?")],
    "system + user": [_m("system", "Answer in one word."), _m("user", "What is the capital of Peru?")],
    "multi-turn": [_m("user", "Hi!"), _m("assistant", "Hello! How can I help?"), _m("user", "Name a colour.")],
    "multi-turn + system": [_m("system", "Be brief."), _m("user", "Hi!"), _m("assistant", "Hello."),
                            _m("user", "Name a colour.")],
    "two system messages": [_m("system", "Be brief."), _m("system", "Answer in French."),
                            _m("user", "Name a colour.")],
    "assistant prefix": [_m("user", "Give me JSON with a colour."), _m("assistant", '{"colour": "')],
}
"""The conversation shapes every TEMPLATE is checked on (the last message an assistant's: Ollama continues it)."""

_CONTENTS = (("starts or ends with whitespace", " Name a colour. \n"),
             ("contains '</think>'", "<think>\nhm\n</think>\n\nRed."))
"""Message contents a Go template cannot transform as Jinja may (``| trim``, a reasoning split)."""


@dataclass(frozen=True)
class ChatLayout:
    """A chat template as Ollama can render it: the text before, between and after the messages' contents."""

    gaps: dict[tuple[str, str, str, bool, bool], str]
    """:data:`Key` -> the text written before that message (the END entries: the generation prompt after a last
    system / user message, "" after an assistant's, which Ollama continues). A key missing: the template refuses
    every chat with it."""
    bos: str
    """The BOS the template opens with and the tokenizer adds by itself, left out of the TEMPLATE ("" if none)."""
    note: str = ""
    """How the template treats chats without a user message, where the layout does not cover it ("" if it does)."""


def adds_bos(tokenizer) -> bool:
    """The tokenizer puts its BOS in front of a text by itself (what ``tokenizer.ggml.add_bos_token`` says)."""
    ids = tokenizer("a")["input_ids"]
    return bool(ids) and ids[0] == tokenizer.bos_token_id


def reference(tokenizer, messages: list[dict], **kwargs) -> str:
    """What ``apply_chat_template`` renders for ``messages`` as Ollama would prompt with them: the generation
    prompt after a system / user message, the last assistant message continued; the tokenizer's own BOS left out."""
    last = messages[-1]["role"] == "assistant"
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=not last,
                                         continue_final_message=last, **kwargs)
    bos = tokenizer.bos_token if adds_bos(tokenizer) else ""
    return text[len(bos):] if bos and text.startswith(bos) else text


def _probes(max_len: int = 5):
    """Role orders Ollama can pass a template (no role twice in a row), up to ``max_len`` messages; those with a
    user message first (they fix the layout), then the rest (a template may refuse or rearrange those)."""
    orders = [r for n in range(1, max_len + 1) for r in itertools.product(ROLES, repeat=n)
              if all(a != b for a, b in itertools.pairwise(r))]
    return [r for r in orders if "user" in r], [r for r in orders if "user" not in r]


def _marker(i: int) -> str:
    return f"fastkitprobe{i}x"


def _cut(text: str, n: int) -> list[str] | None:
    """``text`` cut at the markers of ``n`` messages: ``n + 1`` gaps, or None if a marker is missing / repeated."""
    gaps, pos = [], 0
    for i in range(n):
        marker = _marker(i)
        at = text.find(marker, pos)
        if at < 0 or text.count(marker) != 1:
            return None
        gaps.append(text[pos:at])
        pos = at + len(marker)
    return gaps + [text[pos:]]


Key = tuple[str, str, str, bool, bool]
"""``(previous role or START, role or END, next role or END, a user message came before, the previous message is
the chat's first)``."""


def _keys(roles: tuple[str, ...]) -> list[Key]:
    """The key of the text before each message, then of the text after the last one."""
    full = (START, *roles, END, END)
    return [(full[i], full[i + 1], full[i + 2], "user" in full[:i + 1], i == 1) for i in range(len(roles) + 1)]


def _probe(tokenizer, roles: tuple[str, ...], gaps: dict[Key, str]) -> str | None:
    """Adds the texts around a probe chat of ``roles`` to ``gaps``; returns why it cannot (None: added, or the
    template refuses the chat, which leaves nothing to match)."""
    try:
        text = reference(tokenizer, [_m(r, _marker(i)) for i, r in enumerate(roles)])
    except Exception:
        return None
    cut = _cut(text, len(roles))
    if cut is None:
        return f"it does not write each message once, in order ({' / '.join(roles)} chat)"
    new = dict(zip(_keys(roles), cut, strict=True))
    for key, gap in new.items():
        if gaps.get(key, gap) != gap:
            return (f"what it writes before a {key[1] or 'generation prompt'} after a {key[0] or 'chat start'} "
                    f"depends on more than the turns around it ({' / '.join(roles)} chat)")
    gaps.update(new)
    return None


def chat_layout(tokenizer) -> tuple[ChatLayout | None, str]:
    """``(layout, notes)`` when the chat template is text between messages that depends only on the roles around
    it (and on a user turn having come before); ``notes``: chats without a user message it writes otherwise.
    ``(None, why not)`` when it cannot be written so."""
    gaps: dict[Key, str] = {}
    with_user, without = _probes()
    for roles in with_user:
        if why := _probe(tokenizer, roles, gaps):
            return None, "the chat template: " + why
    if not gaps:
        return None, "the chat template renders no chat of system / user / assistant messages"
    odd = [roles for roles in without if _probe(tokenizer, roles, gaps)]
    note = (f"a chat without a user message (e.g. {' / '.join(odd[0])}): the chat template rearranges or drops its "
            "messages; the TEMPLATE writes them in order" if odd else "")
    return ChatLayout(gaps, tokenizer.bos_token if adds_bos(tokenizer) else "", note), ""


# ----------------------------------------------------------------------------- what Ollama does with it


def collate(messages: list[dict]) -> list[dict]:
    """Ollama's ``template.collate``: consecutive messages of one role (tool messages aside) become one, their
    contents joined by a blank line, before the template sees them."""
    out: list[dict] = []
    for m in messages:
        if out and out[-1]["role"] == m["role"] and m["role"] != "tool":
            out[-1] = _m(m["role"], out[-1]["content"] + "\n\n" + m["content"])
        else:
            out.append(dict(m))
    return out


def render(layout: ChatLayout, messages: list[dict]) -> str:
    """What :func:`go_template` renders in Ollama for ``messages`` (the Python twin of the Go template)."""
    messages = collate(messages)
    roles = tuple(m["role"] for m in messages)
    gaps = [layout.gaps.get(key, "") for key in _keys(roles)]
    return "".join(g + m["content"] for g, m in zip(gaps, messages, strict=False)) + gaps[-1]


def differences(tokenizer, layout: ChatLayout) -> list[str]:
    """Each way Ollama's rendering with the TEMPLATE differs from ``apply_chat_template``, in words ([] if none)."""
    found = [layout.note] if layout.note else []
    for name, chat in SHAPES.items():
        try:
            want = reference(tokenizer, chat)
        except Exception:  # no trained rendering to match; Ollama renders it all the same
            found.append(f"{name}: the chat template refuses this chat (apply_chat_template raises)")
            continue
        if render(layout, chat) != want:
            found.append(f"{name}: " + ("Ollama joins consecutive messages of one role with a blank line before "
                                        "the template runs" if collate(chat) != chat else "renders differently"))
    base = SHAPES["multi-turn + system"]
    for (what, content), role in itertools.product(_CONTENTS, ROLES):
        chat = [_m(m["role"], content if m["role"] == role else m["content"]) for m in base]
        try:
            if render(layout, chat) != reference(tokenizer, chat):
                found.append(f"{'an' if role == 'assistant' else 'a'} {role} message that {what}: the Jinja "
                             "rewrites its content, Go cannot")
        except Exception:
            continue
    source = _template_source(tokenizer)
    if "tools" in source:
        found.append("tools: tool definitions, tool calls and tool results are not written by this TEMPLATE")
    if "strftime_now" in source:
        found.append("the date the template takes from the clock is the export day's, fixed in the TEMPLATE")
    return found


def _template_source(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return template.get("default", "") if isinstance(template, dict) else template


# --------------------------------------------------------------------------------------- the Go template


def go_string(text: str) -> str:
    """``text`` as a Go string literal (text/template's): quotes, backslashes and control characters escaped."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch in "\n\t\r":
            out.append({"\n": "\\n", "\t": "\\t", "\r": "\\r"}[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _emit(text: str) -> str:
    return "{{ " + go_string(text) + " }}" if text else ""


def _condition(next_role: str, seen: bool, first: bool) -> str:
    """Go: the next role is ``next_role``, a user turn came before (or not), the previous message is the first."""
    return f'(and (eq $next "{next_role}") {_flag("$seen", seen)} {_flag("$first", first)})'


def _flag(name: str, value: bool) -> str:
    return name if value else f"(not {name})"


def _gap(layout: ChatLayout, prev: str, role: str) -> str:
    """The Go text before a ``role`` message after ``prev``: one literal, or a choice on the next role and on a
    user turn having come before, where the template writes different texts for those."""
    texts = {k[2:]: g for k, g in layout.gaps.items() if k[:2] == (prev, role)}
    if not texts:
        return ""
    common = max(set(texts.values()), key=list(texts.values()).count)
    if len(set(texts.values())) == 1:
        return _emit(common)
    out, branch = [], "if"
    for text in sorted(set(texts.values()) - {common}):
        cases = [_condition(*case) for case, t in sorted(texts.items()) if t == text]
        out.append(f"{{{{ {branch} or {' '.join(cases)} false }}}}{_emit(text)}")
        branch = "else if"
    return "".join(out) + "{{ else }}" + _emit(common) + "{{ end }}"


def _chain(arms: list[tuple[str, str]]) -> list[str]:
    """``{{ if c1 }}t1{{ else if c2 }}t2...{{ end }}`` over the arms with a text, one arm a line."""
    arms = [(c, t) for c, t in arms if t]
    lines = [f"{{{{- {'if' if i == 0 else 'else if'} {c} }}}}{t}" for i, (c, t) in enumerate(arms)]
    return lines + (["{{- end }}"] if arms else [])


def go_template(layout: ChatLayout) -> str:
    """The TEMPLATE: Ollama's ``.Messages`` (``.Role``, ``.Content``), the layout's text before each content (chosen
    on the previous, this and the next role, and on a user turn before), the text after the last message.
    Every literal is a Go string, so no whitespace trimming can touch the template's own text."""
    lines = ['{{- $prev := "" }}{{- $seen := false }}{{- $first := false }}', "{{- range $i, $m := .Messages }}",
             '{{- $rest := slice $.Messages $i }}{{- $next := "" }}{{- $first = eq $i 1 }}',
             "{{- if gt (len $rest) 1 }}{{- $next = (index $rest 1).Role }}{{- end }}"]
    lines += _chain([(f'and (eq $prev "{p}") (eq $m.Role "{r}")', _gap(layout, p, r))
                     for p in (START, *ROLES) for r in ROLES])
    lines += ["{{- $m.Content }}", '{{- if eq $m.Role "user" }}{{- $seen = true }}{{- end }}',
              "{{- $prev = $m.Role }}", "{{- end }}"]
    lines += ["{{- $first = eq (len .Messages) 1 }}"]
    lines += _chain([(f'eq $prev "{r}"', _gap(layout, r, END)) for r in ROLES])
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- Modelfile


def stop_tokens(tokenizer) -> list[str]:
    """The special tokens the chat template closes an assistant turn with (``<|im_end|>``, ``<|eot_id|>``,
    ``<end_of_turn>``...), read off a rendered two-turn chat, then the EOS token; what Ollama must stop on."""
    marker = "FASTKIT_ASSISTANT_TURN"
    specials = sorted({t for t in getattr(tokenizer, "all_special_tokens", []) if t}, key=len, reverse=True)
    stops: list[str] = []
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "FASTKIT_USER_TURN"},
                                              {"role": "assistant", "content": marker},
                                              {"role": "user", "content": "v"}], tokenize=False)
    except Exception:  # no template, or one that refuses this chat: EOS alone
        text = ""
    opening = text.split("FASTKIT_USER_TURN", 1)[0]  # what opens a turn (BOS, <|im_start|>...) is no stop
    rest = text.split(marker, 1)[1] if marker in text else ""
    while rest:
        rest = rest.lstrip("\n ")
        hit = next((t for t in specials if rest.startswith(t)), None)
        if hit is None or hit in opening:
            break
        stops.append(hit)
        rest = rest[len(hit):]
    eos = getattr(tokenizer, "eos_token", None)
    if eos and eos not in stops:
        stops.append(eos)
    return stops


_WARNED: set[tuple] = set()
"""(chat template, difference) already warned about: an export writes and verifies each Modelfile."""


def modelfile(tokenizer, gguf_name: str) -> str | None:
    """An Ollama ``Modelfile`` for ``gguf_name`` (same folder): FROM, the TEMPLATE (:func:`go_template`), what
    still differs from ``apply_chat_template`` as ``#`` lines, and PARAMETER stop for each of the template's end
    tokens (:func:`stop_tokens`). None, with a warning saying why, when the chat template cannot be written as a
    TEMPLATE (Ollama would otherwise guess one: server/create.go)."""
    layout, why = chat_layout(tokenizer) if _template_source(tokenizer) else (None, "the tokenizer has no template")
    if layout is None:
        logger.warning("fastkit: no Ollama Modelfile written: %s, so Ollama's Go template cannot render what the "
                       "model was trained on (without a TEMPLATE, Ollama substitutes the nearest built-in one)", why)
        return None
    found = differences(tokenizer, layout)
    for d in found:
        if (template_key := (_template_source(tokenizer), d)) not in _WARNED:  # once per template and process
            _WARNED.add(template_key)
            logger.info("fastkit: the Modelfile's TEMPLATE renders chats as you trained except for %s (noted in the "
                        "Modelfile). Only chats of that shape differ: for those, run the GGUF in llama.cpp (the chat "
                        "template is in the file) or chat with the LoRA (fastkit chat)", d)
    template = go_template(layout)
    lines = [f"FROM ./{gguf_name}", *(f"# differs from apply_chat_template: {d}" for d in found),
             f'TEMPLATE """{template}"""']
    lines += [f"PARAMETER stop {json.dumps(t)}" for t in stop_tokens(tokenizer)]
    return "\n".join(lines) + "\n"


__all__ = ["SHAPES", "ChatLayout", "adds_bos", "chat_layout", "collate", "differences", "go_string", "go_template",
           "modelfile", "reference", "render", "stop_tokens"]
