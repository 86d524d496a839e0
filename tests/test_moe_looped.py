"""DBRX and Llama-4 (experts transformers still loops over / runs densely): fastkit routing, same numbers."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM

from fastkit.errors import FastkitError
from fastkit.patches.moe.patch import MoEConfig, MoEExpertsPatch
from fastkit.patching import apply_patch, revert
from fastkit.syncs import SyncCounter
from tests.helpers import assert_grads_close, forward_backward

CONFIGS = {
    "dbrx": lambda: CONFIG_MAPPING["dbrx"](
        d_model=64, n_heads=4, n_layers=2, max_seq_len=128, vocab_size=320,
        attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
        ffn_config=dict(ffn_hidden_size=32, moe_num_experts=8, moe_top_k=2)),
    "llama4_text": lambda: CONFIG_MAPPING["llama4_text"](
        hidden_size=64, intermediate_size=32, intermediate_size_mlp=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_hidden_layers=2, vocab_size=320, num_local_experts=8, num_experts_per_tok=2,
        interleave_moe_layer_step=1),
}


def _model(model_type):
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(CONFIGS[model_type](), dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():  # some of these inits leave weights at zero: give every matrix values
        for p in m.parameters():
            if p.dim() > 1 and p.abs().sum() == 0:
                p.normal_(0, 0.02)
    return m.train()


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_looped_family_logits_grads_and_syncs(model_type):
    base = _model(model_type)
    ids = torch.randint(3, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with SyncCounter() as upstream:
        want = forward_backward(base, ids)
    # upstream DBRX: nonzero + scalar reads per hit expert; upstream Llama-4: no sync, but every token runs through
    # all E experts (a dense bmm over E·T rows), E/K times the expert FLOPs fastkit spends.
    assert upstream.total > 2 if model_type == "dbrx" else upstream.total == 0
    for mode in ("auto", "loop"):
        m = copy.deepcopy(base)
        assert apply_patch(m, MoEExpertsPatch(None, MoEConfig(mode=mode)))[0]
        with SyncCounter(profile=True) as fwd:
            out = m(ids, labels=ids)
        with SyncCounter(profile=True) as bwd:
            out.loss.backward()
        assert bwd.total == 0 and fwd.total == 2  # one per layer: loop: the counts; auto: the first-forward check
        if mode == "auto":
            with SyncCounter(profile=True) as again:
                m(ids)
            assert again.total == 0
        got = forward_backward(m, ids)
        torch.testing.assert_close(got.logits, want.logits, atol=2e-5, rtol=1e-4)
        assert_grads_close(got.grads, want.grads, atol=2e-5, rtol=1e-4)
        revert(m)
        assert not any("forward" in vars(mod) for mod in m.modules())


def test_looped_family_bad_router_ids_name_the_layer():
    m = _model("dbrx")
    apply_patch(m, MoEExpertsPatch(None, MoEConfig(mode="loop")))
    experts = m.transformer.blocks[1].ffn.experts
    with pytest.raises(FastkitError, match=r"transformer\.blocks\.1\.ffn\.experts: router produced expert ids"):
        experts(torch.randn(1, 4, 64), torch.full((4, 2), 8), torch.full((4, 2), 0.5))
