"""fastkit/registry/ (the package) is the one table of family facts, read at call time.

- no fastkit file outside the table compares a model type with a literal (``model_type == "gpt_oss"``,
  ``config.model_type in ("llama", "mistral")``): an AST scan over fastkit/ fails on any;
- a row added (or changed) at run time reaches the 4-bit decisions (the loader's refusal before loading, and
  ``quantize_experts``' refusal on the model) and the looped-experts routing, which read the table when they run.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from fastkit import _hf, registry
from fastkit.errors import FastkitError
from fastkit.families.twins import twin, twin_config

ROOT = Path(__file__).resolve().parents[1] / "fastkit"

# Literals that spell a model type but compare something else (permanent, each with its reason).
NOT_MODEL_TYPES: dict[tuple[str, str], str] = {
    ("export/gguf/vocab.py", "gpt2"): "GGUF's tokenizer.ggml.model (the tokenizer kind), not a config.model_type",
}


def _strings(node: ast.AST) -> list[str]:
    """The string literals ``node`` is: a constant, or a tuple / list / set of constants."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def model_type_literals(source: str, known: set[str]) -> list[tuple[int, str]]:
    """``(line, code)`` of every comparison of a model type with a literal: an operand that mentions
    ``model_type`` against string literals, or any operand against a literal that is a table model type;
    also ``<...model_type...>.startswith("...")``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            literals = [s for o in operands for s in _strings(o)]
            typed = any("model_type" in ast.unparse(o) for o in operands if not _strings(o))
            if literals and (typed or set(literals) & known):
                found.append((node.lineno, ast.unparse(node)))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("startswith", "endswith") and "model_type" in ast.unparse(node.func.value)
              and any(_strings(a) for a in node.args)):
            found.append((node.lineno, ast.unparse(node)))
    return found


def _allowed(rel: str, code: str) -> bool:
    return any(rel == f and repr(lit) in code for (f, lit) in NOT_MODEL_TYPES)


@pytest.mark.parametrize("snippet", [
    'if config.model_type == "gpt_oss": pass',
    'if model_type in ("llama", "mistral"): pass',
    'ok = cfg.model_type not in {"qwen2_moe"}',
    'x = kind == "dbrx"',  # a table model type compared with anything
    'ok = config.model_type.startswith("qwen")',
])
def test_the_scan_flags(snippet):
    assert model_type_literals(snippet, set(registry.MODEL_TABLE)), snippet


def test_the_scan_allows_what_is_not_a_model_type_literal():
    ok = 'a = facts.looped_forward == ""\nb = name in ("q_proj", "k_proj")\nc = model_type in MODEL_TABLE'
    assert model_type_literals(ok, set(registry.MODEL_TABLE)) == []


def test_no_model_type_literal_outside_the_table():
    known = set(registry.MODEL_TABLE)
    hits = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("registry/"):  # the table and the row facts beside it
            continue
        hits += [f"{rel}:{line}: {code}" for line, code in model_type_literals(path.read_text(), known)
                 if not _allowed(rel, code)]
    assert hits == [], "family facts belong in fastkit/registry/ rows:\n" + "\n".join(hits)


# --------------------------------------------------------------------------- rows read at call time


def test_a_row_changed_at_run_time_reaches_the_4bit_decisions(monkeypatch):
    from fastkit.loader import _check_4bit
    from fastkit.patches.moe.nf4 import quantize_experts

    facts = registry.facts_for("qwen3_moe")
    _check_4bit(twin_config("qwen3_moe"), facts, torch.device("cpu"))  # MoE experts: 4-bit on any device
    assert quantize_experts(twin("qwen3_moe")) > 0
    no_layout = dataclasses.replace(facts, no_4bit_experts=("Qwen3MoeExperts",))
    monkeypatch.setitem(registry.MODEL_TABLE, "qwen3_moe", no_layout)
    with pytest.raises(FastkitError, match="Qwen3MoeExperts"):
        _check_4bit(twin_config("qwen3_moe"), no_layout, torch.device("cpu"))
    model = twin("qwen3_moe")
    assert any(_hf.has_no_4bit_layout(m) for m in model.modules())
    with pytest.raises(FastkitError, match="Qwen3MoeExperts"):
        quantize_experts(model)


def test_a_new_row_at_run_time_reaches_the_4bit_refusal(monkeypatch):
    from fastkit.loader import _check_4bit

    config = twin_config("olmoe")
    config.model_type = "olmoe_variant"  # a type fastkit has never heard of, then its row
    _check_4bit(config, None, torch.device("cuda"))  # no row: nothing refused before the device check
    monkeypatch.setitem(registry.MODEL_TABLE, "olmoe_variant",
                        registry.ModelFacts("olmoe_variant", moe=True, no_4bit_experts=("OlmoeExperts",)))
    with pytest.raises(FastkitError, match="OlmoeExperts"):
        _check_4bit(config, registry.facts_for("olmoe_variant"), torch.device("cuda"))


def test_a_composite_is_refused_4bit_by_its_text_row():
    """A Llama-4 checkpoint (``llama4``: vision + text) builds ``llama4_text``'s experts, which have no layout."""
    from transformers import Llama4Config

    from fastkit.loader import _no_4bit_experts

    assert registry.facts_for("llama4") is None
    assert _no_4bit_experts(Llama4Config()) == registry.facts_for("llama4_text").no_4bit_experts
    assert _no_4bit_experts(twin_config("qwen3_moe")) == ()


def test_looped_experts_follow_the_row_at_run_time(monkeypatch):
    from fastkit.patches.moe.patch import MoEExpertsPatch, looped_modules

    model = twin("dbrx")
    assert {type(m).__name__ for _, m, _ in looped_modules(model)} == {"DbrxExperts"}
    row = registry.facts_for("dbrx")
    monkeypatch.setitem(registry.MODEL_TABLE, "dbrx", dataclasses.replace(row, looped_experts=()))
    assert looped_modules(model) == []
    assert "no looped family" in MoEExpertsPatch(row).check(model)
    monkeypatch.setitem(registry.MODEL_TABLE, "dbrx_like",  # a new row naming the class: routed again
                        registry.ModelFacts("dbrx_like", moe=True, looped_experts=("DbrxExperts",),
                                            looped_forward="dbrx"))
    assert MoEExpertsPatch(row).check(model) is None
    assert [type(m).__name__ for _, m, _ in looped_modules(model)] == ["DbrxExperts"] * 2


def test_the_twin_layer_pattern_is_the_rows():
    assert twin_config("gpt_oss", num_hidden_layers=3).layer_types == [
        "sliding_attention", "full_attention", "sliding_attention"]
