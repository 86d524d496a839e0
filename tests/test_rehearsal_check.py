"""tests/gpu/rehearsal_check.py: on the newer device image (datasets' pyarrow there), a bench-sft skipped for
want of TRL is a rehearsal problem; on the bare image it is the one allowed skip."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
import rehearsal_check  # noqa: E402


def _out(tmp_path: Path) -> Path:
    rows = [("gpu-tests", "ok"), ("bench-packed", "ok"), ("bench-offload", "ok"), ("bench-moe", "ok"),
            ("bench-sft", "skipped: needs TRL, and datasets does not import here (see above)")]
    lines = ["| step | result | time |", "|---|---|---|"] + [f"| {n} | {r} | 1 s of 2 s |" for n, r in rows]
    (tmp_path / "summary.md").write_text("\n".join(lines) + "\n")
    for name in ("packed", "offload", "moe"):
        (tmp_path / f"bench_{name}.md").write_text("table\n")
    return tmp_path


def test_skipped_trl_step_is_a_problem_only_where_trl_is_expected(tmp_path):
    out = _out(tmp_path)
    bare = [p for p in rehearsal_check.problems(out, 0) if p.startswith("step ")]
    newer = [p for p in rehearsal_check.problems(out, 0, expect_trl=True) if p.startswith("step ")]
    assert bare == []
    assert newer == ["step bench-sft: skipped: needs TRL, and datasets does not import here (see above)"]
