"""After training: chat through the chat template (streamed, greedy or sampled), and saving (LoRA or merged).

:func:`save_lora` writes PEFT's adapter file (fastkit's expert-LoRA factors included, in PEFT's
``target_parameters`` format) and :func:`load_lora` reads it back onto a fastkit model; :func:`save_merged` a plain
transformers model with the adapters folded in, which runs without fastkit. ``save_gguf`` is the GGUF package's
(:mod:`fastkit.export.gguf`), importable here too.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from fastkit import checks
from fastkit.data.vision import is_processor
from fastkit.errors import FastkitError
from fastkit.export import hub
from fastkit.export import verified as saving
from fastkit.export.adapter_checks import write_info
from fastkit.export.gguf.save import save_gguf  # the GGUF package's entry, importable here as before
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
    messages = _chat_messages(prompt)
    if streamer is not None and not (callable(getattr(streamer, "put", None)) and callable(getattr(streamer, "end",
                                                                                               None))):
        raise FastkitError(f"chat(streamer=...) takes a transformers streamer (with put() and end(), e.g. "
                           f"TextIteratorStreamer), got {type(streamer).__name__}.")
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


def _chat_messages(prompt: Any) -> list[dict]:
    """``chat``'s prompt as a message list: a string is one user message; a list of role/content dicts as is."""
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, dict):
        raise FastkitError("chat(prompt=...) got one message dict; give a list of them ([{'role': 'user', "
                           "'content': ...}]) or the user's text as a string.")
    if not isinstance(prompt, list) or not prompt:
        raise FastkitError(f"chat(prompt=...) takes the user's text (a string) or a list of role/content messages, "
                           f"got {prompt!r:.60}.")
    for i, message in enumerate(prompt):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not (
                isinstance(content, str) or isinstance(content, list)):
            raise FastkitError(f"chat: message {i} is {message!r:.80}; each message is a dict with a 'role' and a "
                               "'content' string.")
    why = _surrogates(prompt)
    if why:
        raise FastkitError(f"chat: {why}")
    return prompt


def _surrogates(messages: list[dict]) -> str | None:
    from fastkit.data.rules import lone_surrogate

    for i, message in enumerate(messages):
        if isinstance(message.get("content"), str) and lone_surrogate(message["content"]):
            return (f"message {i} holds a lone surrogate character ({lone_surrogate(message['content'])}), which "
                    "no tokenizer can encode; fix the text (it is usually a badly decoded emoji).")
    return None


def _in_notebook() -> bool:
    from fastkit.dashboard.views import in_notebook

    return in_notebook()


def save_lora(model: torch.nn.Module, tokenizer, path: str | Path, verify: bool | None = None) -> str:
    """Save LoRA adapters (safetensors) and the tokenizer to ``path``, in PEFT's format for every family.

    fastkit's expert LoRA factors are written as PEFT ``target_parameters`` adapters (converted exactly),
    so ``PeftModel.from_pretrained`` on a plain transformers model, vLLM and TGI load the whole adapter;
    ``fastkit.patches.moe.load_expert_lora`` reads them back into fastkit's per-group factors.
    The save is verified and atomic (:mod:`fastkit.export.verified`): PEFT reads the adapter back onto this model
    and must give its logits before the folder replaces an earlier save (``verify=False`` skips the check).
    """
    if not hasattr(model, "peft_config"):
        raise FastkitError("save_lora needs a PEFT model (FastModel.get_peft_model); use save_merged for full "
                           "weights.")
    _check_not_sharded(model)
    _check_tokenizer(tokenizer, "save_lora")
    path = checks.check_save_target(path)
    _check_adapter_names(model)
    check_verify = saving.should_verify(model, None, verify, "save_lora")
    with saving.staged_folder(path, "save_lora", model) as tmp:
        model.save_pretrained(str(tmp), safe_serialization=True)
        checks.check_saved(tmp, "*.safetensors", "save_lora")
        from fastkit.patches.moe.peft_format import add_to_peft_adapter

        add_to_peft_adapter(model, str(tmp))  # expert factors, if any, as PEFT target_parameters
        write_info(model, tmp)  # the family and sizes, so load_lora can name another model's adapter
        tokenizer.save_pretrained(str(tmp))
        if check_verify:
            _verify_adapter(model, tmp)
        hub.write_card(tmp, "lora", model, str(path), check_verify)  # not PEFT's "[More Information Needed]"
    return str(path)


def _check_not_sharded(model: torch.nn.Module) -> None:
    """An FSDP-sharded model is saved by every rank together (one process holds a slice of each adapter)."""
    from fastkit.export.sharded import is_sharded

    if is_sharded(model):
        raise FastkitError("save_lora: the model is sharded by FSDP (each process holds a slice of every adapter); "
                           "call fastkit.export.sharded.save_sharded_lora(model, tokenizer, path) on every process: "
                           "it gathers the adapters and the main process saves them once.")


def _check_tokenizer(tokenizer, what: str) -> None:
    """The tokenizer is saved beside the weights (the folder then loads and chats on its own): it must be one."""
    if tokenizer is None or not callable(getattr(tokenizer, "save_pretrained", None)):
        raise FastkitError(f"{what} needs the tokenizer (the second value FastModel.from_pretrained returned), got "
                           f"{type(tokenizer).__name__}: it is saved beside the weights so the folder loads and "
                           "chats on its own.")


def _check_adapter_file(folder: Path) -> None:
    """The adapter's safetensors readable (header and sizes): a truncated copy or another file is named as such."""
    from safetensors import safe_open

    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(file), "pt") as handle:
                list(handle.keys())
        except Exception as exc:  # noqa: BLE001 -- SafetensorError, OSError: all mean the same to the user
            raise FastkitError(f"load_lora: {file} cannot be read ({type(exc).__name__}: {str(exc)[:120]}): the file "
                               "is truncated or not a safetensors file. Copy the adapter folder again whole, or "
                               "save it again.") from exc


def _check_adapter_names(model: torch.nn.Module) -> None:
    """PEFT writes an adapter other than ``default`` into ``path/<name>``: each name must stay inside ``path``."""
    for name in model.peft_config:
        if (not isinstance(name, str) or not name or name in (".", "..") or os.path.isabs(name)
                or any(c in name for c in ("/", "\\", "\0")) or name != name.strip()):
            raise FastkitError(f"save_lora: the adapter name {name!r} is not a plain folder name (PEFT writes a "
                               "non-default adapter into path/<name>, so it could land outside the output folder). "
                               "Give adapters names like 'default' or 'math_v2'.")


def _verify_adapter(model: torch.nn.Module, folder: Path) -> None:
    """PEFT loads the adapter just written beside the active one; its logits must be the active one's."""
    from fastkit.patches.moe.lora import expert_lora_modules

    if expert_lora_modules(model):  # expert factors are fastkit's, not PEFT's: load_lora's tests cover them
        from safetensors.torch import load_file

        if not load_file(str(folder / "adapter_model.safetensors")):
            raise FastkitError("save_lora: the adapter file written is empty; nothing was replaced.")
        return
    active = model.active_adapter
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    probe = "fastkit_verify"

    def load():
        model.load_adapter(str(folder), adapter_name=probe)
        model.set_adapter(probe)
        return model

    try:
        want = saving.logits_of(model, saving.probe_ids(unwrap(model).get_input_embeddings().weight.shape[0]))
        saving.verify_reload(model, load, saving.TOLERANCE[torch.float32], "save_lora", reference=want)
    finally:
        if probe in model.peft_config:
            model.set_adapter(active)
            model.delete_adapter(probe)
        for n, p in model.named_parameters():
            p.requires_grad_(flags.get(n, False))


def load_lora(model: torch.nn.Module, path: str | Path, is_trainable: bool = True) -> torch.nn.Module:
    """Load what :func:`save_lora` wrote onto a fastkit model of the same base (4-bit experts included).

    PEFT loads the adapters of the linear layers; the expert adapters (PEFT ``target_parameters``) go into
    fastkit's per-group factors, converted exactly (:func:`fastkit.patches.moe.peft_format.load_into`), since
    4-bit experts have no parameter for PEFT to wrap. ``is_trainable=True`` continues training. Returns the
    PEFT model.
    """

    from peft import LoraConfig, PeftModel

    from fastkit.export.adapter_checks import check_adapter_fits
    from fastkit.patches.moe.peft_format import expert_targets, load_into

    if not isinstance(is_trainable, bool):
        raise FastkitError(f"load_lora(is_trainable={is_trainable!r}): give True or False.")
    config_file = Path(checks.check_save_target(path, "load_lora path")) / "adapter_config.json"
    if not config_file.is_file():
        raise FastkitError(f"load_lora({str(path)!r}): no adapter_config.json there; give the folder save_lora wrote.")
    values = checks.read_adapter_config(config_file.parent, "load_lora")
    if values.get("peft_type", "LORA") != "LORA":
        raise FastkitError(f"load_lora: {config_file} is a {values.get('peft_type')} adapter; fastkit loads LoRA.")
    _check_adapter_file(config_file.parent)
    model = _without_adapter(model)  # a model that already has an adapter: this one replaces it, never nests
    check_adapter_fits(model, path, values)
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


def _without_adapter(model: torch.nn.Module) -> torch.nn.Module:
    """The base model under any PEFT adapter (removed, not merged), so a loaded adapter never nests."""
    if not hasattr(model, "peft_config"):
        return model
    from fastkit.patches.moe.lora import expert_lora_modules

    if expert_lora_modules(model):
        raise FastkitError("load_lora: this model already carries fastkit expert LoRA; load the adapter onto a "
                           "freshly loaded model (FastModel.from_pretrained) instead.")
    logger.info("fastkit: load_lora: the model's adapter %s is replaced by the one loaded", list(model.peft_config))
    return model.unload()


def save_merged(model: torch.nn.Module, tokenizer, path: str | Path, dtype: torch.dtype | None = None,
                verify: bool | None = None) -> str:
    """Merge LoRA into the weights and save a plain transformers model in ``dtype`` (safetensors).

    ``dtype`` defaults to the training dtype (the embeddings', 16-bit under 4-bit). The in-memory model
    keeps its adapters. When the base checkpoint's safetensors are on disk (a local folder or the Hub
    cache), the merge goes shard by shard (:mod:`fastkit.export.merge`): host RAM about one shard plus the
    adapters, no VRAM. Otherwise it runs on a CPU copy of the model; a 4/8-bit model is then merged
    into its base weights reloaded in ``dtype`` (merging into quantized weights would round the update away).

    Verified and atomic (:mod:`fastkit.export.verified`): transformers reloads the folder written and its logits
    must be the in-memory model's (within ``dtype`` rounding) before it replaces an earlier save; an
    interrupted or refused save leaves the earlier one as it was. ``verify=False`` skips the reload.
    """
    from fastkit.export.merge import can_merge_shards, training_dtype

    _check_tokenizer(tokenizer, "save_merged")
    path = checks.check_save_target(path)
    dtype = checks.resolve_dtype(dtype) or training_dtype(model)
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise FastkitError(f"save_merged(dtype={dtype}): give torch.float32, torch.float16 or torch.bfloat16.")
    base = unwrap(model)
    check_verify = saving.should_verify(model, dtype, verify, "save_merged")
    quantized = getattr(base, "is_loaded_in_4bit", False) or getattr(base, "is_loaded_in_8bit", False)
    reference = None
    if check_verify:  # before writing: the in-memory model's own logits, adapters active
        reference = saving.logits_of(model, saving.probe_ids(base.get_input_embeddings().weight.shape[0]))
    with saving.staged_folder(path, "save_merged", model) as tmp:
        _write_merged(model, tmp, dtype, can_merge_shards(model, base.config.name_or_path), quantized)
        checks.check_saved(tmp, "*.safetensors", "save_merged")
        tokenizer.save_pretrained(str(tmp))
        if check_verify:
            # 4/8-bit in memory: the merge is into the 16-bit base, so logits differ by the quantization
            # error; then the check is that the folder loads and runs with the right vocabulary
            tol = float("inf") if quantized else saving.TOLERANCE[dtype]
            vision = is_processor(tokenizer)  # a vision-language model saves its processor
            saving.verify_reload(model, lambda: _reload(tmp, dtype, vision), tol, "save_merged", reference=reference)
        hub.write_card(tmp, "merged", model, str(path), check_verify)
    return str(path)


def _reload(folder: Path, dtype: torch.dtype, vision: bool = False) -> torch.nn.Module:
    """The folder as transformers loads it: a causal LM, or (``vision``) an image-text-to-text model."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    return auto.from_pretrained(str(folder), dtype=dtype, device_map={"": "cpu"}, use_safetensors=True)


def _write_merged(model: torch.nn.Module, folder: Path, dtype: torch.dtype, why_not: str | None,
                  quantized: bool) -> None:
    from fastkit.export.merge import merge_shards, merged_from_disk

    base = unwrap(model)
    if why_not is None:
        merge_shards(model, base.config.name_or_path, folder, dtype)
        return
    logger.info("fastkit: save_merged merges a whole-model copy in host RAM (%s)", why_not)
    merged = merged_from_disk(model, base.config.name_or_path, dtype) if quantized else _merged_copy(model)
    merged.to(dtype).save_pretrained(str(folder), safe_serialization=True)


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
    from fastkit.patches.moe.lora import add_expert_deltas, expert_deltas, merge_expert_lora
    from fastkit.patches.moe.nf4 import has_4bit_experts

    deltas = expert_deltas(merged) if has_4bit_experts(merged) else None  # 4-bit: added once dequantized
    if deltas is None:
        merge_expert_lora(merged)  # fastkit expert LoRA (if any) folds into the expert weights
    if hasattr(merged, "merge_and_unload"):
        merged = merged.merge_and_unload()
    revert(merged)  # saved weights are plain transformers: no fastkit patches travel with them
    if deltas is not None:
        add_expert_deltas(merged, deltas)  # 4-bit experts dequantized (by revert, or here), then the update
    return merged


__all__ = ["chat", "load_lora", "save_gguf", "save_lora", "save_merged"]
