"""The byte model's assembly: :class:`PlanInputs` (what a plan assumes) and :func:`components`, the bytes of one
LoRA (or full) training step at its peak, by component:

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

The per-token counts are :mod:`fastkit.plan.terms`', the DPO / GRPO passes :mod:`fastkit.plan.rl`'s; this module adds
them up, marks the phases not at the peak (:data:`OFF_PEAK`) and checks the inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastkit import checks
from fastkit.errors import FastkitError
from fastkit.patches.sizes import DEQUANT_BYTES_PER_WEIGHT, group_size  # the bound the forward uses
from fastkit.plan import rl
from fastkit.plan.gpus import NO_BF16
from fastkit.plan.multi import parallel_terms
from fastkit.plan.terms import ModelShape, activation_bytes, loss_bytes
from fastkit.units import DTYPE_BYTES, GiB, compute_dtype_name, dtype_name

CUDA_CONTEXT = int(0.6 * GiB)
"""CUDA context, cuBLAS workspace and kernels: memory the allocator does not see. Counted here once: the GPU
table's figures (:data:`fastkit.plan.gpus.CARDS`) are torch's ``total_memory``, the context not taken off."""
ALLOCATOR_SLACK = 0.08
"""Fragmentation of PyTorch's caching allocator, as a fraction of what the step allocates (the CUDA context,
outside the allocator, excluded)."""
OFF_PEAK = "(not at the peak) "
"""Prefix of a component that happens at another time than the peak (shown apart from the sum, not added)."""
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
    dtype: Any = None
    """Compute / weight dtype, a torch dtype or its name (``torch.bfloat16`` or ``"bfloat16"``; float16, bfloat16,
    float32); default 16-bit on a GPU, fp32 for ``gpu="cpu"``."""
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
    unified: bool | None = None
    """The GPU allocates from host memory (:data:`UNIFIED`): host-side bytes count against the budget.
    ``None``: from the ``gpu`` name (a number of GiB: a discrete card)."""
    kind: str = "sft"
    """``"sft"``, ``"dpo"`` (``batch_size`` pairs, chosen + rejected packed: 2 x ``max_seq_length`` tokens each, and
    the reference pass) or ``"grpo"`` (``batch_size`` prompts x ``num_generations`` completions: generation, the
    reference pass, the policy's log-prob pass); :mod:`fastkit.plan.rl` has the terms."""
    num_generations: int = 8
    """GRPO: completions per prompt (G, ``make_grpo_trainer(num_generations=...)``)."""
    max_completion_length: int = 512
    """GRPO: tokens per completion (C), counted at the maximum."""
    max_prompt_length: int | None = None
    """GRPO: tokens per prompt (P); None: ``max_seq_length - max_completion_length`` (make_grpo_trainer's limit)."""
    beta: float = 0.04
    """GRPO: KL strength; 0 skips the reference pass (DPO always runs it)."""
    gpus: int = 1
    """GPUs the run trains on, the plan per GPU (:mod:`fastkit.plan.multi`): each runs its own micro-batch."""
    fsdp: bool = False
    """With ``gpus`` > 1: FSDP2 (parameters, gradients and optimizer state sharded across the GPUs); False: DDP
    (a full copy on each GPU)."""
    gradient_accumulation_steps: int = 1
    """GRPO: TRL generates for a whole optimizer step at once (``steps_per_generation`` = this), so the
    generation batch is ``batch_size x num_generations x gradient_accumulation_steps`` completions."""


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


def _check_inputs(inputs: PlanInputs) -> None:  # max_seq_length: once, with the config (_check_decoder)
    checks.check_positive("batch_size", inputs.batch_size)
    if inputs.r is not None and (not isinstance(inputs.r, int) or inputs.r <= 0):
        raise FastkitError(f"r must be a positive int (LoRA rank) or None (full fine-tuning), got {inputs.r!r}.")
    if inputs.optimizer != "auto" and inputs.optimizer not in OPTIMIZER_STATE_BYTES:
        known = ", ".join(repr(k) for k in ("auto", *OPTIMIZER_STATE_BYTES))
        raise FastkitError(f"optimizer must be one of {known} (transformers' optim names), got {inputs.optimizer!r}.")
    if inputs.loss not in ("trl", "chunked", "full"):
        raise FastkitError(f"loss must be 'trl', 'chunked' or 'full', got {inputs.loss!r}.")
    if inputs.unified is not None and not isinstance(inputs.unified, bool):
        raise FastkitError(f"unified must be True, False or None (from the gpu name), got {inputs.unified!r}.")
    for name in ("load_in_4bit", "offload", "checkpointing", "expert_lora", "host_embedding", "host_lm_head"):
        if not isinstance(getattr(inputs, name), bool):
            raise FastkitError(f"{name} must be True or False, got {getattr(inputs, name)!r}.")
    if inputs.attn not in ("sdpa", "flash_attention_2", "eager"):
        raise FastkitError(f"attn must be 'sdpa', 'flash_attention_2' or 'eager', got {inputs.attn!r}.")
    if inputs.dtype is not None and (isinstance(inputs.dtype, bool) or dtype_name(inputs.dtype) not in DTYPE_BYTES):
        raise FastkitError(f"dtype must be torch.float16, torch.bfloat16, torch.float32 (or its name, e.g. "
                           f"'bfloat16') or None, got {inputs.dtype!r}.")
    if inputs.load_in_4bit and inputs.r is None:
        raise FastkitError("load_in_4bit=True trains LoRA adapters only: give a LoRA rank r (e.g. r=16).")
    if (inputs.host_embedding or inputs.host_lm_head) and inputs.r is None:
        raise FastkitError("host_embedding / host_lm_head keep FROZEN weights on the host: full fine-tuning (r=None) "
                           "trains them. Give a LoRA rank r, or leave them on the GPU.")
    _check_rl_inputs(inputs)
    _check_gpus(inputs)


def _check_gpus(inputs: PlanInputs) -> None:
    checks.check_positive("gpus", inputs.gpus)
    if not isinstance(inputs.fsdp, bool):
        raise FastkitError(f"fsdp must be True or False, got {inputs.fsdp!r}.")
    if inputs.fsdp and inputs.gpus < 2:
        raise FastkitError("fsdp=True shards the model across GPUs: give gpus=2 or more (one GPU: fsdp=False).")


def _check_rl_inputs(inputs: PlanInputs) -> None:
    checks.check_choice("kind", inputs.kind, rl.KINDS)
    checks.check_positive("num_generations", inputs.num_generations)
    checks.check_positive("max_completion_length", inputs.max_completion_length)
    checks.check_positive("max_prompt_length", inputs.max_prompt_length, allow_none=True)
    checks.check_positive("gradient_accumulation_steps", inputs.gradient_accumulation_steps)
    if isinstance(inputs.beta, bool) or not isinstance(inputs.beta, (int, float)) or not inputs.beta >= 0:
        raise FastkitError(f"beta must be a number >= 0 (0: no reference pass), got {inputs.beta!r}.")
    if inputs.kind != "grpo":
        return
    if inputs.num_generations < 2:
        raise FastkitError(f"num_generations={inputs.num_generations}: GRPO compares completions of the same prompt, "
                           "give at least 2.")
    if rl.prompt_tokens(inputs) <= 0:
        raise FastkitError(f"max_completion_length={inputs.max_completion_length} leaves no room for the prompt in "
                           f"max_seq_length={inputs.max_seq_length}: raise max_seq_length or give max_prompt_length.")


def _vision_weights(shape: ModelShape, dtype: str, size: int) -> dict[str, int]:
    """A vision-language model's tower and projector: frozen, 16-bit (no LoRA, no optimizer state by default)."""
    return {f"weights: vision tower + projector, {dtype}": shape.vision_params * size} if shape.vision_params else {}


def _weights(shape: ModelShape, inputs: PlanInputs, dtype: str, size: int) -> tuple[dict[str, int], int]:
    """``(terms, expert parameters)``: the model's weights by kind, as loaded (NF4 where 4-bit, else ``dtype``)."""
    out: dict[str, int] = {}
    if inputs.load_in_4bit:  # MXFP4 (GPT-OSS) too: patches.moe.linear_4bit quantizes them after load
        out["weights: linear layers, NF4 + absmax (double quant)"] = int(shape.linear_params * NF4_BYTES)
    else:
        out[f"weights: linear layers, {dtype}"] = shape.linear_params * size
    out.update(_embedding_weights(shape, inputs, dtype, size))
    experts = shape.expert_params_per_layer * (shape.layers - shape.dense_layers) if shape.experts else 0
    if inputs.load_in_4bit and experts:  # fastkit stores MoE experts NF4 too (patches/moe/nf4.py)
        out["weights: MoE experts, NF4 + absmax"] = int(experts * NF4_BYTES)
        experts_16 = 0
    else:
        experts_16 = experts
    what = "norms, router, experts, other" if experts_16 else "norms, router, other"
    out[f"weights: {what}, {dtype}"] = (shape.other_params - experts + experts_16) * size
    out.update(_vision_weights(shape, dtype, size))
    out.update(rl.reference_weights(shape, inputs, size, dtype))
    return out, experts


def components(shape: ModelShape, inputs: PlanInputs, cuda: bool) -> dict[str, int]:
    """Bytes at the training peak, by component (see the module docstring)."""
    dtype, size = _dtype(inputs, cuda)
    out, experts = _weights(shape, inputs, dtype, size)
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
        out[f"gradients (full fine-tuning, {dtype})"] = trainable * size
    out[f"optimizer state ({optimizer})"] = trainable * OPTIMIZER_STATE_BYTES[optimizer]
    out = parallel_terms(out, shape, inputs, size, weight=NF4_BYTES if inputs.load_in_4bit else size,
                         grad=4 if inputs.r is not None else size)
    stream = 4 if dtype == "float16" and not shape.saved_fp16 else size  # patches/fp16 keeps it fp32
    kept, phases = _step_terms(shape, inputs, size, adapter=size if cuda else 4, stream=stream)
    out.update(kept)
    if inputs.load_in_4bit:
        out["4-bit dequantized weight (largest layer)"] = shape.largest_linear * size * 2
    out.update(rl.kept_logps(inputs))
    out.update(phases)
    tokens = _tokens(inputs)
    if cuda and inputs.unified:
        out.update(_unified_terms(shape, inputs, tokens, size, stream))
    if cuda:
        slack = int(ALLOCATOR_SLACK * _peak(out))  # of what the allocator holds: the context is outside it
        out["CUDA context (outside the allocator)"] = CUDA_CONTEXT
        out[f"allocator slack ({ALLOCATOR_SLACK:.0%})"] = slack
    return out


def _tokens(inputs: PlanInputs) -> int:
    rows, per_row = rl.step_rows(inputs)
    return rows * per_row


def _step_terms(shape: ModelShape, inputs: PlanInputs, size: int, adapter: int,
                stream: int) -> tuple[dict[str, int], dict[str, int]]:
    """``(kept, phases)``: the training step's kept activations and the phases that do not overlap, the smaller
    ones marked :data:`OFF_PEAK` (in both): one layer's backward, the loss, the reference pass (DPO: after the
    policy's forward, so on top of its kept activations; GRPO: before the step, alone) and GRPO's generation
    (alone)."""
    rows, per_row = rl.step_rows(inputs)
    tokens = rows * per_row
    step = PlanInputs(**{**inputs.__dict__, "batch_size": rows, "max_seq_length": per_row})
    kept, transient = activation_bytes(shape, step, tokens, size, adapter=adapter, stream=stream)
    transient.update(_loss_term(shape, inputs, tokens, size))
    alone: list[dict[str, int]] = []  # phases with no training activations alive (GRPO's, before the step)
    if inputs.kind == "grpo":
        alone = [p for p in (rl.generation_phase(shape, inputs, size), rl.reference_pass(shape, inputs, size)) if p]
    else:
        transient.update(rl.reference_pass(shape, inputs, size))
    top = max(transient, key=transient.get)
    phases = [{**kept, top: transient[top]}, *alone]
    peak = max(phases, key=lambda p: sum(p.values()))
    def mark(terms: dict[str, int]) -> dict[str, int]:
        return {name if name in peak else f"{OFF_PEAK}{name}": nbytes for name, nbytes in terms.items()}

    return mark(kept), mark({**transient, **{k: v for p in alone for k, v in p.items()}})


def _unified_terms(shape: ModelShape, inputs: PlanInputs, tokens: int, size: int, stream: int) -> dict[str, int]:
    """On unified memory the "host" side is the same pool: offloaded layer inputs and host weights count."""
    out = {}
    if inputs.offload and inputs.checkpointing and shape.layers > 2:
        out["host-side: offloaded layer inputs (unified memory: the same pool)"] = int(
            (shape.layers - 2) * shape.hidden * stream * tokens)
    for name, nbytes in host_terms(shape, inputs, cuda=True).items():
        if name.startswith("host (pinned)"):
            out[f"host-side: {name.removeprefix('host (pinned): ')} (unified memory: the same pool)"] = nbytes
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


def _embedding_weights(shape: ModelShape, inputs: PlanInputs, name: str, size: int) -> dict[str, int]:
    """Device bytes of the input embedding and lm_head (one line, or one per matrix when one stays on the host)."""
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
    dtype, size = _dtype(inputs, cuda)
    tokens = _tokens(inputs)
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


def _dtype(inputs: PlanInputs, cuda: bool) -> tuple[str, int]:
    """(the compute dtype's name, its bytes per value): ``inputs.dtype``, else fastkit's rule for the GPU."""
    name = dtype_name(inputs.dtype) if inputs.dtype is not None else \
        compute_dtype_name(cuda, bf16=inputs.gpu not in NO_BF16)
    return name, DTYPE_BYTES[name]
