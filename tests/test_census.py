"""The census (fastkit.families.census) over every causal-LM type of transformers; writes docs/coverage.md.

Each table row is its own test (``test_row_is_exact[<type>]``): a transformers upgrade that breaks a
family fails that named test. Every other type is checked too and listed with the reason it is not
patched. Sized for CI on 2 cores (~1 minute; nothing cached between runs).
"""

from __future__ import annotations

import dataclasses
import pathlib

import pytest
import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from fastkit import registry
from fastkit.families import census

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs" / "coverage.md"
ROWS = sorted(t for t, f in registry.MODEL_TABLE.items() if f.vision is None or f.text_config)
"""The rows the census proves on a causal-LM twin; a vision-language row (no causal LM to build) is proven on its
vision twin by tests/test_vision_patches.py."""
_RESULTS: dict[str, census.CensusResult] = {}


def _result(model_type: str) -> census.CensusResult:
    if model_type not in _RESULTS:
        torch.set_num_threads(1)  # tiny matmuls: threads cost more than they give on 2 cores
        _RESULTS[model_type] = census.check_family(model_type)
    return _RESULTS[model_type]


@pytest.mark.parametrize("model_type", ROWS)
def test_row_is_exact(model_type):
    """Every row passes every check (a packing=False row: MoE parity, revert and banner)."""
    res = _result(model_type)
    facts = registry.MODEL_TABLE[model_type]
    if not facts.packing:
        assert res.status == "refused" and {"unpacked", "revert", "banner"} <= set(res.passed), res.reason
        return
    assert res.exact, f"{model_type}: {res.failed}: {res.reason}"  # syncs: packing adds none (census "syncs")


def test_a_wrong_window_in_a_row_turns_the_census_red():
    row = dataclasses.replace(registry.MODEL_TABLE["gemma3_text"], sliding_window=False)
    res = census.check_family("gemma3_text", row=row)
    assert res.status == "wrong" and res.failed == "row" and "sliding_window" in res.reason


def test_attention_that_never_sees_the_metadata_is_refused():
    """nemotron's decoder layer drops **kwargs: the hard check counts attention calls without metadata."""
    res = census.check_family("nemotron")
    assert res.status == "refused" and res.failed == "calls", res.reason
    assert "without the packed metadata" in res.reason


def test_window_passed_as_none_is_full_attention():
    """exaone4 passes sliding_window=None on full layers but keeps a window attribute on every layer."""
    res = census.check_family("exaone4")
    assert res.exact, res.reason


def _num(x: float | None) -> str:
    return "" if x is None else f"{x:.1e}"


def coverage_markdown(results: list[census.CensusResult], transformers_version: str) -> str:
    """``docs/coverage.md``: one table row per type, what was checked and the numbers, or why not."""
    by: dict[str, list] = {"exact": [], "moe only": [], "wrong": []}  # "wrong" = a row that fails: must stay empty
    for r in results:
        in_table = registry.facts_for(r.model_type) is not None
        key = "moe only" if in_table and r.status == "refused" and "unpacked" in r.passed else r.status
        key = "exact, no row yet (not patched)" if key == "exact" and not in_table else key
        key = "not patched: a check failed" if key == "wrong" and not in_table else key
        by.setdefault(key, []).append(r)
        r.label = key
    lines = [
        "# Coverage: every causal-LM type in transformers",
        "",
        f"Written by `tests/test_census.py` (families/census.py) on transformers {transformers_version}: a tiny random "
        f"twin of each type (fp32, CPU), a packed row of {len(census.LENGTHS)} documents {list(census.LENGTHS)} "
        "against each document alone. **exact** = every check passed and the type has a row in "
        "`fastkit/registry/` (patched); "
        "any other status = not patched (no row, no patch), with the first check that failed. "
        f"Tolerances: logits {census.LOGIT_TOL:g} (relative to max(1, |logits|)), gradients {census.GRAD_TOL:g} "
        "per tensor.",
        "",
        "Checks: " + ", ".join(f"`{c}`" for c in census.CHECKS) + " (see `fastkit/families/census.py`).",
        "",
        "| status | types |", "|---|---|",
    ]
    lines += [f"| {k} | {len(v)} |" for k, v in by.items()]
    lines += ["", "| type | status | in table | checks passed | max abs dlogits | max rel dgrad | syncs | MoE | "
              "attention | why not |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: r.model_type):
        in_table = "yes" if registry.facts_for(r.model_type) is not None else ""
        why = f"{r.failed}: {r.reason}" if r.reason else ""
        why = why.replace("|", "/").replace("\n", " ")
        lines.append(f"| {r.model_type} | {r.label} | {in_table} | {' '.join(r.passed)} | {_num(r.logits)} | "
                     f"{_num(r.grads)} | {'' if r.syncs is None else r.syncs} | {'yes' if r.moe else ''} | "
                     f"{r.attention} | {why} |")
    return "\n".join(lines) + "\n"


def test_census_of_every_type_writes_coverage_md():
    types = sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(ROWS))
    results = [_result(t) for t in types]
    wrong_rows = [r.model_type for r in results if r.model_type in registry.MODEL_TABLE and not r.exact
                  and registry.MODEL_TABLE[r.model_type].packing]
    assert not wrong_rows, f"rows that fail the census: {wrong_rows}"
    exact = [r for r in results if r.exact]
    assert len(exact) >= 85, f"only {len(exact)} types exact"
    DOCS.parent.mkdir(exist_ok=True)
    DOCS.write_text(coverage_markdown(results, transformers.__version__))
