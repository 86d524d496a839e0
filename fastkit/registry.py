"""Per-model facts in one table: which fastkit patches apply to which ``model_type``.

Adding a model is adding a row, and a row is admitted only when the census (:mod:`fastkit.families.census`,
``tests/test_census.py``, ``docs/coverage.md``) proves it on a tiny twin: no row, no patch. A model type
that is not in the table is self-checked at load on a twin of its own config
(:func:`fastkit.families.census.self_check`):
patched only if it passes, else it loads unpatched and packed batches are refused, naming the check.
The patch implementations live in :mod:`fastkit.patches` (``packing/``, ``moe/``, ``offload/``);
:data:`PATCH_FACTORIES` names the load-time ones so this module imports none of them (they import the
patch names from here).
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Any

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


_GEMMA_GGUF = dict(norm_shift=1.0, activation="gelu_pytorch_tanh", windows=True)
_DEEPSEEK_GGUF = dict(reader=False, mla=True, dense_lead="first_k_dense_replace", rope_types=("default", "yarn"),
                      config_ints=(("add_expert_shared_count", "n_shared_experts"),),
                      config_scales=(("add_expert_weights_scale", "routed_scaling_factor"),))
"""DeepSeek-V2 / V3 as llama.cpp's deepseek2 graph (src/models/deepseek2.cpp): absorbed MLA, leading dense layers,
shared experts (``n_shared_experts`` x the expert width), routed weights scaled by ``routed_scaling_factor``, YaRN
with its ``mscale_all_dim`` as ``rope.scaling.yarn_log_multiplier``."""
_SELECTION_BIAS = dict(gating="sigmoid", router_renorm="config", expert_groups=True,
                       buffers=("e_score_correction_bias",),
                       renames=((r"\.e_score_correction_bias$", ".e_score_correction.bias"),))
"""DeepSeek-V3's router (GLM-4.5's too): sigmoid scores, a selection-only bias (``exp_probs_b``), groups scored by
their top-2, top-k renormalized when ``norm_topk_prob``."""
_GRANITE_SCALES = (("add_embedding_scale", "embedding_multiplier"), ("add_residual_scale", "residual_multiplier"),
                   ("add_attention_scale", "attention_multiplier"), ("add_logit_scale", "logits_scaling"))
_GRANITEMOE_GGUF = GGUFRules(permute_qk=True, reader=False, router_renorm="always", experts_every_layer=True,
                             config_scales=_GRANITE_SCALES, renames=((r"\.block_sparse_moe\.router\.", ".mlp.gate."),
                                                                     (r"\.block_sparse_moe\.", ".mlp.")))
"""GraniteMoE as llama.cpp's granitemoe (src/models/granite.cpp's graph with experts, top-k renormalized)."""


MROPE = "mrope"
"""Multi-axis rope (Qwen's): 3-D ``position_ids`` (time, height, width) from the image grid."""
ROPE_1D = "1d"
"""Ordinary 1-D positions: an image's tokens take consecutive positions like text."""


@dataclass(frozen=True)
class VisionFacts:
    """What fastkit knows about an image-text-to-text family (``AutoModelForImageTextToText`` + ``AutoProcessor``),
    each fact read by the loader, LoRA targeting, the data checks, the planner and the census of its twin."""

    tower: str
    """Module path of the vision tower inside the ``*ForConditionalGeneration`` model (``model.visual``)."""
    projector: str
    """Module path of the vision-to-text projector (inside the tower for Qwen: ``model.visual.merger``)."""
    language_model: str
    """Module path of the language model (the decoder LoRA targets by default)."""
    image_token: str
    """The token an image expands to, once per image feature (``<|image_pad|>``)."""
    image_token_key: str
    """The config key holding that token's id (``image_token_id`` / ``image_token_index``)."""
    image_part: str
    """What a chat template writes for one ``{"type": "image"}`` part before the processor expands it."""
    rope: str = ROPE_1D
    """:data:`MROPE` or :data:`ROPE_1D`. Packed rows of an mrope row get each document's 3-D rope positions computed
    as if it were alone (:mod:`fastkit.patches.packing.mrope`); 1-D rows restart their positions per document."""
    twin_tokens: tuple[tuple[str, str], ...] = ()
    """The twin tokenizer's added special tokens as ``(config key, token)``; key ``""``: no config key."""
    twin_tokenizer_attrs: tuple[tuple[str, str], ...] = ()
    """Attributes the family's processor reads off its tokenizer (Gemma 3's ``boi_token``), set on the twin's."""
    twin_vision: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    """The twin's ``vision_config`` overrides (a tower of a few thousand parameters)."""
    twin_top: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    """The twin's top-level config overrides (Gemma 3's ``mm_tokens_per_image``, Idefics3's ``scale_factor``)."""
    image_processor: str = ""
    """transformers' image processor class of the twin (the PIL one: no torchvision needed)."""
    twin_images: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    """That image processor's options on the twin (small images)."""
    processor: str = ""
    """transformers' processor class of the twin."""
    twin_processor: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    """That processor's options on the twin (image tokens per image)."""
    twin_text: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    """The twin's ``text_config`` overrides on top of the shrunk defaults."""
    packing_refusal: str = ""
    """Why packing is refused on this vision-language model although its positions are 1-D (shown in the banner;
    the model stays as it was)."""
    gguf_projector: str = ""
    """llama.cpp's projector type (clip-impl.h's ``PROJECTOR_TYPE`` name) :mod:`fastkit.export.gguf.mmproj` writes the
    vision tower + projector as (``"idefics3"``, ``"gemma3"``, ``"qwen2.5vl_merger"``, ``"qwen3vl_merger"``); ``""``:
    no mmproj, so ``save_gguf`` refuses the family (a text-only GGUF would drop the tuned vision)."""
    gguf_renames: tuple[tuple[str, str], ...] = ()
    """``(pattern, replacement)`` from the in-memory tensor names to the checkpoint names gguf's MMPROJ map knows
    (transformers 5 loads Gemma 3's tower flat)."""
    gguf_shell: str = ""
    """The transformers causal-LM class that hosts the language model for the text GGUF where
    ``AutoModelForCausalLM`` has none for its text config (Qwen2.5-VL's text model: ``Qwen2ForCausalLM``'s layers
    with mrope; :mod:`fastkit.export.gguf.mmproj`); ``""``: ``AutoModelForCausalLM``."""


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
_PHIMOE_REFUSAL = ("llama.cpp's phimoe graph (src/models/phi3.cpp, build_moe_ffn) weighs the top-2 experts by a "
                   "softmax over all of them, renormalized (the two weights sum to 1); transformers' sparsemixer "
                   "gives each its own softmax over the experts within 2 x config.router_jitter_noise of it (both "
                   "1.0 for most tokens), which no value of router_jitter_noise turns into llama.cpp's; and its "
                   "norms are RMSNorm plus bias where Phimoe's are LayerNorm")
"""Why phimoe is refused though llama.cpp has an architecture for it: its graph routes (and norms) otherwise."""

# ---- Image-text-to-text families (docs/vision.md; proof: tests/test_vision.py on their twins). ----
_TWIN_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
_TWIN_TEXT = dict(_ATTN, intermediate_size=128, num_hidden_layers=2, vocab_size=384, max_position_embeddings=32768)
_QWEN_TOKENS = (("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
                ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"))
_QWEN_MROPE = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}  # sums to head_dim / 2
_QWEN_VISION = dict(language_model="model.language_model", image_token="<|image_pad|>",
                    image_token_key="image_token_id", image_part="<|vision_start|><|image_pad|><|vision_end|>",
                    rope=MROPE, twin_tokens=_QWEN_TOKENS, image_processor="Qwen2VLImageProcessorPil")
_QWEN_MMPROJ_RENAMES = ((r"^model\.visual\.", "visual."),)
_QWEN2_5_VL_VISION = VisionFacts(
    tower="model.visual", projector="model.visual.merger", **_QWEN_VISION,
    twin_vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                     window_size=56, fullatt_block_indexes=[1]),
    twin_images=dict(patch_size=14, merge_size=2, size={"shortest_edge": 56 * 56, "longest_edge": 56 * 56}),
    processor="Qwen2_5_VLProcessor", twin_text=dict(_TWIN_TEXT, rope_parameters=_QWEN_MROPE),
    gguf_projector="qwen2.5vl_merger", gguf_renames=_QWEN_MMPROJ_RENAMES, gguf_shell="Qwen2ForCausalLM")
_QWEN3_VL_VISION = VisionFacts(
    tower="model.visual", projector="model.visual.merger", **_QWEN_VISION,
    twin_vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
                     num_position_embeddings=16, deepstack_visual_indexes=[0]),
    twin_images=dict(patch_size=16, merge_size=2, size={"shortest_edge": 64 * 64, "longest_edge": 64 * 64}),
    processor="Qwen3VLProcessor",
    twin_text=dict(_TWIN_TEXT, rope_parameters=dict(_QWEN_MROPE, mrope_interleaved=True)),
    gguf_projector="qwen3vl_merger", gguf_renames=_QWEN_MMPROJ_RENAMES, gguf_shell="Qwen3ForCausalLM")
_GEMMA3_VISION = VisionFacts(
    tower="model.vision_tower", projector="model.multi_modal_projector", language_model="model.language_model",
    image_token="<image_soft_token>", image_token_key="image_token_index", image_part="<start_of_image>",
    twin_tokens=(("boi_token_index", "<start_of_image>"), ("image_token_index", "<image_soft_token>"),
                 ("eoi_token_index", "<end_of_image>")),
    twin_tokenizer_attrs=(("boi_token", "<start_of_image>"), ("image_token", "<image_soft_token>"),
                          ("eoi_token", "<end_of_image>")),
    twin_vision=dict(_TWIN_VISION, image_size=28, patch_size=14, vision_use_head=False),
    twin_top=dict(mm_tokens_per_image=4),
    image_processor="Gemma3ImageProcessorPil", twin_images=dict(size={"height": 28, "width": 28}),
    processor="Gemma3Processor", twin_processor=dict(image_seq_length=4),
    packing_refusal="an image's tokens attend to each other bidirectionally (token_type_ids, Gemma 3's mask "
                    "function), which fastkit's per-document causal kernels do not express; packed batches are "
                    "refused, padded batches train as usual",
    twin_text=dict(_TWIN_TEXT, query_pre_attn_scalar=16, sliding_window=8,
                   layer_types=["sliding_attention", "full_attention"]),
    gguf_projector="gemma3", gguf_renames=((r"^model\.vision_tower\.", "vision_tower.vision_model."),
                                           (r"^model\.multi_modal_projector\.", "multi_modal_projector."),
                                           (r"_weight$", ".weight")))
_IDEFICS3_VISION = VisionFacts(
    tower="model.vision_model", projector="model.connector", language_model="model.text_model",
    image_token="<image>", image_token_key="image_token_id", image_part="<image>",
    twin_tokens=(("", "<fake_token_around_image>"), ("image_token_id", "<image>"), ("", "<end_of_utterance>"),
                 ("", "<global-img>")),
    twin_vision=dict(_TWIN_VISION, image_size=64, patch_size=16), twin_top=dict(scale_factor=2),
    image_processor="Idefics3ImageProcessorPil",
    twin_images=dict(do_image_splitting=False, size={"longest_edge": 64}, max_image_size={"longest_edge": 64}),
    processor="Idefics3Processor", twin_processor=dict(image_seq_len=4),
    twin_text=dict(_TWIN_TEXT, tie_word_embeddings=False), gguf_projector="idefics3")
"""SmolVLM (v1: model_type idefics3) and SmolVLM2 (smolvlm): one layout. The smolvlm twin's processor is
Idefics3Processor (the same prompt for an unsplit image; SmolVLMProcessor needs num2words and a torchvision
video processor)."""

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
                   gguf_arch="deepseek2", gguf=GGUFRules(**_DEEPSEEK_GGUF, **_SELECTION_BIAS,
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
                   gguf=GGUFRules(**_DEEPSEEK_GGUF, gating="softmax",  # (norm_topk_prob unread): llama.cpp's default
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
                   gguf=GGUFRules(**_GEMMA_GGUF, attn_softcap="required", final_softcap="required",
                                  query_scale_wide_at=46, output="tied")),
        ModelFacts("gemma3_text", sliding_window=True, gguf_arch="gemma3",
                   gguf=GGUFRules(**_GEMMA_GGUF, final_softcap="optional", rope_by_layer_type=True,
                                  rope_types=("default", "linear"), query_scale_wide_at=62)),
        ModelFacts("gemma3", sliding_window=True, text_config="text_config", text_keys=_TEXT_KEYS,
                   vision=_GEMMA3_VISION,  # GGUF: text + mmproj (export/gguf/mmproj.py)
                   note="composite checkpoint (vision + text): fastkit loads and trains the text model only, "
                        "unless vision=True"),
        ModelFacts("glm"),
        ModelFacts("glm4", gguf_arch="glm4",  # fused gate_up_proj, post-norms, partial interleaved rope
                   gguf=GGUFRules(reader=False)),
        ModelFacts("glm4_moe", moe=True, gguf_arch="glm4moe",  # glm4-moe.cpp: q/k norms, qkv biases optional
                   gguf=GGUFRules(**_SELECTION_BIAS, reader=False, dense_lead="first_k_dense_replace",
                                  config_ints=(("add_expert_shared_count", "n_shared_experts"),),
                                  config_scales=(("add_expert_weights_scale", "routed_scaling_factor"),))),
        ModelFacts("glm4_moe_lite", mla=True, moe=True, gguf_arch="deepseek2",  # GLM-4.7-Flash: V3's MLA and router
                   gguf=GGUFRules(**dict(_DEEPSEEK_GGUF, dense_lead="mlp_layer_types"), **_SELECTION_BIAS,
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
                                                                  config_scales=_GRANITE_SCALES)),
        ModelFacts("granite_swa", sliding_window=True, attention_sinks=True, default_attn="eager"),
        ModelFacts("granitemoe", moe=True, gguf_arch="granitemoe",  # granite.cpp's graph with experts: top-k softmax
                   gguf=_GRANITEMOE_GGUF),
        ModelFacts("granitemoe_swa", sliding_window=True, attention_sinks=True, moe=True, default_attn="eager"),
        ModelFacts("granitemoeshared", moe=True, gguf_arch="granitemoe",  # granite.cpp's shared expert (n_ff_shexp)
                   gguf=dataclasses.replace(_GRANITEMOE_GGUF, config_ints=(
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
        ModelFacts("phimoe", moe=True, gguf_refusal=_PHIMOE_REFUSAL),
        ModelFacts("sarvam_mla", mla=True, moe=True),
        ModelFacts("sarvam_moe", moe=True),
        ModelFacts("seed_oss", gguf_arch="seed_oss",  # seed-oss.cpp: q/k/v biases optional, none on o_proj / MLP
                   gguf=GGUFRules(reader=False, fixed=(("attention_out_bias", False), ("mlp_bias", False)))),
        ModelFacts("smollm3", gguf_arch="smollm3", gguf=GGUFRules(
            permute_qk=True, no_rope_every=4, fixed=(("attention_bias", False), ("mlp_bias", False)),
            reader=False)),
        ModelFacts("solar_open", moe=True, gguf_arch="glm4moe",  # glm4-moe.cpp: MoE in every layer, V3's router
                   gguf=GGUFRules(**_SELECTION_BIAS, reader=False,
                                  config_ints=(("add_expert_shared_count", "n_shared_experts"),),
                                  config_scales=(("add_expert_weights_scale", "routed_scaling_factor"),))),
        ModelFacts("starcoder2", gguf_arch="starcoder2",  # LayerNorm + biases, gelu MLP without gate
                   gguf=GGUFRules(activation="gelu_pytorch_tanh", layer_norm_eps="norm_epsilon",
                                  fixed=(("use_bias", True),))),
        ModelFacts("vaultgemma", sliding_window=True, softcap=True, default_attn="eager"),
        ModelFacts("youtu", mla=True),
        ModelFacts("qwen2_5_vl", vision=_QWEN2_5_VL_VISION, note="vision-language: mrope (3-D positions)",
                   gguf_text=ModelFacts("qwen2_5_vl_text", gguf_arch="qwen2vl",  # text + mmproj (export/gguf/mmproj.py)
                                        gguf=GGUFRules(rope_sections=True, reader=False,  # sections in order
                                                       rope_fixed=(("mrope_interleaved", False),)))),
        ModelFacts("qwen3_vl", vision=_QWEN3_VL_VISION, note="vision-language: mrope (3-D positions)",
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
            _QWEN3_VL_VISION, twin_text=dict(_QWEN3_VL_VISION.twin_text, moe_intermediate_size=32, num_experts=4,
                                             num_experts_per_tok=2, decoder_sparse_step=1),
            gguf_shell="Qwen3MoeForCausalLM")),
        ModelFacts("idefics3", vision=_IDEFICS3_VISION, note="vision-language (SmolVLM)"),  # GGUF: text + mmproj
        ModelFacts("smolvlm", vision=_IDEFICS3_VISION, note="vision-language (SmolVLM2)"),  # (export/gguf/mmproj.py)
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
_NOT_YET = "llama.cpp's {arch} runs it; fastkit does not write its {what} yet"
"""Why a hybrid family llama.cpp runs is still refused (``ModelFacts.gguf_refusal``)."""
_QWEN3_NEXT_GGUF = GGUFRules(norm_shift=1.0, reader=False, router_renorm="always", experts_every_layer=True,
                             shared_expert=True, gated_delta=True, recurrent_layers=("layer_types", "linear_attention"),
                             same=(("linear_key_head_dim", "linear_value_head_dim"),),
                             fixed=(("attention_bias", False),))
"""Qwen3-Next as llama.cpp's qwen3next (src/models/qwen3next.cpp): norms x·(1 + w) but the DeltaNet's gated norm,
gated attention (q_proj's per-head [query, gate] halves, as llama.cpp splits them), softmax top-k renormalized, a
shared expert with its sigmoid gate, every layer MoE."""
_QWEN3_5_GGUF = dataclasses.replace(_QWEN3_NEXT_GGUF, split_delta=True, router_renorm="either",
                                    experts_every_layer=False, shared_expert=False)
"""Qwen3.5 (dense) as llama.cpp's qwen35: Qwen3-Next's DeltaNet with split projections and tiled value heads."""
_QWEN3_5_MOE_GGUF = dataclasses.replace(_QWEN3_5_GGUF, experts_every_layer=True, shared_expert=True)
"""Qwen3.5 MoE as llama.cpp's qwen35moe: top-k always renormalized (transformers' router too; no config key)."""
_FALCON_H1_GGUF = GGUFRules(
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
_GRANITE_HYBRID_GGUF = dataclasses.replace(
    _GRANITEMOE_GGUF, mamba2=True, rope_switch="position_embedding_type",
    kv_heads_by_layer=("layer_types", "full_attention"),
    config_ints=(("add_expert_shared_feed_forward_length", "shared_intermediate_size"),),
    fused_halves=(("shared_mlp.input_linear", "ffn_gate_shexp", "ffn_up_shexp"),),
    same=(("mamba_expand·hidden_size", "mamba_n_heads·mamba_d_head"),),
    fixed=(("mamba_proj_bias", False), ("attention_bias", False)))
"""GraniteMoeHybrid (Granite 4.0-H) as llama.cpp's granitehybrid (src/models/granite-hybrid.cpp): Mamba2 layers
(0 KV heads) and attention layers, GraniteMoeShared's experts and multipliers, rope only where configured."""
_NEMOTRON_H_GGUF = GGUFRules(
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
_LFM2_GGUF = GGUFRules(activation=None, eps_attr="norm_eps", kv_heads_by_layer=("layer_types", "full_attention"),
                       ffn_auto_adjust=True, config_ints=(("add_shortconv_l_cache", "conv_L_cache"),),
                       fixed=(("conv_bias", False),))
"""LFM2 as llama.cpp's lfm2 (src/models/lfm2.cpp): conv layers are those with 0 KV heads; the conv's kernel length
(``conv_L_cache``) as ``shortconv.l_cache``; no biases in the conv block (its graph has none)."""
_LFM2_MOE_GGUF = dataclasses.replace(
    _LFM2_GGUF, ffn_auto_adjust=False, reader=False, gating="sigmoid", router_renorm="always",
    dense_lead="num_dense_layers", buffers=("expert_bias",),
    renames=((r"\.feed_forward\.experts\.", ".mlp.experts."),
             (r"\.feed_forward\.expert_bias$", ".feed_forward.expert_bias.bias")),
    fixed=(("conv_bias", False), ("use_expert_bias", True), ("routed_scaling_factor", 1.0)))
"""LFM2-MoE as llama.cpp's lfm2moe (src/models/lfm2moe.cpp, lfm2.cpp's blocks): leading dense layers, sigmoid router
with its selection bias (``expert_bias`` as ``exp_probs_b``, required by the graph), top-k always renormalized; its
loader reads no ``expert_weights_scale``, so a ``routed_scaling_factor`` other than 1 is refused; the dense MLP's width
is ``intermediate_size`` as is."""
MODEL_TABLE.update({f.model_type: f for f in [
    ModelFacts("qwen3_5_text", gguf_arch="qwen35", gguf=_QWEN3_5_GGUF,
               stateful=("Qwen3_5GatedDeltaNet",), varlen="gated_delta", note=_GDN,
               twin=dict(_ATTN, **_LIN, intermediate_size=128)),
    ModelFacts("qwen3_5_moe_text", gguf_arch="qwen35moe", gguf=_QWEN3_5_MOE_GGUF,
               stateful=("Qwen3_5MoeGatedDeltaNet",), varlen="gated_delta", moe=True, note=_GDN,
               twin=dict(_ATTN, **_LIN, **_MOE4, shared_expert_intermediate_size=32)),
    ModelFacts("qwen3_next", gguf_arch="qwen3next", gguf=_QWEN3_NEXT_GGUF,
               stateful=("Qwen3NextGatedDeltaNet",), varlen="gated_delta", moe=True, note=_GDN,
               twin=dict(_ATTN, **_LIN, **_MOE4, intermediate_size=128, shared_expert_intermediate_size=32)),
    ModelFacts("lfm2", stateful=("Lfm2ShortConv",), varlen="short_conv", note=_CONV,
               gguf_arch="lfm2", gguf=_LFM2_GGUF,  # src/models/lfm2.cpp: short conv (B·x, conv, C·) + attention
               twin=dict(_ATTN, intermediate_size=128, layer_types=["conv", "full_attention"], conv_L_cache=3)),
    ModelFacts("lfm2_moe", gguf_arch="lfm2moe", gguf=_LFM2_MOE_GGUF,
               stateful=("Lfm2MoeShortConv",), varlen="short_conv", moe=True, note=_CONV,
               twin=dict(_ATTN, **_MOE4, intermediate_size=128, num_dense_layers=1,
                         layer_types=["conv", "full_attention"])),
    ModelFacts("falcon_h1", gguf_arch="falcon-h1", gguf=_FALCON_H1_GGUF,
               stateful=("FalconH1Mixer",), varlen="mamba2", note=_MAMBA,
               default_lora_targets=_ATTN_MLP_TARGETS,
               twin=dict(_ATTN, intermediate_size=128, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
                         mamba_d_state=8, mamba_chunk_size=8, mamba_n_groups=1)),
    ModelFacts("jamba", gguf_refusal=_NOT_YET.format(arch="jamba", what="Mamba layers"),
               stateful=("JambaMambaMixer",), moe=True, note=_MAMBA,
               # all-linear less dt_proj: JambaMambaMixer multiplies by dt_proj.weight itself (never calls the
               # module, unless quantized), so a LoRA there would never train (tests/test_moe_lora.py)
               default_lora_targets=(*_ATTN_MLP_TARGETS, "in_proj", "x_proj", "out_proj"),
               twin=dict(_ATTN, intermediate_size=128, attn_layer_period=2, attn_layer_offset=1,
                         expert_layer_period=2, expert_layer_offset=1, num_experts=4, num_experts_per_tok=2,
                         mamba_d_state=8, mamba_dt_rank=8)),
    ModelFacts("granitemoehybrid", gguf_arch="granitehybrid", gguf=_GRANITE_HYBRID_GGUF,
               stateful=("GraniteMoeHybridMambaLayer",), varlen="mamba2", moe=True, note=_MAMBA,
               twin=dict(_ATTN, **_MAMBA2, intermediate_size=32, layer_types=["mamba", "attention"],
                         num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=32)),
    ModelFacts("nemotron_h", gguf_arch="nemotron_h", gguf=_NEMOTRON_H_GGUF,
               stateful=("NemotronHMamba2Mixer",), varlen="mamba2", note=_MAMBA,
               default_lora_targets=_ATTN_MLP_TARGETS,
               twin=dict(_ATTN, intermediate_size=128, layers_block_type=["mamba", "attention"], mamba_num_heads=4,
                         mamba_head_dim=16, ssm_state_size=8, n_groups=1, chunk_size=8)),
    ModelFacts("bamba", gguf_refusal=_NOT_YET.format(arch="granitehybrid", what="Mamba2 layers"),
               stateful=("BambaMixer",), varlen="mamba2", note=_MAMBA,
               twin=dict(_ATTN, **_MAMBA2, intermediate_size=128, attn_layer_indices=[1])),
    ModelFacts("zamba2", gguf_refusal="llama.cpp has no architecture for Zamba2",
               stateful=("Zamba2MambaMixer",), varlen="mamba2", note=_MAMBA,
               twin=dict(_ATTN, intermediate_size=128, layers_block_type=["mamba", "hybrid"], hybrid_layer_ids=[1],
                         mamba_d_state=8, mamba_headdim=16, n_mamba_heads=8, chunk_size=8, num_mem_blocks=1,
                         attention_head_dim=32)),
    ModelFacts("kimi_linear", gguf_refusal=_NOT_YET.format(arch="kimi-linear", what="Kimi delta attention"),
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
