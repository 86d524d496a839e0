"""save_gguf: a GGUF that transformers' GGUF loader (and so llama.cpp's layout) reads back to the merged model.

Measured here (trained llama twin, 2 layers, logits up to ~1.3): f16 max |Δlogit| 2.4e-4, bf16 1.9e-3,
q8_0 7.8e-3, q4_0 7.2e-2 (qwen3 twin: 2.7e-4, 3.1e-3, 7.3e-3, 1.1e-1). SmolLM2-135M (30 layers,
logits up to ~38, LoRA merged): q8_0 max |Δlogit| ~1.2, argmax identical at every position.
"""

from __future__ import annotations

import json
import os

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fastkit import FastkitError, FastModel
from fastkit.export.gguf.vocab import pre_tokenizer_name
from fastkit.export.gguf.writer import merged_parameters, write_gguf
from fastkit.families.twins import twin, twin_bpe_tokenizer, twin_tokenizer
from tests import gguf_round_trip as rt
from tests.helpers import save_twin, train_lora_steps

HUB = {"llama": "HuggingFaceTB/SmolLM2-135M-Instruct", "qwen3": "Qwen/Qwen3-0.6B", "qwen3_moe": "Qwen/Qwen3-30B-A3B",
       "qwen2_moe": "qwen2_moe"}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
TOLERANCE = {"bf16": 1e-2, "q8_0": 2e-2, "q4_0": 1.5e-1}  # max |Δlogit| on the llama twin (see top)
# The pre-tokenizer each family's real tokenizer has (SmolLM2, Mistral Nemo, Qwen2/3), given to its twin.
PRE = {"llama": "smollm", "mistral": "tekken", "qwen2": "qwen2", "qwen3": "qwen2", "qwen3_moe": "qwen2",
       "qwen2_moe": "qwen2", "starcoder2": "smollm"}


def _trained(family: str, steps: int = 2):
    """A fastkit twin with LoRA on every linear layer (qwen3_moe: experts too), trained a few steps."""
    model, _ = FastModel.from_pretrained(HUB[family], max_seq_length=64, twin=True)
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False)
    return train_lora_steps(model, steps), twin_bpe_tokenizer(PRE[family])  # llama.cpp needs BPE merges


def _load(path: str, config=None):
    """transformers' GGUF loader. Its legacy metadata table has no qwen3 head_dim / qwen3_moe
    moe_intermediate_size (it falls back to the 0.6B / 30B defaults), so twins of those pass their config."""
    kw = {"config": config} if config is not None else {}
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32, **kw).eval()


def _x():
    return torch.randint(3, 259, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "qwen2_moe"])
def test_f16_round_trip_is_the_merged_model_rounded(tmp_path, family):
    model, tok = _trained(family)
    with torch.no_grad():
        ref = model(input_ids=_x()).logits
    merged = {name: load() for name, load, _ in merged_parameters(model)}
    path = write_gguf(model, tok, tmp_path, quantization="f16")
    back = _load(path, None if family == "llama" else model.config)
    loaded = dict(back.named_parameters())
    assert set(merged) == set(loaded)
    for name, want in merged.items():  # f16 weights, f32 norms / router: bit-exact after rounding
        got = loaded[name]
        assert torch.equal(got, want) or torch.equal(got, want.half().float()), name
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=_x()).logits, ref, rtol=0, atol=2e-3)


@pytest.mark.parametrize("family", ["mistral", "qwen2", "starcoder2"])
def test_f16_round_trip_plain_models(tmp_path, family):
    """No LoRA; qwen2 brings q/k/v biases (no twin family: built from its config here); starcoder2 LayerNorm biases
    and a bias on every linear layer (the dense family transformers' GGUF reader has)."""
    if family == "qwen2":
        from transformers import Qwen2Config

        torch.manual_seed(0)
        config = Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                             num_hidden_layers=2, vocab_size=320, max_position_embeddings=4096, bos_token_id=1,
                             eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    else:
        model = twin(family, sliding_window=None)  # llama.cpp's llama graph has no window (see the refusal test)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_()  # zero-initialised upstream: make a bias layout mistake visible
        ref = model(input_ids=_x()).logits
        back = _load(write_gguf(model, twin_bpe_tokenizer(PRE[family]), tmp_path, quantization="f16"))
        for name, p in model.named_parameters():
            assert torch.equal(dict(back.named_parameters())[name], p.half().float() if p.dim() > 1 else p), name
        torch.testing.assert_close(back(input_ids=_x()).logits, ref, rtol=0, atol=2e-3)


@pytest.mark.parametrize("quantization", ["bf16", "q8_0", "q4_0"])
def test_quantized_round_trip_within_measured_tolerance(tmp_path, quantization):
    model, tok = _trained("llama")
    with torch.no_grad():
        ref = model(input_ids=_x()).logits
        path = write_gguf(model, tok, tmp_path, quantization=quantization)
        got = _load(path)(input_ids=_x()).logits
    err = (got - ref).abs().max().item()
    assert err < TOLERANCE[quantization], (quantization, err)
    assert err > 1e-5  # it really is quantized
    reader = gguf.GGUFReader(path)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == quantization.upper()
    assert types["blk.0.attn_norm.weight"] == "F32"


def test_metadata_tokenizer_chat_template_and_modelfile(tmp_path):
    model, tok = _trained("qwen3")
    path = write_gguf(model, tok, tmp_path, quantization="q8_0", name="tiny")
    assert os.path.basename(path) == "tiny-q8_0.gguf"
    reader = gguf.GGUFReader(path)

    def field(key):
        f = reader.fields[key]
        value = f.parts[f.data[0]]
        return bytes(value).decode() if f.types[0] == gguf.GGUFValueType.STRING else value[0]

    assert field("general.architecture") == "qwen3"
    assert field("qwen3.attention.key_length") == model.config.head_dim
    assert field("qwen3.block_count") == model.config.num_hidden_layers
    assert field("tokenizer.chat_template") == tok.chat_template
    assert field("tokenizer.ggml.eos_token_id") == tok.eos_token_id
    back = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=os.path.basename(path))
    want = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert back.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == want
    assert back(want)["input_ids"] == tok(want)["input_ids"]
    assert field("tokenizer.ggml.pre") == "qwen2"
    assert len(reader.fields["tokenizer.ggml.merges"].data) == len(json.loads(tok.backend_tokenizer.to_str())[
        "model"]["merges"]) > 0
    # A TEMPLATE (Ollama ignores the embedded Jinja; tests/test_modelfile.py renders it in Go), then the stop token.
    from fastkit.export.gguf.modelfile import chat_layout, go_template

    template = go_template(chat_layout(tok)[0])
    assert (tmp_path / "Modelfile").read_text() == (
        "FROM ./tiny-q8_0.gguf\n# differs from apply_chat_template: two system messages: Ollama joins consecutive "
        f'messages of one role with a blank line before the template runs\nTEMPLATE """{template}"""\n'
        'PARAMETER stop "<|im_end|>"\n')


def test_pre_tokenizer_names_llama_cpp_knows():
    """Read off the tokenizer's own pre_tokenizer: GPT-2's ByteLevel regex is llama.cpp's "gpt-2" (its "default"
    splits differently), SmolLM2's digits rule "smollm"; an unknown split is refused, not written as "default"."""
    def split(regex, ignore_merges=False):
        return {"model": {"ignore_merges": ignore_merges}, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]}}

    llama3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
    assert pre_tokenizer_name(split(llama3, ignore_merges=True)) == "llama-bpe"
    assert pre_tokenizer_name(split(llama3.replace(r"\p{N}{1,3}", r"\p{N}"))) == "qwen2"
    smollm2 = {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [  # SmolLM2's tokenizer.json
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}}
    assert pre_tokenizer_name(smollm2) == "smollm"
    assert pre_tokenizer_name({"pre_tokenizer": {"type": "ByteLevel", "use_regex": True}}) == "gpt-2"
    assert pre_tokenizer_name(split(llama3)) == "dbrx"  # cl100k's split with merges always applied (Phi-4)
    with pytest.raises(FastkitError, match="no llama.cpp pre-tokenizer"):
        pre_tokenizer_name(split(r"\w+|[^\w\s]+"))
    with pytest.raises(FastkitError, match="no llama.cpp counterpart"):
        pre_tokenizer_name({"pre_tokenizer": {"type": "Metaspace", "replacement": "▁"}})
    with pytest.raises(FastkitError, match="ignore_merges=True"):  # no llama.cpp name for Qwen's split + that
        pre_tokenizer_name(split(llama3.replace(r"\p{N}{1,3}", r"\p{N}"), ignore_merges=True))
    for name in ("gpt-2", "smollm", "llama-bpe", "dbrx", "qwen2", "tekken"):  # each twin splits as its name says
        assert pre_tokenizer_name(json.loads(twin_bpe_tokenizer(name).backend_tokenizer.to_str())) == name


def test_tokenizer_llama_cpp_cannot_load_is_refused(tmp_path):
    """A BPE vocabulary without merges loads in transformers but not in llama.cpp: refused before writing."""
    with pytest.raises(FastkitError, match="without merges"):
        write_gguf(twin("llama"), twin_tokenizer(), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_stop_tokens_come_from_the_template():
    from fastkit.export.gguf.modelfile import modelfile, stop_tokens

    tok = twin_bpe_tokenizer()
    assert stop_tokens(tok) == ["<|im_end|>"]
    tok.add_special_tokens({"additional_special_tokens": ["<|eot_id|>", "<|im_start|>", "<|im_end|>"]})
    tok.chat_template = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|eot_id|>\n{% endfor %}"
    tok.eos_token = "<|im_end|>"
    assert stop_tokens(tok) == ["<|eot_id|>", "<|im_end|>"]  # the turn's end first, then EOS
    assert modelfile(tok, "m.gguf").endswith('PARAMETER stop "<|eot_id|>"\nPARAMETER stop "<|im_end|>"\n')


def test_sliding_window_llama_cpp_cannot_express_is_refused(tmp_path):
    tok = twin_bpe_tokenizer("tekken")
    with pytest.raises(FastkitError, match="64-token sliding window"):
        write_gguf(twin("mistral"), tok, tmp_path / "out")  # the twin's window: 64 of 32768 positions
    with pytest.raises(FastkitError, match="sliding window"):
        write_gguf(twin("qwen3", use_sliding_window=True, sliding_window=32), twin_bpe_tokenizer("qwen2"),
                  tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_k_quants_without_llama_cpp_say_how_to_get_them(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_llama_cpp(name, *args, **kwargs):
        if name == "llama_cpp":
            raise ImportError("No module named 'llama_cpp'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_llama_cpp)
    with pytest.raises(FastkitError, match=r"fastkit-llm\[llamacpp\]"):
        write_gguf(twin("llama"), twin_bpe_tokenizer("smollm"), tmp_path / "out", quantization="q4_k_m")
    assert not (tmp_path / "out").exists()


def test_llama3_rope_scaling_travels_as_rope_freqs(tmp_path):
    """Llama-3.x: llama.cpp divides rope frequencies by ``rope_freqs.weight``; those must be transformers'
    own llama3 scaling (transformers' GGUF loader ignores the tensor, so compare with its inv_freq)."""
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    model = twin("llama", rope_parameters=rope)
    path = write_gguf(model, twin_bpe_tokenizer("llama-bpe"), tmp_path, quantization="f16")
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    factors = torch.from_numpy(tensors["rope_freqs.weight"].data.copy())
    default = twin("llama", rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    inv_default, inv_llama3 = default.model.rotary_emb.inv_freq, model.model.rotary_emb.inv_freq
    assert factors.min() == 1.0 and factors.max() == 32.0  # short, long and in-between wavelengths all occur
    torch.testing.assert_close(inv_default / factors, inv_llama3, rtol=1e-5, atol=0)


def test_in_memory_model_is_unchanged(tmp_path):
    model, tok = _trained("llama")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        ref = model(input_ids=_x()).logits
        write_gguf(model, tok, tmp_path, quantization="f16")
        torch.testing.assert_close(model(input_ids=_x()).logits, ref, rtol=0, atol=0)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


def test_4bit_model_merges_into_its_base_reloaded_in_16_bit(tmp_path):
    """QLoRA: packed 4-bit codes are not weights; the adapters merge into the base reloaded from disk."""
    save_twin(twin("llama"), tmp_path / "base")
    model, tok = FastModel.from_pretrained(str(tmp_path / "base"), max_seq_length=64, patches=None)
    model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False).eval()
    tok = twin_bpe_tokenizer("smollm")
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    model.get_base_model().is_loaded_in_4bit = True  # what bitsandbytes sets (no bnb on this CPU)
    with torch.no_grad():
        ref = model(input_ids=_x()).logits
        for name, p in model.named_parameters():
            if "base_layer" in name:
                p.mul_(-1.0)  # stands in for packed codes: the in-memory base weights must not be exported
        path = write_gguf(model, tok, tmp_path / "gguf", quantization="f16")
        torch.testing.assert_close(_load(path)(input_ids=_x()).logits, ref, rtol=0, atol=2e-3)


def test_bad_input_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    model, tok = twin("llama"), twin_bpe_tokenizer("smollm")
    out = tmp_path / "out"
    with pytest.raises(FastkitError, match="quantization='q5_k'"):
        write_gguf(model, tok, out, quantization="q5_k")
    with pytest.raises(FastkitError, match="'dbrx' has no GGUF mapping"):
        write_gguf(twin("dbrx"), tok, out)
    with pytest.raises(FastkitError, match="never renormalizes"):  # llama.cpp's qwen2moe routing differs
        write_gguf(twin("qwen2_moe", norm_topk_prob=True), tok, out)
    with pytest.raises(FastkitError, match="dense layers"):
        write_gguf(twin("qwen2_moe", mlp_only_layers=[0]), tok, out)
    (tmp_path / "file").write_text("x")
    with pytest.raises(FastkitError, match="is a file"):
        write_gguf(model, tok, tmp_path / "file")
    with pytest.raises(FastkitError, match="is a file"):
        write_gguf(model, tok, tmp_path / "file" / "sub")
    monkeypatch.setattr(os, "access", lambda *a, **k: False)  # tests run as root: chmod would not stop us
    with pytest.raises(FastkitError, match="not writable"):
        write_gguf(model, tok, out)
    monkeypatch.undo()
    with pytest.raises(FastkitError, match="byte-level BPE"):
        write_gguf(model, object(), out)
    assert not out.exists()


@pytest.mark.slow
def test_smollm2_quickstart_model_round_trips(tmp_path):
    """The real SmolLM2-135M-Instruct (offline, from the quickstart package), LoRA merged, as q8_0."""
    from fastkit.quickstart import smollm2_135m_instruct

    model, tok = FastModel.from_pretrained(smollm2_135m_instruct(), max_seq_length=128, dtype=torch.float32)
    model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False)
    torch.manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    model.eval()
    prompt = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    x = tok(prompt, return_tensors="pt")["input_ids"]
    path = write_gguf(model, tok, tmp_path, quantization="q8_0")
    with torch.no_grad():
        ref = model(input_ids=x).logits
        got = _load(path)(input_ids=x).logits
    assert (got - ref).abs().max().item() < 2.5  # measured ~1.2 on logits up to ~38
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    back = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=os.path.basename(path))
    assert back.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == prompt
    assert back(prompt)["input_ids"] == tok(prompt)["input_ids"]
    field = gguf.GGUFReader(path).fields["tokenizer.ggml.pre"]
    assert bytes(field.parts[field.data[0]]).decode() == "smollm"  # the name llama.cpp gives SmolLM2's split


def test_4bit_experts_are_dequantized_into_the_file(tmp_path):
    """fastkit's NF4 experts hold their codes in buffers: the file must carry them dequantized (it had no expert
    tensors at all), equal to the 16-bit model with the dequantized expert weights."""
    from tests.gguf_round_trip import moe_4bit_model

    quantized, reference, tok = moe_4bit_model()
    path = write_gguf(quantized, tok, tmp_path, quantization="f16")
    names = {t.name for t in gguf.GGUFReader(path).tensors}
    assert {f"blk.{i}.ffn_{k}_exps.weight" for i in range(2) for k in ("gate", "up", "down")} <= names
    back = _load(path, reference.config)
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=_x()).logits, reference(input_ids=_x()).logits, rtol=0, atol=2e-3)


def test_moe_without_its_experts_is_refused(tmp_path, monkeypatch):
    import fastkit.export.gguf.writer as ge

    model = twin("qwen3_moe")
    monkeypatch.setattr(ge, "_dequantized_experts", lambda base: [])  # a storage fastkit cannot read
    from fastkit.patches.moe.nf4 import quantize_experts

    quantize_experts(model)
    with pytest.raises(FastkitError, match="expert tensors"):
        write_gguf(model, twin_bpe_tokenizer("qwen2"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("pre", ["smollm", "llama-bpe"])
def test_gguf_loaded_tokenizer_splits_as_in_training(tmp_path, pre):
    """FastModel.from_pretrained(gguf_file=...) puts back the split the file names (transformers' GGUF reader drops
    ``tokenizer.ggml.pre``: a llama GGUF comes back with Llama-3's split and merges used): SmolLM2's vocabulary
    cuts every digit alone again, Llama-3's looks whole pieces up before merging; ids equal the trained tokenizer's."""
    tok = twin_bpe_tokenizer(pre)
    path = write_gguf(twin("llama"), tok, tmp_path, quantization="f16")
    _, back = FastModel.from_pretrained(str(tmp_path), gguf_file=os.path.basename(path), max_seq_length=64)
    for text in ["Total: $1,234.56 in 2023 -- 1234567 IT'S fine", "x   \n\n  y\t'Re 12345"]:
        want = tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)
        assert back.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text) == want
        assert back(text, add_special_tokens=False)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    assert back.backend_tokenizer.model.ignore_merges == tok.backend_tokenizer.model.ignore_merges


_SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128)


def test_gemma_and_phi3_files_carry_the_family_rules(tmp_path):
    """The registry's GGUFRules in the file: Gemma's norms +1 (q/k norms too), the window and which layers have it,
    the soft-caps, Gemma 3's per-layer-type rope; Phi-3's fused tensors as they are and partial rotary dims."""
    tok = twin_bpe_tokenizer("gpt-2")
    rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e4},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}
    model = twin("gemma3_text", **_SMALL, query_pre_attn_scalar=16, sliding_window=8, rope_parameters=rope,
                 layer_types=["full_attention", "sliding_attention"])
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    reader = gguf.GGUFReader(write_gguf(model, tok, tmp_path / "g3", quantization="f16"))
    tensors = {t.name: t for t in reader.tensors}
    for hf, name in (("model.norm.weight", "output_norm.weight"),
                     ("model.layers.1.self_attn.q_norm.weight", "blk.1.attn_q_norm.weight"),
                     ("model.layers.0.post_feedforward_layernorm.weight", "blk.0.post_ffw_norm.weight")):
        want = model.get_parameter(hf).detach() + 1
        assert torch.allclose(torch.from_numpy(tensors[name].data.copy()), want), name
    fields = reader.fields
    assert [bool(fields["gemma3.attention.sliding_window_pattern"].contents()[i]) for i in range(2)] == [False, True]
    assert fields["gemma3.attention.sliding_window"].contents() == 8
    assert fields["gemma3.rope.freq_base"].contents() == 1e4
    assert fields["gemma3.rope.freq_base_swa"].contents() == 100.0
    assert fields["gemma3.rope.scaling.factor"].contents() == 8.0
    g2 = twin("gemma2", **_SMALL, query_pre_attn_scalar=16, attn_logit_softcapping=0.5, final_logit_softcapping=1.0)
    fields = gguf.GGUFReader(write_gguf(g2, tok, tmp_path / "g2", quantization="f16")).fields
    assert fields["gemma2.attn_logit_softcapping"].contents() == 0.5
    assert fields["gemma2.final_logit_softcapping"].contents() == 1.0
    phi = twin("phi3", **_SMALL, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                   "partial_rotary_factor": 0.5})
    reader = gguf.GGUFReader(write_gguf(phi, twin_bpe_tokenizer("dbrx"), tmp_path / "phi", quantization="f16"))
    assert reader.fields["phi3.rope.dimension_count"].contents() == 8
    assert reader.fields["general.name"].contents() == "phi_3-finetune"  # llama.cpp's phi3 token rules stay off
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}
    assert shapes["blk.0.attn_qkv.weight"] == (64, 64 + 2 * 32) and shapes["blk.0.ffn_up.weight"] == (64, 256)


def test_what_gemma_and_phi3_graphs_cannot_express_is_refused(tmp_path):
    tok, out = twin_bpe_tokenizer("gpt-2"), tmp_path / "out"
    gemma2 = dict(_SMALL, query_pre_attn_scalar=16)
    cases = [
        (twin("gemma2", **gemma2, tie_word_embeddings=False), "untied lm_head"),
        (twin("gemma2", **dict(gemma2, query_pre_attn_scalar=64)), "query_pre_attn_scalar=64"),
        (twin("gemma2", **gemma2, attn_logit_softcapping=None), "always soft-caps"),
        (twin("gemma2", **gemma2, hidden_activation="gelu"), "activation 'gelu'"),
        (twin("gemma3_text", **gemma2, attn_logit_softcapping=20.0), "no such soft-capping"),
        (twin("gemma3_text", **gemma2, rope_parameters={
            "full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}), "rope types default, linear"),
        (twin("phi3", **_SMALL, sliding_window=16), "16-token sliding window"),  # llama.cpp turns Phi-3's off
        (twin("phi3", **_SMALL, rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                                                 "long_factor": [2.0] * 8, "original_max_position_embeddings": 64}),
         "rope types default"),
    ]
    for model, message in cases:
        with pytest.raises(FastkitError, match=message):
            write_gguf(model, tok, out)
    assert not out.exists()


def test_gpt_oss_file_has_llama_cpp_expert_layout_sinks_and_yarn(tmp_path):
    """GPT-OSS's interleaved (E, H, 2I) gate/up experts come out as llama.cpp's (E, I, H) gate and up (biases split
    alike, kept f32), down_proj transposed, sinks and router bias in f32, YaRN and the alternating windows in the
    metadata; a tied head (llama.cpp's graph needs its own) and other SwiGLU clamps are refused."""
    model = twin("gpt_oss")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    reader = gguf.GGUFReader(write_gguf(model, twin_bpe_tokenizer("gpt-4o"), tmp_path / "g", quantization="q8_0"))
    tensors = {t.name: t for t in reader.tensors}
    experts = model.model.layers[0].mlp.experts

    def f32(name):
        assert tensors[name].tensor_type == gguf.GGMLQuantizationType.F32, name
        return torch.from_numpy(tensors[name].data.copy())

    assert torch.equal(f32("blk.0.ffn_gate_exps.bias"), experts.gate_up_proj_bias[:, ::2])
    assert torch.equal(f32("blk.0.ffn_up_exps.bias"), experts.gate_up_proj_bias[:, 1::2])
    assert torch.equal(f32("blk.0.ffn_down_exps.bias"), experts.down_proj_bias)
    assert torch.equal(f32("blk.0.attn_sinks.weight"), model.model.layers[0].self_attn.sinks)
    assert torch.equal(f32("blk.0.ffn_gate_inp.bias"), model.model.layers[0].mlp.router.bias)
    e, h, two_i = experts.gate_up_proj.shape
    for name in ("blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight"):
        assert tuple(int(d) for d in reversed(tensors[name].shape)) == (e, two_i // 2, h)
    assert tuple(int(d) for d in reversed(tensors["blk.0.ffn_down_exps.weight"].shape)) == (e, h, two_i // 2)
    dq = gguf.quants.dequantize(tensors["blk.0.ffn_up_exps.weight"].data, gguf.GGMLQuantizationType.Q8_0)
    assert torch.allclose(torch.from_numpy(dq), experts.gate_up_proj[..., 1::2].transpose(1, 2), atol=3e-3)
    fields = reader.fields
    assert fields["gpt-oss.rope.scaling.type"].contents() == "yarn"
    assert fields["gpt-oss.rope.scaling.factor"].contents() == model.config.rope_parameters["factor"]
    assert fields["gpt-oss.expert_count"].contents() == model.config.num_local_experts
    pattern = fields["gpt-oss.attention.sliding_window_pattern"].contents()
    assert [bool(x) for x in pattern] == [t == "sliding_attention" for t in model.config.layer_types]
    tok, out = twin_bpe_tokenizer("gpt-4o"), tmp_path / "out"
    with pytest.raises(FastkitError, match="tie_word_embeddings=True"):
        write_gguf(twin("gpt_oss", tie_word_embeddings=True), tok, out)
    with pytest.raises(FastkitError, match="swiglu_limit=5.0"):
        write_gguf(twin("gpt_oss", swiglu_limit=5.0), tok, out)
    assert not out.exists()


def test_gpt_oss_4bit_experts_go_in_dequantized_in_llama_cpp_layout(tmp_path):
    """GPT-OSS with fastkit's 4-bit experts (codes in buffers, stored in the (E, H, 2I) parameter layout): the file
    carries them dequantized, de-interleaved and transposed like the 16-bit ones, and the biases (kept 16-bit)."""
    from fastkit.patches.moe.nf4 import NF4Experts, quantize_experts

    model = twin("gpt_oss")
    quantize_experts(model)
    q = model.model.layers[1].mlp.experts.gate_up_proj
    assert isinstance(q, NF4Experts)
    reader = gguf.GGUFReader(write_gguf(model, twin_bpe_tokenizer("gpt-4o"), tmp_path, quantization="f16"))
    tensors = {t.name: t for t in reader.tensors}
    w = q.dequantize().float()  # (E, H, 2I)
    for name, half in (("blk.1.ffn_gate_exps.weight", w[..., ::2]), ("blk.1.ffn_up_exps.weight", w[..., 1::2])):
        got = torch.from_numpy(tensors[name].data.astype("float32"))
        torch.testing.assert_close(got, half.transpose(1, 2), rtol=1e-3, atol=1e-4)
    assert "blk.1.ffn_down_exps.bias" in tensors


def test_family_facts_are_read_off_the_row_at_call_time(tmp_path, monkeypatch):
    """A row changed (or added) at run time reaches save_gguf: its architecture and its router rule."""
    import dataclasses

    from fastkit import registry

    tok = twin_bpe_tokenizer("qwen2")
    row = registry.MODEL_TABLE["qwen3"]
    monkeypatch.setitem(registry.MODEL_TABLE, "qwen3", dataclasses.replace(row, gguf_arch=None))
    with pytest.raises(FastkitError, match="model_type 'qwen3' has no GGUF mapping"):
        write_gguf(twin("qwen3"), tok, tmp_path / "a")
    moe = registry.MODEL_TABLE["qwen3_moe"]
    rules = dataclasses.replace(moe.gguf, router_renorm="never")
    monkeypatch.setitem(registry.MODEL_TABLE, "qwen3_moe", dataclasses.replace(moe, gguf=rules))
    with pytest.raises(FastkitError, match="qwen3moe never renormalizes"):
        write_gguf(twin("qwen3_moe"), tok, tmp_path / "b")
    monkeypatch.setitem(registry.MODEL_TABLE, "qwen3", row)
    assert os.path.exists(write_gguf(twin("qwen3"), tok, tmp_path / "c", quantization="f16"))


def test_every_quantization_name_is_one_quant_spec():
    from fastkit.export.gguf.writer import LLAMA_CPP_QUANTS, QUANTS, WRITTEN

    for name, spec in QUANTS.items():
        assert gguf.GGMLQuantizationType[spec.ggml_type].name.lower() in (name, name[:4])  # q4_k_m -> Q4_K
        assert gguf.LlamaFileType[spec.file_type].name.lower().endswith(name)
        assert 0 < spec.tolerance < 1
    assert set(WRITTEN) | set(LLAMA_CPP_QUANTS) == set(QUANTS) and not set(WRITTEN) & set(LLAMA_CPP_QUANTS)
    with pytest.raises(FastkitError, match="use one of f16, bf16, q8_0, q4_0, q4_k_m, q5_k_m, q6_k"):
        write_gguf(twin("llama"), twin_bpe_tokenizer(), "/tmp/unused", quantization="q3_k")


def test_moe_read_back_checks_weights_not_routed_logits(tmp_path, monkeypatch):
    """A trained qwen3_moe twin at q8_0: rounding flips 1 of 32 probe tokens' expert choice (0.09 of the logit scale
    in any q8_0 file of it), so the read-back compares every tensor within q8_0's rounding; it saves. Gate and up
    halves swapped in the file: refused."""
    from fastkit.export import save_gguf as save_verified
    from fastkit.export.gguf import writer

    model, tok = rt.twin_model("qwen3_moe (qwen2)")
    assert os.path.exists(save_verified(model, tok, tmp_path / "ok", quantization="q8_0"))
    pieces = writer._expert_pieces

    def swapped(*args):
        out = pieces(*args)
        return [(n, f) for (n, _), (_, f) in zip(out, out[::-1], strict=True)] if len(out) == 2 else out

    monkeypatch.setattr(writer, "_expert_pieces", swapped)
    with pytest.raises(FastkitError, match="gate_up_proj reads back"):
        save_verified(model, tok, tmp_path / "bad", quantization="q8_0")
    assert not (tmp_path / "bad").exists()


def _sharp_attention_twin():
    """A llama twin with its attention made hot: q/k x80 (scores x6,400: a saturated softmax with near-ties between
    keys) and v/o x10. Every f16 tensor is within 2^-11 of the model's, yet the rounding moves its logits by ~0.14 of
    their scale: what a model diverged by a loss spike looks like (a fixed 1% logit bound once refused the
    quickstart's f16 file in CI, at 0.0116)."""
    model = twin("llama")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(k in name for k in ("q_proj", "k_proj")):
                p.mul_(80)
            elif any(k in name for k in ("v_proj", "o_proj")):
                p.mul_(10)
    return model, twin_bpe_tokenizer(PRE["llama"])


def test_read_back_bounds_follow_the_file_not_the_models_conditioning(tmp_path, caplog):
    """save_gguf's check: each tensor within its quantization's rounding, and the file's model on the exact weights
    within fp32 noise. The sharp twin's f16 file saves although its rounding moves the logits by more than 1% of their
    scale (the old bound: red before this check); the log says by how much."""
    import logging
    import re

    from fastkit.export import save_gguf as save_verified
    from fastkit.export.gguf.writer import QUANTS

    model, tok = _sharp_attention_twin()
    with caplog.at_level(logging.INFO, logger="fastkit"):
        assert os.path.exists(save_verified(model, tok, tmp_path, quantization="f16"))
    line = next(r.getMessage() for r in caplog.records if "save_gguf verified" in r.getMessage())
    tensors, exact, moved = map(float, re.search(r"within (\S+) of its scale .* within (\S+) of the logit scale; "
                                                  r"f16 moves the logits by (\S+) ", line).groups())
    assert tensors <= 2.0 ** -11 and exact <= 1e-5, line  # a correct file: rounding only; the same model around it
    assert moved > 3 * QUANTS["f16"].tolerance, line  # what a logit bound on the file would have refused


def test_wrong_metadata_in_the_file_is_refused_on_exact_weights(tmp_path, monkeypatch):
    """Every tensor right but the rope base written x4 (the file's model differs, not its weights): the exact-weights
    logits catch it on the sharp twin, whose rounding alone moves its logits by 0.14 (a logit bound loose enough
    for that would not see this); nothing is left behind. (A random twin's near-uniform attention hardly feels its
    rope: its hot attention is what makes the rope base matter.)"""
    from fastkit.export import save_gguf as save_verified

    real = gguf.GGUFWriter.add_rope_freq_base
    monkeypatch.setattr(gguf.GGUFWriter, "add_rope_freq_base", lambda self, v: real(self, 4 * v))
    model, tok = _sharp_attention_twin()
    with pytest.raises(FastkitError, match="does not match the model in memory .*max \\|Δlogit\\|"):
        save_verified(model, tok, tmp_path / "bad", quantization="f16")
    assert not (tmp_path / "bad").exists()


def test_minimax_m2_reads_back_in_transformers(tmp_path):
    """MiniMax-M2 (llama.cpp's minimax-m2; transformers' GGUF reader has it): save_gguf's read-back passes in f16 and
    q8_0, and the f16 file reloads to the model's logits, its router's selection bias (exp_probs_b) included."""
    from fastkit.export import save_gguf as save_verified
    from tests import gguf_round_trip as rt

    model, tok = rt.twin_model("minimax_m2 (gpt-2)", steps=2)
    assert os.path.exists(save_verified(model, tok, tmp_path / "q8", quantization="q8_0"))
    path = save_verified(model, tok, tmp_path / "f16", quantization="f16")
    back = _load(path, model.config)
    name = "model.layers.1.mlp.e_score_correction_bias"
    assert back.get_buffer(name).abs().max() > 0
    assert torch.equal(back.get_buffer(name), model.base_model.model.get_buffer(name))
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=_x()).logits, model(input_ids=_x()).logits, rtol=0, atol=2e-3)
def test_dense_family_files_carry_their_rules(tmp_path):
    """The dense rows' GGUFRules in the file: LayerNorm epsilon under llama.cpp's LayerNorm key (starcoder2, cohere2),
    Cohere's logit scale and window pattern, OLMo 3's windows and full layers' YaRN, GLM-4's half-head rope and fused
    gate_up_proj."""
    def fields(model, pre, name):
        return gguf.GGUFReader(write_gguf(model, twin_bpe_tokenizer(pre), tmp_path / name, quantization="f16"))

    r = fields(twin("starcoder2", norm_epsilon=1e-3), "smollm", "sc2")
    assert r.fields["starcoder2.attention.layer_norm_epsilon"].contents() == pytest.approx(1e-3)
    assert "starcoder2.attention.layer_norm_rms_epsilon" not in r.fields
    assert "blk.0.ffn_up.bias" in {t.name for t in r.tensors} and "output_norm.bias" in {t.name for t in r.tensors}
    r = fields(twin("cohere2", logit_scale=0.5), "smollm", "co2")
    assert r.fields["cohere2.logit_scale"].contents() == 0.5
    assert [bool(x) for x in r.fields["cohere2.attention.sliding_window_pattern"].contents()] == [True, False]
    rope = {"full_attention": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0,
                               "original_max_position_embeddings": 64},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    r = fields(twin("olmo3", rope_parameters=rope), "dbrx", "olmo3")
    assert r.fields["general.architecture"].contents() == "olmo2"
    assert r.fields["olmo2.attention.sliding_window"].contents() == 8
    assert [bool(x) for x in r.fields["olmo2.attention.sliding_window_pattern"].contents()] == [True, False]
    assert r.fields["olmo2.rope.scaling.type"].contents() == "yarn"
    assert r.fields["olmo2.rope.freq_base"].contents() == 1e4
    r = fields(twin("glm4"), "dbrx", "glm4")
    assert r.fields["glm4.rope.dimension_count"].contents() == 8  # partial_rotary_factor 0.5 of head_dim 16
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in r.tensors}
    assert shapes["blk.0.ffn_up.weight"] == (64, 256)  # gate and up fused, as glm4.cpp reads them


def test_what_dense_family_graphs_cannot_express_is_refused(tmp_path):
    """Each dense row's hard-coded facts (registry GGUFRules), refused before anything is written, naming the key."""
    out = tmp_path / "out"
    cases = [
        (twin("smollm3", no_rope_layers=[1, 0]), "no_rope_layers"),  # llama.cpp: no rope on every 4th layer only
        (twin("smollm3", attention_bias=True), "attention_bias=True"),
        (twin("smollm3", use_sliding_window=True, sliding_window=8), "8-token sliding window"),
        (twin("olmo2", tie_word_embeddings=True), "tie_word_embeddings=True"),
        (twin("olmo2", attention_bias=True), "attention_bias=True"),
        (twin("olmo3", rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                                        "sliding_attention": {"rope_type": "linear", "factor": 2.0,
                                                              "rope_theta": 1e4}}), "rope types default, yarn"),
        (twin("olmo3", rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 1e2}}),
         "rope_theta 100.0 and full layers' 10000.0"),  # olmo2.cpp ropes every layer with one base
        (twin("starcoder2", use_bias=False), "use_bias=False"),
        (twin("starcoder2", hidden_act="gelu"), "activation 'gelu'"),
        (twin("starcoder2", sliding_window=8), "8-token sliding window"),
        (twin("cohere2", tie_word_embeddings=False), "untied lm_head"),
        (twin("cohere2", attention_bias=True), "attention_bias=True"),
        (twin("exaone4"), "exactly at 64 layers"),  # windowed at 2 layers: llama.cpp turns exaone4's windows off
        (twin("exaone4", num_hidden_layers=64, sliding_window=None, layer_types=["full_attention"] * 64),
         "exactly at 64 layers"),  # window-less at 64 layers: llama.cpp turns them on (every 4th layer full)
        (twin("ernie4_5", use_bias=True), "use_bias=True"),
    ]
    for model, message in cases:
        with pytest.raises(FastkitError, match=message):
            write_gguf(model, twin_bpe_tokenizer("gpt-2"), out)
    assert not out.exists()


_DENSE = [label for label in rt.TWINS if "64 layers" not in label and label.split()[0] in (
    "smollm3", "olmo2", "olmo3", "starcoder2", "glm4", "cohere2", "exaone4", "ernie4_5")]


@pytest.mark.parametrize("label", _DENSE)
def test_dense_family_saves_verified_and_its_reader_flag_is_true(tmp_path, label):
    """save_gguf (the verified save) on each dense twin: read back by transformers' GGUF reader where the row says it
    can (``GGUFRules.reader``), and where it says it cannot, the reader really refuses the file (a wrong flag either
    fails the save or skips a check that could run)."""
    from fastkit import registry
    from fastkit.export import save_gguf

    model_type, overrides, pre = rt.TWINS[label]
    path = save_gguf(twin(model_type, **overrides), twin_bpe_tokenizer(pre), tmp_path / "out", quantization="q8_0")
    if not registry.MODEL_TABLE[model_type].gguf.reader:
        with pytest.raises(ValueError, match="not supported"):
            _load(path)


@pytest.mark.parametrize("label", ["ministral (tekken)", "exaone (gpt-2)", "internlm3 (gpt-2)", "helium (gpt-2)",
                                   "gpt2 (gpt-2)"])
def test_llama_graph_families_read_back_in_transformers(tmp_path, label):
    """Ministral, EXAONE 3, InternLM3 and Helium go out as llama.cpp's llama graph (transformers builds EXAONE /
    InternLM3 as LlamaForCausalLM), which transformers' GGUF reader has: save_gguf's read-back passes, and the f16 file
    reloads to the model's logits (q/k rows un-permuted; Helium's, stored interleaved, come back in Llama's order).
    GPT-2 (llama.cpp's gpt2, which the reader has too): its Conv1D weights transposed back."""
    from fastkit import registry
    from fastkit.export import save_gguf as save_verified
    from tests import gguf_round_trip as rt

    model, tok = rt.twin_model(label, steps=2)
    path = save_verified(model, tok, tmp_path, quantization="f16")
    config = registry.MODEL_TABLE[rt.TWINS[label][0]].gguf.reader_config  # the reader lacks GPT-2's n_inner
    back = _load(path, model.config if config else None)
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=_x()).logits, model(input_ids=_x()).logits, rtol=0, atol=2e-3)
