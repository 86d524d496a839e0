"""Every twin family runs forward + backward; the tokenizer round-trips and formats chats."""

import pytest
import torch

from fastkit import registry
from fastkit.families.twins import HUB_TWINS, TWIN_FAMILIES, twin, twin_config, twin_family
from tests.helpers import forward_backward


@pytest.mark.parametrize("model_type", TWIN_FAMILIES)
def test_twin_forward_backward(model_type):
    model = twin(model_type, num_hidden_layers=2).train()
    assert model.config.model_type == model_type
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    x = torch.randint(3, 259, (2, 16))
    step = forward_backward(model, x)
    assert torch.isfinite(step.loss)
    grads = list(step.grads.values())
    assert all(g is not None for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)


def test_twins_keep_family_traits():
    assert twin_config("gpt_oss", num_hidden_layers=4).layer_types == [
        "sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    assert twin_config("mistral").sliding_window == 64
    cfg = twin_config("qwen3_moe")
    assert cfg.num_attention_heads // cfg.num_key_value_heads == 2  # GQA kept
    assert hasattr(twin("qwen3").model.layers[0].self_attn, "q_norm")
    assert twin("deepseek_v3").model.layers[1].mlp.shared_experts is not None


def test_twin_is_deterministic():
    a, b = twin("llama", seed=3), twin("llama", seed=3)
    for (na, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), na


def test_tokenizer_roundtrip_and_chat_template(tokenizer):
    text = "héllo wörld 🦙\n{\"a\": 1}"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    rendered = tokenizer.apply_chat_template(msgs, tokenize=False)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
    assert max(tokenizer(rendered)["input_ids"]) < twin_config("llama").vocab_size
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)


def test_hub_twin_table():
    assert twin_family("openai/gpt-oss-20b")[0] == "gpt_oss"
    assert set(fam for fam, _ in HUB_TWINS.values()) <= set(registry.MODEL_TABLE)  # every twin family has a row
    assert twin_family("phi3") == ("phi3", {})  # any row is a twin: sizes from the row, else shrunk defaults
    with pytest.raises(ValueError, match="No twin"):
        twin_family("nobody/nothing")


def test_changing_one_twins_config_leaves_the_next_twin_as_the_row_says():
    """The row's nested values (a dict, a list) are copied into each twin's config, never shared: a random-order run
    found a test's ``rope_parameters`` change reaching every vision twin built after it."""
    from fastkit.families.vision import vision_twin_config

    first = twin_config("deepseek_v3")
    first.rope_parameters["rope_theta"] = -1.0
    assert twin_config("deepseek_v3").rope_parameters["rope_theta"] != -1.0
    first = vision_twin_config("qwen2_5_vl")
    first.text_config.rope_parameters["mrope_interleaved"] = "changed"
    assert vision_twin_config("qwen2_5_vl").text_config.rope_parameters.get("mrope_interleaved") != "changed"
