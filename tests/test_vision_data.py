"""Image + text rows (fastkit/data/vision.py): checked before the model loads, the loss on assistant turns only,
and one SFT step through make_trainer (TRL's SFTTrainer, handed the processor) trains the language model's LoRA
only."""

from __future__ import annotations

import pytest
import torch

from fastkit import FastModel, registry
from fastkit.data.vision import VisionCollator, check_vision_rows, encode_row
from fastkit.errors import FastkitError
from fastkit.families.vision import twin_image, vision_twin_processor
from fastkit.training import make_trainer


def _row(n_images: int = 1, answer: str = "A small cat.", images=None):
    parts = [{"type": "image"}] * n_images + [{"type": "text", "text": "What is in the picture?"}]
    return {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": answer}],
            "images": images if images is not None else [twin_image(i) for i in range(n_images)]}


@pytest.fixture(scope="module")
def processor():
    return vision_twin_processor("qwen2_5_vl")


def test_rows_are_checked_naming_the_row(processor, tmp_path):
    path = tmp_path / "cat.png"
    twin_image(3).save(path)
    assert check_vision_rows([_row(), _row(images=[str(path)])], processor, 256) > 0
    with pytest.raises(FastkitError, match=r"row 2: images\[0\] .*missing.png' does not exist"):
        check_vision_rows([_row(), _row(images=[str(tmp_path / "missing.png")])], processor, 256)
    (tmp_path / "broken.png").write_bytes(b"not a png")
    with pytest.raises(FastkitError, match=r"row 1: images\[0\] .*broken.png' is not a readable image"):
        check_vision_rows([_row(images=[str(tmp_path / "broken.png")])], processor, 256)
    with pytest.raises(FastkitError, match="row 3: 2 image parts .* but 1 image"):
        check_vision_rows([_row(), _row(), _row(2, images=[twin_image()])], processor, 256)
    with pytest.raises(FastkitError, match=r"row 1: \d+ tokens \(8 of them image tokens, 2 image\(s\)\) is longer "
                                           "than max_seq_length=40"):
        check_vision_rows([_row(2)], processor, 40)


def test_the_mask_trains_assistant_turns_only(processor):
    row = _row()
    row["messages"] += [{"role": "user", "content": "And the colour?"}, {"role": "assistant", "content": "Grey."}]
    ids, mask = encode_row(row, processor)
    trained = processor.tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert trained == "A small cat.<|im_end|>\nGrey.<|im_end|>\n"
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert all(m == 0 for t, m in zip(ids, mask) if t == image_id)
    batch = VisionCollator(processor, 256)([row, _row(answer="No.")])
    for i in range(2):
        labels = batch["labels"][i]
        assert processor.tokenizer.decode(labels[labels != -100]) in (trained, "No.<|im_end|>\n")


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "gemma3", "idefics3"])
def test_one_sft_step_trains_the_language_models_lora_only(model_type, tmp_path):
    vision = {"vision": True} if registry.MODEL_TABLE[model_type].text_config else {}
    model, processor = FastModel.from_pretrained(model_type, twin=True, max_seq_length=256, **vision)
    model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False)
    facts = registry.MODEL_TABLE[model_type].vision
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = make_trainer(model, processor, [_row(), _row(answer="A dog.")], max_steps=1, batch_size=2,
                           packing=False, learning_rate=1e-2, output_dir=str(tmp_path), dashboard="none")
    trainer.train()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n and f"{facts.language_model}." in n for n in changed), changed
    for n, p in model.named_parameters():
        if f"{facts.tower}." in n or f"{facts.projector}." in n:
            assert not p.requires_grad and p.grad is None and torch.equal(p, before[n]), n


def test_image_rows_are_read_from_a_file_beside_their_images(tmp_path):
    """JSON / JSONL / Parquet files of image rows: relative paths from the file's folder, Parquet images stored as
    ``datasets`` stores them ({"bytes", "path"}); text files and several sources told apart."""
    import io
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from fastkit.data.vision import check_image_files, read_image_rows

    twin_image(1).save(tmp_path / "a.png")
    row = {**_row(), "images": ["a.png"]}
    (tmp_path / "rows.json").write_text(json.dumps([row, row]))
    rows = read_image_rows(str(tmp_path / "rows.json"))
    assert [r["images"] for r in rows] == [[str(tmp_path / "a.png")]] * 2
    check_image_files(rows)
    png = io.BytesIO()
    twin_image(2).save(png, format="PNG")
    messages = [row["messages"][0], {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}]
    stored = {"messages": messages, "images": [{"bytes": png.getvalue(), "path": None}]}  # one type per column
    pq.write_table(pa.Table.from_pylist([stored, {**stored, "images": [{"bytes": b"nope", "path": None}]}]),
                   tmp_path / "rows.parquet")
    with pytest.raises(FastkitError, match=r"^data: row 2: images\[0\] holds 4 bytes that are not a readable image"):
        check_image_files(read_image_rows(str(tmp_path / "rows.parquet")))
    (tmp_path / "text.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                                  {"role": "assistant", "content": "yo"}]}) + "\n")
    assert read_image_rows(str(tmp_path / "text.jsonl")) is None  # text rows: the text reader's
    with pytest.raises(FastkitError, match="rows.json holds image \\+ text rows, and image rows come from one"):
        read_image_rows([str(tmp_path / "text.jsonl"), str(tmp_path / "rows.json")], "--data")
    with pytest.raises(FastkitError, match="columns, weight, max_rows and split apply to text data only"):
        read_image_rows(f"{tmp_path / 'rows.json'}?weight=2")
