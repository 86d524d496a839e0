"""The training dashboard: collect (callbacks), draw (render), show (views).

In Jupyter, Colab and VS Code an ipywidgets panel shows progress and ETA, steps/s and tokens/s
(after warm-up), live loss and learning-rate curves, grad norm, memory and fastkit's active
optimizations; when training ends it leaves a static summary (HTML table and PNG plot) in the cell
output. Outside a notebook the same callback logs a compact progress line instead.

- :mod:`fastkit.dashboard.callbacks`: :class:`MetricsCallback` collects :class:`TrainingMetrics`.
- :mod:`fastkit.dashboard.render`: text, HTML and PNG from the metrics (keyed rows, no state).
- :mod:`fastkit.dashboard.views`: the widget panel, the terminal line, the static summary.

Training with it: ``fastkit.fit(trainer)`` (:func:`fastkit.training.fit`).
"""

from fastkit.dashboard.callbacks import MetricsCallback, TrainingMetrics, throughput
from fastkit.dashboard.render import (
    Row,
    Rows,
    SummaryTable,
    fmt_duration,
    fmt_gib,
    fmt_rate,
    memory_rows,
    memory_time_summary,
    plot_png,
    progress_line,
    stat_rows,
    summary_html,
    summary_text,
)
from fastkit.dashboard.views import (
    TerminalView,
    WidgetView,
    dashboard_callback,
    in_notebook,
    make_view,
    show_summary,
)

__all__ = [
    "MetricsCallback", "Row", "Rows", "SummaryTable", "TerminalView", "TrainingMetrics", "WidgetView",
    "dashboard_callback", "fmt_duration", "fmt_gib", "fmt_rate", "in_notebook", "make_view", "memory_rows",
    "memory_time_summary", "plot_png", "progress_line", "show_summary", "stat_rows", "summary_html", "summary_text",
    "throughput",
]
