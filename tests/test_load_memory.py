"""Load-time memory: the planner's verdict before weights, pre-quantized checkpoints, 16-bit embeddings under 4-bit,
and the optimizer make_trainer picks."""

from __future__ import annotations

import json

import pytest
import torch

import fastkit.loader as loader
from fastkit import FastModel
from fastkit.errors import FastkitError
from fastkit.families.twins import twin, twin_config
from fastkit.plan import prequantized_4bit
from tests.test_plan import QWEN3_14B

BNB_4BIT = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
            "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "bfloat16"}


class _Loaded(Exception):
    """Raised by the fake AutoModelForCausalLM.from_pretrained: the load got as far as reading weights."""


@pytest.fixture
def fake_cuda_load(monkeypatch):
    """FastModel.from_pretrained as on a CUDA machine, stopping where weights would be read (kwargs captured)."""
    from transformers import AutoModelForCausalLM

    seen: dict = {}

    def from_pretrained(name, **kwargs):
        seen.update(kwargs)
        raise _Loaded

    monkeypatch.setattr(loader, "pick_device", lambda: torch.device("cuda", 0))
    monkeypatch.setattr(loader, "_pick_attention", lambda facts, device: "sdpa")
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", from_pretrained)
    return seen


def _folder(tmp_path, values: dict):
    (tmp_path / "config.json").write_text(json.dumps(values))
    return str(tmp_path)


def _tiny_values(**extra):
    values = twin_config("qwen3", num_hidden_layers=2).to_dict()
    values.update(extra)
    return values


@pytest.mark.parametrize("load_in_4bit", [False, True])
def test_prequantized_checkpoint_gets_no_second_quantization_config(tmp_path, fake_cuda_load, load_in_4bit):
    folder = _folder(tmp_path, _tiny_values(quantization_config=BNB_4BIT))
    with pytest.raises(_Loaded):
        FastModel.from_pretrained(folder, dtype=torch.bfloat16, gpu="t4", load_in_4bit=load_in_4bit)
    assert "quantization_config" not in fake_cuda_load  # the checkpoint's own config applies
    assert fake_cuda_load["device_map"] == {"": 0}


def test_plain_checkpoint_with_load_in_4bit_gets_nf4(tmp_path, fake_cuda_load):
    folder = _folder(tmp_path, _tiny_values())
    with pytest.raises(_Loaded):
        FastModel.from_pretrained(folder, dtype=torch.bfloat16, gpu="t4", load_in_4bit=True)
    quant = fake_cuda_load["quantization_config"]
    assert quant.load_in_4bit and quant.bnb_4bit_quant_type == "nf4" and quant.bnb_4bit_use_double_quant


def test_prequantized_is_read_from_the_config():
    assert prequantized_4bit(twin_config("qwen3", quantization_config=BNB_4BIT))
    assert not prequantized_4bit(twin_config("qwen3"))
    assert not prequantized_4bit(twin_config("qwen3", quantization_config={"quant_method": "gptq", "bits": 4}))
    from types import SimpleNamespace

    from transformers import BitsAndBytesConfig, Mxfp4Config

    from fastkit.plan.terms import mxfp4_checkpoint

    # a loaded model's config holds config OBJECTS whose quant_method is an enum
    assert prequantized_4bit(SimpleNamespace(quantization_config=BitsAndBytesConfig(load_in_4bit=True)))
    assert not prequantized_4bit(SimpleNamespace(quantization_config=BitsAndBytesConfig(load_in_8bit=True)))
    assert mxfp4_checkpoint(SimpleNamespace(quantization_config=Mxfp4Config(dequantize=True)))
    assert mxfp4_checkpoint(twin_config("gpt_oss", quantization_config={"quant_method": "mxfp4"}))
    assert not mxfp4_checkpoint(twin_config("qwen3", quantization_config=BNB_4BIT))


def test_a_run_that_cannot_fit_stops_before_weights_with_the_knob(tmp_path, fake_cuda_load):
    folder = _folder(tmp_path, QWEN3_14B)
    with pytest.raises(FastkitError, match="load_in_4bit=True") as err:
        FastModel.from_pretrained(folder, dtype=torch.float16, gpu="t4")
    assert "does NOT fit" in str(err.value) and not fake_cuda_load  # nothing was loaded


def test_a_run_that_fits_carries_the_verdict(tmp_path, fake_cuda_load, caplog):
    folder = _folder(tmp_path, QWEN3_14B)
    with caplog.at_level("INFO", logger="fastkit"), pytest.raises(_Loaded):
        FastModel.from_pretrained(folder, dtype=torch.float16, gpu="t4", load_in_4bit=True)
    assert "fits on t4" in caplog.text


def test_unknown_gpu_target_fails_before_weights(tmp_path, fake_cuda_load):
    with pytest.raises(FastkitError, match="rtx-8g"):
        FastModel.from_pretrained(_folder(tmp_path, _tiny_values()), dtype=torch.bfloat16, gpu="gtx-480")
    assert not fake_cuda_load


def test_4bit_preparation_keeps_embeddings_lm_head_and_norms_16bit():
    """PEFT's prepare_model_for_kbit_training would cast every 16-bit parameter to fp32 (6.2 GB on Qwen3-14B)."""
    model = twin("qwen3", num_hidden_layers=2, dtype=torch.bfloat16, tie_word_embeddings=False)
    model.is_loaded_in_4bit = True  # what bitsandbytes sets; the preparation is what is under test
    peft_model = FastModel.get_peft_model(model, r=8, use_gradient_checkpointing=False)
    base = peft_model.get_base_model()
    assert base.get_input_embeddings().weight.dtype == torch.bfloat16
    assert base.get_output_embeddings().weight.dtype == torch.bfloat16
    assert base.model.norm.weight.dtype == torch.bfloat16
    upcast = [n for n, p in base.named_parameters() if "lora_" not in n and p.dtype != torch.bfloat16]
    assert not upcast, upcast
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


def test_make_trainer_optimizer_choice():
    from types import SimpleNamespace

    from fastkit.training.run import _default_optim

    assert _default_optim(SimpleNamespace(device=torch.device("cuda"), is_loaded_in_4bit=True)) == "paged_adamw_8bit"
    assert _default_optim(SimpleNamespace(device=torch.device("cuda"), is_loaded_in_4bit=False)) == "adamw_torch"
    assert _default_optim(SimpleNamespace(device=torch.device("cpu"), is_loaded_in_4bit=True)) == "adamw_torch"


def test_4bit_moe_estimate_warns_but_never_refuses(tmp_path, fake_cuda_load, caplog):
    """fastkit's 4-bit experts are not yet measured against the planner: over budget is a warning there."""
    moe = twin_config("qwen3_moe", num_hidden_layers=2).to_dict()
    with caplog.at_level("WARNING", logger="fastkit"), pytest.raises(_Loaded):
        FastModel.from_pretrained(_folder(tmp_path, moe), dtype=torch.bfloat16, gpu=0.5, load_in_4bit=True)
    assert "does NOT fit" in caplog.text and "not yet checked on a GPU" in caplog.text
    dense = tmp_path / "dense"
    dense.mkdir()
    with pytest.raises(FastkitError, match="does NOT fit"):  # the same budget refuses a dense model
        FastModel.from_pretrained(_folder(dense, _tiny_values()), dtype=torch.bfloat16, gpu=0.5, load_in_4bit=True)
