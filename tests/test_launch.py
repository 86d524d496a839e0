"""``fastkit.launch``: accelerate's notebook_launcher on 2 CPU processes (gloo), as a notebook would call it, run in a
fresh interpreter (the launcher forks it). Not tested: GPUs (Kaggle's 2 x T4), NCCL, a real Jupyter kernel."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
               TOKENIZERS_PARALLELISM="false")
    env.pop("FASTKIT_DASHBOARD", None)
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_launch_runs_a_function_on_two_processes_and_returns_rank0s_result(tmp_path):
    proc = _python("import fastkit\nfrom tests.dist.launch_fns import ranks_seen\n"
                   "print('DDP', fastkit.launch(ranks_seen, 10, num_processes=2))\n"
                   "print('FSDP', fastkit.launch(ranks_seen, 0, num_processes=2, fsdp=True))\n"
                   "print('ONE', fastkit.launch(ranks_seen, 5, num_processes=1))", ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "DDP (0, 2, 21.0, None)" in out  # rank 0 of 2; (0 + 10) + (1 + 10) over gloo
    assert "FSDP (0, 2, 1.0, 'true')" in out
    assert "ONE (0, 1, 5.0, None)" in out  # one process: called here, no process group


def test_launch_refuses_after_accelerate_state_was_made(tmp_path):
    proc = _python("import fastkit\nfrom fastkit import ranks\nranks.state()\n"
                   "from tests.dist.launch_fns import ranks_seen\nfastkit.launch(ranks_seen, 0, num_processes=2)", ROOT)
    assert proc.returncode != 0
    assert "fastkit.launch: accelerate's state was already made in this notebook" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_launch_trains_with_one_dashboard_and_one_save(tmp_path):
    proc = _python(f"import fastkit\nfrom tests.dist.launch_fns import train_twin\n"
                   f"print('RESULT', fastkit.launch(train_twin, {str(tmp_path)!r}, num_processes=2))", ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "RESULT ('finished', 2)" in out
    for line in ("fastkit: new run", "training finished", "save_lora verified"):
        assert out.count(line) == 1, (line, out[-3000:])
    assert "effective batch 2" in out
    assert (tmp_path / "lora/adapter_model.safetensors").is_file()
