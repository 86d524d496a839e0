"""Scaled-down random twins of real architectures, and a tokenizer built in-process.

A twin keeps what makes a family itself (GQA ratio, q/k-norm, sliding-window layers, attention
sinks, interleaved expert weights, shared experts, tied embeddings) and shrinks every size, so
tests and notebook CI run the real transformers modeling code in seconds, offline. Nothing here
downloads anything.

    model = twin("qwen3_moe", num_hidden_layers=4)    # random weights, fp32, CPU
    tok = twin_tokenizer()                            # byte-level, ChatML chat template
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, PretrainedConfig, PreTrainedTokenizerFast

# ChatML, the template SmolLM2-Instruct and Qwen ship; generation prompt "<|im_start|>assistant\n".
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TWIN_VOCAB_SIZE = 320  # 256 byte symbols + 3 specials, rounded up for aligned embeddings

_ATTN = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)

# Per-family overrides on top of the family's default config: the family traits stay, sizes shrink.
TWIN_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(_ATTN, intermediate_size=128, tie_word_embeddings=True),  # SmolLM2 / Llama-3.2 style
    "qwen3": dict(_ATTN, intermediate_size=128, tie_word_embeddings=True),  # q/k RMSNorm
    "mistral": dict(_ATTN, intermediate_size=128, sliding_window=64),
    "qwen3_moe": dict(_ATTN, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                      num_experts_per_tok=2, norm_topk_prob=True),
    "qwen2_moe": dict(_ATTN, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                      num_experts_per_tok=2, shared_expert_intermediate_size=64),
    "mixtral": dict(_ATTN, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
    "olmoe": dict(_ATTN, intermediate_size=32, num_experts=8, num_experts_per_tok=2),
    "gpt_oss": dict(_ATTN, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                    sliding_window=16, layer_types=None),  # alternating sliding/full, sinks
    "deepseek_v3": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=128,
                        moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                        n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}

# ---- Hybrid (stateful) families: one stateful + one attention layer at 2 layers (the default). ----
_LIN = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"])
_MOE4 = dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=32, mamba_d_state=8, mamba_chunk_size=8, mamba_n_groups=1)
TWIN_CONFIGS.update({
    "qwen3_5_text": dict(_ATTN, **_LIN, intermediate_size=128),
    "qwen3_5_moe_text": dict(_ATTN, **_LIN, **_MOE4, shared_expert_intermediate_size=32),
    "qwen3_next": dict(_ATTN, **_LIN, **_MOE4, intermediate_size=128, shared_expert_intermediate_size=32),
    "lfm2": dict(_ATTN, intermediate_size=128, layer_types=["conv", "full_attention"], conv_L_cache=3),
    "lfm2_moe": dict(_ATTN, **_MOE4, intermediate_size=128, num_dense_layers=1,
                     layer_types=["conv", "full_attention"]),
    "falcon_h1": dict(_ATTN, intermediate_size=128, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
                      mamba_d_state=8, mamba_chunk_size=8, mamba_n_groups=1),
    "jamba": dict(_ATTN, intermediate_size=128, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=8, mamba_dt_rank=8),
    "granitemoehybrid": dict(_ATTN, **_MAMBA2, intermediate_size=32, layer_types=["mamba", "attention"],
                             num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=32),
    "nemotron_h": dict(_ATTN, intermediate_size=128, layers_block_type=["mamba", "attention"], mamba_num_heads=4,
                       mamba_head_dim=16, ssm_state_size=8, n_groups=1, chunk_size=8),
    "bamba": dict(_ATTN, **_MAMBA2, intermediate_size=128, attn_layer_indices=[1]),
    "zamba2": dict(_ATTN, intermediate_size=128, layers_block_type=["mamba", "hybrid"], hybrid_layer_ids=[1],
                   mamba_d_state=8, mamba_headdim=16, n_mamba_heads=8, chunk_size=8, num_mem_blocks=1,
                   attention_head_dim=32),
    "kimi_linear": dict(_ATTN, **_MOE4, num_key_value_heads=4, intermediate_size=128,  # MLA: kv heads = heads
                        layer_types=["linear_attention", "full_attention"],
                        mlp_layer_types=["dense", "sparse"], linear_num_heads=4, linear_head_dim=16,
                        kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
})
HYBRID_FAMILIES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "lfm2", "lfm2_moe", "falcon_h1", "jamba",
                   "granitemoehybrid", "nemotron_h", "bamba", "zamba2", "kimi_linear")
"""Twins of the families whose stateful layers fastkit restarts per packed document."""

TWIN_FAMILIES = tuple(TWIN_CONFIGS)

# Models the notebooks use -> the family of their twin, plus traits worth keeping.
HUB_TWINS: dict[str, tuple[str, dict[str, Any]]] = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": ("llama", {}),
    "Qwen/Qwen3-0.6B": ("qwen3", {}),
    "meta-llama/Llama-3.2-1B-Instruct": ("llama", {}),
    "Qwen/Qwen3-14B": ("qwen3", {"tie_word_embeddings": False}),
    "unsloth/Qwen3-14B-bnb-4bit": ("qwen3", {"tie_word_embeddings": False}),  # pre-quantized NF4 of the above
    "openai/gpt-oss-20b": ("gpt_oss", {}),
    "Qwen/Qwen3-30B-A3B": ("qwen3_moe", {}),
}


def twin_family(name: str) -> tuple[str, dict[str, Any]]:
    """``(model_type, overrides)`` of the twin standing in for a Hub model (or a model_type itself)."""
    if name in HUB_TWINS:
        return HUB_TWINS[name]
    if name in TWIN_CONFIGS:
        return name, {}
    raise ValueError(f"No twin for {name!r}; known models: {', '.join(HUB_TWINS)}; "
                     f"families: {', '.join(TWIN_FAMILIES)}")


def twin_config(model_type: str, num_hidden_layers: int = 2, **overrides: Any) -> PretrainedConfig:
    """The config of a tiny twin of ``model_type`` (see ``TWIN_CONFIGS``); ``overrides`` win."""
    if model_type not in TWIN_CONFIGS:
        raise ValueError(f"No twin for model_type {model_type!r}; known: {', '.join(TWIN_FAMILIES)}")
    kwargs = dict(TWIN_CONFIGS[model_type], num_hidden_layers=num_hidden_layers,
                  vocab_size=TWIN_VOCAB_SIZE, max_position_embeddings=32768,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    kwargs.update(overrides)
    if model_type == "gpt_oss" and kwargs.get("layer_types") is None:
        n = kwargs["num_hidden_layers"]
        kwargs["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    return CONFIG_MAPPING[model_type](**kwargs)


def twin(model_type: str, num_hidden_layers: int = 2, seed: int = 0, dtype: torch.dtype = torch.float32,
         attn_implementation: str | None = None, **overrides: Any) -> torch.nn.Module:
    """A randomly initialised tiny causal LM of ``model_type`` (deterministic for a ``seed``)."""
    config = twin_config(model_type, num_hidden_layers=num_hidden_layers, **overrides)
    if attn_implementation is None:
        attn_implementation = "eager" if model_type == "gpt_oss" else "sdpa"  # sinks: no sdpa upstream
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    return model.eval()


def twin_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (every string round-trips) with ChatML specials and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    tok.chat_template = CHATML_TEMPLATE
    tok.model_max_length = 32768
    return tok


# A small corpus the BPE twin tokenizer learns its merges from (prose, quotes, code, numbers).
TWIN_BPE_CORPUS = (
    "The quick brown fox jumps over the lazy dog. It's 12:30, isn't it? \"Yes,\" she said.",
    "def add(a, b):\n    return a + b  # sum of 2 numbers\n\nprint(add(3, 4))",
    "Total: $1,234.56 (approx.) -- that's 3.5% more than in 2023!",
    "<div class='note'>a <= b && c >= d | e ~ f</div>",
    "the theme of the thesis: there, then, these, those, other, another, mother, brother",
)


def twin_bpe_tokenizer(pre: str = "gpt-2", corpus: tuple[str, ...] = TWIN_BPE_CORPUS) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer WITH merges (what llama.cpp needs; :func:`twin_tokenizer` has none) that
    splits text like llama.cpp's pre-tokenizer ``pre`` ("gpt-2", "smollm", "llama-bpe", "qwen2", ...),
    ChatML specials at ids 0-2, trained on ``corpus`` up to ``TWIN_VOCAB_SIZE`` entries."""
    from tokenizers import Tokenizer, decoders, models, trainers
    from tokenizers import pre_tokenizers as pt

    from fastkit.export.gguf_vocab import PRE_TOKENIZERS, pre_tokenizer_object

    facts = next(p for p in PRE_TOKENIZERS if p.name == pre)
    backend = Tokenizer(models.BPE(ignore_merges=facts.ignore_merges))
    backend.pre_tokenizer = pre_tokenizer_object(pre)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TWIN_VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pt.ByteLevel.alphabet())
    backend.train_from_iterator(list(corpus) * 4, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    tok.chat_template = CHATML_TEMPLATE
    tok.model_max_length = 32768
    return tok
