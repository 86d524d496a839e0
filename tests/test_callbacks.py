"""MetricsCallback: exact rates from known timings, memory fields, and real TRL runs on a CPU twin."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import TrainerCallback, TrainerControl, TrainerState

from fastkit.dashboard import MetricsCallback, throughput
from fastkit.training import fit
from tests.helpers import FakeClock


def _run_synthetic(cb: MetricsCallback, clock: FakeClock, durations: list[float], tokens_per_step: list[int],
                   max_steps: int, via: str = "state", world_zero: bool = True):
    """Drive the callback like Trainer does: begin, then per step begin/end(/log), step i lasting durations[i]."""
    args = SimpleNamespace(use_cpu=True)
    state = TrainerState(max_steps=max_steps, is_world_process_zero=world_zero)
    control = TrainerControl()
    cb.on_train_begin(args, state, control, model=None)
    seen = 0
    for i, (dt, n) in enumerate(zip(durations, tokens_per_step)):
        cb.on_step_begin(args, state, control)
        clock.now += dt
        seen += n
        state.global_step = i + 1
        if via == "state":
            state.num_input_tokens_seen = seen
        cb.on_step_end(args, state, control)
        cb.on_log(args, state, control, logs={"loss": 3.0 - 0.1 * i, "learning_rate": 1e-4, "grad_norm": 0.5,
                                              **({"num_tokens": seen} if via == "logs" else {})})
    return state


@pytest.mark.parametrize("via", ["state", "logs"])
def test_rates_exact_with_warmup_excluded(via):
    clock = FakeClock(100.0)
    cb = MetricsCallback(warmup_steps=2, clock=clock)
    # Steps 1-2 are slow warm-up (compile, allocator) and must not count; steps 3-6 take 0.5 s each
    # and train 1000, 1200, 800, 1000 tokens.
    _run_synthetic(cb, clock, [5.0, 3.0, 0.5, 0.5, 0.5, 0.5], [7, 9, 1000, 1200, 800, 1000], max_steps=10, via=via)
    m = cb.metrics
    assert m.step == 6 and m.status == "running"
    assert m.steps_per_s == pytest.approx(4 / 2.0)          # 4 steps after warm-up in 2.0 s
    assert m.tokens_per_s == pytest.approx(4000 / 2.0)      # their 4000 tokens in 2.0 s
    assert m.tokens_seen == 7 + 9 + 4000
    assert m.eta_s == pytest.approx((10 - 6) / 2.0)
    assert m.elapsed_s == pytest.approx(10.0)


def test_no_rate_during_warmup_then_first_window():
    clock = FakeClock(100.0)
    cb = MetricsCallback(warmup_steps=3, clock=clock)
    _run_synthetic(cb, clock, [2.0, 2.0, 2.0], [10, 10, 10], max_steps=8)
    assert cb.metrics.steps_per_s is None and cb.metrics.tokens_per_s is None and cb.metrics.eta_s is None
    clock = FakeClock(100.0)
    cb = MetricsCallback(warmup_steps=3, clock=clock)
    _run_synthetic(cb, clock, [2.0, 2.0, 2.0, 0.25], [10, 10, 10, 50], max_steps=8)
    assert cb.metrics.steps_per_s == pytest.approx(4.0)
    assert cb.metrics.tokens_per_s == pytest.approx(200.0)


def test_warmup_zero_counts_from_train_begin():
    clock = FakeClock(100.0)
    cb = MetricsCallback(warmup_steps=0, clock=clock)
    _run_synthetic(cb, clock, [1.0, 1.0], [10, 30], max_steps=2)
    assert cb.metrics.steps_per_s == pytest.approx(1.0)
    assert cb.metrics.tokens_per_s == pytest.approx(30 / 1.0)  # token counts exist from step 1 on


def test_throughput_function_direct():
    ends = {0: 0.0, 1: 4.0, 2: 5.0, 3: 5.5, 4: 6.0}
    toks = {1: 100, 2: 200, 3: 300, 4: 500}
    assert throughput(ends, toks, 2) == (pytest.approx(2 / 1.0), pytest.approx(300 / 1.0))
    assert throughput(ends, toks, 4) == (None, None)


def test_curves_and_ignored_logs():
    clock = FakeClock(100.0)
    cb = MetricsCallback(warmup_steps=1, clock=clock)
    state = _run_synthetic(cb, clock, [1.0, 1.0, 1.0], [1, 1, 1], max_steps=3)
    args, control = SimpleNamespace(use_cpu=True), TrainerControl()
    cb.on_log(args, state, control, logs={"eval_loss": 9.0})
    cb.on_log(args, state, control, logs={"train_runtime": 3.0, "train_loss": 2.9})
    m = cb.metrics
    assert [s for s, _ in m.loss_history] == [1, 2, 3]
    assert m.loss == pytest.approx(2.8) and m.learning_rate == pytest.approx(1e-4) and m.grad_norm == 0.5
    assert len(m.lr_history) == len(m.grad_norm_history) == 3


def test_log_every_step_asks_trainer_to_log():
    clock = FakeClock(100.0)
    cb = MetricsCallback(clock=clock, log_every_step=True)
    args, state, control = SimpleNamespace(use_cpu=True), TrainerState(max_steps=5), TrainerControl()
    cb.on_train_begin(args, state, control)
    state.global_step = 1
    assert cb.on_step_end(args, state, control).should_log is True


def test_memory_fields_present_on_cpu():
    clock = FakeClock(100.0)
    cb = MetricsCallback(clock=clock)
    _run_synthetic(cb, clock, [1.0], [1], max_steps=1)
    mem = cb.metrics.memory
    assert mem is not None and mem.device == "cpu"
    assert mem.host_rss > 0 and mem.total > 0 and mem.peak > 0
    assert cb.metrics.host_total > 0 and 0 < cb.metrics.host_available <= cb.metrics.host_total
    assert cb.metrics.peak_memory >= mem.host_rss > 0


def test_only_main_process_reports():
    clock = FakeClock(100.0)
    cb = MetricsCallback(clock=clock)
    events = []
    cb.add_listener(lambda e, m: events.append(e))
    state = _run_synthetic(cb, clock, [1.0, 1.0, 1.0], [1, 1, 1], max_steps=3, world_zero=False)
    assert cb.metrics.status == "running"
    cb.on_train_end(SimpleNamespace(use_cpu=True), state, TrainerControl())
    assert events == [] and cb.metrics.memory is None and cb.metrics.loss_history == []
    # the run's status and step are known on every rank: fit returns the same result there (issue 43)
    assert cb.metrics.status == "finished" and cb.metrics.step == 3 and cb.metrics.max_steps == 3


def test_listener_errors_never_stop_training(fastkit_log):
    clock = FakeClock(100.0)
    cb = MetricsCallback(clock=clock)
    cb.add_listener(lambda e, m: 1 / 0)
    _run_synthetic(cb, clock, [1.0], [1], max_steps=1)
    assert cb.metrics.step == 1 and "listener failed" in fastkit_log.text


# -- real training: TRL SFTTrainer on a CPU twin -----------------------------------------------
@pytest.fixture
def one_thread():
    """One intra-op thread: tiny matmuls on a shared 2-core box are faster and steadier that way."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _sft_trainer(tmp_path, callbacks, max_steps=4):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from fastkit import FastModel
    from fastkit.families.twins import twin, twin_tokenizer

    tok = twin_tokenizer()
    model = twin("llama", num_hidden_layers=1)
    FastModel.patch(model, max_seq_length=128, patches=None)  # a LoadReport, no patches: plain transformers
    rows = [{"messages": [{"role": "user", "content": f"What is {a} plus {a}?"},
                          {"role": "assistant", "content": str(2 * a)}]} for a in range(40)]
    args = SFTConfig(output_dir=str(tmp_path), max_steps=max_steps, per_device_train_batch_size=2, use_cpu=True,
                     bf16=False, report_to=[], logging_steps=100, save_strategy="no", max_length=128,
                     learning_rate=1e-3, disable_tqdm=True, gradient_checkpointing=False, dataloader_num_workers=0)
    return SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok,
                      callbacks=callbacks), model, tok


def test_sft_trainer_cpu_twin(tmp_path, one_thread):
    cb = MetricsCallback(warmup_steps=1, measure_syncs=True)
    events = []
    cb.add_listener(lambda e, m: events.append(e))
    trainer, _, _ = _sft_trainer(tmp_path, [cb], max_steps=4)
    trainer.train()
    m = cb.metrics
    assert m.status == "finished" and m.step == 4 and m.max_steps == 4
    assert events[0] == "begin" and events[-1] == "end" and events.count("step") == 4
    # logging_steps=100, yet the curves are live: the callback asks for a log every step.
    assert [s for s, _ in m.loss_history] == [1, 2, 3, 4]
    assert len(m.lr_history) == 4 and all(lr > 0 for _, lr in m.lr_history)
    assert m.grad_norm is not None and m.grad_norm > 0
    # tokens: TRL's own count of real tokens, which the trainer logged on every step
    logged = {e["step"]: e["num_tokens"] for e in trainer.state.log_history if "num_tokens" in e}
    assert m.tokens_seen == logged[4]
    assert m.steps_per_s is not None and m.steps_per_s > 0 and m.tokens_per_s is not None and m.tokens_per_s > 0
    expect_ratio = (logged[4] - logged[1]) / (4 - 1)   # tokens per step after warm-up
    assert m.tokens_per_s / m.steps_per_s == pytest.approx(expect_ratio)
    assert m.model_type == "llama" and m.memory is not None and m.memory.host_rss > 0
    # the last warm-up step was counted: TRL reads its metrics back with .item(), so syncs > 0
    assert m.syncs_per_step is not None and m.syncs_per_step > 0 and "_local_scalar_dense" in m.syncs_by_op


class _InterruptAt(TrainerCallback):
    """Simulates Ctrl-C / Jupyter's stop button at the start of a given step."""

    def __init__(self, step: int):
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            raise KeyboardInterrupt


def test_summary_on_normal_end(tmp_path, one_thread, fastkit_log):
    caplog = fastkit_log
    trainer, _, _ = _sft_trainer(tmp_path, [], max_steps=3)
    m = fit(trainer, view="terminal", warmup_steps=1)
    assert m.status == "finished" and m.step == 3
    assert "training finished at step 3/3" in caplog.text
    for label in ("Steps/s", "Tokens/s", "Loss", "Learning rate", "Grad norm", "Process RAM", "Host RAM"):
        assert label in caplog.text
    # the dashboard callback is removed afterwards, the trainer's own progress printer is back
    names = [type(c).__name__ for c in trainer.callback_handler.callbacks]
    assert "MetricsCallback" not in names and "PrinterCallback" in names


def test_summary_on_interrupt_keeps_model_usable(tmp_path, one_thread, fastkit_log):
    caplog = fastkit_log
    trainer, model, tok = _sft_trainer(tmp_path, [_InterruptAt(3)], max_steps=6)
    m = fit(trainer, view="terminal", warmup_steps=1)   # no exception escapes
    assert m.status == "interrupted" and m.step == 2
    assert "training interrupted at step 2/6" in caplog.text and "Steps/s" in caplog.text
    assert all(p.grad is None for p in model.parameters())
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    model.eval()
    out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 3)


def test_other_errors_show_summary_then_raise(tmp_path, one_thread, fastkit_log):
    class Boom(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            raise RuntimeError("disk full")

    trainer, _, _ = _sft_trainer(tmp_path, [Boom()], max_steps=3)
    with pytest.raises(RuntimeError, match="disk full"):
        fit(trainer, view="terminal")
    assert "training failed at step 1/3 (RuntimeError: disk full)" in fastkit_log.text


# -- make_trainer: eval set, trackers, plain train() -------------------------------------------
class _Tracker(TrainerCallback):
    """Stands in for a reporting integration (W&B, trackio, TensorBoard): records the logs it is given."""

    def __init__(self):
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def test_make_trainer_eval_set_tracker_logs_and_progress_on_plain_train(tmp_path, tokenizer, one_thread,
                                                                           fastkit_log):
    from fastkit import FastModel
    from fastkit.quickstart import quickstart_dataset
    from fastkit.training import make_trainer

    model, _ = FastModel.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct", max_seq_length=256, twin=True)
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8)
    train, _ = quickstart_dataset()
    trainer = make_trainer(model, tokenizer, train, eval_dataset=train.select(range(8)), eval_steps=2, max_steps=4,
                           max_seq_length=256, batch_size=2, output_dir=str(tmp_path), dashboard="terminal")
    dash = trainer.callback_handler.callbacks[0]
    assert isinstance(dash, MetricsCallback)            # first: the trackers after it see its keys
    tracker = _Tracker()
    trainer.callback_handler.callbacks.insert(1, tracker)  # where the reporting integrations sit
    trainer.train()                                      # plain train(): the attached dashboard reports
    m = dash.metrics
    assert m.status == "finished" and [s for s, _ in m.eval_history] == [2, 4] and m.eval_loss > 0
    assert m.examples == len(train) and m.effective_batch == 2 and 0 < m.trainable_params < m.total_params
    assert "training finished at step 4/4" in fastkit_log.text and "effective batch 2" in fastkit_log.text
    assert "Eval loss" in fastkit_log.text and "Epoch" in fastkit_log.text
    step_logs = [entry for entry in tracker.logs if "loss" in entry]
    assert len(step_logs) == 4 and all("fastkit/host_ram_used_gib" in entry for entry in step_logs)
    assert "fastkit/tokens_per_s" in step_logs[-1] and "fastkit/steps_per_s" in step_logs[-1]
    assert any("fastkit/tokens_per_s" in entry for entry in trainer.state.log_history)
    assert any("eval_loss" in entry for entry in tracker.logs)
    assert m.syncs_per_step is None and "fastkit/syncs_per_step" not in step_logs[-1]  # debug switch: off


def test_host_memory_without_os_sysconf(monkeypatch):
    """Windows has no os.sysconf (nor /proc): host RAM and process RSS come from psutil."""
    import os

    from fastkit.device import host_ram, memory_snapshot, process_rss

    monkeypatch.delattr(os, "sysconf", raising=False)
    available, total = host_ram()
    assert 0 < available <= total
    assert process_rss() > 0
    mem = memory_snapshot(torch.device("cpu"))
    assert mem.host_rss > 0 and mem.total == total and mem.peak_reserved > 0
