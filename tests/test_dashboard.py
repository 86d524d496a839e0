"""The dashboard's drawing: widget panel, static summary, terminal line, fit() on interrupt (no kernel needed)."""

from __future__ import annotations

import logging
import os
import tempfile
from types import SimpleNamespace

import pytest
from transformers import PrinterCallback, TrainerControl, TrainerState  # the log printer fit() sets aside

from fastkit import dashboard as dash
from fastkit.dashboard import MetricsCallback, Row, TrainingMetrics
from fastkit.dashboard.render import insert_after, stat_rows, without
from fastkit.device import GiB, MemorySnapshot
from fastkit.errors import FastkitError
from fastkit.training import fit
from tests.helpers import FakeClock

PNG = b"\x89PNG\r\n\x1a\n"


def _metrics(**kw) -> TrainingMetrics:
    m = TrainingMetrics(status="running", step=12, max_steps=60, elapsed_s=30.0, warmup_steps=2, steps_per_s=0.5,
                        tokens_per_s=2048.0, tokens_seen=24_576, eta_s=96.0, loss=1.2345, learning_rate=1.5e-4,
                        grad_norm=0.75, model_type="qwen3", device="NVIDIA T4 (sm75, 14.7 GiB)",
                        loss_history=[(i, 2.0 - i / 20) for i in range(1, 13)],
                        lr_history=[(i, 2e-4 - i * 1e-6) for i in range(1, 13)],
                        grad_norm_history=[(i, 1.0 / i) for i in range(1, 13)],
                        optimizations={"packing": "per-document attention, metadata once per batch"},
                        skipped={"moe": "not a mixture-of-experts model"},
                        syncs_per_step=3, syncs_by_op={"_local_scalar_dense": 3})
    for k, v in kw.items():
        setattr(m, k, v)
    return m


def test_formatting():
    assert dash.fmt_duration(3725) == "1:02:05" and dash.fmt_duration(65) == "1:05" and dash.fmt_duration(None) == "—"
    assert dash.fmt_rate(12345.6, "tokens/s") == "12,346 tokens/s"
    assert dash.fmt_rate(8.0, "steps/s") == "8.00 steps/s"
    assert dash.fmt_rate(0.01234, "steps/s") == "0.0123 steps/s"
    assert dash.fmt_rate(None, "steps/s") == "—"
    assert dash.fmt_gib(3 * GiB // 2) == "1.50 GiB"


def test_gpu_memory_rows_name_allocated_reserved_peak_total():
    mem = MemorySnapshot("cuda:0", allocated=2 * GiB, reserved=3 * GiB, peak=int(2.5 * GiB), total=16 * GiB,
                         free=13 * GiB, host_rss=GiB)
    rows = dash.memory_rows(_metrics(memory=mem, peak_memory=int(2.5 * GiB), peak_reserved=int(3.5 * GiB),
                                     host_total=12 * GiB, host_available=8 * GiB))
    assert list(rows) == ["gpu_memory", "gpu_peak", "process_ram", "host_ram"]
    assert rows["gpu_memory"] == Row("GPU allocated / reserved", "2.00 / 3.00 GiB")
    assert rows["gpu_peak"] == Row("GPU peak allocated / reserved / total", "2.50 / 3.50 / 16.00 GiB")
    assert rows["process_ram"] == Row("Process RAM", "1.00 GiB")
    assert rows["host_ram"] == Row("Host RAM used / total", "4.00 GiB / 12.00 GiB")


def test_cpu_memory_rows_show_process_and_host_ram():
    mem = MemorySnapshot("cpu", allocated=GiB, reserved=GiB, peak=GiB, total=24 * GiB, free=20 * GiB, host_rss=GiB)
    rows = dash.memory_rows(_metrics(memory=mem, peak_memory=2 * GiB, host_total=24 * GiB,
                                     host_available=20 * GiB))
    assert rows["process_ram"] == Row("Process RAM now / peak", "1.00 / 2.00 GiB")
    assert rows["host_ram"] == Row("Host RAM used / total", "4.00 GiB / 24.00 GiB")
    assert not any(k.startswith("gpu") or label.startswith("GPU") for k, (label, _) in rows.items())


def test_stat_rows_are_keyed_and_edited_by_key():
    mem = MemorySnapshot("cpu", allocated=GiB, reserved=GiB, peak=GiB, total=24 * GiB, free=20 * GiB, host_rss=GiB)
    rows = stat_rows(_metrics(memory=mem, host_total=24 * GiB, host_available=20 * GiB))
    assert list(rows)[:9] == ["steps", "elapsed", "epoch", "steps_per_s", "tokens_per_s", "tokens_seen", "loss",
                              "learning_rate", "grad_norm"]
    assert rows["steps_per_s"] == Row("Steps/s", "0.500 steps/s") and rows["syncs"].value == "3 (.item() ×3)"
    assert rows["process_ram"].label == "Process RAM now / peak"
    moved = insert_after(rows, "loss", "extra", Row("Extra", "x"))
    assert list(moved)[list(moved).index("loss") + 1] == "extra" and "extra" not in rows
    assert list(insert_after(rows, "absent", "extra", Row("Extra", "x")))[-1] == "extra"
    assert "steps" not in without(rows, "steps", "elapsed") and "loss" in without(rows, "steps")


def test_summary_html_table_status_and_optimizations():
    text = dash.summary_html(_metrics(status="interrupted", error="stopped by the user after step 12"))
    assert "fastkit-summary" in text and "<table" in text
    for needle in ("12 / 60", "0.500 steps/s", "2,048 tokens/s", "1.234",
                   "1.95 → 1.234", "1.50e-04", "0.75", "interrupted", "stopped by the user after step 12",
                   "packing", "not a mixture-of-experts model", "2 warm-up steps excluded", ".item() ×3"):
        assert needle in text, needle


def test_summary_html_escapes():
    text = dash.summary_html(_metrics(model_type="<script>", optimizations={"x<y": "a&b"}))
    assert "<script>" not in text and "&lt;script&gt;" in text and "a&amp;b" in text


def test_plot_png_with_and_without_data():
    assert dash.plot_png(_metrics()).startswith(PNG)
    assert dash.plot_png(TrainingMetrics()).startswith(PNG)  # before any log: placeholder text, still a PNG


def test_progress_line_is_one_compact_line():
    mem = MemorySnapshot("cuda:0", allocated=2 * GiB, reserved=3 * GiB, peak=2 * GiB, total=16 * GiB)
    line = dash.progress_line(_metrics(memory=mem))
    assert "\n" not in line
    for part in ("step 12/60 (20%)", "0.500 step/s", "2,048 tok/s", "loss 1.2345", "lr 1.50e-04",
                 "mem 2.0/16.0 GiB", "ETA 1:36"):
        assert part in line, part
    assert "warming up" in dash.progress_line(_metrics(steps_per_s=None, tokens_per_s=None, eta_s=None))


def test_memory_time_summary_text_and_html():
    mem = MemorySnapshot("cuda:0", allocated=2 * GiB, reserved=3 * GiB, peak=4 * GiB, total=16 * GiB)
    table = dash.memory_time_summary(_metrics(memory=mem, peak_memory=4 * GiB))
    rows = table.rows
    assert rows["peak_gpu"] == Row("Peak GPU memory", "4.00 GiB of 16.00 GiB (25%)")
    assert rows["time_per_step"] == Row("Time per step", "2,000 ms (after warm-up)")
    assert rows["projected"] == Row("1,000 steps would take", "33:20")
    assert "Memory and time" in repr(table) and "<table" in table._repr_html_()


def test_in_notebook_false_under_pytest():
    assert dash.in_notebook() is False
    assert isinstance(dash.make_view("auto"), dash.TerminalView)
    with pytest.raises(ValueError, match="view must be"):
        dash.make_view("fancy")


# -- the widget, driven by synthetic trainer events -------------------------------------------
@pytest.fixture
def shown(monkeypatch):
    """What the dashboard puts in the cell output (IPython.display.display captured)."""
    import IPython.display

    out: list = []
    monkeypatch.setattr(IPython.display, "display", lambda *objs, **kw: out.extend(objs))
    return out


class FakeTrainer:
    """Just enough of transformers.Trainer for fit(): callbacks, train() emitting events, a model, a state."""

    def __init__(self, steps: int, interrupt_at: int | None = None, clock: FakeClock | None = None):
        import torch

        self.model = torch.nn.Linear(2, 2)
        self.model.config = SimpleNamespace(model_type="fake", name_or_path="fake")  # what the run identity reads
        self.train_dataset = [{"input_ids": [1, 2, 3]}]
        self.args = SimpleNamespace(output_dir=tempfile.mkdtemp(prefix="fastkit-fake-run-"),
                                    logging_nan_inf_filter=True, world_size=1,  # the run identity's processes
                                    per_device_train_batch_size=1, gradient_accumulation_steps=1)
        self.state = TrainerState(max_steps=steps)
        self.callback_handler = SimpleNamespace(callbacks=[PrinterCallback()], on_save=lambda args, state, c: c)
        self.control = TrainerControl()
        self.seen_during_train: list[str] = []
        self.steps, self.interrupt_at, self.clock = steps, interrupt_at, clock or FakeClock()

    def add_callback(self, cb):
        self.callback_handler.callbacks.append(cb)

    def _save_checkpoint(self, model, trial):  # what fit writes on Ctrl-C (fastkit._hf.save_checkpoint)
        os.makedirs(os.path.join(self.args.output_dir, f"checkpoint-{self.state.global_step}"))

    def remove_callback(self, cb):
        self.callback_handler.callbacks.remove(cb)

    def train(self):
        args, control = SimpleNamespace(use_cpu=True), TrainerControl()
        self.seen_during_train = [type(c).__name__ for c in self.callback_handler.callbacks]
        cbs = [c for c in self.callback_handler.callbacks if isinstance(c, MetricsCallback)]
        for cb in cbs:
            cb.on_train_begin(args, self.state, control, model=self.model)
        for step in range(1, self.steps + 1):
            if step == self.interrupt_at:
                self.model.weight.grad = self.model.weight.detach().clone()  # a half-finished backward
                raise KeyboardInterrupt
            self.clock.now += 0.5
            self.state.global_step = step
            self.state.num_input_tokens_seen = 100 * step
            for cb in cbs:
                cb.on_step_end(args, self.state, control)
                cb.on_log(args, self.state, control, logs={"loss": 2.0 / step, "learning_rate": 1e-4,
                                                           "grad_norm": 1.0})
        for cb in cbs:
            cb.on_train_end(args, self.state, control)


def test_fit_widget_view_finished(shown):
    import ipywidgets as w
    from IPython.display import HTML, Image

    trainer = FakeTrainer(steps=6)
    m = fit(trainer, view="widget", clock=trainer.clock, measure_syncs=False)
    assert m.status == "finished" and m.step == 6
    assert m.steps_per_s == pytest.approx(2.0) and m.tokens_per_s == pytest.approx(200.0)
    box, summary, plot = shown
    assert isinstance(box, w.VBox) and "fastkit-dashboard" in box._dom_classes
    assert isinstance(summary, HTML) and "fastkit-summary" in summary.data and "finished" in summary.data
    assert isinstance(plot, Image) and plot.data.startswith(PNG)
    view_bar = box.children[1].children[0]
    assert view_bar.value == 1.0 and view_bar.bar_style == "success"
    assert "fastkit-has-curves" in box.children[2].children[0]._dom_classes
    assert "Steps/s" in box.children[2].children[1].value
    assert trainer.seen_during_train == ["MetricsCallback", "RunGuard"]  # the printer was set aside...
    assert [type(c).__name__ for c in trainer.callback_handler.callbacks] == ["PrinterCallback"]  # ...and is back


def test_fit_widget_view_interrupted(shown, caplog):
    trainer = FakeTrainer(steps=10, interrupt_at=5)
    logging.getLogger("fastkit").addHandler(caplog.handler)
    try:
        m = fit(trainer, view="widget", clock=trainer.clock, measure_syncs=False)   # does not raise
    finally:
        logging.getLogger("fastkit").removeHandler(caplog.handler)
    assert m.status == "interrupted" and m.step == 4 and "after step 4" in m.error
    box, summary, plot = shown
    assert "interrupted" in summary.data and "4 / 10" in summary.data and plot.data.startswith(PNG)
    assert box.children[1].children[0].bar_style == "warning"
    assert trainer.model.weight.grad is None           # the half-made gradient is gone
    assert "interrupted at step 4/10; checkpoint-4 written" in caplog.text
    assert "continue with: fit(trainer, resume=True)" in caplog.text


def test_widget_redraw_is_throttled(shown):
    """Text refreshes at most every text_every_s and the PNG at most every plot_every_s."""
    view = dash.WidgetView(plot_every_s=3600, text_every_s=3600)
    m = _metrics()
    view("begin", m)
    first_png = view.plot.value
    m.step, m.loss_history = 13, m.loss_history + [(13, 0.1)]
    view("log", m)
    assert view.plot.value == first_png and "<b>12</b>" in view.progress.value
    view("end", m)                                      # the end always redraws
    assert view.plot.value != first_png and "<b>13</b>" in view.progress.value


def test_plot_redraws_on_logs_even_when_steps_are_fast(shown):
    """Each step's text refresh must not starve the plot: a due plot redraws on the next log."""
    view = dash.WidgetView(plot_every_s=0.0, text_every_s=3600)
    m = _metrics()
    view("begin", m)
    first_png = view.plot.value
    m.step, m.loss_history = 13, m.loss_history + [(13, 0.1)]
    view("step", m)
    view("log", m)
    assert view.plot.value != first_png


# -- the HTML view: one output, updated in place through a display handle ----------------------
class FakeHandle:
    def __init__(self, out: list):
        self.out = out

    def update(self, obj, **kw):
        self.out.append(("update", obj, kw))


@pytest.fixture
def handles(monkeypatch):
    """display(..., display_id=True) and handle.update(...) calls, in order."""
    import IPython.display

    out: list = []

    def display(obj, **kw):
        out.append(("display", obj, kw))
        return FakeHandle(out)

    monkeypatch.setattr(IPython.display, "display", display)
    return out


def test_fit_html_view_replaces_one_output_and_ends_as_the_summary(handles):
    trainer = FakeTrainer(steps=6)
    m = fit(trainer, view="html", clock=trainer.clock)
    assert m.status == "finished"
    kind, first, kw = handles[0]
    assert kind == "display" and kw == {"raw": True, "display_id": True}
    assert "fastkit-dashboard" in first["text/html"] and first["text/plain"].startswith("fastkit: step 0/6")
    assert [k for k, _, _ in handles[1:]] == ["update"] * (len(handles) - 1)   # never a second output
    final = handles[-1][1]["text/html"]
    assert "fastkit-summary" in final and "finished" in final and "data:image/png;base64,iVBOR" in final
    assert "6 / 6" in final and "training finished at step 6/6" in handles[-1][1]["text/plain"]
    assert "VBox" not in repr(handles)


def test_html_view_redraws_in_place_as_the_run_goes(handles):
    """Every redraw writes the latest numbers into the one output, so a dead kernel leaves them on the page."""
    view = dash.HtmlView(every_s=0.0, plot_every_s=0.0, overhead=float("inf"))
    m = _metrics(step=3)
    view("begin", m)
    m.step, m.loss_history = 4, m.loss_history + [(4, 0.5)]
    view("log", m)
    latest = handles[-1][1]["text/html"]
    assert "step <b>4</b> / 60" in latest and "running" in latest and "fastkit-has-curves" in latest
    assert "Steps/s" in latest and "Eval loss" not in latest


def test_html_view_is_throttled(handles):
    view = dash.HtmlView(every_s=3600, plot_every_s=3600)
    m = _metrics()
    view("begin", m)
    for _ in range(5):
        view("step", m)
        view("log", m)
    assert len(handles) == 1                       # nothing due within every_s
    view("end", m)                                 # the end always redraws
    assert len(handles) == 2 and "fastkit-summary" in handles[-1][1]["text/html"]


def test_auto_view_is_html_in_a_kernel_and_env_overrides(monkeypatch):
    monkeypatch.setattr(dash.views, "in_notebook", lambda: True)
    monkeypatch.delenv("FASTKIT_DASHBOARD", raising=False)
    assert isinstance(dash.make_view("auto"), dash.HtmlView)
    monkeypatch.setenv("FASTKIT_DASHBOARD", "widget")
    assert isinstance(dash.make_view("auto"), dash.WidgetView)
    monkeypatch.setenv("FASTKIT_DASHBOARD", "fancy")
    with pytest.raises(ValueError, match="FASTKIT_DASHBOARD must be"):
        dash.make_view("auto")


def test_widget_text_fallback_is_never_the_raw_vbox_repr():
    view = dash.WidgetView()
    assert view.box._repr_mimebundle_()["text/plain"] == dash.views.WIDGET_FALLBACK


def test_header_shows_run_facts_and_rows_show_eval_loss_and_epoch():
    m = _metrics(examples=1234, effective_batch=8, trainable_params=1_500_000, total_params=150_000_000,
                 eval_loss=0.9, eval_history=[(10, 0.9)], epoch=1.5)
    header = dash.render.header_html(m)
    assert "1,234 examples · effective batch 8 · 1.5M of 150M parameters train (1%)" in header
    rows = stat_rows(m)
    assert rows["eval_loss"] == Row("Eval loss", "0.9") and rows["epoch"] == Row("Epoch", "1.50")
    assert "eval_loss" not in stat_rows(_metrics())
    assert dash.plot_png(m).startswith(PNG)


def test_html_view_stretches_its_interval_to_a_slow_plot(handles):
    """Drawing blocks training: a plot that took 1 s waits 1 s / overhead before the next redraw (at most 5 s)."""
    view = dash.HtmlView(every_s=0.0, plot_every_s=0.0, overhead=0.2)
    m = _metrics()
    view("begin", m)
    assert view._plot_s == 0.0  # the first plot (matplotlib's import) does not count
    view._plot_s = 1.0
    view("log", m)
    assert len(handles) == 1
    view._plot_s = 0.0
    view("log", m)
    assert len(handles) == 2 and "step <b>12</b>" in handles[-1][1]["text/html"]


def test_html_view_redraws_the_curves_on_a_step_event_too(handles):
    """Steps and logs come in pairs: a due redraw must not wait for a 'log' that the step's redraw throttles."""
    view = dash.HtmlView(every_s=0.0, plot_every_s=0.0, overhead=float("inf"))
    m = _metrics(loss_history=[], lr_history=[], grad_norm_history=[])
    view("begin", m)
    assert "fastkit-has-curves" not in handles[-1][1]["text/html"]
    m.loss_history = [(1, 2.0), (2, 1.5)]
    view("step", m)
    assert "fastkit-has-curves" in handles[-1][1]["text/html"]


def test_fit_resume_picks_the_newest_checkpoint_and_refuses_an_incomplete_one(tmp_path):
    # Resuming a complete, matching checkpoint is tested on real trainers in tests/test_resume.py; here: the
    # newest checkpoint is the one looked at, one without optimizer state is refused before training, and
    # resume=True with no checkpoint yet starts a new run.
    class Resumable(FakeTrainer):
        def train(self, **kw):
            self.train_kwargs = kw
            return super().train()

    for step in (3, 10):
        (tmp_path / f"checkpoint-{step}").mkdir()
    trainer = Resumable(steps=2)
    trainer.args.output_dir = str(tmp_path)
    with pytest.raises(FastkitError, match="checkpoint-10 .* has no optimizer state"):
        fit(trainer, view="none", clock=trainer.clock, resume=True)
    assert not hasattr(trainer, "train_kwargs")  # refused before any step
    fresh = Resumable(steps=2)
    fresh.args.output_dir = str(tmp_path / "missing")
    fit(fresh, view="none", clock=fresh.clock, resume=True)   # no checkpoint yet: starts fresh
    assert fresh.train_kwargs == {}
