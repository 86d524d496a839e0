"""Pure rendering of :class:`~fastkit.dashboard.callbacks.TrainingMetrics`: text, HTML and PNG.

Nothing here holds state or touches a widget: every function takes the metrics and returns a string
(or PNG bytes), so the views (:mod:`fastkit.dashboard.views`) and the tests share one source of truth.
The numbers come as keyed :data:`Rows` (``rows["steps_per_s"].value``): lookups never depend on
where a row sits in the table.
"""

from __future__ import annotations

import base64
import html
import io
import math
from typing import NamedTuple

from fastkit.dashboard.callbacks import TrainingMetrics
from fastkit.device import GiB

PLOT_SIZE_IN = (5.2, 3.0)
"""Live plot size (width, height) in inches at 100 dpi."""
SUMMARY_PLOT_SIZE_IN = (7.0, 3.6)
"""The static summary's plot size (inches at 100 dpi)."""
_MUTED = "var(--jp-ui-font-color2, #666)"
BORDER = "var(--jp-border-color2, #ddd)"
"""Panel and summary border colour (JupyterLab's theme variable where there is one)."""
_STATUS_COLOR = {"running": "#1a73e8", "finished": "#188038", "interrupted": "#e37400", "failed": "#d93025"}
_OP_NAMES = {"_local_scalar_dense": ".item()", "tolist": ".tolist()", "numpy": ".numpy()", "_to_copy": "copy to host"}
_STATUS_MARK = {"running": "●", "finished": "✓", "interrupted": "■", "failed": "✗", "idle": "○"}


# -- formatting ----------------------------------------------------------------------------
def fmt_duration(seconds: float | None) -> str:
    """``h:mm:ss`` (or ``m:ss``); '—' when unknown."""
    if seconds is None:
        return "—"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


def fmt_gib(n: int | None) -> str:
    return "—" if n is None else f"{n / GiB:.2f} GiB"


def fmt_rate(value: float | None, unit: str) -> str:
    """``1,234 tokens/s``, ``8.00 steps/s``, ``0.0123 steps/s``; '—' when unknown."""
    if value is None:
        return "—"
    if value >= 100:
        return f"{value:,.0f} {unit}"
    return f"{value:.2f} {unit}" if value >= 1 else f"{value:#.3g} {unit}"


def fmt_num(value: float | None, spec: str = ".4g") -> str:
    return "—" if value is None else format(value, spec)


def throughput_note(m: TrainingMetrics) -> str:
    if m.rates_include_warmup:
        return f"warm-up included (the run was not longer than its {m.warmup_steps} warm-up steps)"
    if m.steps_per_s is None and m.status == "running":
        return f"warming up ({m.warmup_steps} steps excluded)"
    return f"{m.warmup_steps} warm-up steps excluded"


# -- the rows every view shows ---------------------------------------------------------------
class Row(NamedTuple):
    """One line of a two-column table: what the reader sees on the left and on the right."""

    label: str
    value: str


Rows = dict[str, Row]
"""Table rows in display order, keyed by a stable name (``"steps_per_s"``, ``"gpu_peak"``, ...)."""


def insert_after(rows: Rows, after: str, key: str, row: Row) -> Rows:
    """``rows`` with ``key: row`` placed right after ``after`` (at the end when ``after`` is absent)."""
    if after not in rows:
        return {**rows, key: row}
    out: Rows = {}
    for k, r in rows.items():
        out[k] = r
        if k == after:
            out[key] = row
    return out


def without(rows: Rows, *keys: str) -> Rows:
    """``rows`` minus ``keys``."""
    return {k: r for k, r in rows.items() if k not in keys}


def memory_rows(m: TrainingMetrics) -> Rows:
    """Memory rows: device memory via torch on a GPU, host RAM always.

    Keys: ``gpu_memory``, ``gpu_peak`` (GPU only), ``process_ram``, ``host_ram``.
    """
    mem = m.memory
    rows: Rows = {}
    if mem is not None and m.on_gpu:
        rows["gpu_memory"] = Row("GPU allocated / reserved", f"{mem.allocated / GiB:.2f} / {fmt_gib(mem.reserved)}")
        rows["gpu_peak"] = Row("GPU peak allocated / reserved / total",
                               f"{m.peak_memory / GiB:.2f} / {m.peak_reserved / GiB:.2f} / {fmt_gib(mem.total)}")
    if mem is not None:
        if m.on_gpu:
            rows["process_ram"] = Row("Process RAM", fmt_gib(mem.host_rss))
        else:
            peak = fmt_gib(max(m.peak_memory, mem.host_rss))
            rows["process_ram"] = Row("Process RAM now / peak", f"{mem.host_rss / GiB:.2f} / {peak}")
    if m.host_total:
        used = m.host_total - m.host_available
        rows["host_ram"] = Row("Host RAM used / total", f"{fmt_gib(used)} / {fmt_gib(m.host_total)}")
    return rows


def _mean_std(m: TrainingMetrics, mean: str, std: str, spec: str = ".3g") -> str:
    value = fmt_num(m.rl.get(mean), spec)
    return value + (f" ± {fmt_num(m.rl[std], spec)}" if std in m.rl else "")


def rl_rows(m: TrainingMetrics) -> Rows:
    """Rows for the preference / RL metrics TRL logged (none for SFT). Keys: ``reward`` and ``reward:<function>``
    (GRPO, mean ± std), ``kl``, ``completion_length``, ``clipped_ratio`` (completions cut at the length limit),
    ``dpo_margin`` (chosen - rejected reward: DPO's pairs, KTO's desirable - undesirable rows), ``dpo_accuracy``
    (DPO pairs where chosen wins)."""
    rl, rows = m.rl, {}
    if "reward" in rl:
        rows["reward"] = Row("Reward (mean ± std)", _mean_std(m, "reward", "reward_std"))
    for key in rl:
        if key.startswith("rewards/") and key.endswith("/mean"):
            name = key[len("rewards/"):-len("/mean")]
            rows[f"reward:{name}"] = Row(f"  {name}", _mean_std(m, key, f"rewards/{name}/std"))
    for key, name, label, spec in (("kl", "kl", "KL to reference", ".3g"),
                                   ("completions/mean_length", "completion_length", "Completion length", ".4g"),
                                   ("completions/clipped_ratio", "clipped_ratio", "Clipped at max length", ".0%"),
                                   ("rewards/margins", "dpo_margin", "Reward margin", ".3g"),
                                   ("rewards/accuracies", "dpo_accuracy", "Pair accuracy", ".0%")):
        if key in rl:
            rows[name] = Row(label, format(rl[key], spec))
    return rows


def rl_progress(m: TrainingMetrics) -> list[str]:
    """The preference / RL numbers for the one-line terminal progress (empty for SFT)."""
    rl = m.rl
    parts = [f"reward {_mean_std(m, 'reward', 'reward_std')}" if "reward" in rl else "",
             f"kl {rl['kl']:.3g}" if "kl" in rl else "",
             f"len {rl['completions/mean_length']:.0f}" if "completions/mean_length" in rl else "",
             f"margin {rl['rewards/margins']:.3g}" if "rewards/margins" in rl else "",
             f"acc {rl['rewards/accuracies']:.0%}" if "rewards/accuracies" in rl else ""]
    return [p for p in parts if p]


def stat_rows(m: TrainingMetrics) -> Rows:
    """Rows for the numbers panel and the summary table.

    Keys: ``steps``, ``elapsed``, ``epoch``, ``steps_per_s``, ``tokens_per_s``, ``tokens_seen``, ``loss``,
    ``eval_loss`` and ``eval_time`` (when evaluated), ``compile_time`` (when torch.compile ran), ``learning_rate``,
    ``grad_norm``, then :func:`rl_rows`' keys
    (DPO / GRPO), :func:`memory_rows`' keys, then ``syncs`` (when measured: a debug switch).
    """
    eta = f" (ETA {fmt_duration(m.eta_s)})" if m.status == "running" else ""
    rows: Rows = {
        "steps": Row("Steps", f"{m.step} / {m.max_steps}"),
        "elapsed": Row("Elapsed", fmt_duration(m.elapsed_s) + eta),
        "epoch": Row("Epoch", f"{m.epoch:.2f}"),
        "steps_per_s": Row("Steps/s", fmt_rate(m.steps_per_s, "steps/s")),
        "tokens_per_s": Row("Tokens/s", fmt_rate(m.tokens_per_s, "tokens/s")),
        "tokens_seen": Row("Tokens trained", "—" if m.tokens_seen is None else f"{m.tokens_seen:,}"),
        "loss": Row("Loss", fmt_num(m.loss)),
        **({"eval_loss": Row("Eval loss", fmt_num(m.eval_loss)),
            "eval_time": Row("Evaluating", f"{fmt_duration(m.eval_s)} (not in steps/s, tokens/s)")}
           if m.eval_history else {}),
        **({"compile_time": Row("Compiling", f"{fmt_duration(m.compile_s)}, {m.compiles} graph"
                                             f"{'s' if m.compiles != 1 else ''} (not in steps/s, tokens/s)")}
           if m.compiles else {}),
        "learning_rate": Row("Learning rate", fmt_num(m.learning_rate, ".2e")),
        "grad_norm": Row("Grad norm", fmt_num(m.grad_norm, ".3g")),
    }
    rows.update(rl_rows(m))
    rows.update(memory_rows(m))
    if m.syncs_per_step is not None:
        top = ", ".join(f"{_OP_NAMES.get(op, op)} ×{n}" for op, n in list(m.syncs_by_op.items())[:3])
        rows["syncs"] = Row("Host syncs / step", f"{m.syncs_per_step}" + (f" ({top})" if top else ""))
    return rows


def optimization_items(m: TrainingMetrics) -> list[tuple[bool, str, str]]:
    """(active, name, how-or-why) for every optimization fastkit considered."""
    return [(True, k, v) for k, v in m.optimizations.items()] + [(False, k, v) for k, v in m.skipped.items()]


# -- plots -----------------------------------------------------------------------------------
SMOOTHING = 0.7
"""Weight of the smoothed loss line (TensorBoard's debiased exponential moving average)."""


def smoothed(values: list[float], weight: float = SMOOTHING) -> list[float]:
    """TensorBoard's debiased EMA of ``values`` (non-finite values skipped, their place keeps the last mean)."""
    out, mean, seen = [], 0.0, 0
    for v in values:
        if math.isfinite(v):
            seen += 1
            mean = weight * mean + (1 - weight) * v
        out.append(mean / (1 - weight ** seen) if seen else float("nan"))
    return out


def plot_png(m: TrainingMetrics, size: tuple[float, float] = PLOT_SIZE_IN, dpi: int = 100) -> bytes:
    """The curves as PNG bytes: loss (raw, smoothed, eval) on top; grad norm and learning rate small below.

    Each quantity has its own axes (a noisy grad norm never squeezes the loss). Uses matplotlib's
    object API with the Agg canvas, so it never touches pyplot's global figure state or the
    notebook's inline backend.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    fig = Figure(figsize=size, dpi=dpi)
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(2, 2, height_ratios=[2.2, 1], hspace=0.42, wspace=0.22)
    ax_loss, ax_gn, ax_lr = fig.add_subplot(grid[0, :]), fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1])
    _curve(ax_loss, m.loss_history, "#1a73e8", "loss", lw=1.0, alpha=0.35 if len(m.loss_history) > 3 else 1.0)
    if len(m.loss_history) > 3:
        steps, values = zip(*m.loss_history)
        ax_loss.plot(steps, smoothed(list(values)), color="#1a73e8", lw=1.8, label="loss (smoothed)")
    if m.eval_history:
        steps, values = zip(*m.eval_history)
        ax_loss.plot(steps, values, color="#188038", lw=1.6, marker="s", ms=3.5, label="eval loss")
    if len(m.loss_history) > 3 or m.eval_history:
        ax_loss.legend(fontsize=7, loc="upper right", frameon=False)
    ax_loss.set_title("Loss", fontsize=9, loc="left")
    _curve(ax_gn, m.grad_norm_history, "#80868b", "grad norm", lw=1.0)
    ax_gn.set_title("Grad norm", fontsize=8, loc="left")
    _curve(ax_lr, m.lr_history, "#e37400", "learning rate", lw=1.2)
    ax_lr.set_title("Learning rate", fontsize=8, loc="left")
    ax_lr.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.3g}"))  # 0.0002, no offset over the title
    ax_lr.yaxis.set_major_locator(MaxNLocator(3))
    ax_gn.yaxis.set_major_locator(MaxNLocator(3))
    for ax in (ax_loss, ax_gn, ax_lr):
        ax.tick_params(labelsize=7 if ax is ax_loss else 6)
        ax.grid(alpha=0.25, lw=0.6)
        ax.spines[["top", "right"]].set_visible(False)
        ax.set_xlim(0, max(m.step, 1) * 1.03)  # the steps done so far, readable early in a long run
    for ax in (ax_gn, ax_lr):
        ax.set_xlabel("step", fontsize=7, labelpad=1)
    fig.subplots_adjust(left=0.09, right=0.98, top=0.93, bottom=0.12)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def _curve(ax, points: list[tuple[int, float]], color: str, label: str, lw: float = 1.6, alpha: float = 1.0) -> None:
    if not points:
        ax.text(0.5, 0.5, f"no {label} logged yet", ha="center", va="center", fontsize=7, color="#80868b",
                transform=ax.transAxes)
        return
    steps, values = zip(*points)
    ax.plot(steps, values, color=color, lw=lw, alpha=alpha, marker="o" if len(points) < 30 else None, ms=2.5,
            label=label)


# -- HTML --------------------------------------------------------------------------------------
def table_html(rows: Rows) -> str:
    """A borderless two-column HTML table of ``rows`` (labels muted, values in tabular figures)."""
    cells = "".join(
        f"<tr style='background:none'><td style='padding:1px 12px 1px 0;color:{_MUTED};white-space:nowrap;"
        f"text-align:left;border:none'>{html.escape(k)}</td><td style='padding:1px 0;text-align:left;border:none;"
        f"font-variant-numeric:tabular-nums;white-space:nowrap'>{html.escape(v)}</td></tr>"
        for k, v in rows.values())
    return (f"<table style='border-collapse:collapse;font-size:12px;line-height:1.45;margin:0;"
            f"table-layout:auto'>{cells}</table>")


def optimizations_html(m: TrainingMetrics) -> str:
    items = optimization_items(m)
    if not items:
        return f"<div style='font-size:12px;color:{_MUTED}'>fastkit optimizations: none reported for this model</div>"
    chips = []
    for active, name, how in items:
        color, mark = ("#188038", "✓") if active else ("#80868b", "–")
        chips.append(f"<span title='{html.escape(how, quote=True)}' style='display:inline-block;margin:1px 6px 1px 0;"
                     f"padding:0 6px;border:1px solid {color};border-radius:9px;color:{color}'>"
                     f"{mark} {html.escape(name)}<span style='color:{_MUTED}'>: {html.escape(shorten(how))}</span>"
                     "</span>")
    return f"<div style='font-size:11.5px;line-height:1.7'><b>fastkit</b> {''.join(chips)}</div>"


def shorten(text: str, limit: int = 60) -> str:
    """``text`` cut to ``limit`` characters with an ellipsis."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def fmt_count(n: int) -> str:
    """``1.23M``, ``45.6K``, ``789``."""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(n)


def run_facts(m: TrainingMetrics) -> str:
    """The run header line: examples, effective batch, trainable parameters (what is known)."""
    parts = [run_kind(m)]
    if m.examples is not None:
        parts.append(f"{m.examples:,} examples")
    if m.effective_batch is not None:
        parts.append(f"effective batch {m.effective_batch}")
    if m.trainable_params is not None and m.total_params:
        pct = 100 * m.trainable_params / m.total_params
        parts.append(f"{fmt_count(m.trainable_params)} of {fmt_count(m.total_params)} parameters train ({pct:.2g}%)")
    return " · ".join(parts)


def eval_cadence(m: TrainingMetrics) -> str:
    """``"; evaluating every 12 steps and after the last"`` when the run evaluates; else empty."""
    if not m.eval_every:
        return ""
    if m.eval_every >= m.max_steps:
        return "; evaluating after the last step"
    return f"; evaluating every {m.eval_every} steps and after the last"


def run_kind(m: TrainingMetrics) -> str:
    """'new run', 'resumed from checkpoint-N' or 'continued from checkpoint-N, schedule extended to M steps'."""
    if m.run_note and m.resumed_from is not None:
        return m.run_note
    return "new run" if m.resumed_from is None else f"resumed from checkpoint-{m.resumed_from}"


ALERT_TITLES = {"nonfinite_loss": "Loss is not a number", "loss_spike": "Loss spike",
                "memory": "GPU memory nearly full"}
"""What each alert kind is called on the dashboard."""


def alert_lines(m: TrainingMetrics) -> list[str]:
    """One line per alert: ``"Loss spike: loss spiked to ..."``."""
    return [f"{ALERT_TITLES.get(k, k)}: {v}" for k, v in m.alerts.items()]


def alerts_html(m: TrainingMetrics) -> str:
    """A visible warning box (amber; red for a non-finite loss) with one line per alert, or ''."""
    if not m.alerts:
        return ""
    color, background = (("#b3261e", "#fce8e6") if "nonfinite_loss" in m.alerts else ("#8a4b00", "#fef7e0"))
    lines = "".join(f"<div>⚠ <b>{html.escape(ALERT_TITLES.get(k, k))}</b>: {html.escape(v)}</div>"
                    for k, v in m.alerts.items())
    return (f"<div class='fastkit-alerts' style='margin:4px 0;padding:4px 8px;border-left:4px solid {color};"
            f"background:{background};color:{color};font-size:12px;line-height:1.45'>{lines}</div>")


def header_html(m: TrainingMetrics, title: str | None = None) -> str:
    color = _STATUS_COLOR.get(m.status, _MUTED)
    name = title or " · ".join(x for x in (m.model_type, m.device) if x)
    status = f"{_STATUS_MARK.get(m.status, '')} {m.status}"
    why = (f"<div style='font-size:12px;color:{color}'>{html.escape(m.error)}</div>"
           if m.error and m.status != "finished" else "")
    return (f"<div style='display:flex;justify-content:space-between;align-items:baseline;gap:12px;font-size:13px'>"
            f"<span><b>fastkit training</b> <span style='color:{_MUTED}'>{html.escape(name)}</span></span>"
            f"<span style='color:{color};font-weight:600;white-space:nowrap'>{html.escape(status)}</span></div>"
            f"<div class='fastkit-run' style='font-size:11.5px;color:{_MUTED}'>{html.escape(run_facts(m))}</div>{why}"
            f"{alerts_html(m)}")


def progress_text(m: TrainingMetrics) -> str:
    pct = f"{100 * m.progress:.0f}%"
    eta = f"ETA {fmt_duration(m.eta_s)}" if m.status == "running" else m.status
    rate = fmt_rate(m.steps_per_s, "steps/s") if m.steps_per_s else throughput_note(m)
    if m.evaluating:
        rate = f"evaluating · {rate}"
    if m.compiling:
        rate = f"compiling · {rate}"
    return (f"<span style='font-size:12px;font-variant-numeric:tabular-nums'>step <b>{m.step}</b> / {m.max_steps}"
            f" · {pct} · {fmt_duration(m.elapsed_s)} elapsed · {eta} · {html.escape(rate)}</span>")


def png_img(png: bytes, css_class: str = "", width_px: int = 760) -> str:
    """``png`` inline as an ``<img>`` with a base64 data URI (survives a saved notebook, needs no files)."""
    data = base64.b64encode(png).decode("ascii")
    cls = f" class='{css_class}'" if css_class else ""
    return f"<img{cls} src='data:image/png;base64,{data}' style='max-width:100%;width:{width_px}px;height:auto'/>"


def summary_html(m: TrainingMetrics, title: str | None = None, png: bytes | None = None) -> str:
    """The static summary: header, numbers table, optimizations, and ``png`` inline when given (no widgets)."""
    first = m.loss_history[0][1] if m.loss_history else None
    rows = stat_rows(m)
    if first is not None and m.loss is not None:
        rows = insert_after(rows, "loss", "loss_first_last", Row("Loss first → last", f"{first:.4g} → {m.loss:.4g}"))
    rows["throughput_window"] = Row("Throughput window", throughput_note(m))
    return (f"<div class='fastkit-summary' style='border:1px solid {BORDER};border-radius:6px;padding:8px 12px;"
            f"max-width:760px'>{header_html(m, title)}<div style='margin:6px 0'>{table_html(rows)}</div>"
            f"{optimizations_html(m)}{png_img(png, width_px=700) if png else ''}</div>")


def summary_text(m: TrainingMetrics) -> str:
    """The summary as plain text lines (terminal view, logs)."""
    rows = stat_rows(m).values()
    width = max(len(k) for k, _ in rows)
    lines = [f"fastkit: training {m.status} at step {m.step}/{m.max_steps}" + (f" ({m.error})" if m.error else "")]
    lines.append(f"fastkit:   {run_facts(m)}")
    lines += [f"fastkit:   WARNING {line}" for line in alert_lines(m)]
    lines += [f"fastkit:   {k:<{width}}  {v}" for k, v in rows]
    lines += [f"fastkit:   {'+' if a else '-'} {name}: {how}" for a, name, how in optimization_items(m)]
    return "\n".join(lines)


def progress_line(m: TrainingMetrics) -> str:
    """One compact terminal line: step, %, rates, loss, LR, memory, ETA."""
    mem = m.memory
    if mem is not None and m.on_gpu:
        mem_s = f"mem {mem.allocated / GiB:.1f}/{mem.total / GiB:.1f} GiB"
    elif mem is not None:
        mem_s = f"rss {mem.host_rss / GiB:.1f} GiB"
    else:
        mem_s = ""
    parts = [f"step {m.step}/{m.max_steps} ({100 * m.progress:.0f}%)", "evaluating" if m.evaluating else "",
             "compiling" if m.compiling else "",
             fmt_rate(m.steps_per_s, "step/s") if m.steps_per_s else "warming up",
             fmt_rate(m.tokens_per_s, "tok/s") if m.tokens_per_s else "",
             f"loss {m.loss:.4f}" if m.loss is not None else "",
             f"eval {m.eval_loss:.4f}" if m.eval_loss is not None else "",
             f"lr {m.learning_rate:.2e}" if m.learning_rate is not None else "",
             *rl_progress(m), mem_s, f"ETA {fmt_duration(m.eta_s)}" if m.eta_s is not None else "",
             *(f"WARNING {line}" for line in alert_lines(m))]
    return "fastkit: " + " | ".join(p for p in parts if p)


class SummaryTable:
    """A titled two-column table that shows as HTML in a notebook and as text elsewhere."""

    def __init__(self, title: str, rows: Rows):
        self.title, self.rows = title, rows

    def _repr_html_(self) -> str:
        return (f"<div class='fastkit-table' style='font-size:12px'><b>{html.escape(self.title)}</b>"
                f"{table_html(self.rows)}</div>")

    def __repr__(self) -> str:
        width = max((len(k) for k, _ in self.rows.values()), default=0)
        return "\n".join([self.title] + [f"  {k:<{width}}  {v}" for k, v in self.rows.values()])


def memory_time_summary(m: TrainingMetrics, projected_steps: int = 1000) -> SummaryTable:
    """Where the time and memory went, and what a longer run would take at the measured rate.

    Row keys: ``status``, ``wall_time``, ``time_per_step``, ``steps_per_s``, ``tokens_per_s``, then
    ``peak_gpu`` and ``gpu_reserved`` (peak and now; GPU) or ``peak_ram`` (CPU), ``host_ram``, ``projected``.
    """
    per_step = "—" if not m.steps_per_s else f"{1000 / m.steps_per_s:,.0f} ms (after warm-up)"
    rows: Rows = {"status": Row("Status", f"{m.status}, {m.step} / {m.max_steps} steps"),
                  "wall_time": Row("Wall time", fmt_duration(m.elapsed_s)),
                  "time_per_step": Row("Time per step", per_step),
                  "steps_per_s": Row("Steps/s", fmt_rate(m.steps_per_s, "steps/s")),
                  "tokens_per_s": Row("Tokens/s", fmt_rate(m.tokens_per_s, "tokens/s"))}
    mem = m.memory
    if mem is not None and m.on_gpu and mem.total:
        rows["peak_gpu"] = Row("Peak GPU memory", f"{fmt_gib(m.peak_memory)} of {fmt_gib(mem.total)} "
                                                  f"({100 * m.peak_memory / mem.total:.0f}%)")
        rows["gpu_reserved"] = Row("Peak GPU reserved / now", f"{fmt_gib(m.peak_reserved)} / {fmt_gib(mem.reserved)}")
    elif mem is not None:
        rows["peak_ram"] = Row("Peak process RAM", fmt_gib(m.peak_memory))
    if m.host_total:
        used = fmt_gib(m.host_total - m.host_available)
        rows["host_ram"] = Row("Host RAM used / total", f"{used} / {fmt_gib(m.host_total)}")
    if m.steps_per_s:
        rows["projected"] = Row(f"{projected_steps:,} steps would take", fmt_duration(projected_steps / m.steps_per_s))
    return SummaryTable("Memory and time", rows)


__all__ = ["ALERT_TITLES", "Row", "Rows", "SUMMARY_PLOT_SIZE_IN", "SummaryTable", "alert_lines", "alerts_html",
           "fmt_count", "fmt_duration", "fmt_gib", "fmt_num", "fmt_rate", "header_html", "insert_after",
           "memory_rows", "memory_time_summary", "optimization_items", "optimizations_html", "plot_png", "png_img",
           "progress_line", "progress_text", "run_facts", "run_kind", "shorten", "smoothed", "stat_rows",
           "summary_html", "summary_text", "table_html", "throughput_note", "without"]
