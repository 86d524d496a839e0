"""A vision-language model as llama.cpp runs it: the language model as a text GGUF (the text writer,
:mod:`fastkit.export.gguf.writer`) plus an mmproj GGUF, the vision tower and projector that llama.cpp's
multimodal library (``libmtmd``, tools/mtmd/clip.cpp) loads beside it.

Families written: SmolVLM / Idefics3 (``idefics3``, ``smolvlm``): a SigLIP tower, pixel shuffle and one linear
projection, llama.cpp's projector type ``idefics3``; Gemma 3 (``gemma3``): a SigLIP tower, average pooling, an RMS
norm (Gemma's ``1 + w`` folded in) and one projection, projector type ``gemma3``; Qwen2.5-VL (``qwen2_5_vl``): Qwen's
ViT (2-D rope, window attention every block but each n-th, RMS norms, gated SiLU MLP) and the 2x2 merger MLP,
projector type ``qwen2.5vl_merger``, its fused ``qkv`` split into q / k / v and its Conv3D patch kernel into the
two Conv2D kernels of its two frames, as convert_hf_to_gguf.py does (conversion/qwenvl.py); its language model goes
through the text writer as llama.cpp's ``qwen2vl`` (``registry.ModelFacts.gguf_text``); Qwen3-VL (``qwen3_vl``):
Qwen3's ViT (learned position embeddings, LayerNorms, GELU MLP, fused ``qkv`` kept), the merger and the deepstack
mergers (``v.deepstack.<block>.*``, conversion/qwen3vl.py), projector type ``qwen3vl_merger``, its language model
as ``qwen3vl``. The mmproj's keys (``clip.*``,
``clip.vision.*``) and tensor names (``v.blk.N.attn_q.weight``, ``mm.model.fc.weight``) are those llama.cpp's
``convert_hf_to_gguf.py`` writes (names from ``gguf.get_tensor_name_map(MODEL_ARCH.MMPROJ)``); weights f16, biases,
norms and the embeddings f32.
A vision row without a projector here gets no GGUF (the text writer has no mapping for its composite model_type):
a text-only file would drop the vision it was tuned with.

Proof: tests/test_vision_gguf.py loads both files in llama.cpp's libmtmd and compares its image embeddings with
transformers' image features of the same model on the same image.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch

from fastkit import registry
from fastkit.errors import FastkitError
from fastkit.patching import unwrap

logger = logging.getLogger(__name__)

IDEFICS3, GEMMA3, QWEN25VL, QWEN3VL = "idefics3", "gemma3", "qwen2.5vl_merger", "qwen3vl_merger"
"""llama.cpp's projector types fastkit writes (clip-impl.h's PROJECTOR_TYPE names)."""


class _Projectors(Mapping):
    """model_type -> the llama.cpp projector type fastkit writes for it: each vision row's
    :attr:`fastkit.registry.VisionFacts.gguf_projector`, read from the table at call time."""

    @staticmethod
    def _rows() -> dict[str, str]:
        return {t: f.vision.gguf_projector for t, f in registry.MODEL_TABLE.items()
                if f.vision is not None and f.vision.gguf_projector}

    def __getitem__(self, model_type: str) -> str:
        return self._rows()[model_type]

    def __iter__(self):
        return iter(self._rows())

    def __len__(self) -> int:
        return len(self._rows())


PROJECTORS = _Projectors()
"""model_type -> the llama.cpp projector type fastkit writes for it (the vision rows' ``gguf_projector``)."""
_QWEN_WINDOW = 112
"""The window (pixels) llama.cpp's qwen2.5vl_merger graph attends within: clip.cpp hard-codes 112 (it reads no
window key for this projector), Qwen2.5-VL's ``vision_config.window_size``."""


_ACTIVATIONS = {IDEFICS3: "gelu_pytorch_tanh", GEMMA3: "gelu_pytorch_tanh", QWEN25VL: "silu",
                QWEN3VL: "gelu_pytorch_tanh"}
"""Projector type -> the tower MLP's activation its graph computes: clip.use_gelu (ggml_gelu, the tanh
approximation) or clip.use_silu (Qwen2.5-VL's gated MLP)."""
_F32_STEMS = ("v.patch_embd", "v.position_embd")  # as convert_hf_to_gguf.py keeps SmolVLM's embeddings


def writes(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a vision-language model whose mmproj fastkit writes."""
    return getattr(unwrap(model).config, "model_type", None) in PROJECTORS


def split(model: torch.nn.Module, processor) -> tuple[torch.nn.Module, object]:
    """The text model (a causal LM sharing the vision model's language model and head: nothing copied, LoRA layers
    included) and the tokenizer to write it with. Bad input raises here, before any file is written."""
    base = unwrap(model)
    config = base.config
    if getattr(processor, "image_processor", None) is None or getattr(processor, "tokenizer", None) is None:
        raise FastkitError(f"save_gguf: a {config.model_type} model needs its processor (the one from_pretrained "
                           "returned), not a tokenizer: the mmproj records its image size, mean and std.")
    from fastkit.export.gguf.writer import _quantized

    if _quantized(model):  # the text writer would reload a causal LM from the composite checkpoint
        raise FastkitError(f"save_gguf: this {config.model_type} model is 4/8-bit; its vision tower's codes are not "
                           "weights. Save it with save_merged (16-bit), load that, then save_gguf.")
    act, want = getattr(config.vision_config, "hidden_act", None), _ACTIVATIONS[PROJECTORS[config.model_type]]
    if act != want:
        raise FastkitError(f"save_gguf: the vision tower's hidden_act is {act!r}; llama.cpp's "
                           f"{PROJECTORS[config.model_type]} graph computes {want} only. Export with save_merged "
                           "instead.")
    if PROJECTORS[config.model_type] == QWEN25VL:
        _check_qwen(config.vision_config)
    if PROJECTORS[config.model_type] == QWEN3VL:
        _check_qwen(config.vision_config, window=False)
    return _text_model(base), processor.tokenizer


def _check_qwen(vision, window: bool = True) -> None:
    """What llama.cpp's Qwen graphs (tools/mtmd/models/qwen2vl.cpp, qwen3vl.cpp) fix: 2-frame patches, 2x2 merge;
    Qwen2.5-VL's (``window``): 112-pixel windows, full attention every n-th block."""
    fixed = {"temporal_patch_size": 2, "spatial_merge_size": 2} | ({"window_size": _QWEN_WINDOW} if window else {})
    for key, value in fixed.items():
        if getattr(vision, key, value) != value:
            raise FastkitError(f"save_gguf: vision_config.{key}={getattr(vision, key)!r}; llama.cpp's Qwen vision "
                               f"graph computes {key}={value} only. Export with save_merged instead.")
    if window:
        _wa_pattern(vision)


def _wa_pattern(vision) -> int:
    """``fullatt_block_indexes`` as llama.cpp's ``n_wa_pattern`` n (blocks n-1, 2n-1, ... attend fully, the others
    within windows), refused where they are not that pattern."""
    full = list(getattr(vision, "fullatt_block_indexes", None) or [])
    depth = vision.depth
    n = full[0] + 1 if full else 0
    if not full or full != list(range(n - 1, depth, n)):
        raise FastkitError(f"save_gguf: vision_config.fullatt_block_indexes={full} (depth {depth}); llama.cpp's "
                           "qwen2.5vl_merger graph attends fully in blocks n-1, 2n-1, ... through the last such block "
                           "only. Export with save_merged instead.")
    return n


def _text_model(base: torch.nn.Module) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    facts = registry.MODEL_TABLE[base.config.model_type].vision
    text_config = base.config.text_config.__class__.from_dict(base.config.text_config.to_dict())
    body, head = base.get_submodule(facts.language_model), base.get_output_embeddings()
    text_config.tie_word_embeddings = _weight(head) is _weight(body.get_input_embeddings())
    text_config.name_or_path = base.config.name_or_path
    deepstack = getattr(base.config.vision_config, "deepstack_visual_indexes", None)
    if deepstack is not None:  # Qwen3-VL: the language model adds that many extra feature sets (qwen3vl's key)
        text_config.num_deepstack_layers = len(deepstack)
    with torch.device("meta"):  # a shell: its body and head are the vision model's own modules
        if shell := facts.gguf_shell:  # the row's host class (Qwen2.5-VL's text model: Qwen2's layers, mrope)
            text = _shell(shell, text_config)
        else:
            text = AutoModelForCausalLM.from_config(text_config)
    text.model, text.lm_head = body, head
    return text.train(base.training)


def _shell(class_name: str, text_config) -> torch.nn.Module:
    """A ``class_name`` causal LM built from its own config class holding ``text_config``'s values, then given
    ``text_config`` itself (its ``model_type`` is the one the text writer's row names)."""
    import transformers

    cls = getattr(transformers, class_name)
    values = {k: v for k, v in text_config.to_dict().items() if k != "model_type"}
    text = cls(cls.config_class(**values))
    text.config = text_config
    return text


def _weight(module: torch.nn.Module) -> torch.Tensor:
    return getattr(module, "base_layer", module).weight  # under a PEFT wrapper: the base weight


def file_name(text_file: str) -> str:
    """``<name>-<quant>.gguf`` -> ``<name>-mmproj-f16.gguf``, the mmproj beside it."""
    return f"{text_file.rsplit('-', 1)[0]}-mmproj-f16.gguf"


def _tensors(model: torch.nn.Module) -> list[tuple[str, Callable[[], torch.Tensor], tuple[int, ...]]]:
    """``(llama.cpp name, load, shape)`` of the vision tower and projector, LoRA merged in."""
    import gguf

    from fastkit.export.gguf.writer import merged_parameters

    base = unwrap(model)
    facts = registry.MODEL_TABLE[base.config.model_type].vision
    vision = base.config.vision_config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(_depth(vision), 3))  # >= 3: Qwen's mm.2
    out, unmapped = [], []
    for hf_name, load, shape in merged_parameters(model):
        if not hf_name.startswith((facts.tower + ".", facts.projector + ".")):
            continue
        name = hf_name
        for pattern, repl in facts.gguf_renames:
            name = re.sub(pattern, repl, name)
        stem, _, suffix = name.rpartition(".")
        gname = _qwen3_name(stem, vision) or names.get_name(stem)
        if gname is None or suffix not in ("weight", "bias"):
            unmapped.append(hf_name)
            continue
        shift = 1.0 if gname == "mm.soft_emb_norm" else 0.0  # Gemma's RMSNorm x·(1 + w) -> clip.cpp's x·w
        split_qkv = PROJECTORS[base.config.model_type] == QWEN25VL  # qwen3vl.cpp reads the fused qkv
        out.extend(_pieces(f"{gname}.{suffix}", _shifted(load, shift) if shift else load, tuple(shape), split_qkv))
    if unmapped:
        raise FastkitError(f"save_gguf: no llama.cpp mmproj name for {unmapped[:4]} ({len(unmapped)} tensors); this "
                           "vision checkpoint layout is not supported.")
    return out


def _depth(vision) -> int:
    return getattr(vision, "num_hidden_layers", None) or vision.depth  # Qwen: depth


def _qwen3_name(stem: str, vision) -> str | None:
    """Qwen3-VL's merger and deepstack mergers as convert_hf_to_gguf.py names them (gguf's map has neither): the
    merger's ``norm`` / ``linear_fc1`` / ``linear_fc2`` are ``v.post_ln`` / ``mm.0`` / ``mm.2``; deepstack merger k
    is ``v.deepstack.<i>.{norm,fc1,fc2}`` at the tower block i it taps (``deepstack_visual_indexes[k]``)."""
    if m := re.fullmatch(r"visual\.merger\.(norm|linear_fc1|linear_fc2)", stem):
        return {"norm": "v.post_ln", "linear_fc1": "mm.0", "linear_fc2": "mm.2"}[m[1]]
    if m := re.fullmatch(r"visual\.deepstack_merger_list\.(\d+)\.(norm|linear_fc1|linear_fc2)", stem):
        block = vision.deepstack_visual_indexes[int(m[1])]
        return f"v.deepstack.{block}.{m[2].replace('linear_', '')}"
    return None


def _pieces(name: str, load: Callable[[], torch.Tensor], shape: tuple[int, ...], split_qkv: bool = True):
    """One tensor as llama.cpp's pieces: Qwen's fused ``attn_qkv`` (3C, ...) as ``attn_q/k/v`` (C, ...) each, its
    Conv3D patch kernel (C, 3, 2, p, p) as the two Conv2D kernels of its two frames, ``v.patch_embd.weight`` and
    ``v.patch_embd.weight.1`` (C, 3, p, p), as convert_hf_to_gguf.py splits them; others as they are."""
    if split_qkv and ".attn_qkv." in name:
        c = shape[0] // 3
        return [(name.replace("attn_qkv", part), _sliced(load, 0, i * c, c), (c, *shape[1:]))
                for i, part in enumerate(("attn_q", "attn_k", "attn_v"))]
    if name == "v.patch_embd.weight" and len(shape) == 5:  # (C, 3, T=2, p, p)
        return [(name + ("", ".1")[t], _sliced(load, 2, t, None), (*shape[:2], *shape[3:])) for t in range(2)]
    return [(name, load, shape)]


def _sliced(load: Callable[[], torch.Tensor], dim: int, start: int, length: int | None) -> Callable[[], torch.Tensor]:
    """``load()`` narrowed on ``dim`` to ``length`` rows from ``start``; ``length`` None: index ``start`` (dim
    dropped)."""
    def fn() -> torch.Tensor:
        w = load()
        return w.select(dim, start) if length is None else w.narrow(dim, start, length)
    return fn


def _shifted(load: Callable[[], torch.Tensor], shift: float) -> Callable[[], torch.Tensor]:
    def fn() -> torch.Tensor:
        return load() + shift
    return fn


def _qtype(name: str, shape: tuple[int, ...]):
    import gguf

    if len(shape) == 1 or name.endswith(".bias") or name.startswith(_F32_STEMS) or "ln" in name.split(".")[-2]:
        return gguf.GGMLQuantizationType.F32
    return gguf.GGMLQuantizationType.F16


def _add_kv(writer, config, processor, name: str) -> None:
    import gguf

    vision = config.vision_config
    images = processor.image_processor
    projector = PROJECTORS[config.model_type]
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_name(name)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_clip_has_vision_encoder(True)
    writer.add_clip_projector_type(projector)
    writer.add_vision_projection_dim(config.text_config.hidden_size)
    writer.add_vision_patch_size(vision.patch_size)
    writer.add_vision_embedding_length(vision.hidden_size)
    writer.add_vision_feed_forward_length(vision.intermediate_size)
    writer.add_vision_block_count(_depth(vision))
    writer.add_vision_head_count(getattr(vision, "num_attention_heads", None) or vision.num_heads)
    writer.add_vision_image_mean([float(x) for x in images.image_mean])
    writer.add_vision_image_std([float(x) for x in images.image_std])
    if projector == QWEN25VL:
        _add_qwen_kv(writer, vision)
        return
    if projector == QWEN3VL:
        _add_qwen3_kv(writer, vision)
        return
    writer.add_vision_image_size(vision.image_size)
    writer.add_vision_attention_layernorm_eps(vision.layer_norm_eps)
    writer.add_vision_use_gelu(True)
    if projector == GEMMA3:  # the tower's patches per side over the tokens per side
        per_side = vision.image_size // vision.patch_size
        writer.add_vision_projector_scale_factor(per_side // math.isqrt(config.mm_tokens_per_image))
        return
    writer.add_vision_projector_scale_factor(int(getattr(config, "scale_factor", 2)))  # pixel shuffle
    size = getattr(images, "size", None)
    longest = size.get("longest_edge") if isinstance(size, dict) else getattr(size, "longest_edge", None)
    writer.add_vision_preproc_image_size(int(longest or vision.image_size))


def _add_qwen_kv(writer, vision) -> None:
    """Qwen2.5-VL's keys as convert_hf_to_gguf.py writes them (conversion/qwenvl.py): a nominal image size (the
    image's own size, aligned to 28 pixels, is what the graph runs), RMS norms of eps 1e-6 (transformers' hard-coded
    Qwen2RMSNorm default in the tower), the gated SiLU MLP, the window-attention pattern."""
    writer.add_vision_image_size(int(getattr(vision, "image_size", 560)))
    writer.add_vision_attention_layernorm_eps(1e-6)
    writer.add_vision_use_silu(True)
    writer.add_vision_n_wa_pattern(_wa_pattern(vision))


def _add_qwen3_kv(writer, vision) -> None:
    """Qwen3-VL's keys as convert_hf_to_gguf.py writes them (conversion/qwen3vl.py): the image size its learned
    position grid covers, LayerNorms of eps 1e-6 (transformers' tower), GELU (tanh), the 2x2 merge, which blocks
    feed a deepstack merger."""
    per_side = math.isqrt(vision.num_position_embeddings)
    writer.add_vision_image_size(per_side * vision.patch_size)
    writer.add_vision_attention_layernorm_eps(1e-6)
    writer.add_vision_use_gelu(True)
    writer.add_vision_spatial_merge_size(int(vision.spatial_merge_size))
    taps = set(vision.deepstack_visual_indexes)
    writer.add_vision_is_deepstack_layers([i in taps for i in range(vision.depth)])


def _encode(w: torch.Tensor, qtype) -> np.ndarray:
    import gguf

    dtype = np.float32 if qtype == gguf.GGMLQuantizationType.F32 else np.float16
    return w.float().contiguous().numpy().astype(dtype)


@torch.no_grad()
def write_mmproj(model: torch.nn.Module, processor, out: Path, name: str) -> Path:
    """The vision tower and projector of ``model`` as llama.cpp's mmproj GGUF at ``out``; returns ``out``."""
    import gguf

    config = unwrap(model).config
    tensors = _tensors(model)
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ])
    try:
        _add_kv(writer, config, processor, name)
        for gname, _, shape in tensors:
            dtype = np.float32 if _qtype(gname, shape) == gguf.GGMLQuantizationType.F32 else np.float16
            writer.add_tensor_info(gname, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for gname, load, shape in tensors:  # one merged tensor alive at a time
            writer.write_tensor_data(_encode(load(), _qtype(gname, shape)))
        writer.close()
    except BaseException:
        writer.close()
        out.unlink(missing_ok=True)
        raise
    logger.info("fastkit: wrote %s (%d tensors, projector %s, %.1f MB)", out.name, len(tensors),
                PROJECTORS[config.model_type], out.stat().st_size / 1e6)
    return out


def check_mmproj(model: torch.nn.Module, file: Path) -> float:
    """Read ``file`` back (gguf's reader) and compare every tensor with the model's, LoRA merged: names, shapes and
    values within f16 rounding. Returns the worst ``max|Δw| / max|w|``; raises a FastkitError otherwise."""
    import gguf

    got = {t.name: t for t in gguf.GGUFReader(str(file)).tensors}
    worst = 0.0
    for gname, load, shape in _tensors(model):
        t = got.pop(gname, None)
        if t is None:
            raise FastkitError(f"save_gguf: {gname} is missing from the mmproj read back; nothing was replaced.")
        back = torch.tensor(np.array(t.data, dtype=np.float32)).reshape(shape)
        w = load()
        err = ((back - w).abs().max() / w.abs().max().clamp_min(1e-12)).item()
        worst = max(worst, err)
        if err > 1e-3:  # f16 rounds to 2^-11 of the scale
            raise FastkitError(f"save_gguf: mmproj tensor {gname} reads back {err:.3g} of its scale away from the "
                               "model's; nothing was replaced. This is a fastkit bug for this model.")
    if got:
        raise FastkitError(f"save_gguf: the mmproj holds tensors fastkit did not plan ({sorted(got)[:3]}).")
    return worst


__all__ = ["PROJECTORS", "check_mmproj", "file_name", "split", "write_mmproj", "writes"]
