"""Smoke test: ``fastkit bench moe --quick`` runs every path side by side and writes its table and plot."""

from __future__ import annotations

from benchmarks import moe as bench


def test_bench_moe_quick_writes_table_and_plot(tmp_path, capsys):
    assert bench.main(["--quick", "--shapes", "qwen3-30b-a3b", "--out", str(tmp_path)]) == 0
    table = (tmp_path / "bench_moe.md").read_text()
    for impl in bench.IMPLS + bench.LORA_VARIANTS:
        assert f"| {impl} |" in table
    assert (tmp_path / "bench_moe.png").stat().st_size > 0
    assert "syncs fwd/bwd" in capsys.readouterr().out
