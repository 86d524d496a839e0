"""The training dashboard: draws what :class:`fastkit.callbacks.MetricsCallback` collects.

In Jupyter, Colab and VS Code an ipywidgets panel shows progress and ETA, steps/s and tokens/s
(after warm-up), live loss and learning-rate curves, grad norm, memory and fastkit's active
optimizations. Widgets are gone when a notebook is reopened, so when training ends (or is
interrupted) the panel also leaves a static summary in the cell output: an HTML table and a PNG
plot. Outside a notebook the same callback logs a compact progress line instead.

    from fastkit.dashboard import fit
    metrics = fit(trainer)          # trainer.train() with the dashboard; Ctrl-C / "stop" ends cleanly

:func:`fit` turns a ``KeyboardInterrupt`` into a clean stop: the model keeps the weights of the
last finished step, its gradients are dropped, the summary is shown, and the cell does not fail.
"""

from __future__ import annotations

import html
import io
import logging
import time
from typing import Any

import torch

from fastkit.callbacks import MetricsCallback, TrainingMetrics
from fastkit.device import GiB

logger = logging.getLogger(__name__)

PLOT_SIZE_IN = (5.2, 2.2)
"""Live plot size (width, height) in inches at 100 dpi."""
_MUTED = "var(--jp-ui-font-color2, #666)"
_BORDER = "var(--jp-border-color2, #ddd)"
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
    if m.steps_per_s is None and m.status == "running":
        return f"warming up ({m.warmup_steps} steps excluded)"
    return f"{m.warmup_steps} warm-up steps excluded"


# -- the rows every view shows ---------------------------------------------------------------
def memory_rows(m: TrainingMetrics) -> list[tuple[str, str]]:
    """(label, value) rows for memory: device memory via torch on a GPU, host RAM always."""
    mem = m.memory
    rows: list[tuple[str, str]] = []
    if mem is not None and m.on_gpu:
        rows.append(("GPU allocated / reserved", f"{mem.allocated / GiB:.2f} / {fmt_gib(mem.reserved)}"))
        rows.append(("GPU peak / total", f"{m.peak_memory / GiB:.2f} / {fmt_gib(mem.total)}"))
    if mem is not None:
        if m.on_gpu:
            rows.append(("Process RAM", fmt_gib(mem.host_rss)))
        else:
            rows.append(("Process RAM now / peak", f"{mem.host_rss / GiB:.2f} / {fmt_gib(max(m.peak_memory, mem.host_rss))}"))
    if m.host_total:
        used = m.host_total - m.host_available
        rows.append(("Host RAM used / total", f"{fmt_gib(used)} / {fmt_gib(m.host_total)}"))
    return rows


def stat_rows(m: TrainingMetrics) -> list[tuple[str, str]]:
    """(label, value) rows for the numbers panel and the summary table."""
    rows = [
        ("Steps", f"{m.step} / {m.max_steps}"),
        ("Elapsed", fmt_duration(m.elapsed_s) + (f" (ETA {fmt_duration(m.eta_s)})" if m.status == "running" else "")),
        ("Steps/s", fmt_rate(m.steps_per_s, "steps/s")),
        ("Tokens/s", fmt_rate(m.tokens_per_s, "tokens/s")),
        ("Tokens trained", "—" if m.tokens_seen is None else f"{m.tokens_seen:,}"),
        ("Loss", fmt_num(m.loss)),
        ("Learning rate", fmt_num(m.learning_rate, ".2e")),
        ("Grad norm", fmt_num(m.grad_norm, ".3g")),
    ]
    rows += memory_rows(m)
    if m.syncs_per_step is not None:
        top = ", ".join(f"{_OP_NAMES.get(op, op)} ×{n}" for op, n in list(m.syncs_by_op.items())[:3])
        rows.append(("Host syncs / step", f"{m.syncs_per_step}" + (f" ({top})" if top else "")))
    return rows


def optimization_items(m: TrainingMetrics) -> list[tuple[bool, str, str]]:
    """(active, name, how-or-why) for every optimization fastkit considered."""
    return [(True, k, v) for k, v in m.optimizations.items()] + [(False, k, v) for k, v in m.skipped.items()]


# -- plots -----------------------------------------------------------------------------------
def plot_png(m: TrainingMetrics, size: tuple[float, float] = PLOT_SIZE_IN, dpi: int = 100) -> bytes:
    """Loss and learning-rate curves (grad norm on the loss panel's right axis) as PNG bytes.

    Uses matplotlib's object API with the Agg canvas, so it never touches pyplot's global figure
    state or the notebook's inline backend.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=dpi)
    FigureCanvasAgg(fig)
    ax_loss, ax_lr = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    _curve(ax_loss, m.loss_history, "#1a73e8", "loss")
    ax_loss.set_title("Training loss", fontsize=9, loc="left")
    if m.grad_norm_history and m.loss_history:
        ax_gn = ax_loss.twinx()
        _curve(ax_gn, m.grad_norm_history, "#9aa0a6", "grad norm", lw=1.0, ls="--")
        ax_gn.set_ylabel("grad norm", fontsize=7, color="#80868b")
        ax_gn.tick_params(labelsize=7, colors="#80868b")
        ax_gn.spines[["top"]].set_visible(False)
        ax_loss.set_title("Training loss · grad norm (dashed, right)", fontsize=9, loc="left")
    _curve(ax_lr, m.lr_history, "#e37400", "learning rate")
    ax_lr.set_title("Learning rate", fontsize=9, loc="left")
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    ax_lr.yaxis.get_offset_text().set_fontsize(7)
    for ax in (ax_loss, ax_lr):
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.25, lw=0.6)
        ax.spines[["top", "right"]].set_visible(False)
        ax.set_xlim(0, max(m.step, 1) * 1.03)  # the steps done so far, readable early in a long run
    fig.tight_layout(pad=0.6)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def _curve(ax, points: list[tuple[int, float]], color: str, label: str, lw: float = 1.6, ls: str = "-") -> None:
    if not points:
        ax.text(0.5, 0.5, f"no {label} logged yet", ha="center", va="center", fontsize=8, color="#80868b",
                transform=ax.transAxes)
        return
    steps, values = zip(*points)
    ax.plot(steps, values, color=color, lw=lw, ls=ls, marker="o" if len(points) < 30 else None, ms=2.5)


# -- HTML --------------------------------------------------------------------------------------
def _table(rows: list[tuple[str, str]]) -> str:
    cells = "".join(
        f"<tr style='background:none'><td style='padding:1px 12px 1px 0;color:{_MUTED};white-space:nowrap;"
        f"text-align:left;border:none'>{html.escape(k)}</td><td style='padding:1px 0;text-align:left;border:none;"
        f"font-variant-numeric:tabular-nums;white-space:nowrap'>{html.escape(v)}</td></tr>"
        for k, v in rows)
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
                     f"{mark} {html.escape(name)}<span style='color:{_MUTED}'>: {html.escape(_short(how))}</span></span>")
    return f"<div style='font-size:11.5px;line-height:1.7'><b>fastkit</b> {''.join(chips)}</div>"


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def header_html(m: TrainingMetrics, title: str | None = None) -> str:
    color = _STATUS_COLOR.get(m.status, _MUTED)
    name = title or " · ".join(x for x in (m.model_type, m.device) if x)
    status = f"{_STATUS_MARK.get(m.status, '')} {m.status}"
    why = (f"<div style='font-size:12px;color:{color}'>{html.escape(m.error)}</div>"
           if m.error and m.status != "finished" else "")
    return (f"<div style='display:flex;justify-content:space-between;align-items:baseline;gap:12px;font-size:13px'>"
            f"<span><b>fastkit training</b> <span style='color:{_MUTED}'>{html.escape(name)}</span></span>"
            f"<span style='color:{color};font-weight:600;white-space:nowrap'>{html.escape(status)}</span></div>{why}")


def progress_text(m: TrainingMetrics) -> str:
    pct = f"{100 * m.progress:.0f}%"
    eta = f"ETA {fmt_duration(m.eta_s)}" if m.status == "running" else m.status
    rate = fmt_rate(m.steps_per_s, "steps/s") if m.steps_per_s else throughput_note(m)
    return (f"<span style='font-size:12px;font-variant-numeric:tabular-nums'>step <b>{m.step}</b> / {m.max_steps}"
            f" · {pct} · {fmt_duration(m.elapsed_s)} elapsed · {eta} · {html.escape(rate)}</span>")


def summary_html(m: TrainingMetrics, title: str | None = None) -> str:
    """The static end-of-training summary: header, numbers table, optimizations (no widgets)."""
    first = m.loss_history[0][1] if m.loss_history else None
    rows = stat_rows(m)
    if first is not None and m.loss is not None:
        rows.insert(6, ("Loss first → last", f"{first:.4g} → {m.loss:.4g}"))
    rows.append(("Throughput window", throughput_note(m)))
    return (f"<div class='fastkit-summary' style='border:1px solid {_BORDER};border-radius:6px;padding:8px 12px;"
            f"max-width:760px'>{header_html(m, title)}<div style='margin:6px 0'>{_table(rows)}</div>"
            f"{optimizations_html(m)}</div>")


def summary_text(m: TrainingMetrics) -> str:
    """The summary as plain text lines (terminal view, logs)."""
    width = max(len(k) for k, _ in stat_rows(m))
    lines = [f"fastkit: training {m.status} at step {m.step}/{m.max_steps}" + (f" ({m.error})" if m.error else "")]
    lines += [f"fastkit:   {k:<{width}}  {v}" for k, v in stat_rows(m)]
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
    parts = [f"step {m.step}/{m.max_steps} ({100 * m.progress:.0f}%)",
             fmt_rate(m.steps_per_s, "step/s") if m.steps_per_s else "warming up",
             fmt_rate(m.tokens_per_s, "tok/s") if m.tokens_per_s else "",
             f"loss {m.loss:.4f}" if m.loss is not None else "",
             f"lr {m.learning_rate:.2e}" if m.learning_rate is not None else "",
             mem_s, f"ETA {fmt_duration(m.eta_s)}" if m.eta_s is not None else ""]
    return "fastkit: " + " | ".join(p for p in parts if p)


class SummaryTable:
    """A titled two-column table that shows as HTML in a notebook and as text elsewhere."""

    def __init__(self, title: str, rows: list[tuple[str, str]]):
        self.title, self.rows = title, rows

    def _repr_html_(self) -> str:
        return (f"<div class='fastkit-table' style='font-size:12px'><b>{html.escape(self.title)}</b>"
                f"{_table(self.rows)}</div>")

    def __repr__(self) -> str:
        width = max((len(k) for k, _ in self.rows), default=0)
        return "\n".join([self.title] + [f"  {k:<{width}}  {v}" for k, v in self.rows])


def memory_time_summary(m: TrainingMetrics, projected_steps: int = 1000) -> SummaryTable:
    """Where the time and memory went, and what a longer run would take at the measured rate."""
    rows = [("Status", f"{m.status}, {m.step} / {m.max_steps} steps"),
            ("Wall time", fmt_duration(m.elapsed_s)),
            ("Time per step", "—" if not m.steps_per_s else f"{1000 / m.steps_per_s:,.0f} ms (after warm-up)"),
            ("Steps/s", fmt_rate(m.steps_per_s, "steps/s")),
            ("Tokens/s", fmt_rate(m.tokens_per_s, "tokens/s"))]
    mem = m.memory
    if mem is not None and m.on_gpu and mem.total:
        rows.append(("Peak GPU memory", f"{fmt_gib(m.peak_memory)} of {fmt_gib(mem.total)} "
                                        f"({100 * m.peak_memory / mem.total:.0f}%)"))
        rows.append(("GPU reserved now", fmt_gib(mem.reserved)))
    elif mem is not None:
        rows.append(("Peak process RAM", fmt_gib(m.peak_memory)))
    if m.host_total:
        rows.append(("Host RAM used / total", f"{fmt_gib(m.host_total - m.host_available)} / {fmt_gib(m.host_total)}"))
    if m.steps_per_s:
        rows.append((f"{projected_steps:,} steps would take", fmt_duration(projected_steps / m.steps_per_s)))
    return SummaryTable("Memory and time", rows)


# -- environment -------------------------------------------------------------------------------
def in_notebook() -> bool:
    """True inside a Jupyter / Colab / VS Code kernel that can show ipywidgets."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    if shell is None or getattr(shell, "kernel", None) is None:
        return False
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True


# -- views -------------------------------------------------------------------------------------
class WidgetView:
    """The ipywidgets panel. Text refreshes every ``text_every_s``, the plot every ``plot_every_s``."""

    def __init__(self, title: str | None = None, plot_every_s: float = 1.0, text_every_s: float = 0.2):
        import ipywidgets as w

        self.title, self.plot_every_s, self.text_every_s = title, plot_every_s, text_every_s
        self._last_plot = self._last_text = -1e9
        self.header = w.HTML()
        self.bar = w.FloatProgress(value=0.0, min=0.0, max=1.0, bar_style="info",
                                   layout=w.Layout(width="260px", height="18px", margin="0 10px 0 0"))
        self.progress = w.HTML()
        self.plot = w.Image(format="png", layout=w.Layout(width=f"{int(PLOT_SIZE_IN[0] * 100)}px",
                                                           max_width="100%", height="auto", min_width="320px"))
        self.stats = w.HTML(layout=w.Layout(margin="4px 0 0 8px"))
        self.opts = w.HTML()
        self.box = w.VBox(
            [self.header, w.HBox([self.bar, self.progress], layout=w.Layout(align_items="center")),
             w.HBox([self.plot, self.stats], layout=w.Layout(align_items="flex-start", flex_flow="row wrap")),
             self.opts],
            layout=w.Layout(border=f"1px solid {_BORDER}", padding="8px 12px", max_width="900px", width="auto"))
        self.box.add_class("fastkit-dashboard")

    def __call__(self, event: str, m: TrainingMetrics) -> None:
        from IPython.display import display

        if event == "begin":
            self._refresh(m, plot=True)
            display(self.box)
            return
        now = time.monotonic()
        final = event == "end"
        plot_due = final or (event == "log" and now - self._last_plot >= self.plot_every_s)
        if plot_due or now - self._last_text >= self.text_every_s:
            self._refresh(m, plot=plot_due)
        if final:
            show_summary(m, self.title)

    def _refresh(self, m: TrainingMetrics, plot: bool) -> None:
        self._last_text = time.monotonic()
        self.header.value = header_html(m, self.title)
        self.bar.value = m.progress
        self.bar.bar_style = {"finished": "success", "interrupted": "warning", "failed": "danger"}.get(m.status, "info")
        self.progress.value = progress_text(m)
        self.stats.value = _table(stat_rows(m)[2:])
        self.opts.value = optimizations_html(m)
        if plot:
            self._last_plot = time.monotonic()
            self.plot.value = plot_png(m)
            if m.loss_history:
                self.plot.add_class("fastkit-has-curves")  # lets a browser test wait for drawn curves


class TerminalView:
    """Outside a notebook: one compact progress line every ``every_s`` seconds, a text summary at the end."""

    def __init__(self, every_s: float = 10.0):
        self.every_s = every_s
        self._last = -1e9

    def __call__(self, event: str, m: TrainingMetrics) -> None:
        if event == "begin":
            logger.info("fastkit: training %s on %s for %d steps", m.model_type or "model", m.device, m.max_steps)
            return
        now = time.monotonic()
        if event == "end":
            logger.info(summary_text(m))
        elif now - self._last >= self.every_s:  # 'step' or 'log': whichever comes first after every_s
            self._last = now
            logger.info(progress_line(m))


def show_summary(m: TrainingMetrics, title: str | None = None) -> None:
    """Put the static summary (HTML table, then the PNG plot) in the current cell's output."""
    from IPython.display import HTML, Image, display

    display(HTML(summary_html(m, title)))
    display(Image(data=plot_png(m, size=(7.6, 2.6)), format="png"))


def make_view(view: str = "auto", title: str | None = None):
    """'auto' (widget in a notebook, else terminal), 'widget', 'terminal' or 'none'."""
    if view == "auto":
        view = "widget" if in_notebook() else "terminal"
    if view == "widget":
        return WidgetView(title)
    if view == "terminal":
        return TerminalView()
    if view == "none":
        return None
    raise ValueError(f"view must be 'auto', 'widget', 'terminal' or 'none', got {view!r}")


def dashboard_callback(view: str = "auto", title: str | None = None, **callback_kwargs: Any) -> MetricsCallback:
    """A :class:`MetricsCallback` with the dashboard attached, for ``Trainer(callbacks=[...])``."""
    callback = MetricsCallback(**callback_kwargs)
    drawer = make_view(view, title)
    if drawer is not None:
        callback.add_listener(drawer)
    return callback


# -- running a trainer -------------------------------------------------------------------------
_PROGRESS_CALLBACKS = ("ProgressCallback", "NotebookProgressCallback", "PrinterCallback")


def fit(trainer, *, view: str = "auto", title: str | None = None, warmup_steps: int = 2,
        measure_syncs: bool = True, clock=None, **train_kwargs: Any) -> TrainingMetrics:
    """Run ``trainer.train(**train_kwargs)`` with the dashboard; returns the final :class:`TrainingMetrics`.

    The trainer's own progress bar / log printer are set aside while it runs (the dashboard shows
    the same numbers). A ``KeyboardInterrupt`` (Ctrl-C, Jupyter's stop button) ends training
    cleanly: the summary is shown, the model keeps the weights of the last finished optimizer step
    and stays usable (gradients dropped, memory released), and the cell does not fail. Any other
    error also shows the summary, then propagates.
    """
    kwargs = dict(warmup_steps=warmup_steps, measure_syncs=measure_syncs)
    if clock is not None:
        kwargs["clock"] = clock
    callback = dashboard_callback(view, title, **kwargs)
    set_aside = [cb for cb in list(trainer.callback_handler.callbacks) if type(cb).__name__ in _PROGRESS_CALLBACKS]
    for cb in set_aside:
        trainer.remove_callback(cb)
    trainer.add_callback(callback)
    try:
        trainer.train(**train_kwargs)
    except KeyboardInterrupt:
        step = _settle(trainer, callback)
        logger.warning("fastkit: training interrupted after step %d/%d; the model keeps the weights trained so far.",
                       step, callback.metrics.max_steps)
        callback.finish("interrupted", f"stopped by the user after step {step}")
    except Exception as exc:
        _settle(trainer, callback)
        callback.finish("failed", f"{type(exc).__name__}: {_short(str(exc), 120)}")
        raise
    finally:
        trainer.remove_callback(callback)
        for cb in set_aside:
            trainer.add_callback(cb)
    return callback.metrics


def _settle(trainer, callback: MetricsCallback) -> int:
    """After an interrupted step: drop half-made gradients and cached blocks so the model is usable.

    Returns the optimizer steps done (the trainer counts a step before its step-end callbacks run,
    so this can be one more than the last step the dashboard saw).
    """
    trainer.model.zero_grad(set_to_none=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    callback.metrics.step = max(callback.metrics.step, int(trainer.state.global_step))
    return callback.metrics.step


__all__ = ["SummaryTable", "TerminalView", "WidgetView", "dashboard_callback", "fit", "in_notebook", "memory_time_summary", "plot_png", "show_summary",
           "summary_html", "summary_text"]
