"""make_trainer's run-length, eval-split and report_to options, and the coverage line the notebooks print."""

from __future__ import annotations

import pytest

from fastkit import FastModel
from fastkit.errors import FastkitError
from fastkit.quickstart import quickstart_dataset
from fastkit.training import available_trackers, check_report_to, make_trainer, planned_steps, run_coverage


@pytest.fixture(scope="module")
def twin_model():
    model, tok = FastModel.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct", max_seq_length=128, twin=True)
    return FastModel.get_peft_model(model, r=4, lora_alpha=4, use_gradient_checkpointing=False), tok


def _make(twin_model, tmp_path, **kw):
    model, tok = twin_model
    train, _ = quickstart_dataset()
    return make_trainer(model, tok, train, max_seq_length=128, output_dir=str(tmp_path), dashboard="none", **kw)


def test_steps_by_default_and_the_coverage_line(twin_model, tmp_path):
    trainer = _make(twin_model, tmp_path, max_steps=3, batch_size=2)
    rows = len(trainer.train_dataset)
    assert trainer.args.max_steps == 3 and planned_steps(trainer) == 3
    line = run_coverage(trainer)
    assert line.startswith(f"One run: 3 steps × 2 packed rows of ≤128 tokens = 6 of {rows:,} rows")
    assert f"{100 * 6 / rows:.1f}% of one epoch" in line and "examples" in line, line


@pytest.mark.parametrize("every", [None, 2])
def test_logging_steps_chosen_by_the_caller_wins_over_the_dashboards_every_step(twin_model, tmp_path, every):
    """The dashboard callback asks for a log every step (live curves); ``logging_steps=N`` passed to make_trainer
    must still give N-1 steps without the log point's device reads (docs/step.md)."""
    trainer = _make(twin_model, tmp_path, max_steps=4, **({} if every is None else {"logging_steps": every}))
    trainer.train()
    logged = [h["step"] for h in trainer.state.log_history if "loss" in h]
    assert logged == ([1, 2, 3, 4] if every is None else [2, 4])


def test_epochs_run_every_packed_row(twin_model, tmp_path):
    trainer = _make(twin_model, tmp_path, epochs=2, batch_size=2, gradient_accumulation_steps=2)
    rows = len(trainer.train_dataset)
    assert trainer.args.max_steps == -1 and trainer.args.num_train_epochs == 2.0
    assert planned_steps(trainer) == 2 * -(-rows // 4)
    assert trainer.args.warmup_steps == min(5, planned_steps(trainer) // 10)
    line = run_coverage(trainer)
    assert f"= {planned_steps(trainer) * 4:,} of {rows:,} rows" in line and " epochs over " in line, line


@pytest.mark.parametrize("kw, message", [
    (dict(max_steps=10, epochs=1), "not both"),
    (dict(epochs=0), "epochs must be a positive"),
    (dict(max_steps=0), "max_steps must be a positive int"),
    (dict(eval_split=1.5), "eval_split must be"),
    (dict(report_to="mlflow"), "is not one fastkit sets up"),
])
def test_bad_options_refused_before_any_work(twin_model, tmp_path, kw, message):
    with pytest.raises(FastkitError, match=message):
        _make(twin_model, tmp_path, **kw)


def test_eval_split_holds_out_rows_and_evaluates(twin_model, tmp_path):
    whole = _make(twin_model, tmp_path, max_steps=2)
    trainer = _make(twin_model, tmp_path, max_steps=2, eval_split=0.2)
    assert trainer.eval_dataset is not None and len(trainer.eval_dataset) > 0 and trainer.args.eval_strategy == "steps"
    assert trainer.args.eval_steps == 10  # default_eval_steps(2): at most every 10 steps, so once, after step 2
    assert len(trainer.train_dataset) < len(whole.train_dataset)  # the held-out rows left the training set


def test_report_to_needs_the_tracker_installed(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert "wandb" not in available_trackers()
    with pytest.raises(FastkitError, match="pip install wandb"):
        check_report_to("wandb")
    assert check_report_to("none") == [] and check_report_to(None) == []
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "wandb" else real(name, *a))
    assert check_report_to(["wandb"]) == ["wandb"]
