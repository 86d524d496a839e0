"""NF4 attention linears beside MXFP4 experts (GPT-OSS): what fastkit.plan counts is what the loader builds."""

from __future__ import annotations

import pytest
import torch

from fastkit.twins import twin

pytest.importorskip("bitsandbytes")


def _nf4_bytes(module) -> int:
    w = module.weight
    state = w.quant_state
    nested = state.state2
    return w.numel() * w.element_size() + state.absmax.numel() * state.absmax.element_size() + \
        nested.absmax.numel() * nested.absmax.element_size()


def test_attention_linears_become_nf4_and_compute_the_dequantized_layer():
    import bitsandbytes as bnb
    import bitsandbytes.functional as bf

    from fastkit.linear_4bit import quantize_linears_4bit

    model = twin("gpt_oss", num_hidden_layers=2).eval()
    x = torch.randn(1, 5, model.config.hidden_size)
    attn = model.model.layers[0].self_attn
    count = quantize_linears_4bit(model, torch.float32)
    assert count == 4 * 2  # q, k, v, o per layer; experts, router, embeddings, lm_head untouched
    assert type(model.lm_head) is torch.nn.Linear and type(model.model.layers[0].mlp.router) is not bnb.nn.Linear4bit
    q = attn.q_proj
    assert isinstance(q, bnb.nn.Linear4bit) and not q.weight.requires_grad
    w = bf.dequantize_4bit(q.weight.data, q.weight.quant_state).to(torch.float32)  # (out, in)
    torch.testing.assert_close(q(x), torch.nn.functional.linear(x, w, q.bias), atol=1e-5, rtol=1e-5)


def test_planner_counts_the_nf4_linears_the_loader_builds():
    from fastkit.linear_4bit import quantize_linears_4bit
    from fastkit.plan import plan
    from fastkit.twins import twin_config

    config = twin_config("gpt_oss", num_hidden_layers=2, hidden_size=256, head_dim=64, num_attention_heads=4,
                         num_key_value_heads=2)
    config.quantization_config = {"quant_method": "mxfp4"}
    components = plan(config, gpu="cpu", load_in_4bit=True).components
    planned = components["weights: linear layers, NF4 + absmax (double quant)"]
    model = twin("gpt_oss", num_hidden_layers=2, hidden_size=256, head_dim=64, num_attention_heads=4,
                 num_key_value_heads=2)
    quantize_linears_4bit(model, torch.float32)
    built = sum(_nf4_bytes(m) for layer in model.model.layers for m in layer.self_attn.children()
                if hasattr(getattr(m, "weight", None), "quant_state"))
    assert built == pytest.approx(planned, rel=0.02), (built, planned)
