"""Training with TRL's ``SFTTrainer``, set up the way fastkit's patches expect; chat and save.

fastkit does not ship a trainer: :func:`make_trainer` returns a plain ``trl.SFTTrainer`` with
defaults that work on a 2-core CPU and on a T4 alike (precision from the device, packing on,
responses-only loss), after :func:`fastkit.data.check_dataset` has refused bad data.

Gradient checkpointing is owned by ``FastModel.get_peft_model`` / :func:`fastkit.enable_checkpointing`
(plain or offloaded); ``SFTConfig.activation_checkpointing`` stays off so TRL does not replace it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fastkit.data import check_dataset
from fastkit.loader import base_model

logger = logging.getLogger(__name__)


def _precision(model: torch.nn.Module) -> dict[str, Any]:
    """Mixed-precision flags for SFTConfig from where the model lives."""
    if model.device.type != "cuda":
        return dict(use_cpu=True, bf16=False, fp16=False)
    if torch.cuda.is_bf16_supported(including_emulation=False):
        return dict(bf16=True, fp16=False)
    return dict(bf16=False, fp16=True)  # T4 (sm75): no bf16


def make_trainer(
    model: torch.nn.Module,
    tokenizer,
    train_dataset,
    *,
    max_steps: int = 60,
    learning_rate: float = 2e-4,
    batch_size: int = 1,
    gradient_accumulation_steps: int = 1,
    max_seq_length: int | None = None,
    packing: bool = True,
    completion_only_loss: bool = True,
    drop_long: bool = False,
    output_dir: str = "outputs",
    callbacks: Sequence[Any] = (),
    seed: int = 3407,
    **sft_overrides: Any,
):
    """A ``trl.SFTTrainer`` for ``model`` on ``train_dataset`` (checked first, errors before any step).

    ``drop_long=True`` drops rows longer than ``max_seq_length`` (logged) instead of refusing the data.
    """
    from trl import SFTConfig, SFTTrainer

    max_seq_length = max_seq_length or getattr(tokenizer, "model_max_length", 2048)
    dataset = check_dataset(train_dataset, tokenizer, max_seq_length, packing=packing, drop_long=drop_long)
    base_model(model).config.use_cache = False  # never mix documents through a KV cache while training
    config = dict(
        output_dir=output_dir, max_steps=max_steps, learning_rate=learning_rate,
        per_device_train_batch_size=batch_size, gradient_accumulation_steps=gradient_accumulation_steps,
        max_length=max_seq_length, packing=packing, packing_strategy="bfd",
        completion_only_loss=completion_only_loss, activation_checkpointing=False,
        logging_steps=1, save_strategy="no", report_to=[], seed=seed, data_seed=seed,
        lr_scheduler_type="linear", warmup_steps=min(5, max_steps // 10), weight_decay=0.0,
        dataloader_pin_memory=model.device.type == "cuda", disable_tqdm=True,
        **_precision(model),
    )
    config.update(sft_overrides)
    check_distributed_mode(model, config)
    trainer = SFTTrainer(model=model, args=SFTConfig(**config), train_dataset=dataset, processing_class=tokenizer,
                         callbacks=list(callbacks))
    _attach_packed_metadata(trainer)
    return trainer


def check_distributed_mode(model: torch.nn.Module, config: dict[str, Any]) -> None:
    """Refuse, at start, a fastkit patch that cannot work with the chosen distributed mode."""
    from fastkit.errors import FastkitError
    from fastkit.patching import active_patches

    fsdp = config.get("fsdp") or ""
    fsdp = " ".join(fsdp) if isinstance(fsdp, (list, tuple)) else str(fsdp)
    fsdp_config = config.get("fsdp_config") or {}
    cpu_offload = "offload" in fsdp.split() or bool(fsdp_config.get("cpu_offload") or fsdp_config.get("offload_params"))
    if cpu_offload and "offload" in active_patches(base_model(model)):
        raise FastkitError("Activation offload (use_gradient_checkpointing='offload') and FSDP CPU offload both move "
                           "data over the same host link with pinned buffers and would fight for it. Choose one: "
                           "use_gradient_checkpointing=True with FSDP cpu_offload, or drop FSDP's cpu_offload.")


def _attach_packed_metadata(trainer) -> None:
    """Let the packing patch see host-side document lengths (the Trainer moves tensors to the device)."""
    from fastkit.patching import active_patches

    if "packing" not in active_patches(base_model(trainer.model)):
        return
    from fastkit.packing import wrap_collator

    trainer.data_collator = wrap_collator(trainer.data_collator)


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
    from fastkit.moe_lora import expert_lora_modules, save_expert_lora

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
    base = base_model(model)
    if getattr(base, "is_loaded_in_4bit", False) or getattr(base, "is_loaded_in_8bit", False):
        merged = _merged_from_disk(model, base.config._name_or_path, dtype)
    else:
        merged = _merged_copy(model)
    merged.to(dtype).save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    return str(path)


def _merged_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A CPU copy of ``model`` with LoRA merged in and no fastkit patches."""
    import copy

    from fastkit.patching import revert

    device = model.device
    model.to("cpu")
    try:
        merged = copy.deepcopy(model)
    finally:
        model.to(device)
    from fastkit.moe_lora import merge_expert_lora

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

    from fastkit.moe_lora import load_expert_lora, merge_expert_lora
    from fastkit.patching import revert

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
