"""The before/after report: one table (base | tuned | change), the answers that changed most, forgetting.

``EvalReport.save(folder)`` writes ``report.md``, ``results.json`` and ``plot.png`` (the PNG needs matplotlib, the
``notebook`` extra; without it the report says so and the other two files are written). In a notebook the report
shows itself as an HTML table.
"""

from __future__ import annotations

import html
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fastkit.evaluation.forgetting import Forgetting

logger = logging.getLogger("fastkit")

LOWER_IS_BETTER = ("loss", "perplexity")
"""Metrics where the tuned model is ahead when its number is smaller; every other metric is a pass rate."""


@dataclass(frozen=True)
class Example:
    """One held-out prompt answered by both models."""

    row: int
    """The row, counted from 1."""
    prompt: str
    """The prompt's text (its last 300 characters)."""
    reference: str
    """The data's answer."""
    base: str
    """The base model's greedy answer."""
    tuned: str
    """The tuned model's greedy answer."""
    change: float
    """How much the answer changed: checks that flipped, plus how different the two texts are (0..1)."""


@dataclass
class EvalReport:
    """Base and tuned side by side on held-out rows."""

    rows: int
    """Rows evaluated."""
    metrics: dict[str, tuple[float, float]]
    """Metric -> (base, tuned), in the table's order: loss and perplexity on the answers' tokens, then the pass rate
    of each check on greedy answers, then on sampled ones."""
    examples: list[Example] = field(default_factory=list)
    """The prompts whose answers changed most, most first."""
    forgetting: Forgetting | None = None
    """Forgetting on general text and drift on general prompts (:mod:`fastkit.evaluation.forgetting`); None when not
    measured."""
    interrupted: bool = False
    """Stopped early (Ctrl-C): the numbers cover :attr:`rows` rows."""
    options: dict[str, Any] = field(default_factory=dict)
    """The options it ran with."""
    benchmarks: dict[str, dict[str, tuple[float, float]]] = field(default_factory=dict)
    """lm-evaluation-harness tasks (``lm_eval`` option): task -> metric -> (base, tuned), lm-eval's own numbers."""
    tuned: str = ""
    """What the tuned model was when it is not a transformers model (``"<file>.gguf in llama.cpp"``), else empty."""

    def title(self) -> str:
        """``Before / after: N held-out rows`` (and what the tuned model was, and whether it was interrupted)."""
        return (f"Before / after: {self.rows} held-out rows" + (f" (tuned: {self.tuned})" if self.tuned else "")
                + (" (interrupted)" if self.interrupted else ""))

    def ahead(self, metric: str) -> bool:
        """The tuned model is strictly better than the base on ``metric``."""
        base, tuned = self.metrics[metric]
        return tuned < base if metric in LOWER_IS_BETTER else tuned > base

    def table(self) -> str:
        """The metrics as a markdown table."""
        lines = ["| metric | base | tuned | change |", "|---|---:|---:|---:|"]
        for name, (base, tuned) in self.metrics.items():
            lines.append(f"| {name} | {_fmt(name, base)} | {_fmt(name, tuned)} | {_change(name, base, tuned)} |")
        return "\n".join(lines)

    def benchmark_table(self) -> str:
        """lm-eval's tasks as a markdown table: task, metric, base, tuned, change (lm-eval's numbers, 4 decimals)."""
        lines = ["| task | metric | base | tuned | change |", "|---|---|---:|---:|---:|"]
        for task, values in self.benchmarks.items():
            for name, (base, tuned) in values.items():
                lines.append(f"| {task} | {name} | {base:.4f} | {tuned:.4f} | {tuned - base:+.4f} |")
        return "\n".join(lines)

    def summary(self) -> str:
        """The report as markdown: the table, forgetting, the answers that changed most."""
        parts = [f"# {self.title()}", self.table()]
        if self.forgetting is not None:
            parts.append(forgetting_line(self.forgetting))
        if self.benchmarks:
            parts.append("## Benchmarks (lm-evaluation-harness)\n\n" + self.benchmark_table())
        if self.examples:
            parts.append("## Answers that changed most\n\n" + "\n\n".join(map(_example_md, self.examples)))
        return "\n\n".join(parts) + "\n"

    def to_dict(self) -> dict[str, Any]:
        """Everything as plain JSON types (``results.json``)."""
        out = {"rows": self.rows, "interrupted": self.interrupted, "options": self.options,
               "metrics": {k: {"base": b, "tuned": t} for k, (b, t) in self.metrics.items()},
               "examples": [asdict(e) for e in self.examples]}
        if self.forgetting is not None:
            out["forgetting"] = {**asdict(self.forgetting), "warned": self.forgetting.warned}
        if self.tuned:
            out["tuned"] = self.tuned
        if self.benchmarks:
            out["lm_eval"] = {task: {m: {"base": b, "tuned": t} for m, (b, t) in values.items()}
                              for task, values in self.benchmarks.items()}
        return out

    def save(self, folder: str | Path) -> Path:
        """``report.md``, ``results.json`` and ``plot.png`` in ``folder`` (created); returns the folder."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "report.md").write_text(self.summary(), encoding="utf-8")
        (folder / "results.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
        _plot(self, folder / "plot.png")
        return folder

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{_fmt(k, b)}</td><td>{_fmt(k, t)}</td>"
                       f"<td>{_change(k, b, t)}</td></tr>" for k, (b, t) in self.metrics.items())
        extra = f"<p>{html.escape(forgetting_line(self.forgetting))}</p>" if self.forgetting else ""
        return (f"<p><b>{html.escape(self.title())}</b></p><table><tr><th>metric</th><th>base</th>"
                f"<th>tuned</th><th>change</th></tr>{rows}</table>{extra}")


def forgetting_line(f: Forgetting) -> str:
    """Forgetting and drift in two sentences, with the warning when the forgetting is above its threshold."""
    line = (f"Forgetting: {f.forgetting:+.3f} nats/token on general text (warns above {f.threshold}; its perplexity "
            f"{f.base_text_perplexity:.2f} (base) -> {f.tuned_text_perplexity:.2f} (tuned)). Drift on general prompts: "
            f"{f.drift:.3f} nats/token (a new answer format counts; the base's own answers' perplexity "
            f"{f.base_perplexity:.2f} -> {f.tuned_perplexity:.2f}).")
    return line + (" WARNING: the tuned model finds plain general text much less likely than the base did: it may "
                   "have lost knowledge or fluency; fewer steps, a lower learning rate or a smaller LoRA rank forget "
                   "less." if f.warned else "")


def _fmt(name: str, value: float) -> str:
    return f"{value:.4f}" if name in LOWER_IS_BETTER else f"{value:.0%}"


def _change(name: str, base: float, tuned: float) -> str:
    if name in LOWER_IS_BETTER:
        return f"{tuned - base:+.4f}"
    return f"{(tuned - base) * 100:+.0f} pts"


def _example_md(e: Example) -> str:
    def quote(text: str) -> str:
        return " ".join(text.split())[:300] or "(empty)"

    return (f"**Row {e.row}**: {quote(e.prompt)}\n\n- reference: {quote(e.reference)}\n- base: {quote(e.base)}\n"
            f"- tuned: {quote(e.tuned)}")


def _plot(report: EvalReport, path: Path) -> None:
    from fastkit.extras import install_line, installed

    if not installed("matplotlib"):
        logger.info("fastkit eval: no plot.png (it needs matplotlib: %s)", install_line("matplotlib"))
        return
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    rates = [k for k in report.metrics if k not in LOWER_IS_BETTER]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), gridspec_kw={"width_ratios": [max(len(rates), 1), 1]})
    for ax, names, label in ((axes[0], rates, "pass rate"), (axes[1], ["loss"], "answer loss (nats/token)")):
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], [report.metrics[n][0] for n in names], 0.4, label="base", color="#999")
        ax.bar([x + 0.2 for x in xs], [report.metrics[n][1] for n in names], 0.4, label="tuned", color="#e4572e")
        ax.set_xticks(list(xs), names, rotation=20, ha="right")
        ax.set_ylabel(label)
    axes[0].legend()
    fig.suptitle(f"Before / after on {report.rows} held-out rows")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["EvalReport", "Example", "LOWER_IS_BETTER", "forgetting_line"]
