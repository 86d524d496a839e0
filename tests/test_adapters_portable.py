"""What save_lora writes loads in plain PEFT (no fastkit) and gives the fastkit model's logits, experts included."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel

from fastkit import FastkitError, FastModel
from fastkit.export import load_lora, save_lora
from fastkit.families.twins import twin
from fastkit.patches.moe.lora import add_expert_lora, expert_lora_modules
from fastkit.patches.moe.peft_format import add_to_peft_adapter, load_expert_lora
from tests.helpers import train_lora_steps

HUB = {"qwen3": "Qwen/Qwen3-0.6B", "qwen3_moe": "Qwen/Qwen3-30B-A3B", "gpt_oss": "openai/gpt-oss-20b"}


def _trained(family: str, steps: int = 3):
    """A fastkit twin with LoRA (experts too where the family has them), trained a few AdamW steps."""
    model, tok = FastModel.from_pretrained(HUB[family], max_seq_length=64, twin=True)
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False,
                                     target_experts=family != "qwen3")
    return train_lora_steps(model, steps), tok


def _saved(model, tok, path):
    """``(x, fastkit's logits on x)`` after ``save_lora(model, tok, path)``."""
    x = torch.randint(3, 259, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(input_ids=x).logits
    save_lora(model, tok, path)
    return x, ref


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "gpt_oss"])
def test_plain_peft_reproduces_fastkit_logits(tmp_path, family):
    model, tok = _trained(family)
    x, ref = _saved(model, tok, tmp_path)
    assert not (tmp_path / "fastkit_expert_lora.safetensors").exists()  # nothing only fastkit reads
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    if family != "qwen3":
        assert config["target_parameters"], "expert adapters must be PEFT target_parameters"
    plain = PeftModel.from_pretrained(twin(family), str(tmp_path)).eval()  # unpatched transformers + PEFT
    with torch.no_grad():
        got = plain(input_ids=x).logits
        base = twin(family)(input_ids=x).logits
    assert (base - ref).abs().max() > 1e-2  # the adapters matter, experts included
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_expert_factors_convert_exactly_and_load_back_into_fastkit(tmp_path):
    """gpt_oss experts: fastkit factors -> PEFT tensors -> fastkit factors, bit for bit; the reloaded
    fastkit model (fast path: fastkit's own factors) gives the original logits."""
    model, tok = _trained("gpt_oss")
    x, ref = _saved(model, tok, tmp_path)
    fresh, _ = FastModel.from_pretrained(HUB["gpt_oss"], max_seq_length=64, twin=True)
    fresh = load_lora(fresh, tmp_path, is_trainable=False).eval()  # PEFT: attention; experts: fastkit's factors
    want, got = dict(expert_lora_modules(model)), dict(expert_lora_modules(fresh))
    assert set(want) == set(got)
    for name, lora in want.items():
        for key, value in lora.state_dict().items():
            assert torch.equal(got[name].state_dict()[key], value), (name, key)
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=x).logits, ref, rtol=1e-5, atol=1e-5)


def test_expert_rank_and_scaling_different_from_the_adapter_travel_as_patterns(tmp_path):
    """Experts with their own rank / alpha: written as rank_pattern / alpha_pattern, PEFT applies them."""
    model, tok = FastModel.from_pretrained(HUB["gpt_oss"], max_seq_length=64, twin=True)
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False)
    add_expert_lora(model, r=2, lora_alpha=7)
    for _, lora in expert_lora_modules(model):
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.05)
    x = torch.randint(3, 259, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model.eval()(input_ids=x).logits
    save_lora(model, tok, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert set(config["rank_pattern"].values()) == {2}
    plain = PeftModel.from_pretrained(twin("gpt_oss"), str(tmp_path)).eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=x).logits, ref, rtol=1e-5, atol=1e-5)


def test_adding_expert_factors_needs_a_peft_adapter_folder(tmp_path):
    model = twin("gpt_oss")
    add_expert_lora(model, r=2)
    with pytest.raises(FastkitError, match="No PEFT adapter"):
        add_to_peft_adapter(model, str(tmp_path))


def test_peft_own_expert_adapter_is_refused_by_the_factor_loader_but_loads_in_peft(tmp_path):
    """qwen3_moe "all-linear": PEFT adapts the experts (and the router) itself. fastkit's factors cannot hold
    the router's update, so load_expert_lora refuses before attaching anything; PEFT loads it on a fastkit
    model, whose moe patch runs it per expert group, and gives the same logits."""
    model, tok = _trained("qwen3_moe")
    x, ref = _saved(model, tok, tmp_path)
    fresh, _ = FastModel.from_pretrained(HUB["qwen3_moe"], max_seq_length=64, twin=True)
    with pytest.raises(FastkitError, match="not an expert projection"):
        load_expert_lora(fresh, str(tmp_path))
    assert expert_lora_modules(fresh) == []
    loaded = PeftModel.from_pretrained(fresh, str(tmp_path)).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x).logits, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("damage", ["drop_key", "wrong_shape"])
def test_a_damaged_expert_adapter_leaves_the_model_unchanged(tmp_path, damage):
    """A key missing from the adapter file is refused before the factors are attached; a factor whose shape
    does not fit detaches them again: either way no expert LoRA is left on the model."""
    from safetensors.torch import load_file, save_file

    from fastkit.patches.moe.peft_format import load_into
    from fastkit.patching import active_patches

    model, tok = _trained("gpt_oss", steps=1)
    save_lora(model, tok, tmp_path)
    experts = ["gate_up_proj", "down_proj"]  # the router's adapter is PEFT's to load
    assert load_into(twin("gpt_oss"), str(tmp_path), targets=experts)  # intact: it loads
    path = tmp_path / "adapter_model.safetensors"
    tensors = load_file(path)
    key = next(k for k in tensors if "experts" in k and k.endswith("lora_A.weight"))
    if damage == "drop_key":
        tensors.pop(key)
    else:
        tensors[key] = tensors[key][:, :-1].contiguous()  # one input column short
    save_file(tensors, path)
    fresh = twin("gpt_oss")
    with pytest.raises((FastkitError, RuntimeError), match="lacks|size|shape"):
        load_into(fresh, str(tmp_path), targets=experts)
    assert not expert_lora_modules(fresh) and "moe_lora" not in active_patches(fresh)
