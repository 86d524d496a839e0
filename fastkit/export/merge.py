"""Merge LoRA into the base checkpoint shard by shard, in bounded host RAM.

``save_merged`` used to rebuild the whole model on the host (29.5 GB for Qwen3-14B in fp16, on a
Colab runtime with ~12.7 GB). Here the base model's own ``*.safetensors`` shards are read one at a
time: each tensor is cast to the output dtype, the adapter update ``s * B @ A`` of the layer it
belongs to is added (computed when that tensor is reached, in fp32, then rounded once), and the
shard is written before the next one is opened. Peak host memory is about one shard plus the
adapters. The output is the same as merging the whole model and saving it (same tensor names,
values, shard layout and index).

It applies when every adapted weight is an ``nn.Linear`` weight stored under its module name in
16/32-bit shards. Otherwise (fastkit expert LoRA, PEFT ``target_parameters``, DoRA, keys that
transformers renames on load, pre-quantized shards) :func:`can_merge_shards` says why and the
caller falls back to the whole-model merge.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch

from fastkit import _hf
from fastkit.patching import revert, unwrap

logger = logging.getLogger("fastkit")
_PEFT_PREFIX = "base_model.model."


def source_files(source: str) -> tuple[Path, list[str]] | None:
    """``(folder, shard file names)`` of the base checkpoint, or None when it is not local / cached safetensors."""
    folder = Path(os.path.expanduser(str(source)))
    if not folder.is_dir():
        try:
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(str(source), allow_patterns=["*.safetensors", "*.json"],
                                            local_files_only=True))
        except Exception:  # not in the local cache: the caller falls back
            return None
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    return (folder, files) if files else None


def _adapted(model: torch.nn.Module) -> dict[str, torch.nn.Module] | str:
    """``{checkpoint key: LoRA layer}`` for every adapted linear weight, or why shard merging does not apply."""
    from fastkit.patches.moe.lora import expert_lora_modules

    if expert_lora_modules(model):
        return "fastkit expert LoRA"
    out = {}
    for name, layer in _hf.peft_lora_layers(model).items():
        base = getattr(layer, "base_layer", None)
        if not isinstance(base, torch.nn.Linear) and not _hf.is_bnb_linear(base):
            return f"{name} is not a linear layer"
        if any(getattr(layer, "use_dora", {}).values()):
            return "DoRA"
        out[name.removeprefix(_PEFT_PREFIX) + ".weight"] = layer
    return out


def _model_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """``{checkpoint key: shape}`` of the in-memory base weights (PEFT wrappers removed)."""
    import re

    out = {}
    for name, p in unwrap(model).named_parameters():
        if "lora_" in name or ".modules_to_save." in name:
            continue
        out[re.sub(r"\.(base_layer|original_module)", "", name)] = tuple(p.shape)
    return out


def can_merge_shards(model: torch.nn.Module, source: str) -> str | None:
    """None when :func:`merge_shards` applies to ``model`` with base checkpoint ``source``, else why not."""
    if not _hf.peft_lora_layers(model):
        return "no LoRA adapters"
    trained = [n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n]
    if trained:
        return f"{trained[0]} is trained outside LoRA"
    adapted = _adapted(model)
    if isinstance(adapted, str):
        return adapted
    found = source_files(source)
    if found is None:
        return f"no local safetensors for {source!r}" if source else "the base model was not loaded from a checkpoint"
    folder, files = found
    from safetensors import safe_open

    keys: set[str] = set()
    shapes = _model_shapes(model)
    for file in files:
        with safe_open(str(folder / file), framework="pt") as f:
            keys.update(f.keys())
            if any(k.endswith((".absmax", ".quant_map", ".SCB")) or "quant_state" in k for k in f.keys()):
                return "the base checkpoint is pre-quantized"
            for k in f.keys():  # a resized vocabulary (or any reshaped weight) is not the checkpoint's any more
                if k in shapes and tuple(f.get_slice(k).get_shape()) != shapes[k]:
                    return f"{k} is {shapes[k]} in memory, {tuple(f.get_slice(k).get_shape())} in the checkpoint"
    missing = [k for k in adapted if k not in keys]
    return f"adapted weights not stored under their names ({missing[0]})" if missing else None


def merge_shards(model: torch.nn.Module, source: str, path: str | Path, dtype: torch.dtype) -> list[str]:
    """Write ``source``'s shards with ``model``'s LoRA merged in, as ``dtype``, into ``path``; returns the files.

    Call :func:`can_merge_shards` first. ``config.json`` (and ``generation_config.json``) are copied with
    the dtype updated; the tokenizer is the caller's.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    adapted = _adapted(model)
    folder, files = source_files(source)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    total = 0
    for file in files:
        shard: dict[str, torch.Tensor] = {}
        with safe_open(str(folder / file), framework="pt") as f:
            for key in f.keys():
                shard[key] = _merged_tensor(f.get_tensor(key), adapted.get(key), dtype)
        total += sum(t.numel() * t.element_size() for t in shard.values())
        save_file(shard, str(path / file), metadata={"format": "pt"})
        del shard
    index = folder / "model.safetensors.index.json"
    if index.exists():
        meta = json.loads(index.read_text())
        meta.setdefault("metadata", {})["total_size"] = total
        (path / index.name).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    _write_config(unwrap(model), folder, path, dtype)
    return files


@torch.no_grad()
def _merged_tensor(tensor: torch.Tensor, layer, dtype: torch.dtype) -> torch.Tensor:
    if not tensor.is_floating_point():
        return tensor
    if layer is None:
        return tensor.to(dtype)
    delta = _hf.peft_delta(layer, "weight")
    if delta is None:
        return tensor.to(dtype)
    return (tensor.float() + delta.detach().to("cpu", torch.float32)).to(dtype)  # one rounding, like merge_and_unload


def _write_config(base: torch.nn.Module, folder: Path, path: Path, dtype: torch.dtype) -> None:
    config = base.config.to_dict()
    config.pop("quantization_config", None)
    config["dtype"] = str(dtype).replace("torch.", "")
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if (folder / "generation_config.json").exists():
        shutil.copy(folder / "generation_config.json", path / "generation_config.json")


def training_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype the model trained in: its input embeddings' (16-bit under 4-bit, never upcast by fastkit)."""
    return unwrap(model).get_input_embeddings().weight.dtype




def _save_expert_factors(model: torch.nn.Module, path: str) -> bool:
    """fastkit's expert LoRA factors live outside PEFT's adapter file: save them beside it."""
    from fastkit.patches.moe.lora import expert_lora_modules, save_expert_lora

    if not expert_lora_modules(model):
        return False
    save_expert_lora(model, path)
    return True


def merged_from_disk(model: torch.nn.Module, source: str, dtype: torch.dtype) -> torch.nn.Module:
    """Base weights reloaded in ``dtype`` on the CPU, with ``model``'s adapters merged in.

    The whole-model merge for 4/8-bit models (merging into quantized weights would round the update
    away); ``save_merged`` and ``save_gguf`` both use it.
    """
    import tempfile

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from fastkit.patches.moe.lora import merge_expert_lora
    from fastkit.patches.moe.peft_format import load_expert_lora

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        has_experts = _save_expert_factors(model, tmp)
        fresh = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, device_map={"": "cpu"}, use_safetensors=True)
        merged = PeftModel.from_pretrained(fresh, tmp).merge_and_unload()
        if has_experts:
            load_expert_lora(merged, tmp)
            merge_expert_lora(merged)
            revert(merged)
        return merged


__all__ = ["can_merge_shards", "merge_shards", "merged_from_disk", "source_files", "training_dtype"]
