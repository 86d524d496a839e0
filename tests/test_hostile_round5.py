"""The round-5 hostile table (issue 44): one rule per ambiguity, limits from the model in hand, no raw library
error. Rows live in tests/hostile_round5.py (its docstring lists each class with the rule chosen)."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.hostile_round5 import all_rows
from tests.test_hostile_inputs import Case, Ctx, run_case

ROWS = all_rows()
CASES = [case for _, case in ROWS]
CLASSES = {case.id: cls for cls, case in ROWS}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_round5(case: Case, tmp_path, monkeypatch, caplog, capsys, tokenizer):
    run_case(case, Ctx(tmp_path, monkeypatch, caplog, tokenizer, capsys))


def test_round5_rows_by_class():
    counts = Counter(CLASSES.values())
    assert len({c.id for c in CASES}) == len(CASES), "duplicate row ids"
    assert set(counts) == {"duplicates", "names", "rows", "limits", "raw errors", "tool calls",
                           "model state", "files and flags"}, counts
    assert len(CASES) >= 30, len(CASES)
