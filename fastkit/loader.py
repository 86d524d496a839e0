"""``FastModel``: load a Hugging Face causal LM, pick the patches that fit, report what it did.

Every check that can fail runs before weights are read: a path that does not exist, a model
type without a causal-LM head, 4-bit or other GPU-only options on a CPU, a bad max_seq_length.
Patches go through :mod:`fastkit.patching` (idempotent, revertible, atomic) and are chosen by the
table in :mod:`fastkit.registry`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from fastkit import _hf, checks, registry
from fastkit.data.chat_template import has_chat_template
from fastkit.device import auto_dtype, pick_device
from fastkit.errors import FastkitError, GPUOnlyError
from fastkit.families.load import load_twin, patch_model
from fastkit.families.patch import LoadReport
from fastkit.families.vision import load_processor, wants_vision
from fastkit.patches.fp16.patch import protect_fp16_compute
from fastkit.patches.moe.loading import QuantizeWhileLoading
from fastkit.patches.moe.nf4 import quantize_experts
from fastkit.patches.offload.checkpointing import enable_checkpointing
from fastkit.patching import active_patches, change, report, unwrap
from fastkit.training.lora import check_target_modules, get_peft_model, prepare_kbit_training

logger = logging.getLogger("fastkit")


def _check_source(name_or_path: str, gguf_file: str | None) -> None:
    if not isinstance(name_or_path, (str, os.PathLike)) or not str(name_or_path).strip():
        raise FastkitError("name_or_path must be a local folder or a Hugging Face model id, got "
                           f"{name_or_path!r}")
    path = os.path.expanduser(str(name_or_path))
    looks_local = os.path.isabs(path) or path.startswith((".", "~")) or os.path.exists(path)
    if looks_local and not os.path.exists(path):
        raise FastkitError(f"Model path {path!r} does not exist. Pass a folder with config.json and "
                           "*.safetensors (or a GGUF file via gguf_file=), or a Hub id like 'Qwen/Qwen3-0.6B'.")
    if gguf_file and os.path.isdir(path) and not os.path.exists(os.path.join(path, gguf_file)):
        raise FastkitError(f"gguf_file {gguf_file!r} is not in {path!r}.")


def _check_options(device: torch.device, load_in_4bit: bool) -> None:
    if load_in_4bit and device.type == "cuda":  # CPU: MoE experts only, checked once the config is read
        try:
            import bitsandbytes  # noqa: F401
        except ImportError as exc:
            raise FastkitError("load_in_4bit=True needs bitsandbytes: pip install bitsandbytes") from exc


def _no_4bit_experts(config) -> tuple[str, ...]:
    """The experts classes without a 4-bit layout that ``config`` builds: its row's ``no_4bit_experts``, and those of
    its sub-configs' rows (a composite Llama-4 checkpoint builds ``llama4_text``'s experts), read from the table now."""
    configs = [config] + [getattr(config, k, None) for k in getattr(config, "sub_configs", None) or {}]
    rows = [registry.facts_for(getattr(c, "model_type", None) or "") for c in configs]
    return tuple(dict.fromkeys(c for f in rows if f is not None for c in f.no_4bit_experts))


def _check_4bit(config, facts: registry.ModelFacts | None, device: torch.device) -> None:
    """Before any weight is read: can this model load 4-bit here? (patches/moe/nf4.py stores MoE experts.)

    On a CPU only MoE experts go 4-bit, through fastkit's dequantize + matmul (bitsandbytes' CPU
    ``Linear4bit`` path is never used); dense layers stay 16/32-bit there.
    """
    if no_layout := _no_4bit_experts(config):
        raise FastkitError(f"load_in_4bit=True: {config.model_type} experts ({', '.join(no_layout)}) have no 4-bit "
                           "layout in fastkit yet; load with load_in_4bit=False.")
    if device.type != "cuda" and not (facts is not None and facts.moe):
        raise GPUOnlyError("load_in_4bit=True needs a CUDA GPU (bitsandbytes 4-bit kernels) except for MoE experts, "
                           f"which fastkit stores 4-bit on any device; {config.model_type} has none. Load in "
                           "16/32-bit instead (load_in_4bit=False) or run on a GPU runtime.")


def _check_4bit_patches(patches, quant: Quantization) -> None:
    """4-bit MoE experts run only through fastkit's ``moe`` patch (transformers' experts forward reads a 16-bit
    weight): ``patches=`` that leaves it out is refused before a weight is read."""
    wanted = checks.resolve_patches(patches, registry.PATCH_FACTORIES)
    if quant.experts_4bit and wanted != "auto" and registry.MOE not in wanted:
        raise FastkitError(f"load_in_4bit=True with patches={patches!r}: this MoE model's experts are stored 4-bit, "
                           f"and only fastkit's {registry.MOE!r} patch runs them (transformers' experts forward "
                           f"needs 16-bit weights). Keep patches='auto', add {registry.MOE!r} to the list, or load "
                           "with load_in_4bit=False.")


def _load_config(name_or_path: str, gguf_file: str | None, trust_remote_code: bool, hf_kwargs: dict):
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    from fastkit.plan.source import check_hub_answers

    _check_local_config(name_or_path)
    if not gguf_file:  # a Hub id out of reach: refused in seconds, not after huggingface_hub's retries
        check_hub_answers(name_or_path, hf_kwargs.get("revision"))
    try:
        config = AutoConfig.from_pretrained(name_or_path, gguf_file=gguf_file, trust_remote_code=trust_remote_code,
                                            **{k: v for k, v in hf_kwargs.items() if k in ("revision", "token")})
    except StrictDataclassError as exc:  # a field of the wrong type ("hidden_size": "64")
        raise FastkitError(_wrong_field(name_or_path, exc)) from exc
    except (TypeError, ValueError, KeyError, AttributeError) as exc:  # transformers' field checks on a bad value
        raise FastkitError(f"{name_or_path!r}: its config.json cannot be read as a model config "
                           f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]}); fix that field, or "
                           "download the model's config.json again.") from exc
    except OSError as exc:
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        hint = " (HF_HUB_OFFLINE=1 is set: only cached or local models load)" if offline else ""
        raise FastkitError(f"Could not read a config for {name_or_path!r}{hint}: {exc}") from exc
    row = registry.facts_for(config.model_type)
    if not _hf.has_causal_lm_head(config.model_type) and (row is None or row.vision is None):
        raise FastkitError(f"model_type {config.model_type!r} has no causal-LM head in transformers; FastModel "
                           "fine-tunes causal language models (AutoModelForCausalLM).")
    return config


def _wrong_field(name_or_path: str, exc: Exception) -> str:
    """transformers' strict config check (``Field 'hidden_size' expected int, got str (value: '64')``) in words
    naming the file and the field."""
    import re

    cause = " ".join(str(exc.__cause__ or exc).split())
    found = re.search(r"[Ff]ield '([^']+)'", cause) or re.search(r"'([^']+)'", str(exc))
    field = found.group(1) if found else "a field"
    local = os.path.join(os.path.expanduser(str(name_or_path)), "config.json")
    file = local if os.path.isfile(local) else f"{name_or_path!r}'s config.json"
    return (f"{file}: field '{field}' has the wrong type ({cause[:200]}); write it as the type named (a number "
            "without quotes for a size or count), or download the model's config.json again.")


def _check_local_config(name_or_path: str) -> None:
    """A local folder's config.json is a JSON mapping (a list or a broken file is named, not a TypeError)."""
    import json

    file = os.path.join(os.path.expanduser(str(name_or_path)), "config.json")
    if not os.path.isfile(file):
        return
    try:
        with open(file, encoding="utf-8") as f:
            values = json.load(f)
    except (OSError, ValueError) as exc:
        raise FastkitError(f"{file} is not valid JSON ({exc}); download the model's config.json again.") from exc
    if not isinstance(values, dict):
        raise FastkitError(f"{file} holds a {type(values).__name__}, not the mapping of a model config "
                           "({\"model_type\": ..., ...}); download the model's config.json again.")


def _pick_attention(facts: registry.ModelFacts | None, device: torch.device) -> str:
    """The fastest exact backend available: flash-attn 2 on Ampere+, else the family's default."""
    default = facts.default_attn if facts else "sdpa"
    if device.type == "cuda" and default == "sdpa" and torch.cuda.get_device_capability(device) >= (8, 0):
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            pass
    return default


def _from_pretrained(auto_cls, name_or_path: str, load_kwargs: dict, may_fall_back: bool):
    """``from_pretrained``; a family transformers has no sdpa for (and no row saying so) loads eager instead."""
    try:
        return auto_cls.from_pretrained(name_or_path, **load_kwargs)
    except ValueError as exc:
        if not may_fall_back or load_kwargs.get("attn_implementation") != "sdpa" or "sdpa" not in str(exc).lower():
            raise
        logger.info("fastkit: %s has no sdpa attention in transformers; loading with eager", name_or_path)
        return auto_cls.from_pretrained(name_or_path, **{**load_kwargs, "attn_implementation": "eager"})


def _load_tokenizer(name_or_path: str, gguf_file: str | None, trust_remote_code: bool, hf_kwargs: dict | None = None):
    from transformers import AutoTokenizer

    hub = {k: v for k, v in (hf_kwargs or {}).items() if k in ("revision", "token")}  # same files as the weights
    try:
        tok = AutoTokenizer.from_pretrained(name_or_path, gguf_file=gguf_file, trust_remote_code=trust_remote_code,
                                            **hub)
    except (OSError, ValueError) as exc:
        raise FastkitError(f"Could not load a tokenizer from {name_or_path!r} (tokenizer.json / tokenizer_config.json "
                           f"missing or unreadable): {str(exc).splitlines()[0]}") from exc
    if gguf_file:
        _restore_gguf_split(tok, name_or_path, gguf_file, hub)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if not has_chat_template(tok):
        logger.warning("fastkit: %s has no chat template; chat-formatted data will be refused "
                       "(fastkit.add_chat_template(model, tokenizer, source) clones one, or use plain-text data).",
                       name_or_path)
    return tok


def _restore_gguf_split(tok, name_or_path: str, gguf_file: str, hub: dict) -> None:
    """transformers' GGUF reader ignores ``tokenizer.ggml.pre`` and splits like GPT-2; put back the split the file
    names, so the tokenizer cuts text as the vocabulary was trained to (SmolLM2's digits, Qwen's, Llama-3's)."""
    from transformers.utils import cached_file

    from fastkit.export.gguf.vocab import restore_from_gguf

    path = cached_file(name_or_path, gguf_file, **hub)  # the file the weights were just read from
    if path is not None and (pre := restore_from_gguf(tok, path)) is not None:
        logger.info("fastkit: %s: restored pre-tokenizer %r (transformers' GGUF reader drops it)", gguf_file, pre)


@dataclass(frozen=True)
class Quantization:
    """How the weights are stored, decided once before loading (:func:`_quantization_mode`)."""

    linear: str = "16bit"
    """``"16bit"``; ``"bnb_4bit"``: bitsandbytes NF4 linear layers quantized as loaded (CUDA);
    ``"prequantized"``: the checkpoint is bitsandbytes 4-bit already (its own ``quantization_config``)."""
    mxfp4: bool = False
    """GPT-OSS' MXFP4 checkpoint, dequantized layer by layer as read (its kernels are inference-only)."""
    experts_4bit: bool = False
    """fastkit stores the MoE experts 4-bit (NF4, or MXFP4 kept as shipped), as read and after loading."""

    @property
    def on_device_map(self) -> bool:
        """Loaded straight onto the GPU through ``device_map`` (bitsandbytes places its own weights)."""
        return self.linear != "16bit"

    def load_kwargs(self, dtype: torch.dtype, device: torch.device) -> dict:
        """The ``from_pretrained`` arguments this mode needs."""
        kwargs: dict[str, Any] = {}
        if self.linear == "bnb_4bit":
            from transformers import BitsAndBytesConfig

            from fastkit.distributed import ranks

            # FSDP flattens and shards the 4-bit weights with the others: stored in the compute dtype (the recipe
            # accelerate and PEFT document), not bitsandbytes' default uint8
            storage = {"bnb_4bit_quant_storage": dtype} if ranks.fsdp_asked() else {}
            kwargs["quantization_config"] = BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=dtype, **storage)
        if self.mxfp4:
            from transformers import Mxfp4Config

            kwargs["quantization_config"] = Mxfp4Config(dequantize=True)
        if self.on_device_map:
            kwargs["device_map"] = {"": device.index or 0}
        return kwargs


def _quantization_mode(config, facts, device: torch.device, load_in_4bit: bool, name: str) -> Quantization:
    """The one quantization value for this load: the checkpoint's own format, the request, the device."""
    from fastkit.plan.planner import prequantized_4bit
    from fastkit.plan.terms import mxfp4_checkpoint

    prequantized = prequantized_4bit(config)  # its own quantization_config: never pass a second one
    if prequantized and device.type != "cuda":
        raise GPUOnlyError(f"{name} is a bitsandbytes 4-bit checkpoint: it needs a CUDA GPU. Load the "
                           "16-bit original on a CPU.")
    mxfp4 = mxfp4_checkpoint(config)
    if prequantized:
        linear = "prequantized"
    elif load_in_4bit and device.type == "cuda" and not mxfp4:  # CPU: no bnb
        linear = "bnb_4bit"
    else:
        linear = "16bit"
    return Quantization(linear, mxfp4, experts_4bit=load_in_4bit and facts is not None and facts.moe)


def _preflight(name_or_path, gguf_file, trust_remote_code, hf_kwargs, device, max_seq_length, load_in_4bit, gpu):
    """Everything checked before a weight is read: the files, the options, the config, the memory plan."""
    from fastkit.plan.planner import check_fits

    _check_source(name_or_path, gguf_file)
    if not gguf_file:
        checks.check_safetensors_files(name_or_path)
    _check_options(device, load_in_4bit)
    config = _load_config(name_or_path, gguf_file, trust_remote_code, hf_kwargs)
    checks.check_max_seq_length(max_seq_length, config)  # the one check of this load (Note: [max_seq_length])
    facts = registry.facts_for(config.model_type)
    quant = _quantization_mode(config, facts, device, load_in_4bit, str(name_or_path))
    if load_in_4bit:
        _check_4bit(config, facts, device)
    memory_plan = check_fits(config, device, gpu, max_seq_length, load_in_4bit or quant.linear == "prequantized")
    return config, facts, quant, memory_plan


def _load(name_or_path: str, load_kwargs: dict, quant: Quantization, may_fall_back: bool,
          vision: bool = False) -> torch.nn.Module:
    """The transformers load; 4-bit experts are stored as each tensor is read (Note: [quantize as read]).

    ``may_fall_back``: the backend was fastkit's pick, so a family with no sdpa upstream loads eager instead.
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto_cls = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    loading = QuantizeWhileLoading(keep_mxfp4=quant.mxfp4) if quant.experts_4bit else None
    with _hf.on_param_loaded(loading) if loading else contextlib.nullcontext():
        model = _from_pretrained(auto_cls, name_or_path, load_kwargs, may_fall_back)
    if loading is not None:
        logger.info("fastkit: 4-bit experts stored as read: %s", loading.summary())
    return model


class FastModel:
    """Entry point: ``model, tokenizer = FastModel.from_pretrained(...)``."""

    @staticmethod
    def from_pretrained(
        name_or_path: str,
        *,
        max_seq_length: int = 2048,
        dtype: torch.dtype | str | None = None,
        load_in_4bit: bool = False,
        gguf_file: str | None = None,
        attn_implementation: str | None = None,
        patches: str | list[str] | None = "auto",
        trust_remote_code: bool = False,
        twin: bool = False,
        gpu: str | float | None = None,
        vision: bool | None = None,
        **hf_kwargs: Any,
    ):
        """Load ``(model, tokenizer)`` with fastkit's patches applied where they fit.

        ``twin=True`` builds a tiny random model of the same architecture and an in-process
        tokenizer instead (offline; what CI runs notebooks with), see :mod:`fastkit.families.twins`.

        ``dtype`` is a ``torch.dtype`` or a name (``"bf16"``, ``"fp16"``, ``"fp32"``, ``"float16"``...);
        ``twin=True`` honours it and refuses ``load_in_4bit``. ``patches`` may also be one name (``"packing"``).

        Weights load only from safetensors (or ``gguf_file``; ``use_safetensors=False`` is refused, and a
        truncated ``*.safetensors`` in a local folder is named before loading); ``trust_remote_code`` stays off
        unless you turn it on. ``patches="auto"`` applies every patch the registry lists for the
        model type, ``None`` applies none, a list applies those names.

        Before any weight is read, the memory planner (:mod:`fastkit.plan`, LoRA r=16 with
        checkpointing) predicts the training peak on this CUDA GPU, or on ``gpu`` (a name like
        ``"t4"`` or GiB) when given: the verdict goes into the banner, and a run that cannot fit
        stops here with the knob to turn. A checkpoint already quantized with bitsandbytes 4-bit
        (``quantization_config`` in its config.json) loads as it is, ~4x smaller to download.

        Vision-language families (a row with ``vision`` facts: Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, SmolVLM /
        Idefics3, Gemma 3 with ``vision=True``) load as ``AutoModelForImageTextToText`` and return
        ``(model, processor)`` (``processor.tokenizer`` is the tokenizer); see docs/vision.md.
        """
        from fastkit.distributed import ranks

        ranks.quiet_replicas()  # under torchrun: one process reports; its PartialState picks this rank's GPU
        device = pick_device()
        dtype = checks.resolve_dtype(dtype)
        checks.check_hf_kwargs(hf_kwargs)
        if twin:
            checks.check_twin_options(dtype, load_in_4bit)
            return load_twin(str(name_or_path), device, max_seq_length, patches, dtype, vision)
        config, facts, quant, memory_plan = _preflight(name_or_path, gguf_file, trust_remote_code, hf_kwargs, device,
                                                       max_seq_length, load_in_4bit, gpu)
        _check_4bit_patches(patches, quant)
        vlm = wants_vision(facts, vision, config.model_type)
        dtype = dtype or auto_dtype(device)
        load_kwargs = dict(dtype=dtype, attn_implementation=attn_implementation or _pick_attention(facts, device),
                           trust_remote_code=trust_remote_code, **quant.load_kwargs(dtype, device))
        load_kwargs.update({"gguf_file": gguf_file} if gguf_file else {"use_safetensors": True})
        composite = facts.text_config if facts is not None and not vlm else None
        if composite:  # vision + text checkpoint: load the text model alone, under its own keys
            load_kwargs.update(config=getattr(config, composite), key_mapping=dict(facts.text_keys))
        load_kwargs.update(hf_kwargs)
        model = _load(name_or_path, load_kwargs, quant, may_fall_back=attn_implementation is None, vision=vlm)
        if not quant.on_device_map and device.type != "cpu" and "device_map" not in hf_kwargs:
            model.to(device)
        if quant.experts_4bit:
            # NF4 per expert, layer by layer (patches/moe/nf4.py); revert dequantizes back
            change(model, "4bit_experts", lambda swap: quantize_experts(model, swap=swap))
        if load_in_4bit and quant.mxfp4 and device.type == "cuda":  # one quantizer per load: the linears are ours
            from fastkit.patches.moe.linear_4bit import quantize_linears_4bit

            quantize_linears_4bit(model, dtype)
        tokenizer = (load_processor(name_or_path, trust_remote_code, hf_kwargs) if vlm
                     else _load_tokenizer(name_or_path, gguf_file, trust_remote_code, hf_kwargs))
        patch_model(model, max_seq_length, patches, log=False)
        protect_fp16_compute(model, config, dtype)
        if composite and facts.note not in report(model).notes:
            report(model).notes.append(facts.note)
        if memory_plan is not None:
            report(model).memory_plan = memory_plan.verdict()
            report(model).checkpointing = "offload" if memory_plan.needs_offload else True
            report(model).host_weights = memory_plan.host_weights
        logger.info(report(model).banner())  # once the report is complete (its plan line included)
        return model, tokenizer

    @staticmethod
    def patch(model: torch.nn.Module, *, max_seq_length: int | None = None,
              patches: str | list[str] | None = "auto") -> torch.nn.Module:
        """Apply fastkit's patches to a model built elsewhere (a twin, your own loader). Idempotent.

        A family not in fastkit's table is first checked on a tiny twin of its own config (the census,
        :mod:`fastkit.families.census`, about a second): it is patched only if every check passes.
        ``max_seq_length`` is checked against the model's context and kept on its load report, which
        ``make_trainer`` reads; None: 2048, or the model's context where that is shorter.
        """
        config = unwrap(model).config
        if max_seq_length is None:
            text = config.get_text_config() if hasattr(config, "get_text_config") else config
            context = getattr(text, "max_position_embeddings", None)
            max_seq_length = min(2048, context) if isinstance(context, int) and context > 0 else 2048
        checks.check_max_seq_length(max_seq_length, config)
        return patch_model(model, max_seq_length, patches, log=True)

    get_peft_model = staticmethod(get_peft_model)  # fastkit.training.lora: LoRA beside LoraOptions


def meta_model(name_or_path: str) -> torch.nn.Module | None:
    """The model a local folder's config.json builds, on the meta device (no memory, no weights read): for checks
    before the load. Its config is read as the load reads it (a field of the wrong type raises here); None when the
    folder is not local or the model cannot be built this way (the load-time checks then apply)."""
    path = os.path.expanduser(str(name_or_path))
    if not os.path.isfile(os.path.join(path, "config.json")):
        return None
    config = _load_config(path, None, False, {})
    facts = registry.facts_for(config.model_type)
    if facts is not None and facts.text_config:  # a vision + text checkpoint: fastkit loads its text model
        config = getattr(config, facts.text_config)
    try:
        from accelerate import init_empty_weights
        from transformers import AutoModelForCausalLM

        with init_empty_weights():
            return AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # noqa: BLE001 -- a check before the load; the load's own checks still run
        logger.debug("fastkit: no meta-device model of %s (%s)", name_or_path, exc)
        return None


# enable_checkpointing (fastkit.patches.offload.checkpointing), prepare_kbit_training and check_target_modules
# (fastkit.training.lora) keep this documented path too.
__all__ = ["FastModel", "LoadReport", "active_patches", "check_target_modules", "enable_checkpointing",
           "prepare_kbit_training", "report", "unwrap"]
