"""``fastkit plan <shipped model>`` without torch or transformers (issue 41: the CLI answers in <= 3 s).

The shipped models' shapes (fastkit/plan/shapes.json) must be what the meta-device count gives now, so a plan of
a shipped Hub id equals the plan of the same config counted the slow way, component by component.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from fastkit.errors import FastkitError
from fastkit.plan import plan, read_config, shape_of
from fastkit.plan.configs import KNOWN_CONFIGS, SHAPES, ShippedConfig, known_config, lora_dim_counts, shipped_config
from fastkit.plan.source import _check_decoder

ROOT = Path(__file__).resolve().parents[1]
REGENERATE = 'python -c "from fastkit.plan.source import write_shapes; write_shapes()"'


def test_every_shipped_config_has_a_shipped_shape():
    assert sorted(json.loads(SHAPES.read_text())) == sorted(KNOWN_CONFIGS)
    assert all(isinstance(shipped_config(name), ShippedConfig) for name in KNOWN_CONFIGS)


@pytest.mark.parametrize("name", list(KNOWN_CONFIGS))
def test_the_shipped_shape_is_what_the_meta_device_count_gives_now(name):
    config = read_config(known_config(name))
    _check_decoder(config)  # the planner skips this check for shipped configs: each one passes it
    counted, shipped = asdict(shape_of(config)), asdict(shipped_config(name).shape)
    counted["lora_dims"], shipped["lora_dims"] = lora_dim_counts(counted["lora_dims"]), \
        lora_dim_counts(shipped["lora_dims"])
    assert shipped == counted, f"{name}: shapes.json is stale; write it anew with {REGENERATE}"


@pytest.mark.parametrize("options", [dict(gpu="t4"), dict(gpu="t4", load_in_4bit=True, max_seq_length=4096),
                                     dict(gpu="spark", offload=True), dict(gpu="cpu", r=None),
                                     dict(gpu="t4", kind="dpo", load_in_4bit=True),
                                     dict(gpu="rtx-24g", kind="grpo", max_seq_length=1024, host_lm_head=True)])
@pytest.mark.parametrize("name", ["HuggingFaceTB/SmolLM2-135M-Instruct", "Qwen/Qwen3-14B", "google/gemma-3-4b-it",
                                  "Qwen/Qwen3-30B-A3B", "openai/gpt-oss-20b", "unsloth/Qwen3-14B-bnb-4bit"])
def test_a_shipped_plan_equals_the_plan_of_the_same_config_counted(name, options):
    fast, counted = plan(name, **options), plan(known_config(name), **options)
    assert (fast.components, fast.host, fast.total, fast.fits, fast.advice) == \
        (counted.components, counted.host, counted.total, counted.fits, counted.advice)
    assert fast.inputs == counted.inputs


def test_the_longest_rows_of_a_shipped_plan_equal_the_counted_ones():
    fast, counted = plan("Qwen/Qwen3-8B", gpu="l4", max_seq_length="max"), \
        plan(known_config("Qwen/Qwen3-8B"), gpu="l4", max_seq_length="max")
    assert fast.longest == counted.longest and fast.components == counted.components


def test_a_shipped_plan_keeps_the_context_check():
    with pytest.raises(FastkitError, match="longer than the model's context"):
        plan("microsoft/Phi-3-mini-4k-instruct", max_seq_length=8192)


def test_a_local_folder_named_like_a_shipped_model_is_read_not_the_shipped_shape(tmp_path, monkeypatch):
    folder = tmp_path / "Qwen" / "Qwen3-14B"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(dict(known_config("Qwen/Qwen3-0.6B"))))
    monkeypatch.chdir(tmp_path)
    assert plan("Qwen/Qwen3-14B", gpu="t4").total == plan("Qwen/Qwen3-0.6B", gpu="t4").total


def test_dtype_by_name_or_by_torch_dtype_plans_the_same():
    by_name = plan("Qwen/Qwen3-1.7B", gpu="a100-80", dtype="bfloat16")
    assert by_name.components == plan("Qwen/Qwen3-1.7B", gpu="a100-80", dtype=torch.bfloat16).components
    assert by_name.components != plan("Qwen/Qwen3-1.7B", gpu="a100-80", dtype="float32").components
    for bad in ("int8", torch.int8, True, "bf16"):
        with pytest.raises(FastkitError, match="dtype must be torch.float16"):
            plan("Qwen/Qwen3-1.7B", dtype=bad)


PROBE = """
import sys
from fastkit.cli import main
codes = [main(["plan", "Qwen/Qwen3-14B", "--gpu", "t4", "--4bit"]),
         main(["plan", "HuggingFaceTB/SmolLM2-135M-Instruct", "--gpu", "T4", "--max-seq-length", "max"]),
         main(["plan", "Qwen/Qwen3-4B", "--gpu", "t4", "--max-seq-length", "16384"]),
         main(["plan", "Qwen/Qwen3-8B", "--kind", "grpo", "--gpu", "l4", "--max-seq-length", "1024", "--4bit"])]
print("codes", codes, "imported", sorted(m for m in ("torch", "transformers", "trl", "peft", "datasets")
                                         if m in sys.modules))
"""


def test_fastkit_plan_of_a_shipped_model_imports_neither_torch_nor_transformers():
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last == "codes [0, 0, 0, 0] imported []", last  # Qwen3-4B at 16k in 16-bit: fits with fastkit's defaults
    assert "This is fastkit's default set-up" in proc.stdout  # the load-time decision (auto_plan), shipped too
    assert "Qwen/Qwen3-14B: predicted peak" in proc.stdout and proc.stderr.strip() == "", proc.stderr[-2000:]
