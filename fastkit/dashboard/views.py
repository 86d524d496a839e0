"""Where the dashboard shows up: HTML updated in place in a notebook, a progress line in a terminal.

A view is a listener of :class:`~fastkit.dashboard.callbacks.MetricsCallback`: it gets
``view(event, metrics)`` and draws with :mod:`fastkit.dashboard.render`.

- :class:`HtmlView` (the notebook default): one HTML output (numbers, curves as an inline PNG)
  replaced in place through an IPython display handle, the way transformers' notebook progress
  callback works. It needs no widget manager, so it renders in Jupyter, JupyterLab, Colab, VS Code
  and in a saved notebook alike, and because the output itself is the latest state, a kernel that
  dies (out of memory) leaves the last numbers on the page.
- :class:`WidgetView` (``view="widget"``): the ipywidgets panel, for front-ends whose widget
  manager renders it; it leaves a static summary (HTML table and PNG) when training ends.
- :class:`TerminalView`: a compact log line outside a notebook.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from fastkit.dashboard.callbacks import MetricsCallback, TrainingMetrics
from fastkit.dashboard.choices import VIEWS
from fastkit.dashboard.render import (
    BORDER,
    PLOT_SIZE_IN,
    SUMMARY_PLOT_SIZE_IN,
    alert_lines,
    eval_cadence,
    header_html,
    optimizations_html,
    plot_png,
    png_img,
    progress_line,
    progress_text,
    run_kind,
    stat_rows,
    summary_html,
    summary_text,
    table_html,
    without,
)

logger = logging.getLogger(__name__)


WIDGET_FALLBACK = "fastkit dashboard (this front-end does not render ipywidgets: use fit(trainer, view='html'))"
"""What a front-end without the widget manager prints instead of the widget (never ``VBox(children=...)``)."""


def in_notebook() -> bool:
    """True inside a Jupyter / Colab / VS Code kernel (anything that shows rich outputs)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


class HtmlView:
    """The dashboard as one HTML output, replaced in place through an IPython display handle.

    The panel (header, run facts and alerts, progress bar, curves as an inline base64 PNG, numbers,
    optimizations) is redrawn at most every ``every_s`` seconds, the curves with it (at most every
    ``plot_every_s``, by default the same: the curves end where the numbers are). Drawing the curves
    blocks the training loop, so the redraw interval also stretches to the last plot's duration over
    ``overhead`` (at most that share of the host's time goes to drawing; never past ``max_every_s``; the
    first plot, which imports matplotlib, does not count). The end always
    redraws, as the static summary (``fastkit-summary``). Each update replaces the output, so the
    saved notebook always holds the latest state.
    """

    def __init__(self, title: str | None = None, every_s: float = 1.0, plot_every_s: float | None = None,
                 overhead: float = 0.2, max_every_s: float = 5.0):
        self.title, self.every_s, self.overhead, self.max_every_s = title, every_s, overhead, max_every_s
        self.plot_every_s = every_s if plot_every_s is None else plot_every_s
        self._plot_s = 0.0
        self.handle = None
        self._png = b""
        self._png_has_curves = False
        self._last = self._last_plot = -1e9

    def __call__(self, event: str, m: TrainingMetrics) -> None:
        from IPython.display import display

        now = time.monotonic()
        if event == "begin":
            self._plot(m, now)
            self._plot_s = 0.0  # matplotlib's import, not the cost of a redraw
            self._last = now
            self.handle = display(self._bundle(m), raw=True, display_id=True)
            return
        final = event == "end"
        due = max(self.every_s, min(self._plot_s / self.overhead, self.max_every_s))
        if not final and event not in ("evaluate", "compile") and now - self._last < due:  # shown at once
            return
        if final or now - self._last_plot >= self.plot_every_s:  # whichever event comes first when due
            self._plot(m, now, size=SUMMARY_PLOT_SIZE_IN if final else PLOT_SIZE_IN)
        self._last = now
        bundle = self._bundle(m, final)
        if self.handle is None:
            self.handle = display(bundle, raw=True, display_id=True)
        else:
            self.handle.update(bundle, raw=True)

    def _plot(self, m: TrainingMetrics, now: float, size: tuple[float, float] = PLOT_SIZE_IN) -> None:
        start = time.monotonic()
        self._png, self._png_has_curves, self._last_plot = plot_png(m, size=size), bool(m.loss_history), now
        self._plot_s = time.monotonic() - start

    def _bundle(self, m: TrainingMetrics, final: bool = False) -> dict[str, str]:
        if final:
            body = summary_html(m, self.title, png=self._png).replace("class='fastkit-summary'",
                                                                       "class='fastkit-dashboard fastkit-summary'", 1)
            return {"text/html": body, "text/plain": summary_text(m)}
        return {"text/html": panel_html(m, self.title, self._png, self._png_has_curves),
                "text/plain": progress_line(m)}


def panel_html(m: TrainingMetrics, title: str | None, png: bytes, has_curves: bool = False) -> str:
    """The live panel: header, progress bar and line, curves and numbers side by side, optimizations.

    ``has_curves``: ``png`` shows logged values (the ``fastkit-has-curves`` class a browser test waits for).
    """
    color = {"finished": "#188038", "interrupted": "#e37400", "failed": "#d93025"}.get(m.status, "#1a73e8")
    bar = (f"<div style='display:flex;align-items:center;gap:10px;margin:4px 0'><div style='width:260px;height:12px;"
           f"border-radius:6px;background:{BORDER};overflow:hidden;flex:none'><div style='height:100%;"
           f"width:{100 * m.progress:.1f}%;background:{color}'></div></div>{progress_text(m)}</div>")
    curves = png_img(png, "fastkit-has-curves" if has_curves else "", int(PLOT_SIZE_IN[0] * 100)) if png else ""
    stats = table_html(without(stat_rows(m), "steps", "elapsed"))
    return (f"<div class='fastkit-dashboard' style='border:1px solid {BORDER};padding:8px 12px;max-width:900px'>"
            f"{header_html(m, title)}{bar}<div style='display:flex;flex-flow:row wrap;align-items:flex-start;gap:8px'>"
            f"<div style='min-width:320px'>{curves}</div><div style='margin:4px 0 0 8px'>{stats}</div></div>"
            f"{optimizations_html(m)}</div>")


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
        class Panel(w.VBox):
            def __repr__(self) -> str:  # the text a front-end without the widget manager shows
                return WIDGET_FALLBACK

        self.box = Panel(
            [self.header, w.HBox([self.bar, self.progress], layout=w.Layout(align_items="center")),
             w.HBox([self.plot, self.stats], layout=w.Layout(align_items="flex-start", flex_flow="row wrap")),
             self.opts],
            layout=w.Layout(border=f"1px solid {BORDER}", padding="8px 12px", max_width="900px", width="auto"))
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
        if plot_due or event in ("evaluate", "compile") or now - self._last_text >= self.text_every_s:
            self._refresh(m, plot=plot_due)
        if final:
            show_summary(m, self.title)

    def _refresh(self, m: TrainingMetrics, plot: bool) -> None:
        self._last_text = time.monotonic()
        self.header.value = header_html(m, self.title)
        self.bar.value = m.progress
        self.bar.bar_style = {"finished": "success", "interrupted": "warning", "failed": "danger"}.get(m.status, "info")
        self.progress.value = progress_text(m)
        self.stats.value = table_html(without(stat_rows(m), "steps", "elapsed"))  # those two are in the progress line
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
        self._warned: set[str] = set()

    def __call__(self, event: str, m: TrainingMetrics) -> None:
        if event == "begin":
            logger.info("fastkit: training %s on %s for %d steps (%s)%s", m.model_type or "model", m.device,
                        m.max_steps, run_kind(m), eval_cadence(m))
            return
        if event == "evaluate":
            logger.info("fastkit: step %d/%d: evaluating the eval set ...", m.step, m.max_steps)
            return
        if event == "compile":
            logger.info("fastkit: step %d/%d: torch.compile is compiling (not counted in steps/s) ...", m.step,
                        m.max_steps)
            return
        for line in alert_lines(m):  # each new warning once, as a warning, the moment it is seen
            if line not in self._warned:
                self._warned.add(line)
                logger.warning("fastkit: WARNING %s", line)
        now = time.monotonic()
        if event == "step" and m.loss_history and m.loss_history[-1][0] == m.step - 1:
            return  # the run logs every step: this step's log follows, and the line waits for its loss and lr
        if event == "end":
            logger.info(summary_text(m))
        elif now - self._last >= self.every_s:  # 'step' or 'log': whichever comes first after every_s
            self._last = now
            logger.info(progress_line(m))


def show_summary(m: TrainingMetrics, title: str | None = None) -> None:
    """Put the static summary (HTML table, then the PNG plot) in the current cell's output."""
    from IPython.display import HTML, Image, display

    display(HTML(summary_html(m, title)))
    display(Image(data=plot_png(m, size=SUMMARY_PLOT_SIZE_IN), format="png"))


def make_view(view: str = "auto", title: str | None = None):
    """'auto', 'html', 'widget', 'terminal' or 'none'.

    'auto' is ``$FASTKIT_DASHBOARD`` when set, else 'html' in a notebook and 'terminal' elsewhere.
    Why not the widget in a notebook: the kernel cannot see whether the front-end's widget manager
    will render a widget (Colab needs its custom manager enabled, JupyterLab needs a matching
    ``jupyterlab_widgets``, nbviewer and GitHub never do), and where it does not the user sees a
    placeholder string; a widget is also gone when the kernel dies. The display-handle HTML view
    renders everywhere and its last state stays in the saved output. Ask for ``view='widget'`` (or
    ``FASTKIT_DASHBOARD=widget``) where the ipywidgets panel is known to render.
    """
    if view not in VIEWS:
        raise ValueError(f"view must be one of {', '.join(map(repr, VIEWS))}, got {view!r}")
    if view == "auto":
        view = os.environ.get("FASTKIT_DASHBOARD") or ("html" if in_notebook() else "terminal")
        if view not in VIEWS[1:]:
            raise ValueError(f"FASTKIT_DASHBOARD must be one of {', '.join(map(repr, VIEWS[1:]))}, got {view!r}")
    if view in ("html", "widget"):  # the curves are drawn with matplotlib, the panel with ipywidgets
        from fastkit.extras import require

        for module in ("matplotlib", "ipywidgets")[: 1 + (view == "widget")]:
            require(module, f"The dashboard's {view!r} view", "Or fit(trainer, view='terminal').")
    if view == "html":
        return HtmlView(title)
    if view == "widget":
        return WidgetView(title)
    if view == "terminal":
        return TerminalView()
    return None  # 'none'


def dashboard_callback(view: str = "auto", title: str | None = None, **callback_kwargs: Any) -> MetricsCallback:
    """A :class:`MetricsCallback` with the dashboard attached, for ``Trainer(callbacks=[...])``."""
    callback = MetricsCallback(**callback_kwargs)
    drawer = make_view(view, title)
    if drawer is not None:
        callback.add_listener(drawer)
    return callback


__all__ = ["HtmlView", "TerminalView", "WidgetView", "dashboard_callback", "in_notebook", "make_view", "panel_html",
           "show_summary"]
