"""The device run's plan (tests/gpu/gpu_run.py), checked on CPU: it fits its time and file limits, and every
bench it starts accepts its argv and, without CUDA, stops with one clear GPUOnlyError message (exit 2)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.__main__ import main as bench_main

ROOT = Path(__file__).resolve().parents[1]


def _gpu_run():
    spec = importlib.util.spec_from_file_location("gpu_run", ROOT / "tests" / "gpu" / "gpu_run.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_run"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gpu_run = _gpu_run()


def test_step_caps_leave_room_for_a_rerun_and_results_fit():
    caps = [s.cap_s for s in gpu_run.STEPS]
    assert sum(caps) <= 420, f"step caps add up to {sum(caps)} s: a rerun would not fit the 15-minute budget"
    assert gpu_run.STEPS[0].name == "gpu-tests" and gpu_run.STEPS[0].cap_s <= 200  # `--only gpu-tests` ~3.5 min
    assert gpu_run.TEST_TIMEOUT_S <= gpu_run.STEPS[0].cap_s / 3  # one hung test cannot eat the step
    files = gpu_run.RESULT_FILES
    assert len(files) <= gpu_run.MAX_FILES == 8 and len(set(files)) == len(files)
    benches = [s.name.removeprefix("bench-") for s in gpu_run.STEPS if s.name.startswith("bench-")]
    assert sorted(benches) == ["moe", "offload", "packed", "sft"]
    assert {f"bench_{b}.md" for b in benches} <= set(files)


def test_gpu_tests_run_verbose_with_a_per_test_timeout(tmp_path):
    argv = gpu_run.step_argv(gpu_run.STEPS[0], tmp_path, tmp_path / "bench", cuda=True)
    assert "-v" in argv and argv[argv.index("--timeout") + 1] == str(gpu_run.TEST_TIMEOUT_S)
    assert any(pin.startswith("pytest-timeout==") for pin, _ in gpu_run.pins())  # --timeout needs the plugin


def test_every_bench_gets_a_budget_inside_its_cap(tmp_path):
    for step in gpu_run.STEPS[1:]:
        argv = gpu_run.step_argv(step, tmp_path, tmp_path / "bench", cuda=True)
        budget = float(argv[argv.index("--budget-s") + 1])
        assert 0 < budget <= step.cap_s - 10, f"{step.name}: budget {budget} s leaves no room in {step.cap_s} s"
        assert "--gpu" in argv and argv[argv.index("--out") + 1] == str(tmp_path / "bench" / step.name[6:])
        cpu = gpu_run.step_argv(step, tmp_path, tmp_path / "bench", cuda=False)  # the rehearsal's profile
        assert "--quick" in cpu and "--gpu" not in cpu


def test_refuses_unknown_steps_and_missing_wheels(tmp_path, monkeypatch):
    assert gpu_run.device_run(tmp_path / "a", ["gpu-test"]) == 3
    assert "unknown step(s) gpu-test" in (tmp_path / "a" / "summary.md").read_text()
    monkeypatch.setattr(gpu_run, "WHEELS", tmp_path / "no-wheels")
    assert gpu_run.device_run(tmp_path / "b", None) == 3
    text = (tmp_path / "b" / "summary.md").read_text()
    assert "refused before any step: no carried wheel for transformers==" in text


@pytest.mark.parametrize("name", ["packed", "offload", "moe", "sft"])
def test_each_planned_bench_parses_its_argv_and_fails_cleanly_without_cuda(name, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    step = next(s for s in gpu_run.STEPS if s.name == f"bench-{name}")
    argv = gpu_run.step_argv(step, tmp_path / "out", tmp_path / "bench", cuda=True)
    assert argv[1:4] == ["-m", "benchmarks", name]
    assert bench_main(argv[3:]) == 2  # argparse errors exit 2 as well: the message below tells them apart
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("benchmarks: --gpu needs a CUDA GPU"), err
    assert not (tmp_path / "bench").exists()  # stopped before any work
