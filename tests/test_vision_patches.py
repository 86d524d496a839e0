"""Patches on vision-language twins, each proven against unpatched transformers on the same weights: packing on
every family but Gemma 3 (packed rows of image + text documents: every document's logits and every LoRA gradient
equal to the documents run alone; on the mrope families, Qwen2.5-VL / Qwen3-VL / Qwen3-VL-MoE, each document's 3-D
rope positions are computed as if it were alone), refused with its reason where it is not exact (Gemma 3's
bidirectional image attention) with the model left as it was; MoE routing on Qwen3-VL-MoE's experts.

Packed-vs-alone tolerance: logits ``rtol=1e-4, atol=1e-5`` per element; gradients per tensor,
``max|got - want| <= 1e-6 + 1e-5 * max|want|`` (fp32: the packed row sums the same terms in another order, and
MoE routing groups other tokens per expert; measured at most 5.9e-7 of the tensor's largest element)."""

from __future__ import annotations

import pytest
import torch

from fastkit import FastModel, registry
from fastkit.families.vision import twin_image, vision_twin, vision_twin_processor
from fastkit.patching import active_patches, report
from tests.helpers import assert_tensors_close

PACKED_ROWS = tuple(t for t, f in registry.MODEL_TABLE.items() if f.vision is not None and not f.vision.packing_refusal)


def _docs(processor):
    """Two chats (one and two images): each as the processor makes it, batch of one."""
    out = []
    for n, text in ((1, "What is it?"), (2, "Which one is larger, and why?")):
        parts = [{"type": "image"}] * n + [{"type": "text", "text": text}]
        msgs = [{"role": "user", "content": parts}, {"role": "assistant", "content": f"The answer {n}."}]
        rendered = processor.apply_chat_template(msgs, tokenize=False)
        out.append(dict(processor(text=[rendered], images=[[twin_image(10 * n + i) for i in range(n)]],
                                  return_tensors="pt")))
    return out


def _pack(docs):
    """The documents as one packed row: ids and positions concatenated (positions restart per document), images
    in order (Idefics3's ``(rows, images, ...)`` layout: one row holding every image)."""
    ids = torch.cat([d["input_ids"] for d in docs], dim=1)
    pos = torch.cat([torch.arange(d["input_ids"].shape[1]) for d in docs])[None]
    packed = dict(input_ids=ids, position_ids=pos)
    per_row = "pixel_attention_mask" in docs[0]  # Idefics3: (rows, images, ...)
    for key in ("pixel_values", "pixel_attention_mask", "image_grid_thw", "token_type_ids"):
        if key in docs[0]:
            packed[key] = torch.cat([d[key] for d in docs], dim=1 if per_row or key == "token_type_ids" else 0)
    return packed


def _weighted(logits: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (logits * torch.randn(logits.shape, generator=g)).sum()


@pytest.mark.parametrize("model_type", PACKED_ROWS)
def test_packed_image_documents_equal_unpacked_logits_and_lora_gradients(model_type):
    model, processor = FastModel.from_pretrained(model_type, twin=True, max_seq_length=256)
    assert registry.PACKING in active_patches(model)
    model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False)
    with torch.no_grad():  # non-zero B factors: the LoRA path is in the logits too
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    model.train()
    docs = _docs(processor)
    lens = [d["input_ids"].shape[1] for d in docs]
    alone, loss = [], 0
    for i, d in enumerate(docs):
        logits = model(**d).logits
        alone.append(logits.detach())
        loss = loss + _weighted(logits, i)
    loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    packed = model(**_pack(docs)).logits
    split = packed.split(lens, dim=1)
    sum(_weighted(s, i) for i, s in enumerate(split)).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    for a, b in zip(split, alone):
        torch.testing.assert_close(a.detach(), b, rtol=1e-4, atol=1e-5)
    assert_tensors_close(got, want, atol=1e-6, rtol=1e-5, per="tensor")
    assert (packed.detach().split(lens, dim=1)[1] - alone[1]).abs().max() < 1e-4


def test_packing_without_the_patch_mixes_documents():
    """The proof above has teeth: the same packed row on the unpatched twin differs from the documents alone."""
    model_type = PACKED_ROWS[0]
    model, processor = vision_twin(model_type), vision_twin_processor(model_type)
    docs = _docs(processor)
    with torch.no_grad():
        packed = model(**{k: v for k, v in _pack(docs).items() if k != "position_ids"}).logits
        second = model(**docs[1]).logits
    assert (packed[:, docs[0]["input_ids"].shape[1]:] - second).abs().max() > 1e-3


@pytest.mark.parametrize("model_type", [t for t, f in registry.MODEL_TABLE.items()
                                        if f.vision is not None and f.vision.packing_refusal])
def test_packing_refused_with_the_reason_and_the_model_untouched(model_type):
    vision = {"vision": True} if registry.MODEL_TABLE[model_type].text_config else {}
    model, _ = FastModel.from_pretrained(model_type, twin=True, max_seq_length=256, **vision)
    why = report(model).skipped[registry.PACKING]
    assert registry.PACKING not in active_patches(model) and why in report(model).banner()
    assert "bidirectional" in why
    plain = vision_twin(model_type)
    assert str(model.config.get_text_config()._attn_implementation) == str(
        plain.config.get_text_config()._attn_implementation)
    for (name, a), (_, b) in zip(model.named_parameters(), plain.named_parameters()):
        assert torch.equal(a, b), name


def test_moe_routing_on_qwen3_vl_moe_experts_equals_unpatched():
    """fastkit's sort-based routing on Qwen3-VL-MoE's experts: logits and every gradient (experts, router, vision
    tower) equal to unpatched transformers on the same weights, on an image + text batch."""
    model_type = next(t for t, f in registry.MODEL_TABLE.items() if f.vision is not None and f.moe)
    model, processor = FastModel.from_pretrained(model_type, twin=True, max_seq_length=256, patches=["moe"])
    assert active_patches(model) == [registry.MOE]
    plain = vision_twin(model_type)
    batch = _docs(processor)[1]
    grads = []
    for m in (model.train(), plain.train()):
        logits = m(**batch).logits
        _weighted(logits, 0).backward()
        grads.append((logits.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}))
    (got_logits, got), (want_logits, want) = grads
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    assert got.keys() == want.keys() and any(".experts." in n for n in got)
    assert_tensors_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("model_type", [t for t in PACKED_ROWS
                                        if registry.MODEL_TABLE[t].vision.rope == registry.MROPE])
def test_mrope_packed_by_lengths_equals_alone(model_type):
    """The other way to mark a packed row (fastkit's per-row lengths, no position_ids, the processor's
    mm_token_type_ids concatenated): each document's logits are its logits alone (measured 0.0)."""
    from fastkit.patches.packing import LENGTHS_KWARG

    model, processor = FastModel.from_pretrained(model_type, twin=True, max_seq_length=256)
    docs = _docs(processor)
    lens = [d["input_ids"].shape[1] for d in docs]
    packed = {k: v for k, v in _pack(docs).items() if k != "position_ids"}
    packed.update({LENGTHS_KWARG: [lens], "mm_token_type_ids": torch.cat([d["mm_token_type_ids"] for d in docs], 1)})
    with torch.no_grad():
        alone = [model(**d).logits for d in docs]
        split = model(**packed).logits.split(lens, dim=1)
    for a, b in zip(split, alone):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
