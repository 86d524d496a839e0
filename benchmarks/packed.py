"""``python -m benchmarks packed``: packed-sequence training, unpatched transformers vs fastkit, side by side.

Same weights, one process, interleaved repetitions, medians and ratios. For each (layers, tokens):
forward, forward+backward (the SFT step's compute; activation checkpointing on, as TRL defaults),
host-device syncs per step, bytes of attention mask the layers receive. Also:

- attention alone (one layer's kernel, fwd+bwd): dense-mask SDPA vs one causal SDPA per document;
- a hybrid row (qwen3_5-shaped twin: 3 gated-DeltaNet layers per attention layer): fastkit on one packed
  row (state reset per document, :mod:`fastkit.patches.packing.state`) vs the best correct alternative a
  user has today, unpacked right-padded batches in plain transformers; plain transformers on the packed row
  is timed too but marked wrong (its DeltaNet state leaks across documents);
- the time model ``T_saved ≈ (L-1)·m``: ``m`` is the cost of deriving the document boundaries from
  ``position_ids`` once (measured alone). A "per-layer" variant re-derives them in every layer (what
  transformers' flash path does given only ``position_ids``); fastkit derives them once per batch
  (here from ``position_ids`` too, so exactly one derivation remains). Predicted saving per forward:
  ``(L-1)·m``; per checkpointed forward+backward: ``(2L-1)·m`` (the recompute re-derives too).

The model is a llama twin with realistic attention (heads × head_dim, GQA) and a small hidden size, built
directly on the device in its dtype; the table states the shape. On a GPU transformers' flash path
(``flash_attention_2`` given ``position_ids``) is measured too where ``flash_attn`` imports; the time
model is reported only there (on a CPU a boundary derivation costs no device sync: it is a GPU model).
Every time cell is ``median (min, spread)`` of interleaved repeats; ratios carry their per-repeat range.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from benchmarks.common import (
    TimeBudget,
    agg_pyplot,
    bench_device,
    bench_parser,
    fmt_ms,
    fmt_ratio,
    load_line,
    markdown_table,
    median,
    parse_bench_args,
    positive_int,
    run_cli,
    timed,
    write_outputs,
)
from fastkit.syncs import SyncCounter
from fastkit.units import fmt_bytes


@dataclass
class Shape:
    """The benchmark model's attention/MLP sizes (llama twin)."""

    heads: int = 8
    """Query heads."""
    kv_heads: int = 2
    """Key/value heads (GQA 4:1)."""
    head_dim: int = 64
    """Per-head dimension."""
    hidden: int = 128
    """Residual width: small so that the attention, not the MLP, dominates on a CPU."""
    intermediate: int = 256
    """MLP width."""

    def describe(self) -> str:
        return (f"llama twin, {self.heads} q heads × {self.head_dim}, {self.kv_heads} kv heads, hidden "
                f"{self.hidden}, MLP {self.intermediate}, vocab 320")


def _doc_lengths(tokens: int, mean_doc: int, seed: int = 0) -> list[int]:
    """Random document lengths (uniform in [mean/2, 3·mean/2]) that sum to ``tokens``."""
    g = torch.Generator().manual_seed(seed)
    out, left = [], tokens
    while left > 0:
        n = int(torch.randint(mean_doc // 2, mean_doc * 3 // 2 + 1, (1,), generator=g))
        out.append(min(n, left))
        left -= out[-1]
    return out


def _models(layers: int, shape: Shape, dtype: torch.dtype, device: torch.device, checkpointing: bool):
    import copy

    from fastkit._hf import set_attn_implementation
    from fastkit.families.twins import twin
    from fastkit.loader import FastModel

    with torch.device(device):  # built where it runs, in its dtype: no host-side init of big weights
        base = twin("llama", num_hidden_layers=layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
                    num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
                    intermediate_size=shape.intermediate, dtype=dtype).train()
    fast = copy.deepcopy(base)
    FastModel.patch(fast, patches=["packing"])
    per_layer = copy.deepcopy(base)
    set_attn_implementation(per_layer.config, _register_per_layer_key())
    flash, flash_na = None, _flash_unavailable(device)
    if flash_na is None:
        flash = copy.deepcopy(base)
        try:
            flash.set_attn_implementation("flash_attention_2")
        except Exception as exc:  # noqa: BLE001 - reported in the table
            flash, flash_na = None, f"{type(exc).__name__}: {str(exc)[:80]}"
    for m in (base, fast, per_layer, flash):
        if checkpointing and m is not None:
            m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return base, fast, per_layer, flash, flash_na


def _flash_unavailable(device: torch.device) -> str | None:
    """Why transformers' flash_attention_2 path cannot run here (None: it can)."""
    import importlib.util

    if device.type != "cuda":
        return "CPU run"
    if importlib.util.find_spec("flash_attn") is None:
        return "flash_attn does not import on this machine"
    return None


def _lengths_on_host(position_ids: torch.Tensor, rows: int, row_len: int) -> list[list[int]]:
    """Document lengths from device ``position_ids``: one host copy (the sync being measured), then numpy."""
    from fastkit.patches.packing.patch import lengths_from_positions

    host = position_ids.expand(rows, row_len).cpu().numpy()  # (rows, row_len)
    return lengths_from_positions(host) or [[row_len]] * rows


def _register_per_layer_key() -> str:
    """An attention key that re-derives the packed metadata from ``position_ids`` in every layer call."""
    from transformers.modeling_utils import AttentionInterface

    from fastkit.patches.packing import PackedBatch, packed_attention

    key = "fastkit_bench_per_layer"

    def per_layer(module, q, k, v, attention_mask, dropout=0.0, scaling=None, **kwargs):
        pos = kwargs["position_ids"]
        lengths = _lengths_on_host(pos, q.shape[0], q.shape[2])  # one sync, every layer
        meta = PackedBatch(q.shape[0], q.shape[2], lengths, max(max(r) for r in lengths))
        return packed_attention(q, k, v, meta, scaling=scaling, dropout=dropout), None

    AttentionInterface.register(key, per_layer)  # no mask entry: the model builds no mask for this key
    return key


def _timed(fn: Callable[[], None], device: torch.device) -> float:
    """Milliseconds ``fn`` takes (garbage collected first so a collection does not land inside)."""
    gc.collect()
    return timed(fn, device) * 1e3


def _mask_bytes(model, batch: dict) -> int:
    """Largest attention mask any layer receives in one forward (pre-hooks on the attention modules)."""
    seen = [0]

    def hook(_module, args, kwargs):
        mask = kwargs.get("attention_mask", args[2] if len(args) > 2 else None)
        if isinstance(mask, torch.Tensor):
            seen[0] = max(seen[0], mask.numel() * mask.element_size())

    handles = [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True) for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        for h in handles:
            h.remove()
    return seen[0]


def _batches(tokens: int, mean_doc: int, device: torch.device):
    from fastkit.patches.packing.patch import LENGTHS_KWARG

    lengths = _doc_lengths(tokens, mean_doc)
    ids = torch.randint(3, 300, (1, tokens), device=device)
    pos = torch.cat([torch.arange(n) for n in lengths])[None].to(device)  # (1, T)
    plain = dict(input_ids=ids, position_ids=pos, labels=ids, use_cache=False)
    return lengths, plain, {**plain, LENGTHS_KWARG: [lengths]}


def _measure_config(layers, tokens, args, shape, dtype, device, rows, model_rows, budget: TimeBudget):
    base, fast, per_layer, flash, flash_na = _models(layers, shape, dtype, device, not args.no_checkpointing)
    lengths, plain, with_lengths = _batches(tokens, args.mean_doc, device)
    paths = {"transformers": (base, plain), "transformers flash_attention_2": (flash, plain),
             "fastkit": (fast, with_lengths), "fastkit (positions only)": (fast, plain),
             "per-layer metadata": (per_layer, plain)}
    if flash is None:
        paths.pop("transformers flash_attention_2")
    if device.type != "cuda":  # only the GPU time model needs it
        paths.pop("fastkit (positions only)")
    times: dict[str, dict[str, list[float]]] = {p: {"fwd": [], "step": []} for p in paths}

    def fwd(model, batch):
        model(**batch)

    def step(model, batch):
        model(**batch).loss.backward()
        model.zero_grad(set_to_none=True)

    if not args.quick:
        for model, batch in paths.values():  # warm-up (allocator, first-call imports)
            step(model, batch)
    for rep in range(args.reps):
        if rep >= 2 and not budget.allows():
            budget.skip(f"repeats {rep + 1}..{args.reps} of L={layers} T={tokens}")
            break
        for p, (model, batch) in paths.items():  # interleaved: every path sees the same machine state
            times[p]["fwd"].append(_timed(lambda m=model, b=batch: fwd(m, b), device))
            times[p]["step"].append(_timed(lambda m=model, b=batch: step(m, b), device))
    for p, (model, batch) in paths.items():
        with SyncCounter() as sc:
            step(model, batch)
        rows.append(dict(layers=layers, tokens=tokens, docs=len(lengths), path=p, fwd=times[p]["fwd"],
                         step=times[p]["step"], syncs=sc.total, mask=_mask_bytes(model, batch)))
    if flash_na is not None and device.type == "cuda":
        rows.append(dict(layers=layers, tokens=tokens, docs=len(lengths), path="transformers flash_attention_2",
                         na=f"n/a ({flash_na}); 'per-layer metadata' re-derives cu_seqlens in every layer as it "
                         "does"))
    if "fastkit (positions only)" in paths:
        m = _metadata_cost(plain["position_ids"], device, args.reps * 5)
        ck = 1 if args.no_checkpointing else 2
        saved = {k: [a - b for a, b in zip(times["per-layer metadata"][k], times["fastkit (positions only)"][k])]
                 for k in ("fwd", "step")}
        model_rows.append(dict(layers=layers, tokens=tokens, m=m, pred_fwd=(layers - 1) * m, meas_fwd=saved["fwd"],
                               pred_step=(ck * layers - 1) * m, meas_step=saved["step"]))
    del base, fast, per_layer, flash
    gc.collect()


def _metadata_cost(position_ids: torch.Tensor, device: torch.device, reps: int) -> float:
    """m: one derivation of the document boundaries from device position_ids (incl. its sync)."""
    from fastkit.patches.packing import PackedBatch

    def once():
        lengths = _lengths_on_host(position_ids, 1, position_ids.shape[1])
        PackedBatch(1, position_ids.shape[1], lengths, max(lengths[0]))

    once()
    return statistics.median(_timed(once, device) for _ in range(reps))


def _attention_alone(tokens: int, args, shape: Shape, dtype, device) -> dict:
    """One layer's attention fwd+bwd: the dense packed mask transformers builds vs one SDPA per document."""
    import torch.nn.functional as F

    from fastkit.patches.packing.attention import PackedBatch, packed_attention

    lengths = _doc_lengths(tokens, args.mean_doc)
    meta = PackedBatch(1, tokens, [lengths], max(lengths))
    q = torch.randn(1, shape.heads, tokens, shape.head_dim, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(1, shape.kv_heads, tokens, shape.head_dim, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(1, shape.kv_heads, tokens, shape.head_dim, device=device, dtype=dtype, requires_grad=True)
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).to(device)
    idx = torch.arange(tokens, device=device)

    def dense():
        mask = (doc[:, None] == doc[None, :]) & (idx[:, None] >= idx[None, :])  # (T, T) as transformers builds it
        kr, vr = k.repeat_interleave(q.shape[1] // k.shape[1], 1), v.repeat_interleave(q.shape[1] // k.shape[1], 1)
        F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask[None, None]).sum().backward()

    def per_doc():
        packed_attention(q, k, v, meta, scaling=None).sum().backward()

    dense(), per_doc()
    t = {"dense": [], "per_doc": []}
    for _ in range(max(args.reps, 3)):
        t["dense"].append(_timed(dense, device))
        t["per_doc"].append(_timed(per_doc, device))
    return dict(tokens=tokens, docs=len(lengths), dense=t["dense"], per_doc=t["per_doc"], mask=tokens * tokens)


HYBRID_CPU = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256,
                  linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32)
HYBRID_GPU = dict(hidden_size=1024, num_attention_heads=16, num_key_value_heads=2, head_dim=128,
                  intermediate_size=2048, linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=128,
                  linear_value_head_dim=128)


def _hybrid_batches(lengths: list[int], device: torch.device) -> tuple[dict, dict]:
    """The same documents as one packed row (labels -100 at each start, as TRL) and as a right-padded batch."""
    from fastkit.patches.packing import LENGTHS_KWARG

    docs = [torch.randint(3, 300, (n,)) for n in lengths]
    ids = torch.cat(docs)[None]  # (1, T)
    labels = ids.clone()
    labels[0, torch.tensor([0] + torch.tensor(lengths).cumsum(0)[:-1].tolist())] = -100
    pos = torch.cat([torch.arange(n) for n in lengths])[None]  # (1, T)
    packed = dict(input_ids=ids, position_ids=pos, labels=labels, use_cache=False, **{LENGTHS_KWARG: [lengths]})
    width = max(lengths)
    padded_ids = torch.zeros(len(docs), width, dtype=torch.long)  # (D, Lmax), right-padded
    mask = torch.zeros(len(docs), width, dtype=torch.long)
    for i, d in enumerate(docs):
        padded_ids[i, :len(d)], mask[i, :len(d)] = d, 1
    padded = dict(input_ids=padded_ids, attention_mask=mask, labels=padded_ids.masked_fill(mask == 0, -100),
                  use_cache=False)
    move = lambda b: {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in b.items()}  # noqa: E731
    return move(packed), move(padded)


def _hybrid(tokens: int, args, dtype, device, gpu: bool) -> list[dict]:
    """qwen3_5-shaped twin: fastkit packed vs plain transformers on padded batches (and packed, wrong)."""
    import copy

    from fastkit.families.twins import twin
    from fastkit.loader import FastModel

    shape = HYBRID_GPU if gpu else HYBRID_CPU
    with torch.device(device):
        base = twin("qwen3_5_text", num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
                    dtype=dtype, **shape).train()
    fast = copy.deepcopy(base)
    FastModel.patch(fast, patches=["packing"])
    if not args.no_checkpointing:
        for m in (base, fast):
            m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    lengths = _doc_lengths(tokens, args.mean_doc)
    packed, padded = _hybrid_batches(lengths, device)
    paths = {"transformers, padded batches": (base, padded), "fastkit, packed": (fast, packed),
             "transformers, packed (WRONG: state leaks)": (base, {k: v for k, v in packed.items()
                                                                  if not k.startswith("fastkit")})}

    def step(model, batch):
        model(**batch).loss.backward()
        model.zero_grad(set_to_none=True)

    losses = {p: model(**batch).loss.item() for p, (model, batch) in paths.items()}
    for model, batch in paths.values():  # warm-up: first calls (allocator, lazy imports) off the clock
        step(model, batch)
    times: dict[str, list[float]] = {p: [] for p in paths}
    cpu: dict[str, list[float]] = {p: [] for p in paths}  # this process's CPU ms: robust to other processes' load
    for _ in range(max(args.reps, 3)):  # at least 3 interleaved repeats: the row is small
        for p, (model, batch) in paths.items():
            c0 = time.process_time()
            times[p].append(_timed(lambda m=model, b=batch: step(m, b), device))
            cpu[p].append((time.process_time() - c0) * 1e3)
    rows = []
    for p, (model, batch) in paths.items():
        with SyncCounter() as sc:
            step(model, batch)
        rows.append(dict(tokens=tokens, docs=len(lengths), path=p, step=times[p], cpu=cpu[p], syncs=sc.total,
                         slots=batch["input_ids"].numel(), loss=losses[p]))
    return rows


def _render_hybrid(rows: list[dict], gpu: bool) -> list[str]:
    shape = HYBRID_GPU if gpu else HYBRID_CPU
    ref = next(r for r in rows if r["path"].endswith("padded batches"))
    cells = [[r["tokens"], r["docs"], r["path"], fmt_ms(r["step"], 0),
              "1 (reference)" if r is ref else fmt_ratio(ref["step"], r["step"]), fmt_ms(r["cpu"], 0),
              "1 (reference)" if r is ref else fmt_ratio(ref["cpu"], r["cpu"]), r["syncs"], r["slots"],
              f"{r['loss']:.5f}"] for r in rows]
    return [f"Hybrid (qwen3_5 twin, 4 layers: 3 gated DeltaNet + 1 attention, hidden {shape['hidden_size']}, "
            f"{shape['linear_num_value_heads']} value heads × {shape['linear_value_head_dim']}), fwd+bwd per step; "
            "'padded batches' is the best correct alternative without fastkit (one document per row). The loss "
            "column is the same documents' mean loss: equal for the two correct paths. 'process CPU ms' is this "
            "process's CPU time per step (on a shared CPU it is far less noisy than wall time; on a GPU it is host "
            "time only).", "",
            markdown_table(["tokens", "docs", "path", "fwd+bwd ms", "speed-up vs padded [range]",
                            "process CPU ms", "CPU ratio vs padded [range]", "syncs/step", "token slots", "loss"],
                           cells, align="rrlrrrrrrr")]


def _mib(n: int) -> str:
    return fmt_bytes(n, "MiB")


def _diff(xs: list[float]) -> str:
    """A measured saving (ms) with the range of its per-repeat values."""
    return f"{median(xs):.1f} [{min(xs):.1f} to {max(xs):.1f}]" if len(xs) > 1 else f"{median(xs):.1f} (1 rep)"


def render(rows, model_rows, attn_rows, header: str, device: torch.device, note: str = "",
           hybrid_rows: list[dict] | None = None) -> str:
    base = {(r["layers"], r["tokens"]): r for r in rows if r["path"] == "transformers"}
    cells = []
    for r in rows:
        if "na" in r:
            cells.append([r["layers"], r["tokens"], r["docs"], r["path"], r["na"], "-", "-", "-", "-"])
            continue
        ref = base[(r["layers"], r["tokens"])]["step"]
        cells.append([r["layers"], r["tokens"], r["docs"], r["path"], fmt_ms(r["fwd"], 0), fmt_ms(r["step"], 0),
                      "1 (reference)" if r["path"] == "transformers" else fmt_ratio(ref, r["step"]), r["syncs"],
                      _mib(r["mask"])])
    out = [header, "", markdown_table(
        ["layers", "tokens", "docs", "path", "forward ms", "fwd+bwd ms", "speed-up vs transformers [range]",
         "syncs/step", "mask bytes"], cells, align="rrrlrrrrr")]
    if attn_rows:
        out += ["Attention alone (one layer, fwd+bwd):", "", markdown_table(
            ["tokens", "docs", "dense-mask SDPA ms", "per-document SDPA ms", "speed-up [range]", "mask bytes avoided"],
            [[a["tokens"], a["docs"], fmt_ms(a["dense"]), fmt_ms(a["per_doc"]), fmt_ratio(a["dense"], a["per_doc"]),
              _mib(a["mask"])] for a in attn_rows], align="rrrrrr")]
    if device.type != "cuda":
        out += ["Time model T_saved ≈ (L−1)·m: a GPU model; not meaningful on CPU (deriving the boundaries costs "
                "no device sync here, so the predicted saving is far below this machine's run-to-run noise). "
                "`--gpu` measures it.", ""]
    elif model_rows:
        out += ["Time model T_saved ≈ (L−1)·m (forward) and (2L−1)·m (checkpointed fwd+bwd); m = one boundary "
                "derivation from position_ids; measured saving = per-layer metadata − fastkit (positions only), "
                "median [range] over interleaved repeats:", "", markdown_table(
                    ["layers", "tokens", "m ms", "predicted fwd saved ms", "measured fwd saved ms",
                     "predicted fwd+bwd saved ms", "measured fwd+bwd saved ms"],
                    [[t["layers"], t["tokens"], f"{t['m']:.2f}", f"{t['pred_fwd']:.1f}", _diff(t["meas_fwd"]),
                      f"{t['pred_step']:.1f}", _diff(t["meas_step"])] for t in model_rows], align="rrrrrrr")]
    if hybrid_rows:
        out += _render_hybrid(hybrid_rows, device.type == "cuda")
    if note:
        out.append(note)
    return "\n".join(out)


def plot(rows, attn_rows):
    """Step compute per configuration (left) and attention alone against tokens (right)."""
    plt = agg_pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    rows = [r for r in rows if "na" not in r]
    keys = sorted({(r["layers"], r["tokens"]) for r in rows})
    labels = [f"L={layers}\nT={tokens}" for layers, tokens in keys]
    for i, p in enumerate(["transformers", "fastkit"]):
        vals = [median(next(r["step"] for r in rows if (r["layers"], r["tokens"]) == k and r["path"] == p))
                for k in keys]
        axes[0].bar([x + 0.4 * i for x in range(len(keys))], vals, width=0.4, label=p)
    axes[0].set_xticks([x + 0.2 for x in range(len(keys))], labels)
    axes[0].set_ylabel("fwd+bwd ms (median)")
    axes[0].set_yscale("log")
    axes[0].legend()
    axes[0].set_title("Packed SFT step compute")
    if attn_rows:
        xs = [a["tokens"] for a in attn_rows]
        axes[1].plot(xs, [median(a["dense"]) for a in attn_rows], "o-", label="dense-mask SDPA")
        axes[1].plot(xs, [median(a["per_doc"]) for a in attn_rows], "o-", label="per-document SDPA")
        axes[1].set_xscale("log", base=2)
        axes[1].set_yscale("log")
        axes[1].set_xlabel("tokens")
        axes[1].set_ylabel("one layer fwd+bwd ms")
        axes[1].legend()
        axes[1].set_title("Attention alone")
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("packed", __doc__, quick="2 layers, 128 tokens, 1 repetition",
                          gpu="bf16, 32 q heads × 128, 8 kv heads, hidden 1024, 8 layers, 2k/8k/16k tokens",
                          repeats="interleaved repetitions (default 3; gpu 5)")
    parser.add_argument("--layers", type=positive_int, nargs="+", default=None,
                        help="decoder layers (default 4; gpu 8)")
    parser.add_argument("--tokens", type=positive_int, nargs="+", default=None,
                        help="tokens per packed row (default 1024 2048; gpu 2048 8192 16384)")
    parser.add_argument("--mean-doc", type=positive_int, default=256, help="mean document length in tokens")
    parser.add_argument("--no-checkpointing", action="store_true", help="measure without activation checkpointing")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch CPU threads (1 keeps a shared CPU's timings stable; default: torch's)")
    args = parse_bench_args(parser, argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    device = bench_device(args.gpu)
    budget = TimeBudget(args.budget_s)
    load = load_line()
    dtype = torch.bfloat16 if args.gpu else torch.float32
    shape = Shape(heads=32, kv_heads=8, head_dim=128, hidden=1024, intermediate=2048) if args.gpu else Shape()
    if args.quick:
        layers, tokens, reps, args.mean_doc = [2], [128], 1, 24
    else:
        layers = args.layers or ([8] if args.gpu else [4])
        tokens = args.tokens or ([2048, 8192, 16384] if args.gpu else [1024, 2048])
        reps = args.repeats or (5 if args.gpu else 3)
    args.reps = reps
    torch.manual_seed(0)

    from fastkit.device import describe_device

    header = (f"Packed-sequence benchmark on {describe_device(device)}, torch {torch.__version__}, {str(dtype)[6:]}; "
              f"{load}, {torch.get_num_threads()} torch threads. {shape.describe()};"
              f" documents of ~{args.mean_doc} tokens (uniform ±50%), one packed row; "
              f"activation checkpointing {'off' if args.no_checkpointing else 'on'}; {reps} interleaved repetitions, "
              "each time cell median (min, spread = (max−min)/median). 'transformers' is its sdpa path with the dense "
              "(B,1,T,T) packed mask; 'fastkit' gets host lengths (wrap_collator); 'positions only' derives them "
              "once from position_ids; 'per-layer metadata' re-derives them in every layer"
              + (" (transformers' flash_attention_2 path needs CUDA: not run here)." if device.type != "cuda" else "."))
    rows, model_rows, attn_rows, hybrid_rows = [], [], [], []

    def write(figure=None):
        md = render(rows, model_rows, attn_rows, header, device, budget.note(), hybrid_rows)
        return write_outputs("packed", md, figure, out=args.out, quick=args.quick)

    last = None  # (seconds, layers, tokens) of the last configuration: the next one's estimate
    for n_layers in layers:
        for t in tokens:
            if not budget.allows(0 if last is None else last[0] * (t / last[2]) ** 1.5 * n_layers / last[1]):
                budget.skip(f"L={n_layers} T={t}")
                continue
            t0 = time.monotonic()
            if n_layers == layers[0]:
                attn_rows.append(_attention_alone(t, args, shape, dtype, device))
            _measure_config(n_layers, t, args, shape, dtype, device, rows, model_rows, budget)
            last = (time.monotonic() - t0, n_layers, t)
            write()  # the table so far: a run capped from outside still leaves it
    if budget.allows():
        hybrid_rows.extend(_hybrid(tokens[0], args, dtype, device, args.gpu))
    else:
        budget.skip("hybrid row")
    write(lambda: plot(rows, attn_rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
