"""The planner's DPO and GRPO passes: what TRL 1.16's trainers run besides one SFT-like training step.

``plan(model, kind="dpo")``: TRL's collator stacks ``[chosen_1..B, rejected_1..B]`` and fastkit packs them into one
row (:mod:`fastkit.training.dpo`), so a step trains ``2 x max_seq_length x batch_size`` tokens (``batch_size`` pairs).
The reference pass runs after the policy's forward (``DPOTrainer._compute_loss``), no-grad, while the policy's
activations are alive: one layer's forward temporaries plus one tile of TRL's fused LM head. With LoRA it is the
same model with the adapter disabled (no second copy); full fine-tuning (``r=None``) keeps a frozen copy.

``plan(model, kind="grpo")``: ``batch_size`` prompts, each with ``num_generations`` (G) completions of at most
``max_completion_length`` (C) tokens after a prompt of ``max_prompt_length`` (P) tokens. Three phases that do not
overlap (``GRPOTrainer._generate_and_score_completions`` then ``_compute_loss``):

- generation (``generate``, no grad) for the whole generation batch (``batch_size x G x
  gradient_accumulation_steps`` rows: TRL generates once per optimizer step): the KV cache of ``P + C`` tokens per
  row, one decode step's logits, the prompts' prefill;
- the reference pass (``beta > 0``, no grad, ``batch_size x G`` rows at a time): one layer's forward and one fused
  LM-head tile;
- the policy's log-prob pass and backward on ``batch_size x G`` rows of ``P + C`` tokens: the SFT terms on those
  tokens (TRL's fused LM head: ``GRPOTrainer`` calls the model with ``fused_lm_head=True``).

The peak is the largest phase; the others are listed "(not at the peak)". What is not counted: ``old_per_token_logps``
(only when ``gradient_accumulation_steps`` is not a multiple of ``steps_per_generation x num_iterations``; the same
size as the reference's), vLLM (``use_vllm``: TRL's own server or colocated engine), the reward models.
"""

from __future__ import annotations

from fastkit.plan.terms import (
    ModelShape,
    forward_layer_bytes,
    generation_logits_bytes,
    kv_cache_bytes,
    loss_bytes,
    prefill_bytes,
)

KINDS = ("sft", "dpo", "grpo")
"""What ``plan(kind=...)`` plans: supervised fine-tuning, DPO, GRPO."""


def prompt_tokens(inputs) -> int:
    """GRPO's prompt length P: ``max_prompt_length``, else ``max_seq_length - max_completion_length`` (the prompt
    limit ``make_grpo_trainer`` checks by default)."""
    if inputs.max_prompt_length is not None:
        return inputs.max_prompt_length
    return inputs.max_seq_length - inputs.max_completion_length


def step_rows(inputs) -> tuple[int, int]:
    """``(rows, tokens per row)`` of one trained micro-batch: SFT ``batch_size`` rows, DPO ``2 x batch_size``
    (chosen and rejected, packed into one row of the same total), GRPO ``batch_size x G`` rows of ``P + C``."""
    if inputs.kind == "dpo":
        return 2 * inputs.batch_size, inputs.max_seq_length
    if inputs.kind == "grpo":
        return inputs.batch_size * inputs.num_generations, prompt_tokens(inputs) + inputs.max_completion_length
    return inputs.batch_size, inputs.max_seq_length


def reference_weights(shape: ModelShape, inputs, size: int, dtype_name: str) -> dict[str, int]:
    """A frozen copy of the model for the reference: only full fine-tuning (``r=None``) needs one; LoRA disables
    the adapter (GRPO with ``beta=0`` has no reference)."""
    if inputs.kind == "sft" or inputs.r is not None or (inputs.kind == "grpo" and not inputs.beta):
        return {}
    return {f"weights: reference model (a frozen full copy, {dtype_name})": shape.total_params * size}


def reference_pass(shape: ModelShape, inputs, size: int) -> dict[str, int]:
    """The reference forward's transient (no grad): one layer's temporaries and one fused LM-head tile."""
    if inputs.kind == "sft" or (inputs.kind == "grpo" and not inputs.beta):
        return {}
    rows, per_row = step_rows(inputs)
    tokens = rows * per_row
    what = "adapter disabled" if inputs.r is not None else "frozen copy"
    return {f"reference pass ({what}, no grad): one layer + LM-head tile":
            forward_layer_bytes(shape, tokens, size) + loss_bytes(shape, "trl", tokens, size)}


def generation_rows(inputs) -> int:
    """Completions ``generate`` produces at once: ``batch_size x G x gradient_accumulation_steps``."""
    return inputs.batch_size * inputs.num_generations * inputs.gradient_accumulation_steps


def generation_phase(shape: ModelShape, inputs, size: int) -> dict[str, int]:
    """GRPO's generation: KV cache, one decode step's logits, the prompts' prefill (see the module docstring)."""
    rows, prompt, completion = generation_rows(inputs), prompt_tokens(inputs), inputs.max_completion_length
    what = f"{rows} rows x {prompt + completion} tokens"
    return {
        f"generation: KV cache ({what})": kv_cache_bytes(shape, rows, prompt + completion, size),
        f"generation: logits of one decode step ({rows} rows, + fp32 copies)": generation_logits_bytes(
            shape, rows, size),
        f"generation: prompt prefill ({rows} x {prompt} tokens, one layer)": prefill_bytes(shape, rows, prompt, size),
    }


def kept_logps(inputs) -> dict[str, int]:
    """Per-token log-probs kept from scoring to the loss (fp32): GRPO's reference for the whole generation batch."""
    if inputs.kind != "grpo" or not inputs.beta:
        return {}
    return {"reference log-probs of the generation batch (fp32)":
            generation_rows(inputs) * inputs.max_completion_length * 4}


__all__ = ["KINDS", "generation_phase", "generation_rows", "kept_logps", "prompt_tokens", "reference_pass",
           "reference_weights", "step_rows"]
