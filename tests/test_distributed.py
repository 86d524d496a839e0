"""Training across processes with the patches on: DDP and FSDP2 on gloo (2 CPU processes).

Gradients after one step equal one process seeing both ranks' packed rows, which shows the packed
metadata and the MoE routing stay per-rank correct (a metadata object leaking across ranks or rows
would mix documents and change the gradients).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.dist.common import build_model, packed_batch
from tests.helpers import assert_grads_close, forward_backward

ROOT = Path(__file__).resolve().parents[1]


def _torchrun(tmp_path, model_type, mode):
    out = tmp_path / f"{model_type}_{mode}.pt"
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "tests.dist.worker", "--model", model_type, "--mode", mode, "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(out)


def _reference(model_type):
    model = build_model(model_type)
    return model, forward_backward(model, **packed_batch(model_type, 0, 1)).grads


@pytest.mark.slow
@pytest.mark.parametrize("model_type, mode", [("llama", "ddp"), ("qwen3_moe", "ddp"), ("llama", "fsdp2")])
def test_two_process_gradients_equal_single_process(tmp_path, model_type, mode):
    result = _torchrun(tmp_path, model_type, mode)
    model, ref = _reference(model_type)
    assert "packing" in result["active"]
    if model_type == "qwen3_moe":
        assert "moe" in result["active"]
    # fp32; DDP/FSDP average two partial sums where the reference sums once: rounding-level differences.
    assert_grads_close(result["grads"], ref, rtol=1e-4, atol=1e-6)
