"""save_gguf for the hybrid families (recurrent layers beside attention; fastkit/export/gguf/hybrid.py): the file's
tensors and metadata as llama.cpp's graphs read them, what those graphs cannot compute refused before anything is
written, and the hybrid families not written yet refused naming why. The real llama.cpp round trip of each family
written is its row in tests/test_llamacpp_round_trip.py (tests/gguf_round_trip.py TWINS).
"""

from __future__ import annotations

import gguf
import pytest
import torch

from fastkit import FastkitError, registry
from fastkit.export.gguf.writer import merged_parameters, write_gguf
from fastkit.families.twins import twin, twin_bpe_tokenizer
from tests import gguf_round_trip as rt

LFM2 = "lfm2 (gpt-2)"


def _reader(path: str):
    return gguf.GGUFReader(path)


def _field(reader, key: str):
    f = reader.fields[key]
    values = [f.parts[i].tolist() for i in f.data]
    return [v[0] for v in values] if len(values) > 1 or key.endswith("head_count_kv") else values[0][0]


def _lfm2():
    model_type, overrides, _ = rt.TWINS[LFM2]
    return twin(model_type, **overrides).eval()


@pytest.mark.parametrize("quantization", ["f16", "q8_0"])
def test_lfm2_layout(tmp_path, quantization):
    """Conv layers carry 0 KV heads (llama.cpp's mark of a recurrent layer); the conv kernel (C, 1, K) is written
    (C, K) in f32 and bit-exact in every quantization; the MLP's adjusted width and the kernel length are stated."""
    model = _lfm2()
    config = model.config
    reader = _reader(write_gguf(model, twin_bpe_tokenizer("gpt-2"), tmp_path, quantization=quantization))
    arch = registry.MODEL_TABLE["lfm2"].gguf_arch
    kinds = config.layer_types
    assert "conv" in kinds and "full_attention" in kinds
    assert _field(reader, f"{arch}.attention.head_count_kv") == [
        config.num_key_value_heads if k == "full_attention" else 0 for k in kinds]
    assert _field(reader, f"{arch}.shortconv.l_cache") == config.conv_L_cache
    assert _field(reader, f"{arch}.feed_forward_length") == model.model.layers[0].feed_forward.w1.out_features
    assert _field(reader, f"{arch}.feed_forward_length") != config.intermediate_size  # the adjusted width bites
    assert abs(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon") - config.norm_eps) < 1e-12
    tensors = {t.name: t for t in reader.tensors}
    merged = {name: load() for name, load, _ in merged_parameters(model)}
    for i, kind in enumerate(kinds):
        conv = f"blk.{i}.shortconv.conv.weight"
        assert (conv in tensors) == (kind == "conv")
        assert (f"blk.{i}.attn_q.weight" in tensors) == (kind == "full_attention")
        if kind == "conv":
            t = tensors[conv]
            assert t.tensor_type == gguf.GGMLQuantizationType.F32
            want = merged[f"model.layers.{i}.conv.conv.weight"]  # (C, 1, K)
            assert torch.equal(torch.from_numpy(t.data.copy()), want[:, 0, :])  # (C, K), taps in order


def test_lfm2_conv_bias_refused(tmp_path):
    """llama.cpp's lfm2 conv block has no biases: a conv_bias model is refused naming the key, nothing written."""
    model_type, overrides, _ = rt.TWINS[LFM2]
    model = twin(model_type, **overrides, conv_bias=True)
    with pytest.raises(FastkitError, match="conv_bias"):
        write_gguf(model, twin_bpe_tokenizer("gpt-2"), tmp_path / "out", quantization="f16")
    assert not (tmp_path / "out").exists()


QWEN3_NEXT = "qwen3_next (gpt-2)"


@pytest.mark.parametrize("quantization", ["f16", "q8_0"])
def test_qwen3_next_layout(tmp_path, quantization):
    """Gated DeltaNet as llama.cpp's converter writes it: in_proj_qkvz (per key head [q, k, v, z]) as attn_qkv (all q,
    all k, all v) + attn_gate (z); A_log as ssm_a = -exp(A_log), conv kernel (C, K), dt bias and gated norm (no +1)
    in f32 in every quantization; the recurrent layers as a per-layer bool array; the SSM sizes."""
    model_type, overrides, _ = rt.TWINS[QWEN3_NEXT]
    model = twin(model_type, **overrides).eval()
    rt._draw_zeros(model)
    config = model.config
    reader = _reader(write_gguf(model, twin_bpe_tokenizer("gpt-2"), tmp_path, quantization=quantization))
    arch = registry.MODEL_TABLE[model_type].gguf_arch
    recurrent = reader.fields[f"{arch}.attention.recurrent_layers"]
    assert [bool(recurrent.parts[i][0]) for i in recurrent.data] == [k == "linear_attention"
                                                                     for k in config.layer_types]
    assert _field(reader, f"{arch}.ssm.group_count") == config.linear_num_key_heads
    assert _field(reader, f"{arch}.ssm.time_step_rank") == config.linear_num_value_heads
    assert _field(reader, f"{arch}.ssm.conv_kernel") == config.linear_conv_kernel_dim
    tensors = {t.name: t for t in reader.tensors}
    merged = {name: load() for name, load, _ in merged_parameters(model)}
    nk, hk = config.linear_num_key_heads, config.linear_key_head_dim
    rv = config.linear_num_value_heads // nk * config.linear_value_head_dim
    f32 = gguf.GGMLQuantizationType.F32
    for i, kind in enumerate(config.layer_types):
        assert (f"blk.{i}.ssm_a" in tensors) == (kind == "linear_attention")
        if kind != "linear_attention":
            continue
        stem = f"model.layers.{i}.linear_attn"
        for name, want in ((f"blk.{i}.ssm_a", -torch.exp(merged[f"{stem}.A_log"])),
                           (f"blk.{i}.ssm_dt.bias", merged[f"{stem}.dt_bias"]),
                           (f"blk.{i}.ssm_norm.weight", merged[f"{stem}.norm.weight"]),
                           (f"blk.{i}.ssm_conv1d.weight", merged[f"{stem}.conv1d.weight"][:, 0, :])):
            assert tensors[name].tensor_type == f32, name
            assert torch.equal(torch.from_numpy(tensors[name].data.copy()), want), name
        if quantization == "f16":
            fused = merged[f"{stem}.in_proj_qkvz.weight"].reshape(nk, 2 * hk + 2 * rv, -1)  # per key head q k v z
            q, k, v, z = (t.reshape(-1, fused.shape[-1]) for t in fused.split([hk, hk, rv, rv], dim=1))
            got = torch.from_numpy(tensors[f"blk.{i}.attn_qkv.weight"].data.copy()).float()
            assert torch.equal(got, torch.cat([q, k, v]).half().float())
            got = torch.from_numpy(tensors[f"blk.{i}.attn_gate.weight"].data.copy()).float()
            assert torch.equal(got, z.half().float())


def test_qwen3_next_unequal_head_dims_refused(tmp_path):
    """llama.cpp's qwen3next reads the DeltaNet's key and value head dims from one key: unequal ones are refused."""
    model_type, overrides, _ = rt.TWINS[QWEN3_NEXT]
    model = twin(model_type, **overrides, linear_value_head_dim=32)
    with pytest.raises(FastkitError, match="linear_value_head_dim"):
        write_gguf(model, twin_bpe_tokenizer("gpt-2"), tmp_path / "out", quantization="f16")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("label", ["qwen3_5_text (gpt-2)", "qwen3_5_moe_text (gpt-2)"])
def test_qwen3_5_value_heads_tiled(tmp_path, label):
    """Qwen3.5's value heads, grouped by key head in transformers ([k0: v0 v1, k1: v0 v1]), are tiled in the file
    ([k0 v0, k1 v0, k0 v1, k1 v1]) in z, b, a, A_log (as -exp), dt_bias, qkv's and the conv's value rows and out_proj's
    columns; q / k rows untouched; the M-RoPE sections written."""
    model_type, overrides, _ = rt.TWINS[label]
    model = twin(model_type, **overrides).eval()
    config = model.config
    reader = _reader(write_gguf(model, twin_bpe_tokenizer("gpt-2"), tmp_path, quantization="f16"))
    arch = registry.MODEL_TABLE[model_type].gguf_arch
    assert _field(reader, f"{arch}.rope.dimension_sections") == [*overrides["rope_parameters"]["mrope_section"], 0]
    tensors = {t.name: torch.from_numpy(t.data.copy()).float() for t in reader.tensors}
    merged = {name: load() for name, load, _ in merged_parameters(model)}
    nk, nv, hv = config.linear_num_key_heads, config.linear_num_value_heads, config.linear_value_head_dim
    assert nk < nv  # else tiled == grouped
    order = torch.arange(nv).reshape(nk, nv // nk).T.reshape(-1)  # file head j holds transformers' head order[j]
    qk = 2 * nk * config.linear_key_head_dim

    def rows(w, width, skip=0):  # (skip + Nv·width, ...) -> value rows in file order
        v = w[skip:].reshape(nv, width, *w.shape[1:])[order].reshape(w[skip:].shape)
        return torch.cat([w[:skip], v])

    stem = "model.layers.0.linear_attn"
    f16 = lambda t: t.half().float()  # noqa: E731
    assert torch.equal(tensors["blk.0.ssm_a"], rows(-torch.exp(merged[f"{stem}.A_log"]), 1))
    assert torch.equal(tensors["blk.0.ssm_dt.bias"], rows(merged[f"{stem}.dt_bias"], 1))
    assert torch.equal(tensors["blk.0.ssm_beta.weight"], f16(rows(merged[f"{stem}.in_proj_b.weight"], 1)))
    assert torch.equal(tensors["blk.0.ssm_alpha.weight"], f16(rows(merged[f"{stem}.in_proj_a.weight"], 1)))
    assert torch.equal(tensors["blk.0.attn_gate.weight"], f16(rows(merged[f"{stem}.in_proj_z.weight"], hv)))
    assert torch.equal(tensors["blk.0.attn_qkv.weight"], f16(rows(merged[f"{stem}.in_proj_qkv.weight"], hv, qk)))
    assert torch.equal(tensors["blk.0.ssm_conv1d.weight"], rows(merged[f"{stem}.conv1d.weight"][:, 0], hv, qk))
    assert torch.equal(tensors["blk.0.ssm_out.weight"], f16(rows(merged[f"{stem}.out_proj.weight"].T, hv).T))


def test_qwen3_5_rope_sections_beyond_rotary_refused(tmp_path):
    """ggml's M-RoPE aborts the process when the sections exceed the rotary pairs: refused before any work."""
    model_type, overrides, _ = rt.TWINS["qwen3_5_text (gpt-2)"]
    rope = dict(overrides["rope_parameters"], mrope_section=[11, 11, 10])
    model = twin(model_type, **dict(overrides, rope_parameters=rope))
    with pytest.raises(FastkitError, match="mrope_section"):
        write_gguf(model, twin_bpe_tokenizer("gpt-2"), tmp_path / "out", quantization="f16")
    assert not (tmp_path / "out").exists()


FALCON = "falcon_h1 (gpt-2)"


def test_falcon_h1_layout(tmp_path):
    """Falcon-H1's Mamba2 as llama.cpp reads it: A = -exp(A_log) and D as (heads, 1), dt bias, conv (C, K) and its
    bias, in_proj's z / x / B / C / dt rows times their multipliers (and ssm_in's), every other multiplier folded into
    its weight (attn_output by the attention's, not the lm_head's), the pre-FFN norm as llama.cpp's suffix-less name."""
    model_type, overrides, _ = rt.TWINS[FALCON]
    model = twin(model_type, **overrides).eval()
    config = model.config
    reader = _reader(write_gguf(model, twin_bpe_tokenizer("gpt-2"), tmp_path, quantization="f16"))
    tensors = {t.name: torch.from_numpy(t.data.copy()).float() for t in reader.tensors}
    merged = {name: load() for name, load, _ in merged_parameters(model)}
    stem = "model.layers.0.mamba"
    assert torch.equal(tensors["blk.0.ssm_a"], -torch.exp(merged[f"{stem}.A_log"]).reshape(-1, 1))
    assert torch.equal(tensors["blk.0.ssm_d"], merged[f"{stem}.D"].reshape(-1, 1))
    assert torch.equal(tensors["blk.0.ssm_dt.bias"], merged[f"{stem}.dt_bias"])
    assert torch.equal(tensors["blk.0.ssm_conv1d.weight"], merged[f"{stem}.conv1d.weight"][:, 0])
    assert torch.equal(tensors["blk.0.ssm_conv1d.bias"], merged[f"{stem}.conv1d.bias"])
    mup = dict(model.named_buffers())[f"{stem}.mup_vector"].reshape(-1, 1)  # transformers' own section multipliers
    want = merged[f"{stem}.in_proj.weight"] * mup * config.ssm_in_multiplier
    assert torch.allclose(tensors["blk.0.ssm_in.weight"], want.half().float(), rtol=0, atol=1e-6)
    for name, hf, scale in (("blk.0.attn_output.weight", "model.layers.0.self_attn.o_proj.weight",
                             config.attention_out_multiplier),
                            ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight",
                             config.attention_in_multiplier * config.key_multiplier),
                            ("output.weight", "lm_head.weight", config.lm_head_multiplier),
                            ("token_embd.weight", "model.embed_tokens.weight", config.embedding_multiplier)):
        assert torch.allclose(tensors[name], (merged[hf] * scale).half().float(), rtol=0, atol=1e-6), name
    assert torch.equal(tensors["blk.0.ffn_norm"], merged["model.layers.0.pre_ff_layernorm.weight"])


@pytest.mark.parametrize("key", ["mamba_rms_norm", "tie_word_embeddings"])
def test_falcon_h1_refusals(tmp_path, key):
    """llama.cpp gates before its grouped norm (transformers' Falcon-H1 norms first); a tied head would lose the
    lm_head multiplier (llama.cpp reuses the scaled embeddings): both refused before anything is written."""
    model_type, overrides, _ = rt.TWINS[FALCON]
    model = twin(model_type, **overrides, **{key: True})
    with pytest.raises(FastkitError, match=key):
        write_gguf(model, twin_bpe_tokenizer("gpt-2"), tmp_path / "out", quantization="f16")
    assert not (tmp_path / "out").exists()


def test_granitemoehybrid_layout(tmp_path):
    """Granite 4.0-H: Mamba2 layers as 0 KV heads, the gated norm grouped (G, d / G) in f32 (llama.cpp's binary ops
    take no f16 norm), A / D as (heads, 1), rope switched off as configured (``position_embedding_type`` None)."""
    label = "granitemoehybrid (gpt-2)"
    model_type, overrides, _ = rt.TWINS[label]
    model = twin(model_type, **overrides).eval()
    config = model.config
    reader = _reader(write_gguf(model, twin_bpe_tokenizer("gpt-2"), tmp_path, quantization="q8_0"))
    arch = registry.MODEL_TABLE[model_type].gguf_arch
    assert _field(reader, f"{arch}.attention.head_count_kv") == [
        config.num_key_value_heads if k == "full_attention" else 0 for k in config.layer_types]
    assert _field(reader, f"{arch}.rope.scaling.finetuned") is False  # no rope, as transformers runs it
    t = {t.name: t for t in reader.tensors}
    merged = {name: load() for name, load, _ in merged_parameters(model)}
    norm = t["blk.0.ssm_norm.weight"]
    assert norm.tensor_type == gguf.GGMLQuantizationType.F32
    want = merged["model.layers.0.mamba.norm.weight"].reshape(config.mamba_n_groups, -1)  # (G, d / G)
    assert torch.equal(torch.from_numpy(norm.data.copy()), want)
    assert torch.equal(torch.from_numpy(t["blk.0.ssm_a"].data.copy()),
                       -torch.exp(merged["model.layers.0.mamba.A_log"]).reshape(-1, 1))


NEMOTRON = "nemotron_h (gpt-2)"


def test_nemotron_h_layout(tmp_path):
    """Nemotron-H's pattern as llama.cpp's nemotron_h reads it: per layer, KV heads on the attention layers and the FFN
    length on the MLP layers, 0 elsewhere (both 0: Mamba2); the mixers under llama.cpp's names (one ``mixer`` module
    name for all three kinds), the conv kernel (C, K) and the gated norm (G, d / G) in f32, the ReLU² MLP's up / down
    without gate; ``layer_norm_epsilon`` as both epsilons (the loader requires the LayerNorm one); no expert counts
    (the config's defaults of a dense model)."""
    model_type, overrides, _ = rt.TWINS[NEMOTRON]
    model = twin(model_type, **overrides).eval()
    config = model.config
    reader = _reader(write_gguf(model, twin_bpe_tokenizer("gpt-2"), tmp_path, quantization="q8_0"))
    arch = registry.MODEL_TABLE[model_type].gguf_arch
    kinds = config.layers_block_type
    assert "mlp" in kinds and "full_attention" in kinds and "linear_attention" in kinds
    assert _field(reader, f"{arch}.attention.head_count_kv") == [
        config.num_key_value_heads if k == "full_attention" else 0 for k in kinds]
    assert _field(reader, f"{arch}.feed_forward_length") == [
        config.intermediate_size if k == "mlp" else 0 for k in kinds]
    for key in ("attention.layer_norm_epsilon", "attention.layer_norm_rms_epsilon"):
        assert _field(reader, f"{arch}.{key}") == pytest.approx(config.layer_norm_epsilon)
    assert _field(reader, f"{arch}.ssm.group_count") == config.n_groups == 2
    assert _field(reader, f"{arch}.ssm.inner_size") == config.mamba_num_heads * config.mamba_head_dim
    assert not any(k.startswith(f"{arch}.expert") for k in reader.fields)
    t = {t.name: t for t in reader.tensors}
    merged = {name: load() for name, load, _ in merged_parameters(model)}
    stem = "model.layers.0.mixer"
    conv = t["blk.0.ssm_conv1d.weight"]
    assert conv.tensor_type == gguf.GGMLQuantizationType.F32
    assert torch.equal(torch.from_numpy(conv.data.copy()), merged[f"{stem}.conv1d.weight"][:, 0])
    norm = t["blk.0.ssm_norm.weight"]
    assert norm.tensor_type == gguf.GGMLQuantizationType.F32
    assert torch.equal(torch.from_numpy(norm.data.copy()), merged[f"{stem}.norm.weight"].reshape(config.n_groups, -1))
    assert torch.equal(torch.from_numpy(t["blk.0.ssm_a"].data.copy()),
                       -torch.exp(merged[f"{stem}.A_log"]).reshape(-1, 1))
    mlp = kinds.index("mlp")
    assert {f"blk.{mlp}.ffn_up.weight", f"blk.{mlp}.ffn_down.weight"} <= set(t)
    assert f"blk.{mlp}.ffn_gate.weight" not in t
    attention = kinds.index("full_attention")
    assert {f"blk.{attention}.attn_{p}.weight" for p in ("q", "k", "v", "output")} <= set(t)


@pytest.mark.parametrize(("key", "value"), [
    ("layers_block_type", ["linear_attention", "moe", "full_attention"]),  # llama.cpp's nemotron_h_moe
    ("mlp_hidden_act", "silu"), ("mamba_proj_bias", True), ("attention_bias", True)])
def test_nemotron_h_refusals(tmp_path, key, value):
    """What nemotron_h's graph does not compute (MoE layers, another MLP activation, projection / attention biases) is
    refused naming the key, before anything is written."""
    model_type, overrides, _ = rt.TWINS[NEMOTRON]
    model = twin(model_type, **{**overrides, key: value, "moe_intermediate_size": 16,
                                "moe_shared_expert_intermediate_size": 16})
    with pytest.raises(FastkitError, match=key):
        write_gguf(model, twin_bpe_tokenizer("gpt-2"), tmp_path / "out", quantization="f16")
    assert not (tmp_path / "out").exists()


def test_lfm2_moe_layout(tmp_path):
    """LFM2-MoE: the leading dense layer without experts, the selection bias as exp_probs_b (f32, bit-exact), the
    router in f32; a model without the bias (lfm2moe requires it) or with a routed scale (never read) refused."""
    label = "lfm2_moe (gpt-2)"
    model_type, overrides, _ = rt.TWINS[label]
    model = twin(model_type, **overrides).eval()
    rt._draw_zeros(model)
    config = model.config
    reader = _reader(write_gguf(model, twin_bpe_tokenizer("gpt-2"), tmp_path / "ok", quantization="q8_0"))
    arch = registry.MODEL_TABLE[model_type].gguf_arch
    assert _field(reader, f"{arch}.leading_dense_block_count") == config.num_dense_layers == 1
    t = {t.name: t for t in reader.tensors}
    assert "blk.0.ffn_gate.weight" in t and "blk.0.ffn_gate_inp.weight" not in t
    bias = dict(model.named_buffers())["model.layers.1.feed_forward.expert_bias"]
    assert bias.abs().max() > 0 and t["blk.1.exp_probs_b.bias"].tensor_type == gguf.GGMLQuantizationType.F32
    assert torch.equal(torch.from_numpy(t["blk.1.exp_probs_b.bias"].data.copy()), bias)
    assert t["blk.1.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    for key, value in (("use_expert_bias", False), ("routed_scaling_factor", 1.5)):  # lfm2moe reads no scale
        with pytest.raises(FastkitError, match=key):
            write_gguf(twin(model_type, **overrides, **{key: value}), twin_bpe_tokenizer("gpt-2"),
                       tmp_path / "refused", quantization="f16")
    assert not (tmp_path / "refused").exists()


NOT_WRITTEN = [t for t, f in registry.MODEL_TABLE.items() if f.stateful and not f.gguf_arch]
"""Hybrid families the table has with no GGUF layout yet."""


@pytest.mark.parametrize("model_type", NOT_WRITTEN)
def test_unwritten_hybrids_refused_with_reason(tmp_path, model_type):
    """Each hybrid family not written is refused before anything is written, with its row's reason
    (``ModelFacts.gguf_refusal``) where llama.cpp has an architecture for it."""
    model = twin(model_type)
    reason = registry.MODEL_TABLE[model_type].gguf_refusal
    with pytest.raises(FastkitError, match="no GGUF mapping") as err:
        write_gguf(model, twin_bpe_tokenizer("gpt-2"), tmp_path / "out", quantization="f16")
    assert reason in str(err.value)
    assert not (tmp_path / "out").exists()
