"""The run is a class (issue 55): fastkit's trainers own what used to be done to them from outside (the dashboard
first among the callbacks, the model card as a method, ``train(resume=...)`` a fastkit run), and one frozen
``RunRecord`` holds the run's facts instead of ``trainer.fastkit_*`` attributes written by whoever had the trainer."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from fastkit import FastModel
from fastkit.dashboard import MetricsCallback
from fastkit.quickstart import quickstart_dataset
from fastkit.training import make_trainer
from fastkit.training.trainer import FastSFTTrainer, ZeroSyncSFTTrainer

FASTKIT = Path(__file__).resolve().parents[1] / "fastkit"
WRITES = re.compile(r"\btrainer\.fastkit_\w+\s*=(?!=)")
"""An ad-hoc ``trainer.fastkit_*`` attribute written (the run's facts live in ``trainer.run_record``)."""
REBOUND = re.compile(r"\btrainer\.(create_model_card|_calculate_rewards|_generate\w*|_compute_loss|_get_per_token_\w+)"
                     r"\s*=(?!=)")
"""A trainer method replaced on the instance (they are methods of fastkit's trainer classes now)."""


def test_no_fastkit_attribute_is_written_on_a_trainer_and_no_method_rebound():
    found = [f"{path.relative_to(FASTKIT.parent)}:{n}: {line.strip()}"
             for path in sorted(FASTKIT.rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if WRITES.search(line) or REBOUND.search(line)]
    assert not found, "\n".join(found)


def test_train_with_resume_is_a_fastkit_run_and_the_record_is_frozen(tmp_path, tokenizer):
    model, _ = FastModel.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct", max_seq_length=128, twin=True)
    model = FastModel.get_peft_model(model, r=4)
    train, _ = quickstart_dataset()
    trainer = make_trainer(model, tokenizer, train, max_steps=2, max_seq_length=128, output_dir=str(tmp_path),
                           dashboard="none")
    assert isinstance(trainer, FastSFTTrainer) and isinstance(trainer, ZeroSyncSFTTrainer)
    assert isinstance(trainer.callback_handler.callbacks[0], MetricsCallback)  # the dashboard first
    assert trainer.run_record.options.max_steps == 2 and trainer.run_record.config["max_steps"] == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        trainer.run_record.data = "elsewhere"
    with pytest.raises(AttributeError):
        trainer.fastkit_identity = {}  # read from the record, never written
    record = trainer.update_record(data="my rows", resume_hint=None)
    assert trainer.run_record is record and record.data == "my rows" and record.resume_hint is None
    metrics = trainer.train(resume=False)  # TRL-style: the trainer runs its own fastkit run
    assert metrics.status == "finished" and metrics.step == 2 and trainer.state.fastkit_run == "new run"
    assert (tmp_path / "fastkit_config.yaml").is_file()  # the record's config, beside the checkpoints
    assert trainer.fastkit_identity is trainer.run_record.identity and "hyperparameters" in trainer.fastkit_identity
