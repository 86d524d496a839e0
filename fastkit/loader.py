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
from fastkit.families.patch import LoadReport, patch_with_facts
from fastkit.patches.host.patch import HostWeights, enable_host_weights
from fastkit.patches.moe.loading import QuantizeWhileLoading
from fastkit.patches.moe.lora import add_expert_lora, peft_adapts_experts
from fastkit.patches.moe.nf4 import has_4bit_experts, quantize_experts
from fastkit.patches.offload.patch import enable_offload
from fastkit.patching import active_patches, change, report, unwrap

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

            from fastkit import ranks

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


def _load_processor(name_or_path: str, trust_remote_code: bool, hf_kwargs: dict):
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
        from fastkit import ranks

        ranks.quiet_replicas()  # under torchrun: one process reports; its PartialState picks this rank's GPU
        device = pick_device()
        dtype = checks.resolve_dtype(dtype)
        checks.check_hf_kwargs(hf_kwargs)
        if twin:
            checks.check_twin_options(dtype, load_in_4bit)
            return _load_twin(str(name_or_path), device, max_seq_length, patches, dtype, vision)
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
        tokenizer = (_load_processor(name_or_path, trust_remote_code, hf_kwargs) if vlm
                     else _load_tokenizer(name_or_path, gguf_file, trust_remote_code, hf_kwargs))
        _patch(model, max_seq_length, patches, log=False)
        _protect_fp16(model, config, dtype)
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
        return _patch(model, max_seq_length, patches, log=True)

    @staticmethod
    def get_peft_model(
        model: torch.nn.Module,
        r: int = 16,
        lora_alpha: int = 16,
        lora_dropout: float = 0.0,
        target_modules: str | list[str] = "all-linear",
        bias: str = "none",
        use_gradient_checkpointing: bool | str = "auto",
        random_state: int = 3407,
        offload_config=None,
        target_experts: bool = False,
        host_weights: HostWeights | str = "auto",
        options=None,
        finetune_vision_layers: bool = False,
        **lora_kwargs: Any,
    ):
        """Wrap ``model`` with PEFT LoRA (QLoRA when it is 4-bit).

        ``options``: a :class:`fastkit.LoraOptions` (rank, alpha, dropout, targets, rsLoRA, experts,
        checkpointing: what ``fastkit train`` and the notebooks fill); it replaces those arguments, and a keyword
        given beside it (not at its default) changes that option, as ``make_trainer``'s keywords change its
        options (logged).

        ``use_gradient_checkpointing``: ``True`` (plain, non-reentrant), ``"offload"`` (fastkit's
        double-buffered checkpoint reload, see :mod:`fastkit.patches.offload.patch`; tune it with
        ``offload_config=fastkit.patches.offload.OffloadConfig(...)``), ``False``, or ``"auto"`` (the
        default): ``"offload"`` where the load-time memory plan fits only with it, else ``True``.

        ``target_experts=True`` also adapts MoE experts with fastkit's per-expert-group LoRA
        (:mod:`fastkit.patches.moe.lora`, no ``W + B·A`` per expert per forward). Where PEFT already adapts
        the experts itself (``"all-linear"`` on qwen3_moe, mixtral, olmoe, deepseek_v3), fastkit runs
        PEFT's adapter per expert group instead of adding a second one.

        ``host_weights``: a :class:`fastkit.HostWeights` saying which frozen weights stay in host memory (the
        input embedding, the lm_head streamed in vocabulary chunks: :mod:`fastkit.patches.host`), or
        ``"auto"`` (the default): those the load-time memory plan needs to fit, else none.

        Vision-language models: ``"all-linear"`` adapts the language model only (the vision tower and projector get
        no LoRA); ``finetune_vision_layers=True`` (Unsloth's name) adds them, as does a ``target_modules`` naming
        them.
        """
        from peft import LoraConfig, get_peft_model

        if options is not None:  # keywords given beside options change those options, as make_trainer's do
            given = dict(r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, target_modules=target_modules,
                         use_gradient_checkpointing=use_gradient_checkpointing, target_experts=target_experts)
            kwargs = {**_lora_options(options), **_changed_from_defaults(given, lora_kwargs)}
            vision_layers = kwargs.pop("finetune_vision_layers", False) or finetune_vision_layers
            return FastModel.get_peft_model(model, **kwargs, bias=bias, random_state=random_state,
                                            offload_config=offload_config, host_weights=host_weights,
                                            finetune_vision_layers=vision_layers)
        checks.check_lora_options(r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, target_modules=target_modules,
                           bias=bias, use_gradient_checkpointing=use_gradient_checkpointing)
        if hasattr(model, "peft_config"):  # a re-run notebook cell: the same adapter back, never a nested one
            return _same_adapter(model, r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                                 target_modules=target_modules, bias=bias)
        torch.manual_seed(random_state)
        if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False):
            model = prepare_kbit_training(model)
        check_target_modules(model, target_modules)
        lora = LoraConfig(r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, bias=bias, task_type="CAUSAL_LM",
                          target_modules=_table_targets(model, target_modules, finetune_vision_layers),
                          **lora_kwargs)
        peft_model = get_peft_model(model, lora)
        object.__setattr__(peft_model.peft_config[peft_model.active_adapter], ASKED_TARGETS, target_modules)
        # 4-bit experts (patches/moe/nf4.py) have no parameter for PEFT's target_parameters: "all-linear"
        # then adapts them with fastkit's per-group factors instead, as PEFT would have on 16-bit experts.
        four_bit = target_modules == "all-linear" and has_4bit_experts(peft_model)
        if (target_experts or four_bit) and not peft_adapts_experts(peft_model):
            add_expert_lora(peft_model, r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout)
        if use_gradient_checkpointing == "auto":
            rep = report(model)
            use_gradient_checkpointing = rep.checkpointing if rep is not None else True
        enable_checkpointing(peft_model, use_gradient_checkpointing, offload_config)
        if host_weights == "auto":
            rep = report(model)
            host_weights = rep.host_weights if rep is not None else HostWeights()
        if not isinstance(host_weights, HostWeights) or host_weights.any:  # a wrong type is refused there
            enable_host_weights(peft_model, host_weights)  # after PEFT: only frozen weights go to the host
        return peft_model


ASKED_TARGETS = "fastkit_target_modules"  # on the LoraConfig: target_modules as asked (PEFT resolves 'all-linear')


def _vision_targets(model: torch.nn.Module, facts: registry.ModelFacts, vision_layers: bool) -> list[str]:
    """``"all-linear"`` on a vision-language model: the linear layers of its language model (and, with
    ``finetune_vision_layers=True``, of its vision tower and projector), by full module name; the routers and the
    lm_head stay out."""
    base = unwrap(model)
    roots = [facts.vision.language_model] + ([facts.vision.tower, facts.vision.projector] if vision_layers else [])
    routers = _router_linears(model)
    output = base.get_output_embeddings()
    names = []
    for root in dict.fromkeys(roots):
        names += [f"{root}.{n}" for n, m in base.get_submodule(root).named_modules()
                  if isinstance(m, torch.nn.Linear) and m is not output and f"{root}.{n}" not in routers]
    logger.info("fastkit: LoRA 'all-linear' on a vision-language model: %s", "language model and vision tower"
                if vision_layers else "language model only (finetune_vision_layers=True adds the vision tower)")
    return sorted(dict.fromkeys(names))


def _table_targets(model: torch.nn.Module, target_modules, vision_layers: bool = False):
    """``"all-linear"`` as the family's table row says (``ModelFacts.default_lora_targets``; a vision-language
    model: its language model, :func:`_vision_targets`), else every linear layer but the routers
    (:func:`_router_linears`), else as given."""
    if target_modules != "all-linear":
        return target_modules
    facts = registry.facts_for(getattr(unwrap(model).config, "model_type", ""))
    from fastkit.families.patch import is_vision_model

    if is_vision_model(model, facts):
        return _vision_targets(model, facts, vision_layers)
    if vision_layers:
        raise FastkitError("finetune_vision_layers=True: this model has no vision tower (a text model, or a "
                           "vision-language family loaded as text); drop the flag.")
    if facts is not None and facts.default_lora_targets:
        return list(facts.default_lora_targets)
    routers = _router_linears(model)
    if not routers:
        return target_modules
    # PEFT's "all-linear" less the routers: the other linear layers by their last name (lm_head stays out, as there)
    output = unwrap(model).get_output_embeddings()
    router_leaves = {n.rsplit(".", 1)[-1] for n in routers}
    names = {n.rsplit(".", 1)[-1] for n, m in unwrap(model).named_modules()
             if isinstance(m, torch.nn.Linear) and m is not output}
    logger.info("fastkit: LoRA 'all-linear' leaves the router(s) %s out (their forward returns the routing, not a "
                "tensor LoRA can add to)", ", ".join(sorted(router_leaves)))
    return sorted(names - router_leaves)


def check_target_modules(model: torch.nn.Module, target_modules) -> None:
    """``target_modules`` (names or a regex, as PEFT matches them) names a module of ``model``, else a FastkitError
    naming the linear layers there are (instead of PEFT's error after the load). ``model`` may be on the meta
    device (``fastkit train`` checks before any weight loads: :func:`meta_model`)."""
    if target_modules == "all-linear":
        return
    from peft import LoraConfig

    config = LoraConfig(target_modules=target_modules)
    names = [n for n, _ in unwrap(model).named_modules() if n]
    if any(_hf.peft_target_matches(config, n) for n in names):
        return
    output = unwrap(model).get_output_embeddings()
    linears = sorted({n.rsplit(".", 1)[-1] for n, m in unwrap(model).named_modules()
                      if isinstance(m, torch.nn.Linear) and m is not output})
    regex = (" (a string is a regex over the full module name, e.g. 'model.layers.0.self_attn.q_proj'; give a list "
             "for names)") if isinstance(target_modules, str) else ""
    raise FastkitError(f"target_modules={target_modules!r} matches no module of this "
                       f"{getattr(unwrap(model).config, 'model_type', '')} model{regex}; its linear layers are "
                       f"{', '.join(linears) or 'none'} (or give 'all-linear').")


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


def _router_linears(model: torch.nn.Module) -> set[str]:
    """Names of MoE routers that subclass ``nn.Linear`` (Llama-4's ``Llama4Router``, Phi-3.5-MoE's
    ``PhimoeTopKRouter``): their forward returns ``(scores, indices)``, so PEFT's ``"all-linear"``, which wraps every
    ``nn.Linear``, would break the first forward ("'tuple' object has no attribute 'dtype'"). A subclass from a
    transformers model file is a model's own layer; quantized linears (bitsandbytes) come from elsewhere and stay."""
    return {n for n, m in unwrap(model).named_modules()
            if isinstance(m, torch.nn.Linear) and type(m) is not torch.nn.Linear
            and type(m).__module__.startswith("transformers.models.")}


def _same_adapter(model: torch.nn.Module, **asked: Any) -> torch.nn.Module:
    """``model`` as is when its adapter is the one asked for; else a FastkitError naming the differences."""
    if not hasattr(model, "active_adapter"):  # the base model inside a PeftModel (PEFT marks it with peft_config)
        raise FastkitError("get_peft_model: this model already carries a LoRA adapter: it is the base inside the "
                           "PEFT model an earlier get_peft_model call returned. Use that returned model (assign it: "
                           "model = FastModel.get_peft_model(model, ...)), or re-load (FastModel.from_pretrained).")
    _one_lora_adapter(model)
    have = model.peft_config[model.active_adapter]
    diff = []
    for key, value in asked.items():
        current = getattr(have, key, None)
        if key == "target_modules":
            current = getattr(have, ASKED_TARGETS, current)  # what get_peft_model was given ('all-linear')
            same = value == current or (not isinstance(value, str) and not isinstance(current, str)
                                        and set(value) == set(current or ()))
        else:
            same = value == current
        if not same:
            diff.append(f"{key}={value!r} (the model has {current!r})")
    if diff:
        raise FastkitError(f"get_peft_model: the model already has a LoRA adapter, with other options: "
                           f"{', '.join(diff)}. Re-load the model (FastModel.from_pretrained) for a new adapter.")
    logger.info("fastkit: the model already has this LoRA adapter; returned as it is (re-run cell)")
    return model


def _one_lora_adapter(model: torch.nn.Module) -> None:
    """The one case a second get_peft_model may return its model as is: a PeftModel with one LoRA adapter. PEFT's
    tuner layer (``peft_model.base_model``), several adapters or another PEFT method would nest: refused."""
    from peft import PeftModel

    configs = dict(model.peft_config)
    types = sorted({str(getattr(getattr(c, "peft_type", None), "value", None)) for c in configs.values()})
    if not isinstance(model, PeftModel):
        what = f"PEFT's {type(model).__name__} (the base_model of a PeftModel), not the PeftModel"
    elif len(configs) > 1:
        what = f"a PEFT model with {len(configs)} adapters ({', '.join(map(str, configs))})"
    elif types != ["LORA"]:
        what = f"a PEFT model with a {', '.join(types)} adapter, not LoRA"
    else:
        return
    raise FastkitError(f"get_peft_model: the model is already {what}; a second get_peft_model would nest adapters. "
                       "Use the model as it is, or merge_and_unload() (or unload()) it first and call "
                       "get_peft_model on the model that returns.")


def _patch(model: torch.nn.Module, max_seq_length: int, patches, log: bool) -> torch.nn.Module:
    """:meth:`FastModel.patch` after its check (the loaders checked ``max_seq_length`` already).

    Note: [max_seq_length] checked once per load, where the config is known (``_preflight``; a twin, whose context
    is not the real model's: a positive int in ``_load_twin``), and carried once: on the load report
    (``report(model).max_seq_length``), which the banner, checkpoint offload and ``make_trainer`` read.
    """
    model = unwrap(model)
    facts = registry.facts_for(model.config.model_type)
    if facts is not None or patches is None:
        return patch_with_facts(model, facts, max_seq_length=max_seq_length, patches=patches, log=log)
    from fastkit.families.census import self_check

    return patch_with_facts(model, *self_check(model.config), max_seq_length=max_seq_length, patches=patches,
                            log=log)


def prepare_kbit_training(model: torch.nn.Module) -> torch.nn.Module:
    """Freeze a 4/8-bit model for LoRA, and upcast nothing.

    PEFT's ``prepare_model_for_kbit_training`` casts every 16-bit parameter to fp32: on Qwen3-14B the
    untied embeddings and lm_head alone (1.56B parameters) grow from 3.1 to 6.2 GB, which is what
    kept it off a T4. Here embeddings, lm_head and norms keep the dtype they loaded in; the adapters
    PEFT adds are fp32, and the trainer's autocast runs the 16-bit matmuls.
    """
    for param in model.parameters():
        param.requires_grad_(False)
    return model


def _protect_fp16(model: torch.nn.Module, config, dtype: torch.dtype) -> None:
    """fp16 compute of a checkpoint not saved in fp16 (bf16-trained: fp16 overflows its residual stream):
    keep the residual stream in fp32 (patches/fp16/patch.py), and say so in the load report."""
    saved = getattr(config, "dtype", None)  # transformers >= 4.56: torch_dtype is a (warning) alias of dtype
    if dtype != torch.float16 or saved in (torch.float16, "float16"):
        return
    from fastkit.patches.fp16 import FP16_RESIDUAL, protect_fp16

    ok, how = protect_fp16(model)
    rep = report(model)
    if rep is not None:
        (rep.active if ok else rep.skipped)[FP16_RESIDUAL] = how
    logger.info("fastkit: fp16 residual stream in fp32 (checkpoint saved as %s): %s", saved, how)


def _load_twin(name: str, device: torch.device, max_seq_length: int, patches, dtype: torch.dtype | None = None,
               vision: bool | None = None):
    from fastkit.families.twins import TWIN_PREFIX, twin, twin_bpe_tokenizer, twin_family

    checks.check_max_seq_length(max_seq_length, _real_config(name))  # the real model's context, where known
    name = _twin_name(name)
    try:
        family, overrides = twin_family(name)
    except ValueError as exc:
        raise FastkitError(str(exc)) from exc
    family = _twin_vision_family(family, vision)
    logger.info("fastkit: twin=True: a tiny random %s stands in for %s (no download)", family, name)
    if wants_vision(registry.facts_for(family), vision, family):
        return _load_vision_twin(name, family, device, max_seq_length, patches, dtype)
    model = twin(family, num_hidden_layers=2, **overrides).to(device, dtype=dtype or torch.float32)
    # its saves say which twin to rebuild (twins are deterministic): PEFT reads the instance attribute
    model.config._name_or_path = model.name_or_path = TWIN_PREFIX + name
    tokenizer = twin_bpe_tokenizer()  # with merges, so a twin's GGUF export is one llama.cpp loads
    _patch(model, max_seq_length, patches, log=True)
    return model, tokenizer


def _twin_vision_family(family: str, vision: bool | None) -> str:
    """``vision=True`` on a twin whose stand-in is a composite's text model (``google/gemma-3-4b-it`` ->
    ``gemma3_text``): the vision row whose config builds that text model (``gemma3``)."""
    row = registry.facts_for(family)
    if vision is not True or (row is not None and row.vision is not None):
        return family
    from transformers import CONFIG_MAPPING

    for model_type, facts in registry.MODEL_TABLE.items():
        if facts.vision is not None and CONFIG_MAPPING[model_type]().get_text_config().model_type == family:
            return model_type
    return family


def _load_vision_twin(name: str, family: str, device: torch.device, max_seq_length: int, patches,
                      dtype: torch.dtype | None):
    """A tiny random vision-language twin and its processor (:mod:`fastkit.families.vision`)."""
    from fastkit.families.twins import TWIN_PREFIX
    from fastkit.families.vision import vision_twin, vision_twin_processor

    model = vision_twin(family).to(device, dtype=dtype or torch.float32)
    model.config._name_or_path = model.name_or_path = TWIN_PREFIX + name
    processor = vision_twin_processor(family)
    _patch(model, max_seq_length, patches, log=True)
    return model, processor


def _real_config(name: str):
    """The config of the model a twin stands in for, when it is at hand without a download (a local config.json,
    or a config fastkit ships): its context bounds the twin's ``max_seq_length`` as a real load's would."""
    import json

    from fastkit.plan.source import _config_from_dict, known_config

    path = os.path.expanduser(name)
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    values = None
    if os.path.basename(file) == "config.json" and os.path.isfile(file):
        try:
            with open(file, encoding="utf-8") as f:
                values = json.load(f)
        except (OSError, ValueError):
            return None  # _twin_name names the broken file
    elif not os.path.exists(path):
        values = known_config(name)
    if not isinstance(values, dict) or not values.get("model_type"):
        return None
    try:
        return _config_from_dict(dict(values))
    except FastkitError:
        return None


def _twin_name(name: str) -> str:
    """``twin=True`` on a local folder (or its config.json): the model_type its config.json names."""
    import json
    from pathlib import Path

    path = Path(os.path.expanduser(name))
    config = path / "config.json" if path.is_dir() else path
    if not (config.name == "config.json" and config.is_file()):
        return name
    try:
        values = json.loads(config.read_text())
    except ValueError as exc:
        raise FastkitError(f"twin=True: {str(config)!r} is not valid JSON ({exc}).") from exc
    if not isinstance(values, dict):
        raise FastkitError(f"twin=True: {str(config)!r} holds a {type(values).__name__}, not a model config mapping.")
    model_type = values.get("model_type")
    if not model_type:
        raise FastkitError(f"twin=True: {str(config)!r} names no model_type to build a twin of.")
    logger.info("fastkit: twin=True: %s is a local %s config", name, model_type)
    return str(model_type)


def _changed_from_defaults(given: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """get_peft_model's LoRA keywords that differ from their defaults (plus any other LoRA keyword): the ones a
    caller gave beside ``options=``. The one precedence rule (make_trainer's too): a keyword changes the option;
    a keyword left at its default leaves the option as it is. Each change is logged."""
    import inspect

    defaults = {k: v.default for k, v in inspect.signature(FastModel.get_peft_model).parameters.items()}
    changed = {k: v for k, v in given.items() if v != defaults[k]} | dict(extra)
    if changed:
        logger.info("fastkit: get_peft_model: %s given beside options= change those options",
                    ", ".join(f"{k}={v!r}" for k, v in changed.items()))
    return changed


def _lora_options(options) -> dict[str, Any]:
    """get_peft_model's arguments from a :class:`fastkit.LoraOptions`."""
    from fastkit.training.options import LoraOptions

    if not isinstance(options, LoraOptions):
        raise FastkitError(f"get_peft_model(options=...) takes a fastkit.LoraOptions, got {type(options).__name__}.")
    return options.peft_kwargs()


def enable_checkpointing(model: torch.nn.Module, mode: bool | str = True, offload_config=None) -> str:
    """Turn on gradient checkpointing: ``True``, ``"offload"`` or ``False``. Returns the mode in effect.

    Also the switch for full fine-tuning (no LoRA): ``enable_checkpointing(model, "offload")``.
    """
    if mode not in (True, False, "offload"):
        raise FastkitError(f"use_gradient_checkpointing must be True, False or 'offload', got {mode!r}.")
    if mode is False:
        return "off"
    base = unwrap(model)

    def turn_on(swap):  # transformers' own switch, its per-layer flags and input-grad hooks recorded for revert
        swap.record(model, lambda: _hf.enable_activation_checkpointing(base))
        if hasattr(model, "enable_input_require_grads"):
            swap.record(model, model.enable_input_require_grads)

    change(base, "checkpointing", turn_on)
    if mode == "offload":
        return enable_offload(base, offload_config)
    return "checkpoint"


__all__ = ["FastModel", "LoadReport", "active_patches", "enable_checkpointing", "report",
           "unwrap"]
