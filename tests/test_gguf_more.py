"""save_gguf for the dense families of the gguf-more round (gemma, phi, olmo, cohere, arcee, seed_oss,
hunyuan_v1_dense, apertus, gpt_neox, gpt2, gpt_bigcode, ministral3, ministral, exaone, internlm3, helium): each row's
GGUFRules in the file, and what each family's llama.cpp graph cannot compute refused before anything is written,
naming the config key. Their llama.cpp round trips are rows of tests/gguf_round_trip.py (TWINS), run by
tests/test_llamacpp_round_trip.py."""

from __future__ import annotations

import gguf
import pytest
import torch

from fastkit import FastkitError
from fastkit.export.gguf.writer import write_gguf
from fastkit.families.twins import twin, twin_bpe_tokenizer


def _fields_and_tensors(model, tmp_path):
    reader = gguf.GGUFReader(write_gguf(model, twin_bpe_tokenizer("gpt-2"), tmp_path, quantization="f16"))
    return reader.fields, {t.name: t for t in reader.tensors}


def _value(fields, key):
    return fields[key].contents()


def test_layer_norm_families_write_their_epsilon_clamp_and_logit_scale(tmp_path):
    """phi2 / olmo / command-r read attention.layer_norm_epsilon (LayerNorm graphs), not the RMS key; OLMo's clip_qkv
    is clamp_kqv, Cohere's logit_scale is logit_scale; Phi-2's LayerNorm and lm_head biases and partial rotary."""
    fields, tensors = _fields_and_tensors(twin("phi", layer_norm_eps=3e-5), tmp_path / "phi")
    assert _value(fields, "phi2.attention.layer_norm_epsilon") == pytest.approx(3e-5)
    assert "phi2.attention.layer_norm_rms_epsilon" not in fields
    assert _value(fields, "phi2.rope.dimension_count") == 8  # partial_rotary_factor 0.5 of 16
    assert {"output.bias", "output_norm.bias", "blk.0.attn_norm.bias", "blk.0.ffn_up.bias"} <= set(tensors)
    fields, tensors = _fields_and_tensors(twin("olmo", clip_qkv=0.5), tmp_path / "olmo")
    assert _value(fields, "olmo.attention.layer_norm_epsilon") == pytest.approx(1e-5)
    assert _value(fields, "olmo.attention.clamp_kqv") == 0.5
    assert not [n for n in tensors if "norm" in n]  # OLMo's LayerNorms have no weights
    fields, _ = _fields_and_tensors(twin("olmo"), tmp_path / "olmo-noclip")
    assert "olmo.attention.clamp_kqv" not in fields  # clip_qkv None: nothing written, nothing clamped
    fields, tensors = _fields_and_tensors(twin("cohere", logit_scale=4.0, layer_norm_eps=2e-5), tmp_path / "cohere")
    assert _value(fields, "command-r.logit_scale") == 4.0
    assert _value(fields, "command-r.attention.layer_norm_epsilon") == pytest.approx(2e-5)
    assert "output.weight" not in tensors  # tied: command-r.cpp computes logits with token_embd


def test_gemma_arcee_seed_oss_tensors(tmp_path):
    """Gemma's norms written +1 and no output tensor; Arcee's gate-less MLP; Seed-OSS's post-attention norm."""
    model = twin("gemma")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    _, tensors = _fields_and_tensors(model, tmp_path / "gemma")
    want = model.get_parameter("model.layers.1.post_attention_layernorm.weight").detach() + 1
    assert torch.allclose(torch.from_numpy(tensors["blk.1.ffn_norm.weight"].data.copy()), want)
    assert "output.weight" not in tensors
    _, tensors = _fields_and_tensors(twin("arcee"), tmp_path / "arcee")
    assert "blk.0.ffn_up.weight" in tensors and not [n for n in tensors if "ffn_gate" in n]
    _, tensors = _fields_and_tensors(twin("seed_oss"), tmp_path / "seed")
    assert {"blk.0.post_attention_norm.weight", "blk.0.attn_q.bias"} <= set(tensors)


def test_apertus_xielu_parameters_are_per_layer_metadata(tmp_path):
    """Apertus's xIELU alpha_p / alpha_n (parameters) and beta / eps (buffers) go in as one array per kind over the
    layers (apertus.cpp reads them so), raw as the model holds them; no tensor is written for them."""
    model = twin("apertus")
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            layer.mlp.act_fn.alpha_p.fill_(0.1 + i)
            layer.mlp.act_fn.alpha_n.fill_(-0.2 - i)
    fields, tensors = _fields_and_tensors(model, tmp_path)
    assert list(_value(fields, "xielu.alpha_p")) == pytest.approx([0.1, 1.1], abs=1e-2)  # bf16 parameters
    assert list(_value(fields, "xielu.alpha_n")) == pytest.approx([-0.2, -1.2], abs=1e-2)
    assert list(_value(fields, "xielu.beta")) == [0.5, 0.5]
    assert not [n for n in tensors if "act_fn" in n or "xielu" in n]


def test_gpt_neox_qkv_rows_reordered_and_residual_flag(tmp_path):
    """GPT-NeoX's fused query_key_value rows go from per head (H, 3, D) to llama.cpp's (3, H, D), bias alike; the
    parallel-residual flag is written as configured."""
    model = twin("gpt_neox", use_parallel_residual=False)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    fields, tensors = _fields_and_tensors(model, tmp_path)
    assert bool(_value(fields, "gptneox.use_parallel_residual")) is False
    w = model.get_parameter("gpt_neox.layers.1.attention.query_key_value.weight").detach()  # (H·3·D, hidden)
    heads = model.config.num_attention_heads
    want = w.reshape(heads, 3, -1, w.shape[-1]).transpose(0, 1).reshape(w.shape)  # q rows of every head first
    got = torch.from_numpy(tensors["blk.1.attn_qkv.weight"].data.copy()).float()
    assert torch.allclose(got, want.half().float())
    b = model.get_parameter("gpt_neox.layers.1.attention.query_key_value.bias").detach()
    got = torch.from_numpy(tensors["blk.1.attn_qkv.bias"].data.copy())
    assert torch.equal(got, b.reshape(heads, 3, -1).transpose(0, 1).reshape(-1))


def test_gpt2_conv1d_weights_transposed_and_mlp_width(tmp_path):
    """GPT-2's Conv1D weights (in, out) go out as llama.cpp's (out, in); n_inner None is 4 x hidden; learned positions
    are position_embd; its activation_function is the one checked."""
    model = twin("gpt2")
    fields, tensors = _fields_and_tensors(model, tmp_path)
    assert _value(fields, "gpt2.feed_forward_length") == 4 * 64
    assert _value(fields, "gpt2.attention.layer_norm_epsilon") == pytest.approx(model.config.layer_norm_epsilon)
    w = model.get_parameter("transformer.h.0.attn.c_attn.weight").detach()  # (in, 3·hidden)
    got = torch.from_numpy(tensors["blk.0.attn_qkv.weight"].data.copy()).float()
    assert torch.allclose(got, w.t().half().float())
    assert "position_embd.weight" in tensors and "output.weight" not in tensors  # tied


def test_families_not_exported_say_so(tmp_path):
    """Table families still without a GGUF row are refused before any work, naming the way out."""
    for model_type in ("codegen", "persimmon", "gptj"):
        with pytest.raises(FastkitError, match=f"model_type '{model_type}' has no GGUF mapping here"):
            write_gguf(twin(model_type), twin_bpe_tokenizer("gpt-2"), tmp_path / model_type)
        assert not (tmp_path / model_type).exists()


_YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16,
         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}


def test_ministral3_writes_yarn_and_the_query_temperature(tmp_path):
    """mistral3.cpp reads YaRN's log multiplier and the Llama-4 query temperature (beta) off the metadata."""
    fields, tensors = _fields_and_tensors(twin("ministral3", rope_parameters=dict(_YARN, llama_4_scaling_beta=0.25)),
                                          tmp_path)
    assert _value(fields, "mistral3.attention.temperature_scale") == 0.25
    assert _value(fields, "mistral3.rope.scaling.yarn_log_multiplier") == 1.0
    assert _value(fields, "mistral3.rope.scaling.original_context_length") == 16
    assert _value(fields, "mistral3.rope.scaling.factor") == 4.0


@pytest.mark.parametrize(("model_type", "overrides", "message"), [
    ("cohere", {"attention_bias": True}, "config.attention_bias=True: llama.cpp's command-r"),
    ("olmo", {"attention_bias": True}, "config.attention_bias=True: llama.cpp's olmo"),
    ("phi", {"qk_layernorm": True}, "config.qk_layernorm=True: llama.cpp's phi2"),
    ("phi", {"tie_word_embeddings": True}, "needs its own output tensor"),
    ("phi", {"hidden_act": "gelu"}, "activation 'gelu': llama.cpp's phi2 graph applies 'gelu_new'"),
    ("seed_oss", {"attention_out_bias": True}, "config.attention_out_bias=True"),
    ("arcee", {"mlp_bias": True}, "config.mlp_bias=True: llama.cpp's arcee"),
    ("arcee", {"hidden_act": "silu"}, "activation 'silu': llama.cpp's arcee graph applies 'relu2'"),
    ("gemma", {"tie_word_embeddings": False}, "untied lm_head"),
    ("cohere", {"tie_word_embeddings": False}, "untied lm_head"),
    ("ministral", {"sliding_window": 16}, "16-token sliding window"),
    ("hunyuan_v1_dense", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
     "rope types default"),
    ("apertus", {"tie_word_embeddings": True}, "needs its own output tensor"),
    ("apertus", {"hidden_act": "silu"}, "activation 'silu': llama.cpp's apertus graph applies 'xielu'"),
    ("gpt_neox", {"attention_bias": False}, "config.attention_bias=False: llama.cpp's gptneox"),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "config.scale_attn_by_inverse_layer_idx=True"),
    ("gpt2", {"activation_function": "relu"}, "activation 'relu': llama.cpp's gpt2 graph applies 'gelu_new'"),
    ("gpt_bigcode", {"multi_query": False}, "config.multi_query=False: llama.cpp's starcoder"),
    ("ministral3", {"rope_parameters": dict(_YARN, mscale=0.5)}, r"rope_parameters\['mscale'\]=0.5"),
    ("ministral3", {"rope_parameters": dict(_YARN, attention_factor=1.5)}, "attention_factor"),
    ("ministral3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "rope types yarn"),
])
def test_what_the_graphs_cannot_compute_is_refused(tmp_path, model_type, overrides, message):
    out = tmp_path / "out"
    with pytest.raises(FastkitError, match=message):
        write_gguf(twin(model_type, **overrides), twin_bpe_tokenizer("gpt-2"), out)
    assert not out.exists()
