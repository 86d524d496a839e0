"""The benchmarks' shared layer: one device rule for --gpu, quick runs never write into assets/, one formatter."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import common
from fastkit.cli import main as cli_main
from fastkit.errors import GPUOnlyError
from fastkit.units import fmt_bytes

BENCHES = ["packed", "offload", "moe", "sft"]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize("name", BENCHES)
def test_gpu_without_cuda_raises_before_any_work(name, no_cuda, tmp_path):
    module = importlib.import_module(f"benchmarks.{name}")
    with pytest.raises(GPUOnlyError, match="--gpu needs a CUDA GPU"):
        module.main(["--gpu", "--quick", "--out", str(tmp_path)])
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("name", BENCHES)
def test_cli_prints_the_gpu_error_and_exits_2(name, no_cuda, capsys):
    assert cli_main(["bench", name, "--gpu", "--quick"]) == 2  # `fastkit bench` from a clone
    err = capsys.readouterr().err
    assert "--gpu needs a CUDA GPU" in err and "Traceback" not in err


def test_device_is_cpu_without_gpu_flag():
    assert common.bench_device(False) == torch.device("cpu")


def test_quick_runs_never_write_into_assets(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    path = common.write_outputs("demo", "| a |\n|---|\n| 1 |\n", quick=True)
    assert not (tmp_path / common.ASSETS).exists() and path.exists() and path.name == "bench_demo.md"
    assert tmp_path not in path.parents
    assert f"written: {path}" in capsys.readouterr().out
    again = common.write_outputs("demo", "| a |\n|---|\n| 2 |\n", quick=True)  # a table rewritten after a case
    assert again == path and "| 2 |\n\nMade by commit " in path.read_text()
    shutil.rmtree(path.parent)
    given = common.write_outputs("demo", "x\n", quick=True, out=tmp_path / "given")
    assert given == tmp_path / "given" / "bench_demo.md"
    with pytest.raises(ValueError, match="--out"):  # a full run writes only where it is told
        common.write_outputs("demo", "x\n")
    assert not (tmp_path / common.ASSETS).exists()


def test_table_is_written_before_the_plot_and_survives_a_missing_matplotlib(tmp_path, capsys):
    # The GPU machine has no matplotlib: the plot fails, the table must already be there and the bench succeed.
    def plot():
        assert (tmp_path / "bench_demo.md").read_text().startswith("| a |\n\nMade by")  # table first
        raise ImportError("No module named 'matplotlib'")

    path = common.write_outputs("demo", "| a |\n", plot, out=tmp_path)
    assert path.read_text().startswith("| a |\n") and not (tmp_path / "bench_demo.png").exists()
    assert "plot skipped (No module named 'matplotlib')" in capsys.readouterr().out


def test_every_table_ends_with_the_commit_machine_date_and_command(tmp_path, monkeypatch):
    import re
    import subprocess

    monkeypatch.setattr("sys.argv", ["benchmarks", "demo", "--quick"])
    text = common.write_outputs("demo", "| a |\n|---|\n| 1 |\n", quick=True, out=tmp_path).read_text()
    last = text.strip().splitlines()[-1]
    head = subprocess.run(["git", "-C", str(Path(common.__file__).parents[1]), "rev-parse", "--short=10", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    assert last.startswith(f"Made by commit {head}") and "`python -m benchmarks demo --quick`" in last
    assert re.search(r" on .+\(\w+ \w+, \d+ CPUs\), \d{4}-\d\d-\d\d \d\d:\d\d UTC", last), last


def test_one_byte_formatter_and_one_table_renderer():
    assert fmt_bytes(3 * 2**29) == "1.50 GiB" and fmt_bytes(12 * 2**20) == "12.0 MiB"
    assert fmt_bytes(24 * 1024) == "24.0 KiB" and fmt_bytes(512) == "512 B"
    assert fmt_bytes(16 * 1024, "MiB") == "0.0 MiB" and fmt_bytes(0) == "0"
    assert fmt_bytes(None, unknown="n/a (CPU)") == "n/a (CPU)"
    table = common.markdown_table(["name", "ms"], [["a", 1.5], ["b", 2]], align="lr")
    assert table == "| name | ms |\n|---|---:|\n| a | 1.5 |\n| b | 2 |\n"


def test_every_bench_parses_the_shared_arguments():
    for name in BENCHES:
        module = importlib.import_module(f"benchmarks.{name}")
        with pytest.raises(SystemExit) as info:
            module.main(["--help"])
        assert info.value.code == 0


def test_python_dash_m_fastkit_is_the_command():
    out = subprocess.run([sys.executable, "-m", "fastkit", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "usage: fastkit" in out.stdout and "quickstart" in out.stdout and "bench" in out.stdout


def test_times_carry_min_and_spread_and_ratios_their_range():
    assert common.fmt_ms([10.0, 12.0, 11.0]) == "11.0 (min 10.0, spread 18%, noisy)"
    assert common.fmt_ms([100.0, 101.0, 102.0]) == "101.0 (min 100.0, spread 2%)"
    assert common.fmt_ms([5.0]) == "5.0 (1 rep)"
    # interleaved pairs: per-repeat ratios 2.0, 1.5, 3.0 -> median 2.0, range 1.5..3.0
    assert common.fmt_ratio([2.0, 3.0, 6.0], [1.0, 2.0, 2.0]) == "2.00× [1.50–3.00]"
    assert common.fmt_ratio([0.9, 1.2], [1.0, 1.0]).endswith("[0.90–1.20] within noise")
    assert common.fmt_ratio([2.0], [1.0]) == "2.00× [1 rep: no spread]"


def test_load_line_records_load_cpus_and_a_verdict(monkeypatch):
    monkeypatch.setattr(common.os, "getloadavg", lambda: (3.5, 2.0, 1.0))
    monkeypatch.setattr(common, "_busy_others", lambda: "no other process busy")
    monkeypatch.setattr(common.os, "cpu_count", lambda: 2)
    line = common.load_line()
    assert line.startswith("load avg 3.50/2.00/1.00 on 2 CPUs") and "UNDER LOAD" in line
    monkeypatch.setattr(common.os, "getloadavg", lambda: (1.0, 1.3, 1.0))  # the previous bench run, decaying
    assert common.load_line().endswith(": quiet")
    monkeypatch.setattr(common, "_busy_others", lambda: "1 other process(es) busy (>20% CPU: python 99%)")
    assert "UNDER LOAD" in common.load_line()
    assert "load avg" in common.machine_line(torch.device("cpu"))


def test_time_budget_skips_with_a_note(monkeypatch):
    budget = common.TimeBudget(100.0)
    monkeypatch.setattr(budget, "elapsed", lambda: 90.0)
    assert budget.allows(5.0) and not budget.allows(20.0)
    budget.skip("L=8 T=16384")
    assert budget.note() == "Skipped for time (budget 100 s): L=8 T=16384.\n"
    assert common.TimeBudget(None).allows(1e9) and common.TimeBudget(None).note() == ""


@pytest.mark.parametrize("name", BENCHES)
def test_a_spent_budget_skips_cases_but_still_writes_the_table(name, tmp_path):
    module = importlib.import_module(f"benchmarks.{name}")
    assert module.main(["--quick", "--budget-s", "0.01", "--out", str(tmp_path)]) == 0  # spent at import
    table = (tmp_path / f"bench_{name}.md").read_text()
    assert "Skipped for time (budget 0 s)" in table and "load avg" in table


def test_a_full_run_without_out_is_refused_before_any_work(capsys):
    from benchmarks import packed

    with pytest.raises(SystemExit) as info:  # not --quick, no --out: argparse's exit 2, nothing measured
        packed.main(["--budget-s", "0.01"])
    assert info.value.code == 2 and "--out is required" in capsys.readouterr().err


def test_python_dash_m_benchmarks_is_the_command():
    out = subprocess.run([sys.executable, "-m", "benchmarks", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "usage: python -m benchmarks" in out.stdout and "packed" in out.stdout
