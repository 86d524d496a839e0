"""``fastkit train``: the notebooks' run from a terminal (twin, offline), and help text without reST markup."""

from __future__ import annotations

import logging

import pytest

from fastkit import cli


def _help(capsys, *argv) -> str:
    with pytest.raises(SystemExit):
        cli.main([*argv, "--help"])
    return capsys.readouterr().out


@pytest.mark.parametrize("argv", [(), ("train",), ("plan",), ("quickstart",), ("bench", "packed"), ("bench", "sft")])
def test_help_has_no_rst_markup(capsys, argv):
    text = _help(capsys, *argv)
    assert "``" not in text and ":func:" not in text and ":mod:" not in text, text
    if not argv:
        assert "train" in text and "quickstart" in text and "plan" in text


def test_train_defaults_are_the_notebooks(monkeypatch):
    """fastkit train's resolved defaults are the per-model notebooks' parameters cell (the same TrainOptions and
    LoraOptions fields; the CLI's own defaults are fastkit.cli.config.CLI_DEFAULTS)."""
    import runpy
    from pathlib import Path

    from fastkit.cli.config import resolve

    monkeypatch.delenv("FASTKIT_TWIN", raising=False)
    build = runpy.run_path(str(Path(__file__).resolve().parents[1] / "notebooks" / "_build.py"))
    spec = next(s for s in build["SPECS"] if s.filename.startswith("01_"))
    scope: dict = {}
    exec(build["_parameters"](spec)[1].source, scope)
    cli_default = resolve({"model": "m", "data": "sample"}, None)
    notebook, cli_train = scope["options"].to_dict(), cli_default.train.to_dict()
    for name in ("max_seq_length", "max_steps", "epochs", "batch_size", "gradient_accumulation_steps",
                 "learning_rate", "save_steps", "eval_split", "report_to", "drop_long", "drop_invalid", "seed",
                 "warmup_steps", "lr_scheduler_type"):
        assert notebook[name] == cli_train[name], (name, notebook[name], cli_train[name])
    assert scope["lora"].lora_r == cli_default.lora.lora_r


def test_steps_and_epochs_are_exclusive(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--model", "m", "--data", "d", "--steps", "3", "--epochs", "1"])
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.slow
def test_train_twin_end_to_end(tmp_path, caplog):
    out = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="fastkit"):
        rc = cli.main(["train", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct", "--twin", "--data", "quickstart",
                       "--steps", "3", "--max-seq-length", "128", "--lora-r", "4", "--checkpointing", "off",
                       "--save-steps", "3", "--output-dir", str(out), "--gguf", "q8_0"])
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert rc == 0, text
    assert "One run: 3 steps × 1 packed row of ≤128 tokens" in text
    assert "(new run)" in text and "training finished at step 3/3" in text
    assert (out / "lora" / "adapter_model.safetensors").is_file() and (out / "checkpoint-3").is_dir()
    assert any((out / "gguf").glob("*.gguf")) and (out / "gguf" / "Modelfile").is_file()
    # the resolved options, saved beside the checkpoints, read back by --config to the same options
    import yaml

    saved = yaml.safe_load((out / "fastkit_config.yaml").read_text())
    assert saved["max_steps"] == 3 and saved["lora_r"] == 4 and saved["checkpointing"] == "off", saved
    assert saved["gguf"] == ["q8_0"] and saved["twin"] is True and saved["data"] == "quickstart"


def test_a_twin_run_exports_and_chats_from_the_command_line(tmp_path, capsys, caplog):
    """A --twin run's adapters name the twin they were trained on (fastkit-twin:<model>), so ``fastkit export`` and
    ``fastkit chat`` rebuild that same deterministic twin offline instead of stopping at "no base model"; the export
    says each Modelfile difference once and draws no GGUF reader bar."""
    import json

    out = tmp_path / "run"
    assert cli.main(["train", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct", "--twin", "--data", "sample",
                     "--steps", "2", "--max-seq-length", "128", "--output-dir", str(out)]) == 0
    config = json.loads((out / "lora" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "fastkit-twin:HuggingFaceTB/SmolLM2-135M-Instruct"
    assert "tiny random twin of `HuggingFaceTB/SmolLM2-135M-Instruct`" in (out / "README.md").read_text()
    capsys.readouterr()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fastkit"):
        assert cli.main(["export", "--model", str(out / "lora"), "--gguf", "q8_0"]) == 0
    printed = capsys.readouterr()
    assert "GGUF q8_0:" in printed.out and "Converting and de-quantizing" not in printed.err + printed.out
    warned = [r.getMessage() for r in caplog.records if "Modelfile TEMPLATE differs" in r.getMessage()]
    assert len(warned) == len(set(warned)), warned
    assert cli.main(["chat", "--model", str(out / "lora"), "--prompt", "hi", "--max-new-tokens", "4"]) == 0
