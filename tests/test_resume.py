"""Resuming from a mid-run checkpoint gives the same loss curve as the uninterrupted run."""

import pytest

from fastkit import FastModel
from fastkit.quickstart import quickstart_dataset
from fastkit.training import make_trainer


def _trainer(tokenizer, out, max_steps, save_steps=None):
    model, _ = FastModel.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct", max_seq_length=128, twin=True)
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, lora_dropout=0.1)  # dropout: RNG must resume too
    train, _ = quickstart_dataset()
    save = dict(save_strategy="steps", save_steps=save_steps) if save_steps else {}
    return make_trainer(model, tokenizer, train, max_steps=max_steps, max_seq_length=128, batch_size=2,
                        learning_rate=1e-3, output_dir=str(out), **save)


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


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
