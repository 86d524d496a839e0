"""FastModel: loads from safetensors, refuses bad input before any work, reports what it did."""

import logging

import pytest
import torch
from transformers import ViTConfig

import fastkit
from fastkit import FastkitError, FastModel, GPUOnlyError
from fastkit.families.twins import twin, twin_tokenizer
from tests.helpers import save_twin


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    model = twin("llama")
    return save_twin(model, tmp_path_factory.mktemp("llama")), model


def test_loads_saved_twin_with_report(saved_llama, caplog):
    path, ref = saved_llama
    with caplog.at_level(logging.INFO, logger="fastkit"):
        model, tok = FastModel.from_pretrained(str(path), max_seq_length=128)
    assert model.dtype == torch.float32  # CPU: fp32
    assert tok.pad_token is not None
    rep = fastkit.report(model)
    assert rep.model_type == "llama" and rep.max_seq_length == 128
    assert "fastkit: llama on CPU" in caplog.text
    x = torch.randint(3, 259, (1, 10))
    with torch.no_grad():
        fastkit.revert(model)
        torch.testing.assert_close(model(x).logits, ref(x).logits)


def test_refuses_pickle_only_checkpoints(tmp_path):
    model = twin("llama")
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")  # a pickle: never loaded by fastkit
    with pytest.raises(OSError, match="safetensors"):
        FastModel.from_pretrained(str(tmp_path))


@pytest.mark.parametrize("bad, match", [
    ("/no/such/model", "does not exist"),
    ("./missing-folder", "does not exist"),
    ("", "name_or_path"),
])
def test_bad_path(bad, match):
    with pytest.raises(FastkitError, match=match):
        FastModel.from_pretrained(bad)


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    twin("llama").save_pretrained(tmp_path, safe_serialization=True)
    with pytest.raises(FastkitError, match="Could not load a tokenizer"):
        FastModel.from_pretrained(str(tmp_path))


def test_model_without_causal_lm_head(tmp_path):
    vit = ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    vit.save_pretrained(tmp_path)
    with pytest.raises(FastkitError, match="no causal-LM head"):
        FastModel.from_pretrained(str(tmp_path))


@pytest.mark.parametrize("value", [0, -5, 1.5])
def test_max_seq_length_must_be_positive(saved_llama, value):
    with pytest.raises(FastkitError, match="max_seq_length"):
        FastModel.from_pretrained(str(saved_llama[0]), max_seq_length=value)


def test_max_seq_length_is_checked_once_with_the_config_and_carried_on_the_report(saved_llama, monkeypatch, tmp_path,
                                                                                     caplog):
    """One check per load, where the config is known (the memory plan for a T4 included), and one carrier: the
    load report, which make_trainer reads (the tokenizer's own model_max_length is not it)."""
    from fastkit import checks
    from fastkit.quickstart import quickstart_dataset
    from fastkit.training import make_trainer

    seen = []
    real = checks.check_max_seq_length
    monkeypatch.setattr(checks, "check_max_seq_length", lambda n, config=None: (seen.append(config), real(n, config)))
    with caplog.at_level(logging.INFO, logger="fastkit"):
        model, tok = FastModel.from_pretrained(str(saved_llama[0]), max_seq_length=96, gpu="t4")
    assert f"fastkit: plan: {fastkit.report(model).memory_plan}" in caplog.text  # the banner, logged complete
    assert len(seen) == 1 and seen[0] is not None and seen[0].model_type == "llama"
    assert fastkit.report(model).max_seq_length == 96 and fastkit.report(model).memory_plan
    monkeypatch.setattr(checks, "check_max_seq_length", real)
    tok.model_max_length = 4096  # the tokenizer's own limit: not what the trainer packs to
    trainer = make_trainer(model, tok, quickstart_dataset()[0].select(range(8)), max_steps=1, output_dir=str(tmp_path),
                           dashboard="none", drop_long=True)
    assert trainer.args.max_length == 96


def test_max_seq_length_above_context(saved_llama):
    with pytest.raises(FastkitError, match="max_position_embeddings"):
        FastModel.from_pretrained(str(saved_llama[0]), max_seq_length=10**6)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_4bit_on_cpu_is_refused_before_loading(saved_llama):
    with pytest.raises(GPUOnlyError, match="needs a CUDA GPU"):
        FastModel.from_pretrained(str(saved_llama[0]), load_in_4bit=True)


def test_unknown_patch_name(saved_llama):
    with pytest.raises(FastkitError, match="Unknown patch"):
        FastModel.from_pretrained(str(saved_llama[0]), patches=["warp-drive"])


def test_patches_none_loads_plain(saved_llama):
    model, _ = FastModel.from_pretrained(str(saved_llama[0]), patches=None)
    assert fastkit.active_patches(model) == []


def test_twin_loading_is_offline_and_patched():
    model, tok = FastModel.from_pretrained("Qwen/Qwen3-0.6B", max_seq_length=64, twin=True)
    assert model.config.model_type == "qwen3" and tok.chat_template
    with pytest.raises(FastkitError, match="No twin"):
        FastModel.from_pretrained("nobody/nothing", twin=True)


def test_get_peft_model_lora_and_checkpointing():
    model = twin("llama")
    peft_model = FastModel.get_peft_model(model, r=4, lora_alpha=8)
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert model.model.layers[0].gradient_checkpointing
    with pytest.raises(FastkitError, match="rank"):
        FastModel.get_peft_model(twin("llama"), r=0)
    with pytest.raises(FastkitError, match="use_gradient_checkpointing"):
        FastModel.get_peft_model(twin("llama"), use_gradient_checkpointing="sometimes")


def test_chat_template_required_for_chat_data():
    from datasets import Dataset

    from fastkit.data import check_dataset

    tok = twin_tokenizer()
    tok.chat_template = None
    ds = Dataset.from_list([{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}])
    with pytest.raises(FastkitError, match="no chat template"):
        check_dataset(ds, tok, 128)


def test_tokenizer_gets_the_same_revision_and_token(monkeypatch):
    """A gated / pinned model: the tokenizer must come from the same revision with the same token as the weights."""
    from transformers import AutoTokenizer

    from fastkit.families.twins import twin_tokenizer
    from fastkit.loader import _load_tokenizer

    seen = {}

    def fake(name, **kwargs):
        seen.update(kwargs)
        return twin_tokenizer()

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", fake)
    _load_tokenizer("org/model", None, False, {"revision": "v1.2", "token": "hf_x", "device_map": "auto"})
    assert seen["revision"] == "v1.2" and seen["token"] == "hf_x" and "device_map" not in seen


def test_max_seq_length_above_a_composite_models_context(tmp_path):
    """A vision-language config keeps max_position_embeddings in its text config; the loader checks it there
    (it used to read the top-level config only, so any length passed), with the planner's message."""
    from fastkit.plan import plan

    model = twin("gemma3")
    model.config.text_config.max_position_embeddings = 64
    assert "max_position_embeddings" not in model.config.to_diff_dict()  # the text config holds it
    path = save_twin(model, tmp_path / "gemma3")
    with pytest.raises(FastkitError, match="max_position_embeddings=64") as loaded:
        FastModel.from_pretrained(path, max_seq_length=128)
    with pytest.raises(FastkitError) as planned:
        plan(model.config, gpu="cpu", max_seq_length=128)
    assert str(loaded.value) == str(planned.value)
