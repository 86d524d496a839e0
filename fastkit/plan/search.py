"""The longest-row search: the longest packed row per setup that fits a budget (``plan(max_seq_length="max")``)
and GRPO's largest ``num_generations`` / ``max_completion_length``, each a bisection over the byte model
(:func:`fastkit.plan.peak.components`; the peak grows with the row).
"""

from __future__ import annotations

from fastkit.plan import rl
from fastkit.plan.peak import PlanInputs, _peak, components
from fastkit.plan.terms import ModelShape

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
