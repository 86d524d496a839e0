"""The published MoE configs :mod:`fastkit.plan.moe_4bit` plans and :mod:`fastkit.plan.configs` ships (no imports)."""

GPT_OSS_20B = dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                   num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                   num_experts_per_tok=4, vocab_size=201088, sliding_window=128, max_position_embeddings=131072,
                   tie_word_embeddings=False, quantization_config={"quant_method": "mxfp4"})
"""openai/gpt-oss-20b config.json (the sizes, and that it ships MXFP4 experts; rope fields do not change the memory)."""
QWEN3_30B_A3B = dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     num_experts=128, num_experts_per_tok=8, vocab_size=151936, max_position_embeddings=40960,
                     norm_topk_prob=True, tie_word_embeddings=False)
"""Qwen/Qwen3-30B-A3B config.json (the sizes)."""

__all__ = ["GPT_OSS_20B", "QWEN3_30B_A3B"]
