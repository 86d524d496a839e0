"""Vision-language families (docs/vision.md): each row's twin loads with its processor, the real-folder path loads
the same weights, the row's facts name the model's own modules, LoRA stays on the language model by default, and
the patches apply or are refused (the model unchanged) as the row says."""

from __future__ import annotations

import pytest
import torch

from fastkit import FastModel, registry
from fastkit.errors import FastkitError
from fastkit.families.vision import twin_image, vision_twin, vision_twin_processor
from fastkit.patching import active_patches, report, revert

VISION_ROWS = tuple(t for t, f in registry.MODEL_TABLE.items() if f.vision is not None)
MROPE_ROWS = tuple(t for t in VISION_ROWS if registry.MODEL_TABLE[t].vision.rope == registry.MROPE)


def image_batch(processor, n_images: int = 1):
    """One chat with ``n_images`` images and an assistant answer, through the family's processor."""
    parts = [{"type": "image"}] * n_images + [{"type": "text", "text": "What is it?"}]
    msgs = [{"role": "user", "content": parts}, {"role": "assistant", "content": "A cat."}]
    text = processor.apply_chat_template(msgs, tokenize=False)
    return processor(text=[text], images=[[twin_image(i) for i in range(n_images)]], return_tensors="pt")


def _load(model_type: str, **kwargs):
    vision = {"vision": True} if registry.MODEL_TABLE[model_type].text_config else {}
    return FastModel.from_pretrained(model_type, twin=True, max_seq_length=256, **vision, **kwargs)


def test_the_vision_rows():
    assert {"qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "gemma3", "idefics3", "smolvlm"} <= set(VISION_ROWS)
    assert set(MROPE_ROWS) == {"qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"}


@pytest.mark.parametrize("model_type", VISION_ROWS)
def test_twin_loads_with_its_processor_and_trains_on_an_image(model_type):
    model, processor = _load(model_type)
    facts = registry.MODEL_TABLE[model_type].vision
    assert model.config.model_type == model_type and type(processor).__name__ == facts.processor
    for path in (facts.tower, facts.projector, facts.language_model):  # the row names the model's own modules
        model.get_submodule(path)
    image_id = processor.tokenizer.convert_tokens_to_ids(facts.image_token)
    assert getattr(model.config, facts.image_token_key) == image_id
    batch = image_batch(processor)
    assert (batch["input_ids"] == image_id).sum() > 0
    out = model.train()(**batch, labels=batch["input_ids"])
    out.loss.backward()
    assert torch.isfinite(out.loss)
    tower = model.get_submodule(facts.tower)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in tower.parameters())  # images reach the loss
    assert sum(p.numel() for p in model.parameters()) < 1_000_000


@pytest.mark.parametrize("model_type", MROPE_ROWS)
def test_mrope_packing_is_applied_and_reverts(model_type):
    """Packing is on for mrope rows (per-document 3-D positions: proven in tests/test_vision_patches.py); revert
    gives back the forward of the module owning get_rope_index, and the weights are the twin's."""
    model, _ = _load(model_type)
    assert registry.PACKING in active_patches(model) and registry.PACKING not in report(model).skipped
    owner = model.get_submodule(registry.MODEL_TABLE[model_type].vision.language_model.rpartition(".")[0])
    assert getattr(owner.forward, "_fastkit_packing", False)
    revert(model)
    assert not getattr(owner.forward, "_fastkit_packing", False) and "forward" not in vars(owner)
    plain = vision_twin(model_type)
    for (name, a), (_, b) in zip(model.named_parameters(), plain.named_parameters()):
        assert torch.equal(a, b), name
    assert str(model.config.get_text_config()._attn_implementation) == str(
        plain.config.get_text_config()._attn_implementation)


def test_gemma3_stays_text_by_default_and_vision_is_refused_for_a_text_family():
    model, tok = FastModel.from_pretrained("google/gemma-3-4b-it", twin=True, max_seq_length=256)
    assert model.config.model_type == "gemma3_text" and not hasattr(tok, "image_processor")
    model, processor = FastModel.from_pretrained("google/gemma-3-4b-it", twin=True, max_seq_length=256, vision=True)
    assert model.config.model_type == "gemma3" and hasattr(processor, "image_processor")
    with pytest.raises(FastkitError, match="vision=True: qwen3 is not a vision-language family"):
        FastModel.from_pretrained("Qwen/Qwen3-0.6B", twin=True, vision=True)
    with pytest.raises(FastkitError, match="vision=False"):
        FastModel.from_pretrained("qwen2_5_vl", twin=True, vision=False)


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "idefics3", "gemma3"])
def test_a_local_checkpoint_loads_as_a_vision_model_with_its_processor(model_type, tmp_path):
    """The real path: AutoModelForImageTextToText + AutoProcessor from a folder (a processor's video part is left
    out where torchvision is missing), the same logits as the model saved."""
    full = vision_twin(model_type)
    processor = vision_twin_processor(model_type)
    full.save_pretrained(tmp_path, safe_serialization=True)
    processor.save_pretrained(tmp_path)
    vision = {"vision": True} if registry.MODEL_TABLE[model_type].text_config else {}
    model, loaded = FastModel.from_pretrained(str(tmp_path), max_seq_length=256, dtype="fp32", **vision)
    assert type(model).__name__ == type(full).__name__ and type(loaded).__name__ == type(processor).__name__
    batch = image_batch(loaded)
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, full(**batch).logits, rtol=1e-5, atol=1e-5)


def _lora_names(peft_model) -> list[str]:
    return [n for n, p in peft_model.named_parameters() if "lora_" in n and p.requires_grad]


def _under(names, path: str) -> list[str]:
    return [n for n in names if f"{path}." in n]


@pytest.mark.parametrize("model_type", VISION_ROWS)
def test_default_lora_is_on_the_language_model_only(model_type):
    facts = registry.MODEL_TABLE[model_type].vision
    model, _ = _load(model_type)
    peft_model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False)
    names = _lora_names(peft_model)
    assert names and set(names) == set(_under(names, facts.language_model))
    assert _under(names, facts.tower) == [] and _under(names, facts.projector) == []


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "gemma3", "idefics3"])
def test_finetune_vision_layers_or_target_modules_opt_the_tower_in(model_type):
    facts = registry.MODEL_TABLE[model_type].vision
    model, _ = _load(model_type)
    names = _lora_names(FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False,
                                                 finetune_vision_layers=True))
    assert _under(names, facts.tower) and _under(names, facts.language_model)
    model, _ = _load(model_type)
    tower_linear = next(n for n, m in model.get_submodule(facts.tower).named_modules()
                        if isinstance(m, torch.nn.Linear))
    names = _lora_names(FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False,
                                                 target_modules=[tower_linear.rsplit(".", 1)[-1]]))
    assert _under(names, facts.tower)


def test_finetune_vision_layers_on_a_text_model_is_refused():
    model, _ = FastModel.from_pretrained("Qwen/Qwen3-0.6B", twin=True, max_seq_length=256)
    with pytest.raises(FastkitError, match="finetune_vision_layers=True: this model has no vision tower"):
        FastModel.get_peft_model(model, r=4, finetune_vision_layers=True)
