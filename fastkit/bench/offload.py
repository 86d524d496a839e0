"""``fastkit bench offload``: checkpoint-reload strategies side by side, and the time model checked.

Part 1 (strategies): no checkpointing / plain checkpointing / transformers ``offload=True``
(``save_on_cpu``) / TRL ``activation_offloading`` / fastkit single buffer / fastkit double buffer,
on the same weights, interleaved repetitions in one process: median step time (forward + backward),
ratio to plain checkpointing, peak device memory, host staging memory. A strategy that cannot run
here (transformers' and TRL's offload need an accelerator build of torch) reports ``n/a (reason)``.

Part 2 (time model): backward time spent in the checkpointed layers, measured, against
single ~ L*(c+g) and double ~ c + (L-1)*max(c,g) + g, for a few reload costs c. On CPU the copy
stream is throttled to a known c (a sleep per reload, which uses no CPU); on a GPU c is a measured
pinned host->device copy of one layer input. g and the backward time outside the layers come from
plain checkpointing at L and 1 layers. Every layer is offloaded here (``skip_last_layer=False``)
so the formulas apply as written; forward copies are drained before backward is timed.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace

import torch

from fastkit.bench.common import (
    agg_pyplot,
    bench_device,
    bench_parser,
    fmt_bytes,
    machine_line,
    markdown_table,
    median,
    run_cli,
    sync,
    write_outputs,
)
from fastkit.device import GiB
from fastkit.patches.offload import OffloadConfig, enable_offload, offload_controller
from fastkit.patches.streams import Throttle
from fastkit.patching import revert

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


CPU = Profile(layers=6, hidden=256, heads=8, kv_heads=4, intermediate=768, seq=1024, reps=5,
              dtype=torch.float32, c_over_g=(0.5, 1.0, 2.0))
QUICK = Profile(layers=3, hidden=64, heads=4, kv_heads=2, intermediate=128, seq=64, reps=1,
                dtype=torch.float32, c_over_g=(1.0,))
GPU = Profile(layers=6, hidden=4096, heads=32, kv_heads=8, intermediate=14336, seq=4096, reps=3,
              dtype=torch.bfloat16, c_over_g=())


def build_model(p: Profile, layers: int, device: torch.device) -> torch.nn.Module:
    """A llama-architecture model at the profile's layer shapes, initialised on ``device`` (small vocab)."""
    from transformers import AutoModelForCausalLM

    from fastkit.twins import twin_config

    config = twin_config("llama", num_hidden_layers=layers, hidden_size=p.hidden, num_attention_heads=p.heads,
                         num_key_value_heads=p.kv_heads, head_dim=p.hidden // p.heads,
                         intermediate_size=p.intermediate, tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=p.dtype, attn_implementation="sdpa")
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


def run_strategies(p: Profile, device: torch.device, config: OffloadConfig) -> list[dict]:
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
    base = median(times["plain checkpointing"])
    for r in runners:
        t = median(times[r.mode])
        rows[r.mode]["step"] = r.na or f"{t * 1e3:.1f} ms"
        rows[r.mode]["ratio"] = "-" if r.na else f"{t / base:.2f}x"
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


def _layers_time_gpu(runner: Runner, ids: torch.Tensor, p: Profile) -> float:
    """GPU: median backward time (host spans do not show GPU time, so the whole backward is compared)."""
    return median([runner.step(ids)[1] for _ in range(p.reps + 1)][1:])


def run_time_model(p: Profile, device: torch.device, config: OffloadConfig) -> list[dict]:
    """Part 2 (CPU): measured time inside the layers against the single/double time model."""
    L = p.layers
    model = build_model(p, L, device)
    ids = torch.randint(3, 300, (1, p.seq), device=device)
    base = replace(config, skip_last_layer=False, trace=True, throttle=Throttle(0.0, poison=False))
    runner = Runner(model, "fastkit single buffer", device, base)
    runner.setup()
    g0 = median([_trace_step(runner, ids)[1] for _ in range(p.reps + 1)][1:])
    runner.teardown()
    rows = []
    for k in p.c_over_g:
        row = {"label": f"{k:g} g0", "L": L}
        for double in (False, True):
            cfg = replace(base, double_buffer=double, throttle=Throttle(k * g0, directions=("h2d",), poison=False))
            runner = Runner(model, "fastkit double buffer" if double else "fastkit single buffer", device, cfg)
            runner.setup()
            runs = [_trace_step(runner, ids) for _ in range(p.reps + 1)][1:]
            runner.teardown()
            inside, g, c = (median([r[i] for r in runs]) for i in range(3))
            model_t = c + (L - 1) * max(c, g) + g if double else L * (c + g)
            key = "double" if double else "single"
            row.update({f"{key} measured": f"{inside * 1e3:.0f} ms", f"{key} model": f"{model_t * 1e3:.0f} ms",
                        f"_{key}": (inside, model_t), f"{key} g": g, "c": f"{c * 1e3:.0f} ms"})
        row["g"] = f"{row['single g'] * 1e3:.0f} / {row['double g'] * 1e3:.0f} ms"
        (s_meas, s_model), (d_meas, d_model) = row["_single"], row["_double"]
        row["ratio"] = f"{d_meas / s_meas:.2f} (model {d_model / s_model:.2f})"
        row["saved"] = f"{(s_meas - d_meas) * 1e3:.0f} ms (model {(s_model - d_model) * 1e3:.0f})"
        rows.append(row)
    return rows


def run_gpu_model(p: Profile, device: torch.device, config: OffloadConfig) -> list[dict]:
    """Part 2 (GPU): measured c; backward time single vs double and their ratio."""
    c = _measure_c_gpu(p, device)
    model = build_model(p, p.layers, device)
    ids = torch.randint(3, 300, (1, p.seq), device=device)
    out = {}
    for mode in ("plain checkpointing", "fastkit single buffer", "fastkit double buffer"):
        runner = Runner(model, mode, device, replace(config, skip_last_layer=False))
        runner.setup()
        out[mode] = _layers_time_gpu(runner, ids, p)
        runner.teardown()
    g = out["plain checkpointing"] / p.layers  # upper bound: includes the head and embedding backward
    L = p.layers
    return [{"label": "measured H2D", "c": f"{c * 1e3:.2f} ms", "g": f"<= {g * 1e3:.1f} ms", "L": L,
             "single measured": f"{out['fastkit single buffer'] * 1e3:.1f} ms (bwd)",
             "single model": f"+{L * c * 1e3:.1f} ms over plain",
             "double measured": f"{out['fastkit double buffer'] * 1e3:.1f} ms (bwd)",
             "double model": f"+{(c + (L - 1) * max(c - g, 0)) * 1e3:.1f} ms over plain",
             "ratio": f"plain bwd {out['plain checkpointing'] * 1e3:.1f} ms",
             "saved": f"{(out['fastkit single buffer'] - out['fastkit double buffer']) * 1e3:.1f} ms "
                      f"(model {(L - 1) * min(c, g) * 1e3:.1f})",
             "_single": (out["fastkit single buffer"], out["plain checkpointing"] + L * c),
             "_double": (out["fastkit double buffer"], out["plain checkpointing"] + c)}]


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
    ap = bench_parser("offload", __doc__, quick="tiny shapes, 1 rep", gpu="8B-class layer shapes",
                      repeats="interleaved repetitions, median reported (default 5; gpu 3; quick 1)")
    ap.add_argument("--layers", type=int, default=None, help="override the number of layers")
    ap.add_argument("--seq", type=int, default=None, help="override the sequence length")
    args = ap.parse_args(argv)
    device = bench_device(args.gpu)
    p = QUICK if args.quick else GPU if args.gpu else CPU
    p = replace(p, layers=args.layers or p.layers, seq=args.seq or p.seq, reps=args.repeats or p.reps)
    config = OffloadConfig(min_tokens=0, min_bytes=0, force_cpu_stream=device.type == "cpu",
                           pinned_budget_bytes=8 * GiB)
    torch.manual_seed(0)
    strat = run_strategies(p, device, config)
    tm = run_gpu_model(p, device, config) if device.type == "cuda" else run_time_model(p, device, config)
    shape = (f"llama layers: {p.layers} x (hidden {p.hidden}, {p.heads}/{p.kv_heads} heads, intermediate "
             f"{p.intermediate}), seq {p.seq}, batch 1, {str(p.dtype).replace('torch.', '')}, full fine-tune")
    md = (f"# fastkit bench offload\n\n{machine_line(device)}\n\n{shape}; median of {p.reps} interleaved reps.\n\n"
          "## Strategies\n\n"
          + _table(strat, [("mode", "strategy"), ("step", "step (fwd+bwd)"), ("ratio", "vs plain ckpt"),
                           ("peak", "peak device mem"), ("host", "host staging")])
          + "\n## Time model (backward time inside the checkpointed layers; c, g measured in the same run)\n\n"
          + _table(tm, [("label", "throttle"), ("c", "reload c"), ("g", "layer g (single / double run)"),
                        ("L", "L"), ("single measured", "single"), ("single model", "L(c+g)"),
                        ("double measured", "double"), ("double model", "c+(L-1)max(c,g)+g"),
                        ("ratio", "double/single"), ("saved", "saved")]))
    write_outputs("offload", md, _figure(tm), out=args.out, quick=args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
