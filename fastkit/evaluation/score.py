"""Scoring one model on held-out rows: the loss on the answers' tokens, and answers generated from the prompts.

Both run on the row's own tokens (:mod:`fastkit.evaluation.rows`), one row at a time (no padding: a left-padded batch
can change a greedy answer, and base and tuned must see the same input). Generation is greedy, plus one sampled
answer per row from a per-row seed (the same seed for base and tuned, the caller's RNG state untouched).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastkit.evaluation.rows import EvalRow


@dataclass(frozen=True)
class Generation:
    """How answers are generated."""

    max_new_tokens: int
    """At most this many new tokens per answer."""
    sampled: bool
    """Also one sampled answer per row (temperature / top_p below), seeded per row."""
    seed: int
    """Row i's sampled answer uses seed + i, for base and tuned alike."""
    temperature: float = 0.7
    """The sampled answer's temperature."""
    top_p: float = 0.95
    """The sampled answer's nucleus."""


@dataclass
class RowResult:
    """One model on one row."""

    nll: float
    """Summed negative log-likelihood of the answer tokens (nats)."""
    tokens: int
    """How many answer tokens the loss covers."""
    greedy: str | None
    """The greedy answer (None for a plain-text row: nothing to answer)."""
    sampled: str | None
    """The sampled answer (None when not asked for, or a plain-text row)."""


def device_of(model: torch.nn.Module) -> torch.device:
    """Where the model's inputs go."""
    return getattr(model, "device", None) or next(model.parameters()).device


@torch.no_grad()
def answer_nll(model: torch.nn.Module, row: EvalRow) -> tuple[float, int]:
    """``(summed NLL, tokens)`` over the row's trained tokens, as training's loss counts them."""
    ids = torch.tensor([row.input_ids], device=device_of(model))  # [1, T]
    trained = torch.tensor(row.mask[1:], dtype=torch.bool, device=ids.device)  # [T-1]: token t+1 is predicted at t
    logits = model(input_ids=ids).logits[0, :-1][trained].float()  # [n, V]: only the positions the loss covers
    targets = ids[0, 1:][trained]  # [n]
    nll = torch.nn.functional.cross_entropy(logits, targets, reduction="sum")
    return float(nll), int(trained.sum())


@torch.no_grad()
def generate_ids(model: torch.nn.Module, tokenizer, prompt_ids: list[int], gen: Generation,
                 seed: int | None) -> list[int]:
    """The new tokens of the model's answer to ``prompt_ids`` (greedy when ``seed`` is None, else sampled from it)."""
    ids = torch.tensor([prompt_ids], device=device_of(model))  # [1, P]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    kwargs = dict(max_new_tokens=gen.max_new_tokens, do_sample=seed is not None, use_cache=True, pad_token_id=pad)
    devices = [ids.device] if ids.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        if seed is not None:
            torch.manual_seed(seed)
            kwargs.update(temperature=gen.temperature, top_p=gen.top_p)
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)  # the model's sampling defaults off for greedy
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
    return out[0, len(prompt_ids):].tolist()


def generate(model: torch.nn.Module, tokenizer, prompt_ids: list[int], gen: Generation, seed: int | None) -> str:
    """The model's answer to ``prompt_ids`` as text (:func:`generate_ids`, special tokens and whitespace removed)."""
    return tokenizer.decode(generate_ids(model, tokenizer, prompt_ids, gen, seed), skip_special_tokens=True).strip()


def score_row(model: torch.nn.Module, tokenizer, row: EvalRow, gen: Generation) -> RowResult:
    """One model on one row: the answer loss, and its answers when the row has a prompt."""
    nll, tokens = answer_nll(model, row)
    if not row.prompt_ids:
        return RowResult(nll, tokens, None, None)
    greedy = generate(model, tokenizer, row.prompt_ids, gen, None)
    sampled = generate(model, tokenizer, row.prompt_ids, gen, gen.seed + row.index) if gen.sampled else None
    return RowResult(nll, tokens, greedy, sampled)


__all__ = ["Generation", "RowResult", "answer_nll", "device_of", "generate", "generate_ids", "score_row"]
