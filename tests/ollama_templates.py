"""The Modelfile TEMPLATE of each chat-template family, rendered by Go's text/template as Ollama renders it
(tests/ollama/render.go), against ``apply_chat_template``: the shared code of tests/test_modelfile.py and of the
table in docs/export.md (``python -m tests.ollama_templates`` rewrites it).

Families: the real SmolLM2-135M-Instruct tokenizer (its template adds a default system prompt), the twins' ChatML
and Gemma formats, and TRL's copies of the real Qwen2.5 / Qwen3 / Llama-3 / Llama-3.1 / Phi-3 / Gemma / Gemma 3
templates (``trl/chat_templates``) on a twin vocabulary holding each family's special tokens.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from fastkit.export.gguf import modelfile as mf
from fastkit.families.twins import CHATML_TEMPLATE

GO_SOURCE = Path(__file__).parent / "ollama" / "render.go"
DOC = Path(__file__).parent.parent / "docs" / "export.md"


def _trl_template(name: str) -> str:
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text(encoding="utf-8")


def _styled(template: str, specials: list[str], bos: str | None = None, eos: str | None = None,
            adds_bos: bool = False):
    """A twin byte-level BPE tokenizer with a family's special tokens, BOS / EOS and chat template."""
    from tokenizers import processors

    from fastkit.families.twins import twin_bpe_tokenizer

    tok = twin_bpe_tokenizer("gpt-2")
    tok.add_special_tokens({"additional_special_tokens": specials})
    if bos:
        tok.bos_token = bos
    if eos:
        tok.eos_token = eos
    if adds_bos:
        bid = tok.convert_tokens_to_ids(bos)
        tok._tokenizer.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, bid)])
    tok.chat_template = template
    return tok


def _smollm2():
    from transformers import AutoTokenizer

    from fastkit.quickstart.weights import smollm2_135m_instruct

    return AutoTokenizer.from_pretrained(smollm2_135m_instruct())


def _gemma(template: str | None = None):
    from fastkit.families.twins import twin_spm_tokenizer

    tok = twin_spm_tokenizer()
    if template:
        tok.chat_template = template
    return tok


_CHATML = ["<|im_start|>", "<|im_end|>"]
_LLAMA3 = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
_PHI3 = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
FAMILIES = {  # label -> (tokenizer, the template's end tokens then EOS: the PARAMETER stop list)
    "SmolLM2-135M-Instruct": (_smollm2, ["<|im_end|>"]),
    "ChatML (twins)": (lambda: _styled(CHATML_TEMPLATE, _CHATML), ["<|im_end|>"]),
    "Qwen2.5": (lambda: _styled(_trl_template("qwen2_5"), _CHATML, eos="<|im_end|>"), ["<|im_end|>"]),
    "Qwen3": (lambda: _styled(_trl_template("qwen3"), _CHATML, eos="<|im_end|>"), ["<|im_end|>"]),
    "Llama-3": (lambda: _styled(_trl_template("llama3"), _LLAMA3, "<|begin_of_text|>", "<|eot_id|>", True),
                ["<|eot_id|>"]),
    "Llama-3.1": (lambda: _styled(_trl_template("llama3_1"), _LLAMA3, "<|begin_of_text|>", "<|eot_id|>", True),
                  ["<|eot_id|>"]),
    "Phi-3": (lambda: _styled(_trl_template("phi3"), _PHI3, eos="<|endoftext|>"), ["<|end|>", "<|endoftext|>"]),
    "Gemma (twins)": (_gemma, ["<end_of_turn>", "<eos>"]),
    "Gemma": (lambda: _gemma(_trl_template("gemma")), ["<end_of_turn>", "<eos>"]),
    "Gemma 3": (lambda: _gemma(_trl_template("gemma3")), ["<end_of_turn>", "<eos>"]),
}


@cache
def tokenizer(label: str):
    return FAMILIES[label][0]()


def go_binary() -> Path | None:
    """tests/ollama/render.go built once into a temp dir (None without a Go toolchain)."""
    go = shutil.which("go")
    if go is None:
        return None
    return _build(go)


@cache
def _build(go: str) -> Path:
    out = Path(tempfile.mkdtemp(prefix="fastkit-go-"))
    env = dict(os.environ, GOCACHE=str(out / "cache"), GOPATH=str(out / "gopath"), GO111MODULE="off",
               GOFLAGS="", CGO_ENABLED="0")
    subprocess.run([go, "build", "-o", str(out / "render"), str(GO_SOURCE)], check=True, env=env,
                   capture_output=True, timeout=600)
    return out / "render"


def go_render(binary: Path, template: str, chats: list[list[dict]]) -> list[str]:
    """Each chat rendered by ``template`` as Ollama would (collate, .Messages) in Go's text/template."""
    done = subprocess.run([str(binary)], input=json.dumps({"template": template, "chats": chats}),
                          capture_output=True, text=True, check=True, timeout=120)
    out = json.loads(done.stdout)
    if isinstance(out, dict):
        raise AssertionError(f"Go refused the template: {out['error']}")
    return out


def template_of(modelfile_text: str) -> str:
    """The TEMPLATE as Ollama's Modelfile parser reads it: between the triple quotes, unescaped."""
    return modelfile_text.split('TEMPLATE """', 1)[1].split('"""\n', 1)[0]


def cells(label: str, binary: Path) -> dict[str, str]:
    """Shape -> "equal" / what differs, for one family's Modelfile TEMPLATE rendered in Go."""
    tok = tokenizer(label)
    text = mf.modelfile(tok, "m.gguf")
    if text is None:
        return {name: "no Modelfile" for name in mf.SHAPES}
    got = go_render(binary, template_of(text), list(mf.SHAPES.values()))
    out = {}
    for (name, chat), rendered in zip(mf.SHAPES.items(), got, strict=True):
        try:
            want = mf.reference(tok, chat)
        except Exception:
            out[name] = "Jinja refuses"
            continue
        if rendered == want:
            out[name] = "equal"
        else:
            out[name] = "merged by Ollama" if mf.collate(chat) != chat else "**differs**"
    return out


def table(binary: Path) -> str:
    head = "| family | " + " | ".join(mf.SHAPES) + " | stop |"
    lines = [head, "|" + "---|" * (len(mf.SHAPES) + 2)]
    for label in FAMILIES:
        row = cells(label, binary)
        stops = ", ".join("`" + t.replace("|", "\\|") + "`" for t in mf.stop_tokens(tokenizer(label)))
        lines.append(f"| {label} | " + " | ".join(row.values()) + f" | {stops} |")
    return "\n".join(lines)


def write_table(binary: Path, doc: Path = DOC) -> None:
    begin, end = "<!-- ollama table: begin -->", "<!-- ollama table: end -->"
    text = doc.read_text()
    head, rest = text.split(begin, 1)
    doc.write_text(head + begin + "\n" + table(binary) + "\n" + end + rest.split(end, 1)[1])


if __name__ == "__main__":
    found = go_binary()
    if found is None:
        raise SystemExit("no Go toolchain (apt-get install golang-go)")
    write_table(found)
    print(table(found))
