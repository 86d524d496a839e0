"""How each family is written for llama.cpp: :class:`GGUFRules` (a row's ``gguf`` field) and the rule sets several
rows share. Data only: read by :mod:`fastkit.export.gguf` through the rows of :data:`fastkit.registry.MODEL_TABLE`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GGUFRules:
    """How :func:`fastkit.export.save_gguf` writes one family for llama.cpp, beyond the tensor names gguf-py maps:
    each rule is a difference between the transformers model and llama.cpp's graph for ``gguf_arch`` (read in
    llama.cpp's ``src/models/<arch>.cpp``), proven by the family's row in tests/test_llamacpp_round_trip.py."""

    norm_shift: float = 0.0
    """Added to every RMSNorm weight (names ending ``norm.weight``): Gemma's norms compute ``x·(1 + w)``, llama.cpp's
    ``x·w``."""
    activation: str | None = "silu"
    """The MLP activation llama.cpp's graph applies (``config.hidden_activation`` / ``hidden_act``); others refused.
    None: the config names none (LFM2: SiLU on both sides, hard-coded)."""
    attn_softcap: str = "none"
    """Attention-logit soft-capping: ``"none"`` (llama.cpp has none: a configured cap is refused), ``"required"``
    (llama.cpp always caps: written, a missing cap refused)."""
    final_softcap: str = "none"
    """Final-logit soft-capping: ``"none"``, ``"required"`` (always applied by llama.cpp), ``"optional"`` (written
    when configured)."""
    windows: bool = False
    """llama.cpp's graph has per-layer sliding windows: ``sliding_window`` and the per-layer pattern (from
    ``config.layer_types``) are written. Without it a window shorter than the context is refused."""
    rope_by_layer_type: bool = False
    """``config.rope_parameters`` is per layer type (Gemma 3): ``full_attention``'s theta (and linear scaling) for
    the full layers, ``sliding_attention``'s theta as llama.cpp's ``rope.freq_base_swa``."""
    query_scale_wide_at: int = 0
    """llama.cpp scales queries by ``1/sqrt(head_dim)``, or ``1/sqrt(hidden/heads)`` for a model of exactly this many
    layers (its Gemma 27B); ``config.query_pre_attn_scalar`` must be the one it uses (0: no such config key)."""
    output: str = "either"
    """``"tied"``: llama.cpp's graph computes logits with ``token_embd`` (an untied head is refused); ``"untied"``:
    it needs its own ``output`` tensor (a tied head is refused); ``"either"``."""
    rope_types: tuple[str, ...] = ("default",)
    """``rope_type`` values written (Llama-3's as ``rope_freqs``, linear / yarn as llama.cpp's scaling keys); others
    refused."""
    experts: str = "halves"
    """Fused expert layout: ``"halves"`` (``gate_up_proj (E, 2I, H)``, gate rows first: Qwen MoE) or
    ``"interleaved"`` (``gate_up_proj (E, H, 2I)`` with gate / up alternating on the last dim, biases alike, and
    ``down_proj (E, I, H)``: GPT-OSS), split into llama.cpp's ``ffn_{gate,up,down}_exps``."""
    permute_qk: bool = False
    """q/k rows stored in llama.cpp's interleaved-pair rope order (its ``llama`` arch); transformers' reader
    undoes it."""
    router_renorm: str = "either"
    """Top-k router weights in llama.cpp's MoE graph: ``"always"`` renormalized (``config.norm_topk_prob`` False is
    refused), ``"never"`` (True is refused), ``"either"`` (no experts, or a graph that reads it), ``"config"``
    (the graph reads ``expert_weights_norm``: written from ``config.norm_topk_prob``)."""
    experts_every_layer: bool = False
    """llama.cpp's MoE graph has experts in every layer: dense layers (``mlp_only_layers``, ``decoder_sparse_step``
    other than 1) are refused."""
    shared_expert: bool = False
    """A shared expert beside the routed ones (its FFN length written as ``expert_shared_feed_forward_length``)."""
    swiglu: tuple[float, float] | None = None
    """``(alpha, limit)`` of the clamped SwiGLU llama.cpp's graph hard-codes (GPT-OSS: 1.702, 7.0); a config with
    other values is refused. None: plain SwiGLU."""
    config_scales: tuple[tuple[str, str], ...] = ()
    """``(gguf-py writer method, config attribute)`` pairs of float hyperparameters llama.cpp's graph reads (Granite's
    ``add_embedding_scale`` <- ``embedding_multiplier``, ...), written from the config."""
    reader: bool = True
    """transformers' GGUF reader loads this family's file (its read-back check runs); False (mixtral: the reader has
    no such architecture): the check is skipped with a warning; the llama.cpp round trip is its proof."""
    reader_config: bool = True
    """transformers' GGUF reader lacks some of this family's config keys (qwen3's head_dim, MoE sizes): the
    read-back check passes the model's config. False: the reader rebuilds the whole config from the file."""
    # MoE families (gguf-moe): read by fastkit/export/gguf/moe.py
    renames: tuple[tuple[str, str], ...] = ()
    """``(regex, replacement)`` applied to a transformers tensor name before gguf-py's map, where the family names a
    tensor differently from the names gguf-py knows (GraniteMoe's ``block_sparse_moe.router`` is llama.cpp's
    ``ffn_gate_inp``; DeepSeek-V3's ``mlp.gate.e_score_correction_bias`` is ``exp_probs_b.bias``)."""
    buffers: tuple[str, ...] = ()
    """Buffers (last name component) written as tensors beside the parameters: DeepSeek-V3's / GLM-4.5's
    ``e_score_correction_bias``, llama.cpp's ``exp_probs_b`` (added to the router scores for the choice of experts
    only, ``build_moe_ffn`` in src/llama-graph.cpp)."""
    gating: str = ""
    """The router's score function written as ``expert_gating_func`` (``"softmax"`` / ``"sigmoid"``) for graphs that
    read it (src/models/deepseek2.cpp, glm4-moe.cpp); ``""``: the graph hard-codes it, nothing written."""
    dense_lead: str = ""
    """Config attribute counting the leading dense-MLP layers (DeepSeek / GLM-4.5 ``first_k_dense_replace``), or
    listing each layer's kind (GLM-4.7-Flash's ``mlp_layer_types``: ``"dense"`` ones must come first), written as
    ``leading_dense_block_count``: those layers have ``ffn_{gate,up,down}`` and no experts."""
    config_ints: tuple[tuple[str, str], ...] = ()
    """``(gguf-py writer method, config attribute)`` integer hyperparameters the graph reads
    (``add_expert_shared_count`` <- ``n_shared_experts``); ``"a·b"`` writes the product of two attributes (ERNIE 4.5's
    shared-expert width, ``moe_intermediate_size·moe_num_shared_experts``)."""
    moe_last: str = ""
    """Config attribute of the last MoE layer's index (ERNIE 4.5's ``moe_layer_end_index``): llama.cpp's graph has
    experts in every layer after the leading dense ones, through the last; a config ending them earlier is refused."""
    expert_groups: bool = False
    """llama.cpp's graph restricts routing to the best ``n_group_used`` of ``n_expert_groups`` groups, a group scored
    by the sum of its top-2 biased scores (DeepSeek-V3's ``noaux_tc``, ``build_moe_ffn``): ``n_group`` / ``topk_group``
    written when they restrict. False: a config restricting routing to groups is refused."""
    mla: bool = False
    """DeepSeek's multi-head latent attention as src/models/deepseek2.cpp absorbs it: ``kv_b_proj`` split per head
    into ``attn_k_b`` (its nope rows, transposed) and ``attn_v_b``, one KV head, key / value lengths of the latent
    (``kv_lora_rank + qk_rope_head_dim`` / ``kv_lora_rank``) and the heads' as ``key_length_mla`` /
    ``value_length_mla``, ``q_lora_rank`` (0: a plain ``q_proj``) and ``kv_lora_rank``."""
    fused_halves: tuple[tuple[str, str, str], ...] = ()
    """``(transformers module name suffix, llama.cpp tensor of the first half of its rows, of the second half)``: a
    fused linear split in two (GraniteMoeShared's ``shared_mlp.input_linear`` ``(2S, H)``, gate rows first, is
    ``ffn_gate_shexp`` and ``ffn_up_shexp``)."""
    mha_only: bool = False
    """The graph needs ``num_key_value_heads == num_attention_heads`` (src/models/olmoe.cpp: ``attn_k_norm`` is
    ``n_embd`` wide, transformers' ``k_norm`` spans the KV heads): grouped-query attention is refused."""
    fixed: tuple[tuple[str, Any], ...] = ()
    """``(config attribute, the only value llama.cpp's graph computes)``: a config with another value is refused
    naming the key; a missing attribute counts as that value. Mostly which biases the graph adds (``starcoder2.cpp``
    requires ``attn_output`` / ``ffn_*`` biases: ``use_bias`` True; ``ernie4-5.cpp``, ``olmo2.cpp``, ``cohere2.cpp``,
    ``smollm3.cpp`` have none), OLMoE's ``clip_qkv`` None (olmoe.cpp does not clamp), DeepSeek's biases off."""
    # dense families (gguf-dense)
    layer_norm_eps: str | float = ""
    """The graph's norms are LayerNorm (mean subtracted; a bias where the model has one: llama.cpp's ``LLM_NORM`` in
    ``starcoder2.cpp`` / ``cohere2.cpp``): the config attribute holding their epsilon, written as
    ``attention.layer_norm_epsilon``, or the number transformers hard-codes (OLMo's weightless LayerNorm: 1e-5,
    ``olmo.cpp``). ``""``: RMSNorm, ``config.rms_norm_eps`` as ``attention.layer_norm_rms_epsilon``."""
    no_rope_every: int = 0
    """The graph skips rope on every n-th layer (``smollm3.cpp``: ``n_no_rope_layer_step = 4``, layers 3, 7, ...):
    ``config.no_rope_layers`` must be that pattern (1 = rope). 0: no such rule."""
    windows_at_depth: int = 0
    """The graph turns sliding windows on, and rope off on the full-attention layers, for exactly this many layers
    and never otherwise (``exaone4.cpp``: 64, EXAONE 4.0 32B); transformers does both whenever
    ``config.sliding_window`` is set. A windowed config of another depth, or a window-less one of this depth, is
    refused. 0: no such rule."""
    swa_rope_global: bool = False
    """The graph ropes the windowed layers with the global base and no scaling (``olmo2.cpp`` passes ``freq_base``
    and scale 1 there, ignoring ``rope.freq_base_swa``): a per-layer-type config whose sliding layers' theta differs
    from the full layers' is refused."""
    # more dense families (gguf-more)
    config_optional: tuple[tuple[str, str], ...] = ()
    """``(gguf-py writer method, config attribute)`` float hyperparameters written only where the config sets them (not
    None): OLMo's ``clip_qkv`` as ``attention.clamp_kqv`` (llama-graph.cpp ``build_qkv`` clamps q, k and v)."""
    rope_optional: tuple[tuple[str, str], ...] = ()
    """``(gguf-py writer method, config.rope_parameters key)`` floats written where the rope sets them (Ministral 3:
    ``mscale_all_dim`` as ``rope.scaling.yarn_log_multiplier``, ``llama_4_scaling_beta`` as
    ``attention.temperature_scale``: src/models/mistral3.cpp scales queries by
    ``1 + beta·log(1 + floor(pos / n_ctx_orig))`` as transformers does)."""
    rope_fixed: tuple[tuple[str, Any], ...] = ()
    """``(config.rope_parameters key, the only value llama.cpp computes)``; another value is refused naming the key
    (src/llama-context.cpp takes YaRN's ``mscale`` as 1 outside deepseek2, and no ``attention_factor``)."""
    rope_sections: bool = False
    """Multi-axis rope (``qwen2vl``): ``config.rope_parameters["mrope_section"]`` padded to 4 written as
    ``rope.dimension_sections`` (src/models/qwen2vl.cpp: ``ggml_rope_multi``; text positions are the same on
    every axis, so a text prompt is plain rope)."""
    layer_arrays: tuple[tuple[str, str], ...] = ()
    """``(regex on a transformers parameter / buffer name, gguf-py writer method)``: one scalar per layer written as a
    metadata array over the layers instead of as tensors (Apertus's xIELU ``act_fn.alpha_p`` / ``alpha_n`` parameters
    and ``beta`` / ``eps`` buffers: src/models/apertus.cpp reads them per layer and applies the softplus itself)."""
    qkv_per_head: bool = False
    """A fused ``query_key_value`` whose rows are stored per head, ``(H, 3, D)`` (GPT-NeoX), reordered into llama.cpp's
    ``attn_qkv`` ``(3, H, D)``: every query row, then keys, then values (src/models/gptneox.cpp splits it so); its bias
    alike."""
    config_flags: tuple[tuple[str, str], ...] = ()
    """``(gguf-py writer method, config attribute)`` booleans the graph reads (GPT-NeoX's ``use_parallel_residual``:
    gptneox.cpp runs attention and MLP off the same input when set, one after the other when not)."""
    transposed: tuple[str, ...] = ()
    """llama.cpp tensor names (``attn_qkv``...) whose transformers weights are stored ``(in, out)`` (GPT-2's
    ``Conv1D``), written transposed to llama.cpp's ``(out, in)``."""
    ffn_length: str = ""
    """Config attribute of the MLP width where it is not ``intermediate_size`` (GPT-2's ``n_inner``; None there means
    4 x hidden, as transformers builds it), written as ``feed_forward_length``."""
    kv_heads: int = 0
    """The KV head count written where transformers does not read ``num_key_value_heads`` (GPT-BigCode's
    ``multi_query``: one shared key / value head, src/models/starcoder.cpp sizes ``attn_qkv`` from it); 0: the
    config's (all heads where it has none)."""
    # hybrid families (gguf-hybrid): read by fastkit/export/gguf/hybrid.py
    eps_attr: str = "rms_norm_eps"
    """Config attribute of the RMSNorm epsilon, written as ``attention.layer_norm_rms_epsilon`` (LFM2: ``norm_eps``)."""
    kv_heads_by_layer: tuple[str, str] = ()
    """``(config attribute listing each layer's kind, the kind that has attention)``: ``head_count_kv`` written per
    layer, 0 for the others, which is how llama.cpp marks a layer recurrent (src/models/lfm2.cpp ``load_arch_hparams``:
    ``is_recr_impl[il] = n_head_kv(il) == 0``; LFM2's ``layer_types``, ``"full_attention"`` vs ``"conv"``)."""
    recurrent_layers: tuple[str, str] = ()
    """``(config attribute listing each layer's kind, the recurrent kind)``: written as the per-layer bool array
    ``attention.recurrent_layers`` (src/models/qwen3next.cpp ``load_arch_hparams``; without it llama.cpp assumes
    every 4th layer attention, ``full_attention_interval``). Qwen3-Next's ``layer_types``, ``"linear_attention"``."""
    gated_delta: bool = False
    """Gated DeltaNet layers (``linear_attn``) as src/models/qwen3next.cpp reads them, as its converter writes them:
    ``in_proj_qkvz`` (per key head ``[q, k, v, z]``) split into ``attn_qkv`` (all q, all k, all v) and ``attn_gate``
    (z); ``in_proj_ba`` as ``ssm_ba``; the conv kernel ``(C, K)``; ``dt_bias`` as ``ssm_dt.bias``; ``A_log`` as
    ``ssm_a = -exp(A_log)``; the gated norm as ``ssm_norm`` (plain weight: no ``norm_shift``); ``out_proj`` as
    ``ssm_out``; and the SSM sizes (conv kernel, key head dim as state size, key heads as groups, value heads as
    time-step rank, value width as inner size)."""
    split_delta: bool = False
    """Qwen3.5's gated DeltaNet (src/models/qwen35.cpp, qwen35moe.cpp; :attr:`gated_delta`'s sizes and norms):
    separate ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a`` (``attn_qkv``, ``attn_gate``,
    ``ssm_beta``, ``ssm_alpha``), with the value heads reordered from grouped by key head (``[k0: v0 v1, k1: v0 v1]``)
    to tiled (``[k0 v0, k1 v0, k0 v1, k1 v1]``, how ggml broadcasts the key heads) in every tensor that has them:
    qkv's and the conv's value rows, z, b, a, ``A_log``, ``dt_bias`` and ``out_proj``'s columns; rope sections
    (``mrope_section``, llama.cpp's default [11, 11, 10]) as ``rope.dimension_sections``."""
    mamba2: bool = False
    """Mamba2 mixers (``mamba``) as src/models/mamba-base.cpp ``build_mamba2_layer`` reads them: ``A_log`` as
    ``ssm_a = -exp(A_log)`` and ``D`` as ``ssm_d``, both ``(heads, 1)``; ``dt_bias`` as ``ssm_dt.bias``; the conv
    kernel ``(C, K)``; the gated norm ``(d_inner,)`` as ``ssm_norm`` ``(groups, d_inner / groups)``; the SSM sizes
    (``mamba_d_conv``, ``mamba_d_state``, ``mamba_n_groups``, ``mamba_n_heads``, inner size heads x
    ``mamba_d_head``)."""
    zxbcdt: str = ""
    """Config attribute of the five zxBCdt multipliers (Falcon-H1's ``ssm_multipliers``, transformers' ``mup_vector``)
    folded into ``in_proj``'s row sections (z, x: ``mamba_d_ssm``; B, C: ``mamba_n_groups · mamba_d_state``; dt:
    ``mamba_n_heads``), as llama.cpp's converter folds them."""
    rope_switch: str = ""
    """Config attribute that turns rope on when ``"rope"`` (GraniteMoeHybrid's ``position_embedding_type``; None: no
    positional encoding), written as llama.cpp's ``rope.scaling.finetuned``, which granite-hybrid.cpp reads as that
    switch."""
    exact_names: tuple[tuple[str, str], ...] = ()
    """``(regex over the transformers name, llama.cpp's exact tensor name)`` for tensors llama.cpp names without the
    ``.weight`` suffix gguf-py's map would add (falcon-h1.cpp loads its pre-FFN norm as ``blk.N.ffn_norm``)."""
    weight_scales: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """``(llama.cpp tensor name suffix, config values)``: that tensor multiplied by the product of the values
    (``"attr"`` or ``"attr[i]"``), where transformers multiplies activations and llama.cpp's graph has no such scale
    (Falcon-H1's embedding / lm_head / attention in-out / key / SSM in-out / MLP multipliers, folded as its converter
    folds them)."""
    same: tuple[tuple[str, str], ...] = ()
    """``(config attribute, config attribute)`` pairs llama.cpp's graph takes as equal (Qwen3-Next: the linear
    attention's key and value head dims, both read from ``ssm.state_size``); a config where they differ is refused."""
    mamba2_module: str = "mamba"
    """Module name of the Mamba2 mixer in a layer (Nemotron-H's ``mixer``, which names its attention and MLP too)."""
    mamba2_sizes: tuple[str, str, str, str, str] = ("mamba_d_conv", "mamba_n_heads·mamba_d_head", "mamba_d_state",
                                                    "mamba_n_heads", "mamba_n_groups")
    """Config attributes (or products) of the Mamba2 conv kernel, inner size, state size, heads and groups, written
    as ``ssm.conv_kernel``, ``ssm.inner_size``, ``ssm.state_size``, ``ssm.time_step_rank``, ``ssm.group_count``
    (Nemotron-H: ``conv_kernel``, ``mamba_num_heads·mamba_head_dim``, ``ssm_state_size``, ``n_groups``)."""
    ffn_by_layer: tuple[str, str] = ()
    """``(config attribute listing each layer's kind, the kind that has the MLP)``: ``feed_forward_length`` written per
    layer, 0 for the others (src/models/nemotron-h.cpp: a layer is recurrent where both ``head_count_kv`` and
    ``feed_forward_length`` are 0, attention where only the latter is)."""
    layer_kinds: tuple[str, tuple[str, ...]] = ()
    """``(config attribute listing each layer's kind, the kinds the graph computes)``: a config with any other kind is
    refused naming the attribute (Nemotron-H's ``"moe"`` layers: llama.cpp's nemotron_h_moe, not written here), and
    the config's expert counts (defaults of a dense model) are not written."""
    ffn_auto_adjust: bool = False
    """The MLP width is not ``intermediate_size`` but Lfm2MLP's (``block_auto_adjust_ff_dim``: 2/3 of it, times
    ``block_ffn_dim_multiplier`` rounded up to ``block_multiple_of``), written as ``feed_forward_length`` (llama.cpp
    reads ``n_ff`` for its dense ``ffn_gate/up/down``)."""


READER_UNPERMUTES_QK = ("llama",)
"""The GGUF architectures whose q/k rows transformers' GGUF reader un-permutes on load (its ``reverse_permute_weights``
for ``llama``): a file's q/k read back in the rotate-half order whether or not the writer permuted them
(``permute_qk``), which :func:`fastkit.export.gguf.writer.read_back_view` follows."""


# ---- Rule sets several rows share (dense and MoE families). ----
GEMMA = dict(norm_shift=1.0, activation="gelu_pytorch_tanh", windows=True)
DEEPSEEK = dict(reader=False, mla=True, dense_lead="first_k_dense_replace", rope_types=("default", "yarn"),
                config_ints=(("add_expert_shared_count", "n_shared_experts"),),
                config_scales=(("add_expert_weights_scale", "routed_scaling_factor"),))
"""DeepSeek-V2 / V3 as llama.cpp's deepseek2 graph (src/models/deepseek2.cpp): absorbed MLA, leading dense layers,
shared experts (``n_shared_experts`` x the expert width), routed weights scaled by ``routed_scaling_factor``, YaRN
with its ``mscale_all_dim`` as ``rope.scaling.yarn_log_multiplier``."""
SELECTION_BIAS = dict(gating="sigmoid", router_renorm="config", expert_groups=True,
                      buffers=("e_score_correction_bias",),
                      renames=((r"\.e_score_correction_bias$", ".e_score_correction.bias"),))
"""DeepSeek-V3's router (GLM-4.5's too): sigmoid scores, a selection-only bias (``exp_probs_b``), groups scored by
their top-2, top-k renormalized when ``norm_topk_prob``."""
GRANITE_SCALES = (("add_embedding_scale", "embedding_multiplier"), ("add_residual_scale", "residual_multiplier"),
                  ("add_attention_scale", "attention_multiplier"), ("add_logit_scale", "logits_scaling"))
GRANITEMOE = GGUFRules(permute_qk=True, reader=False, router_renorm="always", experts_every_layer=True,
                       config_scales=GRANITE_SCALES, renames=((r"\.block_sparse_moe\.router\.", ".mlp.gate."),
                                                               (r"\.block_sparse_moe\.", ".mlp.")))
"""GraniteMoE as llama.cpp's granitemoe (src/models/granite.cpp's graph with experts, top-k renormalized)."""
PHIMOE_REFUSAL = ("llama.cpp's phimoe graph (src/models/phi3.cpp, build_moe_ffn) weighs the top-2 experts by a "
                  "softmax over all of them, renormalized (the two weights sum to 1); transformers' sparsemixer "
                  "gives each its own softmax over the experts within 2 x config.router_jitter_noise of it (both "
                  "1.0 for most tokens), which no value of router_jitter_noise turns into llama.cpp's; and its "
                  "norms are RMSNorm plus bias where Phimoe's are LayerNorm")
"""Why phimoe is refused though llama.cpp has an architecture for it: its graph routes (and norms) otherwise."""

# ---- Hybrid (stateful) families' rules (fastkit/export/gguf/hybrid.py). ----
NOT_YET = "llama.cpp's {arch} runs it; fastkit does not write its {what} yet"
"""Why a hybrid family llama.cpp runs is still refused (``ModelFacts.gguf_refusal``)."""
QWEN3_NEXT = GGUFRules(norm_shift=1.0, reader=False, router_renorm="always", experts_every_layer=True,
                       shared_expert=True, gated_delta=True, recurrent_layers=("layer_types", "linear_attention"),
                       same=(("linear_key_head_dim", "linear_value_head_dim"),),
                       fixed=(("attention_bias", False),))
"""Qwen3-Next as llama.cpp's qwen3next (src/models/qwen3next.cpp): norms x·(1 + w) but the DeltaNet's gated norm,
gated attention (q_proj's per-head [query, gate] halves, as llama.cpp splits them), softmax top-k renormalized, a
shared expert with its sigmoid gate, every layer MoE."""
QWEN3_5 = dataclasses.replace(QWEN3_NEXT, split_delta=True, router_renorm="either",
                              experts_every_layer=False, shared_expert=False)
"""Qwen3.5 (dense) as llama.cpp's qwen35: Qwen3-Next's DeltaNet with split projections and tiled value heads."""
QWEN3_5_MOE = dataclasses.replace(QWEN3_5, experts_every_layer=True, shared_expert=True)
"""Qwen3.5 MoE as llama.cpp's qwen35moe: top-k always renormalized (transformers' router too; no config key)."""
FALCON_H1 = GGUFRules(
    output="untied", mamba2=True, zxbcdt="ssm_multipliers", reader=False,
    exact_names=((r".*\.layers\.(\d+)\.pre_ff_layernorm\.weight", r"blk.\1.ffn_norm"),),
    same=(("mamba_d_ssm", "mamba_n_heads·mamba_d_head"),),
    weight_scales=(("token_embd.weight", ("embedding_multiplier",)), ("output.weight", ("lm_head_multiplier",)),
                   ("attn_q.weight", ("attention_in_multiplier",)),
                   ("attn_k.weight", ("attention_in_multiplier", "key_multiplier")),
                   ("attn_v.weight", ("attention_in_multiplier",)),
                   ("attn_output.weight", ("attention_out_multiplier",)), ("ssm_in.weight", ("ssm_in_multiplier",)),
                   ("ssm_out.weight", ("ssm_out_multiplier",)), ("ffn_gate.weight", ("mlp_multipliers[0]",)),
                   ("ffn_down.weight", ("mlp_multipliers[1]",))),
    fixed=(("mamba_rms_norm", False), ("mamba_proj_bias", False), ("projectors_bias", False), ("mlp_bias", False),
           ("attention_bias", False)))
"""Falcon-H1 as llama.cpp's falcon-h1 (src/models/falcon-h1.cpp): attention and a Mamba2 mixer in parallel on the
same normed input, every multiplier folded into the weights; its lm_head multiplier needs its own output tensor.
``mamba_rms_norm`` refused: llama.cpp gates before its grouped norm, transformers' Falcon-H1 norms first."""
GRANITE_HYBRID = dataclasses.replace(
    GRANITEMOE, mamba2=True, rope_switch="position_embedding_type",
    kv_heads_by_layer=("layer_types", "full_attention"),
    config_ints=(("add_expert_shared_feed_forward_length", "shared_intermediate_size"),),
    fused_halves=(("shared_mlp.input_linear", "ffn_gate_shexp", "ffn_up_shexp"),),
    same=(("mamba_expand·hidden_size", "mamba_n_heads·mamba_d_head"),),
    fixed=(("mamba_proj_bias", False), ("attention_bias", False)))
"""GraniteMoeHybrid (Granite 4.0-H) as llama.cpp's granitehybrid (src/models/granite-hybrid.cpp): Mamba2 layers
(0 KV heads) and attention layers, GraniteMoeShared's experts and multipliers, rope only where configured."""
NEMOTRON_H = GGUFRules(
    activation=None, output="either", reader=False, mamba2=True, mamba2_module="mixer",
    mamba2_sizes=("conv_kernel", "mamba_num_heads·mamba_head_dim", "ssm_state_size", "mamba_num_heads", "n_groups"),
    eps_attr="layer_norm_epsilon", config_scales=(("add_layer_norm_eps", "layer_norm_epsilon"),),
    renames=((r"^model\.layers\.(\d+)\.mixer\.", r"backbone.layers.\1.mixer."),),
    kv_heads_by_layer=("layers_block_type", "full_attention"), ffn_by_layer=("layers_block_type", "mlp"),
    layer_kinds=("layers_block_type", ("linear_attention", "full_attention", "mlp")),
    fixed=(("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu"), ("mamba_proj_bias", False),
           ("use_bias", False), ("mlp_bias", False), ("attention_bias", False), ("sliding_window", None),
           ("num_nextn_predict_layers", 0)))
"""Nemotron-H as llama.cpp's nemotron_h (src/models/nemotron-h.cpp): one mixer per layer, Mamba2 (0 KV heads, 0 FFN
length), attention without rope (0 FFN length) or a ReLU² MLP without gate (its width); the mixers' names as gguf-py
maps them (``backbone.layers.N.mixer``); the loader requires ``attention.layer_norm_epsilon``, the graph's RMSNorms
(the gated Mamba2 norm's too) read the RMS epsilon, both ``layer_norm_epsilon``. MoE layers refused."""
LFM2 = GGUFRules(activation=None, eps_attr="norm_eps", kv_heads_by_layer=("layer_types", "full_attention"),
                 ffn_auto_adjust=True, config_ints=(("add_shortconv_l_cache", "conv_L_cache"),),
                 fixed=(("conv_bias", False),))
"""LFM2 as llama.cpp's lfm2 (src/models/lfm2.cpp): conv layers are those with 0 KV heads; the conv's kernel length
(``conv_L_cache``) as ``shortconv.l_cache``; no biases in the conv block (its graph has none)."""
LFM2_MOE = dataclasses.replace(
    LFM2, ffn_auto_adjust=False, reader=False, gating="sigmoid", router_renorm="always",
    dense_lead="num_dense_layers", buffers=("expert_bias",),
    renames=((r"\.feed_forward\.experts\.", ".mlp.experts."),
             (r"\.feed_forward\.expert_bias$", ".feed_forward.expert_bias.bias")),
    fixed=(("conv_bias", False), ("use_expert_bias", True), ("routed_scaling_factor", 1.0)))
"""LFM2-MoE as llama.cpp's lfm2moe (src/models/lfm2moe.cpp, lfm2.cpp's blocks): leading dense layers, sigmoid router
with its selection bias (``expert_bias`` as ``exp_probs_b``, required by the graph), top-k always renormalized; its
loader reads no ``expert_weights_scale``, so a ``routed_scaling_factor`` other than 1 is refused; the dense MLP's width
is ``intermediate_size`` as is."""
