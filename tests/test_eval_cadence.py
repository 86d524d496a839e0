"""Evaluation on short runs (issue 54, item 3): the default cadence (about 5 evaluations a run, never more often than
every 10 steps, one after the last step), stated in the run's start line; "evaluating" shown while the eval set runs;
steps/s and tokens/s over training steps only (a slow evaluation left out), on a fake clock."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers import TrainerControl, TrainerState

from fastkit.dashboard import MetricsCallback
from fastkit.dashboard.render import progress_line, progress_text, stat_rows
from fastkit.training import TrainOptions, fit, sft_config
from fastkit.training.options import EVAL_EVERY_AT_LEAST, EVALS_PER_RUN, default_eval_steps
from tests.helpers import FakeClock


@pytest.mark.parametrize("steps, every", [(1, 10), (6, 10), (20, 10), (40, 10), (60, 12), (61, 13), (1000, 200)])
def test_the_default_cadence(steps, every):
    assert default_eval_steps(steps) == every
    in_run = steps // every
    assert in_run <= EVALS_PER_RUN and every >= EVAL_EVERY_AT_LEAST  # + one after the last step when not on it
    options = TrainOptions(output_dir="out", max_steps=steps, save_steps=None)
    config = sft_config(options, evaluate=True, cuda=False, optim="adamw_torch", precision={})
    assert (config["eval_strategy"], config["eval_steps"]) == ("steps", every)


def _drive(cb: MetricsCallback, clock: FakeClock, steps: int, eval_after: dict[int, float], eval_steps=None):
    """Trainer-like events: each step 1 s and 100 tokens; after step s in ``eval_after``, an evaluation of that many
    seconds (two eval batches, the eval loss logged, then on_evaluate). Returns the progress lines seen mid-eval."""
    args = SimpleNamespace(use_cpu=True, eval_strategy="steps" if eval_steps else "no", eval_steps=eval_steps)
    state, control = TrainerState(max_steps=steps, is_world_process_zero=True), TrainerControl()
    cb.on_train_begin(args, state, control, model=None)
    during = []
    for step in range(1, steps + 1):
        cb.on_step_begin(args, state, control)
        clock.now += 1.0
        state.global_step, state.num_input_tokens_seen = step, 100 * step
        cb.on_step_end(args, state, control)
        cb.on_log(args, state, control, logs={"loss": 2.0, "learning_rate": 1e-4})
        if step in eval_after:
            for _ in range(2):
                cb.on_prediction_step(args, state, control)
                clock.now += eval_after[step] / 2
            during.append(progress_line(cb.metrics) + progress_text(cb.metrics))  # the terminal's, the notebook's
            cb.on_log(args, state, control, logs={"eval_loss": 1.5})
            assert not cb.metrics.evaluating  # the eval loss is its result: no longer "evaluating"
            cb.on_evaluate(args, state, control)
    cb.on_train_end(args, state, control)
    return during


def test_a_slow_evaluation_is_left_out_of_the_rates():
    clock = FakeClock(50.0)
    cb = MetricsCallback(warmup_steps=0, clock=clock)
    during = _drive(cb, clock, steps=6, eval_after={2: 100.0, 6: 30.0}, eval_steps=10)
    m = cb.metrics
    assert m.steps_per_s == pytest.approx(1.0) and m.tokens_per_s == pytest.approx(100.0)  # 6 steps of 1 s each
    assert m.eval_s == pytest.approx(130.0) and m.elapsed_s == pytest.approx(136.0)
    assert not m.evaluating and m.eval_every == 10
    assert all("| evaluating |" in line and "evaluating ·" in line for line in during), during
    assert stat_rows(m)["eval_time"].value == "2:10 (not in steps/s, tokens/s)"


def test_the_eta_counts_the_evaluations_left_at_their_measured_time():
    clock = FakeClock(0.0)
    cb = MetricsCallback(warmup_steps=0, clock=clock)
    etas = {}
    listener = lambda event, m: etas.__setitem__(m.step, m.eta_s) if event == "step" else None  # noqa: E731
    cb.add_listener(listener)
    _drive(cb, clock, steps=25, eval_after={10: 40.0}, eval_steps=10)
    assert etas[11] == pytest.approx(14 / 1.0 + 2 * 40.0)  # 14 steps at 1 step/s, then evaluations at 20 and 25
    assert etas[21] == pytest.approx(4 / 1.0 + 1 * 40.0) and etas[25] == 0


def test_without_evaluation_the_rates_are_the_wall_clocks():
    clock = FakeClock(0.0)
    cb = MetricsCallback(warmup_steps=0, clock=clock)
    _drive(cb, clock, steps=4, eval_after={})
    assert cb.metrics.steps_per_s == pytest.approx(1.0) and cb.metrics.eval_s == 0 and cb.metrics.eval_every is None


@pytest.mark.parametrize("steps, evaluated", [(6, [6]), (12, [10, 12])])
def test_a_short_run_evaluates_at_the_cadence_and_after_its_last_step(steps, evaluated, tmp_path, fastkit_log):
    import torch

    from fastkit import FastModel
    from fastkit.families.twins import twin_tokenizer
    from fastkit.quickstart import quickstart_dataset
    from fastkit.training import make_trainer

    torch.manual_seed(0)
    model, _ = FastModel.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct", max_seq_length=128, twin=True)
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8)
    train, _ = quickstart_dataset()
    trainer = make_trainer(model, twin_tokenizer(), train.select(range(24)), max_steps=steps, eval_split=4,
                           max_seq_length=128, output_dir=str(tmp_path), save_steps=None)
    m = fit(trainer, view="terminal")
    assert m.status == "finished" and [s for s, _ in m.eval_history] == evaluated
    every = "after the last step" if steps < 10 else "every 10 steps and after the last"
    assert f"for {steps} steps (new run); evaluating {every}" in fastkit_log.text
    said = {id(r) for r in fastkit_log.records if "evaluating the eval set" in r.getMessage()}
    assert len(said) == len(evaluated)
    assert m.eval_s > 0 and m.steps_per_s is not None
