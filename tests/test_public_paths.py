"""Every import path users are shown keeps working when modules move.

The ``from fastkit... import ...`` / ``import fastkit...`` lines of README.md, docs/*.md and the notebooks run
here one by one, and so do the old paths of modules moved in the round-3 / round-4 restructures (served by
``fastkit._MOVED``: the old path is the very module now at the new one).
"""

from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path

import pytest

import fastkit

REPO = Path(__file__).resolve().parents[1]
_IMPORT = re.compile(r"^\s*(from\s+fastkit(?:\.\w+)*\s+import\s+[\w\s,()]+?|import\s+fastkit(?:\.\w+)*)\s*(?:#.*)?$")

# Old paths users imported (README / docs before the moves) -> what they were imported for.
OLD_PATHS = (
    "from fastkit.twins import twin, twin_config, twin_tokenizer, tiny_config",
    "from fastkit.census import check_family, self_check",
    "from fastkit.trainer import ZeroSyncSFTTrainer",
    "from fastkit.chat_template import add_chat_template, has_chat_template",
    "from fastkit.linear_4bit import quantize_linears_4bit",
    "from fastkit.training import fit, make_trainer, run_coverage",  # the module became a package
    "import fastkit.cli",  # the module became a package
    # round 4: the GGUF writer's modules moved into the package fastkit.export.gguf
    "from fastkit.export.gguf import write_gguf, merged_parameters, QUANTS, QUANTIZATIONS, LLAMA_CPP_QUANTS, WRITTEN",
    "from fastkit.export.gguf import quantize_with_llama_cpp, check_weights, num_experts, save_gguf",
    "import fastkit.export.gguf as ge",  # the old module's names as attributes
    "from fastkit.export.gguf_vocab import PRE_TOKENIZERS, pre_tokenizer_name, restore_pre_tokenizer",
    "from fastkit.export.gguf_spm import check_spm, spm_layout",
    "from fastkit.export import gguf_moe, gguf_hybrid, gguf_more",
    "from fastkit.export.modelfile import modelfile, stop_tokens",
    "from fastkit.export import modelfile",
    "from fastkit.export.quants import QUANTS, K_QUANTS",
    # round 5: the loader split by room (its names kept), the several-processes code and the test seams moved
    "from fastkit.loader import FastModel, LoadReport, enable_checkpointing, prepare_kbit_training, report",
    "from fastkit.loader import check_target_modules, meta_model, Quantization",
    "from fastkit import ranks",
    "from fastkit.ranks import agreed, is_main, world_size, OtherRankFailed",
    "from fastkit.launcher import launch",
    "from fastkit.testing import OffloadTestConfig",
)


def _text_sources() -> dict[str, str]:
    out = {}
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        out[path.relative_to(REPO).as_posix()] = path.read_text()
    for path in sorted((REPO / "notebooks").glob("*.ipynb")):
        cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
        out[path.relative_to(REPO).as_posix()] = "\n".join("".join(c["source"]) for c in cells)
    return out


def import_lines(text: str) -> list[str]:
    """The fastkit import statements of ``text``, one per line (parenthesized name lists on one line only)."""
    found = []
    for line in text.splitlines():
        line = line.strip().strip("`").strip()
        m = _IMPORT.match(line)
        if m and "(" not in m.group(1):
            found.append(" ".join(m.group(1).split()))
    return found


def _shown() -> list[tuple[str, str]]:
    return sorted({(stmt, where) for where, text in _text_sources().items() for stmt in import_lines(text)})


SHOWN = _shown()


def test_the_scan_finds_the_documented_entrance():
    statements = {s for s, _ in SHOWN}
    assert "from fastkit import FastModel" in statements
    assert any(s.startswith("from fastkit.training import") for s in statements)
    assert import_lines("    from fastkit.x import a, b  # note\nfrom os import path\n`import fastkit.y`") == [
        "from fastkit.x import a, b", "import fastkit.y"]


@pytest.mark.parametrize("statement, where", SHOWN, ids=[f"{w}: {s}" for s, w in SHOWN])
def test_documented_import_works(statement, where):
    exec(statement, {})  # noqa: S102 - the statement is a fastkit import line of the repository's own docs


@pytest.mark.parametrize("statement", OLD_PATHS)
def test_old_path_still_imports(statement):
    exec(statement, {})  # noqa: S102 - a fixed fastkit import line above


@pytest.mark.parametrize("old, new", sorted(fastkit._MOVED.items()))
def test_an_old_path_is_the_moved_module_itself(old, new):
    assert importlib.import_module(old) is importlib.import_module(new)
    assert sys.modules[new].__spec__.name == new  # the module keeps its own identity


def test_the_old_gguf_module_names_are_the_writers():
    import fastkit.export.gguf as package
    from fastkit.export.gguf import quants, save, writer

    assert package.write_gguf is writer.write_gguf and package.QUANTS is quants.QUANTS
    assert package.save_gguf is save.save_gguf
    assert importlib.import_module("fastkit.export").save_gguf is save.save_gguf


def test_the_loader_keeps_get_peft_model_and_the_ranks_attribute():
    from fastkit.distributed import ranks
    from fastkit.loader import FastModel
    from fastkit.training.lora import get_peft_model

    assert FastModel.get_peft_model is get_peft_model  # the notebook API, its body beside LoraOptions
    assert fastkit.ranks is ranks and fastkit.launch is importlib.import_module("fastkit.distributed.launcher").launch


def test_every_top_level_name_resolves():
    for name in fastkit.__all__:
        assert getattr(fastkit, name) is not None, name
