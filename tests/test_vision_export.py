"""Export of a vision-language twin: save_lora and save_merged reload-verified (and the folders give the in-memory
model's logits on an image + text batch), GGUF of a tower llama.cpp computes otherwise refused naming the key
(tests/test_vision_gguf.py runs Qwen2.5-VL's GGUF in llama.cpp)."""

from __future__ import annotations

import pytest
import torch

from fastkit import FastModel
from fastkit.errors import FastkitError
from fastkit.export import save_gguf, save_lora, save_merged
from tests.test_vision import image_batch


@pytest.fixture(scope="module")
def tuned():
    model, processor = FastModel.from_pretrained("qwen2_5_vl", twin=True, max_seq_length=256)
    model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False)
    with torch.no_grad():  # a trained-looking adapter: non-zero B
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    return model.eval(), processor


def test_save_merged_reloads_as_a_vision_model_with_the_same_image_logits(tuned, tmp_path):
    model, processor = tuned
    save_merged(model, processor, tmp_path / "merged", dtype=torch.float32)
    loaded, loaded_processor = FastModel.from_pretrained(str(tmp_path / "merged"), max_seq_length=256, dtype="fp32")
    assert type(loaded).__name__ == "Qwen2_5_VLForConditionalGeneration"
    batch = image_batch(loaded_processor, 2)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).logits, model(**batch).logits, rtol=1e-4, atol=1e-4)


def test_save_lora_reloads_onto_a_fresh_twin_with_the_same_image_logits(tuned, tmp_path):
    from peft import PeftModel

    model, processor = tuned
    save_lora(model, processor, tmp_path / "lora")
    assert (tmp_path / "lora" / "preprocessor_config.json").exists() or (tmp_path / "lora" / "processor_config.json"
                                                                         ).exists()
    base, _ = FastModel.from_pretrained("qwen2_5_vl", twin=True, max_seq_length=256)
    loaded = PeftModel.from_pretrained(base, str(tmp_path / "lora")).eval()
    batch = image_batch(processor)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).logits, model(**batch).logits, rtol=1e-5, atol=1e-5)


def test_gguf_of_the_twins_56_pixel_windows_is_refused_naming_window_size(tuned, tmp_path):
    model, processor = tuned  # the twin's window_size is 56; llama.cpp's qwen2.5vl_merger computes 112 only
    assert model.config.vision_config.window_size == 56
    with pytest.raises(FastkitError, match="window_size=56.*112"):
        save_gguf(model, processor, tmp_path / "gguf")
    assert not (tmp_path / "gguf").exists()


def test_fastkit_export_takes_a_vision_runs_adapters(tmp_path, capsys):
    """``fastkit export`` on the LoRA folder of a vision run (its processor saved beside it): the vision-language
    class loads with that processor, --merged reloads as one and --gguf writes the text GGUF and its mmproj."""
    import json

    from gguf import GGUFReader

    from fastkit import cli

    model, processor = FastModel.from_pretrained("idefics3", twin=True, max_seq_length=256)
    model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    save_lora(model, processor, tmp_path / "run" / "lora")
    assert cli.main(["export", "--model", str(tmp_path / "run" / "lora"), "--merged", "--gguf", "q8_0",
                     "--name", "cat"]) == 0, capsys.readouterr().err
    merged = tmp_path / "run" / "merged_16bit"
    assert json.loads((merged / "config.json").read_text())["architectures"] == ["Idefics3ForConditionalGeneration"]
    assert (merged / "processor_config.json").is_file() or (merged / "preprocessor_config.json").is_file()
    gguf = tmp_path / "run" / "gguf"
    for file, arch in (("cat-q8_0.gguf", "llama"), ("cat-mmproj-f16.gguf", "clip")):
        field = GGUFReader(gguf / file).fields["general.architecture"]
        assert bytes(field.parts[field.data[0]]).decode() == arch, file
    assert "with cat-mmproj-f16.gguf (the vision projector" in capsys.readouterr().out


def test_fastkit_export_loads_the_vision_class_only_for_a_vision_run(tmp_path):
    """A folder with a processor of a vision family loads with vision=True (Gemma 3 would load its text model
    otherwise); a text run's folder (a tokenizer only) of the same family, or a text family, loads as it was saved."""
    from fastkit.cli.export import _vision

    (tmp_path / "vision").mkdir()
    (tmp_path / "vision" / "processor_config.json").write_text("{}")
    (tmp_path / "text").mkdir()
    assert _vision(tmp_path / "vision", "gemma3", twin=True) == {"vision": True}
    assert _vision(tmp_path / "text", "gemma3", twin=True) == {}
    assert _vision(tmp_path / "vision", "llama", twin=True) == {}
