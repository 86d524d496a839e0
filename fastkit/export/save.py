"""After training: chat through the chat template (streamed, greedy or sampled), and saving (LoRA or merged).

:func:`save_lora` writes PEFT's adapter file (fastkit's expert-LoRA factors included, in PEFT's
``target_parameters`` format) and :func:`load_lora` reads it back onto a fastkit model; :func:`save_gguf`
writes a GGUF for llama.cpp / Ollama; :func:`save_merged` a plain transformers model with the adapters
folded in, which runs without fastkit.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from fastkit import checks
from fastkit.patching import revert, unwrap

logger = logging.getLogger("fastkit")


@torch.no_grad()
def chat(model: torch.nn.Module, tokenizer, prompt: str | list[dict], max_new_tokens: int = 64, *,
         stream: bool | None = None, temperature: float | None = None, top_p: float | None = None,
         do_sample: bool | None = None, enable_thinking: bool | None = None, reasoning_effort: str | None = None,
         chat_template_kwargs: dict[str, Any] | None = None, streamer=None) -> str:
    """The model's answer to ``prompt`` (a user message or a message list) through the chat template.

    - ``stream``: print tokens as they are generated (``transformers.TextStreamer``); default: on in a
      notebook, off elsewhere. ``streamer`` takes your own (e.g. a ``TextIteratorStreamer``) instead.
    - Sampling: greedy unless ``do_sample=True`` or a ``temperature`` > 0 is given (then ``top_p`` applies).
    - Chat-template options go to ``apply_chat_template``: ``enable_thinking`` (Qwen3: False skips the
      reasoning block), ``reasoning_effort`` (GPT-OSS: "low" / "medium" / "high"), any others through
      ``chat_template_kwargs``; options a template does not use are ignored by it.

    Generation runs in eval mode with the KV cache on (training sets ``config.use_cache=False``, which
    stays as it is for the next training step); the train/eval mode is restored, and fastkit's patches stay in
    place (packing reads no packed metadata outside a training batch, so generation is plain attention).
    Returns the answer text (special tokens and surrounding whitespace removed).
    """
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    template_kwargs = dict(chat_template_kwargs or {})
    for key, value in (("enable_thinking", enable_thinking), ("reasoning_effort", reasoning_effort)):
        if value is not None:
            template_kwargs[key] = value
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True,
                                           **template_kwargs)
    inputs = {k: v.to(model.device) for k, v in inputs.items()}
    sample = do_sample if do_sample is not None else bool(temperature)
    gen = dict(max_new_tokens=max_new_tokens, do_sample=sample, use_cache=True, pad_token_id=tokenizer.pad_token_id)
    if sample:
        gen.update({k: v for k, v in (("temperature", temperature), ("top_p", top_p)) if v is not None})
    if streamer is None and (stream if stream is not None else _in_notebook()):
        from transformers import TextStreamer

        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    if streamer is not None:
        gen["streamer"] = streamer
    was_training = model.training
    model.eval()
    try:
        out = model.generate(**inputs, **gen)  # use_cache=True wins over config.use_cache=False from training
    finally:
        model.train(was_training)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def _in_notebook() -> bool:
    from fastkit.dashboard.views import in_notebook

    return in_notebook()


def save_lora(model: torch.nn.Module, tokenizer, path: str | Path) -> str:
    """Save LoRA adapters (safetensors) and the tokenizer to ``path``, in PEFT's format for every family.

    fastkit's expert LoRA factors are written as PEFT ``target_parameters`` adapters (converted exactly),
    so ``PeftModel.from_pretrained`` on a plain transformers model, vLLM and TGI load the whole adapter;
    ``fastkit.patches.moe.load_expert_lora`` reads them back into fastkit's per-group factors.
    """
    if not hasattr(model, "peft_config"):
        raise ValueError("save_lora needs a PEFT model (FastModel.get_peft_model); use save_merged for full weights.")
    path = checks.check_save_target(path)
    model.save_pretrained(str(path), safe_serialization=True)
    checks.check_saved(path, "*.safetensors", "save_lora")
    from fastkit.patches.moe.peft_format import add_to_peft_adapter

    add_to_peft_adapter(model, str(path))  # expert factors, if any, as PEFT target_parameters
    tokenizer.save_pretrained(str(path))
    return str(path)


def load_lora(model: torch.nn.Module, path: str | Path, is_trainable: bool = True) -> torch.nn.Module:
    """Load what :func:`save_lora` wrote onto a fastkit model of the same base (4-bit experts included).

    PEFT loads the adapters of the linear layers; the expert adapters (PEFT ``target_parameters``) go into
    fastkit's per-group factors, converted exactly (:func:`fastkit.patches.moe.peft_format.load_into`), since
    4-bit experts have no parameter for PEFT to wrap. ``is_trainable=True`` continues training. Returns the
    PEFT model.
    """
    import json

    from peft import LoraConfig, PeftModel

    from fastkit.errors import FastkitError
    from fastkit.patches.moe.peft_format import expert_targets, load_into

    config_file = Path(path) / "adapter_config.json"
    if not config_file.is_file():
        raise FastkitError(f"{path}: no adapter_config.json; give the folder save_lora wrote.")
    values = json.loads(config_file.read_text())
    targets = list(values.get("target_parameters") or ())
    experts = expert_targets(model, targets)  # into fastkit's factors; the rest (a router) stays PEFT's
    for key in ("rank_pattern", "alpha_pattern"):  # fastkit writes expert patterns only for expert targets
        values[key] = {k: v for k, v in (values.get(key) or {}).items() if k not in experts}
    values["target_parameters"] = [t for t in targets if t not in experts] or None
    config = LoraConfig.from_peft_type(**{k: v for k, v in values.items() if k != "peft_version"})
    peft_model = PeftModel.from_pretrained(model, str(path), config=config, is_trainable=is_trainable)
    if experts:
        load_into(peft_model, str(path), targets=experts)
        if not is_trainable:
            for p in peft_model.parameters():
                p.requires_grad_(False)
    return peft_model


def _save_expert_factors(model: torch.nn.Module, path: str) -> bool:
    """fastkit's expert LoRA factors live outside PEFT's adapter file: save them beside it."""
    from fastkit.patches.moe.lora import expert_lora_modules, save_expert_lora

    if not expert_lora_modules(model):
        return False
    save_expert_lora(model, path)
    return True


def save_merged(model: torch.nn.Module, tokenizer, path: str | Path, dtype: torch.dtype | None = None) -> str:
    """Merge LoRA into the weights and save a plain transformers model in ``dtype`` (safetensors).

    ``dtype`` defaults to the training dtype (the embeddings', 16-bit under 4-bit). The in-memory model
    keeps its adapters. When the base checkpoint's safetensors are on disk (a local folder or the Hub
    cache), the merge goes shard by shard (:mod:`fastkit.export.merge`): host RAM about one shard plus the
    adapters, no VRAM. Otherwise it runs on a CPU copy of the model; a 4/8-bit model is then merged
    into its base weights reloaded in ``dtype`` (merging into quantized weights would round the update away).
    """
    from fastkit.export.merge import can_merge_shards, merge_shards, training_dtype

    path = checks.check_save_target(path)
    base = unwrap(model)
    dtype = dtype or training_dtype(model)
    why_not = can_merge_shards(model, base.config.name_or_path)
    if why_not is None:
        merge_shards(model, base.config.name_or_path, path, dtype)
        checks.check_saved(path, "*.safetensors", "save_merged")
        tokenizer.save_pretrained(str(path))
        return str(path)
    logger.info("fastkit: save_merged merges a whole-model copy in host RAM (%s)", why_not)
    if getattr(base, "is_loaded_in_4bit", False) or getattr(base, "is_loaded_in_8bit", False):
        merged = _merged_from_disk(model, base.config.name_or_path, dtype)
    else:
        merged = _merged_copy(model)
    merged.to(dtype).save_pretrained(str(path), safe_serialization=True)
    checks.check_saved(path, "*.safetensors", "save_merged")
    tokenizer.save_pretrained(str(path))
    return str(path)


def _merged_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A CPU copy of ``model`` with LoRA merged in and no fastkit patches."""
    import copy

    from fastkit.patches.offload.patch import CONTROLLER_ATTR

    device = model.device
    model.to("cpu")
    # the offload controller (queues, streams) cannot be copied: the copy shares it until revert drops it
    controller = getattr(unwrap(model), CONTROLLER_ATTR, None)
    memo = {} if controller is None else {id(controller): controller}
    try:
        merged = copy.deepcopy(model, memo)
    finally:
        model.to(device)
    from fastkit.patches.moe.lora import merge_expert_lora

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


def save_gguf(model: torch.nn.Module, tokenizer, path: str | Path, quantization: str = "q8_0",
              name: str | None = None) -> str:
    """Write a GGUF (LoRA merged, tokenizer and chat template embedded) and an Ollama ``Modelfile`` into
    folder ``path``; ``quantization`` is ``"f16"``, ``"bf16"``, ``"q8_0"`` or ``"q4_0"`` (written by fastkit), or
    ``"q4_k_m"`` / ``"q5_k_m"`` / ``"q6_k"`` (llama.cpp's quantizer; needs ``fastkit-llm[llamacpp]``). Returns the
    .gguf path. See :mod:`fastkit.export.gguf` and docs/export.md."""
    from fastkit.export.gguf import save_gguf as _save_gguf

    return _save_gguf(model, tokenizer, path, quantization=quantization, name=name)


__all__ = ["chat", "load_lora", "save_gguf", "save_lora", "save_merged"]
