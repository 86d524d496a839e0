"""The planner on vision-language configs: the vision tower counted apart (frozen weights, no LoRA) and an image's
tokens said; the load-time check accepts them."""

from __future__ import annotations

import pytest
import torch

from fastkit import registry
from fastkit.families.vision import vision_twin, vision_twin_config
from fastkit.plan import plan
from fastkit.plan.terms import image_tokens, shape_of

VISION_ONLY = tuple(t for t, f in registry.MODEL_TABLE.items() if f.vision is not None and not f.text_config)


@pytest.mark.parametrize("model_type", VISION_ONLY)
def test_the_vision_tower_is_counted_apart_and_an_image_has_its_tokens(model_type):
    facts = registry.MODEL_TABLE[model_type].vision
    config = vision_twin_config(model_type)
    shape = shape_of(config)
    model = vision_twin(model_type)
    tower = {id(p): p.numel() for path in (facts.tower, facts.projector)
             for p in model.get_submodule(path).parameters()}
    assert shape.vision_params == sum(tower.values()) > 0
    assert shape.total_params == sum(p.numel() for p in model.parameters())
    language = {n for n, m in model.get_submodule(facts.language_model).named_modules()
                if isinstance(m, torch.nn.Linear)}
    linear_dims = [d for d in shape.lora_dims if d[2] == 1]  # (fused MoE experts: copies = experts)
    assert len(linear_dims) == len(language)  # LoRA planned on the language model only
    assert shape.image_tokens == image_tokens(config) > 0
    result = plan(config, gpu="t4", max_seq_length=512)
    assert "weights: vision tower + projector, float16" in result.components
    assert f"one image is {shape.image_tokens:,} tokens" in result.table()


def test_image_tokens_of_the_published_layouts():
    from transformers import CONFIG_MAPPING

    assert image_tokens(CONFIG_MAPPING["qwen2_5_vl"]()) == (448 // 28) ** 2  # patch 14, 2x2 merge
    assert image_tokens(CONFIG_MAPPING["gemma3"]()) == 256  # mm_tokens_per_image
    assert image_tokens(CONFIG_MAPPING["idefics3"](vision_config=dict(image_size=512, patch_size=16),
                                                   scale_factor=4)) == 64  # SmolVLM-256M: one 512 px tile
