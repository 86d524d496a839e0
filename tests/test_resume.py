"""Resuming from a mid-run checkpoint gives the same loss curve as the uninterrupted run; extending a run
(``fit(resume=True, extend=True)``) trains the continued steps on the new schedule (issue 41)."""

import pytest
import torch

from fastkit import FastModel
from fastkit.quickstart import quickstart_dataset
from fastkit.training import fit, make_trainer
from fastkit.training.identity import restart_schedule_at


def _trainer(tokenizer, out, max_steps, save_steps=None, **options):
    model, _ = FastModel.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct", max_seq_length=128, twin=True)
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, lora_dropout=0.1)  # dropout: RNG must resume too
    train, _ = quickstart_dataset()
    save = dict(save_strategy="steps", save_steps=save_steps) if save_steps else {}
    return make_trainer(model, tokenizer, train, max_steps=max_steps, max_seq_length=128, batch_size=2,
                        learning_rate=1e-3, output_dir=str(out), **save, **options)


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _lrs(trainer):
    return [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]


@pytest.mark.slow
def test_resume_matches_uninterrupted(tmp_path, tokenizer):
    full = _trainer(tokenizer, tmp_path / "full", max_steps=6)
    full.train()
    first = _trainer(tokenizer, tmp_path / "resumed", max_steps=6, save_steps=3)
    first.train()
    resumed = _trainer(tokenizer, tmp_path / "resumed", max_steps=6, save_steps=3)
    resumed.train(resume_from_checkpoint=str(tmp_path / "resumed" / "checkpoint-3"))
    assert len(_losses(full)) == 6
    # the resumed trainer restores steps 1-3 from trainer_state.json and computes steps 4-6 itself
    assert _losses(resumed) == pytest.approx(_losses(full), rel=1e-5)
    assert _losses(resumed)[3:] != pytest.approx(_losses(full)[:3], rel=1e-3)  # the curve is not flat


# -- extend: the new schedule from the checkpoint's step on ------------------------------------------------------

SCHEDULES = {"linear": dict(lr_scheduler_type="linear", warmup_steps=0),
             "cosine-warmup": dict(lr_scheduler_type="cosine", warmup_steps=1)}


def _adapter(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES, ids=str)
def test_extend_follows_the_new_schedule_from_the_checkpoint_step(tmp_path, tokenizer, schedule):
    """2 steps, then extended to 4: steps 3-4 log the lr a fresh 4-step run logs there, and step 3 trains."""
    options = dict(SCHEDULES[schedule], save_total_limit=None)
    fresh = _trainer(tokenizer, tmp_path / "fresh", max_steps=4, **options)
    fit(fresh, view="none")
    fit(_trainer(tokenizer, tmp_path / "run", max_steps=2, save_steps=1, **options), view="none")
    extended = _trainer(tokenizer, tmp_path / "run", max_steps=4, save_steps=1, **options)
    fit(extended, view="none", resume=True, extend=True)
    assert len(_lrs(extended)) == len(_lrs(fresh)) == 4
    assert _lrs(extended)[2:] == pytest.approx(_lrs(fresh)[2:], rel=1e-6, abs=1e-12)
    assert min(_lrs(extended)[2:]) > 0  # the 2-step schedule ended at 0; the first continued step is not at it
    before, after = _adapter(tmp_path / "run" / "checkpoint-2"), _adapter(tmp_path / "run" / "checkpoint-3")
    assert any(not torch.equal(before[k], after[k]) for k in before), "step 3 left the adapter as it was"


@pytest.mark.parametrize("kind,warmup", [("linear", 0), ("linear", 3), ("cosine", 2), ("cosine_with_min_lr", 2)])
def test_restart_schedule_at_gives_the_longer_schedules_rate(kind, warmup):
    """A 10-step schedule loaded with a finished 4-step one's state (what the trainer does on extend), then restarted
    at step 4, has a fresh 10-step schedule's rates from step 5 on (in the optimizer and in get_last_lr)."""
    kwargs = {"min_lr_rate": 0.1} if kind == "cosine_with_min_lr" else {}
    short = _scheduler_with(kind, 4, warmup, kwargs)
    for _ in range(4):
        short.optimizer.step()
        short.step()
    extended, fresh = _scheduler_with(kind, 10, warmup, kwargs), _scheduler_with(kind, 10, warmup, kwargs)
    extended.load_state_dict(short.state_dict())
    restart_schedule_at(extended, 4)
    for _ in range(4):
        fresh.optimizer.step()
        fresh.step()
    for _ in range(6):
        assert extended.get_last_lr() == pytest.approx(fresh.get_last_lr())
        assert extended.optimizer.param_groups[0]["lr"] == pytest.approx(fresh.get_last_lr()[0])
        for s in (extended, fresh):
            s.optimizer.step()
            s.step()


def _scheduler_with(kind, total, warmup, kwargs):
    from transformers import get_scheduler

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    return get_scheduler(kind, optimizer=optimizer, num_warmup_steps=warmup, num_training_steps=total,
                         scheduler_specific_kwargs=kwargs)


def test_restart_schedule_at_leaves_a_plateau_scheduler_alone():
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
    restart_schedule_at(plateau, 4)
    assert optimizer.param_groups[0]["lr"] == 1e-3
