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

import logging
from dataclasses import dataclass, field
from typing import Any

from fastkit import checks
from fastkit.errors import FastkitError
from fastkit.patches.sizes import DEQUANT_BYTES_PER_WEIGHT, group_size  # the bound the forward uses
from fastkit.plan import rl
from fastkit.plan.configs import ShippedConfig
from fastkit.plan.gpus import CARDS, GPUS, NO_BF16, UNIFIED, gpu_name
from fastkit.plan.source import _check_decoder, check_config, planned_config, read_config
from fastkit.plan.terms import ModelShape, activation_bytes, loss_bytes, quantization_values, shape_of
from fastkit.units import DTYPE_BYTES, GiB, compute_dtype_name, dtype_name

logger = logging.getLogger("fastkit")

CUDA_CONTEXT = int(0.6 * GiB)
"""CUDA context, cuBLAS workspace and kernels: memory the allocator does not see. Counted here once: the GPU
table's figures (:data:`fastkit.plan.gpus.CARDS`) are torch's ``total_memory``, the context not taken off."""
ALLOCATOR_SLACK = 0.08
"""Fragmentation of PyTorch's caching allocator, as a fraction of what the step allocates (the CUDA context,
outside the allocator, excluded)."""
OFF_PEAK = "(not at the peak) "
"""Prefix of a component that happens at another time than the peak (shown apart from the sum, not added)."""
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
    gradient_accumulation_steps: int = 1
    """GRPO: TRL generates for a whole optimizer step at once (``steps_per_generation`` = this), so the
    generation batch is ``batch_size x num_generations x gradient_accumulation_steps`` completions."""


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
    longest: dict[str, int | None] = field(default_factory=dict)
    """``max_seq_length="max"``: setup name (:data:`SETUPS`) -> the longest packed row that fits (None: not even
    :data:`MIN_SEARCH` tokens). Empty otherwise."""
    largest: dict[str, int | None] = field(default_factory=dict)
    """GRPO on a GPU: ``"num_generations"`` -> the most completions per prompt that fit at this completion length,
    ``"max_completion_length"`` -> the longest completions that fit at this G (None: not even the smallest)."""

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
        where = "host" if self.budget is None else f"{self.inputs.gpu} ({self.budget / GiB:.2f} GiB total)"
        if self.inputs.unified and self.budget is not None:
            where += ", unified memory"
        word = "fits" if self.fits else "does NOT fit"
        if self.budget is not None:
            left = (self.budget - self.total) / GiB
            where += f", {left:.2f} GiB to spare" if self.fits else f", {-left:.2f} GiB over"
        line = f"{self.model}: predicted peak {self.total / GiB:.2f} GiB, {word} on {where}"
        return line if self.fits else f"{line}. {' '.join(self.advice[:2])}"

    def assumption(self) -> str:
        """What the numbers refer to: rows x tokens x batch of one micro-batch, e.g. ``1 row × 4,096 tokens ×
        batch 1 (packed)``, and the setup (LoRA rank, weights, checkpointing, loss)."""
        return f"{_shape_line(self.inputs)}\nSetup: {_setup_line(self.inputs, cuda=self.budget is not None)}"

    def header(self) -> str:
        """The table's first lines: the model, the GPU's budget and where it comes from, the assumption."""
        if self.budget is None:
            where = "on the host (no budget)"
        else:
            card = CARDS.get(str(self.inputs.gpu).strip().lower())
            source = card.source if card else "as given"
            where = f"on {self.inputs.gpu}: {self.budget / GiB:.2f} GiB ({source}; the CUDA context is a row below)"
        return f"{self.model} {where}\nPlanned for: {self.assumption()}"

    def longest_table(self) -> str:
        """``max_seq_length="max"``: the longest packed row per setup (markdown)."""
        rows = ["| setup | longest packed row (tokens) |", "|---|---:|"]
        for name, n in self.longest.items():
            rows.append(f"| {name} | {'does not fit' if n is None else f'{n:,}'} |")
        note = f" ({UNIFIED_NOTE})" if self.inputs.unified else ""
        where = self.inputs.gpu if self.budget is None else f"{self.inputs.gpu} ({self.budget / GiB:.2f} GiB total)"
        return "\n".join(rows) + f"\n\n{self.model} on {where}, batch {self.inputs.batch_size}, " \
            f"LoRA r={self.inputs.r}; each the longest row that fits, to {SEARCH_STEP} tokens, with no margin for " \
            f"the planner's error (within 15% on measured twins){note}"

    def table(self) -> str:
        """The header (what is assumed), the components at the peak and their sum, then apart from the sum the
        terms not at the peak and those off the GPU, then the verdict (markdown)."""
        unit, scale = ("GiB", GiB) if self.total >= GiB else ("MiB", 2**20)
        peak = {k: v for k, v in self.components.items() if not k.startswith(OFF_PEAK)}
        off = {k.removeprefix(OFF_PEAK): v for k, v in self.components.items() if k.startswith(OFF_PEAK)}
        parts = [self.header(), _rows(peak, unit, scale, total=self.total)]
        if off:
            parts += ["Not at the peak (another phase of the step; shown, not added):", _rows(off, unit, scale)]
        if self.host:
            parts += ["Off the GPU (not added):", _rows(self.host, unit, scale)]
        return "\n\n".join(parts) + "\n\n" + self.verdict() + self._largest_line()

    def _largest_line(self) -> str:
        """GRPO on a GPU: the most completions per prompt and the longest completions that fit (``largest``)."""
        if not self.largest:
            return ""
        i = self.inputs
        g, c = (self.largest.get(k) for k in ("num_generations", "max_completion_length"))
        g_text = f"at most {g:,}" if g is not None else "not even 2"
        c_text = f"at most {c:,} tokens" if c is not None else "not even 1 token"
        return (f"\nGRPO on {i.gpu}: {g_text} completions per prompt of {i.max_completion_length} tokens fit; "
                f"completions of {c_text} with num_generations={i.num_generations} "
                f"(batch {i.batch_size} prompt(s) of {rl.prompt_tokens(i)} tokens).")


def _rows(terms: dict[str, int], unit: str, scale: int, total: int | None = None) -> str:
    """A markdown table of ``terms``; with ``total``, its sum as the last row (the predicted peak)."""
    rows = [f"| component | {unit} |", "|---|---:|"]
    rows += [f"| {name} | {nbytes / scale:.2f} |" for name, nbytes in terms.items()]
    if total is not None:
        rows.append(f"| **predicted peak** | **{total / scale:.2f}** |")
    return "\n".join(rows)


def _shape_line(inputs: PlanInputs) -> str:
    """One micro-batch as rows x tokens x batch (SFT packed rows, DPO's pair, GRPO's completions)."""
    rows, per_row = rl.step_rows(inputs)
    each, batch = rows // inputs.batch_size, inputs.batch_size
    if inputs.kind == "dpo":
        what = f"{each} rows (chosen + rejected, packed into one)"
    elif inputs.kind == "grpo":
        what = f"{each} rows (completions of one prompt)"
    else:
        what = f"{each} row{'s' if each > 1 else ''}"
    length = f"{per_row:,} tokens"
    if inputs.kind == "grpo":
        length += f" ({rl.prompt_tokens(inputs):,} prompt + {inputs.max_completion_length:,} completion)"
    packed = " (packed)" if inputs.kind == "sft" else ""
    return f"{what} × {length} × batch {batch}{packed} = {rows * per_row:,} tokens per step"


def _setup_line(inputs: PlanInputs, cuda: bool) -> str:
    """The setup the plan assumes, in the words of ``fastkit plan``'s flags."""
    adapter = "full fine-tuning" if inputs.r is None else f"LoRA r={inputs.r}"
    weights = "4-bit (NF4) weights" if inputs.load_in_4bit else "16-bit weights"
    ckpt = ("checkpointing + offload" if inputs.offload else "checkpointing") if inputs.checkpointing \
        else "no checkpointing"
    host = [w for w, on in (("input embedding", inputs.host_embedding), ("lm_head", inputs.host_lm_head)) if on]
    where = f", {' and '.join(host)} on the host" if host else ""
    optimizer = inputs.optimizer
    if optimizer == "auto":
        optimizer = default_optimizer("cuda" if cuda else "cpu", inputs.load_in_4bit)
    return f"{adapter}, {weights}, {ckpt}{where}, loss {inputs.loss}, optimizer {optimizer}"


def gpu_budget(gpu: str | float | int) -> int | None:
    """Usable bytes of a GPU name or a number of GiB; None for ``"cpu"``."""
    if isinstance(gpu, (int, float)) and not isinstance(gpu, bool):
        return int(gpu_name(gpu) * GiB)
    name = str(gpu).strip().lower()
    if name == "cpu":
        return None
    if name in CARDS:
        return int(CARDS[name].gib * GiB)
    try:
        gib = float(name.removesuffix("gib").removesuffix("gb"))
    except ValueError:
        gib = -1.0
    if gib > 0:
        return int(gpu_name(gib) * GiB)  # "inf" / "1e400" refused there, naming the size
    raise FastkitError(f"gpu={gpu!r} is not a GPU the planner knows. Use one of {', '.join(GPUS)}, "
                       "'cpu', or a number of GiB (e.g. 24).")


def is_unified(gpu: str | float | int) -> bool:
    """True for a GPU name in :data:`UNIFIED` (a number of GiB is planned as a discrete card)."""
    return isinstance(gpu, str) and gpu.strip().lower() in UNIFIED


UNIFIED_NOTE = ("unified memory: host and GPU share one pool, so activation offload and host weights save nothing "
                "and are counted against it; FastModel never turns them on here")


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


class PlanBuildError(FastkitError):
    """The config is valid but the meta-device count cannot build this architecture (the load-time plan is then
    skipped, not a refusal)."""


def plan(model_or_config: Any, gpu: str | float = "t4", max_seq_length: int | str = 2048, batch_size: int = 1,
         r: int | None = 16, load_in_4bit: bool = False, offload: bool = False, **options: Any) -> Plan:
    """Predict the training peak of ``model_or_config`` on ``gpu``, by component, with a verdict and advice.

    ``options`` are the other fields of :class:`PlanInputs` (``checkpointing``, ``optimizer``, ``loss``,
    ``dtype``, ``attn``). Nothing is downloaded but a Hub id's ``config.json`` (none for the models in
    :data:`fastkit.plan.configs.KNOWN_CONFIGS`); no weights are built. ``max_seq_length="max"``: the longest
    packed row that fits, per setup of :data:`SETUPS` (``Plan.longest``, found with this same model), and the
    plan of the asked setup at its own longest row.
    """
    unknown = set(options) - set(PlanInputs.__dataclass_fields__)
    if unknown:
        raise FastkitError(f"plan() got unknown option(s) {sorted(unknown)}; known: "
                           f"{', '.join(PlanInputs.__dataclass_fields__)}")
    gpu = gpu_name(gpu)  # one spelling from here on: "T4 " plans as "t4" (fp16 weights, its budget)
    search = max_seq_length == "max"
    inputs = PlanInputs(gpu=str(gpu), max_seq_length=MIN_SEARCH if search else max_seq_length, batch_size=batch_size,
                        r=r, load_in_4bit=load_in_4bit, offload=offload, **options)
    if search and inputs.kind == "grpo":
        raise FastkitError("max_seq_length='max' searches SFT/DPO rows; a GRPO plan on a GPU gives the largest "
                           "num_generations and max_completion_length that fit (Plan.largest).")
    _check_inputs(inputs)
    budget = gpu_budget(gpu)
    if inputs.unified is None:
        inputs.unified = is_unified(gpu)
    if search and budget is None:
        raise FastkitError("max_seq_length='max' needs a GPU to fit (a name or a number of GiB), not gpu='cpu'.")
    config = planned_config(model_or_config)
    check_config(config)
    _check_decoder(config)
    if inputs.kind == "grpo":  # the generated rows: prompt + completion
        checks.check_max_seq_length(rl.prompt_tokens(inputs) + inputs.max_completion_length, config)
    elif not search:  # the search tries lengths up to the model's context itself
        checks.check_max_seq_length(max_seq_length, config)
    name = model_or_config if isinstance(model_or_config, str) else getattr(config, "name_or_path", "")
    return _predict(config, inputs, budget, name, search=search)


def _predict(config, inputs: PlanInputs, budget: int | None, name: str = "", search: bool = False) -> Plan:
    """:func:`plan`'s prediction, for inputs already checked against ``config`` (``max_seq_length``: by
    :func:`plan`, :func:`auto_plan`, or the loader before :func:`check_fits`); ``search``: the longest rows too."""
    inputs.load_in_4bit = inputs.load_in_4bit or prequantized_4bit(config)
    shape = _shape(config)
    longest = {}
    if search:
        longest = longest_rows(shape, inputs, budget, _context(config))
        asked = longest_row(shape, inputs, budget, _context(config))
        inputs.max_seq_length = asked or MIN_SEARCH
    result = _result(name or config.model_type, shape, inputs, budget)
    result.longest = longest
    if inputs.kind == "grpo" and budget is not None:
        result.largest = largest_grpo(shape, inputs, budget, _context(config))
    return result


def _shape(config) -> ModelShape:
    if isinstance(config, ShippedConfig):
        return config.shape
    try:
        return shape_of(config)
    except FastkitError:
        raise
    except Exception as exc:  # noqa: BLE001 -- an architecture the meta-device count cannot build
        raise PlanBuildError(f"model_type {config.model_type!r}: the planner cannot build this config on the meta "
                             f"device ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})") from exc


def _result(name: str, shape: ModelShape, inputs: PlanInputs, budget: int | None) -> Plan:
    result = Plan(name, inputs, budget=budget)
    result.components = components(shape, inputs, cuda=budget is not None)
    host = host_terms(shape, inputs, cuda=budget is not None)
    if inputs.unified:  # the pinned bytes are in the components (same pool); the traffic stays listed here
        host = {k: v for k, v in host.items() if not k.startswith("host (pinned)")}
    result.host = host
    if not result.fits:
        result.advice = advise(shape, inputs, budget)
    return result


# -- the longest row ---------------------------------------------------------------------------------
SETUPS: tuple[tuple[str, dict], ...] = (
    ("no checkpointing", dict(checkpointing=False, offload=False, host_embedding=False, host_lm_head=False)),
    ("checkpointing", dict(checkpointing=True, offload=False, host_embedding=False, host_lm_head=False)),
    ("checkpointing + offload", dict(checkpointing=True, offload=True, host_embedding=False, host_lm_head=False)),
    ("checkpointing + offload + host weights", dict(checkpointing=True, offload=True, host_embedding=True,
                                                     host_lm_head=True)),
    ("4-bit + checkpointing", dict(checkpointing=True, offload=False, host_embedding=False, host_lm_head=False,
                                   load_in_4bit=True)),
)
"""The setups ``max_seq_length="max"`` answers for (host weights and 4-bit: LoRA only)."""
MIN_SEARCH = 64
"""The shortest row the search tries; below it a setup "does not fit"."""
SEARCH_STEP = 64
"""The longest row is found to this many tokens (the peak grows with the row: a bisection over multiples)."""
SEARCH_CAP = 1 << 20
"""Rows are searched up to the model's context, or this many tokens for a config without one."""


def _context(config) -> int:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    context = getattr(text, "max_position_embeddings", None)
    return context if isinstance(context, int) and context > 0 else SEARCH_CAP


def longest_row(shape: ModelShape, inputs: PlanInputs, budget: int, context: int) -> int | None:
    """The longest ``max_seq_length`` (a multiple of :data:`SEARCH_STEP`, at most ``context``) whose plan fits
    ``budget`` with the other ``inputs`` as given; None when :data:`MIN_SEARCH` tokens do not fit."""
    def fits(n: int) -> bool:
        trial = PlanInputs(**{**inputs.__dict__, "max_seq_length": n})
        return _peak(components(shape, trial, cuda=True)) <= budget

    if not fits(MIN_SEARCH):
        return None
    if fits(context):
        return context
    lo, hi = MIN_SEARCH // SEARCH_STEP, context // SEARCH_STEP + 1  # fits(lo * step), not fits(hi * step)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * SEARCH_STEP) else (lo, mid)
    return lo * SEARCH_STEP


GRPO_MAX_GENERATIONS = 1024
"""The most completions per prompt :func:`largest_grpo` tries."""


def _largest(fits, lo: int, hi: int) -> int | None:
    """The largest ``n`` in ``[lo, hi]`` with ``fits(n)`` (``fits`` true up to some n, false above); None if not lo."""
    if hi < lo or not fits(lo):
        return None
    if fits(hi):
        return hi
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def largest_grpo(shape: ModelShape, inputs: PlanInputs, budget: int, context: int) -> dict[str, int | None]:
    """The most completions per prompt (at this ``max_completion_length``) and the longest completions (at this
    ``num_generations``) whose GRPO plan fits ``budget``, the prompt length held (the same byte model, bisection)."""
    prompt = rl.prompt_tokens(inputs)
    base = {**inputs.__dict__, "max_prompt_length": prompt}

    def fits(**change) -> bool:
        return _peak(components(shape, PlanInputs(**{**base, **change}), cuda=True)) <= budget

    return {"num_generations": _largest(lambda n: fits(num_generations=n), 2, GRPO_MAX_GENERATIONS),
            "max_completion_length": _largest(lambda n: fits(max_completion_length=n), 1, context - prompt)}


def longest_rows(shape: ModelShape, inputs: PlanInputs, budget: int, context: int) -> dict[str, int | None]:
    """:func:`longest_row` for each of :data:`SETUPS` (those that need LoRA left out for full fine-tuning)."""
    out = {}
    for name, knobs in SETUPS:
        if inputs.r is None and (knobs.get("host_embedding") or knobs.get("load_in_4bit")):
            continue
        out[name] = longest_row(shape, PlanInputs(**{**inputs.__dict__, **knobs}), budget, context)
    return out


CONTEXT_GPUS = ("t4", "l4", "rtx-24g", "a100-80", "h100", "spark")
"""The columns of docs/plan.md's long-context table."""


def context_table(models: list[str], gpus: tuple[str, ...] = CONTEXT_GPUS) -> str:
    """docs/plan.md's table: per model and GPU, the longest packed row (LoRA r=16, batch 1) with checkpointing
    in 16-bit / with 4-bit weights (``plan(..., max_seq_length="max")``; tests/test_plan.py keeps it true)."""
    def cell(longest: dict) -> str:
        a, b = longest.get("checkpointing"), longest.get("4-bit + checkpointing")
        return " / ".join("-" if n is None else f"{n:,}" for n in (a, b))

    rows = ["| model | " + " | ".join(gpus) + " |", "|---|" + "---:|" * len(gpus)]
    for model in models:
        rows.append(f"| {model} | " + " | ".join(cell(plan(model, gpu=g, max_seq_length="max").longest)
                                               for g in gpus) + " |")
    return "\n".join(rows)


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


def components(shape: ModelShape, inputs: PlanInputs, cuda: bool) -> dict[str, int]:
    """Bytes at the training peak, by component (see the module docstring)."""
    dtype, size = _dtype(inputs, cuda)
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
    out.update(rl.reference_weights(shape, inputs, size, dtype))
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


def _tries(shape: ModelShape, inputs: PlanInputs) -> list[tuple[str, dict]]:
    """The single knobs :func:`advise` tries, cheapest in quality first."""
    tries: list[tuple[str, dict]] = []
    if not inputs.checkpointing:
        tries.append(("turn on use_gradient_checkpointing=True", dict(checkpointing=True)))
    if inputs.loss == "full":
        tries.append(("train through make_trainer (TRL's fused LM head) or fastkit's chunked loss",
                      dict(loss="trl")))
    if inputs.optimizer == "auto" or OPTIMIZER_STATE_BYTES[inputs.optimizer] > OPTIMIZER_STATE_BYTES[EIGHT_BIT]:
        tries.append((f"use the 8-bit optimizer (optim={EIGHT_BIT!r})", dict(optimizer=EIGHT_BIT)))
    if not inputs.offload and not inputs.unified:  # unified memory: the host is the same pool (UNIFIED)
        tries.append(("use_gradient_checkpointing='offload' (layer inputs on the host)",
                      dict(offload=True, checkpointing=True)))
    if not inputs.load_in_4bit and inputs.r is not None:
        tries.append(("load_in_4bit=True (QLoRA)", dict(load_in_4bit=True)))
    if not inputs.unified:
        tries += _host_tries(shape, inputs)
    if inputs.load_in_4bit and shape.experts and inputs.r is not None and inputs.expert_lora:
        tries.append(("LoRA on the linear layers only (get_peft_model(target_modules=[...]) without the experts)",
                      dict(expert_lora=False)))
    seq = inputs.max_seq_length if inputs.kind != "grpo" else 0  # GRPO: its own knobs below
    while seq > 256:
        seq //= 2
        tries.append((f"shorter rows: max_seq_length={seq}", dict(max_seq_length=seq)))
    if inputs.batch_size > 1:
        tries.append(("batch_size=1 with gradient_accumulation_steps", dict(batch_size=1)))
    tries += _grpo_tries(inputs)
    if inputs.r is not None and inputs.r > 8:
        tries.append(("smaller LoRA rank: r=8", dict(r=8)))
    return tries


def _grpo_tries(inputs: PlanInputs) -> list[tuple[str, dict]]:
    """GRPO's own knobs: fewer completions per prompt, shorter completions (halved, while sensible)."""
    if inputs.kind != "grpo":
        return []
    tries = []
    if inputs.num_generations >= 4:
        g = inputs.num_generations // 2
        tries.append((f"fewer completions per prompt: num_generations={g}", dict(num_generations=g)))
    if inputs.max_completion_length >= 128:
        c = inputs.max_completion_length // 2
        tries.append((f"shorter completions: max_completion_length={c}", dict(max_completion_length=c,
                                                                               max_prompt_length=rl.prompt_tokens(inputs))))
    return tries


def advise(shape: ModelShape, inputs: PlanInputs, budget: int) -> list[str]:
    """Single knobs that bring the plan under ``budget``, cheapest in quality first."""
    cuda = True
    fixes = []
    for text, change in _tries(shape, inputs):
        trial = PlanInputs(**{**inputs.__dict__, **change})
        total = _peak(components(shape, trial, cuda))
        if total <= budget:
            fixes.append(f"Fix: {text} (predicted {total / GiB:.1f} GiB).")
            if "max_seq_length" in change:
                break
    if not fixes:
        fixes.append("No single knob is enough: combine 4-bit, offload and shorter rows, or use a larger GPU."
                     if not inputs.unified else "No single knob is enough: combine 4-bit and shorter rows.")
    if inputs.unified:
        fixes.append(f"(Not offered: activation offload and host weights; {UNIFIED_NOTE}.)")
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


def auto_plan(config, gpu, max_seq_length: int, load_in_4bit: bool,
              unified: bool | None = None) -> tuple[str, Plan] | None:
    """What ``get_peft_model(use_gradient_checkpointing="auto")`` turns on when plain checkpointing does not fit:
    the first of :data:`AUTO_STEPS` within :data:`AUTO_HEADROOM` of the budget, else the first that fits, as
    ``(what, its plan)`` (the plan flagged ``needs_offload``); None when none fits, and always None on unified
    memory (``unified``, else from the ``gpu`` name: :data:`UNIFIED`), where those steps save nothing."""
    if unified or (unified is None and is_unified(gpu)):
        return None
    name = config if isinstance(config, str) else getattr(config, "name_or_path", "")
    config = planned_config(config)
    check_config(config)
    _check_decoder(config)
    checks.check_max_seq_length(max_seq_length, config)
    return _auto(config, gpu, max_seq_length, load_in_4bit, name)


def _auto(config, gpu, max_seq_length: int, load_in_4bit: bool, name: str = "") -> tuple[str, Plan] | None:
    """:func:`auto_plan` for a config its inputs were checked against (not on unified memory: the caller's check)."""
    first = None
    for what, knobs in AUTO_STEPS:
        inputs = PlanInputs(gpu=str(gpu), max_seq_length=max_seq_length, load_in_4bit=load_in_4bit, unified=False,
                            **knobs)
        trial = _predict(config, inputs, gpu_budget(gpu), name or getattr(config, "name_or_path", ""))
        if trial.fits:
            trial.needs_offload = True
            first = first or (what, trial)
            if trial.total <= AUTO_HEADROOM * trial.budget:
                first = (what, trial)
                break
    return first


def check_fits(config, device, gpu: str | float | None, max_seq_length: int,
               load_in_4bit: bool) -> Plan | None:
    """The load-time verdict (LoRA r=16, checkpointing, batch 1): None off CUDA without a ``gpu`` target.

    Raises :class:`FastkitError` with the advice when the run cannot fit, before any weight is read.
    """
    unified = is_unified(gpu) if gpu is not None else None
    if gpu is None:
        if device.type != "cuda":
            return None
        import torch  # the loader's path: torch is there

        props = torch.cuda.get_device_properties(device)
        gpu = props.total_memory / GiB  # torch's reading, as the GPU table holds it (the context: a component)
        unified = bool(getattr(props, "is_integrated", False))  # DGX Spark, Jetson: one pool (UNIFIED)
    check_config(config)
    _check_decoder(config)  # max_seq_length: checked by the loader, once, against this config
    inputs = PlanInputs(gpu=str(gpu), max_seq_length=max_seq_length, load_in_4bit=load_in_4bit,
                        unified=is_unified(gpu) if unified is None else unified)
    try:
        result = _predict(config, inputs, gpu_budget(gpu), getattr(config, "name_or_path", ""))
    except PlanBuildError as exc:  # an architecture the meta-device count cannot build: no verdict, no refusal
        logger.info("fastkit: no memory plan for %s (%s)", config.model_type, exc)
        return None
    if not result.fits and unified:
        logger.info("fastkit: %s: activation offload and host weights are not turned on (%s)", result.model,
                    UNIFIED_NOTE)
    if not result.fits:
        better = None if result.inputs.unified else _auto(config, gpu, max_seq_length, load_in_4bit)
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


__all__ = ["EIGHT_BIT", "GPUS", "OPTIMIZER_STATE_BYTES", "SETUPS", "UNIFIED", "Plan", "PlanBuildError", "PlanInputs",
           "auto_plan", "check_config", "check_fits", "context_table", "default_optimizer", "gpu_budget",
           "is_unified", "longest_row", "longest_rows", "plan", "prequantized_4bit", "read_config"]
