"""The dashboard's view names, as data (no torch, no transformers): ``TrainOptions.dashboard``'s check reads them."""

VIEWS = ("auto", "html", "widget", "terminal", "none")
"""``fit(view=...)`` / ``TrainOptions.dashboard``: auto (the widget in a notebook, the progress line elsewhere),
html, widget, terminal, none."""
