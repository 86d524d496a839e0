"""Checkpoint offload on vision-language twins, proven against unpatched transformers on the same weights.

Per family, an image + text chat (the twin processor's ``pixel_values`` and grid / mask tensors) runs forward and
backward with gradient checkpointing: fastkit's model with ``use_gradient_checkpointing="offload"`` (LoRA) or
``enable_checkpointing(model, "offload")`` (full fine-tune) against the unpatched transformers twin with plain
non-reentrant checkpointing. Only the language model's decoder layers are offloaded (the tower keeps plain
checkpointing: ``fastkit.patches.offload.checkpointed_layers``). The pipeline runs on the CPU copy stream with a
poisoning throttle (as in tests/test_offload.py), so a buffer read before its copy ends shows up as NaN.

Tolerance: none. Offload changes only where a saved layer input lives, so the arithmetic is the same in the same
order: logits and every gradient are bitwise equal (``torch.equal``, fp32 CPU), in the full fine-tune and in the
LoRA run through ``FastModel`` (whose load-time patches, packing's attention on SmolVLM / Idefics3, take
transformers' path on an unpacked batch: measured max abs difference 0.0 on every family).
"""

from __future__ import annotations

import copy

import pytest
import torch

from fastkit import FastModel, registry
from fastkit.families.vision import twin_image, vision_twin, vision_twin_processor
from fastkit.loader import enable_checkpointing
from fastkit.patches.offload.patch import checkpointed_layers, offload_active, offload_controller
from fastkit.patches.offload.streams import Throttle
from fastkit.patches.offload.testing import OffloadTestConfig
from fastkit.patching import active_patches, revert

LAYERS = 4
"""Language-model layers of the full fine-tune's twins: three offloaded inputs, two of them prefetched."""
FAMILIES = tuple(t for t, f in registry.MODEL_TABLE.items() if f.vision is not None)


def cfg() -> OffloadTestConfig:
    """Offload every language-model layer input but the last (tiny twins are below the production thresholds);
    reloads take 30 ms and fill their destination with NaN first, so a read before the copy ends is caught."""
    return OffloadTestConfig(min_tokens=0, min_bytes=0, force_cpu_stream=True,
                             throttle=Throttle(0.03, directions=("h2d",), poison=True))


def _batch(model_type: str) -> dict:
    """One chat with two images, as the twin processor makes it; labels are the ids."""
    processor = vision_twin_processor(model_type)
    parts = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Which one is larger, and why?"}]
    msgs = [{"role": "user", "content": parts}, {"role": "assistant", "content": "The left one."}]
    text = processor.apply_chat_template(msgs, tokenize=False)
    batch = dict(processor(text=[text], images=[[twin_image(1), twin_image(2)]], return_tensors="pt"))
    return dict(batch, labels=batch["input_ids"])


def _run(model, batch) -> tuple[torch.Tensor, dict]:
    """Logits and every gradient of one forward + backward (the logits weighted so every position counts)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    logits = model(**batch).logits
    g = torch.Generator().manual_seed(1)
    (logits * torch.randn(logits.shape, generator=g)).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _twin(model_type: str, layers: int) -> torch.nn.Module:
    """The family's vision twin with ``layers`` language-model layers (a ``layer_types`` pattern repeated), training."""
    pattern = registry.MODEL_TABLE[model_type].vision.twin_text.get("layer_types")
    extra = {"layer_types": (pattern * layers)[:layers]} if pattern else {}
    return vision_twin(model_type, num_hidden_layers=layers, **extra).train()


def _plain_checkpointed(model_type: str, layers: int = 2) -> torch.nn.Module:
    """The unpatched transformers twin, plain non-reentrant gradient checkpointing (transformers' own switch)."""
    model = _twin(model_type, layers)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    return model


def _assert_bitwise(got_logits, got: dict, want_logits, want: dict) -> None:
    """Logits and every gradient bitwise equal; the message names the worst gradient (max abs difference)."""
    assert torch.equal(got_logits, want_logits), (got_logits - want_logits).abs().max()
    assert got.keys() == want.keys() and want
    diff = {n: (got[n] - want[n]).abs().max().item() for n in want}
    worst = max(diff, key=diff.get)
    assert all(torch.equal(got[n], want[n]) for n in want), f"{worst}: max abs difference {diff[worst]:.3g}"


def _language_layers(model) -> list[str]:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = {id(m): n for n, m in base.named_modules()}
    return [names[id(m)] for m in checkpointed_layers(model)]


def _check_offloaded(model, model_type: str) -> None:
    """Offload is on the language model's layers only, and it offloaded (the tower keeps plain checkpointing)."""
    lm = registry.MODEL_TABLE[model_type].vision.language_model
    layers = _language_layers(model)
    assert layers and all(n.startswith(lm + ".") for n in layers), layers
    assert offload_active(model)
    assert offload_controller(model).stats.offloaded == len(layers) - 1  # all but the last (skip_last_layer)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_offload_full_finetune_bitwise_equal_unpatched(model_type):
    """Every parameter trainable (the vision tower's included): logits and every gradient bitwise equal to
    transformers' plain checkpointing; revert gives back each layer's checkpoint function object."""
    batch = _batch(model_type)
    want_logits, want = _run(_plain_checkpointed(model_type, LAYERS), batch)
    model = _twin(model_type, LAYERS)
    assert enable_checkpointing(model, True) == "checkpoint"
    before = {n: m._gradient_checkpointing_func for n, m in model.named_modules()
              if hasattr(m, "_gradient_checkpointing_func")}
    from fastkit.patches.offload.patch import enable_offload

    assert enable_offload(model, cfg()) == "double-buffer"
    got_logits, got = _run(model, batch)
    _check_offloaded(model, model_type)
    assert any(n.startswith(registry.MODEL_TABLE[model_type].vision.tower) for n in got)  # the tower trains too
    _assert_bitwise(got_logits, got, want_logits, want)
    assert revert(model, [registry.OFFLOAD]) == [registry.OFFLOAD]
    assert registry.OFFLOAD not in active_patches(model) and offload_controller(model) is None
    after = {n: m._gradient_checkpointing_func for n, m in model.named_modules()
             if hasattr(m, "_gradient_checkpointing_func")}
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_offload_lora_through_get_peft_model_equals_unpatched(model_type):
    """``FastModel.from_pretrained`` + ``get_peft_model(use_gradient_checkpointing="offload")``: logits and every
    LoRA gradient equal to the unpatched twin with the same adapter and plain checkpointing."""
    vision = {"vision": True} if registry.MODEL_TABLE[model_type].text_config else {}
    model, _ = FastModel.from_pretrained(model_type, twin=True, max_seq_length=256, **vision)
    model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing="offload", offload_config=cfg())
    with torch.no_grad():  # non-zero B factors: the LoRA path is in the logits too
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    model.train()
    from peft import get_peft_model

    plain = get_peft_model(_plain_checkpointed(model_type), copy.deepcopy(model.peft_config["default"]))
    plain.load_state_dict(model.state_dict())
    plain.train()
    batch = _batch(model_type)
    got_logits, got = _run(model, batch)
    _check_offloaded(model, model_type)
    want_logits, want = _run(plain, batch)
    assert got and all("lora_" in n for n in got)
    _assert_bitwise(got_logits, got, want_logits, want)
