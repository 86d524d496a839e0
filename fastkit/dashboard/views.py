"""Where the dashboard shows up: an ipywidgets panel in a notebook, a progress line in a terminal.

A view is a listener of :class:`~fastkit.dashboard.callbacks.MetricsCallback`: it gets
``view(event, metrics)`` and draws with :mod:`fastkit.dashboard.render`. Widgets are gone when a
notebook is reopened, so when training ends (or is interrupted) the widget view also leaves a
static summary in the cell output: an HTML table and a PNG plot.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fastkit.dashboard.callbacks import MetricsCallback, TrainingMetrics
from fastkit.dashboard.render import (
    BORDER,
    PLOT_SIZE_IN,
    header_html,
    optimizations_html,
    plot_png,
    progress_line,
    progress_text,
    stat_rows,
    summary_html,
    summary_text,
    table_html,
    without,
)

logger = logging.getLogger(__name__)


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


__all__ = ["TerminalView", "WidgetView", "dashboard_callback", "in_notebook", "make_view", "show_summary"]
