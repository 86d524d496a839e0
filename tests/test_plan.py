"""The memory planner: measured peaks on CPU twins, the Qwen3-14B-on-a-T4 verdict, bad input, the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from fastkit.errors import FastkitError
from fastkit.families.twins import twin, twin_config
from fastkit.plan import GPUS, default_optimizer, gpu_budget, plan
from fastkit.plan.memprobe import measure_peak

_BIG = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=32)

# Qwen3-14B's published config.json values (hf.co/Qwen/Qwen3-14B), written here so nothing downloads.
QWEN3_14B = dict(model_type="qwen3", hidden_size=5120, num_hidden_layers=40, num_attention_heads=40,
                 num_key_value_heads=8, head_dim=128, intermediate_size=17408, vocab_size=151936,
                 tie_word_embeddings=False, max_position_embeddings=40960, rms_norm_eps=1e-6)


def _measured_step_peak(model, checkpointing: bool, tokens: int, r: int = 8) -> int:
    """Parameter bytes + the measured peak of one LoRA step (forward, backward, AdamW step)."""
    from peft import LoraConfig, get_peft_model

    from fastkit.loader import enable_checkpointing

    peft_model = get_peft_model(model.train(), LoraConfig(r=r, lora_alpha=16, target_modules="all-linear"))
    enable_checkpointing(peft_model, checkpointing)
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(3, model.config.vocab_size, (1, tokens))

    def step():
        out = peft_model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    _, peak = measure_peak(step)
    return sum(p.numel() * p.element_size() for p in peft_model.parameters()) + peak


@pytest.mark.parametrize("family,checkpointing,dtype", [
    ("qwen3", True, torch.bfloat16),
    ("qwen3", False, torch.bfloat16),
    ("llama", True, torch.float32),
    ("llama", False, torch.float32),
    ("qwen3_moe", True, torch.bfloat16),
    ("qwen3_moe", False, torch.float32),
])
def test_planner_within_15_percent_of_measured_peak_on_twins(family, checkpointing, dtype):
    over = dict(_BIG, moe_intermediate_size=128) if family == "qwen3_moe" else _BIG
    model = twin(family, num_hidden_layers=4, dtype=dtype, **over)
    tokens = 1024
    predicted = plan(model.config, gpu="cpu", max_seq_length=tokens, r=8, checkpointing=checkpointing,
                     loss="full", dtype=dtype, optimizer="adamw_torch")
    measured = _measured_step_peak(model, checkpointing, tokens)
    assert abs(predicted.total / measured - 1) <= 0.15, (predicted.table(), measured)


def _qwen3_14b():
    from transformers import Qwen3Config

    values = dict(QWEN3_14B)
    values.pop("model_type")
    config = Qwen3Config(**values)
    config.name_or_path = "Qwen/Qwen3-14B"
    return config


def test_qwen3_14b_qlora_fits_a_t4():
    result = plan(_qwen3_14b(), gpu="t4", max_seq_length=2048, batch_size=1, r=16, load_in_4bit=True)
    assert result.fits, result.table()
    assert 11 * 2**30 < result.total < GPUS["t4"] * 2**30  # the 4-bit weights alone are ~9.3 GiB
    table = result.table()
    assert "NF4" in table and "predicted peak" in table and "fits on t4" in table


def test_runs_that_do_not_fit_name_the_knob():
    full_logits = plan(_qwen3_14b(), gpu="t4", load_in_4bit=True, loss="full")
    assert not full_logits.fits and "fused LM head" in full_logits.advice[0]
    sixteen_bit = plan(_qwen3_14b(), gpu="t4", load_in_4bit=False)
    assert not sixteen_bit.fits and "load_in_4bit=True" in " ".join(sixteen_bit.advice)
    assert "does NOT fit" in sixteen_bit.verdict() and "Fix:" in sixteen_bit.verdict()


def test_offload_and_8bit_optimizer_shrink_their_components():
    base = plan(_qwen3_14b(), gpu="t4", load_in_4bit=True, optimizer="adamw_torch")
    offload = plan(_qwen3_14b(), gpu="t4", load_in_4bit=True, optimizer="paged_adamw_8bit", offload=True)
    assert offload.total < base.total
    assert any("2 on the GPU" in k for k in offload.components)


def test_unknown_gpu_lists_the_known_names():
    with pytest.raises(FastkitError) as err:
        plan(_qwen3_14b(), gpu="h900")
    assert all(name in str(err.value) for name in GPUS)
    assert gpu_budget(24) == 24 * 2**30 and gpu_budget("12") == 12 * 2**30 and gpu_budget("cpu") is None


def test_bad_inputs_fail_before_any_work():
    with pytest.raises(FastkitError, match="max_seq_length"):
        plan(_qwen3_14b(), max_seq_length=0)
    with pytest.raises(FastkitError, match="loss"):
        plan(_qwen3_14b(), loss="fp8")
    with pytest.raises(FastkitError, match="unknown option"):
        plan(_qwen3_14b(), lora_rank=8)


def test_config_from_folder_and_clear_errors(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_14B))
    assert plan(str(tmp_path), gpu="t4", load_in_4bit=True).fits
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FastkitError, match="HF_HUB_OFFLINE"):
        plan("nobody/not-a-cached-model")
    with pytest.raises(FastkitError, match="neither a local"):
        plan(str(tmp_path / "missing"))
    (tmp_path / "bad.json").write_text(json.dumps({"model_type": "not_a_model"}))
    with pytest.raises(FastkitError, match="model_type"):
        plan(str(tmp_path / "bad.json"))


def test_counts_parameters_on_the_meta_device():
    from fastkit.plan.terms import shape_of

    config = twin_config("qwen3", num_hidden_layers=2, tie_word_embeddings=False)
    model = twin("qwen3", num_hidden_layers=2, tie_word_embeddings=False)
    shape = shape_of(config)
    assert shape.total_params == sum(p.numel() for p in model.parameters())
    assert shape.embedding_params == 2 * config.vocab_size * config.hidden_size


def test_default_optimizer():
    assert default_optimizer("cuda", True) == "paged_adamw_8bit"
    assert default_optimizer("cuda", False) == "adamw_torch"
    assert default_optimizer("cpu", True) == "adamw_torch"


def test_cli_prints_the_table(tmp_path, capsys):
    from fastkit.cli import main

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_14B))
    assert main(["plan", str(tmp_path), "--gpu", "t4", "--4bit", "--r", "16", "--max-seq-length", "2048"]) == 0
    out = capsys.readouterr().out
    assert "| component |" in out and "fits on t4" in out
    assert main(["plan", str(tmp_path), "--gpu", "rtx-8g"]) == 1
    assert main(["plan", str(tmp_path), "--gpu", "h900"]) == 2
    assert "t4" in capsys.readouterr().err


def test_cli_4bit_moe_counts_expert_lora_unless_switched_off(tmp_path, capsys):
    from fastkit.cli import main
    from fastkit.plan.moe_4bit import GPT_OSS_20B

    (tmp_path / "config.json").write_text(json.dumps(GPT_OSS_20B))
    args = ["plan", str(tmp_path), "--gpu", "rtx-16g", "--4bit", "--r", "8", "--max-seq-length", "1024"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "LoRA r=8 on experts (fastkit)" in out and "MoE experts, NF4" in out and "merged" not in out
    assert main(args + ["--no-expert-lora"]) == 0
    assert "on experts" not in capsys.readouterr().out


def test_cli_leads_with_fastkits_default_setup_where_plain_checkpointing_does_not_fit(tmp_path, capsys):
    """GPT-OSS-20B 4-bit on a T4 (issue 54): plain checkpointing does not fit, fastkit's default set-up (what the
    load-time plan turns on, check_fits) does: fastkit plan leads with that set-up's table and verdict and exits 0,
    then names the plain set-up; asked with --checkpointing on, the plain one does not fit (exit 1), its fixes in
    fastkit train's flags; Python's plan() keeps Python's words."""
    from fastkit.cli import main
    from fastkit.plan import check_fits
    from fastkit.plan.moe_4bit import GPT_OSS_20B
    from fastkit.plan.planner import read_config

    (tmp_path / "config.json").write_text(json.dumps(GPT_OSS_20B))
    assert main(["plan", str(tmp_path), "--gpu", "t4", "--4bit"]) == 0
    out = capsys.readouterr().out
    loaded = check_fits(read_config(str(tmp_path)), torch.device("cpu"), "t4", 2048, True)
    assert loaded.needs_offload and loaded.inputs.host_embedding and loaded.inputs.host_lm_head
    assert out.startswith(f"{tmp_path} on t4") and "does NOT fit" in out  # the plain set-up, named after
    assert "Setup: LoRA r=16, 4-bit (NF4) weights, checkpointing + offload, input embedding and lm_head on the host" \
        in out
    verdict = f"predicted peak {loaded.total / 2**30:.2f} GiB, fits on t4"
    plain = plan(dict(GPT_OSS_20B), gpu="t4", load_in_4bit=True)
    assert out.index(verdict) < out.index(f"plain checkpointing would need {plain.total / 2**30:.2f} GiB, does NOT fit")
    assert "turns on activation offload + the input embedding and lm_head on the host" in out
    assert main(["plan", str(tmp_path), "--gpu", "t4", "--4bit", "--checkpointing", "on"]) == 1
    out = capsys.readouterr().out
    assert "Fix: keep the frozen input embedding on the host (fastkit train turns it on by itself" in out
    assert "fastkit's default set-up" not in out and "get_peft_model" not in out and "HostWeights(" not in out
    assert main(["plan", str(tmp_path), "--gpu", "t4", "--4bit", "--offload"]) == 1  # a setup asked for: as asked
    assert "fastkit's default set-up" not in capsys.readouterr().out
    assert any("get_peft_model(host_weights=fastkit.HostWeights(input_embedding=True))" in a for a in plain.advice)


def test_cli_fixes_are_fastkit_train_flags_where_nothing_fits(capsys):
    """Qwen3-8B 16-bit on an 8 GB RTX does not fit even with fastkit's defaults: exit 1, the fixes in fastkit
    train's flags (--4bit, --checkpointing offload, --max-seq-length), and --4bit with the default set-up fits;
    the same plan from Python speaks Python."""
    from fastkit.cli import main

    assert main(["plan", "Qwen/Qwen3-8B", "--gpu", "rtx-8g"]) == 1
    out = capsys.readouterr().out
    assert "combine --4bit, --checkpointing offload and a shorter --max-seq-length" in out
    assert "With --4bit (QLoRA): predicted 6.84 GiB, fits on rtx-8g" in out
    assert main(["plan", "Qwen/Qwen3-8B", "--gpu", "rtx-8g", "--4bit"]) == 0
    assert main(["plan", "Qwen/Qwen3-14B", "--gpu", "t4", "--4bit", "--max-seq-length", "32768"]) == 1
    out = capsys.readouterr().out
    assert "Fix: shorter rows: --max-seq-length 2048" in out and "max_seq_length=" not in out
    python = plan("Qwen/Qwen3-14B", gpu="t4", load_in_4bit=True, max_seq_length=32768)
    assert python.advice == ["Fix: shorter rows: max_seq_length=2048 (predicted 14.2 GiB)."]
    sixteen = plan("Qwen/Qwen3-8B", gpu="rtx-8g")
    assert "combine 4-bit, offload and shorter rows" in sixteen.verdict()


def test_optimizer_names_are_the_trainers_spelling():
    """The planner takes the ``optim`` names make_trainer passes to TrainingArguments, nothing else."""
    from transformers.training_args import OptimizerNames

    from fastkit.plan import OPTIMIZER_STATE_BYTES

    assert set(OPTIMIZER_STATE_BYTES) <= {o.value for o in OptimizerNames}
    for device, four_bit in [("cpu", False), ("cuda", False), ("cuda", True)]:
        assert default_optimizer(device, four_bit) in OPTIMIZER_STATE_BYTES
    rows = {o: plan(_qwen3_14b(), gpu="t4", load_in_4bit=True, optimizer=o).components for o in
            ("adamw_torch", "paged_adamw_8bit")}
    assert rows["adamw_torch"]["optimizer state (adamw_torch)"] == 4 * rows["paged_adamw_8bit"][
        "optimizer state (paged_adamw_8bit)"]
    with pytest.raises(FastkitError, match="transformers' optim names"):
        plan(_qwen3_14b(), gpu="t4", optimizer="adamw_32bit")  # the planner's old private spelling


@pytest.mark.parametrize("bf16", [True, False])
def test_one_dtype_rule_for_loader_trainer_and_planner(monkeypatch, bf16):
    """auto_dtype (loader), _precision (SFTConfig flags) and the planner read device.compute_dtype."""
    from types import SimpleNamespace

    from fastkit.device import auto_dtype, compute_dtype
    from fastkit.training.run import _precision

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16)
    cuda = torch.device("cuda")
    want = torch.bfloat16 if bf16 else torch.float16
    assert auto_dtype(cuda) == compute_dtype(True, bf16) == want
    assert _precision(SimpleNamespace(device=cuda)) == {"bf16": bf16, "fp16": not bf16}
    gpu = "l4" if bf16 else "t4"
    label = f"weights: embeddings + lm_head, {str(want).replace('torch.', '')}"
    assert label in plan(_qwen3_14b(), gpu=gpu, load_in_4bit=True).components
    assert auto_dtype(torch.device("cpu")) == torch.float32


# -- frozen embedding / lm_head on the host (fastkit.patches.host) --------------------------------------------
def test_gpt_oss_20b_qlora_is_planned_under_13_5_gib_on_a_t4():
    """r=16, 2,048 tokens, batch 1: what from_pretrained plans on a T4 (offload + both weights on the host)."""
    from fastkit.plan import GPT_OSS_20B, check_fits, read_config

    result = check_fits(read_config(dict(GPT_OSS_20B)), torch.device("cpu"), "t4", 2048, True)
    assert result.fits and result.total <= 13.5 * 2**30, result.table()
    assert result.needs_offload and result.host_weights.input_embedding and result.host_weights.lm_head
    assert not any(k.startswith("weights: embeddings") or "lm_head," in k for k in result.components), result.table()
    head = 201088 * 2880 * 2
    assert result.host["host (pinned): lm_head"] == head and result.host["host (pinned): input embedding"] == head
    assert result.host["host→GPU per step: lm_head streamed (forward + backward)"] == 2 * head
    assert "host→GPU per step" in result.table()
    offload_only = plan(dict(GPT_OSS_20B), gpu="t4", load_in_4bit=True, offload=True)
    assert not offload_only.fits and offload_only.total - result.total > 2 * 2**30
    # a run that fits with plain checkpointing keeps everything on the GPU
    assert not check_fits(_qwen3_14b(), torch.device("cpu"), "t4", 2048, True).host_weights.any


def test_streamed_head_is_planned_with_the_chunk_the_patch_uses():
    """The planner's streamed-loss rows are what fastkit.patches.host uses for the same head and tokens."""
    from fastkit.patches.host import HostWeights, enable_host_weights
    from fastkit.patches.host.patch import head_rows
    from fastkit.plan.terms import shape_of, streamed_rows

    model = twin("qwen3", num_hidden_layers=1, tie_word_embeddings=False, vocab_size=30000).requires_grad_(False)
    enable_host_weights(model, HostWeights(lm_head=True, block_bytes=2**20))
    shape = shape_of(model.config)
    for tokens in (1, 100, 2048):  # the head-chunk cap binds at 1 token, the (tokens x rows) block at 100 and 2048
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("fastkit.plan.terms.CHUNK_BYTES", 2**20)
            assert streamed_rows(shape, tokens, 4) == head_rows(model.get_output_embeddings(), tokens)
    tied = plan(dict(model_type="qwen3", tie_word_embeddings=True), gpu="t4", load_in_4bit=True,
                host_embedding=True, host_lm_head=True)
    assert not tied.host and any(k.startswith("weights: embeddings + lm_head") for k in tied.components)
    with pytest.raises(FastkitError, match="FROZEN"):
        plan(_qwen3_14b(), gpu="t4", r=None, host_embedding=True)


def test_cli_plans_the_host_weights(tmp_path, capsys):
    from fastkit.cli import main
    from fastkit.plan.moe_4bit import GPT_OSS_20B

    (tmp_path / "config.json").write_text(json.dumps(GPT_OSS_20B))
    args = ["plan", str(tmp_path), "--gpu", "t4", "--4bit", "--offload"]
    assert main(args) != 0 and "Fix: keep the frozen input embedding" in capsys.readouterr().out
    assert main(args + ["--host-embedding", "--host-lm-head"]) == 0
    out = capsys.readouterr().out
    assert "lm_head streamed from the host" in out and "host (pinned): lm_head" in out and "fits on t4" in out
