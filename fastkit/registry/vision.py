"""Image-text-to-text families: :class:`VisionFacts` (a row's ``vision`` field) and each family's facts, read by the
loader, LoRA targeting, the data checks, the planner, the census and the mmproj writer through the rows of
:data:`fastkit.registry.MODEL_TABLE` (docs/vision.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MROPE = "mrope"
"""Multi-axis rope (Qwen's): 3-D ``position_ids`` (time, height, width) from the image grid."""
ROPE_1D = "1d"
"""Ordinary 1-D positions: an image's tokens take consecutive positions like text."""


@dataclass(frozen=True)
class VisionFacts:
    """What fastkit knows about an image-text-to-text family (``AutoModelForImageTextToText`` + ``AutoProcessor``),
    each fact read by the loader, LoRA targeting, the data checks, the planner and the census of its twin."""

    tower: str
    """Module path of the vision tower inside the ``*ForConditionalGeneration`` model (``model.visual``)."""
    projector: str
    """Module path of the vision-to-text projector (inside the tower for Qwen: ``model.visual.merger``)."""
    language_model: str
    """Module path of the language model (the decoder LoRA targets by default)."""
    image_token: str
    """The token an image expands to, once per image feature (``<|image_pad|>``)."""
    image_token_key: str
    """The config key holding that token's id (``image_token_id`` / ``image_token_index``)."""
    image_part: str
    """What a chat template writes for one ``{"type": "image"}`` part before the processor expands it."""
    rope: str = ROPE_1D
    """:data:`MROPE` or :data:`ROPE_1D`. Packed rows of an mrope row get each document's 3-D rope positions computed
    as if it were alone (:mod:`fastkit.patches.packing.mrope`); 1-D rows restart their positions per document."""
    twin_tokens: tuple[tuple[str, str], ...] = ()
    """The twin tokenizer's added special tokens as ``(config key, token)``; key ``""``: no config key."""
    twin_tokenizer_attrs: tuple[tuple[str, str], ...] = ()
    """Attributes the family's processor reads off its tokenizer (Gemma 3's ``boi_token``), set on the twin's."""
    twin_vision: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    """The twin's ``vision_config`` overrides (a tower of a few thousand parameters)."""
    twin_top: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    """The twin's top-level config overrides (Gemma 3's ``mm_tokens_per_image``, Idefics3's ``scale_factor``)."""
    image_processor: str = ""
    """transformers' image processor class of the twin (the PIL one: no torchvision needed)."""
    twin_images: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    """That image processor's options on the twin (small images)."""
    processor: str = ""
    """transformers' processor class of the twin."""
    twin_processor: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    """That processor's options on the twin (image tokens per image)."""
    twin_text: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    """The twin's ``text_config`` overrides on top of the shrunk defaults."""
    packing_refusal: str = ""
    """Why packing is refused on this vision-language model although its positions are 1-D (shown in the banner;
    the model stays as it was)."""
    gguf_projector: str = ""
    """llama.cpp's projector type (clip-impl.h's ``PROJECTOR_TYPE`` name) :mod:`fastkit.export.gguf.mmproj` writes the
    vision tower + projector as (``"idefics3"``, ``"gemma3"``, ``"qwen2.5vl_merger"``, ``"qwen3vl_merger"``); ``""``:
    no mmproj, so ``save_gguf`` refuses the family (a text-only GGUF would drop the tuned vision)."""
    gguf_renames: tuple[tuple[str, str], ...] = ()
    """``(pattern, replacement)`` from the in-memory tensor names to the checkpoint names gguf's MMPROJ map knows
    (transformers 5 loads Gemma 3's tower flat)."""
    gguf_shell: str = ""
    """The transformers causal-LM class that hosts the language model for the text GGUF where
    ``AutoModelForCausalLM`` has none for its text config (Qwen2.5-VL's text model: ``Qwen2ForCausalLM``'s layers
    with mrope; :mod:`fastkit.export.gguf.mmproj`); ``""``: ``AutoModelForCausalLM``."""


# ---- Image-text-to-text families (docs/vision.md; proof: tests/test_vision.py on their twins). ----
_TWIN_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
_TWIN_TEXT = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                 num_hidden_layers=2, vocab_size=384, max_position_embeddings=32768)
_QWEN_TOKENS = (("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
                ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"))
_QWEN_MROPE = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}  # sums to head_dim / 2
_QWEN_VISION = dict(language_model="model.language_model", image_token="<|image_pad|>",
                    image_token_key="image_token_id", image_part="<|vision_start|><|image_pad|><|vision_end|>",
                    rope=MROPE, twin_tokens=_QWEN_TOKENS, image_processor="Qwen2VLImageProcessorPil")
_QWEN_MMPROJ_RENAMES = ((r"^model\.visual\.", "visual."),)
QWEN2_5_VL = VisionFacts(
    tower="model.visual", projector="model.visual.merger", **_QWEN_VISION,
    twin_vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                     window_size=56, fullatt_block_indexes=[1]),
    twin_images=dict(patch_size=14, merge_size=2, size={"shortest_edge": 56 * 56, "longest_edge": 56 * 56}),
    processor="Qwen2_5_VLProcessor", twin_text=dict(_TWIN_TEXT, rope_parameters=_QWEN_MROPE),
    gguf_projector="qwen2.5vl_merger", gguf_renames=_QWEN_MMPROJ_RENAMES, gguf_shell="Qwen2ForCausalLM")
QWEN3_VL = VisionFacts(
    tower="model.visual", projector="model.visual.merger", **_QWEN_VISION,
    twin_vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
                     num_position_embeddings=16, deepstack_visual_indexes=[0]),
    twin_images=dict(patch_size=16, merge_size=2, size={"shortest_edge": 64 * 64, "longest_edge": 64 * 64}),
    processor="Qwen3VLProcessor",
    twin_text=dict(_TWIN_TEXT, rope_parameters=dict(_QWEN_MROPE, mrope_interleaved=True)),
    gguf_projector="qwen3vl_merger", gguf_renames=_QWEN_MMPROJ_RENAMES, gguf_shell="Qwen3ForCausalLM")
GEMMA3 = VisionFacts(
    tower="model.vision_tower", projector="model.multi_modal_projector", language_model="model.language_model",
    image_token="<image_soft_token>", image_token_key="image_token_index", image_part="<start_of_image>",
    twin_tokens=(("boi_token_index", "<start_of_image>"), ("image_token_index", "<image_soft_token>"),
                 ("eoi_token_index", "<end_of_image>")),
    twin_tokenizer_attrs=(("boi_token", "<start_of_image>"), ("image_token", "<image_soft_token>"),
                          ("eoi_token", "<end_of_image>")),
    twin_vision=dict(_TWIN_VISION, image_size=28, patch_size=14, vision_use_head=False),
    twin_top=dict(mm_tokens_per_image=4),
    image_processor="Gemma3ImageProcessorPil", twin_images=dict(size={"height": 28, "width": 28}),
    processor="Gemma3Processor", twin_processor=dict(image_seq_length=4),
    packing_refusal="an image's tokens attend to each other bidirectionally (token_type_ids, Gemma 3's mask "
                    "function), which fastkit's per-document causal kernels do not express; packed batches are "
                    "refused, padded batches train as usual",
    twin_text=dict(_TWIN_TEXT, query_pre_attn_scalar=16, sliding_window=8,
                   layer_types=["sliding_attention", "full_attention"]),
    gguf_projector="gemma3", gguf_renames=((r"^model\.vision_tower\.", "vision_tower.vision_model."),
                                           (r"^model\.multi_modal_projector\.", "multi_modal_projector."),
                                           (r"_weight$", ".weight")))
IDEFICS3 = VisionFacts(
    tower="model.vision_model", projector="model.connector", language_model="model.text_model",
    image_token="<image>", image_token_key="image_token_id", image_part="<image>",
    twin_tokens=(("", "<fake_token_around_image>"), ("image_token_id", "<image>"), ("", "<end_of_utterance>"),
                 ("", "<global-img>")),
    twin_vision=dict(_TWIN_VISION, image_size=64, patch_size=16), twin_top=dict(scale_factor=2),
    image_processor="Idefics3ImageProcessorPil",
    twin_images=dict(do_image_splitting=False, size={"longest_edge": 64}, max_image_size={"longest_edge": 64}),
    processor="Idefics3Processor", twin_processor=dict(image_seq_len=4),
    twin_text=dict(_TWIN_TEXT, tie_word_embeddings=False), gguf_projector="idefics3")
"""SmolVLM (v1: model_type idefics3) and SmolVLM2 (smolvlm): one layout. The smolvlm twin's processor is
Idefics3Processor (the same prompt for an unsplit image; SmolVLMProcessor needs num2words and a torchvision
video processor)."""
