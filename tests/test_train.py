"""make_trainer refuses incompatible distributed modes at start; export saves adapters and merged weights."""

import pytest
import torch

from fastkit import FastkitError, FastModel, active_patches
from fastkit.export import save_lora, save_merged
from fastkit.patches.offload.testing import OffloadTestConfig
from fastkit.quickstart import quickstart_dataset
from fastkit.training import make_trainer


def _model(mode=True):
    model, tok = FastModel.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct", max_seq_length=128, twin=True)
    cfg = OffloadTestConfig(force_cpu_stream=True, min_tokens=1, min_bytes=0)
    return FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=mode, offload_config=cfg), tok


def _nonzero_adapters(model):
    """LoRA B starts at zero; give every adapter a visible effect."""
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)


def _assert_merged_matches(path, x, ref):
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(path, use_safetensors=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=x).logits, ref, rtol=1e-4, atol=1e-4)


def test_offload_with_fsdp_cpu_offload_is_refused_at_start(tmp_path):
    model, tok = _model("offload")
    assert "offload" in active_patches(model.get_base_model())
    train, _ = quickstart_dataset()
    with pytest.raises(FastkitError, match="FSDP CPU offload"):
        make_trainer(model, tok, train, max_steps=1, output_dir=str(tmp_path), fsdp="full_shard offload")
    with pytest.raises(FastkitError, match="FSDP CPU offload"):
        make_trainer(model, tok, train, max_steps=1, output_dir=str(tmp_path), fsdp="full_shard",
                     fsdp_config={"cpu_offload": True})


def test_save_lora_and_merged_roundtrip(tmp_path):
    model, tok = _model(False)
    _nonzero_adapters(model)
    x = torch.randint(3, 259, (1, 12))
    model.eval()
    with torch.no_grad():
        ref = model(input_ids=x).logits
    save_lora(model, tok, tmp_path / "lora")
    assert (tmp_path / "lora" / "adapter_model.safetensors").exists()
    save_merged(model, tok, tmp_path / "merged", dtype=torch.float32)
    _assert_merged_matches(tmp_path / "merged", x, ref)
    assert any("lora" in n for n, _ in model.named_parameters())  # the in-memory model keeps its adapters


def test_quantized_models_merge_into_reloaded_base(tmp_path):
    """The 4/8-bit path: adapters merged into the base reloaded from disk in 16/32-bit, on the CPU."""
    from transformers import AutoModelForCausalLM

    from fastkit.export.merge import merged_from_disk
    from fastkit.families.twins import twin
    from tests.helpers import save_twin

    save_twin(twin("llama"), tmp_path / "base")
    model, _ = FastModel.from_pretrained(str(tmp_path / "base"), max_seq_length=64, patches=None)
    model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False)
    _nonzero_adapters(model)
    x = torch.randint(3, 259, (1, 12))
    with torch.no_grad():
        ref = model.eval()(input_ids=x).logits
        merged = merged_from_disk(model, str(tmp_path / "base"), torch.float32)
        assert isinstance(merged, type(AutoModelForCausalLM.from_pretrained(tmp_path / "base")))
        torch.testing.assert_close(merged.eval()(input_ids=x).logits, ref, rtol=1e-4, atol=1e-4)


def test_target_experts_lora_saves_and_merges(tmp_path):
    """gpt_oss (PEFT does not adapt its experts): fastkit expert LoRA is added, saved with the
    adapters (as PEFT target_parameters), and folded into the merged weights."""
    from fastkit.patches.moe.lora import expert_lora_modules

    model, tok = FastModel.from_pretrained("openai/gpt-oss-20b", max_seq_length=64, twin=True)
    model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False, target_experts=True)
    assert expert_lora_modules(model)
    _nonzero_adapters(model)
    x = torch.randint(3, 259, (1, 12))
    with torch.no_grad():
        ref = model.eval()(input_ids=x).logits
    save_lora(model, tok, tmp_path / "lora")
    import json

    config = json.loads((tmp_path / "lora" / "adapter_config.json").read_text())  # experts in PEFT's own format
    assert any(t.endswith("experts.gate_up_proj") for t in config["target_parameters"])
    save_merged(model, tok, tmp_path / "merged", dtype=torch.float32)
    _assert_merged_matches(tmp_path / "merged", x, ref)


def test_offload_with_accelerate_fsdp_offload_params_is_refused(tmp_path, monkeypatch):
    model, tok = _model("offload")
    train, _ = quickstart_dataset()
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # accelerate launch --use_fsdp --fsdp_offload_params true
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "true")
    with pytest.raises(FastkitError, match="FSDP CPU offload"):
        make_trainer(model, tok, train, max_steps=1, output_dir=str(tmp_path))


def test_deepspeed_is_refused_with_its_reason(tmp_path, monkeypatch):
    model, tok = _model(True)
    train, _ = quickstart_dataset()
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # what accelerate launch --use_deepspeed sets
    with pytest.raises(FastkitError, match="DeepSpeed is not supported by fastkit yet: it has not been tested"):
        make_trainer(model, tok, train, max_steps=1, output_dir=str(tmp_path))


@pytest.mark.parametrize("fsdp", [False, True])
def test_qlora_under_fsdp_stores_4bit_weights_in_the_compute_dtype(monkeypatch, fsdp):
    from fastkit.loader import Quantization

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true" if fsdp else "false")
    config = Quantization(linear="bnb_4bit").load_kwargs(torch.bfloat16, torch.device("cuda", 0))["quantization_config"]
    assert config.bnb_4bit_compute_dtype == torch.bfloat16
    assert config.bnb_4bit_quant_storage == (torch.bfloat16 if fsdp else torch.uint8)
