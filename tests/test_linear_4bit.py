"""What fastkit.plan counts is what the loader builds: NF4 attention linears beside MXFP4 experts (GPT-OSS),
activation offload on by default where the plan needs it."""

from __future__ import annotations

import pytest
import torch

from fastkit.families.twins import twin

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

    from fastkit.patches.moe.linear_4bit import quantize_linears_4bit

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


def test_revert_restores_the_linear_modules():
    """``fastkit.revert`` undoes the swap: the same ``nn.Linear`` objects and weight ``Parameter`` objects are back,
    holding the NF4 layer's dequantized values (the 16-bit values are not kept: that is the memory saved)."""
    import bitsandbytes.functional as bf

    from fastkit.patches.moe.linear_4bit import quantize_linears_4bit
    from fastkit.patching import revert

    model = twin("gpt_oss", num_hidden_layers=2).eval()
    before = {n: (type(m), m, getattr(m, "weight", None)) for n, m in model.named_modules()}
    originals = {n: m.weight.detach().clone() for n, m in model.named_modules() if type(m) is torch.nn.Linear}
    ids = torch.randint(3, 259, (1, 7), generator=torch.Generator().manual_seed(0))
    assert quantize_linears_4bit(model, torch.float32) == 8
    nf4 = {n: bf.dequantize_4bit(m.weight.data, m.weight.quant_state).float()
           for n, m in model.named_modules() if hasattr(getattr(m, "weight", None), "quant_state")}
    with torch.no_grad():
        quantized = model(ids).logits
    assert revert(model) == [] and not hasattr(model, "_fastkit_patches")  # a change, not a listed patch
    after = {n: (type(m), m, getattr(m, "weight", None)) for n, m in model.named_modules()}
    assert after.keys() == before.keys()
    for n, (cls, module, weight) in before.items():
        assert after[n][0] is cls and after[n][1] is module and after[n][2] is weight, n
    assert set(nf4) < set(originals)  # the attention linears; lm_head / router were never swapped
    for n, w in originals.items():
        got = dict(model.named_modules())[n].weight
        assert got.shape == w.shape and got.dtype == w.dtype
        if n in nf4:
            assert torch.equal(got, nf4[n]), n  # the values the NF4 layer computed with
            assert (got - w).abs().max() <= 0.2 * w.abs().max(), n  # NF4 error of the original
        else:
            assert torch.equal(got, w), n
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, quantized, atol=1e-4, rtol=1e-4)


def test_planner_counts_the_nf4_linears_the_loader_builds():
    from fastkit.families.twins import twin_config
    from fastkit.patches.moe.linear_4bit import quantize_linears_4bit
    from fastkit.plan import plan

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


def test_offload_on_by_default_where_the_plan_needs_it():
    """Qwen3-14B QLoRA at 4,096 tokens on a T4: plain checkpointing does not fit, offload does."""
    from fastkit.plan import check_fits
    from tests.test_plan import _qwen3_14b

    result = check_fits(_qwen3_14b(), torch.device("cpu"), "t4", 4096, True)
    assert result.needs_offload and result.fits and result.inputs.offload
    assert not check_fits(_qwen3_14b(), torch.device("cpu"), "t4", 2048, True).needs_offload


def test_get_peft_model_auto_checkpointing_follows_the_report():
    from fastkit import FastModel, active_patches
    from fastkit.patches.offload.testing import OffloadTestConfig
    from fastkit.patching import report

    model, _ = FastModel.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct", max_seq_length=64, twin=True)
    assert report(model).checkpointing is True  # no plan on a CPU
    report(model).checkpointing = "offload"  # what a plan that needs offload leaves
    cpu = OffloadTestConfig(force_cpu_stream=True, min_tokens=1, min_bytes=0)  # offload's CPU rehearsal
    peft = FastModel.get_peft_model(model, r=4, offload_config=cpu)
    assert "offload" in active_patches(peft.get_base_model())


def test_fp16_compute_of_a_bf16_checkpoint_plans_the_fp32_residual_stream():
    """patches/fp16_residual.py keeps the stream fp32 in fp16: the checkpointed layer inputs take 4 bytes."""
    from fastkit.plan import plan
    from tests.test_plan import _qwen3_14b

    key = "checkpointed layer inputs (40 layers)"
    fp16 = plan(_qwen3_14b(), gpu="t4", load_in_4bit=True).components[key]
    bf16 = plan(_qwen3_14b(), gpu="t4", load_in_4bit=True, dtype=torch.bfloat16).components[key]
    assert fp16 == 40 * 5120 * 2048 * 4 == 2 * bf16
    saved_fp16 = _qwen3_14b()
    saved_fp16.dtype = torch.float16  # a checkpoint saved in fp16: fastkit leaves its stream alone
    assert plan(saved_fp16, gpu="t4", load_in_4bit=True).components[key] == bf16


def test_a_deepcopys_revert_refills_the_copy_not_the_original():
    """save_merged merges a deepcopy: its revert must act on the copy. The undo holds the linear's weight and the NF4
    layer as data (copied with the model), not in a closure over the original's objects."""
    import copy

    from fastkit.patches.moe.linear_4bit import quantize_linears_4bit
    from fastkit.patching import revert

    model = twin("gpt_oss", num_hidden_layers=1).eval()
    held = {n: m for n, m in model.named_modules() if type(m) is torch.nn.Linear and n.endswith("q_proj")}
    assert quantize_linears_4bit(model, torch.float32) == 4
    assert all(m.weight.numel() == 0 for m in held.values())  # the values live in the NF4 layers now
    duplicate = copy.deepcopy(model)
    revert(duplicate)
    assert all(type(m) is torch.nn.Linear and m.weight.numel() > 0 for n, m in duplicate.named_modules()
               if n.endswith("q_proj"))  # the copy refilled
    assert all(m.weight.numel() == 0 for m in held.values())  # the original's held linears untouched
    assert all(type(m) is not torch.nn.Linear for n, m in model.named_modules() if n.endswith("q_proj"))
    revert(model)  # and the original's own revert still refills its own
    assert all(dict(model.named_modules())[n] is m and m.weight.numel() > 0 for n, m in held.items())
