"""The plan as text: :class:`Plan` (the components, the verdict, the table ``fastkit plan`` prints, the longest rows)
and :func:`advise`, the single knobs that bring a plan under its budget, cheapest in quality first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastkit.errors import FastkitError
from fastkit.plan import rl
from fastkit.plan.gpus import CARDS, UNIFIED_NOTE
from fastkit.plan.multi import setup_words
from fastkit.plan.peak import (
    EIGHT_BIT,
    OFF_PEAK,
    OPTIMIZER_STATE_BYTES,
    PlanInputs,
    _peak,
    components,
    default_optimizer,
)
from fastkit.plan.search import MIN_SEARCH, SEARCH_STEP  # noqa: F401 (MIN_SEARCH: named in Plan's docstrings)
from fastkit.plan.terms import ModelShape
from fastkit.units import GiB


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
    vision: str = ""
    """A vision-language model: its vision tower's parameters and the tokens of one image (a line of the table)."""
    largest: dict[str, int | None] = field(default_factory=dict)
    single: int | None = None
    """``gpus`` > 1: the predicted peak of the same run on one GPU (bytes), for the comparison line."""
    across: tuple[int, bool, int] | None = None
    """One GPU that does not fit: ``(gpus, fsdp, bytes per GPU)`` of the fewest GPUs that fit (DDP before FSDP2 at
    the same count), or None. Not in :meth:`table` (``fastkit plan`` prints it below)."""
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
        vision = f"\nVision: {self.vision}" if self.vision else ""
        return f"{self.model} {where}\nPlanned for: {self.assumption()}{vision}"

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
        return "\n\n".join(parts) + "\n\n" + self.verdict() + self._largest_line() + self._gpus_line()

    def _gpus_line(self) -> str:
        """``gpus`` > 1: the same run on one GPU, and whether the N GPUs are what makes it fit."""
        if self.single is None:
            return ""
        how = "FSDP2" if self.inputs.fsdp else "DDP"
        line = f"\nOne GPU: predicted {self.single / GiB:.2f} GiB"
        if self.budget is None:
            return line + f"; {self.inputs.gpus} GPUs with {how}: {self.total / GiB:.2f} GiB per GPU."
        one = "fits" if self.single <= self.budget else "does NOT fit"
        many = "fits" if self.fits else "does NOT fit"
        return line + f", {one}; {self.inputs.gpus} GPUs with {how}: {self.total / GiB:.2f} GiB per GPU, {many}."

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
    return f"{adapter}, {weights}, {ckpt}{where}, loss {inputs.loss}, optimizer {optimizer}{setup_words(inputs)}"


INTERFACES = ("python", "cli")
"""The words a plan's advice is given in (``plan(..., interface=...)``): ``"python"``, the arguments of
``from_pretrained`` / ``get_peft_model`` / ``make_trainer``; ``"cli"``, the flags of ``fastkit train`` (which
``fastkit plan`` takes too)."""


def _host_tries(shape: ModelShape, inputs: PlanInputs) -> list[tuple[tuple[str, str], dict]]:
    """The host-weights knobs :func:`advise` tries (LoRA only: the weights must be frozen; untied only). fastkit
    train has no flag for them: its load-time plan turns them on where it needs them (--checkpointing auto)."""
    if inputs.r is None or shape.tied:
        return []
    tries = []
    cli = " (fastkit train turns it on by itself where its load-time plan needs it; the table: add {})"
    if not inputs.host_embedding:
        tries.append((("keep the frozen input embedding on the host (get_peft_model(host_weights="
                       "fastkit.HostWeights(input_embedding=True)))",
                       "keep the frozen input embedding on the host" + cli.format("--host-embedding")),
                      dict(host_embedding=True)))
    if not (inputs.host_embedding and inputs.host_lm_head):
        tries.append((("keep the frozen input embedding and lm_head on the host (get_peft_model(host_weights="
                       "fastkit.HostWeights(input_embedding=True, lm_head=True)))",
                       "keep the frozen input embedding and lm_head on the host"
                       + cli.format("--host-embedding --host-lm-head")),
                      dict(host_embedding=True, host_lm_head=True)))
    return tries


def _tries(shape: ModelShape, inputs: PlanInputs) -> list[tuple[tuple[str, str], dict]]:
    """The single knobs :func:`advise` tries, cheapest in quality first: ``((python words, cli words), change)``."""
    tries: list[tuple[tuple[str, str], dict]] = []
    if not inputs.checkpointing:
        tries.append((("turn on use_gradient_checkpointing=True", "--checkpointing on"), dict(checkpointing=True)))
    if inputs.loss == "full":
        tries.append((("train through make_trainer (TRL's fused LM head) or fastkit's chunked loss",
                       "--chunked-loss"), dict(loss="trl")))
    if inputs.optimizer == "auto" or OPTIMIZER_STATE_BYTES[inputs.optimizer] > OPTIMIZER_STATE_BYTES[EIGHT_BIT]:
        tries.append(((f"use the 8-bit optimizer (optim={EIGHT_BIT!r})", f"the 8-bit optimizer (--sft optim="
                       f"{EIGHT_BIT})"), dict(optimizer=EIGHT_BIT)))
    if not inputs.offload and not inputs.unified:  # unified memory: the host is the same pool (UNIFIED)
        tries.append((("use_gradient_checkpointing='offload' (layer inputs on the host)",
                       "--checkpointing offload (layer inputs on the host)"), dict(offload=True, checkpointing=True)))
    if not inputs.load_in_4bit and inputs.r is not None:
        tries.append((("load_in_4bit=True (QLoRA)", "--4bit (QLoRA)"), dict(load_in_4bit=True)))
    if not inputs.unified:
        tries += _host_tries(shape, inputs)
    if inputs.load_in_4bit and shape.experts and inputs.r is not None and inputs.expert_lora:
        tries.append((("LoRA on the linear layers only (get_peft_model(target_modules=[...]) without the experts)",
                       "LoRA on the linear layers only (--target-modules NAME ... without the experts; the table: "
                       "add --no-expert-lora)"), dict(expert_lora=False)))
    seq = inputs.max_seq_length if inputs.kind != "grpo" else 0  # GRPO: its own knobs below
    while seq > 256:
        seq //= 2
        tries.append(((f"shorter rows: max_seq_length={seq}", f"shorter rows: --max-seq-length {seq}"),
                      dict(max_seq_length=seq)))
    if inputs.batch_size > 1:
        tries.append((("batch_size=1 with gradient_accumulation_steps", f"--batch-size 1 --grad-accumulation "
                       f"{inputs.batch_size}"), dict(batch_size=1)))
    tries += _grpo_tries(inputs)
    if inputs.r is not None and inputs.r > 8:
        tries.append((("smaller LoRA rank: r=8", "smaller LoRA rank: --lora-r 8"), dict(r=8)))
    return tries


def _grpo_tries(inputs: PlanInputs) -> list[tuple[tuple[str, str], dict]]:
    """GRPO's own knobs: fewer completions per prompt, shorter completions (halved, while sensible)."""
    if inputs.kind != "grpo":
        return []
    tries = []
    if inputs.num_generations >= 4:
        g = inputs.num_generations // 2
        tries.append(((f"fewer completions per prompt: num_generations={g}", f"fewer completions per prompt: "
                       f"--num-generations {g}"), dict(num_generations=g)))
    if inputs.max_completion_length >= 128:
        c = inputs.max_completion_length // 2
        tries.append(((f"shorter completions: max_completion_length={c}", f"shorter completions: "
                       f"--max-completion-length {c}"),
                      dict(max_completion_length=c, max_prompt_length=rl.prompt_tokens(inputs))))
    return tries


def advise(shape: ModelShape, inputs: PlanInputs, budget: int, interface: str = "python") -> list[str]:
    """Single knobs that bring the plan under ``budget``, cheapest in quality first, in the words of
    ``interface`` (:data:`INTERFACES`)."""
    if interface not in INTERFACES:
        raise FastkitError(f"interface must be one of {', '.join(INTERFACES)}, got {interface!r}.")
    cli = interface == "cli"
    fixes = []
    for words, change in _tries(shape, inputs):
        trial = PlanInputs(**{**inputs.__dict__, **change})
        total = _peak(components(shape, trial, cuda=True))
        if total <= budget:
            fixes.append(f"Fix: {words[cli]} (predicted {total / GiB:.1f} GiB).")
            if "max_seq_length" in change:
                break
    if not fixes:
        fixes.append(_no_single_knob(inputs, cli))
    if inputs.unified:
        fixes.append(f"(Not offered: activation offload and host weights; {UNIFIED_NOTE}.)")
    return fixes


def _no_single_knob(inputs: PlanInputs, cli: bool) -> str:
    """The advice when no single knob fits: what to combine (those not on yet; no offload on unified memory)."""
    words = [("--4bit", "4-bit", inputs.load_in_4bit), ("--checkpointing offload", "offload",
                                                        inputs.offload or inputs.unified),
             ("a shorter --max-seq-length", "shorter rows", False)]
    knobs = [w[0] if cli else w[1] for w in words if not w[2]]
    text = f"combine {', '.join(knobs[:-1])} and {knobs[-1]}" if len(knobs) > 1 else f"use {knobs[0]}"
    larger = "" if inputs.unified else ", or use a larger GPU"
    return f"No single knob is enough: {text}{larger}."
