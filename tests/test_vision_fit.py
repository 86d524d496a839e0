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


def test_an_eval_set_of_image_rows_reports_its_loss(tmp_path):
    model, processor = FastModel.from_pretrained("qwen2_5_vl", twin=True, max_seq_length=256)
    model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False)
    trainer = make_trainer(model, processor, [_row(), _row(answer="A dog.")], eval_dataset=[_row(answer="A cow.")],
                           max_steps=2, eval_steps=1, packing=False, output_dir=str(tmp_path), dashboard="none")
    metrics = fit(trainer, view="none", warmup_steps=0)
    assert metrics.status == "finished" and [s for s, _ in metrics.eval_history] == [1, 2]
    assert metrics.eval_loss is not None and math.isfinite(metrics.eval_loss) and metrics.eval_loss > 0
    # eval_split: the rows held out of train (seeded), evaluated the same way
    split = make_trainer(model, processor, [_row(answer=f"A cat {i}.") for i in range(4)], eval_split=1,
                         max_steps=1, packing=False, output_dir=str(tmp_path / "split"), dashboard="none")
    assert len(split.train_dataset) == 3 and len(split.eval_dataset) == 1
    assert math.isfinite(split.evaluate()["eval_loss"])


def test_a_broken_eval_image_row_is_refused_naming_eval_dataset(tmp_path):
    model, processor = FastModel.from_pretrained("qwen2_5_vl", twin=True, max_seq_length=256)
    missing = str(tmp_path / "missing.png")
    with pytest.raises(FastkitError, match=r"^eval_dataset: row 2: images\[0\] .*missing.png' does not exist"):
        make_trainer(model, processor, [_row()], eval_dataset=[_row(), _row(images=[missing])], max_steps=1,
                     packing=False, output_dir=str(tmp_path))
    with pytest.raises(FastkitError, match="streaming=True: image"):
        make_trainer(model, processor, [_row()], max_steps=1, packing=False, streaming=True, output_dir=str(tmp_path))


def test_a_file_of_image_rows_reads_its_images_beside_it(tmp_path, monkeypatch):
    import json

    from fastkit.families.vision import twin_image

    (tmp_path / "imgs").mkdir()
    rows = []
    for i in range(2):
        twin_image(i).save(tmp_path / "imgs" / f"{i}.png")
        rows.append({**_row(answer=f"Picture {i}."), "images": [f"imgs/{i}.png"]})
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(tmp_path / "imgs")  # another working directory: paths are the file's folder's
    model, processor = FastModel.from_pretrained("qwen2_5_vl", twin=True, max_seq_length=256)
    trainer = make_trainer(model, processor, str(tmp_path / "rows.jsonl"), max_steps=1, packing=False,
                           output_dir=str(tmp_path / "out"), dashboard="none")
    assert trainer.data_collator.rows[1]["images"] == [str(tmp_path / "imgs" / "1.png")]
    long = _row(2)
    kept = make_trainer(model, processor, [_row(), long], max_steps=1, packing=False, drop_long=True,
                        max_seq_length=55, output_dir=str(tmp_path / "out"), dashboard="none")
    assert len(kept.train_dataset) == 1  # the two-image row is past 55 tokens: dropped, counted in the log


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
