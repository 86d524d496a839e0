"""``fastkit dpo``, ``fastkit kto`` and ``fastkit grpo`` (issue 45): the same options system as ``fastkit train``
(flags, ``--config``, ``--print-config``, ``--help`` / ``--help-all``), the same preflight (bad input: exit 2 naming
the flag or file, before the model loads, on every rank), and 2 steps on a twin with the shipped data, saving a
verified adapter."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fastkit.cli import main

ROOT = Path(__file__).resolve().parents[1]
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
TWIN = ["--model", MODEL, "--twin", "--steps", "2", "--max-seq-length", "128", "--lora-r", "4"]


def _trained_lora(folder: Path) -> dict:
    """The saved adapter's tensors; at least one LoRA B moved off its zero start (the steps trained it)."""
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "adapter_model.safetensors"))
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in tensors.items()), sorted(tensors)[:4]
    return tensors


def _log(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records)


def test_dpo_config_file_trains_two_steps_and_saves_a_verified_adapter(tmp_path, caplog, capsys):
    out = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {MODEL}\ntwin: true\ndata: sample\nsteps: 5\nmax-seq-length: 128\nlora-r: 4\n"
                      f"beta: 0.2\noutput-dir: {out}\ntrl:\n  max_grad_norm: 0.5\n")
    with caplog.at_level(logging.INFO, logger="fastkit"):
        rc = main(["dpo", "--config", str(config), "--steps", "2"])  # the flag wins over the file's steps: 5
    assert rc == 0, _log(caplog)
    text = _log(caplog)
    assert "training finished at step 2/2" in text and "save_lora verified" in text, text
    assert "LoRA adapters:" in capsys.readouterr().out
    _trained_lora(out / "lora")
    saved = (out / "fastkit_config.yaml").read_text()
    assert saved.startswith("# The options of this run (fastkit dpo --config FILE reads them back).")
    assert "max_steps: 2\n" in saved and "beta: 0.2\n" in saved and "trl: {max_grad_norm: 0.5}" in saved, saved
    # the run's saved file reads back to the same options (--print-config writes them in the same form)
    assert main(["dpo", "--config", str(out / "fastkit_config.yaml"), "--print-config"]) == 0
    assert capsys.readouterr().out.split("\n", 1)[1] == saved.split("\n", 1)[1]


REWARDS_PY = """def alternate(completions, **kwargs):
    return [float(i % 2) for i in range(len(completions))]  # completions of a prompt differ: advantages != 0
"""


def test_grpo_flags_train_two_steps_and_save_a_verified_adapter(tmp_path, caplog):
    """A shipped reward by name and one of the user's by path/to/file.py:function."""
    out = tmp_path / "run"
    (tmp_path / "my_rewards.py").write_text(REWARDS_PY)
    with caplog.at_level(logging.INFO, logger="fastkit"):
        rc = main(["grpo", *TWIN, "--max-seq-length", "256", "--data", "sample", "--num-generations", "2",
                   "--max-completion-length", "8", "--reward", f"format,{tmp_path / 'my_rewards.py'}:alternate",
                   "--lr", "1e-3", "--output-dir", str(out)])
    text = _log(caplog)
    assert rc == 0, text
    assert "training finished at step 2/2" in text and "save_lora verified" in text, text
    assert "format_reward" in text and "alternate" in text, text  # the two named rewards scored the steps
    _trained_lora(out / "lora")


@pytest.mark.parametrize("command, extra", [
    ("dpo", ["--beta", "0.3", "--drop-long", "--trl", "loss_type=[ipo]", "--max-grad-norm", "0.5"]),
    ("grpo", ["--reward", "format,exact_answer", "--num-generations", "3", "--temperature", "0.7",
              "--trl", "top_k=5"]),
    ("kto", ["--undesirable-weight", "1.5", "--drop-long", "--trl", "loss_type=apo_zero_unpaired", "--max-grad-norm",
             "0.5"]),
])
def test_print_config_round_trips(tmp_path, capsys, command, extra):
    assert main([command, "--model", "m", "--data", "sample", "--steps", "3", "--lr", "1e-4", *extra,
                 "--print-config"]) == 0
    first = capsys.readouterr().out
    file = tmp_path / "run.yaml"
    file.write_text(first)
    assert main([command, "--config", str(file), "--print-config"]) == 0
    assert capsys.readouterr().out == first
    assert first.startswith(f"# fastkit {command} --config FILE reproduces this run.")
    assert "max_steps: 3\n" in first and "learning_rate: 0.0001\n" in first
    if command == "grpo":
        assert "reward: [format, exact_answer]\n" in first and "trl: {top_k: 5}" in first, first
    elif command == "kto":
        assert "undesirable_weight: 1.5\n" in first and "batch_size: 2\n" in first and "packing" not in first
        assert "trl: {loss_type: apo_zero_unpaired, max_grad_norm: 0.5}\n" in first, first
    else:
        assert "drop_long: true\n" in first and "trl:\n  loss_type: [ipo]\n  max_grad_norm: 0.5\n" in first, first


def test_config_file_refuses_unknown_keys_and_trl_names_fastkit_sets(tmp_path, capsys):
    file = tmp_path / "run.yaml"
    file.write_text("model: m\ndata: sample\nlrr: 1e-4\n")
    assert main(["dpo", "--config", str(file), "--print-config"]) == 2
    assert f"--config {file}: unknown option 'lrr'; did you mean 'lr'?" in capsys.readouterr().err
    file.write_text("model: m\ndata: sample\ntrl:\n  learning_rate: 1e-4\n")
    assert main(["grpo", "--config", str(file), "--print-config"]) == 2
    assert "trl: learning_rate is set by fastkit's option learning_rate" in capsys.readouterr().err


BAD_PAIRS = '{"prompt": "Hi", "chosen": "a", "rejected": "b"}\n{"prompt": "Yo", "chosen": "x", "rejected": "x"}\n'
NO_ANSWER = '{"prompt": "What is 2 + 2?"}\n'
ONE_LABEL = '{"prompt": "Hi", "completion": "Hello!", "label": true}\n{"prompt": "Yo", "completion": "Hey", ' \
            '"label": true}\n'
BAD_LABEL = '{"prompt": "Hi", "completion": "Hello!", "label": 1}\n{"prompt": "Yo", "completion": "Hey", "label": 3}\n'
ASSISTANT_LAST = '{"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}], ' \
                 '"answer": "1"}\n'


@pytest.mark.parametrize("command, data, extra, said", [
    ("dpo", BAD_PAIRS, [], "--data {data} row 2: 'chosen' and 'rejected' are the same"),
    ("dpo", None, [], "--data {data}: '{data}' does not exist"),
    ("dpo", "sample", ["--trl", "lr_scheduler_type=bogus"], "trl.DPOConfig refuses the options: bogus"),
    ("kto", ONE_LABEL, [], "--data {data}: all 2 rows are desirable (label true)"),
    ("kto", BAD_LABEL, [], "--data {data} row 2 field 'label' must be true or false (or 1 / 0)"),
    ("kto", BAD_PAIRS, [], "--data {data} row 2: 'chosen' and 'rejected' are the same"),
    ("kto", "sample", ["--trl", "lr_scheduler_type=bogus"], "trl.KTOConfig refuses the options: bogus"),
    ("grpo", NO_ANSWER, [], "reward function 'exact_answer' needs the column 'answer', but --data {data} has"),
    ("grpo", ASSISTANT_LAST, [], "--data {data} row 1 field 'prompt' ends with an assistant message"),
    ("grpo", NO_ANSWER, ["--reward", "json:no_such_fn"], "--reward json:no_such_fn: 'json' has no function"),
    ("grpo", NO_ANSWER, ["--reward", "no_such_module_zz:fn"], "--reward no_such_module_zz:fn: cannot import"),
    ("grpo", "sample", ["--max-completion-length", "256"],
     "--max-completion-length 256 leaves no room for a prompt within --max-seq-length 128"),
])
def test_bad_input_exits_2_naming_it_before_the_model_loads(tmp_path, capsys, monkeypatch, command, data, extra,
                                                            said):
    from fastkit import FastModel

    def load(*args, **kwargs):
        raise AssertionError("the model loaded before the input was checked")

    monkeypatch.setattr(FastModel, "from_pretrained", load)
    path = tmp_path / "rows.jsonl"
    if data not in (None, "sample"):
        path.write_text(data)
    source = "sample" if data == "sample" else str(path)
    room = ["--max-completion-length", "16"] if command == "grpo" else []  # TWIN's 128 tokens: room for a prompt
    rc = main([command, *TWIN, *room, "--data", source, "--output-dir", str(tmp_path / "out"), *extra])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert f"fastkit {command}: " + said.format(data=source) in err, err


def test_bad_flag_values_exit_2_at_parse_time(capsys):
    for argv, said in ((["grpo", "--num-generations", "1"], "GRPO compares completions of the same prompt"),
                       (["grpo", "--reward", "format,nosuch"], "'nosuch' is neither a shipped reward"),
                       (["dpo", "--beta", "0"], "beta must be a positive"),
                       (["dpo", "--reward", "format"], "unrecognized arguments: --reward"),
                       (["kto", "--desirable-weight", "0"], "desirable_weight must be a positive"),
                       (["kto", "--packing"], "unrecognized arguments: --packing")):
        with pytest.raises(SystemExit) as stop:
            main([*argv, "--model", "m", "--data", "sample", "--print-config"])
        assert stop.value.code == 2 and said in capsys.readouterr().err, argv


@pytest.mark.parametrize("command", ["dpo", "kto", "grpo"])
def test_help_is_short_and_help_all_has_trl_fields(capsys, command):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    short = capsys.readouterr().out
    assert len(short.splitlines()) <= 90, len(short.splitlines())
    for flag in ("--model", "--data", "--steps", "--lr", "--beta", "--lora-r", "--twin", "--config",
                 "--print-config", "--help-all"):
        assert f"  {flag}" in short, flag
    assert "--max-grad-norm" not in short and "--max_steps" not in short
    with pytest.raises(SystemExit):
        main([command, "--help-all"])
    full = capsys.readouterr().out
    for flag in ("--max-grad-norm", "--trl NAME=VALUE", "--lora-dropout", "--save-steps"):
        assert f"  {flag}" in full, flag
    assert ("--num-generations" in short) == (command == "grpo")
    assert ("--desirable-weight" in short) == (command == "kto")


def _heavy_modules_after(argv: list[str]) -> list[str]:
    probe = ("import contextlib, io, json, sys\nfrom fastkit.cli import main\n"
             f"with contextlib.redirect_stdout(io.StringIO()):\n    try:\n        main({argv!r})\n"
             "    except SystemExit:\n        pass\n"
             "print(json.dumps([m for m in ('torch', 'trl', 'transformers', 'datasets') if m in sys.modules]))")
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # this checkout's fastkit
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, env=env, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", [["dpo", "--help"], ["grpo", "--model", "m", "--data", "sample", "--print-config"]])
def test_help_and_print_config_import_no_training_stack(argv):
    assert _heavy_modules_after(argv) == []


@pytest.mark.slow
def test_refusal_ends_every_rank_with_one_line(tmp_path):
    """Under torchrun the preflight's refusal on every rank: both exit 2, the main process prints the line once."""
    from tests.test_distributed import _exit_codes, _launch

    (tmp_path / "pairs.jsonl").write_text(BAD_PAIRS)
    proc = _launch(["fastkit", "dpo", *TWIN, "--data", "pairs.jsonl", "--output-dir", "out"], cwd=tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert output.count("fastkit dpo: --data pairs.jsonl row 2: 'chosen' and 'rejected' are the same") == 1, output
    codes = _exit_codes(output)
    assert 2 in codes and set(codes) <= {2, -15}, output[-3000:]
    assert "stands in for" not in output  # no rank loaded the model
