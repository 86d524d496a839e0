"""The command line answers fast and reads one set of names (issue 41).

- ``fastkit train --help`` shows the options people use, each once, in at most 90 lines; ``--help-all`` every one
  (TRL's SFTConfig fields included);
- ``--help``, ``--print-config`` and ``import fastkit`` import neither torch nor TRL (what made them take ~13 s):
  checked in a fresh interpreter through ``sys.modules``, not with a clock;
- a --config file takes every spelling a flag takes (``steps``, ``lr``, ``lora-r``), ``--print-config`` writes the
  field names, and two spellings of one option in one file are refused.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fastkit.cli import main

HEAVY = ("torch", "trl", "transformers", "datasets", "peft")


def _modules_after(code: str) -> list[str]:
    """The heavy packages a fresh interpreter has imported after running ``code`` (stdout silenced)."""
    probe = (f"import contextlib, io, json, sys\nwith contextlib.redirect_stdout(io.StringIO()):\n"
             f"    try:\n        {code}\n    except SystemExit:\n        pass\n"
             f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_fastkit_imports_no_torch():
    assert _modules_after("import fastkit, fastkit.cli, fastkit.data, fastkit.export, fastkit.training") == []


@pytest.mark.parametrize("argv", [
    ["train", "--help"],
    ["train", "--model", "m", "--data", "sample", "--steps", "3", "--lr", "1e-4", "--print-config"],
])
def test_help_and_print_config_import_no_training_stack(argv):
    assert _modules_after(f"from fastkit.cli import main; main({argv!r})") == []


def test_help_shows_the_usual_options_once(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    assert len(text.splitlines()) <= 90, len(text.splitlines())
    for flag in ("--model", "--data", "--steps", "--epochs", "--lr", "--batch-size", "--grad-accumulation",
                 "--lora-r", "--lora-alpha", "--4bit", "--eval-split", "--resume", "--gguf", "--config",
                 "--help-all"):
        assert f"  {flag}" in text, flag
    assert "--max_steps" not in text and "--learning-rate" not in text  # one spelling each
    assert "--max-grad-norm" not in text  # SFTConfig's fields: --help-all


def test_help_all_lists_every_option(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help-all"])
    text = capsys.readouterr().out
    for flag in ("--max-grad-norm", "--lora-dropout", "--save-steps", "--warmup-steps", "--steps"):
        assert f"  {flag}" in text, flag


def test_a_trl_field_still_parses_without_help(tmp_path, capsys):
    rc = main(["train", "--model", "m", "--data", "sample", "--max-grad-norm", "0.5", "--print-config"])
    assert rc == 0 and "max_grad_norm: 0.5" in capsys.readouterr().out


def test_config_file_takes_the_flags_spellings(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("model: m\ndata: sample\nsteps: 3\nlr: 1e-4\nlora-r: 8\ngrad-accumulation: 2\n"
                      "max-grad-norm: 0.5\n4bit: false\n")
    assert main(["train", "--config", str(config), "--print-config"]) == 0
    text = capsys.readouterr().out
    for line in ("max_steps: 3", "learning_rate: 0.0001", "lora_r: 8", "gradient_accumulation_steps: 2",
                 "load_in_4bit: false", "max_grad_norm: 0.5"):
        assert line in text, line
    assert "\nsteps:" not in text and "\nlr:" not in text  # the canonical names are written


def test_two_spellings_of_one_option_in_a_file_are_refused(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("model: m\ndata: sample\nsteps: 3\nmax_steps: 5\n")
    assert main(["train", "--config", str(config), "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "max_steps" in err and "keep one of them" in err
