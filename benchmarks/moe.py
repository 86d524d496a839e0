"""``python -m benchmarks moe``: one MoE experts layer, transformers' paths vs fastkit's, side by side.

Per shape (GPT-OSS-20B: hidden 2880, 32 experts top-4, expert width 2880, biases, interleaved
clamp-SwiGLU; Qwen3-30B-A3B: hidden 2048, 128 experts top-8, expert width 768) it times, with
interleaved repetitions in one process:

- ``eager``: transformers' per-expert loop (the class's own forward);
- ``grouped_mm``: transformers' sort + grouped GEMM (the default where ``grouped_mm`` runs);
- ``batched_mm``: transformers' batched form (each (token, k) row gets a copy of its expert's weights, one
  ``bmm``); not run where those copies would pass ``--batched-gib`` (the table says so);
- ``grouped_mm fallback``: the same with ``grouped_mm`` unavailable, i.e. what a T4 gets
  (``torch.ops.transformers.grouped_mm_fallback``, offsets read back per GEMM);
- ``fastkit``: :func:`fastkit.patches.moe.fastkit_experts_forward` (grouped GEMM where it runs);
- ``fastkit loop``: fastkit's host-count loop (what fastkit runs where grouped GEMM does not);
- ``fastkit batched``: fastkit's routing with one bmm over gathered weights (its choice off the grouped
  GEMM for small frozen layers: 0 syncs); skipped like ``batched_mm``.
- ``GEMM floor``: the expert GEMMs and the activation alone, on rows already sorted by expert (no routing,
  gather or combine): what every path must compute. ``eager / floor`` bounds what ANY routing can gain over
  eager at that shape; ``fastkit / floor`` is what fastkit's routing still costs.

The first columns compare fastkit (its ``auto`` choice) with the best of transformers' own paths on this
device (``eager``, ``grouped_mm``, ``batched_mm``: the fastest median) and with ``eager``.

Forward and forward+backward (input and routing-weight gradients; expert weights frozen, the LoRA
fine-tuning setting), host syncs per layer, then LoRA on the experts: PEFT ``target_parameters`` on
transformers' grouped_mm, the same PEFT adapter run by fastkit, and fastkit's own expert LoRA: time
and peak extra memory (tensors alive during forward+backward, tracked by a dispatch mode, so the
number means the same on CPU and GPU). Times are ``median (min, spread)`` of interleaved repeats;
speed-ups carry the range of their per-repeat ratios.
"""

from __future__ import annotations

import copy
import gc
import statistics
import time
from contextlib import contextmanager, nullcontext

import torch

from benchmarks.common import (
    CLOCKS,
    TimeBudget,
    agg_pyplot,
    bench_device,
    bench_parser,
    clock_for,
    fmt_ms,
    fmt_ratio,
    load_line,
    markdown_table,
    parse_bench_args,
    positive_float,
    positive_int,
    run_cli,
    timed,
    write_outputs,
)
from benchmarks.moe_4bit import bench_4bit, table_4bit
from benchmarks.moe_layer import PeakMemory, experts_module, inputs, layer_syncs, share_weights, step
from fastkit.units import fmt_bytes

SHAPES = {
    "gpt-oss-20b": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_local_experts=32,
                        num_experts_per_tok=4),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, moe_intermediate_size=768, num_experts=128,
                          num_experts_per_tok=8),
}
QUICK = {
    "gpt-oss-20b": dict(hidden_size=64, intermediate_size=64, num_local_experts=8),
    "qwen3-30b-a3b": dict(hidden_size=64, moe_intermediate_size=32, num_experts=32),
}
IMPLS = ["eager", "grouped_mm", "batched_mm", "grouped_mm fallback", "fastkit", "fastkit loop", "fastkit batched",
         "GEMM floor"]
FLOOR = "GEMM floor"
UPSTREAM = ("eager", "grouped_mm", "batched_mm")
"""transformers' own experts paths: the best of them is what fastkit must never be slower than."""
_KEYS = {"eager": "eager", "grouped_mm": "grouped_mm", "grouped_mm fallback": "grouped_mm", "batched_mm": "batched_mm"}
_FASTKIT_MODES = {"fastkit": "auto", "fastkit loop": "loop", "fastkit batched": "batched"}


class GemmFloor(torch.nn.Module):
    """The expert GEMMs and the activation of ``module`` alone, on rows sorted by expert beforehand (no routing,
    no gather, no combine): a lower bound on any experts forward+backward with the same weights.

    Its rows are a leaf of their own (the input gradient flows to them, as the real paths' flows to ``h``);
    the GEMMs are fastkit's (grouped GEMM where it runs, else one ``mm`` per expert on host offsets, read once
    here, outside the timed call). Biases are left out (an add each, next to two GEMMs).
    """

    def __init__(self, module, h: torch.Tensor, idx: torch.Tensor):
        super().__init__()
        from fastkit.patches.moe.patch import projection_names
        from fastkit.patches.moe.routing import in_out, read_back, route

        routing = route(idx, module.num_experts)
        routing.host_ends = read_back(routing, h, module.num_experts, check=False, with_ends=True)[0]
        k = idx.size(1)
        self.rows = h.detach().index_select(0, routing.perm // k).requires_grad_(True)  # (S, H) sorted by expert
        self.routing = routing
        up, down = projection_names(module)
        self.up = in_out(getattr(module, up), module.is_transposed)  # (E, H, 2I or I)
        self.down = in_out(getattr(module, down), module.is_transposed)  # (E, I, H)
        self.gated = module.has_gate

    def forward(self, h, idx, w):
        from fastkit.patches.moe.routing import grouped_matmul, grouped_mm_runs

        routing = self.routing
        if grouped_mm_runs(self.up) and grouped_mm_runs(self.down):
            routing = copy.copy(routing)
            routing.host_ends = None  # the grouped GEMM, with its device-side offsets
        y = grouped_matmul(self.rows, self.up, routing)  # (S, 2I) or (S, I)
        if self.gated:
            gate, up = y.chunk(2, dim=-1)  # (S, I) each
            y = torch.nn.functional.silu(gate) * up
        else:
            y = torch.nn.functional.silu(y)
        return grouped_matmul(y, self.down, routing)  # (S, H)


def _impl_context(module, impl: str):
    """Select ``impl`` on the module's config; the fallback makes transformers' grouped_mm check say no."""
    from fastkit._hf import grouped_mm_disabled
    from fastkit.patches.moe.patch import MoEConfig, attach_experts, detach_experts

    if impl == FLOOR:
        return nullcontext()
    if impl in _FASTKIT_MODES:
        attach_experts(module, MoEConfig(mode=_FASTKIT_MODES[impl], validate="off"), name="bench.experts")
    else:
        detach_experts(module, _KEYS[impl])
    if impl == "grouped_mm fallback":
        return grouped_mm_disabled()
    return nullcontext()


def _count_syncs(module, h, idx, w, impl):
    with _impl_context(module, impl):
        return layer_syncs(GemmFloor(module, h, idx) if impl == FLOOR else module, h, idx, w)


def _gathered_bytes(module, tokens: int, top_k: int) -> int:
    """Bytes of the per-row weight copies the batched paths build in one forward."""
    from fastkit.patches.moe.patch import projection_names

    return tokens * top_k * sum(getattr(module, n)[0].numel() * getattr(module, n).element_size()
                                for n in projection_names(module))


def bench_routing(name: str, shape: dict, tokens: int, reps: int, dtype, device, impls=IMPLS,
                  budget: TimeBudget | None = None, batched_gib: float = 2.0, notes: list | None = None,
                  clock=time.perf_counter) -> list[dict]:
    module = experts_module(shape, dtype, device)
    h, idx, w = inputs(module, tokens, shape["num_experts_per_tok"], dtype, device)
    gathered = _gathered_bytes(module, tokens, shape["num_experts_per_tok"])
    if gathered > batched_gib * 2**30:
        impls = [i for i in impls if "batched" not in i]
        if notes is not None:
            notes.append(f"{name}: batched_mm and fastkit batched not run (their per-row weight copies would take "
                         f"{fmt_bytes(gathered, 'GiB')}, over --batched-gib {batched_gib:g}).")
    floor = GemmFloor(module, h, idx)
    run = {i: floor if i == FLOOR else module for i in impls}  # what each path calls
    times = {(i, b): [] for i in impls for b in (False, True)}
    for i in impls:  # warm-up (and the first-forward checks)
        with _impl_context(module, i):
            step(run[i], h, idx, w, True)
    for rep in range(reps):
        if rep >= 3 and budget is not None and not budget.allows():
            budget.skip(f"{name} routing repeats {rep + 1}..{reps}")
            break
        for i in impls:  # interleaved: every impl sees the same machine state
            for b in (False, True):
                with _impl_context(module, i):
                    times[(i, b)].append(timed(lambda m=run[i], b=b: step(m, h, idx, w, b), device, clock))
    rows = []
    for i in impls:
        syncs = _count_syncs(module, h, idx, w, i)
        rows.append(dict(shape=name, impl=i, tokens=tokens, fwd_ms=[1e3 * t for t in times[(i, False)]],
                         fwd_bwd_ms=[1e3 * t for t in times[(i, True)]], syncs_fwd=syncs[0], syncs_bwd=syncs[1]))
    del module, floor, run
    gc.collect()
    return rows


class _Layer(torch.nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.experts = experts

    def forward(self, h, idx, w):
        return self.experts(h, idx, w)


def _lora_variant(module, variant: str, r: int):
    """A layer holding ``module`` with LoRA on its experts, run the ``variant`` way."""
    from peft import LoraConfig, get_peft_model

    from fastkit.patches.moe.lora import ExpertLoRA
    from fastkit.patches.moe.patch import MoEConfig, attach_experts, detach_experts

    experts = share_weights(module)
    if variant == "fastkit expert LoRA":
        experts.fastkit_lora = ExpertLoRA(experts, r=r, lora_alpha=2 * r)
        with torch.no_grad():
            for n, p in experts.fastkit_lora.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.02)
        layer = _Layer(experts)
    else:
        cfg = LoraConfig(r=r, lora_alpha=2 * r, target_parameters=["experts.gate_up_proj", "experts.down_proj"])
        layer = get_peft_model(_Layer(experts), cfg)
    impl = "grouped_mm" if variant == "PEFT target_parameters (transformers grouped_mm)" else "fastkit"
    experts.config = copy.copy(experts.config)
    if impl == "fastkit":
        attach_experts(experts, MoEConfig(validate="off"), name="bench.experts")
    else:
        detach_experts(experts, impl)
    return layer


LORA_VARIANTS = ["PEFT target_parameters (transformers grouped_mm)", "PEFT target_parameters (fastkit)",
                 "fastkit expert LoRA"]


def bench_lora(name: str, shape: dict, tokens: int, reps: int, r: int, dtype, device,
               clock=time.perf_counter) -> list[dict]:
    module = experts_module(shape, dtype, device)
    h, idx, w = inputs(module, tokens, shape["num_experts_per_tok"], dtype, device)
    layers = {v: _lora_variant(module, v, r) for v in LORA_VARIANTS}
    del module
    times = {v: [] for v in LORA_VARIANTS}
    peaks = {}
    for v, layer in layers.items():
        step(layer, h, idx, w, True)
        gc.collect()
        tracker = PeakMemory()
        with tracker:
            step(layer, h, idx, w, True)
        peaks[v] = tracker.peak
        layer.zero_grad(set_to_none=True)
    for _ in range(reps):
        for v, layer in layers.items():  # interleaved
            times[v].append(timed(lambda layer=layer: step(layer, h, idx, w, True), device, clock))
            layer.zero_grad(set_to_none=True)
    rows = [dict(shape=name, variant=v, tokens=tokens, r=r, fwd_bwd_ms=[1e3 * t for t in times[v]],
                 peak_bytes=peaks[v]) for v in LORA_VARIANTS]
    del layers
    gc.collect()
    return rows


def _best_upstream(group: list[dict]) -> dict | None:
    """The fastest (fwd+bwd median) of transformers' own paths that ran for one shape."""
    ups = [r for r in group if r["impl"] in UPSTREAM]
    return min(ups, key=lambda r: statistics.median(r["fwd_bwd_ms"])) if ups else None


def _summary_cells(rows: list[dict]) -> list[list]:
    cells = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        group = [r for r in rows if r["shape"] == shape]
        fk = next(r for r in group if r["impl"] == "fastkit")
        best = _best_upstream(group)
        eager = next((r for r in group if r["impl"] == "eager"), None)
        floor = next((r for r in group if r["impl"] == FLOOR), None)
        bound = fmt_ratio(eager["fwd_bwd_ms"], floor["fwd_bwd_ms"]) if eager and floor else "-"
        cost = fmt_ratio(fk["fwd_bwd_ms"], floor["fwd_bwd_ms"]) if floor else "-"
        cells.append([shape, fk["tokens"], best["impl"] if best else "-",
                      f"{fmt_ratio(best['fwd_ms'], fk['fwd_ms'])} / {fmt_ratio(best['fwd_bwd_ms'], fk['fwd_bwd_ms'])}"
                      if best else "-",
                      fmt_ratio(eager["fwd_bwd_ms"], fk["fwd_bwd_ms"]) if eager else "-", bound, cost,
                      f"{fk['syncs_fwd']} / {fk['syncs_bwd']}"])
    return cells


def _table(rows: list[dict], lora_rows: list[dict], device_name: str, note: str = "",
           four_rows: list[dict] | None = None) -> str:
    out = [f"MoE experts layer, {device_name}. Interleaved repetitions: times median (min, spread = "
           "(max−min)/median); speed-up = time(path) / time(fastkit), median [range] of the per-repeat ratios. "
           "Backward = input and routing-weight gradients (expert weights frozen).", ""]
    if rows:
        out += ["fastkit (`mode=\"auto\"`) against the best of transformers' own paths (eager, grouped_mm, "
                "batched_mm: the fastest fwd+bwd median) and against eager:", "",
                markdown_table(["shape", "tokens", "best upstream path", "vs best upstream fwd / fwd+bwd [range]",
                                "vs eager fwd+bwd [range]", "most any routing can gain over eager (eager / GEMM floor)",
                                "fastkit / GEMM floor", "fastkit syncs fwd/bwd"], _summary_cells(rows)), ""]
    cells = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        group = [r for r in rows if r["shape"] == shape]
        fk = next(r for r in group if r["impl"] == "fastkit")
        for r in group:
            ratio = (f"{fmt_ratio(r['fwd_ms'], fk['fwd_ms'])} / {fmt_ratio(r['fwd_bwd_ms'], fk['fwd_bwd_ms'])}"
                     if r["impl"] != "fastkit" else "1 (reference)")
            cells.append([shape, r["tokens"], r["impl"], fmt_ms(r["fwd_ms"]), fmt_ms(r["fwd_bwd_ms"]),
                          f"{r['syncs_fwd']} / {r['syncs_bwd']}", ratio])
    out.append(markdown_table(["shape", "tokens", "path", "forward ms", "fwd+bwd ms", "syncs fwd/bwd",
                               "fastkit speed-up fwd / fwd+bwd [range]"], cells))
    if lora_rows:
        cells = []
        for shape in dict.fromkeys(r["shape"] for r in lora_rows):
            group = [r for r in lora_rows if r["shape"] == shape]
            fk = next(r for r in group if r["variant"] == "fastkit expert LoRA")
            for r in group:
                ref = r["variant"] == "fastkit expert LoRA"
                cells.append([shape, r["tokens"], r["r"], r["variant"], fmt_ms(r["fwd_bwd_ms"]),
                              fmt_bytes(r["peak_bytes"], "MiB"),
                              "1 (reference)" if ref else fmt_ratio(r["fwd_bwd_ms"], fk["fwd_bwd_ms"]),
                              f"{r['peak_bytes'] / max(fk['peak_bytes'], 1e-9):.2f}x"])
        out += ["LoRA on every expert (gate_up_proj and down_proj), forward+backward (peak memory is counted, not "
                "timed: no spread):", "",
                markdown_table(["shape", "tokens", "r", "variant", "fwd+bwd ms", "peak extra memory",
                                "time / fastkit [range]", "memory / fastkit"], cells)]
    if four_rows:
        out += ["", table_4bit(four_rows)]
    if note:
        out.append(note)
    return "\n".join(out)


def _plot(rows: list[dict]):
    plt = agg_pyplot()
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(5.5 * len(shapes), 3.6), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        group = [r for r in rows if r["shape"] == shape]
        names = [r["impl"] for r in group]
        ax.barh(names, [statistics.median(r["fwd_bwd_ms"]) for r in group],
                color=["#2a7" if n.startswith("fastkit") else "#999" for n in names])
        ax.set_title(f"{shape}: forward+backward (ms)")
        ax.invert_yaxis()
    fig.tight_layout()
    return fig


@contextmanager
def _quiet():
    import logging

    level = logging.getLogger("fastkit").level
    logging.getLogger("fastkit").setLevel(logging.WARNING)
    try:
        yield
    finally:
        logging.getLogger("fastkit").setLevel(level)


def main(argv: list[str] | None = None) -> int:
    from fastkit.device import describe_device

    p = bench_parser("moe", __doc__, quick="tiny shapes, a few seconds", gpu="H200 profile: bf16, full token counts",
                     repeats="interleaved repetitions, median reported (default 3; gpu 10; quick 1)")
    p.add_argument("--tokens", type=positive_int, default=None,
                   help="tokens per layer call (default 256 CPU, 8192 GPU)")
    p.add_argument("--clock", choices=CLOCKS, default=None,
                   help="wall: perf_counter; cpu: this thread's CPU time, which leaves out the time other processes "
                        "held the core (CPU, 1 thread only; the default there)")
    p.add_argument("--batched-gib", type=positive_float, default=2.0,
                   help="skip the batched paths where their per-row weight copies would pass this many GiB")
    p.add_argument("--rank", type=positive_int, default=16, help="LoRA rank for the expert-LoRA comparison")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--lora-shapes", nargs="*", default=None, choices=list(SHAPES),
                   help="shapes for the LoRA comparison (default: all with --gpu/--quick, qwen3-30b-a3b on CPU: "
                        "PEFT's W + B·A of the GPT-OSS stack needs ~13 GB more in fp32)")
    p.add_argument("--no-4bit", dest="four_bit", action="store_false",
                   help="skip the 4-bit experts rows (fastkit NF4 vs 16-bit vs a per-expert Linear4bit loop)")
    p.add_argument("--threads", type=positive_int, default=1,
                   help="CPU threads (default 1: on a shared 2-core machine OpenMP spin-waits make tiny ops "
                        "take milliseconds and the medians meaningless)")
    args = parse_bench_args(p, argv)

    device = bench_device(args.gpu)
    budget = TimeBudget(args.budget_s)
    load = load_line()
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    clock_name = args.clock or ("cpu" if device.type == "cpu" and torch.get_num_threads() == 1 else "wall")
    clock = clock_for(clock_name, device)
    dtype = torch.bfloat16 if args.gpu else torch.float32
    tokens = args.tokens or (16 if args.quick else 8192 if args.gpu else 256)
    reps = args.repeats or (1 if args.quick else 10 if args.gpu else 3)
    rows, lora_rows, four_rows, notes = [], [], [], []
    machine = describe_device(device) + ("" if device.type == "cuda" else f", {torch.get_num_threads()} threads")
    clock_note = "times are this thread's CPU time" if clock_name == "cpu" else "wall-clock times"
    machine = f"{machine}, {str(dtype).replace('torch.', '')}, {clock_note}; {load}. Layer shapes: " + "; ".join(
        f"{n} hidden {sh['hidden_size']}, {sh.get('num_experts', sh.get('num_local_experts'))} experts "
        f"top-{sh['num_experts_per_tok']}, expert width {sh.get('moe_intermediate_size', sh.get('intermediate_size'))}"
        for n, sh in ((n, dict(SHAPES[n], **(QUICK[n] if args.quick else {}))) for n in args.shapes))
    lora_shapes = args.lora_shapes
    if lora_shapes is None:
        lora_shapes = list(SHAPES) if (args.gpu or args.quick) else ["qwen3-30b-a3b"]
    last = 0.0  # seconds the last part took: the next one's estimate
    with _quiet():
        shapes = {name: dict(SHAPES[name], **(QUICK[name] if args.quick else {})) for name in args.shapes}
        parts = [("routing", n) for n in shapes] + [("LoRA", n) for n in shapes if n in lora_shapes] + \
            [("4-bit", n) for n in shapes if args.four_bit]
        for part, name in parts:  # every routing table first: the LoRA comparison is the heavier part
            if not budget.allows(last) or (part == "LoRA" and not any(r["shape"] == name for r in rows)):
                budget.skip(f"{name} {part}")
                continue
            t0 = time.monotonic()
            if part == "routing":
                rows += bench_routing(name, shapes[name], tokens, reps, dtype, device, budget=budget,
                                      batched_gib=args.batched_gib, notes=notes, clock=clock)
            elif part == "4-bit":
                four_rows += bench_4bit(name, shapes[name], tokens, reps, dtype, device, clock)
            else:
                lora_rows += bench_lora(name, shapes[name], tokens, reps, args.rank, dtype, device, clock)
            last = time.monotonic() - t0
            note = " ".join(notes) + "\n" + budget.note()
            write_outputs("moe", _table(rows, lora_rows, machine, note, four_rows), out=args.out, quick=args.quick)
    write_outputs("moe", _table(rows, lora_rows, machine, " ".join(notes) + "\n" + budget.note(), four_rows),
                  (lambda: _plot(rows)) if rows else None, out=args.out, quick=args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
