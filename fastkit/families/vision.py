"""Tiny random twins of image-text-to-text families, and their processors, built in-process from the table row.

A vision twin is the family's ``*ForConditionalGeneration`` (``AutoModelForImageTextToText``) with a vision tower
of a few thousand parameters and the text model of a text twin; its processor is the family's own processor class
around the twin BPE tokenizer (the family's image tokens added, their ids written into the config) and the family's
PIL image processor on images of a few dozen pixels. Nothing here downloads anything.

    model = vision_twin("qwen2_5_vl")          # random weights, fp32, CPU
    processor = vision_twin_processor("qwen2_5_vl")
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from fastkit import _hf, registry
from fastkit.errors import FastkitError

VISION_TWIN_VOCAB = 384
"""The twin BPE tokenizer's 320 entries, then the family's image tokens (``VisionFacts.twin_tokens``)."""


def vision_facts(model_type: str) -> registry.VisionFacts:
    """The row's :class:`fastkit.registry.VisionFacts`; a ValueError for a type without one."""
    facts = registry.facts_for(model_type)
    if facts is None or facts.vision is None:
        known = ", ".join(t for t, f in registry.MODEL_TABLE.items() if f.vision is not None)
        raise ValueError(f"No vision twin for {model_type!r}: its row has no vision facts (vision rows: {known})")
    return facts.vision


def vision_chat_template(image_part: str) -> str:
    """ChatML over content that is a string or a list of ``{"type": "text"|"image"}`` parts; an image part is
    written as ``image_part`` (what the family's processor expands into its image tokens)."""
    return (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\n' }}"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        "{% if part['type'] == 'image' %}{{ '" + image_part + "' }}"
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}"
        "{{ '<|im_end|>' + '\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )


def vision_twin_tokenizer(model_type: str):
    """The twin BPE tokenizer with the family's image tokens added (ids from 320 on; those its processor reads off
    the tokenizer, Gemma 3's ``boi_token``, as named special tokens that a save keeps) and a chat template that
    writes image parts as the family does."""
    from transformers import PreTrainedTokenizerFast

    from fastkit.families.twins import twin_bpe_tokenizer

    facts = vision_facts(model_type)
    base = twin_bpe_tokenizer()
    named = dict(facts.twin_tokenizer_attrs)
    tok = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, bos_token=base.bos_token,
                                  eos_token=base.eos_token, pad_token=base.pad_token,
                                  extra_special_tokens=named or None)
    plain = [t for _, t in facts.twin_tokens if t not in named.values()]
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *plain]},
                           replace_extra_special_tokens=False)
    tok.chat_template = vision_chat_template(facts.image_part)
    tok.model_max_length = base.model_max_length
    return tok


def _token_ids(model_type: str) -> dict[str, int]:
    """Config key -> the twin tokenizer's id of that image token."""
    tok = vision_twin_tokenizer(model_type)
    return {key: tok.convert_tokens_to_ids(token) for key, token in vision_facts(model_type).twin_tokens if key}


def vision_twin_config(model_type: str, num_hidden_layers: int = 2, **text_overrides: Any):
    """The config of a tiny twin of a vision-language ``model_type``: the row's vision / text / top sizes."""
    from transformers import CONFIG_MAPPING

    facts = vision_facts(model_type)
    # deep: the row's nested dicts (rope_parameters) must not become the model's, or a change to one twin's config
    # would change every twin built after it (found by a random-order run: tests/test_vision_gguf.py)
    text = dict(copy.deepcopy(dict(facts.twin_text)), num_hidden_layers=num_hidden_layers, bos_token_id=1,
                eos_token_id=2, pad_token_id=0)
    text.update(text_overrides)
    vision_defaults = CONFIG_MAPPING[model_type]().vision_config.to_dict()
    return CONFIG_MAPPING[model_type](text_config=text, vision_config={**vision_defaults, **facts.twin_vision},
                                      **facts.twin_top, **_token_ids(model_type))


def vision_twin(model_type: str, num_hidden_layers: int = 2, seed: int = 0, dtype: torch.dtype = torch.float32,
                attn_implementation: str | None = None, **text_overrides: Any) -> torch.nn.Module:
    """A randomly initialised tiny vision-language model of ``model_type`` (deterministic for a ``seed``)."""
    from transformers import AutoModelForImageTextToText

    config = vision_twin_config(model_type, num_hidden_layers, **text_overrides)
    if attn_implementation is None:
        attn_implementation = registry.facts_for(model_type).default_attn
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    with torch.no_grad():  # a projection initialised to zeros (Gemma 3's) would cut the images off the loss
        for param in model.parameters():
            if param.dim() >= 2 and not param.any():
                param.normal_(0.0, 0.02)
    return model.eval()


def vision_twin_processor(model_type: str):
    """The family's processor around the twin tokenizer and its PIL image processor on small images."""
    import transformers

    facts = vision_facts(model_type)
    images = getattr(transformers, facts.image_processor)(**facts.twin_images)
    tokenizer = vision_twin_tokenizer(model_type)
    processor = _hf.processor_class(facts.processor)(image_processor=images, tokenizer=tokenizer,
                                                       chat_template=tokenizer.chat_template, **facts.twin_processor)
    return processor


def twin_image(seed: int = 0, size: tuple[int, int] = (64, 48)):
    """A small deterministic RGB image (PIL) for twin runs and tests."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), mode="RGB")


def wants_vision(facts: registry.ModelFacts | None, vision: bool | None, model_type: str) -> bool:
    """Load as a vision-language model (``AutoModelForImageTextToText`` + ``AutoProcessor``)? ``vision=None``: where
    the row has vision facts and is not a composite loaded as text by default (Gemma 3: ``vision=True``)."""
    row_vision = facts is not None and facts.vision is not None
    if vision is None:
        vision = row_vision and not facts.text_config
        if vision:
            _require_pillow(model_type)
        return vision
    if not isinstance(vision, bool):
        raise FastkitError(f"vision must be True, False or None, got {vision!r}.")
    if vision and not row_vision:
        known = ", ".join(t for t, f in registry.MODEL_TABLE.items() if f.vision is not None)
        raise FastkitError(f"vision=True: {model_type} is not a vision-language family fastkit knows (its rows: "
                           f"{known}); load it without vision=True.")
    if not vision and row_vision and not facts.text_config:
        raise FastkitError(f"vision=False: {model_type} loads only as a vision-language model (its text model alone "
                           "is not a checkpoint fastkit loads); drop vision=False and train on text rows.")
    if vision:
        _require_pillow(model_type)
    return vision


def _require_pillow(model_type: str) -> None:
    """A vision-language model's processor reads images with Pillow (the ``vision`` extra): named before the load."""
    from fastkit.extras import require

    require("PIL", f"{model_type}, a vision-language model (its processor reads images)")


def load_processor(name_or_path: str, trust_remote_code: bool, hf_kwargs: dict):
    """The family's processor (tokenizer + image processor), with a pad token like the text loader's."""
    import importlib.util

    from transformers import AutoProcessor

    hub = {k: v for k, v in (hf_kwargs or {}).items() if k in ("revision", "token")}
    try:
        try:
            processor = AutoProcessor.from_pretrained(name_or_path, trust_remote_code=trust_remote_code, **hub)
        except (ImportError, AttributeError, OSError):  # a video processor without torchvision: images only
            if importlib.util.find_spec("torchvision") is not None:
                raise
            processor = _hf.processor_class(_processor_name(name_or_path, hub)).from_pretrained(name_or_path, **hub)
    except (OSError, ValueError, ImportError) as exc:
        raise FastkitError(f"Could not load a processor from {name_or_path!r} (preprocessor_config.json / "
                           f"tokenizer files missing or unreadable): {str(exc).splitlines()[0]}") from exc
    tok = processor.tokenizer
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return processor


def _processor_name(name_or_path: str, hub: dict) -> str:
    """The processor class a checkpoint names (``processor_config.json``, else ``tokenizer_config.json``)."""
    import json

    from transformers.utils import cached_file

    for file in ("processor_config.json", "tokenizer_config.json"):
        path = cached_file(name_or_path, file, _raise_exceptions_for_missing_entries=False, **hub)
        if path is not None:
            with open(path, encoding="utf-8") as f:
                if name := json.load(f).get("processor_class"):
                    return name
    raise FastkitError(f"{name_or_path!r} names no processor class (processor_config.json / tokenizer_config.json).")


__all__ = ["VISION_TWIN_VOCAB", "twin_image", "vision_chat_template", "vision_facts", "vision_twin", "wants_vision",
           "load_processor",
           "vision_twin_config", "vision_twin_processor", "vision_twin_tokenizer"]
