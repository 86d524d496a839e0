"""The planner's arithmetic: a model's shape from its config (meta device), and activation / loss bytes.

Counts are per token and per decoder layer, from what autograd keeps for backward in transformers'
decoder layers under LoRA (frozen base weights: a frozen linear keeps nothing, its LoRA ``A``
keeps its input, ``B`` keeps the rank-``r`` middle). Checked against measured peaks on CPU twins
(tests/test_plan.py, within 15%).
"""

from __future__ import annotations

from dataclasses import dataclass

from fastkit.patches.sizes import CHUNK_BYTES  # the chunk the loss uses is the chunk planned
from fastkit.units import dtype_name

TRL_TILE = (4096, 32768)  # tokens x vocabulary per tile of TRL's fused LM head (trl.kernels.chunked_logprob)


@dataclass
class ModelShape:
    """Parameter counts by kind and the sizes the activation terms need."""

    model_type: str
    """``config.model_type``."""
    linear_params: int
    """Weights of ``nn.Linear`` layers other than the lm_head (what bitsandbytes quantizes)."""
    embedding_params: int
    """Input embeddings plus an untied lm_head."""
    other_params: int
    """Everything else: norms, routers, fused 3-D expert weights (not ``nn.Linear``: kept 16-bit)."""
    lora_dims: list[tuple[int, int, int]]
    """``(in, out, copies)`` of every module LoRA adapts (``copies`` = experts for fused expert weights)."""
    largest_linear: int
    """Weights of the largest ``nn.Linear`` (dequantized whole under 4-bit)."""
    layers: int
    """Decoder layers."""
    hidden: int
    """Hidden size."""
    q_dim: int
    """Query width (heads x head_dim)."""
    kv_dim: int
    """Key (= value) width (kv heads x head_dim)."""
    heads: int
    """Attention heads."""
    qk_norm: bool
    """Per-head RMSNorm on q and k (Qwen3)."""
    dense_layers: int
    """Layers with a dense MLP."""
    intermediate: int
    """Dense MLP width."""
    experts: int
    """Routed experts per MoE layer (0 for dense models)."""
    top_k: int
    """Experts per token."""
    expert_intermediate: int
    """Width of one routed expert."""
    shared_intermediate: int
    """Width of the shared expert(s), 0 if none."""
    vocab: int
    """Vocabulary size."""

    @property
    def total_params(self) -> int:
        """All parameters."""
        return self.linear_params + self.embedding_params + self.other_params + self.vision_params

    expert_params_per_layer: int = 0
    """Weights of one layer's routed experts (fused 3-D)."""
    mxfp4: bool = False
    """The checkpoint ships MXFP4 experts (GPT-OSS). fastkit loads it through transformers' MXFP4 path
    (layer by layer, experts kept 4-bit); ``fastkit.patches.moe.linear_4bit`` then stores the linear layers NF4."""
    tied: bool = False
    """The lm_head is the input embedding's weight (``tie_word_embeddings``): one matrix, never kept on the host."""
    input_embedding_params: int = 0
    """Weights of the input embedding alone (``vocab x hidden``)."""
    vision_params: int = 0
    """Weights of a vision-language model's vision tower and projector (frozen, 16-bit, no LoRA by default);
    not in the three counts above."""
    image_tokens: int = 0
    """Tokens one image takes in a row (at :data:`IMAGE_SIDE` pixels where the count depends on the image size);
    they count toward ``max_seq_length`` like text."""
    saved_fp16: bool = False
    """The checkpoint was saved in float16. Otherwise fp16 compute keeps the residual stream fp32
    (``patches/fp16/patch.py``), so the checkpointed layer inputs take 4 bytes per value."""

    def lora_params(self, r: int) -> int:
        """LoRA parameters at rank ``r`` on every adapted module."""
        return sum(r * (i + o) * n for i, o, n in self.lora_dims)


IMAGE_SIDE = 448
"""The image side (pixels) the planner counts an image's tokens at, for families whose count follows the size."""


def image_tokens(config) -> int:
    """Tokens one image takes: the config's fixed count (Gemma 3's ``mm_tokens_per_image``), a tile's count after
    pixel shuffle (Idefics3 / SmolVLM: ``(image_size / patch)² / scale_factor²``, one tile), or a
    :data:`IMAGE_SIDE`-pixel image's patches merged ``spatial_merge_size``² to one (Qwen-VL)."""
    vision = getattr(config, "vision_config", None)
    if vision is None:
        return 0
    if getattr(config, "mm_tokens_per_image", None):
        return int(config.mm_tokens_per_image)
    patch = getattr(vision, "patch_size", 14)
    if getattr(config, "scale_factor", None):
        return (vision.image_size // patch) ** 2 // config.scale_factor ** 2
    side = IMAGE_SIDE // (patch * getattr(vision, "spatial_merge_size", 1))
    return side * side


def _vision_modules(model, config) -> set[int]:
    """ids of the modules of a vision-language model's tower and projector (its row's ``vision`` paths)."""
    from fastkit import registry

    facts = registry.facts_for(config.model_type)
    if facts is None or facts.vision is None:
        return set()
    out = set()
    for path in (facts.vision.tower, facts.vision.projector):
        try:
            out |= {id(m) for m in model.get_submodule(path).modules()}
        except AttributeError:  # a row whose paths this model does not have: counted as the rest
            continue
    return out


def _build_meta(config):
    """The model ``config`` builds, on the meta device: a causal LM, or a vision row's image-text-to-text model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from fastkit import _hf, registry

    facts = registry.facts_for(config.model_type)
    vision = facts is not None and facts.vision is not None and not _hf.has_causal_lm_head(config.model_type)
    with torch.device("meta"):
        return (AutoModelForImageTextToText if vision else AutoModelForCausalLM).from_config(config)


def shape_of(config) -> ModelShape:
    """Count ``config``'s parameters by kind on the meta device (no memory, no weights)."""
    import torch  # here, not at import: a shipped model's plan reads its shape from fastkit/plan/shapes.json

    from fastkit import _hf

    model = _build_meta(config)
    head = model.get_output_embeddings()
    tower = _vision_modules(model, config)
    seen: set[int] = set()
    linear = embedding = other = largest = vision = 0
    lora_dims: list[tuple[int, int, int]] = []
    experts_in_layer = 0
    for module in model.modules():
        if id(module) in tower:  # frozen, no LoRA (finetune_vision_layers=True adds some: not planned)
            vision += sum(p.numel() for p in module.parameters(recurse=False))
            continue
        for p in module.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            n = p.numel()
            if isinstance(module, torch.nn.Embedding) or module is head:
                embedding += n
            elif isinstance(module, torch.nn.Linear):
                linear += n
                largest = max(largest, n)
            else:
                other += n
        if isinstance(module, torch.nn.Linear) and module is not head:
            lora_dims.append((module.in_features, module.out_features, 1))
        elif _hf.is_fused_experts_class(module):  # fused 3-D experts: PEFT adapts each expert
            for p in module.parameters(recurse=False):
                if p.dim() == 3:
                    lora_dims.append((p.shape[2], p.shape[1], p.shape[0]))  # (E, out, in)
                    experts_in_layer += p.numel()
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    shape = _with_sizes(text, model, linear, embedding, other, lora_dims, largest)
    inp = model.get_input_embeddings()
    shape.input_embedding_params = inp.weight.numel() if inp is not None else 0
    shape.tied = head is not None and inp is not None and head.weight is inp.weight
    if shape.experts:
        shape.expert_params_per_layer = experts_in_layer // (shape.layers - shape.dense_layers)
    shape.mxfp4 = mxfp4_checkpoint(config)
    shape.vision_params, shape.image_tokens = vision, image_tokens(config) if tower else 0
    saved = getattr(config, "dtype", None)  # transformers >= 4.56: torch_dtype is a (warning) alias of dtype
    shape.saved_fp16 = saved is not None and dtype_name(saved) == "float16"
    return shape


def quantization_values(config) -> dict:
    """``config.quantization_config`` as a plain dict (``{}`` when there is none), its ``quant_method`` a string.

    config.json gives a dict; a loaded model's config holds a transformers config object whose method is an
    enum (``str()`` of it is ``"QuantizationMethod.BITS_AND_BYTES"``, not ``"bitsandbytes"``).
    """
    quant = getattr(config, "quantization_config", None)
    if quant is None:
        return {}
    values = dict(quant) if isinstance(quant, dict) else quant.to_dict() if hasattr(quant, "to_dict") else vars(quant)
    method = values.get("quant_method", "")
    return {**values, "quant_method": str(getattr(method, "value", method))}


def mxfp4_checkpoint(config) -> bool:
    """True for a checkpoint shipped in MXFP4 (GPT-OSS): its ``quantization_config`` says ``quant_method: mxfp4``."""
    return quantization_values(config).get("quant_method") == "mxfp4"


def _with_sizes(config, model, linear, embedding, other, lora_dims, largest) -> ModelShape:
    hidden = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    layers = config.num_hidden_layers
    inner = getattr(model, "model", model)
    decoder = getattr(inner, "layers", None) or getattr(getattr(inner, "language_model", None), "layers", [])
    moe_layers = sum(1 for layer in decoder if hasattr(getattr(layer, "mlp", None), "experts"))
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or \
        getattr(config, "n_routed_experts", None) or 0
    moe_inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    shared = getattr(config, "shared_expert_intermediate_size", None) or \
        (getattr(config, "n_shared_experts", None) or 0) * moe_inter
    return ModelShape(
        model_type=config.model_type, linear_params=linear, embedding_params=embedding, other_params=other,
        lora_dims=lora_dims, largest_linear=largest, layers=layers, hidden=hidden, q_dim=heads * head_dim,
        kv_dim=kv_heads * head_dim, heads=heads,
        qk_norm=any(n.endswith("q_norm") for n, _ in model.named_modules()),
        dense_layers=layers - moe_layers, intermediate=config.intermediate_size,
        experts=experts if moe_layers else 0, top_k=getattr(config, "num_experts_per_tok", 0) or 0,
        expert_intermediate=moe_inter, shared_intermediate=shared, vocab=config.vocab_size,
    )


def layer_bytes(s: ModelShape, r: int | None, size: int, adapter: int, moe: bool) -> float:
    """Bytes per token one decoder layer keeps for backward (its full activations).

    ``adapter`` is the byte size of the copy of its input each LoRA ``A`` keeps when the adapters'
    dtype differs from the weights' (PEFT casts the input to the fp32 adapter dtype; under CUDA
    autocast that copy is 16-bit); with equal dtypes the modules share one saved input.
    """
    lora = r is not None
    share = not lora or adapter == size
    h, q, kv = s.hidden, s.q_dim, s.kv_dim
    attn = (h * size if share else 3 * h * adapter)  # input of q/k/v (or their LoRA copies)
    attn += (q + kv) * 4 if s.qk_norm else 0  # q/k RMSNorm keeps its fp32 input
    attn += (q + 2 * kv + q) * size  # rotated q and k, v, attention output
    attn += 0 if share else q * adapter  # o_proj's LoRA copy of the attention output
    attn += s.heads * 4 + 2 * h * 4  # log-sum-exp; the residual stream twice (RMSNorm's fp32 inputs)
    modules = 7
    if not moe:
        mlp = (h * size if share else 2 * h * adapter) + 3 * s.intermediate * size
        mlp += s.intermediate * (size if share else adapter)
    else:
        mlp = h * size + s.top_k * (2 * h + 4 * s.expert_intermediate) * size + s.experts * 4
        if s.shared_intermediate:
            mlp += 2 * h * size + 4 * s.shared_intermediate * size
        modules = 4 + (3 if s.shared_intermediate else 0)
    return attn + mlp + (modules * r * 4 if lora else 0)


def activation_bytes(s: ModelShape, inputs, tokens: int, size: int, adapter: int,
                     stream: int | None = None) -> tuple[dict, dict]:
    """``(kept, transient)``: activations alive through the step, and the two phases that do not overlap.

    ``stream``: bytes per value of the residual stream between layers (default ``size``; 4 where fp16
    compute keeps it fp32, ``patches/fp16/patch.py``).

    ``transient`` holds one layer's recompute + backward temporaries; the loss phase (logits) is the
    other one, so the peak counts the larger of the two.
    """
    moe_layers = s.layers - s.dense_layers
    per_layer = [layer_bytes(s, inputs.r, size, adapter, False)] * s.dense_layers + \
        [layer_bytes(s, inputs.r, size, adapter, True)] * moe_layers
    widest = max(s.intermediate if s.dense_layers else 0, s.top_k * s.expert_intermediate + s.shared_intermediate)
    temporaries = (2 * s.hidden + 2 * widest) * 4 * tokens  # gradients in flight inside one layer
    kept: dict[str, int] = {}
    transient: dict[str, int] = {}
    # PEFT's target_parameters LoRA builds W + B·A for a whole MoE layer; fastkit's 4-bit experts never do
    merged = s.expert_params_per_layer * size if inputs.r is not None and moe_layers and not inputs.load_in_4bit else 0
    if merged and not inputs.checkpointing:  # PEFT adds B @ A to the expert weights in each forward
        kept["expert weights merged with LoRA, every MoE layer (PEFT)"] = int(moe_layers * merged)
    if inputs.checkpointing:
        kept_layers = 2 if inputs.offload else s.layers
        what = "2 on the GPU (offload)" if inputs.offload else f"{s.layers} layers"
        kept[f"checkpointed layer inputs ({what})"] = int(kept_layers * s.hidden * (stream or size) * tokens)
        transient["one layer's recompute + backward temporaries"] = int(max(per_layer) * tokens + temporaries + merged)
        attn_layers = 1
    else:
        kept[f"saved activations ({s.layers} layers, no checkpointing)"] = int(sum(per_layer) * tokens)
        transient["backward temporaries"] = int(temporaries)
        attn_layers = s.layers
    kept["embeddings output + final norm"] = int(2 * s.hidden * size * tokens)
    rows = max(1, inputs.batch_size)
    seq = tokens // rows
    if inputs.attn == "eager":  # softmax probabilities kept per layer, scores transient
        kept["attention scores (eager)"] = int((attn_layers + 1) * rows * s.heads * seq * seq * size)
    return kept, transient


def streamed_rows(s: ModelShape, tokens: int, size: int) -> int:
    """Vocabulary rows per chunk of a host lm_head streamed by the chunked loss (``patches/host``: the same sizing)."""
    return max(1, min(s.vocab, CHUNK_BYTES // (4 * max(1, tokens)), CHUNK_BYTES // (s.hidden * size)))


def loss_bytes(s: ModelShape, loss: str, tokens: int, size: int) -> int:
    """Peak bytes of the logits and the loss over the lm_head.

    ``"streamed"``: the head stays on the host (``patches/host``, ``patches/loss/streamed.py``): two device
    chunks of ``R`` head rows (double buffer), per chunk a ``(T, R)`` block in the compute dtype, its fp32
    logits / softmax and one fp32 temporary, and the fp32 gradient of the hidden states ``(T, H)`` with its
    per-chunk product.
    """
    if loss == "streamed":
        rows = streamed_rows(s, tokens, size)
        return 2 * rows * s.hidden * size + tokens * rows * (size + 4 + 4) + 2 * tokens * s.hidden * 4
    if loss == "full":  # logits (dtype) + fp32 copy + log-softmax + its gradient + the logits' gradient
        return tokens * s.vocab * (size + (4 if size < 4 else 0) + 4 + 4 + 4)
    if loss == "chunked":  # one chunk's fp32 logits, softmax and gradient
        chunk = min(tokens, max(1, CHUNK_BYTES // (4 * s.vocab)))
        return chunk * s.vocab * 12
    rows, cols = min(tokens, TRL_TILE[0]), min(s.vocab, TRL_TILE[1])
    return rows * cols * (size + 8)


__all__ = ["CHUNK_BYTES", "TRL_TILE", "ModelShape", "activation_bytes", "layer_bytes", "loss_bytes", "shape_of",
           "streamed_rows"]


# -- preference tuning (DPO) and reasoning RL (GRPO): the terms of their extra passes -------------------------------
GENERATION_LOGIT_COPIES = 3
"""fp32 ``(rows, vocab)`` tensors per decode step besides the model's own logits: ``generate``'s fp32 copy of the last
position, the logits processors' output (temperature / top-k / top-p write new tensors) and the softmax
probabilities ``multinomial`` samples from (transformers 5.24 ``GenerationMixin._sample``)."""


def _widest(s: ModelShape) -> int:
    """The widest MLP activation of a layer (dense intermediate, or top_k experts + the shared expert)."""
    return max(s.intermediate if s.dense_layers else 0, s.top_k * s.expert_intermediate + s.shared_intermediate)


def kv_cache_bytes(s: ModelShape, rows: int, row_tokens: int, size: int) -> int:
    """``generate``'s KV cache: layers x 2 (keys and values) x kv_heads x head_dim x tokens per row x rows x bytes."""
    return s.layers * 2 * s.kv_dim * row_tokens * rows * size


def generation_logits_bytes(s: ModelShape, rows: int, size: int) -> int:
    """One decode step's logits: the last position only (``generate`` asks ``logits_to_keep=1``) in the compute dtype,
    plus :data:`GENERATION_LOGIT_COPIES` fp32 copies, for every row."""
    return rows * s.vocab * (size + GENERATION_LOGIT_COPIES * 4)


def forward_layer_bytes(s: ModelShape, tokens: int, size: int) -> int:
    """One decoder layer's temporaries in a no-grad forward over ``tokens`` (nothing is kept for backward): the
    residual in and out, q / k / v and the attention output, the MLP's gate, up and their product."""
    return tokens * (2 * s.hidden + 2 * s.q_dim + 2 * s.kv_dim + 3 * _widest(s)) * size


def prefill_bytes(s: ModelShape, rows: int, prompt: int, size: int) -> int:
    """The prompts' forward in ``generate`` (no grad): one layer's temporaries over ``rows x prompt`` tokens plus
    the bool padding mask ``(rows, 1, prompt, prompt)`` left-padded prompts get."""
    return forward_layer_bytes(s, rows * prompt, size) + rows * prompt * prompt


__all__ += ["GENERATION_LOGIT_COPIES", "forward_layer_bytes", "generation_logits_bytes", "kv_cache_bytes",
            "prefill_bytes"]
