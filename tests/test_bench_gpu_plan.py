"""The device run's plan (tests/gpu/gpu_run.py), checked on CPU: it fits its time and file limits, and every
bench it starts accepts its argv and, without CUDA, stops with one clear GPUOnlyError message (exit 2)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from benchmarks.__main__ import main as bench_main

ROOT = Path(__file__).resolve().parents[1]


def _gpu_run():
    spec = importlib.util.spec_from_file_location("gpu_run", ROOT / "tests" / "gpu" / "gpu_run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_run = _gpu_run()


def test_step_caps_leave_room_for_a_rerun_and_results_fit():
    caps = [secs for _, secs in gpu_run.STEPS]
    assert sum(caps) <= 420, f"step caps add up to {sum(caps)} s: a rerun would not fit the 15-minute budget"
    files = gpu_run.result_files()
    assert len(files) <= gpu_run.MAX_FILES == 8 and len(set(files)) == len(files)
    benches = [name[6:] for name, _ in gpu_run.STEPS if name.startswith("bench-")]
    assert sorted(benches) == ["moe", "offload", "packed", "sft"]
    assert {f"bench_{b}.md" for b in benches} <= set(files)


def test_every_bench_gets_a_budget_inside_its_cap(tmp_path):
    steps = gpu_run.plan(tmp_path / "out", tmp_path / "bench")
    assert [s[0] for s in steps] == [name for name, _ in gpu_run.STEPS]
    for name, secs, argv in steps:
        if name.startswith("bench-"):
            budget = float(argv[argv.index("--budget-s") + 1])
            assert 0 < budget <= secs - 10, f"{name}: budget {budget} s leaves no room for imports in {secs} s"
            assert "--gpu" in argv and argv[argv.index("--out") + 1] == str(tmp_path / "bench" / name[6:])


@pytest.mark.parametrize("name", ["packed", "offload", "moe", "sft"])
def test_each_planned_bench_parses_its_argv_and_fails_cleanly_without_cuda(name, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = next(a for n, _, a in gpu_run.plan(tmp_path / "out", tmp_path / "bench") if n == f"bench-{name}")
    assert argv[1:4] == ["-m", "benchmarks", name]
    assert bench_main(argv[3:]) == 2  # argparse errors exit 2 as well: the message below tells them apart
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("benchmarks: --gpu needs a CUDA GPU"), err
    assert not (tmp_path / "bench").exists()  # stopped before any work
