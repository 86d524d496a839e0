"""save_merged shard by shard: same tensors as the whole-model merge, host memory about one shard."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from fastkit.export.merge import can_merge_shards, merge_shards
from fastkit.export.save import _merged_copy, save_merged
from fastkit.families.twins import twin, twin_tokenizer
from fastkit.plan.memprobe import measure_peak

_SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=32)


def _sharded_lora_model(tmp_path, dtype=torch.float32):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    src = tmp_path / "base"
    twin("qwen3", num_hidden_layers=6, dtype=dtype, tie_word_embeddings=False, **_SHAPE).save_pretrained(
        src, max_shard_size="1MB")
    base = AutoModelForCausalLM.from_pretrained(src, dtype=dtype)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.02)  # a trained-looking adapter (B starts at zero)
    return model, src


def _tensors(folder):
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def test_shard_merge_equals_whole_model_merge(tmp_path):
    model, src = _sharded_lora_model(tmp_path)
    shards = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(shards.values())) >= 4  # really sharded
    assert can_merge_shards(model, str(src)) is None
    save_merged(model, twin_tokenizer(), tmp_path / "by_shard")
    _merged_copy(model).to(torch.float32).save_pretrained(tmp_path / "whole")
    got, want = _tensors(tmp_path / "by_shard"), _tensors(tmp_path / "whole")
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].dtype == torch.float32  # the training dtype by default
        torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=1e-6, msg=key)
    changed = [k for k in want if not torch.equal(want[k], load_file_any(src, k))]
    assert changed and all("proj" in k for k in changed)  # the adapters did change the linear weights
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "by_shard")  # a plain transformers model
    assert reloaded.config.model_type == "qwen3"


def load_file_any(folder, key):
    for file in folder.glob("*.safetensors"):
        tensors = load_file(file)
        if key in tensors:
            return tensors[key]
    raise KeyError(key)


def test_shard_merge_peak_is_about_one_shard(tmp_path):
    model, src = _sharded_lora_model(tmp_path)
    largest = max(f.stat().st_size for f in src.glob("*.safetensors"))
    total = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    adapters = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" in n)
    _, shard_peak = measure_peak(lambda: merge_shards(model, str(src), tmp_path / "out", torch.float32))
    assert shard_peak <= largest + adapters + 2**20, (shard_peak, largest, adapters)
    # the whole-model merge holds a full copy: counted from the storages it holds (not from a profile of its
    # allocations, whose events depend on the machine's load), every base tensor a fresh copy
    weights = sum(t.numel() * t.element_size() for t in _tensors(src).values())
    assert weights <= total
    ours = {p.untyped_storage().data_ptr() for p in model.parameters()}
    whole = _merged_copy(model).state_dict()
    copied = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in whole.values()
              if t.untyped_storage().data_ptr() not in ours}
    assert sum(copied.values()) >= weights
    assert shard_peak * 3 < sum(copied.values())


def test_falls_back_when_shards_do_not_apply(tmp_path):
    model, src = _sharded_lora_model(tmp_path)
    assert "no local safetensors" in can_merge_shards(model, str(tmp_path / "nowhere"))
    assert can_merge_shards(twin("qwen3", num_hidden_layers=1), str(src)) == "no LoRA adapters"
    next(p for n, p in model.named_parameters() if "embed_tokens" in n).requires_grad_(True)
    assert "trained outside LoRA" in can_merge_shards(model, str(src))


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_16bit_merge_rounds_once(tmp_path, dtype):
    model, src = _sharded_lora_model(tmp_path, dtype=dtype)
    save_merged(model, twin_tokenizer(), tmp_path / "by_shard")
    _merged_copy(model).save_pretrained(tmp_path / "whole")
    got, want = _tensors(tmp_path / "by_shard"), _tensors(tmp_path / "whole")
    for key in want:
        assert got[key].dtype == dtype
        # whole-model merge rounds W and B·A to bf16 before adding; shard merge adds in fp32 and rounds once
        torch.testing.assert_close(got[key].float(), want[key].float(), atol=0, rtol=2 ** -7, msg=key)
