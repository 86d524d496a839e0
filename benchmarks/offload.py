"""``python -m benchmarks offload``: checkpoint-reload strategies side by side, and the time model checked.

Everything runs on a LoRA run (PEFT LoRA r=16 on every linear layer, base weights frozen), which is
what users do. Part 1 (strategies): no checkpointing / plain checkpointing / transformers ``offload=True``
(``save_on_cpu``) / TRL ``activation_offloading`` / fastkit single buffer / fastkit double buffer,
on the same weights, interleaved repetitions in one process: median step time (forward + backward),
ratio to plain checkpointing, peak device memory, host staging memory. A strategy that cannot run
here (transformers' and TRL's offload need an accelerator build of torch) reports ``n/a (reason)``.

Part 2 (time model): backward time spent in the checkpointed layers, measured, against
single ~ L*(c+g) and double ~ c + (L-1)*max(c,g) + g, for a few reload costs c. On CPU the copy
stream is throttled to a known c (a sleep per reload, which uses no CPU); on a GPU c is a measured
pinned host->device copy of one layer input. g and the backward time outside the layers come from
plain checkpointing at L and 1 layers. Every layer is offloaded here (``skip_last_layer=False``)
so the formulas apply as written; forward copies are drained before backward is timed. Times are
``median (min, spread)`` of interleaved repeats; ratios carry their per-repeat range.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace

import torch

from benchmarks.common import (
    TimeBudget,
    agg_pyplot,
    bench_device,
    bench_parser,
    fmt_ms,
    fmt_ratio,
    load_line,
    machine_line,
    markdown_table,
    median,
    parse_bench_args,
    positive_int,
    run_cli,
    sync,
    write_outputs,
)
from fastkit.device import GiB
from fastkit.patches.offload.patch import OffloadConfig, enable_offload, offload_controller
from fastkit.patches.offload.streams import Throttle
from fastkit.patches.offload.testing import OffloadTestConfig
from fastkit.patching import revert
from fastkit.units import fmt_bytes

MODES = ["no checkpointing", "plain checkpointing", "transformers offload=True", "TRL activation_offloading",
         "fastkit single buffer", "fastkit double buffer"]


@dataclass
class Profile:
    """Model shape and run length."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    seq: int
    reps: int
    dtype: torch.dtype
    c_over_g: tuple[float, ...]


CPU = Profile(layers=6, hidden=256, heads=8, kv_heads=4, intermediate=768, seq=512, reps=3,
              dtype=torch.float32, c_over_g=(0.5, 1.0, 2.0))
QUICK = Profile(layers=3, hidden=64, heads=4, kv_heads=2, intermediate=128, seq=64, reps=1,
                dtype=torch.float32, c_over_g=(1.0,))
# 6 layers of 8B shapes (1.3B params, bf16, ~0.1 s per LoRA step at 4k tokens on an H200), built on the GPU
GPU = Profile(layers=6, hidden=4096, heads=32, kv_heads=8, intermediate=14336, seq=4096, reps=3,
              dtype=torch.bfloat16, c_over_g=())
LORA_R = 16


def build_model(p: Profile, layers: int, device: torch.device) -> torch.nn.Module:
    """A llama-architecture model at the profile's layer shapes, initialised on ``device`` (small vocab), with
    PEFT LoRA (r=16) on every linear layer: only the adapters train."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from fastkit.families.twins import twin_config

    config = twin_config("llama", num_hidden_layers=layers, hidden_size=p.hidden, num_attention_heads=p.heads,
                         num_key_value_heads=p.kv_heads, head_dim=p.hidden // p.heads,
                         intermediate_size=p.intermediate, tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=p.dtype, attn_implementation="sdpa")
        model = get_peft_model(model, LoraConfig(r=LORA_R, lora_alpha=LORA_R, target_modules="all-linear"))
    return model.train()


class Runner:
    """One strategy on one model: how to switch it on, run a step, and undo it."""

    def __init__(self, model, mode: str, device: torch.device, config: OffloadConfig):
        self.model, self.mode, self.device, self.config = model, mode, device, config
        self.ctx = contextlib.nullcontext
        self.na: str | None = None

    def setup(self) -> None:
        m = self.model
        if self.mode == "no checkpointing":
            return
        offload = self.mode == "transformers offload=True"
        m.activation_checkpointing_enable({"use_reentrant": False}, offload=offload)
        if self.mode == "TRL activation_offloading":
            from trl.models.activation_offloading import get_act_offloading_ctx_manager

            ctx = get_act_offloading_ctx_manager(m, warn_if_no_head=False)
            self.ctx = lambda: ctx
        elif self.mode.startswith("fastkit"):
            config = replace(self.config, double_buffer=self.mode.endswith("double buffer"))
            mode = enable_offload(m, config)
            if mode.startswith("checkpoint"):
                self.na = mode

    def teardown(self) -> None:
        revert(self.model)
        if self.mode != "no checkpointing":
            self.model.activation_checkpointing_disable()

    def step(self, ids: torch.Tensor) -> tuple[float, float]:
        """(step seconds, backward seconds); forward copies are drained before backward starts."""
        self.model.zero_grad(set_to_none=True)
        sync(self.device)
        t0 = time.perf_counter()
        with self.ctx():
            loss = self.model(input_ids=ids, labels=ids).loss
        ctrl = offload_controller(self.model)
        if ctrl is not None:
            ctrl.streams.synchronize()
        sync(self.device)
        t1 = time.perf_counter()
        loss.backward()
        sync(self.device)
        t2 = time.perf_counter()
        return t2 - t0, t2 - t1


def _peak_reset(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device) -> str:
    return fmt_bytes(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else "-"


def _host(runner: Runner) -> str:
    ctrl = offload_controller(runner.model)
    if ctrl is not None:
        return f"{fmt_bytes(ctrl.host.total)} ({'pinned' if ctrl.host.pin else 'pageable'})"
    if runner.device.type == "cuda" and hasattr(torch.cuda, "host_memory_stats"):
        stats = torch.cuda.host_memory_stats()
        return f"{fmt_bytes(stats.get('allocated_bytes.peak', stats.get('allocated_bytes.all.peak', 0)))} pinned"
    return "-"


def run_strategies(p: Profile, device: torch.device, config: OffloadConfig, budget: TimeBudget) -> list[dict]:
    """Part 1: every strategy on its own copy of the same weights, repetitions interleaved."""
    ids = torch.randint(3, 300, (1, p.seq), device=device)
    runners = []
    for mode in MODES:
        r = Runner(build_model(p, p.layers, device), mode, device, config)
        try:
            r.setup()
        except Exception as exc:  # noqa: BLE001 - reported in the table
            r.na = _na(exc)
        runners.append(r)
    times: dict[str, list[float]] = {r.mode: [] for r in runners}
    rows = {r.mode: {"mode": r.mode, "peak": "-", "host": "-"} for r in runners}
    for rep in range(p.reps + 1):  # rep 0 warms up (buffers, kernels) and is not counted
        if rep >= 3 and not budget.allows():
            budget.skip(f"strategy repeats {rep}..{p.reps}")
            break
        for r in runners:
            if r.na is not None:
                continue
            try:
                _peak_reset(device)
                step, _ = r.step(ids)
            except Exception as exc:  # transformers/TRL offload on a CPU-only torch build
                r.na = _na(exc)
                continue
            if rep > 0:
                times[r.mode].append(step)
            rows[r.mode].update(peak=_peak(device), host=_host(r))
    base = times["plain checkpointing"]
    for r in runners:
        t = times[r.mode]
        rows[r.mode]["step"] = r.na or fmt_ms([x * 1e3 for x in t])
        ref = r.mode == "plain checkpointing"
        rows[r.mode]["ratio"] = "-" if r.na else "1 (reference)" if ref else fmt_ratio(t, base)
        r.teardown()
    return list(rows.values())


def _na(exc: BaseException) -> str:
    return f"n/a ({type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''})"


def _trace_step(runner: Runner, ids: torch.Tensor) -> tuple[float, float, float]:
    """One traced step: (time inside the layers, median g, median c), all from this step's trace.

    Inside the layers = from the first reload's start (issued by the first unpack, since every layer is
    offloaded) to the end of the last layer's backward; g = a layer's recompute + backward (compute
    spans start after the wait for its reload); c = a reload copy.
    """
    trace = offload_controller(runner.model).streams.trace
    trace.clear()
    runner.step(ids)
    h2d, comp = trace.of("h2d"), trace.of("compute")
    first = min(h2d, key=lambda s: s.start)
    inside = max(s.end for s in comp) - first.start
    return inside, median([s.end - s.start for s in comp]), median([s.end - s.start for s in h2d])


def _measure_c_gpu(p: Profile, device: torch.device) -> float:
    numel = p.seq * p.hidden
    host = torch.empty(numel, dtype=p.dtype, pin_memory=True)
    dev = torch.empty(numel, dtype=p.dtype, device=device)
    ts = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dev.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        ts.append(start.elapsed_time(end) / 1e3)
    return median(ts[2:])


def _saved(single: list[float], double: list[float]) -> str:
    """single - double per interleaved repeat (ms): median [min to max]."""
    d = [(a - b) * 1e3 for a, b in zip(single, double)]
    return f"{median(d):.1f} ms [{min(d):.1f} to {max(d):.1f}]" if len(d) > 1 else f"{median(d):.1f} ms (1 rep)"


def _interleaved(runners: list[Runner], ids: torch.Tensor, p: Profile, budget: TimeBudget, measure) -> list[list]:
    """``measure(runner, ids)`` for every runner, repeats interleaved, the first (warm-up) dropped."""
    out: list[list] = [[] for _ in runners]
    for rep in range(p.reps + 1):
        if rep >= 3 and not budget.allows():
            budget.skip(f"time-model repeats {rep}..{p.reps}")
            break
        for i, r in enumerate(runners):
            value = measure(r, ids)
            if rep > 0:
                out[i].append(value)
    return out


def run_time_model(p: Profile, device: torch.device, config: OffloadConfig, budget: TimeBudget) -> list[dict]:
    """Part 2 (CPU): measured time inside the layers against the single/double time model."""
    L = p.layers
    models = [build_model(p, L, device), build_model(p, L, device)]
    ids = torch.randint(3, 300, (1, p.seq), device=device)
    base = replace(config, skip_last_layer=False, trace=True, throttle=Throttle(0.0, poison=False))
    runner = Runner(models[0], "fastkit single buffer", device, base)
    runner.setup()
    g0 = median([_trace_step(runner, ids)[1] for _ in range(min(p.reps, 2) + 1)][1:])
    runner.teardown()
    rows = []
    for k in p.c_over_g:
        if not budget.allows(2 * (p.reps + 1) * L * (k + 1) * g0 * 1.5):
            budget.skip(f"time-model throttle c = {k:g} g0")
            continue
        row = {"label": f"{k:g} g0", "L": L}
        runners = []
        for double, model in zip((False, True), models):
            cfg = replace(base, double_buffer=double, throttle=Throttle(k * g0, directions=("h2d",), poison=False))
            runners.append(Runner(model, "fastkit double buffer" if double else "fastkit single buffer", device, cfg))
            runners[-1].setup()
        runs = _interleaved(runners, ids, p, budget, _trace_step)
        for r in runners:
            r.teardown()
        for key, rs in zip(("single", "double"), runs):
            inside, g, c = ([r[i] for r in rs] for i in range(3))
            cm, gm = median(c), median(g)
            model_t = cm + (L - 1) * max(cm, gm) + gm if key == "double" else L * (cm + gm)
            row.update({f"{key} measured": fmt_ms([x * 1e3 for x in inside], 0),
                        f"{key} model": f"{model_t * 1e3:.0f} ms", f"_{key}": (median(inside), model_t),
                        f"_{key}_all": inside, f"{key} g": gm, "c": f"{cm * 1e3:.0f} ms"})
        row["g"] = f"{row['single g'] * 1e3:.0f} / {row['double g'] * 1e3:.0f} ms"
        (_, s_model), (_, d_model) = row["_single"], row["_double"]
        row["ratio"] = f"{fmt_ratio(row['_double_all'], row['_single_all'])} (model {d_model / s_model:.2f}×)"
        row["saved"] = f"{_saved(row['_single_all'], row['_double_all'])} (model {(s_model - d_model) * 1e3:.0f})"
        rows.append(row)
    return rows


def run_gpu_model(p: Profile, device: torch.device, config: OffloadConfig, budget: TimeBudget) -> list[dict]:
    """Part 2 (GPU): measured c; backward time plain vs single vs double (interleaved) against the model."""
    c = _measure_c_gpu(p, device)
    ids = torch.randint(3, 300, (1, p.seq), device=device)
    modes = ("plain checkpointing", "fastkit single buffer", "fastkit double buffer")
    runners = [Runner(build_model(p, p.layers, device), m, device, replace(config, skip_last_layer=False))
               for m in modes]
    for r in runners:
        r.setup()
    # host spans do not show GPU time, so the whole backward is compared
    plain, single, double = _interleaved(runners, ids, p, budget, lambda r, x: r.step(x)[1])
    for r in runners:
        r.teardown()
    g = median(plain) / p.layers  # upper bound: includes the head and embedding backward
    L = p.layers
    ms = lambda xs: fmt_ms([x * 1e3 for x in xs])  # noqa: E731
    return [{"label": "measured H2D", "c": f"{c * 1e3:.2f} ms", "g": f"<= {g * 1e3:.1f} ms", "L": L,
             "single measured": f"{ms(single)} (bwd)", "single model": f"+{L * c * 1e3:.1f} ms over plain",
             "double measured": f"{ms(double)} (bwd)",
             "double model": f"+{(c + (L - 1) * max(c - g, 0)) * 1e3:.1f} ms over plain",
             "ratio": f"{fmt_ratio(double, single)}; plain bwd {ms(plain)}",
             "saved": f"{_saved(single, double)} (model {(L - 1) * min(c, g) * 1e3:.1f})",
             "_single": (median(single), median(plain) + L * c), "_double": (median(double), median(plain) + c)}]


def _table(rows: list[dict], cols: list[tuple[str, str]]) -> str:
    return markdown_table([h for _, h in cols], [[r[k] for k, _ in cols] for r in rows])


def _figure(model_rows: list[dict]):
    plt = agg_pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = range(len(model_rows))
    for i, key in enumerate(("single", "double")):
        xs = [j + (i - 0.5) * 0.35 for j in x]
        ax.bar(xs, [r[f"_{key}"][0] * 1e3 for r in model_rows], 0.35, label=f"{key} measured")
        ax.scatter(xs, [r[f"_{key}"][1] * 1e3 for r in model_rows], color="k", marker="_", s=400, zorder=3,
                   label="time model" if i else None)
    ax.set_xticks(list(x), [f"c = {r['label']}" for r in model_rows], fontsize=8)
    ax.set_ylabel("backward time in layers (ms)")
    ax.set_title("fastkit offload: measured vs time model")
    ax.legend(fontsize=8)
    return fig


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser("offload", __doc__, quick="tiny shapes, 1 rep", gpu="6 layers of 8B shapes, 4k tokens, LoRA",
                      repeats="interleaved repetitions (default 3; gpu 3; quick 1)")
    ap.add_argument("--layers", type=positive_int, default=None, help="override the number of layers")
    ap.add_argument("--seq", type=positive_int, default=None, help="override the sequence length")
    args = parse_bench_args(ap, argv)
    device = bench_device(args.gpu)
    budget = TimeBudget(args.budget_s)
    load = load_line()
    p = QUICK if args.quick else GPU if args.gpu else CPU
    p = replace(p, layers=args.layers or p.layers, seq=args.seq or p.seq, reps=args.repeats or p.reps)
    config = OffloadTestConfig(min_tokens=0, min_bytes=0, force_cpu_stream=device.type == "cpu",
                           pinned_budget_bytes=8 * GiB)
    torch.manual_seed(0)
    shape = (f"llama layers: {p.layers} x (hidden {p.hidden}, {p.heads}/{p.kv_heads} heads, intermediate "
             f"{p.intermediate}), seq {p.seq}, batch 1, {str(p.dtype).replace('torch.', '')}, LoRA r={LORA_R} on "
             "every linear layer (base weights frozen)")

    def write(strat, tm, figure=None):
        md = (f"# fastkit bench offload\n\n{machine_line(device, load)}\n\n{shape}; {p.reps} interleaved reps after "
              "one warm-up; times are median (min, spread = (max−min)/median), ratios median [range] of the "
              "per-repeat ratios.\n\n## Strategies\n\n"
              + _table(strat, [("mode", "strategy"), ("step", "step (fwd+bwd) ms"),
                               ("ratio", "time / plain ckpt [range]"), ("peak", "peak device mem"),
                               ("host", "host staging")])
              + "\n## Time model (backward time inside the checkpointed layers; c, g measured in the same run)\n\n"
              + (_table(tm, [("label", "throttle"), ("c", "reload c"), ("g", "layer g (single / double run)"),
                             ("L", "L"), ("single measured", "single ms"), ("single model", "L(c+g)"),
                             ("double measured", "double ms"), ("double model", "c+(L-1)max(c,g)+g"),
                             ("ratio", "double/single [range]"), ("saved", "saved [range]")]) if tm else "-\n")
              + ("\n" + budget.note() if budget.note() else ""))
        write_outputs("offload", md, figure, out=args.out, quick=args.quick)

    strat = run_strategies(p, device, config, budget)
    write(strat, [])
    run_model = run_gpu_model if device.type == "cuda" else run_time_model
    tm = run_model(p, device, config, budget) if budget.allows(budget.elapsed() * 0.5) else []
    if not tm and not budget.skipped:
        budget.skip("the time model")
    write(strat, tm, (lambda: _figure(tm)) if tm else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
