"""fastkit.fit on a vision-language trainer (make_trainer with a processor): the live dashboard counts steps, loss
and tokens (image tokens included: the processor's attention mask), and only the language model's LoRA trains."""

from __future__ import annotations

import math

import pytest
import torch

from fastkit import FastModel, registry
from fastkit.dashboard import MetricsCallback
from fastkit.data.vision import encode_row
from fastkit.errors import FastkitError
from fastkit.training import fit, make_trainer
from tests.test_vision_data import _row


def test_fit_runs_a_vision_trainer_under_the_dashboard(tmp_path):
    model, processor = FastModel.from_pretrained("qwen2_5_vl", twin=True, max_seq_length=256)
    model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False)
    rows = [_row(), _row(answer="A dog.")]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = make_trainer(model, processor, rows, max_steps=2, batch_size=2, packing=False, learning_rate=1e-2,
                           output_dir=str(tmp_path), dashboard="none")
    assert isinstance(trainer.callback_handler.callbacks[0], MetricsCallback)  # trainer.train() shows it too
    metrics = fit(trainer, view="none", warmup_steps=0)
    assert metrics.status == "finished" and metrics.step == 2 and metrics.examples == 2
    assert [s for s, _ in metrics.loss_history] == [1, 2] and math.isfinite(metrics.loss)
    per_step = sum(len(encode_row(row, processor, i)[0]) for i, row in enumerate(rows))  # both rows, each step
    assert metrics.tokens_seen == 2 * per_step and metrics.tokens_per_s > 0
    assert (tmp_path / "fastkit_config.yaml").exists()
    facts = registry.MODEL_TABLE["qwen2_5_vl"].vision
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n and f"{facts.language_model}." in n for n in changed), changed


def test_an_eval_set_for_image_rows_is_refused(tmp_path):
    model, processor = FastModel.from_pretrained("qwen2_5_vl", twin=True, max_seq_length=256)
    with pytest.raises(FastkitError, match="eval_dataset / eval_split are not supported for image"):
        make_trainer(model, processor, [_row()], eval_dataset=[_row()], max_steps=1, packing=False,
                     output_dir=str(tmp_path))


def test_the_data_fingerprint_tells_other_image_rows_apart(tmp_path):
    from fastkit.families.vision import twin_image
    from fastkit.training.identity import data_fingerprint

    model, processor = FastModel.from_pretrained("qwen2_5_vl", twin=True, max_seq_length=256)

    def fingerprint(rows):
        trainer = make_trainer(model, processor, rows, max_steps=1, packing=False, output_dir=str(tmp_path))
        return data_fingerprint(trainer.train_dataset)

    rows = [_row(), _row(answer="A dog.")]
    assert fingerprint(rows) == fingerprint([_row(), _row(answer="A dog.")])
    assert fingerprint(rows) != fingerprint([_row(), _row(answer="A cat.")])  # other text
    assert fingerprint(rows) != fingerprint([_row(), _row(answer="A dog.", images=[twin_image(5)])])  # other image
