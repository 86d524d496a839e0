"""Forgetting: how far the tuned model drifted from the base on text outside the training data, with no download.

The base model answers :data:`GENERAL_PROMPTS` (shipped here: everyday requests of many kinds) greedily; both models
then score those answers token by token. Two numbers:

- **drift**: the mean KL divergence KL(base || tuned) of the next-token distributions over the answers' tokens
  (nats per token). 0 when the tuned model predicts exactly what the base predicts; it grows as training rewrites
  behaviour the data never asked about.
- the perplexity of the base's answers under each model: the tuned model finding the base's own fluent answers
  less likely is forgetting seen from the outside.

A LoRA trained briefly on a narrow task moves these little; long training at a high learning rate moves them a lot
(docs/eval.md has measured values). Above :data:`DRIFT_WARN` the report warns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

GENERAL_PROMPTS = (
    "What is the capital of France?",
    "Explain what photosynthesis is in two sentences.",
    "Write a haiku about the sea.",
    "Give me three tips for sleeping better.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Write a short Python function that reverses a string.",
    "Who wrote Romeo and Juliet?",
    "Summarize the plot of Cinderella in one sentence.",
    "What are the primary colors?",
    "How do I boil an egg?",
    "Name three planets in our solar system.",
    "What does a thermometer measure?",
    "Write a polite email declining a meeting invitation.",
    "Why is the sky blue?",
    "List the days of the week.",
)
"""Everyday requests no fine-tuning set is about; the base model's greedy answers to them are the forgetting probe."""
DRIFT_WARN = 0.5
"""Drift (nats per token) above which the report warns that the tuned model forgot (docs/eval.md: measured values)."""


@dataclass(frozen=True)
class Forgetting:
    """The drift of the tuned model from the base on :data:`GENERAL_PROMPTS`."""

    drift: float
    """Mean KL(base || tuned) per answer token, in nats."""
    base_perplexity: float
    """The base's own answers' perplexity under the base."""
    tuned_perplexity: float
    """The same answers' perplexity under the tuned model."""
    tokens: int
    """Answer tokens scored."""
    threshold: float
    """The drift above which :attr:`warned` is set."""

    @property
    def warned(self) -> bool:
        """The drift is above the threshold."""
        return self.drift > self.threshold


def probe_ids(tokenizer, prompt: str) -> list[int]:
    """The general prompt's tokens as the model is asked: through its chat template (with the generation prompt),
    or as plain text when the tokenizer has none."""
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)
        return list(out["input_ids"])
    return tokenizer(f"Question: {prompt}\nAnswer:", add_special_tokens=True)["input_ids"]


def base_answer(model: torch.nn.Module, tokenizer, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The base model's greedy answer tokens (its end-of-sequence token included when it stops)."""
    from fastkit.evaluation.score import Generation, generate_ids

    return generate_ids(model, tokenizer, prompt_ids, Generation(max_new_tokens, sampled=False, seed=0), None)


@torch.no_grad()
def answer_log_probs(model: torch.nn.Module, prompt_ids: list[int], answer_ids: list[int]) -> torch.Tensor:
    """``[A, V]`` log-probabilities of the next token at each answer position (float32, on the CPU)."""
    from fastkit.evaluation.score import device_of

    ids = torch.tensor([prompt_ids + answer_ids], device=device_of(model))  # [1, P + A]
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1]  # [A, V]: position t predicts token t + 1
    return torch.log_softmax(logits.float(), dim=-1).cpu()


def drift_terms(base_lp: torch.Tensor, tuned_lp: torch.Tensor, answer_ids: list[int]) -> tuple[float, float, float]:
    """``(summed KL(base || tuned), summed NLL under base, summed NLL under tuned)`` over one answer's tokens."""
    kl = (base_lp.exp() * (base_lp - tuned_lp)).sum(-1).clamp_min(0).sum()  # [A, V] -> [A] -> scalar
    target = torch.tensor(answer_ids)[:, None]  # [A, 1]
    return float(kl), float(-base_lp.gather(1, target).sum()), float(-tuned_lp.gather(1, target).sum())


def summarize(kl: float, base_nll: float, tuned_nll: float, tokens: int, threshold: float) -> Forgetting:
    """The sums over all probe answers as a :class:`Forgetting`."""
    n = max(tokens, 1)
    return Forgetting(kl / n, math.exp(base_nll / n), math.exp(tuned_nll / n), tokens, threshold)


__all__ = ["DRIFT_WARN", "GENERAL_PROMPTS", "Forgetting", "answer_log_probs", "base_answer", "drift_terms",
           "probe_ids", "summarize"]
