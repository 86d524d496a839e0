"""Forgetting: did the tuned model lose what it could do before, on text outside the training data, with no download.

Two measurements, both scored by the base and the tuned model alike:

- **forgetting** (the score that warns): the rise of the loss on :data:`~fastkit.evaluation.general_text.GENERAL_TEXT`
  (short factual paragraphs written for fastkit, scored as plain text: no chat template, no question), tuned minus
  base, in nats per token. A model that learned a new answer format reads plain prose as before (a few hundredths);
  one that lost general knowledge or fluency finds it much less likely. Above :data:`FORGETTING_WARN` the report
  warns.
- **drift**: how differently the tuned model answers everyday requests. The base model answers
  :data:`GENERAL_PROMPTS` greedily; drift is the mean KL divergence KL(base || tuned) of the next-token
  distributions over those answers' tokens (nats per token), with the answers' perplexity under each model. A new
  answer format counts as drift (teaching one moves it far in a few steps), so it informs and does not warn.

docs/eval.md has measured values for a short and a long run.
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
FORGETTING_WARN = 0.3
"""The rise of the general text's loss (nats per token, tuned minus base) above which the report warns that the
tuned model forgot (docs/eval.md: measured values)."""


@dataclass(frozen=True)
class Forgetting:
    """How much the tuned model forgot (the general text's loss) and drifted (its answers to general prompts)."""

    forgetting: float
    """The general text's loss under the tuned model minus under the base, in nats per token (0: unchanged; below 0:
    the tuned model reads it better)."""
    base_text_perplexity: float
    """The general text's perplexity under the base."""
    tuned_text_perplexity: float
    """The general text's perplexity under the tuned model."""
    text_tokens: int
    """General-text tokens scored."""
    drift: float
    """Mean KL(base || tuned) per token of the base's answers to :data:`GENERAL_PROMPTS`, in nats."""
    base_perplexity: float
    """The base's own answers' perplexity under the base."""
    tuned_perplexity: float
    """The same answers' perplexity under the tuned model."""
    tokens: int
    """Answer tokens scored."""
    threshold: float
    """The forgetting above which :attr:`warned` is set."""

    @property
    def warned(self) -> bool:
        """The forgetting is above the threshold."""
        return self.forgetting > self.threshold


def text_ids(tokenizer, text: str) -> list[int]:
    """A general-text paragraph's tokens as plain text (the tokenizer's own special tokens, no chat template)."""
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


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


def summarize(text: tuple[float, float, int], answers: tuple[float, float, float, int],
              threshold: float) -> Forgetting:
    """The sums as a :class:`Forgetting`: ``text`` = (NLL under base, NLL under tuned, tokens) over the general text,
    ``answers`` = (KL, NLL under base, NLL under tuned, tokens) over the base's answers to the general prompts."""
    (text_base, text_tuned, n_text), (kl, base_nll, tuned_nll, n_answer) = text, answers
    t, a = max(n_text, 1), max(n_answer, 1)
    return Forgetting((text_tuned - text_base) / t, math.exp(text_base / t), math.exp(text_tuned / t), n_text,
                      kl / a, math.exp(base_nll / a), math.exp(tuned_nll / a), n_answer, threshold)


__all__ = ["FORGETTING_WARN", "GENERAL_PROMPTS", "Forgetting", "answer_log_probs", "base_answer", "drift_terms",
           "probe_ids", "summarize", "text_ids"]
