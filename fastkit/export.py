"""After training: greedy chat through the chat template, and saving (LoRA adapters or merged weights).

:func:`save_lora` writes PEFT's adapter file (plus fastkit's expert-LoRA factors beside it, when
the model has them); :func:`save_merged` writes a plain transformers model with the adapters
folded in, which runs without fastkit.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fastkit.patching import revert, unwrap


@torch.no_grad()
def chat(model: torch.nn.Module, tokenizer, prompt: str | list[dict], max_new_tokens: int = 64) -> str:
    """Greedy answer to ``prompt`` (a user message or a message list) through the chat template."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    inputs = {k: v.to(model.device) for k, v in inputs.items()}
    was_training = model.training
    model.eval()
    try:
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, use_cache=True,
                             pad_token_id=tokenizer.pad_token_id)
    finally:
        model.train(was_training)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def save_lora(model: torch.nn.Module, tokenizer, path: str | Path) -> str:
    """Save LoRA adapters (safetensors) and the tokenizer to ``path``."""
    if not hasattr(model, "peft_config"):
        raise ValueError("save_lora needs a PEFT model (FastModel.get_peft_model); use save_merged for full weights.")
    model.save_pretrained(str(path), safe_serialization=True)
    _save_expert_factors(model, str(path))
    tokenizer.save_pretrained(str(path))
    return str(path)


def _save_expert_factors(model: torch.nn.Module, path: str) -> bool:
    """fastkit's expert LoRA factors live outside PEFT's adapter file: save them beside it."""
    from fastkit.patches.moe_lora import expert_lora_modules, save_expert_lora

    if not expert_lora_modules(model):
        return False
    save_expert_lora(model, path)
    return True


def save_merged(model: torch.nn.Module, tokenizer, path: str | Path, dtype: torch.dtype = torch.float16) -> str:
    """Merge LoRA into the weights and save a plain transformers model in ``dtype`` (safetensors).

    The in-memory model keeps its adapters. The merge runs on a CPU copy, so it costs host RAM, not
    VRAM; a 4/8-bit model is merged into its base weights reloaded in ``dtype`` (merging into
    quantized weights would round the update away).
    """
    base = unwrap(model)
    if getattr(base, "is_loaded_in_4bit", False) or getattr(base, "is_loaded_in_8bit", False):
        merged = _merged_from_disk(model, base.config.name_or_path, dtype)
    else:
        merged = _merged_copy(model)
    merged.to(dtype).save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    return str(path)


def _merged_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A CPU copy of ``model`` with LoRA merged in and no fastkit patches."""
    import copy

    device = model.device
    model.to("cpu")
    try:
        merged = copy.deepcopy(model)
    finally:
        model.to(device)
    from fastkit.patches.moe_lora import merge_expert_lora

    merge_expert_lora(merged)  # fastkit expert LoRA (if any) folds into the expert weights
    if hasattr(merged, "merge_and_unload"):
        merged = merged.merge_and_unload()
    revert(merged)  # saved weights are plain transformers: no fastkit patches travel with them
    return merged


def _merged_from_disk(model: torch.nn.Module, source: str, dtype: torch.dtype) -> torch.nn.Module:
    """Base weights reloaded in ``dtype`` on the CPU, with ``model``'s adapters merged in."""
    import tempfile

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from fastkit.patches.moe_lora import load_expert_lora, merge_expert_lora

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


__all__ = ["chat", "save_lora", "save_merged"]
