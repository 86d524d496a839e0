"""fastkit.plan: GPU budgets from the card table (torch's total_memory, the CUDA context counted once), the
table's header (rows x length x batch), off-peak terms apart from the summed column (issue 41)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from fastkit.cli import main
from fastkit.errors import FastkitError
from fastkit.plan import CUDA_CONTEXT, check_fits, gpu_budget, plan
from fastkit.plan.gpus import CARDS, DERIVED, GPUS, TORCH
from fastkit.plan.planner import ALLOCATOR_SLACK, OFF_PEAK, read_config

GiB = 2**30
CONTEXT_ROW = "CUDA context (outside the allocator)"


def test_t4_is_what_torch_reports_on_a_colab_t4():
    assert CARDS["t4"].gib == 14.74 and GPUS["t4"] == 14.74
    assert gpu_budget("t4") == int(14.74 * GiB) == plan("Qwen/Qwen3-14B", gpu="t4", load_in_4bit=True).budget


@pytest.mark.parametrize("name", list(CARDS))
def test_every_budget_comes_from_its_row_with_a_source(name):
    card = CARDS[name]
    assert gpu_budget(name) == int(card.gib * GiB)
    assert card.source.startswith((TORCH, DERIVED)), card.source


def test_the_cuda_context_is_counted_once_and_outside_the_slack():
    result = plan("Qwen/Qwen3-14B", gpu="t4", load_in_4bit=True)
    rows = result.components
    assert [k for k in rows if "CUDA context" in k] == [CONTEXT_ROW] and rows[CONTEXT_ROW] == CUDA_CONTEXT
    slack = next(v for k, v in rows.items() if k.startswith("allocator slack"))
    allocated = result.total - CUDA_CONTEXT - slack
    assert slack == int(ALLOCATOR_SLACK * allocated)


def test_a_live_t4_gets_the_same_budget_as_the_t4_row(monkeypatch):
    props = SimpleNamespace(total_memory=15095 * 2**20, is_integrated=False, name="Tesla T4")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props)
    live = check_fits(read_config("Qwen/Qwen3-14B"), torch.device("cuda", 0), None, 2048, True)
    assert abs(live.budget - gpu_budget("t4")) < 0.01 * GiB  # no second cut for the context


@pytest.mark.parametrize(("options", "words"), [
    (dict(max_seq_length=4096, batch_size=2), "1 row × 4,096 tokens × batch 2 (packed)"),
    (dict(max_seq_length=1024, kind="dpo"), "2 rows (chosen + rejected, packed into one) × 1,024 tokens × batch 1"),
    (dict(max_seq_length=1024, kind="grpo", num_generations=8, max_completion_length=512),
     "8 rows (completions of one prompt) × 1,024 tokens (512 prompt + 512 completion) × batch 1"),
])
def test_the_header_names_rows_length_and_batch(options, words):
    table = plan("Qwen/Qwen3-0.6B", gpu="t4", **options).table()
    header = table.split("| component |")[0]
    assert words in header and "Planned for:" in header, header
    assert "14.74 GiB" in header and TORCH in header


def _summed_rows(table: str) -> tuple[list[float], float]:
    """The rows above the predicted peak in the first component table, and that peak."""
    block = table[table.index("| component |"):table.index("**predicted peak**")]
    values = [float(v) for v in re.findall(r"^\| .+ \| ([\d.]+) \|$", block, flags=re.M)]
    peak = float(re.search(r"\*\*predicted peak\*\* \| \*\*([\d.]+)\*\*", table).group(1))
    return values, peak


def test_off_peak_rows_sit_apart_from_the_sum():
    result = plan("Qwen/Qwen3-14B", gpu="t4", load_in_4bit=True)
    off = [k for k in result.components if k.startswith(OFF_PEAK)]
    assert off  # the loss is not at the peak here
    table = result.table()
    values, peak = _summed_rows(table)
    assert abs(sum(values) - peak) <= 0.01 * len(values)  # the column adds up to the peak
    summed = table[:table.index("**predicted peak**")]
    apart = table[table.index("**predicted peak**"):]
    assert "Not at the peak" in apart and OFF_PEAK.strip() not in table
    for name in off:
        assert name.removeprefix(OFF_PEAK) in apart and f"| {name.removeprefix(OFF_PEAK)} |" not in summed


def test_qwen3_14b_on_a_t4_at_max_length_promises_at_most_the_card(capsys):
    assert main(["plan", "Qwen/Qwen3-14B", "--gpu", "t4", "--4bit", "--max-seq-length", "max"]) == 0
    out = capsys.readouterr().out
    peak = float(re.search(r"predicted peak ([\d.]+) GiB, fits on t4", out).group(1))
    assert peak <= 14.74, out
    assert "1 row × " in out and "(packed)" in out and "14.74 GiB" in out


@pytest.mark.parametrize("spelling", ["T4", "T4 ", " t4", "\tT4\n"])
def test_a_gpu_name_plans_the_same_however_it_is_spelled(spelling):
    """One spelling where the name enters (issue 44): README writes "T4"; it plans fp16 weights and the T4's
    budget exactly as "t4" does (it planned bf16 weights before)."""
    model = "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert str(plan(model, gpu=spelling)) == str(plan(model, gpu="t4"))
    assert plan(model, gpu=spelling).components == plan(model, gpu="t4").components


@pytest.mark.parametrize("gib", [float("inf"), float("-inf"), float("nan"), 0, -2.5])
def test_a_gpu_size_that_is_not_a_finite_positive_number_is_refused(gib):
    with pytest.raises(FastkitError, match="finite number above 0"):
        plan("HuggingFaceTB/SmolLM2-135M-Instruct", gpu=gib)
    with pytest.raises(FastkitError, match="finite number above 0"):
        gpu_budget(gib)


@pytest.mark.parametrize("text", ["inf", "1e400", "Inf GiB"])
def test_an_infinite_size_given_as_text_is_refused_as_the_cli_gives_it(text):
    with pytest.raises(FastkitError, match="finite number above 0"):
        gpu_budget(text)
    assert main(["plan", "HuggingFaceTB/SmolLM2-135M-Instruct", "--gpu", text]) == 2
