"""4-bit experts stored while the checkpoint is read: bounded load memory, same bytes, exact MXFP4 for GPT-OSS."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Mxfp4Config

from fastkit import FastModel, _hf, loader
from fastkit.families.twins import twin
from fastkit.patches.moe.loading import QuantizeWhileLoading, mxfp4_from_values
from fastkit.patches.moe.nf4 import MXFP4Experts, NF4Experts, quantize_experts
from fastkit.patches.moe.patch import experts_modules
from tests.helpers import forward_backward, save_twin


def _ids(t=16):
    return torch.randint(3, 300, (2, t), generator=torch.Generator().manual_seed(1))


def _projection_bytes(model) -> list[int]:
    return [getattr(m, p).numel() * 4 for _, m in experts_modules(model) for p in ("gate_up_proj", "down_proj")]


def _no_16bit_experts_left(model) -> bool:
    return all(not isinstance(m._parameters.get(p), torch.Tensor) for _, m in experts_modules(model)
               for p in ("gate_up_proj", "down_proj", "up_proj"))


def test_quantize_as_read_holds_one_16bit_projection_and_stores_the_same_bytes(tmp_path):
    original = twin("qwen3_moe", num_hidden_layers=4)  # checkpoint: one tensor per expert, fused at load
    path = save_twin(original, tmp_path)
    sizes = _projection_bytes(original)
    hook = QuantizeWhileLoading()
    with _hf.on_param_loaded(hook):
        loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert hook.nf4 == len(sizes) == 8 and hook.mxfp4 == 0 and _no_16bit_experts_left(loaded)
    assert 0 < hook.peak_16bit_bytes <= max(sizes) < sum(sizes)  # one projection alive, never the layer's or model's
    after = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    quantize_experts(after)  # the old way: whole 16-bit model first
    want = dict(after.named_buffers())
    for name, buf in loaded.named_buffers():
        assert torch.equal(buf, want[name]), name  # byte for byte what quantize_experts stores


def test_from_pretrained_4bit_quantizes_during_the_load_not_after(tmp_path, monkeypatch):
    path = save_twin(twin("qwen3_moe"), tmp_path)
    seen = []

    def spy(model, *a, **k):  # what the loader finds once from_pretrained returns
        seen.append(_no_16bit_experts_left(model))
        return quantize_experts(model, *a, **k)

    monkeypatch.setattr(loader, "quantize_experts", spy)
    model, _ = FastModel.from_pretrained(str(path), load_in_4bit=True, max_seq_length=64)
    assert seen == [True]
    assert all(isinstance(m.gate_up_proj, NF4Experts) for _, m in experts_modules(model))
    forward_backward(FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False), _ids())


def _mxfp4_checkpoint(path, seed=0):
    """A GPT-OSS twin saved the way GPT-OSS ships: experts as MXFP4 ``_blocks``/``_scales`` + quantization_config."""
    save_twin(twin("gpt_oss"), path)
    g = torch.Generator().manual_seed(seed)
    sd = load_file(f"{path}/model.safetensors")
    for k in [k for k in sd if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, d_in, d_out = sd.pop(k).shape  # GPT-OSS (E, in, out); the checkpoint holds (E, out, in/32, 16)
        sd[k + "_blocks"] = torch.randint(0, 256, (e, d_out, d_in // 32, 16), generator=g, dtype=torch.uint8)
        sd[k + "_scales"] = torch.randint(118, 124, (e, d_out, d_in // 32), generator=g, dtype=torch.uint8)
        sd[k + "_scales"][0, 0, 0] = 127  # and one all-zero block below
        sd[k + "_blocks"][0, 0, 0] = 0
    save_file(sd, f"{path}/model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_mxfp4_checkpoint_keeps_its_exact_values_at_4bit(tmp_path, dtype):
    path = _mxfp4_checkpoint(tmp_path)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, quantization_config=Mxfp4Config(dequantize=True))
    model, _ = FastModel.from_pretrained(str(path), load_in_4bit=True, max_seq_length=64, dtype=dtype)
    mods = dict(ref.named_modules())
    for name, m in experts_modules(model):
        for p in ("gate_up_proj", "down_proj"):
            q, want = getattr(m, p), getattr(mods[name], p)
            assert isinstance(q, MXFP4Experts), f"{name}.{p} was requantized"
            assert torch.equal(torch.stack([q.in_out(i) for i in range(q.num_experts)]), want)  # the shipped values
    with torch.no_grad():
        torch.testing.assert_close(model(_ids()).logits.float(), ref(_ids()).logits.float(),
                                   atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=1e-5)


def test_mxfp4_from_values_round_trips_blocks_and_refuses_other_values():
    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (3, 16, 2, 16), generator=g, dtype=torch.uint8)  # (E, out, G, 16)
    scales = torch.randint(100, 140, (3, 16, 2), generator=g, dtype=torch.uint8)
    blocks[1, 2, 1] = 0  # an all-zero block
    values = MXFP4Experts(blocks, scales, dtype=torch.float32)
    w = torch.stack([values.in_out(i) for i in range(3)])  # (E, in=64, out=16)
    kept = mxfp4_from_values(w)
    assert kept is not None
    assert torch.equal(torch.stack([kept.in_out(i) for i in range(3)]), w)
    assert mxfp4_from_values(w + 1e-3) is None  # not MXFP4 values: NF4 instead
    assert mxfp4_from_values(torch.randn(2, 48, 8)) is None  # in not a multiple of 32


def test_adapter_trained_on_4bit_experts_loads_in_plain_peft_on_the_dequantized_model(tmp_path):
    from peft import PeftModel

    from fastkit.export import load_lora, save_lora
    from tests.helpers import train_lora_steps

    original = twin("qwen3_moe")
    path = save_twin(original, tmp_path / "base")
    model, tok = FastModel.from_pretrained(str(path), load_in_4bit=True, max_seq_length=64)
    ref = original  # the same twin with its expert weights replaced by the NF4 values fastkit trained on
    mods = dict(ref.named_modules())
    for name, m in experts_modules(model):
        for p in ("gate_up_proj", "down_proj"):
            getattr(mods[name], p).data.copy_(getattr(m, p).dequantize())
    model = train_lora_steps(FastModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False), 3)
    with torch.no_grad():
        want = model(input_ids=_ids()).logits
    save_lora(model, tok, tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["target_parameters"]
    plain = PeftModel.from_pretrained(ref, str(tmp_path / "adapter")).eval()  # unpatched transformers + PEFT
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=_ids()).logits, want, atol=1e-4, rtol=1e-4)
    fresh, _ = FastModel.from_pretrained(str(path), load_in_4bit=True, max_seq_length=64)
    again = load_lora(fresh, tmp_path / "adapter")  # and back onto 4-bit experts, to continue training
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=_ids()).logits, want, atol=1e-5, rtol=1e-5)
    assert any("fastkit_lora" in n for n, p in again.named_parameters() if p.requires_grad)
    forward_backward(again, _ids())
