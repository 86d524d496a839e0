"""The training dashboard: collect (callbacks), draw (render), show (views).

In Jupyter, Colab and VS Code one HTML output, replaced in place through an IPython display handle
(no widget manager needed), shows the run (examples, effective batch, trainable parameters),
progress and ETA, epoch, steps/s and tokens/s (after warm-up), live loss / eval loss /
learning-rate curves, grad norm, peak allocated and reserved memory and fastkit's active
optimizations; it always holds the latest state, so it survives a dead kernel, and ends as a static
summary. ``view="widget"`` shows an ipywidgets panel instead. Outside a notebook the same callback
logs a compact progress line. The numbers also go into the trainer's logs (``fastkit/...`` keys).

- :mod:`fastkit.dashboard.callbacks`: :class:`MetricsCallback` collects :class:`TrainingMetrics`.
- :mod:`fastkit.dashboard.render`: text, HTML and PNG from the metrics (keyed rows, no state).
- :mod:`fastkit.dashboard.views`: the widget panel, the terminal line, the static summary.

Training with it: ``fastkit.fit(trainer)`` (:func:`fastkit.training.fit`).
"""

from fastkit._lazy import exports as _exports

_LAZY = {
    "MetricsCallback": "callbacks", "TrainingMetrics": "callbacks", "throughput": "callbacks",
    "Row": "render", "Rows": "render", "SummaryTable": "render", "fmt_duration": "render", "fmt_gib": "render",
    "fmt_rate": "render", "memory_rows": "render", "memory_time_summary": "render", "plot_png": "render",
    "progress_line": "render", "stat_rows": "render", "summary_html": "render", "summary_text": "render",
    "HtmlView": "views", "TerminalView": "views", "WidgetView": "views", "dashboard_callback": "views", "in_notebook":
    "views", "make_view": "views", "show_summary": "views",
}
"""Each public name -> its module, imported when first used (fastkit._lazy)."""
__getattr__, __dir__ = _exports(globals(), "fastkit.dashboard", _LAZY)

__all__ = [
    "HtmlView", "MetricsCallback", "Row", "Rows", "SummaryTable", "TerminalView", "TrainingMetrics", "WidgetView",
    "dashboard_callback", "fmt_duration", "fmt_gib", "fmt_rate", "in_notebook", "make_view", "memory_rows",
    "memory_time_summary", "plot_png", "progress_line", "show_summary", "stat_rows", "summary_html", "summary_text",
    "throughput",
]
