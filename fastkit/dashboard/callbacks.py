"""Training metrics for the dashboard: a ``TrainerCallback`` that collects, never draws.

:class:`MetricsCallback` works with any transformers ``Trainer`` (TRL's ``SFTTrainer`` included)
and keeps one :class:`TrainingMetrics` up to date: progress and ETA, steps/s and tokens/s with the
warm-up steps excluded, loss / learning rate / grad norm curves, device memory read through torch
(``torch.cuda.mem_get_info``, not NVML, which fails on GB10), host RAM, and which fastkit
optimizations are active on the model. Drawing is someone else's job: a listener
(``callback.add_listener(fn)``) gets ``fn(event, metrics)`` for ``"begin"``, ``"step"``,
``"log"``, ``"evaluate"`` (an evaluation began: it runs until the next step), ``"compile"`` (``torch.compile`` began
compiling) and ``"end"``. The views in
:mod:`fastkit.dashboard.views` are such listeners.

Only the main process reports: on other ranks the callback keeps the run's status and step (so
``fit`` returns the same status on every rank) and calls no listener, so a ``torchrun`` /
``accelerate launch`` job prints one dashboard.

Throughput, exactly: with ``warmup_steps = w``, the window starts at the end of optimizer step
``w`` and ends at the latest step end ``n``; ``steps/s = (n - w) / (t_n - t_w)``. Tokens come from
the trainer's own count (``state.num_input_tokens_seen`` when the trainer tracks it, else TRL's
logged ``num_tokens``, which counts real, non-padding tokens); ``tokens/s`` is the tokens added
between the first count seen at or after step ``w`` and the latest one, over the time between
those two step ends. Time spent evaluating (from the eval loop's first batch to ``on_evaluate``) and compiling
(dynamo's compile start to end) is left out of that time: the step ends are read on a clock that stops while the
eval set runs or torch.compile compiles, so steps/s and tokens/s are
training's alone (``TrainingMetrics.eval_s`` holds the time left out). Nothing here reads a device tensor, so the
callback adds no host-device sync.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import TrainerCallback

from fastkit.device import MemorySnapshot, host_ram, memory_snapshot

logger = logging.getLogger(__name__)

Listener = Callable[[str, "TrainingMetrics"], None]

RL_KEYS = ("reward", "reward_std", "kl", "completions/mean_length", "completions/clipped_ratio",
           "clip_ratio/region_mean", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")
"""What DPO / GRPO users watch, as TRL 1.16's DPOTrainer / GRPOTrainer log it (GRPO's reward per function,
``rewards/<name>/mean`` and ``/std``, too: :func:`is_rl_key`)."""


def is_rl_key(key: str) -> bool:
    """True for a logged key the dashboard shows as a preference / RL metric."""
    return key in RL_KEYS or key.startswith("rewards/") and key.endswith(("/mean", "/std"))


@dataclass
class TrainingMetrics:
    """Everything the dashboard shows, as plain numbers (seconds, bytes, tokens)."""

    status: str = "idle"
    """'idle', 'running', 'finished', 'interrupted' or 'failed'."""
    step: int = 0
    """Optimizer steps done (``state.global_step``)."""
    max_steps: int = 0
    """Optimizer steps planned (``state.max_steps``)."""
    epoch: float = 0.0
    """Fractional epoch reached."""
    elapsed_s: float = 0.0
    """Seconds since training began (warm-up included)."""
    warmup_steps: int = 0
    """Steps left out of steps/s and tokens/s (compilation, allocator and cache warm-up)."""
    steps_per_s: float | None = None
    """Optimizer steps per second after warm-up; None until a step after warm-up ended."""
    tokens_per_s: float | None = None
    """Training tokens per second after warm-up; None while unknown."""
    tokens_seen: int | None = None
    """Tokens trained on so far, as the trainer counts them (None if it does not)."""
    eta_s: float | None = None
    """Seconds to go at the post-warm-up rate."""
    loss: float | None = None
    """Latest logged training loss."""
    learning_rate: float | None = None
    """Latest logged learning rate."""
    grad_norm: float | None = None
    """Latest logged gradient norm (before clipping)."""
    loss_history: list[tuple[int, float]] = field(default_factory=list)
    """(step, loss) for every logged loss."""
    lr_history: list[tuple[int, float]] = field(default_factory=list)
    """(step, learning rate) for every logged learning rate."""
    grad_norm_history: list[tuple[int, float]] = field(default_factory=list)
    """(step, grad norm) for every logged gradient norm."""
    memory: MemorySnapshot | None = None
    """Latest memory reading (device via torch, host via /proc)."""
    peak_memory: int = 0
    """Peak device memory allocated during training (bytes); peak process RSS on CPU."""
    peak_reserved: int = 0
    """Peak device memory reserved by torch's caching allocator during training (bytes): what predicts an
    out-of-memory error (allocated plus the allocator's cache and fragmentation). Peak RSS on CPU."""
    eval_loss: float | None = None
    """Latest evaluation loss (``eval_loss`` in the trainer's logs), when there is an eval set."""
    eval_history: list[tuple[int, float]] = field(default_factory=list)
    """(step, eval loss) for every evaluation."""
    eval_every: int | None = None
    """Steps between evaluations (the trainer's ``eval_steps``; one more after the last step), None without any."""
    evaluating: bool = False
    """True while the eval set runs (the views say "evaluating")."""
    eval_s: float = 0.0
    """Seconds spent evaluating so far: in ``elapsed_s``, left out of steps/s and tokens/s."""
    compiling: bool = False
    """True while ``torch.compile`` compiles (a first step, a new shape; the views say "compiling")."""
    compile_s: float = 0.0
    """Seconds spent compiling so far (dynamo's compile start / end, lazy backward compiles included): in
    ``elapsed_s``, left out of steps/s and tokens/s."""
    compiles: int = 0
    """Compilations this run has made (a graph each; recompiles included)."""
    evaluations: int = 0
    """Evaluations this run has made (their mean time estimates the ones left in ``eta_s``)."""
    examples: int | None = None
    """Training examples (rows before packing when fastkit built the trainer; else the dataloader's rows)."""
    effective_batch: int | None = None
    """Sequences per optimizer step: per-device batch × gradient accumulation × processes."""
    trainable_params: int | None = None
    """Parameters that train (LoRA adapters), counted at train begin."""
    total_params: int | None = None
    """All parameters of the model, counted at train begin."""
    host_available: int = 0
    """Host RAM available now (bytes)."""
    host_total: int = 0
    """Host RAM in total (bytes)."""
    model_type: str | None = None
    """``config.model_type`` of the model being trained."""
    device: str | None = None
    """The device in words (from fastkit's LoadReport) or its torch name."""
    optimizations: dict[str, str] = field(default_factory=dict)
    """Active fastkit optimization -> how it is applied (``fastkit.report(model).active``)."""
    skipped: dict[str, str] = field(default_factory=dict)
    """fastkit optimization -> why it does not apply to this model."""
    syncs_per_step: int | None = None
    """Host-device syncs in one whole training step, measured with SyncCounter (opt-in)."""
    syncs_by_op: dict[str, int] = field(default_factory=dict)
    """Which ops caused those syncs."""
    error: str | None = None
    """Why training stopped, when it failed or was interrupted."""
    resumed_from: int | None = None
    """The optimizer step this run resumed from (``checkpoint-<N>``); None for a new run."""
    comparison: Any = None
    """``fit(compare=True)``'s before/after report (:class:`fastkit.evaluation.EvalReport`); None when not asked."""
    run_note: str | None = None
    """A continued run's own words (``fit(..., extend=True)``): "continued from checkpoint-N, schedule extended
    to M steps"; None otherwise."""
    rates_include_warmup: bool = False
    """True when the run was too short to leave the warm-up out, so steps/s and tokens/s include it."""
    rl: dict[str, float] = field(default_factory=dict)
    """Latest preference / RL metrics TRL logs (:data:`RL_KEYS`; ``rewards/<function>/mean|std`` for GRPO), by
    their TRL names."""
    rl_history: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    """(step, value) for every logged value of each :attr:`rl` metric."""
    alerts: dict[str, str] = field(default_factory=dict)
    """Warnings for the reader, by kind (``nonfinite_loss``, ``loss_spike``, ``memory``): the latest of each,
    except ``loss_spike``, which names the worst spike of the run and counts the others."""

    @property
    def progress(self) -> float:
        """Fraction of planned steps done, 0..1."""
        return min(1.0, self.step / self.max_steps) if self.max_steps else 0.0

    @property
    def on_gpu(self) -> bool:
        return self.memory is not None and self.memory.device != "cpu"


@dataclass
class _Window:
    """Step-end timestamps and token counts, the raw data behind steps/s and tokens/s."""

    step_end: dict[int, float] = field(default_factory=dict)
    """global_step -> clock() at its on_step_end."""
    tokens: dict[int, int] = field(default_factory=dict)
    """global_step -> cumulative tokens seen at that step end."""


class MetricsCallback(TrainerCallback):
    """Collects :class:`TrainingMetrics` during ``trainer.train()``; listeners draw them.

    Args:
        warmup_steps: optimizer steps left out of steps/s and tokens/s.
        clock: seconds as a float; inject one in tests for exact rates.
        log_every_step: ask the trainer to log loss / LR / grad norm after every step, so the curves
            are live (the trainer reads the loss back once per logged step).
        measure_syncs: count host-device syncs over the last warm-up step with
            :class:`fastkit.syncs.SyncCounter` (that step is outside the timing window anyway). A debug
            switch, off by default.
        examples: training examples for the run header (``make_trainer`` passes the rows before packing);
            None: the train dataloader's dataset length.

    It also writes its numbers into the trainer's ``logs`` (``fastkit/tokens_per_s``,
    ``fastkit/steps_per_s``, ``fastkit/peak_reserved_gib``, ...), so the reporting integrations
    (W&B, trackio, TensorBoard) get them: put it before them in the callback list
    (``make_trainer`` and ``fit`` do).
    """

    def __init__(self, warmup_steps: int = 2, clock: Callable[[], float] = time.perf_counter,
                 log_every_step: bool = True, measure_syncs: bool = False, examples: int | None = None):
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        self.warmup_steps = warmup_steps
        self.clock = clock
        self.log_every_step = log_every_step
        self.measure_syncs = measure_syncs
        self.examples = examples
        self.run_note: str | None = None  # fit sets it for a continued run; copied onto the metrics at train begin
        self.metrics = TrainingMetrics(warmup_steps=warmup_steps)
        self.is_main = True
        self._listeners: list[Listener] = []
        self._window = _Window()
        self._start = 0.0
        self._first_step = 0
        self._device: torch.device | None = None
        self._sync_counter = None
        self._spike_step = -10**9
        self._spikes: list[Spike] = []
        self._eval_start = 0.0
        self._compile_start = 0.0

    # -- listeners -------------------------------------------------------------------------
    def add_listener(self, fn: Listener) -> None:
        """Call ``fn(event, metrics)`` on 'begin', 'step', 'log' and 'end' (main process only)."""
        self._listeners.append(fn)

    def _emit(self, event: str) -> None:
        if not self.is_main:
            return
        for fn in self._listeners:
            try:
                fn(event, self.metrics)
            except Exception:  # a drawing bug must never stop training
                logger.exception("fastkit: dashboard listener failed on %r", event)

    # -- trainer events --------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.is_main = bool(state.is_world_process_zero)
        if not self.is_main:  # the run's status and step only: fit's result is the same on every rank
            self.metrics = TrainingMetrics(status="running", max_steps=state.max_steps, step=state.global_step,
                                           warmup_steps=self.warmup_steps)
            return
        self._start = self.clock()
        self._first_step = state.global_step
        self._spike_step = -10**9
        self._spikes = []
        self._window = _Window(step_end={state.global_step: self._start})
        self._device = _training_device(args, model)
        if self._device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self._device)
        m = self.metrics = TrainingMetrics(status="running", max_steps=state.max_steps,
                                           warmup_steps=self.warmup_steps, step=state.global_step,
                                           resumed_from=state.global_step or None,  # restored before train begin
                                           run_note=self.run_note)
        m.loss_history[:] = _restored(state.log_history, "loss")  # a resumed run: the curve from step 1
        m.lr_history[:] = _restored(state.log_history, "learning_rate")
        m.grad_norm_history[:] = _restored(state.log_history, "grad_norm")
        m.eval_history[:] = _restored(state.log_history, "eval_loss")
        m.eval_every = _eval_every(args, state)
        _describe_model(m, model, self._device)
        _describe_run(m, args, model, kwargs.get("train_dataloader"), self.examples)
        self._read_memory()
        self._watch_compiles(True)
        self._emit("begin")

    def on_step_begin(self, args, state, control, **kwargs):
        if self.is_main and self.measure_syncs and state.global_step + 1 == self._first_step + self.warmup_steps:
            from fastkit.syncs import SyncCounter

            self._sync_counter = SyncCounter().__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if self.log_every_step:  # on every rank: the trainer's log gathers the loss across ranks
            control.should_log = True
        if not self.is_main:
            self.metrics.step = state.global_step
            return control
        now = self.clock()
        self._finish_sync_count()
        step = state.global_step
        m = self.metrics
        self._window.step_end[step] = now - m.eval_s - m.compile_s  # training's clock: stopped while evaluating or
        # compiling
        if state.num_input_tokens_seen:
            self._window.tokens[step] = int(state.num_input_tokens_seen)
        m.step, m.epoch, m.elapsed_s = step, float(state.epoch or 0.0), now - self._start
        self._update_rates()
        self._read_memory()
        self._emit("step")
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not self.is_main or not logs or "train_runtime" in logs:
            return
        m, step = self.metrics, state.global_step
        if isinstance(logs.get("eval_loss"), (int, float)):
            self._end_evaluation()  # the evaluation's result: it is over (on_evaluate follows)
            m.eval_loss = float(logs["eval_loss"])
            if not m.eval_history or m.eval_history[-1][0] != step:
                m.eval_history.append((step, m.eval_loss))
            if not math.isfinite(m.eval_loss):
                m.alerts["nonfinite_loss"] = f"eval loss is {m.eval_loss} at step {step}"
            self._emit("log")
            return
        if any(k.startswith("eval_") for k in logs):
            return
        for key, hist, attr in (("loss", m.loss_history, "loss"), ("learning_rate", m.lr_history, "learning_rate"),
                                ("grad_norm", m.grad_norm_history, "grad_norm")):
            value = logs.get(key)
            if isinstance(value, (int, float)):
                setattr(m, attr, float(value))
                if not hist or hist[-1][0] != step:
                    hist.append((step, float(value)))
        self._check_loss(m, logs, step)
        _collect_rl(m, logs, step)
        if "num_tokens" in logs and step not in self._window.tokens:
            self._window.tokens[step] = int(logs["num_tokens"])
            self._update_rates()
        extra = tracker_metrics(m)
        logs.update(extra)  # the same dict the reporting callbacks after this one get
        if state.log_history and state.log_history[-1].get("step") == step and "loss" in state.log_history[-1]:
            state.log_history[-1].update(extra)  # the trainer kept a copy: trainer_state.json gets them too
        self._emit("log")

    def on_prediction_step(self, args, state, control, **kwargs):
        """The eval loop's first batch: an evaluation began (its time is kept out of the rates)."""
        if self.is_main and not self.metrics.evaluating and self.metrics.status == "running":
            self._eval_start = self.clock()
            self.metrics.evaluating = True
            self._emit("evaluate")

    def on_evaluate(self, args, state, control, **kwargs):
        self._end_evaluation()

    def on_train_end(self, args, state, control, **kwargs):
        self.finish("finished")

    def _end_evaluation(self) -> None:
        m = self.metrics
        if self.is_main and m.evaluating:
            m.eval_s += self.clock() - self._eval_start
            m.evaluating = False
            m.evaluations += 1

    # -- torch.compile ----------------------------------------------------------------------
    def _watch_compiles(self, on: bool) -> None:
        """Hear dynamo's compile start / end (its callback handler) while the run trains, so compile time is
        shown ("compiling") and kept out of the rates. Nothing is compiled or read here."""
        from torch._dynamo.callback import callback_handler

        listening = self._compile_started in callback_handler.start_callbacks  # the pair is added and removed together
        if on and not listening:
            callback_handler.register_start_callback(self._compile_started)
            callback_handler.register_end_callback(self._compile_ended)
        elif not on and listening:
            callback_handler.remove_start_callback(self._compile_started)
            callback_handler.remove_end_callback(self._compile_ended)

    def _compile_started(self, _args=None) -> None:
        m = self.metrics
        if self.is_main and m.status == "running" and not m.compiling:
            self._compile_start = self.clock()
            m.compiling = True
            self._emit("compile")

    def _compile_ended(self, _args=None) -> None:
        m = self.metrics
        if self.is_main and m.compiling:
            m.compile_s += self.clock() - self._compile_start
            m.compiling = False
            m.compiles += 1

    # -- ends that the trainer does not report ---------------------------------------------
    def finish(self, status: str, error: str | None = None) -> TrainingMetrics:
        """Close the run as 'finished', 'interrupted' or 'failed' and tell the listeners (once)."""
        self._finish_sync_count()
        self._end_evaluation()  # an evaluation interrupted or failed
        self._compile_ended()  # a compile interrupted or failed
        self._watch_compiles(False)
        m = self.metrics
        if m.status != "running":
            return m
        m.status, m.error = status, error
        if not self.is_main:  # the status only (nothing else was collected here)
            return m
        if self._window.step_end:
            m.elapsed_s = max(m.elapsed_s, self.clock() - self._start)
        if m.steps_per_s is None:  # a run no longer than its warm-up (a short resumed run): rates with it
            w = self._window
            m.steps_per_s, m.tokens_per_s = throughput(w.step_end, w.tokens, self._first_step)
            m.rates_include_warmup = m.steps_per_s is not None
        self._read_memory()
        self._emit("end")
        return m

    # -- computations ----------------------------------------------------------------------
    def _check_loss(self, m: TrainingMetrics, logs: dict, step: int) -> None:
        """Alerts on a non-finite training loss or grad norm, and on a loss spike."""
        for key in ("loss", "grad_norm"):
            value = logs.get(key)
            if isinstance(value, (int, float)) and not math.isfinite(value):
                m.alerts["nonfinite_loss"] = f"{key.replace('_', ' ')} is {value} at step {step}"
        spike = loss_spike(m.loss_history)
        if spike is not None and step - self._spike_step > SPIKE_WINDOW:  # the first step of a spike, not its tail
            self._spikes.append(spike)
            self._spike_step = step
            m.alerts["loss_spike"] = spikes_alert(self._spikes)

    def _update_rates(self) -> None:
        m, w = self.metrics, self._window
        steps_per_s, tokens_per_s = throughput(w.step_end, w.tokens, self._first_step + self.warmup_steps)
        m.steps_per_s, m.tokens_per_s = steps_per_s, tokens_per_s
        m.tokens_seen = w.tokens[max(w.tokens)] if w.tokens else None
        m.eta_s = (m.max_steps - m.step) / steps_per_s + evals_left(m) * m.eval_s / max(1, m.evaluations) \
            if steps_per_s and m.max_steps else None

    def _read_memory(self) -> None:
        m = self.metrics
        device = self._device or torch.device("cpu")
        m.memory = memory_snapshot(device)
        m.peak_memory = max(m.peak_memory, m.memory.peak)
        m.peak_reserved = max(m.peak_reserved, m.memory.peak_reserved)
        m.host_available, m.host_total = host_ram()
        alert = memory_alert(m)
        if alert is not None:
            m.alerts["memory"] = alert

    def _finish_sync_count(self) -> None:
        counter, self._sync_counter = self._sync_counter, None
        if counter is not None:
            counter.__exit__(None, None, None)
            self.metrics.syncs_per_step = counter.total
            self.metrics.syncs_by_op = dict(counter.by_op.most_common())


def _collect_rl(m: TrainingMetrics, logs: dict, step: int) -> None:
    """The preference / RL metrics of one log (:func:`is_rl_key`), latest value and history."""
    for key, value in logs.items():
        if is_rl_key(key) and isinstance(value, (int, float)) and not isinstance(value, bool):
            m.rl[key] = float(value)
            hist = m.rl_history.setdefault(key, [])
            if not hist or hist[-1][0] != step:
                hist.append((step, float(value)))


def throughput(step_end: dict[int, float], tokens: dict[int, int],
               window_start: int) -> tuple[float | None, float | None]:
    """(steps/s, tokens/s) over the steps after ``window_start``, from step-end times and token counts.

    ``step_end[s]`` is the clock at the end of optimizer step ``s`` (the training start for the
    step training began at); ``tokens[s]`` the cumulative token count at that step end. Steps up
    to ``window_start`` are warm-up: only the time and tokens after its end count.
    """
    steps = sorted(s for s in step_end if s >= window_start)
    steps_per_s = tokens_per_s = None
    if len(steps) >= 2 and step_end[steps[-1]] > step_end[steps[0]]:
        steps_per_s = (steps[-1] - steps[0]) / (step_end[steps[-1]] - step_end[steps[0]])
    counted = sorted(s for s in tokens if s >= window_start and s in step_end)
    if len(counted) >= 2:
        first, last = counted[0], counted[-1]
        dt = step_end[last] - step_end[first]
        if dt > 0:
            tokens_per_s = (tokens[last] - tokens[first]) / dt
    return steps_per_s, tokens_per_s


SPIKE_FACTOR = 2.0
"""A logged loss above this many times the median of the previous :data:`SPIKE_WINDOW` is a spike."""
SPIKE_WINDOW = 10
"""Logged losses the spike check compares against (it waits until there are this many)."""
MEMORY_ALERT = 0.9
"""Peak reserved GPU memory above this fraction of the device's total raises the memory alert."""


@dataclass(frozen=True)
class Spike:
    """A logged loss far above the losses just before it."""

    step: int
    """The optimizer step it was logged at."""
    loss: float
    """The logged loss."""
    median: float
    """Median of the :data:`SPIKE_WINDOW` finite losses before it."""

    @property
    def ratio(self) -> float:
        return self.loss / self.median


def loss_spike(history: list[tuple[int, float]], factor: float = SPIKE_FACTOR,
               window: int = SPIKE_WINDOW) -> Spike | None:
    """The spike, when the latest logged loss is above ``factor`` × the median of the ``window`` finite losses
    before it."""
    if len(history) <= window:
        return None
    step, last = history[-1]
    before = sorted(v for _, v in history[-window - 1:-1] if math.isfinite(v))
    if len(before) < window or not math.isfinite(last):
        return None
    median = before[len(before) // 2]
    if median <= 0 or last <= factor * median:
        return None
    return Spike(step, last, median)


def spikes_alert(spikes: list[Spike]) -> str:
    """The alert text: the worst spike of the run (by ratio to its median), and how many there were."""
    worst = max(spikes, key=lambda s: s.ratio)
    text = (f"loss spiked to {worst.loss:.4g} at step {worst.step} ({worst.ratio:.1f}× the median {worst.median:.4g}"
            f" of the {SPIKE_WINDOW} steps before): a learning rate too high for this model, or a bad batch")
    if len(spikes) > 1:
        others = [str(s.step) for s in spikes if s is not worst]
        shown = ", ".join(others[-5:]) if len(others) <= 5 else "…, " + ", ".join(others[-5:])  # the latest five
        text += f"; {len(spikes)} spikes in this run (also at step {shown})"
    return text


def memory_alert(m: TrainingMetrics) -> str | None:
    """The alert text when the peak reserved GPU memory is above :data:`MEMORY_ALERT` of the total."""
    mem = m.memory
    if mem is None or not m.on_gpu or not mem.total or m.peak_reserved <= MEMORY_ALERT * mem.total:
        return None
    return (f"reserved GPU memory peaked at {m.peak_reserved / 2**30:.1f} of {mem.total / 2**30:.1f} GiB "
            f"({100 * m.peak_reserved / mem.total:.0f}%): close to out of memory; lower the batch size or "
            "MAX_SEQ_LENGTH, or use gradient-checkpoint offload")


def _restored(log_history: list[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) for ``key`` in a trainer's restored ``log_history`` (empty for a new run)."""
    return [(int(h["step"]), float(h[key])) for h in log_history
            if isinstance(h.get(key), (int, float)) and "step" in h]


def tracker_metrics(m: TrainingMetrics) -> dict[str, float]:
    """fastkit's numbers for the trainer's logs (keys ``fastkit/...``; only the known ones)."""
    out: dict[str, float] = {}
    if m.steps_per_s is not None:
        out["fastkit/steps_per_s"] = m.steps_per_s
    if m.tokens_per_s is not None:
        out["fastkit/tokens_per_s"] = m.tokens_per_s
    if m.peak_memory:
        out["fastkit/peak_allocated_gib"] = m.peak_memory / 2**30
    if m.peak_reserved:
        out["fastkit/peak_reserved_gib"] = m.peak_reserved / 2**30
    if m.host_total:
        out["fastkit/host_ram_used_gib"] = (m.host_total - m.host_available) / 2**30
    if m.syncs_per_step is not None:
        out["fastkit/syncs_per_step"] = float(m.syncs_per_step)
    return out


def evals_left(m: TrainingMetrics) -> int:
    """Evaluations still to come after step ``m.step``: each multiple of ``eval_every`` up to ``max_steps``, and one
    after the last step when the cadence does not fall on it."""
    if not m.eval_every or m.step >= m.max_steps:
        return 0
    return m.max_steps // m.eval_every - m.step // m.eval_every + (1 if m.max_steps % m.eval_every else 0)


def _eval_every(args, state) -> int | None:
    """The trainer's steps between evaluations (a share of the run: as the trainer resolved it), or None."""
    if str(getattr(args, "eval_strategy", "no")).split(".")[-1].lower() != "steps":
        return None
    every = getattr(args, "eval_steps", None)
    every = every if every and every >= 1 else getattr(state, "eval_steps", None)  # below 1: a share of the run
    return int(every) if every else None


def _describe_run(m: TrainingMetrics, args, model, dataloader, examples: int | None) -> None:
    """The run header: examples, effective batch, trainable / total parameters."""
    if examples is None and dataloader is not None:
        try:
            examples = len(dataloader.dataset)
        except (TypeError, AttributeError):
            examples = None
    m.examples = examples
    if args is not None:
        per_device = int(getattr(args, "per_device_train_batch_size", 1))
        accumulate = int(getattr(args, "gradient_accumulation_steps", 1))
        m.effective_batch = per_device * accumulate * int(getattr(args, "world_size", 1))
    if model is not None:
        params = list(model.parameters())
        m.trainable_params = sum(p.numel() for p in params if p.requires_grad)
        m.total_params = sum(p.numel() for p in params)


def _training_device(args, model) -> torch.device:
    if model is not None:
        try:
            return next(model.parameters()).device
        except (StopIteration, AttributeError):
            pass
    return torch.device("cpu") if getattr(args, "use_cpu", False) else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")


def _describe_model(m: TrainingMetrics, model, device: torch.device) -> None:
    """Model type, device and fastkit's active / skipped optimizations from its LoadReport."""
    from fastkit import _torch
    from fastkit.patching import report, unwrap

    m.device = str(device)
    if model is None:
        return
    config = getattr(unwrap(model), "config", None)
    m.model_type = getattr(config, "model_type", None)
    rep = report(model)
    if rep is not None:
        m.device = rep.device
        m.optimizations, m.skipped = dict(rep.active), dict(rep.skipped)
    if getattr(unwrap(model), "is_activation_checkpointing", False):
        m.optimizations.setdefault("gradient checkpointing", _checkpoint_mode(model))
    compiled = getattr(unwrap(model), _torch.COMPILE_NOTE_ATTR, None)
    if compiled:
        m.optimizations.setdefault("torch.compile", compiled)


def _checkpoint_mode(model) -> str:
    from fastkit.patching import active_patches, unwrap

    offload = any("offload" in name for name in active_patches(unwrap(model)))
    return "with double-buffered CPU offload" if offload else "recompute in backward"


__all__ = ["MEMORY_ALERT", "SPIKE_FACTOR", "SPIKE_WINDOW", "MetricsCallback", "Spike", "TrainingMetrics", "loss_spike",
           "memory_alert", "throughput", "tracker_metrics"]
