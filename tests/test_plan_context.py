"""fastkit.plan: shipped configs (offline), the fast Hub refusal, GPU names, unified memory, the longest row,
docs/plan.md's context table, configs that cannot be built."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fastkit.cli import main
from fastkit.errors import FastkitError
from fastkit.plan import GPUS, gpu_budget, plan
from fastkit.plan import planner as planner_mod
from fastkit.plan.configs import KNOWN_CONFIGS

DOCS = Path(__file__).resolve().parents[1] / "docs" / "plan.md"
SMALL = dict(model_type="qwen3", hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, head_dim=32, vocab_size=1000, max_position_embeddings=65536)


def _no_hub(monkeypatch):
    """Any Hub access fails the test: the download and the TCP probe."""
    import huggingface_hub

    def download(*args, **kwargs):
        if kwargs.get("local_files_only"):
            raise FileNotFoundError("not cached")
        raise AssertionError("the planner went to the Hub")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: (_ for _ in ()).throw(OSError("no network")))


@pytest.mark.parametrize("name", ["Qwen/Qwen3-14B", "openai/gpt-oss-20b", "unsloth/Qwen3-14B-bnb-4bit"])
def test_shipped_configs_plan_without_the_hub(monkeypatch, name):
    _no_hub(monkeypatch)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    result = plan(name, gpu="t4", load_in_4bit=True)
    assert result.total > 5 * 2**30
    assert result.inputs.load_in_4bit


def test_unknown_model_without_network_fails_in_one_line(monkeypatch, capsys):
    _no_hub(monkeypatch)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(FastkitError, match="cannot be reached") as err:
        plan("nobody/not-a-model")
    assert "Qwen/Qwen3-14B" in str(err.value)  # names what it can plan offline
    assert main(["plan", "nobody/not-a-model"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


@pytest.mark.parametrize("name", ["h100", "a100-80", "rtx-24g", "a10g", "l40s", "h200", "rtx-12g", "gh200"])
def test_gpu_names(name):
    assert gpu_budget(name) == int(GPUS[name] * 2**30)


def test_cli_gpu_number_and_max(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(SMALL))
    assert main(["plan", str(tmp_path), "--gpu", "24"]) == 0
    assert main(["plan", str(tmp_path), "--gpu", "24", "--max-seq-length", "max"]) == 0
    out = capsys.readouterr().out
    assert "| checkpointing + offload |" in out and "longest packed row" in out


def test_unified_memory_counts_host_bytes_and_never_offers_offload():
    spark = {o: plan("Qwen/Qwen3-14B", gpu="spark", max_seq_length=32768, offload=o) for o in (False, True)}
    assert spark[True].total >= spark[False].total  # offload moves bytes within the one pool
    assert any("host-side: offloaded layer inputs" in k for k in spark[True].components)
    h100 = {o: plan("Qwen/Qwen3-14B", gpu="h100", max_seq_length=32768, offload=o) for o in (False, True)}
    assert h100[True].total < h100[False].total  # a discrete card: offload frees GPU memory
    host = plan("Qwen/Qwen3-14B", gpu="spark", host_embedding=True, host_lm_head=True)
    assert any(k.startswith("host-side: lm_head") for k in host.components)
    tight = plan("Qwen/Qwen3-32B", gpu="spark", max_seq_length=40960)
    assert not tight.fits
    assert not any("offload" in a.lower() and "not offered" not in a.lower() for a in tight.advice), tight.advice
    assert any("unified memory" in a for a in tight.advice)
    assert planner_mod.auto_plan(dict(KNOWN_CONFIGS["Qwen/Qwen3-32B"]), "spark", 40960, False) is None


def test_check_fits_on_an_integrated_gpu_never_turns_on_offload(monkeypatch):
    from fastkit.plan.planner import check_fits, read_config

    config = read_config("Qwen/Qwen3-32B")
    props = SimpleNamespace(total_memory=int(100.0 * 2**30), is_integrated=True, name="NVIDIA GB10")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props)
    with pytest.raises(FastkitError, match="does NOT fit"):  # 40,960 tokens: over, and nothing to turn on
        check_fits(config, torch.device("cuda", 0), None, 40960, False)
    props.is_integrated = False  # the same memory on a discrete card: offload is the default's answer
    result = check_fits(config, torch.device("cuda", 0), None, 40960, False)
    assert result.needs_offload and result.inputs.offload


def test_longest_row_is_the_edge():
    result = plan("Qwen/Qwen3-14B", gpu="t4", load_in_4bit=True, max_seq_length="max")
    n = result.inputs.max_seq_length
    assert result.longest["checkpointing"] == n == result.longest["4-bit + checkpointing"]
    assert plan("Qwen/Qwen3-14B", gpu="t4", load_in_4bit=True, max_seq_length=n).fits
    assert not plan("Qwen/Qwen3-14B", gpu="t4", load_in_4bit=True, max_seq_length=n + 64).fits
    assert result.longest["no checkpointing"] < n <= result.longest["checkpointing + offload"]
    with pytest.raises(FastkitError, match="gpu='cpu'"):
        plan("Qwen/Qwen3-14B", gpu="cpu", max_seq_length="max")


def test_docs_context_table_is_what_the_planner_says():
    text = DOCS.read_text(encoding="utf-8")
    start = text.index("| model | t4 | l4 | rtx-24g | a100-80 | h100 | spark |")
    table = text[start:].split("\n\n")[0].strip()
    models = re.findall(r"^\| ([\w./-]+/[\w.-]+) \|", table, flags=re.M)
    assert len(models) >= 8
    assert planner_mod.context_table(models) == table


@pytest.mark.parametrize(("change", "field"), [
    (dict(vocab_size=0), "vocab_size"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=6, moe_intermediate_size=64),
     "num_experts_per_tok"),
])
def test_configs_that_cannot_be_built_exit_2_naming_the_field(tmp_path, capsys, change, field):
    (tmp_path / "config.json").write_text(json.dumps({**SMALL, **change}))
    with pytest.raises(FastkitError, match=field):
        plan(str(tmp_path))
    assert main(["plan", str(tmp_path)]) == 2
    assert field in capsys.readouterr().err


def test_every_model_with_a_twin_has_a_shipped_config_of_its_family():
    from fastkit.families.twins import HUB_TWINS

    for name, (model_type, _) in HUB_TWINS.items():
        assert name in KNOWN_CONFIGS, name
        assert KNOWN_CONFIGS[name]["model_type"] == model_type, name
