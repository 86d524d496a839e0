"""Will this run fit? A training-memory planner that reads only the model's config.

``plan("Qwen/Qwen3-14B", gpu="t4", load_in_4bit=True)`` builds the model on the meta device (no
weights, no memory), counts its parameters by kind, and predicts the peak of one LoRA (or full)
training step by component (:mod:`fastkit.plan.peak`). It says whether that fits the GPU
(:mod:`fastkit.plan.gpus`) and, if not, which knob brings it under (:mod:`fastkit.plan.report`);
``max_seq_length="max"`` searches the longest row that fits (:mod:`fastkit.plan.search`). ``fastkit plan MODEL``
prints the same table; ``FastModel.from_pretrained`` logs the verdict and refuses a run that cannot fit
(:func:`check_fits`), and ``get_peft_model(use_gradient_checkpointing="auto")`` turns on what :func:`auto_plan`
says.

The names of the single module this was before (``from fastkit.plan.planner import Plan, components, ...``) are
still imported from here.
"""

from __future__ import annotations

import logging
from typing import Any

from fastkit import checks
from fastkit.errors import FastkitError
from fastkit.patches.sizes import DEQUANT_BYTES_PER_WEIGHT  # noqa: F401 (re-exported)
from fastkit.plan import rl
from fastkit.plan.configs import ShippedConfig
from fastkit.plan.gpus import GPUS, UNIFIED, UNIFIED_NOTE, gpu_budget, gpu_name, is_unified  # noqa: F401
from fastkit.plan.peak import (  # noqa: F401 (re-exported: the names of the single module this was)
    ALLOCATOR_SLACK,
    CUDA_CONTEXT,
    EIGHT_BIT,
    NF4_BYTES,
    NF4_BYTES_NO_DOUBLE,
    OFF_PEAK,
    OPTIMIZER_STATE_BYTES,
    PlanInputs,
    _check_inputs,
    _peak,
    components,
    default_optimizer,
    dequant_group_bytes,
    host_terms,
)
from fastkit.plan.report import Plan, advise
from fastkit.plan.search import MIN_SEARCH, SETUPS, _context, largest_grpo, longest_row, longest_rows  # noqa: F401
from fastkit.plan.source import _check_decoder, check_config, planned_config, read_config  # noqa: F401
from fastkit.plan.terms import ModelShape, quantization_values, shape_of
from fastkit.units import GiB

logger = logging.getLogger("fastkit")

REFUSE_ABOVE = 1.10
"""``from_pretrained`` refuses a run only when the prediction exceeds the budget by this factor (the
planner's error on measured twins is within 15%; runs just above the line get a warning instead)."""


class PlanBuildError(FastkitError):
    """The config is valid but the meta-device count cannot build this architecture (the load-time plan is then
    skipped, not a refusal)."""


def plan(model_or_config: Any, gpu: str | float = "t4", max_seq_length: int | str = 2048, batch_size: int = 1,
         r: int | None = 16, load_in_4bit: bool = False, offload: bool = False, interface: str = "python",
         **options: Any) -> Plan:
    """Predict the training peak of ``model_or_config`` on ``gpu``, by component, with a verdict and advice.

    ``options`` are the other fields of :class:`PlanInputs` (``checkpointing``, ``optimizer``, ``loss``,
    ``dtype``, ``attn``; ``gpus=N`` and ``fsdp=True``: the peak per GPU of N GPUs, DDP or FSDP2). Nothing is
    downloaded but a Hub id's ``config.json`` (none for the models in
    :data:`fastkit.plan.configs.KNOWN_CONFIGS`); no weights are built. ``max_seq_length="max"``: the longest
    packed row that fits, per setup of :data:`SETUPS` (``Plan.longest``, found with this same model), and the
    plan of the asked setup at its own longest row. ``interface``: the words of ``Plan.advice``, ``"python"``
    (these arguments, ``get_peft_model``'s) or ``"cli"`` (``fastkit train``'s flags; :data:`report.INTERFACES`).
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
    return _predict(config, inputs, budget, name, search=search, interface=interface)


def _predict(config, inputs: PlanInputs, budget: int | None, name: str = "", search: bool = False,
             interface: str = "python") -> Plan:
    """:func:`plan`'s prediction, for inputs already checked against ``config`` (``max_seq_length``: by
    :func:`plan`, :func:`auto_plan`, or the loader before :func:`check_fits`); ``search``: the longest rows too."""
    inputs.load_in_4bit = inputs.load_in_4bit or prequantized_4bit(config)
    shape = _shape(config)
    longest = {}
    if search:
        longest = longest_rows(shape, inputs, budget, _context(config))
        asked = longest_row(shape, inputs, budget, _context(config))
        inputs.max_seq_length = asked or MIN_SEARCH
    result = _result(name or config.model_type, shape, inputs, budget, interface)
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


def _result(name: str, shape: ModelShape, inputs: PlanInputs, budget: int | None, interface: str) -> Plan:
    result = Plan(name, inputs, budget=budget)
    result.components = components(shape, inputs, cuda=budget is not None)
    if shape.vision_params:
        result.vision = (f"vision tower + projector: {shape.vision_params:,} parameters (frozen, no LoRA; "
                         f"finetune_vision_layers=True adapts them too); one image is {shape.image_tokens:,} tokens "
                         f"of a row, counted in max_seq_length")
    host = host_terms(shape, inputs, cuda=budget is not None)
    if inputs.unified:  # the pinned bytes are in the components (same pool); the traffic stays listed here
        host = {k: v for k, v in host.items() if not k.startswith("host (pinned)")}
    result.host = host
    if not result.fits:
        result.advice = advise(shape, inputs, budget, interface)
    if inputs.gpus > 1:
        result.single = _peak(components(shape, PlanInputs(**{**inputs.__dict__, "gpus": 1, "fsdp": False}),
                                         cuda=budget is not None))
    elif not result.fits:
        result.across = across_gpus(shape, inputs, budget)
    return result


ACROSS = (2, 4, 8)
"""The GPU counts :func:`across_gpus` tries."""


def across_gpus(shape: ModelShape, inputs: PlanInputs, budget: int) -> tuple[int, bool, int] | None:
    """The fewest GPUs of this kind that fit the run one does not: ``(gpus, fsdp, bytes per GPU)``, DDP first."""
    for n in ACROSS:
        for fsdp in (False, True):
            total = _peak(components(shape, PlanInputs(**{**inputs.__dict__, "gpus": n, "fsdp": fsdp}), cuda=True))
            if total <= budget:
                return n, fsdp, total
    return None


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


def default_setup(model_or_config, gpu, max_seq_length: int, load_in_4bit: bool) -> tuple[str, dict] | None:
    """What FastModel's defaults (``get_peft_model``'s ``use_gradient_checkpointing="auto"`` and
    ``host_weights="auto"``, what ``fastkit train`` runs with) turn on for this model: :func:`check_fits`'
    load-time decision (LoRA r=16, batch 1): nothing where plain checkpointing fits, else the :func:`auto_plan`
    step, as ``(what, PlanInputs fields)``. None when nothing is turned on (it fits, nothing fits, or unified memory).
    """
    if gpu_budget(gpu) is None or is_unified(gpu):
        return None
    name = model_or_config if isinstance(model_or_config, str) else ""
    config = planned_config(model_or_config)
    check_config(config)
    _check_decoder(config)
    checks.check_max_seq_length(max_seq_length, config)
    inputs = PlanInputs(gpu=str(gpu), max_seq_length=max_seq_length, load_in_4bit=load_in_4bit, unified=False)
    if _predict(config, inputs, gpu_budget(gpu), name).fits:
        return None
    found = _auto(config, gpu, max_seq_length, load_in_4bit, name)
    if found is None:
        return None
    knobs = found[1].inputs
    return found[0], dict(offload=knobs.offload, host_embedding=knobs.host_embedding, host_lm_head=knobs.host_lm_head)


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
           "auto_plan", "check_config", "check_fits", "context_table", "default_optimizer", "default_setup",
           "gpu_budget", "is_unified", "longest_row", "longest_rows", "plan", "prequantized_4bit", "read_config"]
