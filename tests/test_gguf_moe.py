"""save_gguf for the MoE / MLA families beyond Qwen / Mixtral / GPT-OSS (olmoe, granitemoe, deepseek_v2, deepseek_v3,
glm4_moe, ernie4_5_moe...): the file's tensors and metadata as llama.cpp's graphs read them, and what those graphs
cannot compute refused before anything is written. transformers' GGUF reader has none of these architectures (their
``GGUFRules.reader`` is False); the real llama.cpp round trip of each is in tests/test_llamacpp_round_trip.py
(tests/gguf_round_trip.py rows).
"""

from __future__ import annotations

import gguf
import pytest
import torch

from fastkit import FastkitError, registry
from fastkit.export.gguf import moe as gguf_moe
from fastkit.export.gguf.writer import merged_parameters, write_gguf
from fastkit.families.twins import twin, twin_bpe_tokenizer
from tests import gguf_round_trip as rt

FAMILIES = [label for label in rt.ROUTER_STD if not rt.TWINS[label][0].startswith("lfm2")]
"""Every MoE family of tests/gguf_round_trip.py with its experts under ``mlp`` (or GraniteMoe's ``block_sparse_moe``);
LFM2-MoE's sit under ``feed_forward``, its layout is tests/test_gguf_hybrid.py's."""


def _model(label: str):
    """The round trip's twin of ``label`` (routers drawn wide, zero-initialized tensors drawn), untrained."""
    model_type, overrides, _ = rt.TWINS[label]
    model = twin(model_type, **overrides)
    rt._draw_zeros(model)
    rt._draw_routers(model, rt.ROUTER_STD[label])
    return model.eval()


def _tensors(path: str) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def _value(t) -> torch.Tensor:
    return torch.from_numpy(t.data.copy()).float()  # torch order (GGUF dims reversed)


@pytest.mark.parametrize("label", FAMILIES)
def test_tensors_are_llama_cpp_layout(tmp_path, label):
    """f16: every expert split into ffn_{gate,up,down}_exps (gate rows first), MLA's kv_b_proj as attn_k_b (transposed)
    / attn_v_b, the selection bias as exp_probs_b, dense leading layers without experts; routers, norms and the bias
    bit-exact in f32."""
    model = _model(label)
    config = model.config
    tensors = _tensors(write_gguf(model, twin_bpe_tokenizer("gpt-2"), tmp_path, quantization="f16"))
    merged = {name.replace("block_sparse_moe.router", "mlp.gate").replace("block_sparse_moe", "mlp"): load()
              for name, load, _ in merged_parameters(model)}
    rules = registry.MODEL_TABLE[config.model_type].gguf
    lead = gguf_moe.dense_lead(config, rules)
    assert lead == (1 if rules.dense_lead else 0)  # the twins with dense layers have one
    for i in range(config.num_hidden_layers):
        kinds = {n.split(".")[2] for n in tensors if n.startswith(f"blk.{i}.ffn")}
        if i < lead:
            assert kinds >= {"ffn_gate", "ffn_up", "ffn_down"} and not kinds & {"ffn_gate_exps", "ffn_gate_inp"}, kinds
            continue
        gate_up, down = merged[f"model.layers.{i}.mlp.experts.gate_up_proj"], merged[
            f"model.layers.{i}.mlp.experts.down_proj"]
        half = gate_up.shape[1] // 2  # (E, 2I, H): gate rows, then up rows
        for name, want in ((f"blk.{i}.ffn_gate_exps.weight", gate_up[:, :half]),
                           (f"blk.{i}.ffn_up_exps.weight", gate_up[:, half:]),
                           (f"blk.{i}.ffn_down_exps.weight", down)):
            assert torch.equal(_value(tensors[name]), want.half().float()), name
        router = tensors[f"blk.{i}.ffn_gate_inp.weight"]
        assert router.tensor_type == gguf.GGMLQuantizationType.F32
        assert torch.equal(_value(router), merged[f"model.layers.{i}.mlp.gate.weight"])
        bias = next((b for n, b in [*model.named_buffers(), *model.named_parameters()]  # ERNIE's: a parameter
                     if n.startswith(f"model.layers.{i}.") and n.endswith("e_score_correction_bias")), None)
        assert bias is not None or not rules.buffers  # mlp.gate's, mlp's (MiniMax-M2), mlp.gate.moe_statics' (ERNIE)
        assert (f"blk.{i}.exp_probs_b.bias" in tensors) == (bias is not None)
        if bias is not None:  # ERNIE's (1, E) as llama.cpp's (E,)
            assert bias.abs().max() > 0
            assert torch.equal(_value(tensors[f"blk.{i}.exp_probs_b.bias"]), bias.detach().flatten())
        if getattr(config, "kv_lora_rank", None):
            _assert_mla_split(tensors, merged, config, i)
        if getattr(config, "shared_intermediate_size", None):  # (2S, H): gate rows, then up rows
            fused = merged[f"model.layers.{i}.shared_mlp.input_linear.weight"].half().float()
            assert torch.equal(_value(tensors[f"blk.{i}.ffn_gate_shexp.weight"]), fused[: fused.shape[0] // 2])
            assert torch.equal(_value(tensors[f"blk.{i}.ffn_up_shexp.weight"]), fused[fused.shape[0] // 2:])


def _assert_mla_split(tensors, merged, config, i: int) -> None:
    """attn_k_b (H, rank, nope) and attn_v_b (H, v, rank) put back together are kv_b_proj (H·(nope+v), rank)."""
    k_b, v_b = _value(tensors[f"blk.{i}.attn_k_b.weight"]), _value(tensors[f"blk.{i}.attn_v_b.weight"])
    heads, rank = config.num_attention_heads, config.kv_lora_rank
    assert k_b.shape == (heads, rank, config.qk_nope_head_dim) and v_b.shape == (heads, config.v_head_dim, rank)
    kv_b = torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, rank)  # (H·(nope+v), rank)
    assert torch.equal(kv_b, merged[f"model.layers.{i}.self_attn.kv_b_proj.weight"].half().float())
    assert f"blk.{i}.attn_kv_b.weight" not in tensors


def test_q8_0_keeps_what_llama_cpp_quantizer_keeps():
    """As llama.cpp's llama-quant.cpp: routers (ffn_gate_inp), norms, the selection bias and 1-D tensors stay f32;
    2-D / 3-D weights whose rows are whole 32-value blocks are q8_0 (MLA's attn_k_b / attn_v_b included)."""
    import tempfile

    model = _model("deepseek_v3 (gpt-2)")
    with tempfile.TemporaryDirectory() as tmp:
        tensors = _tensors(write_gguf(model, twin_bpe_tokenizer("gpt-2"), tmp, quantization="q8_0"))
    kept = {n for n, t in tensors.items() if t.tensor_type == gguf.GGMLQuantizationType.F32}
    assert {"blk.1.ffn_gate_inp.weight", "blk.1.exp_probs_b.bias", "blk.1.attn_kv_a_norm.weight",
            "blk.1.attn_q_a_norm.weight"} <= kept
    assert all("gate_inp" in n or "norm" in n or n.endswith(".bias") for n in kept), kept
    for name in ("blk.1.attn_k_b.weight", "blk.1.attn_v_b.weight", "blk.1.ffn_gate_exps.weight",
                 "blk.1.attn_kv_a_mqa.weight", "blk.0.ffn_down.weight"):
        assert tensors[name].tensor_type == gguf.GGMLQuantizationType.Q8_0, name


def test_metadata_states_the_routing_and_mla(tmp_path):
    """DeepSeek-V3: sigmoid gating, renormalized top-k x routed_scaling_factor, 2 groups with 1 used, one dense layer,
    a shared expert, MLA's latent as one KV head; V2: softmax, no renormalization, no groups; V2-Lite: q_lora_rank 0."""
    tok = twin_bpe_tokenizer("gpt-2")
    fields = gguf.GGUFReader(write_gguf(_model("deepseek_v3 (gpt-2)"), tok, tmp_path / "v3", "f16")).fields
    got = {k.removeprefix("deepseek2."): fields[k].contents() for k in fields if k.startswith("deepseek2.")}
    assert got["expert_gating_func"] == gguf.ExpertGatingFuncType.SIGMOID and got["expert_weights_norm"] is True
    assert got["expert_weights_scale"] == 2.5 and got["expert_group_count"] == 2 and got["expert_group_used_count"] == 1
    assert got["leading_dense_block_count"] == 1 and got["expert_shared_count"] == 1
    assert (got["attention.head_count_kv"], got["attention.key_length"], got["attention.value_length"]) == (1, 40, 32)
    assert (got["attention.key_length_mla"], got["attention.value_length_mla"], got["rope.dimension_count"]) == \
        (40, 32, 8)
    assert (got["attention.q_lora_rank"], got["attention.kv_lora_rank"]) == (32, 32)
    fields = gguf.GGUFReader(write_gguf(_model("deepseek_v2 (gpt-2)"), tok, tmp_path / "v2", "f16")).fields
    assert fields["deepseek2.expert_gating_func"].contents() == gguf.ExpertGatingFuncType.SOFTMAX
    assert fields["deepseek2.expert_weights_scale"].contents() == 2.0
    assert "deepseek2.expert_weights_norm" not in fields and "deepseek2.expert_group_count" not in fields
    fields = gguf.GGUFReader(write_gguf(_model("deepseek_v2 (q_proj, yarn, as V2-Lite)"), tok, tmp_path / "lite",
                                        "f16")).fields
    assert fields["deepseek2.attention.q_lora_rank"].contents() == 0
    assert fields["deepseek2.rope.scaling.type"].contents() == "yarn"
    assert fields["deepseek2.rope.scaling.factor"].contents() == 40.0
    assert abs(fields["deepseek2.rope.scaling.yarn_log_multiplier"].contents() - 0.0707) < 1e-6  # 0.1 x mscale_all_dim
    fields = gguf.GGUFReader(write_gguf(_model("granitemoeshared (gpt-2)"), tok, tmp_path / "gm", "f16")).fields
    assert fields["granitemoe.embedding_scale"].contents() == 4.0 and fields["granitemoe.logit_scale"].contents() == 2.0
    assert fields["granitemoe.expert_shared_feed_forward_length"].contents() == 64


def test_ernie4_5_moe_keys(tmp_path):
    """ERNIE-4.5 MoE: the dense lead, the MoE step and the shared experts' width (moe_intermediate_size x
    moe_num_shared_experts) as src/models/ernie4-5.cpp reads them; the (1, E) selection bias flattened, f32; no
    shared-expert width or tensors without shared experts."""
    tok = twin_bpe_tokenizer("gpt-2")
    model = _model("ernie4_5_moe (gpt-2)")
    path = write_gguf(model, tok, tmp_path / "a", "f16")
    fields = gguf.GGUFReader(path).fields
    got = {k.removeprefix("ernie4_5-moe."): fields[k].contents() for k in fields if k.startswith("ernie4_5-moe.")}
    assert (got["leading_dense_block_count"], got["interleave_moe_layer_step"]) == (1, 1)
    assert (got["expert_feed_forward_length"], got["expert_shared_feed_forward_length"]) == (32, 64)
    assert (got["expert_count"], got["expert_used_count"]) == (8, 2)
    bias = _tensors(path)["blk.1.exp_probs_b.bias"]
    assert bias.tensor_type == gguf.GGMLQuantizationType.F32 and list(bias.shape) == [8]
    want = model.model.layers[1].mlp.gate.moe_statics.e_score_correction_bias.detach().flatten()
    assert torch.equal(_value(bias), want)
    path = write_gguf(twin("ernie4_5_moe", moe_num_shared_experts=0), tok, tmp_path / "b", "f16")
    assert gguf.GGUFReader(path).fields["ernie4_5-moe.expert_shared_feed_forward_length"].contents() == 0
    assert not [n for n in _tensors(path) if "shexp" in n]


def test_what_their_graphs_cannot_compute_is_refused(tmp_path):
    """Refused before any work, naming the key: OLMoE with grouped-query attention (llama.cpp's k norm spans all
    heads) or clip_qkv; GLM-4.7-Flash with a dense layer after a MoE one; DeepSeek-V2's group_limited_greedy
    (llama.cpp scores a group by its top-2 sum), biases; DeepSeek with rope_interleave False, YaRN whose mscale differs
    from mscale_all_dim (llama.cpp assumes them equal), other rope types; OLMoE's renormalization rule; ERNIE-4.5 MoE
    with dense layers between MoE ones (moe_layer_interval), experts ending before the last layer, or biases."""
    tok, out = twin_bpe_tokenizer("gpt-2"), tmp_path / "out"
    mla = dict(rt._MLA)
    cases = [
        (twin("olmoe"), "num_key_value_heads=2"),
        (twin("olmoe", num_key_value_heads=4, clip_qkv=8.0), "config.clip_qkv=8.0"),
        (twin("olmoe", num_key_value_heads=4, norm_topk_prob=True), "olmoe never renormalizes"),
        (twin("deepseek_v2", **mla, topk_method="group_limited_greedy", n_group=2, topk_group=1),
         "topk_method='group_limited_greedy'"),
        (twin("deepseek_v2", **mla, attention_bias=True), "config.attention_bias=True"),
        (twin("deepseek_v3", **mla, rope_interleave=False), "config.rope_interleave=False"),
        (twin("glm4_moe_lite", **mla, mlp_layer_types=["sparse", "dense", "sparse"]), "only before the first MoE"),
        (twin("deepseek_v3", **mla, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                                      "original_max_position_embeddings": 64}), "YaRN rope"),
        (twin("deepseek_v2", **mla, rope_parameters=dict(rt._yarn(0.707), mscale=1.0)), "'mscale': 1.0"),
        (twin("deepseek_v3", **mla, rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}),
         "rope types default, yarn"),
        (twin("ernie4_5_moe", num_hidden_layers=4, moe_layer_interval=2), "config.moe_layer_interval=2"),
        (twin("ernie4_5_moe", num_hidden_layers=3, moe_layer_end_index=1), "config.moe_layer_end_index=1"),
        (twin("ernie4_5_moe", use_bias=True), "config.use_bias=True"),
    ]
    for model, message in cases:
        with pytest.raises(FastkitError, match=message):
            write_gguf(model, tok, out)
    assert not out.exists()
    # a V2 whose groups do not restrict routing (topk_group == n_group, or greedy) is written
    assert write_gguf(twin("deepseek_v2", **mla, topk_method="greedy", n_group=2, topk_group=1), tok, out, "f16")


@pytest.mark.parametrize("jitter", [0.0, 0.01, 0.5, 10.0])
def test_phimoe_refused_sparsemixer_is_not_llama_cpp_routing(tmp_path, jitter):
    """phimoe is refused before anything is written, naming why: llama.cpp's phimoe graph (src/models/phi3.cpp)
    weighs the top-2 experts by a softmax over all experts renormalized over the two (``build_moe_ffn``, softmax,
    ``norm_w`` true), transformers' sparsemixer by two softmaxes over thresholded sets. The reason is checked, not
    assumed: at every ``router_jitter_noise`` tried the twin's eval-mode weights differ from llama.cpp's rule on the
    same router logits (same experts chosen, other weights)."""
    model = twin("phimoe", router_jitter_noise=jitter).eval()
    with pytest.raises(FastkitError, match="router_jitter_noise") as err:
        write_gguf(model, twin_bpe_tokenizer("gpt-2"), tmp_path / "out", quantization="f16")
    assert registry.MODEL_TABLE["phimoe"].gguf_refusal in str(err.value)
    assert not (tmp_path / "out").exists()
    router = model.model.layers[0].mlp.router
    torch.nn.init.normal_(router.weight, std=1.0)  # drawn wide, as the round trip's MoE twins
    with torch.no_grad():
        logits, weights, chosen = router(torch.randn(64, model.config.hidden_size))
        top = logits.softmax(-1).topk(2, dim=-1)
    assert torch.equal(chosen, top.indices)  # the same two experts...
    llama_cpp = top.values / top.values.sum(-1, keepdim=True)
    assert (weights - llama_cpp).abs().max() > 0.1  # ...weighed otherwise
