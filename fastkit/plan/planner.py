"""Will this run fit? A training-memory planner that reads only the model's config.

``plan("Qwen/Qwen3-14B", gpu="t4", load_in_4bit=True)`` builds the model on the meta device (no
weights, no memory), counts its parameters by kind, and predicts the peak of one LoRA (or full)
training step by component:

- weights, per dtype / quantization (NF4 = 0.5 byte per weight plus absmax: one 8-bit scale per
  64 weights and one fp32 scale per 256 blocks with double quantization); embeddings and lm_head
  stay 16-bit under 4-bit (fastkit does not upcast them);
- LoRA parameters (fp32), their gradients and the optimizer state (AdamW 32-bit: 8 bytes per
  parameter; 8-bit: 2);
- activations saved for backward: with checkpointing one layer input per layer plus one layer's
  full recompute, without it every layer's activations (:mod:`fastkit.plan.terms` has the per-token
  counts);
- the attention workspace (eager attention keeps ``heads x T x T`` scores; SDPA does not);
- logits and loss: TRL's fused LM head (tiles of 4096 tokens x 32768 vocabulary, what
  ``fastkit.make_trainer`` trains with), fastkit's chunked loss, or full fp32 logits;
- on CUDA, the context outside the allocator and the allocator's slack.

It says whether that fits the GPU and, if not, which knob brings it under. ``fastkit plan MODEL``
prints the same table; ``FastModel.from_pretrained`` logs the verdict and refuses a run that cannot fit.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from fastkit import checks
from fastkit.device import compute_dtype
from fastkit.errors import FastkitError
from fastkit.patches.moe.nf4 import DEQUANT_BYTES_PER_WEIGHT, group_size  # the bound the forward uses
from fastkit.plan.terms import ModelShape, activation_bytes, loss_bytes, quantization_values, shape_of
from fastkit.units import GiB

logger = logging.getLogger("fastkit")

GPUS: dict[str, float] = {
    "t4": 15.0,  # Colab free: 15 GiB usable of 16
    "l4": 22.0,
    "a100-40": 39.4,
    "rtx-8g": 7.6,
    "rtx-16g": 15.6,
    "spark": 128.0,  # DGX Spark, unified memory
}
"""Usable GPU memory in GiB by name (``--gpu`` accepts these or a number of GiB)."""
NO_BF16 = frozenset({"t4"})
"""GPUs in :data:`GPUS` without bf16 (pre-Ampere), where fastkit trains in fp16; a GiB number is planned as bf16."""

CUDA_CONTEXT = int(0.6 * GiB)
"""CUDA context, cuBLAS workspace and kernels: memory the allocator does not see."""
ALLOCATOR_SLACK = 0.08
"""Fragmentation of PyTorch's caching allocator, as a fraction of what the step allocates."""
OFF_PEAK = "(not at the peak) "
"""Prefix of a component that happens at another time than the peak (shown, not added)."""
REFUSE_ABOVE = 1.10
"""``from_pretrained`` refuses a run only when the prediction exceeds the budget by this factor (the
planner's error on measured twins is within 15%; runs just above the line get a warning instead)."""
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
"""Bytes per 4-bit weight with double quantization (NF4 + 8-bit absmax per 64 + fp32 per 256 blocks)."""
NF4_BYTES_NO_DOUBLE = 0.5 + 4 / 64
"""Bytes per 4-bit weight without double quantization (one fp32 absmax per 64 weights)."""


@dataclass
class PlanInputs:
    """What the plan assumes about the run."""

    gpu: str = "t4"
    """A name in :data:`GPUS`, a number of GiB, or ``"cpu"`` (no CUDA context, no budget check)."""
    max_seq_length: int = 2048
    """Tokens per row (a packed row counts as one)."""
    batch_size: int = 1
    """Rows per micro-batch."""
    r: int | None = 16
    """LoRA rank on every linear layer but the lm_head; ``None`` for full fine-tuning."""
    load_in_4bit: bool = False
    """NF4 base weights (QLoRA)."""
    offload: bool = False
    """fastkit's checkpoint offload: layer inputs live on the host, two stay on the GPU."""
    checkpointing: bool = True
    """Activation checkpointing (``use_gradient_checkpointing``)."""
    optimizer: str = "auto"
    """An ``optim`` name of transformers' ``TrainingArguments`` (a key of :data:`OPTIMIZER_STATE_BYTES`, the
    same spelling ``make_trainer(optim=...)`` takes) or ``"auto"``: :func:`default_optimizer`, as make_trainer."""
    loss: str = "trl"
    """``"trl"`` (SFTTrainer's fused LM head), ``"chunked"`` (fastkit's) or ``"full"`` (fp32 logits)."""
    dtype: torch.dtype | None = None
    """Compute / weight dtype; default 16-bit on a GPU, fp32 for ``gpu="cpu"``."""
    attn: str = "sdpa"
    """Attention backend: ``"sdpa"`` / ``"flash_attention_2"`` (no T x T scores kept) or ``"eager"``."""
    expert_lora: bool = True
    """4-bit MoE: fastkit's per-group LoRA on the experts too (what ``get_peft_model`` adds for
    ``"all-linear"``); False: LoRA on the linear layers only."""
    moe_dequant_group_bytes: int | None = None
    """4-bit MoE: the bound on one dequantization call's transient (``MoEConfig.dequant_group_bytes``, the
    same meaning: None = 8 MiB, 0 = one expert per call)."""
    host_embedding: bool = False
    """The frozen input embedding in pinned host memory, its rows gathered there per step
    (``fastkit.HostWeights(input_embedding=True)``, :mod:`fastkit.patches.host`)."""
    host_lm_head: bool = False
    """The frozen lm_head in pinned host memory, streamed to the GPU in vocabulary chunks by the chunked
    loss, twice per step (``fastkit.HostWeights(lm_head=True)``); the loss is then fastkit's, whatever ``loss`` says."""


@dataclass
class Plan:
    """The predicted training peak by component, and the verdict."""

    model: str
    """What was planned (name or model_type)."""
    inputs: PlanInputs
    """The assumptions."""
    components: dict[str, int] = field(default_factory=dict)
    """Component name -> bytes at the peak."""
    budget: int | None = None
    """Usable GPU bytes (None on CPU)."""
    advice: list[str] = field(default_factory=list)
    """Knobs that bring the run under the budget, best first (empty when it fits)."""
    needs_offload: bool = False
    """Set by :func:`check_fits`: plain checkpointing does not fit, checkpoint offload does, so
    ``FastModel.get_peft_model(use_gradient_checkpointing="auto")`` (the default) offloads."""
    host: dict[str, int] = field(default_factory=dict)
    """Not on the GPU: pinned host memory and host-to-GPU bytes per step of the weights kept on the host."""

    @property
    def host_weights(self):
        """The :class:`fastkit.HostWeights` this plan assumes (what ``get_peft_model(host_weights="auto")`` applies)."""
        from fastkit.patches.host.patch import HostWeights

        return HostWeights(input_embedding=self.inputs.host_embedding, lm_head=self.inputs.host_lm_head)

    @property
    def total(self) -> int:
        """Predicted peak bytes (components marked "not at the peak" excluded)."""
        return _peak(self.components)

    @property
    def fits(self) -> bool:
        """True when the predicted peak is within the budget (always on CPU)."""
        return self.budget is None or self.total <= self.budget

    def verdict(self) -> str:
        """One line: fits or not, with the numbers."""
        where = "host" if self.budget is None else f"{self.inputs.gpu} ({self.budget / GiB:.1f} GiB usable)"
        word = "fits" if self.fits else "does NOT fit"
        line = f"{self.model}: predicted peak {self.total / GiB:.2f} GiB, {word} on {where}"
        return line if self.fits else f"{line}. {' '.join(self.advice[:2])}"

    def table(self) -> str:
        """The component table (markdown) followed by the verdict."""
        unit, scale = ("GiB", GiB) if self.total >= GiB else ("MiB", 2**20)
        rows = [f"| component | {unit} |", "|---|---:|"]
        rows += [f"| {name} | {nbytes / scale:.2f} |" for name, nbytes in self.components.items()]
        rows.append(f"| **predicted peak** | **{self.total / scale:.2f}** |")
        rows += [f"| {name} | {nbytes / scale:.2f} |" for name, nbytes in self.host.items()]
        return "\n".join(rows) + "\n\n" + self.verdict()


def gpu_budget(gpu: str | float | int) -> int | None:
    """Usable bytes of a GPU name or a number of GiB; None for ``"cpu"``."""
    if isinstance(gpu, (int, float)) and not isinstance(gpu, bool) and gpu > 0:
        return int(gpu * GiB)
    name = str(gpu).strip().lower()
    if name == "cpu":
        return None
    if name in GPUS:
        return int(GPUS[name] * GiB)
    try:
        gib = float(name.removesuffix("gib").removesuffix("gb"))
    except ValueError:
        gib = -1.0
    if gib > 0:
        return int(gib * GiB)
    raise FastkitError(f"gpu={gpu!r} is not a GPU the planner knows. Use one of {', '.join(GPUS)}, "
                       "'cpu', or a number of GiB (e.g. gpu=24).")


def read_config(model_or_config: Any):
    """A transformers config from a config object, a model, a local folder / config.json, or a Hub id."""
    from transformers import PretrainedConfig

    if isinstance(model_or_config, PretrainedConfig):
        return model_or_config
    if isinstance(model_or_config, torch.nn.Module) and hasattr(model_or_config, "config"):
        return model_or_config.config
    if isinstance(model_or_config, dict):
        return _config_from_dict(dict(model_or_config))
    name = os.path.expanduser(str(model_or_config))
    path = os.path.join(name, "config.json") if os.path.isdir(name) else name
    if not os.path.exists(path):
        path = _hub_config(name)
    try:
        with open(path, encoding="utf-8") as f:
            return _config_from_dict(json.load(f))
    except (OSError, ValueError) as exc:
        raise FastkitError(f"Could not read a model config from {path!r}: {exc}") from exc


def _config_from_dict(values: dict):
    from transformers import CONFIG_MAPPING

    model_type = values.pop("model_type", None)
    if "torch_dtype" in values:  # checkpoints saved before transformers 5 spell it so (as from_pretrained maps it)
        values.setdefault("dtype", values.pop("torch_dtype"))
    if model_type not in CONFIG_MAPPING:
        raise FastkitError(f"config model_type {model_type!r} is not one transformers knows; pass a config "
                           "with a known model_type (e.g. 'qwen3', 'llama').")
    return CONFIG_MAPPING[model_type](**values)


def _hub_config(name: str) -> str:
    if os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") != 1:
        raise FastkitError(f"{name!r} is neither a local model folder / config.json nor a Hub id "
                           "like 'Qwen/Qwen3-14B'.")
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        try:
            from huggingface_hub import hf_hub_download

            return hf_hub_download(name, "config.json", local_files_only=True)
        except Exception as exc:
            raise FastkitError(f"HF_HUB_OFFLINE=1 and {name!r}'s config.json is not in the local cache: pass a "
                               "local folder or config object, or go online (only config.json is read).") from exc
    from huggingface_hub import hf_hub_download

    try:
        return hf_hub_download(name, "config.json")  # the config only, never the weights
    except Exception as exc:
        raise FastkitError(f"Could not read {name!r}'s config.json from the Hub: {exc}") from exc


OPTIMIZER_STATE_BYTES = {
    "adamw_torch": 8, "adamw_torch_fused": 8, "paged_adamw_32bit": 8,
    "paged_adamw_8bit": 2, "adamw_8bit": 2, "adamw_bnb_8bit": 2,
}
"""Optimizer state bytes per trainable parameter, by transformers' ``optim`` name: AdamW keeps two moments,
fp32 (8 bytes) or bitsandbytes' 8-bit blockwise (2 bytes; its per-block scales are noise at LoRA sizes)."""
EIGHT_BIT = "paged_adamw_8bit"
"""The 8-bit optimizer fastkit picks (and the planner suggests): bitsandbytes' paged AdamW."""


def default_optimizer(device_type: str, load_in_4bit: bool) -> str:
    """What fastkit trains with (``make_trainer``'s ``optim`` and the planner's ``"auto"``): paged 8-bit AdamW on
    CUDA with 4-bit weights, 32-bit AdamW elsewhere."""
    return EIGHT_BIT if device_type == "cuda" and load_in_4bit else "adamw_torch"


def plan(model_or_config: Any, gpu: str | float = "t4", max_seq_length: int = 2048, batch_size: int = 1,
         r: int | None = 16, load_in_4bit: bool = False, offload: bool = False, **options: Any) -> Plan:
    """Predict the training peak of ``model_or_config`` on ``gpu``, by component, with a verdict and advice.

    ``options`` are the other fields of :class:`PlanInputs` (``checkpointing``, ``optimizer``, ``loss``,
    ``dtype``, ``attn``). Nothing is downloaded but a Hub id's ``config.json``; no weights are built.
    """
    unknown = set(options) - set(PlanInputs.__dataclass_fields__)
    if unknown:
        raise FastkitError(f"plan() got unknown option(s) {sorted(unknown)}; known: "
                           f"{', '.join(PlanInputs.__dataclass_fields__)}")
    inputs = PlanInputs(gpu=str(gpu), max_seq_length=max_seq_length, batch_size=batch_size, r=r,
                        load_in_4bit=load_in_4bit, offload=offload, **options)
    _check_inputs(inputs)
    budget = gpu_budget(gpu)
    config = read_config(model_or_config)
    _check_decoder(config)
    checks.check_max_seq_length(max_seq_length, config)
    name = model_or_config if isinstance(model_or_config, str) else getattr(config, "name_or_path", "")
    return _predict(config, inputs, budget, name)


def _predict(config, inputs: PlanInputs, budget: int | None, name: str = "") -> Plan:
    """:func:`plan`'s prediction, for inputs already checked against ``config`` (``max_seq_length``: by
    :func:`plan`, :func:`auto_plan`, or the loader before :func:`check_fits`)."""
    inputs.load_in_4bit = inputs.load_in_4bit or prequantized_4bit(config)
    shape = shape_of(config)
    result = Plan(name or config.model_type, inputs, budget=budget)
    result.components = components(shape, inputs, cuda=budget is not None)
    result.host = host_terms(shape, inputs, cuda=budget is not None)
    if not result.fits:
        result.advice = advise(shape, inputs, budget)
    return result


def _check_decoder(config) -> None:
    """The planner models decoder-only causal LMs."""
    from fastkit import _hf

    # BERT-style encoders have a causal-LM head class too (BertLMHeadModel); they are masked LMs first
    if not _hf.has_causal_lm_head(config.model_type) or _hf.has_masked_lm_head(config.model_type) \
            or getattr(config, "is_encoder_decoder", False):
        raise FastkitError(f"model_type {config.model_type!r} is not a decoder-only causal LM; the planner (and "
                           "fastkit) trains causal LMs (llama, qwen3, gemma3, ...).")


def _check_inputs(inputs: PlanInputs) -> None:  # max_seq_length: once, with the config (_check_decoder)
    checks.check_positive("batch_size", inputs.batch_size)
    if inputs.r is not None and (not isinstance(inputs.r, int) or inputs.r <= 0):
        raise FastkitError(f"r must be a positive int (LoRA rank) or None (full fine-tuning), got {inputs.r!r}.")
    if inputs.optimizer != "auto" and inputs.optimizer not in OPTIMIZER_STATE_BYTES:
        known = ", ".join(repr(k) for k in ("auto", *OPTIMIZER_STATE_BYTES))
        raise FastkitError(f"optimizer must be one of {known} (transformers' optim names), got {inputs.optimizer!r}.")
    if inputs.loss not in ("trl", "chunked", "full"):
        raise FastkitError(f"loss must be 'trl', 'chunked' or 'full', got {inputs.loss!r}.")
    for name in ("load_in_4bit", "offload", "checkpointing", "expert_lora", "host_embedding", "host_lm_head"):
        if not isinstance(getattr(inputs, name), bool):
            raise FastkitError(f"{name} must be True or False, got {getattr(inputs, name)!r}.")
    if inputs.attn not in ("sdpa", "flash_attention_2", "eager"):
        raise FastkitError(f"attn must be 'sdpa', 'flash_attention_2' or 'eager', got {inputs.attn!r}.")
    if inputs.dtype is not None and inputs.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise FastkitError(f"dtype must be torch.float16, torch.bfloat16, torch.float32 or None, got {inputs.dtype!r}.")
    if inputs.load_in_4bit and inputs.r is None:
        raise FastkitError("load_in_4bit=True trains LoRA adapters only: give a LoRA rank r (e.g. r=16).")
    if (inputs.host_embedding or inputs.host_lm_head) and inputs.r is None:
        raise FastkitError("host_embedding / host_lm_head keep FROZEN weights on the host: full fine-tuning (r=None) "
                           "trains them. Give a LoRA rank r, or leave them on the GPU.")


def components(shape: ModelShape, inputs: PlanInputs, cuda: bool) -> dict[str, int]:
    """Bytes at the training peak, by component (see the module docstring)."""
    dtype = inputs.dtype or compute_dtype(cuda, bf16=inputs.gpu not in NO_BF16)
    size = torch.tensor([], dtype=dtype).element_size()
    tokens = inputs.max_seq_length * inputs.batch_size
    out: dict[str, int] = {}
    if inputs.load_in_4bit:  # MXFP4 (GPT-OSS) too: patches.moe.linear_4bit quantizes them after load
        out["weights: linear layers, NF4 + absmax (double quant)"] = int(shape.linear_params * NF4_BYTES)
    else:
        out[f"weights: linear layers, {_dtype_name(dtype)}"] = shape.linear_params * size
    out.update(_embedding_weights(shape, inputs, dtype, size))
    experts = shape.expert_params_per_layer * (shape.layers - shape.dense_layers) if shape.experts else 0
    if inputs.load_in_4bit and experts:  # fastkit stores MoE experts NF4 too (patches/moe/nf4.py)
        out["weights: MoE experts, NF4 + absmax"] = int(experts * NF4_BYTES)
        experts_16 = 0
    else:
        experts_16 = experts
    what = "norms, router, experts, other" if experts_16 else "norms, router, other"
    out[f"weights: {what}, {_dtype_name(dtype)}"] = (shape.other_params - experts + experts_16) * size
    trainable = shape.lora_params(inputs.r) if inputs.r is not None else shape.total_params
    optimizer = inputs.optimizer
    if optimizer == "auto":
        optimizer = default_optimizer("cuda" if cuda else "cpu", inputs.load_in_4bit)
    four_bit_experts = bool(inputs.load_in_4bit and experts and inputs.r is not None)
    if four_bit_experts:  # PEFT adapts the linear layers (fp32); fastkit's factors the 4-bit experts (compute dtype)
        on_experts = sum(inputs.r * (i + o) * n for i, o, n in shape.lora_dims if n > 1)
        trainable -= on_experts
        out[f"LoRA r={inputs.r} on linear layers (PEFT): parameters + gradients (fp32)"] = trainable * 8
        if inputs.expert_lora:
            out[f"LoRA r={inputs.r} on experts (fastkit): parameters + gradients"] = on_experts * 2 * size
            trainable += on_experts
        out["4-bit experts dequantized per hit group (fastkit, fwd and bwd)"] = dequant_group_bytes(
            shape, inputs.moe_dequant_group_bytes)
    elif inputs.r is not None:  # PEFT keeps adapters (and so their gradients) in fp32
        out[f"LoRA r={inputs.r}: parameters + gradients (fp32)"] = trainable * 8
    else:  # the parameters are the weights above
        out[f"gradients (full fine-tuning, {_dtype_name(dtype)})"] = trainable * size
    out[f"optimizer state ({optimizer})"] = trainable * OPTIMIZER_STATE_BYTES[optimizer]
    stream = 4 if dtype == torch.float16 and not shape.saved_fp16 else size  # patches/fp16 keeps it fp32
    kept, transient = activation_bytes(shape, inputs, tokens, size, adapter=size if cuda else 4, stream=stream)
    out.update(kept)
    if inputs.load_in_4bit:
        out["4-bit dequantized weight (largest layer)"] = shape.largest_linear * size * 2
    transient.update(_loss_term(shape, inputs, tokens, size))
    smaller = min(transient, key=transient.get)
    for name, nbytes in transient.items():  # the loss and the layers' backward do not overlap: peak = larger
        out[name if name != smaller else f"{OFF_PEAK}{name}"] = nbytes
    if cuda:
        out["CUDA context (outside the allocator)"] = CUDA_CONTEXT
        out[f"allocator slack ({ALLOCATOR_SLACK:.0%})"] = int(ALLOCATOR_SLACK * _peak(out))
    return out


def dequant_group_bytes(shape: ModelShape, bound: int | None = None) -> int:
    """Transient of the largest 4-bit experts dequantization call: ``group_size`` experts of the projection
    that needs most (``fastkit.patches.moe.nf4``: the same function picks the group in the forward)."""
    return max((group_size(i * o, n, bound) * i * o * DEQUANT_BYTES_PER_WEIGHT
                for i, o, n in shape.lora_dims if n > 1), default=0)


def _loss_term(shape: ModelShape, inputs: PlanInputs, tokens: int, size: int) -> dict[str, int]:
    if _host_head(shape, inputs):  # only fastkit's chunked loss streams a host head
        return {"logits + loss (chunked, lm_head streamed from the host)": loss_bytes(shape, "streamed", tokens, size)}
    return {f"logits + loss ({inputs.loss})": loss_bytes(shape, inputs.loss, tokens, size)}


def _host_head(shape: ModelShape, inputs: PlanInputs) -> bool:
    return inputs.host_lm_head and not shape.tied


def _embedding_weights(shape: ModelShape, inputs: PlanInputs, dtype: torch.dtype, size: int) -> dict[str, int]:
    """Device bytes of the input embedding and lm_head (one line, or one per matrix when one stays on the host)."""
    name = _dtype_name(dtype)
    host_in = inputs.host_embedding and not shape.tied
    if not host_in and not _host_head(shape, inputs):
        return {f"weights: embeddings + lm_head, {name}": shape.embedding_params * size}
    head = shape.embedding_params - shape.input_embedding_params
    out = {}
    if not host_in:
        out[f"weights: input embedding, {name}"] = shape.input_embedding_params * size
    if not _host_head(shape, inputs):
        out[f"weights: lm_head, {name}"] = head * size
    return out


def host_terms(shape: ModelShape, inputs: PlanInputs, cuda: bool) -> dict[str, int]:
    """What the host weights cost off the GPU: pinned host memory, and host-to-GPU bytes per step."""
    dtype = inputs.dtype or compute_dtype(cuda, bf16=inputs.gpu not in NO_BF16)
    size = torch.tensor([], dtype=dtype).element_size()
    tokens = inputs.max_seq_length * inputs.batch_size
    out: dict[str, int] = {}
    if inputs.host_embedding and not shape.tied:
        out["host (pinned): input embedding"] = shape.input_embedding_params * size
        out["host→GPU per step: embedding rows gathered"] = tokens * shape.hidden * size
    if _host_head(shape, inputs):
        head = shape.embedding_params - shape.input_embedding_params
        out["host (pinned): lm_head"] = head * size
        out["host→GPU per step: lm_head streamed (forward + backward)"] = 2 * head * size
    return out


def _peak(components: dict[str, int]) -> int:
    return sum(v for k, v in components.items() if not k.startswith(OFF_PEAK))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _host_tries(shape: ModelShape, inputs: PlanInputs) -> list[tuple[str, dict]]:
    """The host-weights knobs :func:`advise` tries (LoRA only: the weights must be frozen; untied only)."""
    if inputs.r is None or shape.tied:
        return []
    tries = []
    if not inputs.host_embedding:
        tries.append(("keep the frozen input embedding on the host (get_peft_model(host_weights="
                      "fastkit.HostWeights(input_embedding=True)))", dict(host_embedding=True)))
    if not (inputs.host_embedding and inputs.host_lm_head):
        tries.append(("keep the frozen input embedding and lm_head on the host (get_peft_model(host_weights="
                      "fastkit.HostWeights(input_embedding=True, lm_head=True)))",
                      dict(host_embedding=True, host_lm_head=True)))
    return tries


def advise(shape: ModelShape, inputs: PlanInputs, budget: int) -> list[str]:
    """Single knobs that bring the plan under ``budget``, cheapest in quality first."""
    tries: list[tuple[str, dict]] = []
    if not inputs.checkpointing:
        tries.append(("turn on use_gradient_checkpointing=True", dict(checkpointing=True)))
    if inputs.loss == "full":
        tries.append(("train through make_trainer (TRL's fused LM head) or fastkit's chunked loss",
                      dict(loss="trl")))
    if inputs.optimizer == "auto" or OPTIMIZER_STATE_BYTES[inputs.optimizer] > OPTIMIZER_STATE_BYTES[EIGHT_BIT]:
        tries.append((f"use the 8-bit optimizer (optim={EIGHT_BIT!r})", dict(optimizer=EIGHT_BIT)))
    if not inputs.offload:
        tries.append(("use_gradient_checkpointing='offload' (layer inputs on the host)",
                      dict(offload=True, checkpointing=True)))
    if not inputs.load_in_4bit and inputs.r is not None:
        tries.append(("load_in_4bit=True (QLoRA)", dict(load_in_4bit=True)))
    tries += _host_tries(shape, inputs)
    if inputs.load_in_4bit and shape.experts and inputs.r is not None and inputs.expert_lora:
        tries.append(("LoRA on the linear layers only (get_peft_model(target_modules=[...]) without the experts)",
                      dict(expert_lora=False)))
    seq = inputs.max_seq_length
    while seq > 256:
        seq //= 2
        tries.append((f"shorter rows: max_seq_length={seq}", dict(max_seq_length=seq)))
    if inputs.batch_size > 1:
        tries.append(("batch_size=1 with gradient_accumulation_steps", dict(batch_size=1)))
    if inputs.r is not None and inputs.r > 8:
        tries.append(("smaller LoRA rank: r=8", dict(r=8)))
    cuda = True
    fixes = []
    for text, change in tries:
        trial = PlanInputs(**{**inputs.__dict__, **change})
        total = _peak(components(shape, trial, cuda))
        if total <= budget:
            fixes.append(f"Fix: {text} (predicted {total / GiB:.1f} GiB).")
            if "max_seq_length" in change:
                break
    if not fixes:
        fixes.append("No single knob is enough: combine 4-bit, offload and shorter rows, or use a larger GPU.")
    return fixes


def prequantized_4bit(config) -> bool:
    """True when ``config.json`` carries a bitsandbytes 4-bit ``quantization_config`` (a pre-quantized checkpoint)."""
    values = quantization_values(config)
    return values.get("quant_method", "").endswith("bitsandbytes") and bool(values.get("load_in_4bit"))


AUTO_STEPS = (
    ("activation offload", dict(offload=True)),
    ("activation offload + the input embedding on the host", dict(offload=True, host_embedding=True)),
    ("activation offload + the input embedding and lm_head on the host",
     dict(offload=True, host_embedding=True, host_lm_head=True)),
)
"""What the load-time plan turns on, in this order, when plain checkpointing does not fit: each step adds host
traffic (the activations, then the embedding rows, then two transfers of the lm_head per step) and changes
no value."""
AUTO_HEADROOM = 0.90
"""Once a run needs :data:`AUTO_STEPS`, they go on until the plan is within this share of the budget (else the
first that fits is kept): such a run sits at the edge, the planner's error on measured twins is up to 15%,
and a T4 kernel dies on OOM. A run that fits with plain checkpointing is left as it is."""


def auto_plan(config, gpu, max_seq_length: int, load_in_4bit: bool) -> tuple[str, Plan] | None:
    """What ``get_peft_model(use_gradient_checkpointing="auto")`` turns on when plain checkpointing does not fit:
    the first of :data:`AUTO_STEPS` within :data:`AUTO_HEADROOM` of the budget, else the first that fits, as
    ``(what, its plan)`` (the plan flagged ``needs_offload``); None when none fits."""
    name = config if isinstance(config, str) else getattr(config, "name_or_path", "")
    config = read_config(config)
    _check_decoder(config)
    checks.check_max_seq_length(max_seq_length, config)
    return _auto(config, gpu, max_seq_length, load_in_4bit, name)


def _auto(config, gpu, max_seq_length: int, load_in_4bit: bool, name: str = "") -> tuple[str, Plan] | None:
    """:func:`auto_plan` for a config its inputs were checked against."""
    first = None
    for what, knobs in AUTO_STEPS:
        inputs = PlanInputs(gpu=str(gpu), max_seq_length=max_seq_length, load_in_4bit=load_in_4bit, **knobs)
        trial = _predict(config, inputs, gpu_budget(gpu), name or getattr(config, "name_or_path", ""))
        if trial.fits:
            trial.needs_offload = True
            first = first or (what, trial)
            if trial.total <= AUTO_HEADROOM * trial.budget:
                first = (what, trial)
                break
    return first


def check_fits(config, device: torch.device, gpu: str | float | None, max_seq_length: int,
               load_in_4bit: bool) -> Plan | None:
    """The load-time verdict (LoRA r=16, checkpointing, batch 1): None off CUDA without a ``gpu`` target.

    Raises :class:`FastkitError` with the advice when the run cannot fit, before any weight is read.
    """
    if gpu is None:
        if device.type != "cuda":
            return None
        gpu = torch.cuda.get_device_properties(device).total_memory / GiB * 0.97  # what the allocator can get
    _check_decoder(config)  # max_seq_length: checked by the loader, once, against this config
    inputs = PlanInputs(gpu=str(gpu), max_seq_length=max_seq_length, load_in_4bit=load_in_4bit)
    try:
        result = _predict(config, inputs, gpu_budget(gpu), getattr(config, "name_or_path", ""))
    except FastkitError:
        raise
    except Exception as exc:  # an architecture the meta-device count cannot build: no verdict, no refusal
        logger.info("fastkit: no memory plan for %s (%s: %s)", config.model_type, type(exc).__name__, exc)
        return None
    if not result.fits:
        better = _auto(config, gpu, max_seq_length, load_in_4bit)
        if better is not None:
            logger.info("fastkit: %s on by default: %s", better[0], better[1].verdict())
            return better[1]
    unmeasured = any(k.startswith("weights: MoE experts, NF4") for k in result.components)  # 4-bit experts
    if result.total > REFUSE_ABOVE * result.budget and not unmeasured:
        raise FastkitError(f"{result.verdict()} Nothing was loaded. See `fastkit plan` for the table, or pass "
                           "gpu=<GiB> to plan for another GPU.")
    if result.fits:
        logger.info("fastkit: %s", result.verdict())
    elif unmeasured:  # fastkit's 4-bit experts have not been measured against the planner: warn, never refuse
        logger.warning("fastkit: %s (4-bit MoE experts: an estimate not yet checked on a GPU; the run goes on)",
                       result.verdict())
    else:  # within the planner's margin: say so, let the run try
        logger.warning("fastkit: %s (within %d%% of the budget: it may still fit; watch the first steps)",
                       result.verdict(), round((REFUSE_ABOVE - 1) * 100))
    return result


__all__ = ["EIGHT_BIT", "GPUS", "OPTIMIZER_STATE_BYTES", "Plan", "PlanInputs", "auto_plan", "check_fits",
           "default_optimizer", "gpu_budget", "plan", "prequantized_4bit", "read_config"]
