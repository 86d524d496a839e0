"""Smoke test of `fastkit bench packed --quick` (numbers are never asserted, only that it measures and writes)."""

from __future__ import annotations

import pytest

from benchmarks.packed import main


@pytest.mark.slow  # ~10 s on an idle 2-core CPU, ~60 s when the machine is shared
def test_bench_packed_quick_writes_table_and_plot(tmp_path, capsys):
    assert main(["--quick", "--out", str(tmp_path)]) == 0
    table = (tmp_path / "bench_packed.md").read_text()
    assert (tmp_path / "bench_packed.png").stat().st_size > 0
    assert table in capsys.readouterr().out
    rows = [line.split("|") for line in table.splitlines() if line.startswith("| 2 | 128 |")]
    paths = {r[4].strip(): r for r in rows}
    assert set(paths) == {"transformers", "fastkit", "per-layer metadata"}
    assert paths["fastkit"][8].strip() == "0"  # syncs per step
    assert paths["transformers"][8].strip() != "0"
    assert paths["fastkit"][9].strip() == "0"  # no mask bytes
    assert "MiB" in paths["transformers"][9]
    assert "(1 rep)" in paths["fastkit"][5]  # one repetition: no spread claimed
    assert "not meaningful on CPU" in table  # the time model is a GPU model
    # the hybrid row (qwen3_5 twin): fastkit packed vs plain transformers on padded batches, same documents
    hybrid = {r[3].strip(): r for r in (line.split("|") for line in table.splitlines()) if len(r) == 12}
    assert {"transformers, padded batches", "fastkit, packed"} <= set(hybrid), sorted(hybrid)
    assert hybrid["fastkit, packed"][8].strip() == "0"  # syncs per step
    loss = {p: float(hybrid[p][10]) for p in ("transformers, padded batches", "fastkit, packed")}
    assert abs(loss["fastkit, packed"] - loss["transformers, padded batches"]) < 1e-4  # the same loss: exact
