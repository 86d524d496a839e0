"""Published ``config.json`` values of the models fastkit's notebooks, docs and twins name: the planner reads
them offline (``fastkit plan Qwen/Qwen3-14B`` never touches the Hub for these).

Only what changes the memory is kept (sizes, head counts, vocabulary, tying, context, quantization); rope
fields and token ids do not. :func:`known_config` gives a copy (callers may change it). A name not here is
read from a local folder, the local Hub cache, or the Hub (``fastkit.plan.source.read_config``).

Each one's :class:`~fastkit.plan.terms.ModelShape` (what the meta-device count gives) is shipped too, in
``shapes.json``, so ``fastkit plan <shipped model>`` answers without importing torch or transformers (a third of
a second, not five). tests/test_plan_shipped.py counts every shape again from these values with the installed
transformers and fails on any difference; :func:`fastkit.plan.source.write_shapes` writes the file anew.
"""

from __future__ import annotations

import copy
import json
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

from fastkit.plan.moe_4bit_configs import GPT_OSS_20B, QWEN3_30B_A3B

_QWEN3 = dict(model_type="qwen3", head_dim=128, vocab_size=151936, max_position_embeddings=40960)
_LLAMA3 = dict(model_type="llama", vocab_size=128256, max_position_embeddings=131072)

KNOWN_CONFIGS: dict[str, dict] = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": dict(model_type="llama", hidden_size=576, intermediate_size=1536,
                                                num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                                vocab_size=49152, max_position_embeddings=8192,
                                                tie_word_embeddings=True),
    "HuggingFaceTB/SmolLM2-1.7B-Instruct": dict(model_type="llama", hidden_size=2048, intermediate_size=8192,
                                                num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=32,
                                                vocab_size=49152, max_position_embeddings=8192,
                                                tie_word_embeddings=True),
    "Qwen/Qwen3-0.6B": dict(_QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                            num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "Qwen/Qwen3-1.7B": dict(_QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                            num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "Qwen/Qwen3-4B": dict(_QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                          num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
    "Qwen/Qwen3-8B": dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                          num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    "Qwen/Qwen3-14B": dict(_QWEN3, hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                           num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False),
    "Qwen/Qwen3-32B": dict(_QWEN3, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                           num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False),
    "meta-llama/Llama-3.2-1B-Instruct": dict(_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                             num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                                             tie_word_embeddings=True),
    "meta-llama/Llama-3.2-3B-Instruct": dict(_LLAMA3, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                                             num_attention_heads=24, num_key_value_heads=8, head_dim=128,
                                             tie_word_embeddings=True),
    "meta-llama/Llama-3.1-8B-Instruct": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                             num_attention_heads=32, num_key_value_heads=8,
                                             tie_word_embeddings=False),
    "mistralai/Mistral-7B-Instruct-v0.3": dict(model_type="mistral", hidden_size=4096, intermediate_size=14336,
                                               num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                               vocab_size=32768, max_position_embeddings=32768,
                                               tie_word_embeddings=False),
    "microsoft/Phi-3-mini-4k-instruct": dict(model_type="phi3", hidden_size=3072, intermediate_size=8192,
                                             num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                                             vocab_size=32064, max_position_embeddings=4096,
                                             tie_word_embeddings=False),
    # composite checkpoint: fastkit trains its text model, so the text config is what the plan counts
    "google/gemma-3-4b-it": dict(model_type="gemma3_text", hidden_size=2560, intermediate_size=10240,
                                 num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                                 vocab_size=262208, sliding_window=1024, max_position_embeddings=131072,
                                 tie_word_embeddings=True),
    "openai/gpt-oss-20b": GPT_OSS_20B,
    "Qwen/Qwen3-30B-A3B": QWEN3_30B_A3B,
    # vision-language: the language model in text_config, the vision tower in vision_config (counted apart)
    "Qwen/Qwen2.5-VL-3B-Instruct": dict(
        model_type="qwen2_5_vl", image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
        vision_end_token_id=151653, tie_word_embeddings=True,
        text_config=dict(model_type="qwen2_5_vl_text", hidden_size=2048, intermediate_size=11008,
                         num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=128000, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                          "mrope_section": [16, 24, 24]}),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2)),
}
"""Hub id -> the memory-relevant ``config.json`` values (checked against the published files, 2026)."""
KNOWN_CONFIGS["unsloth/Qwen3-14B-bnb-4bit"] = dict(  # the pre-quantized NF4 checkpoint of Qwen3-14B
    KNOWN_CONFIGS["Qwen/Qwen3-14B"], quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True,
                                                          "bnb_4bit_quant_type": "nf4",
                                                          "bnb_4bit_use_double_quant": True})


SHAPES = Path(__file__).with_name("shapes.json")
"""Hub id -> the counted :class:`~fastkit.plan.terms.ModelShape` of its :data:`KNOWN_CONFIGS` values
(``lora_dims`` as a count of each kind of module, ``[in, out, copies, modules]``: no term depends on their order)."""


def known_config(name: str) -> dict | None:
    """A copy of ``name``'s config values, or None when fastkit does not ship them."""
    values = KNOWN_CONFIGS.get(name)
    return copy.deepcopy(values) if values is not None else None


class ShippedConfig(SimpleNamespace):
    """A shipped model's config values as attributes (``model_type``, ``max_position_embeddings``, ...), its
    ``name_or_path`` and its counted ``shape``: what the planner reads of a transformers config, without one."""


def shipped_config(name: object) -> ShippedConfig | None:
    """``name``'s :class:`ShippedConfig`, or None when it is not a shipped Hub id (or its shape is not shipped)."""
    values = known_config(name) if isinstance(name, str) else None
    shape = _shapes().get(name) if values is not None else None
    if shape is None:
        return None
    return ShippedConfig(**values, name_or_path=name, shape=copy.deepcopy(shape))  # the caller's own copy


_cache: dict = {}


def _shapes() -> dict:
    """The shipped shapes, read once."""
    if not _cache:
        from fastkit.plan.terms import ModelShape

        for name, fields in json.loads(SHAPES.read_text(encoding="utf-8")).items():
            dims = [(i, o, n) for i, o, n, modules in fields.pop("lora_dims") for _ in range(modules)]
            _cache[name] = ModelShape(**fields, lora_dims=dims)
    return _cache


def lora_dim_counts(dims) -> list[list[int]]:
    """``ModelShape.lora_dims`` as ``[in, out, copies, modules]`` per kind of module, sorted."""
    return [[*kind, n] for kind, n in sorted(Counter(tuple(d) for d in dims).items())]


__all__ = ["KNOWN_CONFIGS", "SHAPES", "ShippedConfig", "known_config", "lora_dim_counts", "shipped_config"]
