"""Committed bench tables stay true where they are deterministic: the host-sync columns of assets/bench_moe.md
(the real layer shape) and assets/bench_moe_quick.md (the quick profile's shapes) equal what the quick profile
counts now (SyncCounter on the same paths). Eager's count depends on how many experts the tokens hit, so on the
shape: it is compared exactly in the quick table and only checked to be the largest in the real-shape one;
every other path's count is shape-free (0, the loop's 1 read-back, the fallback's 2 per direction)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
MOE = ROOT / "assets" / "bench_moe.md"
MOE_QUICK = ROOT / "assets" / "bench_moe_quick.md"


def committed_syncs(text: str) -> dict[tuple[str, str], tuple[int, int]]:
    """``(shape, path) -> (fwd, bwd)`` from the routing table: rows of a table with a ``path`` and a ``syncs fwd/bwd``
    column whose path is one of the routing paths (``benchmarks.moe.IMPLS``; the 4-bit table has its own)."""
    from benchmarks.moe import IMPLS

    out = {}
    header = None
    for line in text.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
            continue
        if set(cells[0]) <= {"-"} or "path" not in header or "syncs fwd/bwd" not in header:
            continue
        if cells[header.index("path")] not in IMPLS:
            continue
        fwd, bwd = (int(x) for x in re.findall(r"\d+", cells[header.index("syncs fwd/bwd")])[:2])
        out[(cells[header.index("shape")], cells[header.index("path")])] = (fwd, bwd)
    return out


def quick_syncs(shape_name: str, paths: list[str]) -> dict[str, tuple[int, int]]:
    """What the quick profile counts for ``paths`` at ``shape_name``'s quick shape."""
    from benchmarks.moe import QUICK, SHAPES, _count_syncs
    from benchmarks.moe_layer import experts_module, inputs

    shape = dict(SHAPES[shape_name], **QUICK[shape_name])
    module = experts_module(shape, torch.float32, "cpu")
    h, idx, w = inputs(module, 16, shape["num_experts_per_tok"], torch.float32, "cpu")
    return {p: _count_syncs(module, h, idx, w, p) for p in paths}


@pytest.mark.parametrize("path", [MOE, MOE_QUICK], ids=lambda p: p.name)
def test_committed_moe_sync_column_matches_the_quick_run(path):
    table = committed_syncs(path.read_text(encoding="utf-8"))
    assert table, f"no routing table with a syncs column in {path}"
    quick = path == MOE_QUICK
    for shape in {s for s, _ in table}:
        paths = [p for s, p in table if s == shape]
        assert "fastkit" in paths and "grouped_mm" in paths
        now = quick_syncs(shape, [p for p in paths if quick or p != "eager"])
        for path, counts in now.items():
            assert table[(shape, path)] == counts, f"{shape} {path}: committed {table[(shape, path)]}, now {counts}"
        if "eager" in paths and not quick:
            assert table[(shape, "eager")][0] > max(c[0] for c in now.values())
