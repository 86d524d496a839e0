"""The round-4 hostile table (issue 31): saves that never delete what they did not write, rotation, resume
completeness, data splits and lengths, adapters, docs. Rows live in tests/hostile_round4.py."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.hostile_round4 import all_rows
from tests.test_hostile_inputs import Case, Ctx, run_case

ROWS = all_rows()
CASES = [case for _, case in ROWS]
SURFACES = {case.id: surface for surface, case in ROWS}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_round4(case: Case, tmp_path, monkeypatch, caplog, capsys, tokenizer):
    run_case(case, Ctx(tmp_path, monkeypatch, caplog, tokenizer, capsys))


def test_round4_rows_by_surface():
    counts = Counter(SURFACES.values())
    print(dict(counts))
    assert len({c.id for c in CASES}) == len(CASES), "duplicate row ids"
    assert set(counts) == {"saves", "rotation", "resume", "data", "adapters", "docs"}, counts
    assert len(CASES) >= 150, len(CASES)
