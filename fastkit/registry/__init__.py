"""Per-model facts in one table: which fastkit patches apply to which ``model_type``.

Adding a model is adding a row, and a row is admitted only when the census (:mod:`fastkit.families.census`,
``tests/test_census.py``, ``docs/coverage.md``) proves it on a tiny twin: no row, no patch. A model type
that is not in the table is self-checked at load on a twin of its own config
(:func:`fastkit.families.census.self_check`):
patched only if it passes, else it loads unpatched and packed batches are refused, naming the check.
The patch implementations live in :mod:`fastkit.patches` (``packing/``, ``moe/``, ``offload/``);
:data:`PATCH_FACTORIES` names the load-time ones so this module imports none of them (they import the
patch names from here).

The table is this file; two kinds of row facts live beside it, data only: :mod:`fastkit.registry.gguf`
(:class:`GGUFRules`, how a row is written for llama.cpp, and the rule sets several rows share) and
:mod:`fastkit.registry.vision` (:class:`VisionFacts` and the vision-language families' facts). Every name is
served from ``fastkit.registry``.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Any

from fastkit.registry import gguf, vision
from fastkit.registry.gguf import GGUFRules
from fastkit.registry.vision import MROPE, ROPE_1D, VisionFacts  # noqa: F401  (MROPE, ROPE_1D: their import path)

PACKING = "packing"
"""Packed-sequence attention (:mod:`fastkit.patches.packing`), applied at load."""
MOE = "moe"
"""Sort-based MoE experts (:mod:`fastkit.patches.moe`), applied at load."""
OFFLOAD = "offload"
"""Double-buffered checkpoint offload (:mod:`fastkit.patches.offload`), applied by ``enable_checkpointing``."""
MOE_LORA = "moe_lora"
"""LoRA on MoE experts per expert group (:mod:`fastkit.patches.moe.lora`), applied by ``add_expert_lora``."""

# patch name -> "module:class" constructed as ``cls(facts)``; imported only when used.
PATCH_FACTORIES: dict[str, str] = {
    PACKING: "fastkit.patches.packing:PackedAttentionPatch",
    MOE: "fastkit.patches.moe:MoEExpertsPatch",
}


@dataclass(frozen=True)
class ModelFacts:
    """What fastkit knows about one ``model_type``, each fact proven by the census (:mod:`fastkit.families.census`)."""

    model_type: str
    """The ``config.model_type`` this row describes."""
    packing: bool = True
    """The packed-attention patch applies; the census proved packed rows exact on this family's twin."""
    moe: bool = False
    """The family has experts fastkit's router runs (``@use_experts_implementation``, or ``looped_experts``)."""
    attention_sinks: bool = False
    """Per-head learned sinks in the softmax (GPT-OSS): SDPA cannot express them."""
    sliding_window: bool = False
    """Some or all layers attend within a window (``config.sliding_window`` / ``layer_types``)."""
    softcap: bool = False
    """Attention logits are soft-capped (``config.attn_logit_softcapping``, Gemma-2 style)."""
    mla: bool = False
    """Multi-head latent attention (DeepSeek): q/k and v head sizes differ, so no varlen flash kernel."""
    default_attn: str = "sdpa"
    """The exact attention backend to load with when flash-attn is not installed (``eager``: no sdpa upstream)."""
    text_config: str | None = None
    """A composite checkpoint (vision + text): the sub-config its text model is built from; fastkit trains
    that text model only."""
    text_keys: tuple[tuple[str, str], ...] = ()
    """``(pattern, replacement)`` checkpoint key renames that load the text model of a composite checkpoint."""
    looped_experts: tuple[str, ...] = ()
    """Experts classes transformers loops over without the decorator, that fastkit routes itself."""
    looped_forward: str = ""
    """Which fastkit forward runs those classes (:mod:`fastkit.patches.moe.patch`): ``"dbrx"``
    (``dbrx_experts_forward``, a ``DbrxExperts``-like module with ``mlp.w1/v1/w2``) or ``"llama4"``
    (``llama4_moe_forward``, a ``Llama4TextMoe``-like module over fused ``experts.gate_up_proj``)."""
    no_4bit_experts: tuple[str, ...] = ()
    """Experts classes with no NF4 layout in fastkit: ``load_in_4bit`` is refused for this type (and for a
    composite whose sub-config is this type) before loading, and by ``quantize_experts`` on a built model."""
    gguf_arch: str | None = None
    """llama.cpp's architecture name, where ``save_gguf`` writes (and a round trip tests) this family."""
    gguf: GGUFRules = field(default_factory=GGUFRules)
    """How this family's tensors and metadata differ from llama.cpp's ``gguf_arch`` graph (read by ``save_gguf``)."""
    gguf_refusal: str = ""
    """Why ``save_gguf`` does not write this family yet where llama.cpp has an architecture for it (said in the
    refusal); empty: no reason beyond "no GGUF mapping"."""
    twin: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    """Config overrides of this family's tiny twin on top of the shrunk defaults (:mod:`fastkit.families.twins`)."""
    twin_layer_pattern: tuple[str, ...] = ()
    """The twin's ``layer_types``, repeated over its layers when no ``layer_types`` is given (GPT-OSS: sliding
    then full attention, so a twin of any depth has both kinds); ``()``: the config class decides."""
    note: str = ""
    """Anything a user should know, shown in the load banner."""
    stateful: tuple[str, ...] = ()
    """Class names of the layers that carry state along the sequence (linear attention, causal conv, SSM);
    the packing patch restarts each at every document start (:mod:`fastkit.patches.packing.state`)."""
    default_lora_targets: tuple[str, ...] = ()
    """``get_peft_model``'s targets for ``target_modules="all-linear"`` where PEFT's all-linear fails on this
    family (empty: PEFT's all-linear). Mamba hybrids whose mixer PEFT refuses (``out_proj``: "incompatible with
    Mamba-based models") list their attention / MLP projections."""
    varlen: str = ""
    """How those layers restart per document inside one CUDA kernel call, where the kernels transformers
    already uses are installed (:mod:`fastkit.patches.packing.varlen`): ``"gated_delta"`` (causal-conv1d
    ``seq_idx`` + flash-linear-attention ``cu_seqlens``), ``"short_conv"`` (causal-conv1d ``seq_idx``),
    ``"mamba2"`` (causal-conv1d + mamba-ssm ``seq_idx``); ``""``: the per-document regroup everywhere."""
    vision: VisionFacts | None = None
    """An image-text-to-text family: loaded with its processor as ``AutoModelForImageTextToText``
    (:class:`VisionFacts`); None: a text model."""
    gguf_text: ModelFacts | None = None
    """A vision-language family whose language model has no row of its own (Qwen2.5-VL's ``qwen2_5_vl_text``): that
    text model's GGUF facts (``model_type``, ``gguf_arch``, ``gguf``), read by ``save_gguf`` for its text GGUF
    (:func:`gguf_row`)."""


_TEXT_KEYS = ((r"^model\.language_model\.", "model."), (r"^language_model\.model\.", "model."),
              (r"^language_model\.lm_head\.", "lm_head."))
"""Checkpoint key renames that load a composite checkpoint's text model alone (transformers' key_mapping)."""
_ATTN = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
_LOOPED = "experts looped upstream; fastkit routes them"

MODEL_TABLE: dict[str, ModelFacts] = {
    f.model_type: f
    for f in [
        ModelFacts("llama", gguf_arch="llama", gguf=GGUFRules(permute_qk=True, rope_types=("default", "llama3"),
                                                              reader_config=False),
                   twin=dict(_ATTN, intermediate_size=128, tie_word_embeddings=True)),
        ModelFacts("mistral", sliding_window=True, gguf_arch="llama", gguf=GGUFRules(permute_qk=True,
                                                                                     reader_config=False),
                   twin=dict(_ATTN, intermediate_size=128, sliding_window=64)),
        ModelFacts("qwen2", gguf_arch="qwen2"),  # windows only with use_sliding_window
        ModelFacts("qwen3", gguf_arch="qwen3",  # q/k RMSNorm
                   twin=dict(_ATTN, intermediate_size=128, tie_word_embeddings=True)),
        ModelFacts("qwen3_moe", moe=True, gguf_arch="qwen3moe", gguf=GGUFRules(router_renorm="always"),
                   twin=dict(_ATTN, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                             num_experts_per_tok=2, norm_topk_prob=True)),
        ModelFacts("qwen2_moe", moe=True, gguf_arch="qwen2moe",
                   gguf=GGUFRules(router_renorm="never", experts_every_layer=True, shared_expert=True),
                   twin=dict(_ATTN, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                             num_experts_per_tok=2, shared_expert_intermediate_size=64)),
        ModelFacts("mixtral", moe=True, gguf_arch="llama",  # llama.cpp's llama graph with experts: softmax top-k
                   gguf=GGUFRules(permute_qk=True, experts_every_layer=True, reader=False),
                   twin=dict(_ATTN, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2)),
        ModelFacts("olmoe", moe=True, gguf_arch="olmoe",  # softmax top-k, not renormalized; q/k norms over all heads
                   gguf=GGUFRules(router_renorm="never", experts_every_layer=True, output="untied", reader=False,
                                  mha_only=True, fixed=(("clip_qkv", None),)),
                   twin=dict(_ATTN, intermediate_size=32, num_experts=8, num_experts_per_tok=2)),
        ModelFacts("deepseek_v3", moe=True, mla=True, note="MLA attention: q/k and v head sizes differ",
                   gguf_arch="deepseek2", gguf=GGUFRules(**gguf.DEEPSEEK, **gguf.SELECTION_BIAS,
                                                         fixed=(("attention_bias", False), ("rope_interleave", True))),
                   twin=dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=128,
                             moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                             n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
                             qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
        ModelFacts("dbrx", moe=True, looped_experts=("DbrxExperts",), looped_forward="dbrx",
                   no_4bit_experts=("DbrxExperts",),
                   note=_LOOPED, twin=dict(d_model=64, n_heads=4, attn_config=dict(kv_n_heads=2, rope_theta=1e4,
                                                                                   clip_qkv=8.0),
                                           ffn_config=dict(ffn_hidden_size=32, moe_num_experts=8, moe_top_k=2))),
        ModelFacts("llama4_text", packing=False, moe=True, looped_experts=("Llama4TextMoe",), looped_forward="llama4",
                   no_4bit_experts=("Llama4TextExperts",), note=_LOOPED),
        ModelFacts("gpt_oss", moe=True, attention_sinks=True, sliding_window=True, default_attn="eager",
                   note="attention sinks: sdpa cannot express them upstream", gguf_arch="gpt-oss",
                   gguf=GGUFRules(windows=True, rope_types=("default", "yarn"), experts="interleaved", output="untied",
                                  swiglu=(1.702, 7.0)),
                   twin=dict(_ATTN, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                             sliding_window=16, layer_types=None),  # sinks
                   twin_layer_pattern=("sliding_attention", "full_attention")),
        # Every row below: a plain row, proven by the census (docs/coverage.md) on transformers 5.24.
        ModelFacts("afmoe", sliding_window=True, moe=True),
        ModelFacts("apertus", gguf_arch="apertus",  # apertus.cpp: q/k RMSNorm before rope, xIELU up/down MLP
                   gguf=GGUFRules(activation="xielu", rope_types=("default", "llama3"), output="untied", reader=False,
                                  layer_arrays=((r"\.act_fn\.alpha_p$", "add_xielu_alpha_p"),
                                                (r"\.act_fn\.alpha_n$", "add_xielu_alpha_n"),
                                                (r"\.act_fn\.beta$", "add_xielu_beta"),
                                                (r"\.act_fn\.eps$", "add_xielu_eps")))),
        ModelFacts("apertus1p5_text"),
        ModelFacts("arcee", gguf_arch="arcee",  # arcee.cpp: llama's graph, ReLU² up/down MLP, no gate
                   gguf=GGUFRules(permute_qk=True, activation="relu2", reader=False, fixed=(("mlp_bias", False),))),
        ModelFacts("aria_text", moe=True),
        ModelFacts("axk1", mla=True, moe=True),
        ModelFacts("beam", sliding_window=True, moe=True),
        ModelFacts("bitnet"),
        ModelFacts("codegen"),
        ModelFacts("cohere", gguf_arch="command-r",  # command-r.cpp: parallel block, bias-free LayerNorm, interleaved
                   gguf=GGUFRules(layer_norm_eps="layer_norm_eps", output="tied", reader=False,  # rope, logit scale
                                  config_scales=(("add_logit_scale", "logit_scale"),),
                                  fixed=(("attention_bias", False),))),  # command-r.cpp loads no o_proj bias
        # cohere2: parallel attention + MLP on one LayerNorm; rope on the windowed layers only (as transformers)
        ModelFacts("cohere2", sliding_window=True, gguf_arch="cohere2",
                   gguf=GGUFRules(windows=True, output="tied", layer_norm_eps="layer_norm_eps",
                                  fixed=(("attention_bias", False),),
                                  config_scales=(("add_logit_scale", "logit_scale"),), reader=False)),
        ModelFacts("cohere2_moe", sliding_window=True, moe=True),
        ModelFacts("cwm", sliding_window=True),
        ModelFacts("deepseek_v2", mla=True, moe=True, gguf_arch="deepseek2",  # HF's V2 router never renormalizes
                   gguf=GGUFRules(**gguf.DEEPSEEK, gating="softmax",  # (norm_topk_prob unread): llama.cpp's default
                                  fixed=(("attention_bias", False), ("mlp_bias", False)))),
        ModelFacts("diffllama"),
        ModelFacts("dory", sliding_window=True),
        ModelFacts("emu3"),
        ModelFacts("ernie4_5", gguf_arch="ernie4_5", gguf=GGUFRules(fixed=(("use_bias", False),),
                                                                    reader=False)),
        ModelFacts("ernie4_5_moe", moe=True, gguf_arch="ernie4_5-moe",  # ernie4-5-moe.cpp: ernie4_5's attention,
                   gguf=GGUFRules(reader=False, router_renorm="always",  # softmax top-k renormalized (hard-coded)
                                  dense_lead="moe_layer_start_index", moe_last="moe_layer_end_index",
                                  config_ints=(("add_interleave_moe_layer_step", "moe_layer_interval"),
                                               ("add_expert_shared_feed_forward_length",
                                                "moe_intermediate_size·moe_num_shared_experts")),
                                  renames=((r"\.mlp\.gate\.moe_statics\.e_score_correction_bias$",
                                            ".mlp.gate.e_score_correction.bias"),),  # exp_probs_b: selection only
                                  fixed=(("use_bias", False), ("moe_layer_interval", 1)))),
        ModelFacts("exaone", gguf_arch="llama",  # transformers builds EXAONE 3 as LlamaForCausalLM
                   gguf=GGUFRules(permute_qk=True, rope_types=("default", "llama3"), reader_config=False)),
        ModelFacts("exaone4", sliding_window=True, gguf_arch="exaone4",  # post-norms only, per-head q/k RMSNorm
                   gguf=GGUFRules(windows=True, windows_at_depth=64, rope_types=("default", "llama3"), reader=False)),
        ModelFacts("exaone_moe", sliding_window=True, moe=True),
        ModelFacts("flex_olmo", moe=True),
        ModelFacts("flint", sliding_window=True, attention_sinks=True, default_attn="eager"),
        ModelFacts("gemma", gguf_arch="gemma",  # gemma.cpp: x·sqrt(H) embeddings, norms x·w, GELU(tanh), tied head
                   gguf=GGUFRules(norm_shift=1.0, activation="gelu_pytorch_tanh", output="tied", reader=False)),
        ModelFacts("gemma2", sliding_window=True, softcap=True, default_attn="eager",
                   note="soft-capped attention: eager (transformers has no sdpa for Gemma 2)", gguf_arch="gemma2",
                   gguf=GGUFRules(**gguf.GEMMA, attn_softcap="required", final_softcap="required",
                                  query_scale_wide_at=46, output="tied")),
        ModelFacts("gemma3_text", sliding_window=True, gguf_arch="gemma3",
                   gguf=GGUFRules(**gguf.GEMMA, final_softcap="optional", rope_by_layer_type=True,
                                  rope_types=("default", "linear"), query_scale_wide_at=62)),
        ModelFacts("gemma3", sliding_window=True, text_config="text_config", text_keys=_TEXT_KEYS,
                   vision=vision.GEMMA3,  # GGUF: text + mmproj (export/gguf/mmproj.py)
                   note="composite checkpoint (vision + text): fastkit loads and trains the text model only, "
                        "unless vision=True"),
        ModelFacts("glm"),
        ModelFacts("glm4", gguf_arch="glm4",  # fused gate_up_proj, post-norms, partial interleaved rope
                   gguf=GGUFRules(reader=False)),
        ModelFacts("glm4_moe", moe=True, gguf_arch="glm4moe",  # glm4-moe.cpp: q/k norms, qkv biases optional
                   gguf=GGUFRules(**gguf.SELECTION_BIAS, reader=False, dense_lead="first_k_dense_replace",
                                  config_ints=(("add_expert_shared_count", "n_shared_experts"),),
                                  config_scales=(("add_expert_weights_scale", "routed_scaling_factor"),))),
        ModelFacts("glm4_moe_lite", mla=True, moe=True, gguf_arch="deepseek2",  # GLM-4.7-Flash: V3's MLA and router
                   gguf=GGUFRules(**dict(gguf.DEEPSEEK, dense_lead="mlp_layer_types"), **gguf.SELECTION_BIAS,
                                  fixed=(("attention_bias", False), ("rope_interleave", True)))),
        ModelFacts("gpt-sw3"),
        ModelFacts("gpt2", gguf_arch="gpt2",  # gpt2.cpp: learned positions, LayerNorms + biases, fused qkv, GELU (tanh)
                   gguf=GGUFRules(layer_norm_eps="layer_norm_epsilon", activation="gelu_new",  # reader: has gpt2
                                  transposed=("attn_qkv", "attn_output", "ffn_up", "ffn_down"), ffn_length="n_inner",
                                  fixed=(("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                                         ("add_cross_attention", False)))),
        ModelFacts("gpt_bigcode", gguf_arch="starcoder",  # starcoder.cpp: gpt2's graph with one KV head (multi_query)
                   gguf=GGUFRules(layer_norm_eps="layer_norm_epsilon", activation="gelu_pytorch_tanh", reader=False,
                                  ffn_length="n_inner", kv_heads=1,
                                  fixed=(("multi_query", True), ("scale_attn_weights", True),
                                         ("add_cross_attention", False)))),
        ModelFacts("gpt_neox", gguf_arch="gptneox",  # gptneox.cpp: LayerNorms + biases, partial rotary, GELU (tanh)
                   gguf=GGUFRules(layer_norm_eps="layer_norm_eps", activation="gelu", output="untied", reader=False,
                                  qkv_per_head=True, config_flags=(("add_parallel_residual", "use_parallel_residual"),),
                                  fixed=(("attention_bias", True),))),
        ModelFacts("gptj"),
        ModelFacts("granite", gguf_arch="granite", gguf=GGUFRules(permute_qk=True, reader=False,
                                                                  config_scales=gguf.GRANITE_SCALES)),
        ModelFacts("granite_swa", sliding_window=True, attention_sinks=True, default_attn="eager"),
        ModelFacts("granitemoe", moe=True, gguf_arch="granitemoe",  # granite.cpp's graph with experts: top-k softmax
                   gguf=gguf.GRANITEMOE),
        ModelFacts("granitemoe_swa", sliding_window=True, attention_sinks=True, moe=True, default_attn="eager"),
        ModelFacts("granitemoeshared", moe=True, gguf_arch="granitemoe",  # granite.cpp's shared expert (n_ff_shexp)
                   gguf=dataclasses.replace(gguf.GRANITEMOE, config_ints=(
                       ("add_expert_shared_feed_forward_length", "shared_intermediate_size"),),
                       fused_halves=(("shared_mlp.input_linear", "ffn_gate_shexp", "ffn_up_shexp"),))),
        ModelFacts("helium", gguf_arch="llama",  # llama's graph: Helium's rope already rotates interleaved pairs
                   gguf=GGUFRules(reader_config=False)),  # (llama.cpp's order): q/k written as they are
        ModelFacts("hrm_text"),
        ModelFacts("hunyuan_v1_dense", gguf_arch="hunyuan-dense",  # hunyuan-vl.cpp: q/k RMSNorm after rope
                   gguf=GGUFRules(reader=False)),
        ModelFacts("hy_v3", moe=True),
        ModelFacts("hyperclovax"),
        ModelFacts("internlm3", gguf_arch="llama",  # transformers builds InternLM3 as LlamaForCausalLM (llama.cpp too)
                   gguf=GGUFRules(permute_qk=True, rope_types=("default", "llama3"), reader_config=False)),
        ModelFacts("iquestcoder"),
        ModelFacts("jais2"),
        ModelFacts("jetmoe", no_4bit_experts=("JetMoeMoE", "JetMoeMoA")),  # packing exact; experts not 4-bit
        ModelFacts("kolibri1", sliding_window=True, moe=True),
        ModelFacts("laguna", sliding_window=True, moe=True),
        ModelFacts("mellum", sliding_window=True, moe=True),
        ModelFacts("mimo_v2_flash", sliding_window=True, attention_sinks=True, moe=True, default_attn="eager"),
        ModelFacts("minicpm3", mla=True),
        ModelFacts("minimax_m2", moe=True, gguf_arch="minimax-m2",  # minimax-m2.cpp: sigmoid + bias, top-k renormalized
                   gguf=GGUFRules(gating="sigmoid", router_renorm="always", experts_every_layer=True, output="untied",
                                  buffers=("e_score_correction_bias",),
                                  renames=((r"\.mlp\.e_score_correction_bias$", ".mlp.e_score_correction.bias"),))),
        ModelFacts("minimax_m3_vl_text", moe=True),
        ModelFacts("ministral", sliding_window=True, gguf_arch="llama",  # llama.cpp's llama graph: no window
                   gguf=GGUFRules(permute_qk=True, reader_config=False)),
        ModelFacts("ministral3", gguf_arch="mistral3",  # mistral3.cpp: llama's graph, YaRN, Llama-4 query temperature
                   gguf=GGUFRules(permute_qk=True, rope_types=("yarn",), reader=False,
                                  rope_optional=(("add_rope_scaling_yarn_log_mul", "mscale_all_dim"),
                                                 ("add_attn_temperature_scale", "llama_4_scaling_beta")),
                                  rope_fixed=(("mscale", 1.0), ("attention_factor", None)))),
        ModelFacts("mllama"),
        ModelFacts("moshi", sliding_window=True),
        ModelFacts("nanochat"),
        ModelFacts("olmo", gguf_arch="olmo",  # olmo.cpp: weightless LayerNorms (eps 1e-5), q/k/v clamped to clip_qkv
                   gguf=GGUFRules(permute_qk=True, layer_norm_eps=1e-5, reader=False,
                                  fixed=(("attention_bias", False),),  # olmo.cpp: no o_proj bias
                                  config_optional=(("add_clamp_kqv", "clip_qkv"),))),
        ModelFacts("olmo2", gguf_arch="olmo2",  # post-norms only, q/k RMSNorm over all heads
                   gguf=GGUFRules(output="untied", fixed=(("attention_bias", False),), reader=False)),
        ModelFacts("olmo3", sliding_window=True, gguf_arch="olmo2",  # llama.cpp's olmo2 graph with windows
                   gguf=GGUFRules(windows=True, rope_by_layer_type=True, swa_rope_global=True, output="untied",
                                  rope_types=("default", "yarn"), fixed=(("attention_bias", False),),
                                  reader=False)),
        ModelFacts("persimmon"),
        ModelFacts("phi", gguf_arch="phi2",  # phi2.cpp: parallel attention + MLP from one LayerNorm, biases, GELU(tanh)
                   gguf=GGUFRules(layer_norm_eps="layer_norm_eps", activation="gelu_new", output="untied", reader=False,
                                  fixed=(("qk_layernorm", False),))),
        ModelFacts("phi3", gguf_arch="phi3"),  # fused qkv_proj / gate_up_proj: llama.cpp reads them fused
        ModelFacts("phi4_multimodal"),
        ModelFacts("phimoe", moe=True, gguf_refusal=gguf.PHIMOE_REFUSAL),
        ModelFacts("sarvam_mla", mla=True, moe=True),
        ModelFacts("sarvam_moe", moe=True),
        ModelFacts("seed_oss", gguf_arch="seed_oss",  # seed-oss.cpp: q/k/v biases optional, none on o_proj / MLP
                   gguf=GGUFRules(reader=False, fixed=(("attention_out_bias", False), ("mlp_bias", False)))),
        ModelFacts("smollm3", gguf_arch="smollm3", gguf=GGUFRules(
            permute_qk=True, no_rope_every=4, fixed=(("attention_bias", False), ("mlp_bias", False)),
            reader=False)),
        ModelFacts("solar_open", moe=True, gguf_arch="glm4moe",  # glm4-moe.cpp: MoE in every layer, V3's router
                   gguf=GGUFRules(**gguf.SELECTION_BIAS, reader=False,
                                  config_ints=(("add_expert_shared_count", "n_shared_experts"),),
                                  config_scales=(("add_expert_weights_scale", "routed_scaling_factor"),))),
        ModelFacts("starcoder2", gguf_arch="starcoder2",  # LayerNorm + biases, gelu MLP without gate
                   gguf=GGUFRules(activation="gelu_pytorch_tanh", layer_norm_eps="norm_epsilon",
                                  fixed=(("use_bias", True),))),
        ModelFacts("vaultgemma", sliding_window=True, softcap=True, default_attn="eager"),
        ModelFacts("youtu", mla=True),
        ModelFacts("qwen2_5_vl", vision=vision.QWEN2_5_VL, note="vision-language: mrope (3-D positions)",
                   gguf_text=ModelFacts("qwen2_5_vl_text", gguf_arch="qwen2vl",  # text + mmproj (export/gguf/mmproj.py)
                                        gguf=GGUFRules(rope_sections=True, reader=False,  # sections in order
                                                       rope_fixed=(("mrope_interleaved", False),)))),
        ModelFacts("qwen3_vl", vision=vision.QWEN3_VL, note="vision-language: mrope (3-D positions)",
                   gguf_text=ModelFacts("qwen3_vl_text", gguf_arch="qwen3vl",  # text + mmproj (export/gguf/mmproj.py)
                                        gguf=GGUFRules(rope_sections=True, reader=False,  # sections interleaved
                                                       rope_fixed=(("mrope_interleaved", True),), config_ints=(
                                            ("add_num_deepstack_layers", "num_deepstack_layers"),)))),
        ModelFacts("qwen3_vl_moe", moe=True, note="vision-language: mrope (3-D positions)",
                   gguf_text=ModelFacts("qwen3_vl_moe_text", moe=True, gguf_arch="qwen3vlmoe", gguf=GGUFRules(
                       router_renorm="always", rope_sections=True, reader=False,  # qwen3vl-moe.cpp: renormalized
                       rope_fixed=(("mrope_interleaved", True),),
                       config_ints=(("add_num_deepstack_layers", "num_deepstack_layers"),))),
                   vision=dataclasses.replace(
            vision.QWEN3_VL, twin_text=dict(vision.QWEN3_VL.twin_text, moe_intermediate_size=32, num_experts=4,
                                             num_experts_per_tok=2, decoder_sparse_step=1),
            gguf_shell="Qwen3MoeForCausalLM")),
        ModelFacts("idefics3", vision=vision.IDEFICS3, note="vision-language (SmolVLM)"),  # GGUF: text + mmproj
        ModelFacts("smolvlm", vision=vision.IDEFICS3, note="vision-language (SmolVLM2)"),  # (export/gguf/mmproj.py)
    ]
}

# ---- Hybrid (stateful) families: packing exact because their stateful layers restart per document
# (fastkit/patches/packing/state.py; proof: tests/test_packing_state.py, table: docs/packing.md). ----
_GDN = "gated DeltaNet (causal conv1d + chunked delta-rule state) restarts per document"
_MAMBA = "Mamba mixer (causal conv1d + SSM scan state) restarts per document"
_CONV = "short causal conv restarts per document"
# Hybrid twins: one stateful + one attention layer at 2 layers (the default).
_LIN = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"])
_MOE4 = dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
_ATTN_MLP_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=32, mamba_d_state=8, mamba_chunk_size=8, mamba_n_groups=1)
MODEL_TABLE.update({f.model_type: f for f in [
    ModelFacts("qwen3_5_text", gguf_arch="qwen35", gguf=gguf.QWEN3_5,
               stateful=("Qwen3_5GatedDeltaNet",), varlen="gated_delta", note=_GDN,
               twin=dict(_ATTN, **_LIN, intermediate_size=128)),
    ModelFacts("qwen3_5_moe_text", gguf_arch="qwen35moe", gguf=gguf.QWEN3_5_MOE,
               stateful=("Qwen3_5MoeGatedDeltaNet",), varlen="gated_delta", moe=True, note=_GDN,
               twin=dict(_ATTN, **_LIN, **_MOE4, shared_expert_intermediate_size=32)),
    ModelFacts("qwen3_next", gguf_arch="qwen3next", gguf=gguf.QWEN3_NEXT,
               stateful=("Qwen3NextGatedDeltaNet",), varlen="gated_delta", moe=True, note=_GDN,
               twin=dict(_ATTN, **_LIN, **_MOE4, intermediate_size=128, shared_expert_intermediate_size=32)),
    ModelFacts("lfm2", stateful=("Lfm2ShortConv",), varlen="short_conv", note=_CONV,
               gguf_arch="lfm2", gguf=gguf.LFM2,  # src/models/lfm2.cpp: short conv (B·x, conv, C·) + attention
               twin=dict(_ATTN, intermediate_size=128, layer_types=["conv", "full_attention"], conv_L_cache=3)),
    ModelFacts("lfm2_moe", gguf_arch="lfm2moe", gguf=gguf.LFM2_MOE,
               stateful=("Lfm2MoeShortConv",), varlen="short_conv", moe=True, note=_CONV,
               twin=dict(_ATTN, **_MOE4, intermediate_size=128, num_dense_layers=1,
                         layer_types=["conv", "full_attention"])),
    ModelFacts("falcon_h1", gguf_arch="falcon-h1", gguf=gguf.FALCON_H1,
               stateful=("FalconH1Mixer",), varlen="mamba2", note=_MAMBA,
               default_lora_targets=_ATTN_MLP_TARGETS,
               twin=dict(_ATTN, intermediate_size=128, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
                         mamba_d_state=8, mamba_chunk_size=8, mamba_n_groups=1)),
    ModelFacts("jamba", gguf_refusal=gguf.NOT_YET.format(arch="jamba", what="Mamba layers"),
               stateful=("JambaMambaMixer",), moe=True, note=_MAMBA,
               # all-linear less dt_proj: JambaMambaMixer multiplies by dt_proj.weight itself (never calls the
               # module, unless quantized), so a LoRA there would never train (tests/test_moe_lora.py)
               default_lora_targets=(*_ATTN_MLP_TARGETS, "in_proj", "x_proj", "out_proj"),
               twin=dict(_ATTN, intermediate_size=128, attn_layer_period=2, attn_layer_offset=1,
                         expert_layer_period=2, expert_layer_offset=1, num_experts=4, num_experts_per_tok=2,
                         mamba_d_state=8, mamba_dt_rank=8)),
    ModelFacts("granitemoehybrid", gguf_arch="granitehybrid", gguf=gguf.GRANITE_HYBRID,
               stateful=("GraniteMoeHybridMambaLayer",), varlen="mamba2", moe=True, note=_MAMBA,
               twin=dict(_ATTN, **_MAMBA2, intermediate_size=32, layer_types=["mamba", "attention"],
                         num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=32)),
    ModelFacts("nemotron_h", gguf_arch="nemotron_h", gguf=gguf.NEMOTRON_H,
               stateful=("NemotronHMamba2Mixer",), varlen="mamba2", note=_MAMBA,
               default_lora_targets=_ATTN_MLP_TARGETS,
               twin=dict(_ATTN, intermediate_size=128, layers_block_type=["mamba", "attention"], mamba_num_heads=4,
                         mamba_head_dim=16, ssm_state_size=8, n_groups=1, chunk_size=8)),
    ModelFacts("bamba", gguf_refusal=gguf.NOT_YET.format(arch="granitehybrid", what="Mamba2 layers"),
               stateful=("BambaMixer",), varlen="mamba2", note=_MAMBA,
               twin=dict(_ATTN, **_MAMBA2, intermediate_size=128, attn_layer_indices=[1])),
    ModelFacts("zamba2", gguf_refusal="llama.cpp has no architecture for Zamba2",
               stateful=("Zamba2MambaMixer",), varlen="mamba2", note=_MAMBA,
               twin=dict(_ATTN, intermediate_size=128, layers_block_type=["mamba", "hybrid"], hybrid_layer_ids=[1],
                         mamba_d_state=8, mamba_headdim=16, n_mamba_heads=8, chunk_size=8, num_mem_blocks=1,
                         attention_head_dim=32)),
    ModelFacts("kimi_linear", gguf_refusal=gguf.NOT_YET.format(arch="kimi-linear", what="Kimi delta attention"),
               stateful=("KimiLinearDeltaAttention",), moe=True, mla=True,
               note="Kimi delta attention (causal convs + chunked delta-rule state) restarts per document",
               twin=dict(_ATTN, **_MOE4, num_key_value_heads=4, intermediate_size=128,  # MLA: kv heads = heads
                         layer_types=["linear_attention", "full_attention"],
                         mlp_layer_types=["dense", "sparse"], linear_num_heads=4, linear_head_dim=16,
                         kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)),
]})

REFUSED: dict[str, str] = {}
"""Types the census must not admit although their default-config twin passes, and why."""

def gguf_archs() -> dict[str, str]:
    """transformers ``model_type`` -> llama.cpp architecture, for every row ``save_gguf`` writes (read at call time,
    so a row added at run time is exported too)."""
    return {t: f.gguf_arch for t, f in MODEL_TABLE.items() if f.gguf_arch}


def gguf_text_archs() -> dict[str, str]:
    """Vision-language models' text ``model_type`` -> llama.cpp architecture (:attr:`ModelFacts.gguf_text`)."""
    return {f.gguf_text.model_type: f.gguf_text.gguf_arch for f in MODEL_TABLE.values() if f.gguf_text}


def gguf_row(model_type: str) -> ModelFacts | None:
    """The row ``save_gguf`` writes ``model_type`` by: its own, or the ``gguf_text`` of the vision row whose language
    model it is; None: neither."""
    if model_type in MODEL_TABLE:
        return MODEL_TABLE[model_type]
    return next((f.gguf_text for f in MODEL_TABLE.values() if f.gguf_text and f.gguf_text.model_type == model_type),
                None)


def facts_for(model_type: str) -> ModelFacts | None:
    """The table row for ``model_type``, or None for a model fastkit does not know."""
    return MODEL_TABLE.get(model_type)


# The table is read at call time, never copied at import: a row added (or changed) at run time reaches every
# decision below (tests/test_registry.py adds one).


def looped_experts() -> dict[str, str]:
    """Every looped-experts class fastkit routes -> the fastkit forward that runs it (``looped_forward``)."""
    return {c: f.looped_forward for f in MODEL_TABLE.values() for c in f.looped_experts}


def no_4bit_experts() -> tuple[str, ...]:
    """Every experts class with no NF4 layout in fastkit (``ModelFacts.no_4bit_experts`` of every row)."""
    return tuple(c for f in MODEL_TABLE.values() for c in f.no_4bit_experts)


def patch_names_for(facts: ModelFacts) -> list[str]:
    """Load-time patches that apply to a family, in application order."""
    names = []
    if facts.packing:
        names.append(PACKING)
    if facts.moe:
        names.append(MOE)
    return names


def build_patch(name: str, facts: ModelFacts):
    """Instantiate the patch called ``name`` for a family (imports its module on first use)."""
    module_name, cls_name = PATCH_FACTORIES[name].split(":")
    return getattr(importlib.import_module(module_name), cls_name)(facts)
