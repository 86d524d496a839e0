"""The dashboard's warnings (non-finite loss, loss spike, reserved memory near the total), its 'new run' /
'resumed from checkpoint-N' line, rates after a short resumed run, and the named upstream-warning filter."""

from __future__ import annotations

import logging
import math
import warnings
from types import SimpleNamespace

import pytest
from transformers import TrainerControl, TrainerState

from fastkit.dashboard import MetricsCallback, callbacks
from fastkit.dashboard.render import plot_png, progress_line, smoothed, summary_html, summary_text
from fastkit.dashboard.views import TerminalView, panel_html
from fastkit.device import GiB, MemorySnapshot
from tests.helpers import FakeClock


def _run(losses, start_step=0, log_history=(), warmup_steps=2, finish=True, cb=None):
    """Drive a MetricsCallback like the Trainer: begin at ``start_step``, one step + log per loss."""
    clock = FakeClock(10.0)
    cb = cb or MetricsCallback(warmup_steps=warmup_steps, clock=clock)
    cb.clock = clock
    args, control = SimpleNamespace(use_cpu=True), TrainerControl()
    state = TrainerState(max_steps=start_step + len(losses), is_world_process_zero=True)
    state.global_step, state.log_history = start_step, list(log_history)
    cb.on_train_begin(args, state, control, model=None)
    for i, loss in enumerate(losses):
        clock.now += 1.0
        state.global_step = start_step + i + 1
        state.num_input_tokens_seen = 100 * state.global_step
        cb.on_step_end(args, state, control)
        cb.on_log(args, state, control, logs={"loss": loss, "learning_rate": 1e-4, "grad_norm": 0.5})
    if finish:
        cb.on_train_end(args, state, control)
    return cb.metrics


def _shows(m, title: str) -> None:
    """The alert is visible in every view: panel, summary, progress line, text summary."""
    assert "fastkit-alerts" in panel_html(m, None, b"") and title in panel_html(m, None, b"")
    assert title in summary_html(m) and f"WARNING {title}" in progress_line(m) and title in summary_text(m)


def test_steady_run_has_no_alerts():
    m = _run([2.0 - 0.05 * i for i in range(20)])
    assert m.alerts == {} and "fastkit-alerts" not in panel_html(m, None, b"") and "WARNING" not in progress_line(m)


def test_nonfinite_loss_alert():
    m = _run([2.0, 1.9, float("nan"), 1.8], finish=False)
    assert m.alerts["nonfinite_loss"] == "loss is nan at step 3"
    _shows(m, "Loss is not a number")
    assert "#b3261e" in panel_html(m, None, b"")  # red, not amber
    plot_png(m)  # a nan in the history still draws


def test_loss_spike_alert_only_on_a_real_spike():
    steady = [1.0 + 0.02 * (i % 3) for i in range(12)]
    assert "loss_spike" not in _run(steady + [1.5]).alerts  # 1.5x the median: noise, not a spike
    m = _run(steady + [4.0])
    assert "loss spiked to 4 at step 13" in m.alerts["loss_spike"]
    m = _run(steady + [4.0, 4.2, 4.1])  # a spike's tail still beats the median: the alert keeps its first step
    assert "loss spiked to 4 at step 13" in m.alerts["loss_spike"]
    _shows(m, "Loss spike")
    assert "loss_spike" not in _run([5.0, 1.0, 4.0]).alerts  # too few steps to judge


def test_loss_spike_alert_keeps_the_worst_spike_and_counts_them():
    """A later, smaller spike does not hide the big one (assets/dashboard_warning.png once named a 2.7x spike
    while the curve's 33x one went unnamed)."""
    steady = [1.0 + 0.02 * (i % 3) for i in range(12)]
    m = _run(steady + [8.0] + steady + [3.0] + steady + [2.5])  # spikes at steps 13, 26 and 39
    alert = m.alerts["loss_spike"]
    assert alert.startswith("loss spiked to 8 at step 13 (7.8× the median")
    assert "3 spikes in this run (also at step 26, 39)" in alert
    many = steady + [9.0] + sum(([1.0] * 11 + [2.6] for _ in range(7)), [])
    assert "8 spikes in this run (also at step …, " in _run(many).alerts["loss_spike"]


def test_reserved_memory_alert_above_90_percent(monkeypatch):
    def gpu(reserved):
        return lambda device: MemorySnapshot("cuda:0", allocated=GiB, reserved=reserved, peak=GiB,
                                             peak_reserved=reserved, total=15 * GiB, free=GiB)

    monkeypatch.setattr(callbacks, "memory_snapshot", gpu(13 * GiB))  # 87%
    assert "memory" not in _run([2.0, 1.9, 1.8]).alerts
    monkeypatch.setattr(callbacks, "memory_snapshot", gpu(int(14.2 * GiB)))  # 95%
    m = _run([2.0, 1.9, 1.8])
    assert "14.2 of 15.0 GiB (95%)" in m.alerts["memory"]
    _shows(m, "GPU memory nearly full")


def test_new_run_and_resumed_run_say_which():
    m = _run([2.0, 1.9, 1.8, 1.7])
    assert m.resumed_from is None and "new run" in panel_html(m, None, b"")
    history = [{"step": s, "loss": 3.0 - s / 10, "learning_rate": 1e-4, "grad_norm": 0.4} for s in (1, 2, 3, 4, 5, 6)]
    m = _run([2.0, 1.9], start_step=6, log_history=history)
    assert m.resumed_from == 6 and "resumed from checkpoint-6" in panel_html(m, None, b"")
    assert "resumed from checkpoint-6" in summary_text(m)
    assert [s for s, _ in m.loss_history] == [1, 2, 3, 4, 5, 6, 7, 8]  # the restored curve, then this run's


def test_rates_after_a_resumed_run_shorter_than_its_warmup():
    m = _run([2.0, 1.9], start_step=6, warmup_steps=2)
    assert m.steps_per_s == pytest.approx(1.0) and m.tokens_per_s == pytest.approx(100.0)
    assert m.rates_include_warmup and "warm-up included" in summary_html(m)
    assert "—" not in summary_html(m).split("Steps/s")[1][:80]
    longer = _run([2.0, 1.9, 1.8, 1.7, 1.6])
    assert not longer.rates_include_warmup and longer.steps_per_s == pytest.approx(1.0)


def test_smoothed_is_a_debiased_ema_that_skips_nonfinite():
    assert smoothed([2.0, 2.0, 2.0]) == pytest.approx([2.0, 2.0, 2.0])
    out = smoothed([1.0, float("nan"), 3.0], weight=0.5)
    assert out[0] == pytest.approx(1.0) and out[1] == pytest.approx(1.0)
    assert out[2] == pytest.approx((0.5 * 0.5 + 0.5 * 3.0) / (1 - 0.25))
    assert math.isnan(smoothed([float("nan")])[0])


def test_terminal_view_logs_each_alert_once_as_a_warning(caplog):
    cb = MetricsCallback(warmup_steps=0)
    cb.add_listener(TerminalView(every_s=0.0))
    with caplog.at_level(logging.INFO, logger="fastkit"):
        _run([2.0, float("nan"), float("nan"), 1.0], cb=cb)
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "Loss is not a number" in r.getMessage()]
    assert len(warned) == 2  # nan at step 2, nan at step 3: two different lines, each once
    assert "new run" in caplog.records[0].getMessage()


# -- the named upstream warnings -------------------------------------------------------------------
def test_known_upstream_messages_are_filtered_and_nothing_else():
    from fastkit import _quiet

    _quiet.install()
    assert len({k.text for k in _quiet.KNOWN}) == len(_quiet.KNOWN) and all(k.reason for k in _quiet.KNOWN)
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    for known in (k for k in _quiet.KNOWN if k.category is None):
        log = logging.getLogger(known.source)
        handler = Keep()
        log.addHandler(handler)
        try:
            log.warning(known.text + ": some detail")
            log.warning("Something else went wrong")
        finally:
            log.removeHandler(handler)
    assert records == ["Something else went wrong"] * sum(k.category is None for k in _quiet.KNOWN)
    # the one warnings.warn entry: hidden from its module, shown for another message and from elsewhere
    known = next(k for k in _quiet.KNOWN if k.category is not None)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _quiet.install()  # its warnings filter goes in front of "always"
        warnings.warn_explicit(known.text + " and will be removed", known.category, "modeling_utils.py", 1,
                               module=known.source)
        warnings.warn_explicit("another deprecation", known.category, "modeling_utils.py", 1, module=known.source)
        warnings.warn_explicit(known.text + " elsewhere", known.category, "mine.py", 1, module="mypackage")
    assert [str(w.message) for w in seen] == ["another deprecation", known.text + " elsewhere"]
