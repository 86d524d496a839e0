"""The committed benchmark tables (assets/bench_*.md) tell noise from results: every table header records the
machine's load, no measured time is negative, every timing ratio carries the range of its per-repeat ratios,
and a CPU table prints no (L−1)·m time model (a GPU model) as if it were measured."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TABLES = sorted((ROOT / "assets").glob("bench_*.md"))
NUMBER = r"-?\d+(?:\.\d+)?"
RANGE = re.compile(rf"\[\s*{NUMBER}\s*(?:–|-|to)\s*{NUMBER}\s*\]")
RATIO = re.compile(rf"{NUMBER}\s*[×x](?![a-zA-Z(])")
NEGATIVE_MS = re.compile(r"(?<![\d.\w])-\d+(?:\.\d+)?\s*ms\b")
LEADING_NEGATIVE = re.compile(r"^\**\s*-\d")


def _tables(text: str):
    """(header cells, rows of cells) of every markdown table in ``text``."""
    block: list[str] = []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            block.append(line)
            continue
        if len(block) >= 2:
            split = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in block]
            yield split[0], split[2:]
        block = []


def problems(text: str) -> list[str]:
    """What in a committed table would let noise pass for a result."""
    out = []
    if "load avg" not in text and "load unknown" not in text:
        out.append("no machine load recorded in the header")
    if "CPU (" in text and "(L−1)·m" in text and "not meaningful on CPU" not in text:
        out.append("a CPU table prints the (L−1)·m GPU time model")
    for header, rows in _tables(text):
        for row in rows:
            if len(row) != len(header):
                out.append(f"row with {len(row)} cells under {len(header)} columns: {row}")
                continue
            for col, cell in zip(header, row):
                saving = "saved" in col.lower()
                time_col = re.search(r"\bms\b", col) is not None
                if not saving and (NEGATIVE_MS.search(cell) or (time_col and LEADING_NEGATIVE.match(cell))):
                    out.append(f"negative measured time in '{col}': {cell}")
                if saving and "predicted" not in col.lower() and not RANGE.search(cell):
                    out.append(f"measured saving without its range in '{col}': {cell}")
                if "mem" in col.lower() or "bytes" in col.lower():
                    continue  # memory is counted, not timed: a ratio of counts has no spread
                if RATIO.search(cell) and not RANGE.search(cell):
                    out.append(f"ratio without its spread in '{col}': {cell}")
    return out


def test_there_are_committed_tables():
    assert {p.name for p in TABLES} >= {"bench_packed.md", "bench_offload.md", "bench_moe.md", "bench_sft.md"}


@pytest.mark.parametrize("path", TABLES, ids=lambda p: p.name)
def test_committed_table_tells_noise_from_results(path):
    assert problems(path.read_text()) == []


def test_the_checker_catches_each_kind_of_problem():
    ok = ("load avg 0.1/0.1/0.1 on 2 CPUs\n\n| path | fwd ms | speed-up | saved |\n|---|---:|---:|---|\n"
          "| a | 12.0 (min 11.0, spread 9%) | 1.20× [1.10–1.30] | -0.5 ms [-1.0 to 0.2] |\n")
    assert problems(ok) == []
    assert problems(ok.replace("load avg", "load")) == ["no machine load recorded in the header"]
    assert problems(ok.replace("| 12.0 (", "| -12.0 (")), "negative time cell"
    assert problems(ok.replace("1.20× [1.10–1.30]", "1.20×")), "ratio without spread"
    assert problems(ok.replace("1.20× [1.10–1.30]", "1.20× [1 rep: no spread]")), "one pair is no spread"
    assert problems(ok.replace(" [-1.0 to 0.2]", "")), "measured saving without range"
    assert problems(ok.replace("speed-up |", "speed-up | x |")), "malformed row"
    cpu_model = "CPU (2 cores)\n" + ok + "\nTime model T_saved ≈ (L−1)·m\n"
    assert problems(cpu_model) == ["a CPU table prints the (L−1)·m GPU time model"]


def test_gpu_shaped_tables_pass_the_checker():
    """The GPU tables (committed after a device run) are rendered by the same code: synthetic GPU rows pass."""
    import argparse

    import torch

    from benchmarks import moe, packed, sft

    cuda, load = torch.device("cuda"), "H200; load avg 0.50/0.40/0.30 on 16 CPUs, no other process busy: quiet"
    t = lambda *xs: list(xs)  # noqa: E731
    rows = [dict(layers=8, tokens=16384, docs=64, path=p, fwd=t(9.0, 9.5, 9.1), step=t(30.0, 31.0, 30.5), syncs=s,
                 mask=m) for p, s, m in (("transformers", 1, 2**28), ("fastkit", 0, 0), ("per-layer metadata", 16, 0))]
    rows.append(dict(layers=8, tokens=16384, docs=64, path="transformers flash_attention_2",
                     na="n/a (flash_attn does not import on this machine)"))
    model_rows = [dict(layers=8, tokens=16384, m=0.05, pred_fwd=0.35, meas_fwd=t(-0.2, 0.3, 0.5), pred_step=0.75,
                       meas_step=t(0.1, 0.9, 1.3))]
    attn = [dict(tokens=16384, docs=64, dense=t(80.0, 82.0, 81.0), per_doc=t(5.0, 5.2, 5.1), mask=16384**2)]
    md = packed.render(rows, model_rows, attn, load, cuda)
    assert "measured fwd saved ms" in md and problems(md) == []
    routing = [dict(shape="qwen3-30b-a3b", impl=i, tokens=8192, fwd_ms=t(4.0, 4.2, 4.1), fwd_bwd_ms=t(9.0, 9.3, 9.1),
                    syncs_fwd=0, syncs_bwd=0) for i in moe.IMPLS]
    lora = [dict(shape="qwen3-30b-a3b", variant=v, tokens=8192, r=16, fwd_bwd_ms=t(12.0, 12.5, 12.2),
                 peak_bytes=2**30) for v in moe.LORA_VARIANTS]
    assert problems(moe._table(routing, lora, load)) == []
    side = dict(losses=[1.0, 0.9], times=t(0.1, 0.11, 0.1), tokens_per_s=4e4, peak=2**34, syncs=0)
    results = [dict(case=sft.GPU_CASES[0], base=side, fast=dict(side, times=t(0.05, 0.06, 0.05)), loss_diff=1e-3)]
    args = argparse.Namespace(steps=8, r=16, max_len=4096, checkpointing=True, repeats=1)
    md = sft.render(results, load, args, "Skipped for time (budget 48 s): gpt_oss.\n")
    assert "anchor kit" in md and problems(md) == []
    side = dict(side, loss_steps=[1, 2], warmup_extra_s=0.5, step_s=0.1)
    slow = dict(side, times=t(0.2, 0.21, 0.2), step_s=0.2, warmup_extra_s=40.0)
    results = [dict(case=sft.GPU_CASES[0], base=side, fast=side, loss_diff=0.0, losses_match=True,
                    compiled={"baseline": dict(slow, loss_diff=0.0, losses_match=True),
                              "fastkit": dict(side, times=t(0.05, 0.06, 0.05), step_s=0.05, warmup_extra_s=20.5,
                                              loss_diff=2e-5, losses_match=True)})]
    md = sft.render_compile(results, load, args)
    assert problems(md) == [] and "step 400" in md and "40 / 20" in md  # 20 s / (0.1 - 0.05) s per step


PROVENANCE = re.compile(r"Made by commit [0-9a-f]{7,}.* on .+, \d{4}-\d\d-\d\d \d\d:\d\d UTC: `python -m benchmarks \w+"
                        r"|Made before tables named their commit: last committed in [0-9a-f]{7,} \(\d{4}-\d\d-\d\d")


@pytest.mark.parametrize("path", TABLES, ids=lambda p: p.name)
def test_every_committed_table_names_what_made_it(path):
    assert PROVENANCE.search(path.read_text()), f"{path.name}: no commit / machine / date line"


FIGURE = re.compile(rf"{NUMBER}\s*×\s*\[\s*{NUMBER}\s*–\s*{NUMBER}\s*\]")
"""A measured ratio with its per-repeat range, as the bench tables print it (``1.64× [1.52–1.82]``)."""


GAINS = "\n## What you get"
"""README's section with the table of measured gains."""


def readme_figures(readme: str, section: str | None = GAINS) -> list[str]:
    """The measured ratios (with ranges) README's table of gains quotes (``section=None``: the whole text)."""
    if section is not None:
        readme = readme.split(section, 1)[1].split("\n## ", 1)[0]
    return FIGURE.findall(readme)


def unquoted(readme: str, sources: list[str], section: str | None = GAINS) -> list[str]:
    """Figures that no committed table or doc prints verbatim (rounded, or left over from an older run)."""
    return [f for f in readme_figures(readme, section) if not any(f in text for text in sources)]


def test_readme_quotes_its_figures_from_the_tables():
    """Every ``N× [a–b]`` in README's table of gains is copied from a committed table (assets/bench_*.md) or
    the doc that reads it (docs/*.md): a rerun that changes a table shows up here until README follows."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    sources = [p.read_text(encoding="utf-8") for p in [*TABLES, *sorted((ROOT / "docs").glob("*.md"))]]
    assert len(readme_figures(readme)) >= 5
    assert unquoted(readme, sources) == []
    stale = readme.replace(readme_figures(readme)[0], "9.99× [9.98–9.99]")  # the check can fail
    assert unquoted(stale, sources) == ["9.99× [9.98–9.99]"]


def test_benchmarks_page_quotes_its_figures_from_the_tables():
    """docs/benchmarks.md's summary table (README's Benchmarks section before issue 41) holds the same to the
    committed tables and the other docs (not to itself)."""
    page = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    sources = [p.read_text(encoding="utf-8") for p in [*TABLES, *sorted((ROOT / "docs").glob("*.md"))]
               if p.name != "benchmarks.md"]
    assert len(readme_figures(page, None)) >= 10
    assert unquoted(page, sources, None) == []
