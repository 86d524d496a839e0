"""Every ```python block of README.md and docs/*.md runs (issue 31): a doc example that does not run is a bug.

Blocks of one file run in order in one namespace, like notebook cells, in a temporary working folder
holding the files the examples name (:data:`GIVEN_FILES`). Offline, a Hub id loads as its tiny twin
(``FastModel.from_pretrained(..., twin=True)``: same architecture and code path, random weights), a
``make_trainer(..., max_steps=N)`` (or ``options=TrainOptions(max_steps=N)``) runs at most :data:`MAX_STEPS`
steps (the same code, a shorter run), and a
block that starts from a model (``save_gguf(model, tokenizer, ...)``) gets a twin's as ``model`` /
``tokenizer``. A block that cannot run here is marked with ``<!-- not run: reason -->`` on the line
before it; it is still compiled, and its imports are executed (so a renamed function still fails).
"""

from __future__ import annotations

import ast
import json
import os
import re
from pathlib import Path

import pytest

from fastkit import FastModel

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TWIN = "HuggingFaceTB/SmolLM2-135M-Instruct"
NOT_RUN = re.compile(r"<!--\s*not run:\s*(.+?)\s*-->")
GIVEN_FILES = {"my_chats.jsonl": "\n".join(json.dumps({"messages": [
    {"role": "user", "content": f"What is {i} plus {i}?"}, {"role": "assistant", "content": f"{2 * i}."}]})
    for i in range(8)) + "\n"}
"""Files the examples read, as a user would have them."""
MAX_STEPS = 3


def code_blocks(path: Path) -> list[tuple[int, str, str | None]]:
    """``(line, code, not-run reason or None)`` for each ```python block of ``path``."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i + 1
            end = next(j for j in range(start, len(lines)) if lines[j].strip() == "```")
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            marked = NOT_RUN.search(before)
            out.append((start + 1, "\n".join(lines[start:end]), marked.group(1) if marked else None))
            i = end
        i += 1
    return out


DOC_FILES = [p for p in DOCS if code_blocks(p)]


def test_the_docs_have_code_blocks_to_run():
    """The harness finds the blocks (a parser that finds none would pass every file)."""
    counted = {p.name: len(code_blocks(p)) for p in DOC_FILES}
    assert counted.get("README.md", 0) >= 1 and counted.get("export.md", 0) >= 1, counted
    assert sum(counted.values()) >= 4, counted


def _offline_loads(monkeypatch) -> None:
    """A Hub id (not a local path) loads as its twin; a local path loads for real."""
    real = FastModel.from_pretrained

    def from_pretrained(name_or_path, *args, **kwargs):
        if not os.path.exists(os.path.expanduser(str(name_or_path))):
            kwargs["twin"] = True
        return real(name_or_path, *args, **kwargs)

    monkeypatch.setattr(FastModel, "from_pretrained", staticmethod(from_pretrained))
    import fastkit.training

    make_trainer = fastkit.training.make_trainer

    def short_trainer(*args, **kwargs):
        if isinstance(kwargs.get("max_steps"), int):
            kwargs["max_steps"] = min(kwargs["max_steps"], MAX_STEPS)
        options = kwargs.get("options", args[3] if len(args) > 3 else None)
        if options is not None and isinstance(options.max_steps, int):  # make_trainer(..., options=TrainOptions(...))
            kwargs["options"], args = options.replace(max_steps=min(options.max_steps, MAX_STEPS)), args[:3]
        return make_trainer(*args, **kwargs)

    monkeypatch.setattr(fastkit.training, "make_trainer", short_trainer)


def _needs_a_model(code: str) -> bool:
    """The block uses ``model`` / ``tokenizer`` without loading one (it continues an earlier step)."""
    tree = ast.parse(code)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    loads = any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "from_pretrained"
                for n in ast.walk(tree))
    return bool(used & {"model", "tokenizer"}) and not loads


def _imports_only(code: str) -> str:
    tree = ast.parse(code)
    return ast.unparse([n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))])


@pytest.mark.slow
@pytest.mark.parametrize("doc", DOC_FILES, ids=[p.name for p in DOC_FILES])
def test_doc_code_blocks_run(doc: Path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name, text in GIVEN_FILES.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    _offline_loads(monkeypatch)
    namespace: dict = {"__name__": "__doc__"}
    for line, code, reason in code_blocks(doc):
        where = f"{doc.name}:{line}"
        compiled = compile(code, where, "exec")  # a SyntaxError names the file and line
        if reason is not None:
            exec(compile(_imports_only(code), where, "exec"), namespace)
            continue
        if _needs_a_model(code) and "model" not in namespace:
            namespace["model"], namespace["tokenizer"] = FastModel.from_pretrained(TWIN, max_seq_length=64, twin=True)
        exec(compiled, namespace)
