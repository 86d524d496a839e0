"""The per-GPU peak of a run on several GPUs (``plan(..., gpus=N, fsdp=...)``, ``fastkit plan --gpus N [--fsdp]``).

- DDP (``fsdp=False``): every GPU holds a full copy of the weights, the trainable parameters, their gradients
  and the optimizer state; the gradients are all-reduced from DDP's buckets, a second copy of the gradients
  (:data:`DDP_BUCKETS`).
- FSDP2 (``fsdp=True``, torch's ``fully_shard`` per decoder layer and on the root, as accelerate's
  ``fsdp_version: 2`` with the transformer-layer wrap): the weights, the trainable parameters, their gradients and
  the optimizer state are sharded, ``1/N`` each. Gathered unsharded on top (:data:`GATHERED`): the root's
  parameters (input embedding, lm_head; FSDP2 keeps the root gathered from its forward to its backward) and two
  decoder layers (the one computing and the next, prefetched), plus one layer's unsharded gradients before their
  reduce-scatter (:data:`LAYER_GRADS`).

Activations, the loss and the other transients are per GPU and unchanged: each GPU runs its own micro-batch.
None of these terms has been measured on a GPU yet; the single-GPU terms are the measured ones.
"""

from __future__ import annotations

from fastkit.plan.terms import ModelShape

SHARDED = ("weights:", "LoRA", "gradients", "optimizer state")
"""The components FSDP2 shards (by name prefix): the parameters, their gradients, the optimizer state."""
DDP_BUCKETS = "DDP all-reduce buckets (a copy of the gradients)"
GATHERED = "FSDP2: gathered unsharded (root: embeddings + lm_head; 2 decoder layers: computing + prefetched)"
LAYER_GRADS = "FSDP2: one layer's unsharded gradients (before reduce-scatter)"


def parallel_terms(out: dict[str, int], shape: ModelShape, inputs, size: int, weight: float,
                   grad: int) -> dict[str, int]:
    """``out`` (the parameter, gradient and optimizer terms of one GPU's full copy) as one of ``inputs.gpus`` GPUs
    holds them. ``size``: bytes per compute-dtype value; ``weight``: bytes per linear weight (NF4 under 4-bit);
    ``grad``: bytes per trainable gradient value (fp32 LoRA: 4)."""
    n = inputs.gpus
    if n <= 1:
        return out
    trainable = shape.lora_params(inputs.r) if inputs.r is not None else shape.total_params
    if not inputs.fsdp:
        return {**out, DDP_BUCKETS: trainable * grad}
    sharded = {(f"{k}, sharded 1/{n}" if k.startswith(SHARDED) else k): (-(-v // n) if k.startswith(SHARDED) else v)
               for k, v in out.items()}
    layer, layer_trainable = layer_bytes(shape, inputs, size, weight)
    sharded[GATHERED] = shape.embedding_params * size + 2 * layer
    sharded[LAYER_GRADS] = layer_trainable * grad
    return sharded


def layer_bytes(shape: ModelShape, inputs, size: int, weight: float) -> tuple[int, int]:
    """``(bytes, trainable values)`` of the largest decoder layer unsharded: its share of the linear weights and the
    other parameters (an MoE layer: with one layer's routed experts), and its LoRA parameters (fp32) or, for full
    fine-tuning, its parameters as the trainable values."""
    experts = shape.expert_params_per_layer if shape.experts else 0
    moe_layers = shape.layers - shape.dense_layers if shape.experts else 0
    other = shape.other_params - experts * moe_layers
    expert_bytes = experts * (weight if inputs.load_in_4bit else size)
    nbytes = int((shape.linear_params * weight + other * size) / shape.layers + expert_bytes)
    if inputs.r is None:
        return nbytes, (shape.linear_params + other) // shape.layers + experts
    lora = shape.lora_params(inputs.r) // shape.layers
    return nbytes + lora * 4, lora


def setup_words(inputs) -> str:
    """``", 2 GPUs, FSDP2 (per GPU)"`` for the setup line; empty for one GPU."""
    if inputs.gpus <= 1:
        return ""
    return f", {inputs.gpus} GPUs, {'FSDP2' if inputs.fsdp else 'DDP'} (per GPU)"
