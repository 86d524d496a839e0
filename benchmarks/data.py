"""``python -m benchmarks data``: reading and preparing a chat dataset, plain datasets + TRL vs fastkit.

Plain: ``datasets.load_dataset("json")`` and ``trl.SFTTrainer(packing=True)`` with TRL's defaults. fastkit:
:func:`fastkit.data.load_chat_dataset` (every row checked) and :func:`fastkit.training.make_trainer` (rows
measured, tokenized once, packed). The same file of multi-turn chats (a system prompt, 1-3 assistant turns),
the same twin model and tokenizer, one torch thread, ``max_length`` 2048, packing on. Each variant runs in its
own process with its own empty ``datasets`` cache, so its peak RSS is its own (the workers' peak is reported
beside it) and nothing is read from an earlier run's cache. Reported: seconds to read, seconds from read to a
built trainer, peak RSS, and the rows and tokens in the trainer's packed dataset (the rows trained).
``fastkit-stream`` streams the same file (``load_chat_dataset(..., streaming=True)``); a stream prepares its rows
as they are drawn, so its preparing time includes one whole pass over its packed rows.
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import (
    bench_command,
    bench_parser,
    machine_line,
    markdown_table,
    parse_bench_args,
    positive_int,
    readable_file,
    write_outputs,
)

VARIANTS = ("plain", "plain-assistant", "fastkit", "fastkit-stream")
# The twin's ChatML template with TRL's {% generation %} markers around each assistant answer and its end of turn:
# what a user of plain TRL writes to train the assistant turns only (SFTConfig(assistant_only_loss=True)), so
# plain-assistant trains exactly the tokens fastkit trains (tests/test_bench_data.py checks that row by row).
ASSISTANT_ONLY_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>\n' }}{% endgeneration %}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
WORDS = ("alpha", "beta", "gamma", "delta", "pack", "row", "token", "layer", "sync", "grad", "mask", "doc", "data",
         "arrow", "table", "batch")


def chat_rows(n: int, seed: int = 0):
    """``n`` chats: a system prompt, then 1-3 (user, assistant) exchanges of 5-50 words each."""
    rng = random.Random(seed)

    def words(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k))

    for _ in range(n):
        messages = [{"role": "system", "content": "You are a helpful assistant. " + words(8)}]
        for _ in range(rng.randint(1, 3)):
            messages += [{"role": "user", "content": words(rng.randint(5, 25))},
                         {"role": "assistant", "content": words(rng.randint(10, 50))}]
        yield {"messages": messages}


def write_file(path: Path, n: int) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for row in chat_rows(n):
            f.write(json.dumps(row) + "\n")
    return path


def _peak_mib() -> tuple[float, float]:
    """(this process's, its finished children's) peak RSS in MiB (Linux reports KiB)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return own, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def _tree_pss_mib(pid: int) -> tuple[float, float]:
    """(PSS, anonymous PSS) of ``pid`` and all its descendants in MiB. PSS counts a page shared between processes
    (forked workers) once, split between them: the sum is the memory the machine spends. Anonymous: the heap and
    stacks, which only exiting frees (the rest is file pages such as memory-mapped Arrow caches, which the kernel
    drops under pressure). (0, 0) where /proc cannot say."""
    total = anon = 0
    stack = [pid]
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1])
                    elif line.startswith("Pss_Anon:"):
                        anon += int(line.split()[1])
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    stack += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            continue
    return total / 1024, anon / 1024


class PssSampler:
    """The peaks of :func:`_tree_pss_mib` over this process's tree, sampled every ``every`` seconds on a thread."""

    def __init__(self, every: float = 0.05):
        import threading

        self.peak = self.peak_anon = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every,), daemon=True)
        self._thread.start()

    def _run(self, every: float) -> None:
        while not self._stop.is_set():
            total, anon = _tree_pss_mib(os.getpid())
            self.peak, self.peak_anon = max(self.peak, total), max(self.peak_anon, anon)
            self._stop.wait(every)

    def stop(self) -> tuple[float, float]:
        self._stop.set()
        self._thread.join()
        return self.peak, self.peak_anon


def _trained(trainer) -> tuple[int, int]:
    """(packed rows, tokens with a label) of the trainer's training dataset, read from its Arrow columns (a stream:
    drawn row by row, which is where a stream does its checking and tokenizing)."""
    ds = trainer.train_dataset
    if getattr(ds, "num_rows", None) is None:  # an IterableDataset
        rows = tokens = 0
        for row in ds:
            rows += 1
            tokens += sum(1 for x in row["labels"] if x != -100)
        return rows, tokens
    import pyarrow.compute as pc

    tokens = 0
    for batch in ds.select_columns(["labels"]).with_format("arrow").iter(batch_size=4096):
        tokens += pc.sum(pc.not_equal(pc.list_flatten(batch["labels"]), -100)).as_py() or 0
    return len(ds), tokens


def plain_dataset(file: str):
    from datasets import load_dataset

    return load_dataset("json", data_files=file, split="train")


def plain_trainer(model, tokenizer, dataset, out_dir: str, assistant_only: bool, packing: bool = True):
    """TRL's SFTTrainer as its docs set it up: TRL's defaults, or assistant turns only (``assistant_only_loss``
    with a template that marks them)."""
    from trl import SFTConfig, SFTTrainer

    if assistant_only:
        tokenizer.chat_template = ASSISTANT_ONLY_TEMPLATE
    config = SFTConfig(output_dir=out_dir, max_steps=1, max_length=2048, packing=packing, report_to=[],
                       save_strategy="no", use_cpu=True, disable_tqdm=True, assistant_only_loss=assistant_only)
    return SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer)


def run_variant(variant: str, file: str, out_dir: str) -> dict:
    """One variant, in this process: read the file, build the trainer; the figures as a dict."""
    import torch

    torch.set_num_threads(1)
    from fastkit.families.twins import twin, twin_tokenizer

    model, tokenizer = twin("llama", seed=0), twin_tokenizer()
    sampler = PssSampler()
    start = time.perf_counter()
    if variant.startswith("plain"):
        dataset = plain_dataset(file)
        read = time.perf_counter()
        trainer = plain_trainer(model, tokenizer, dataset, out_dir, assistant_only=variant == "plain-assistant")
    else:
        from fastkit import FastModel
        from fastkit.data import load_chat_dataset
        from fastkit.training import make_trainer

        FastModel.patch(model, max_seq_length=2048)  # packing needs fastkit's per-document attention
        stream = variant == "fastkit-stream"
        dataset = load_chat_dataset(file, streaming=stream)
        read = time.perf_counter()
        trainer = make_trainer(model, tokenizer, dataset, max_steps=1, max_seq_length=2048, output_dir=out_dir,
                               dashboard="none")
    if variant == "fastkit-stream":  # its work happens as rows are drawn: one whole pass is its preparing
        rows, tokens = _trained(trainer)
    built = time.perf_counter()
    own, children = _peak_mib()
    tree_pss, tree_anon = sampler.stop()
    if variant != "fastkit-stream":
        rows, tokens = _trained(trainer)
    rows_in = getattr(dataset, "num_rows", None) or sum(1 for _ in open(file, encoding="utf-8"))
    return {"variant": variant, "read_s": read - start, "prepare_s": built - read, "total_s": built - start,
            "peak_mib": own, "workers_peak_mib": children,
            "tree_pss_mib": tree_pss, "tree_anon_mib": tree_anon, "rows_in": rows_in, "packed_rows": rows,
            "trained_tokens": tokens, "num_proc": trainer.args.dataset_num_proc}


def _child(variant: str, file: str, tmp: str) -> dict:
    """``run_variant`` in a fresh process with its own empty datasets cache."""
    cache = tempfile.mkdtemp(dir=tmp, prefix=f"cache-{variant}-")
    env = {**os.environ, "HF_DATASETS_CACHE": cache, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    code = ("import json, sys; from benchmarks.data import run_variant; "
            "print('RESULT ' + json.dumps(run_variant(sys.argv[1], sys.argv[2], sys.argv[3])))")
    out = subprocess.run([sys.executable, "-c", code, variant, file, tempfile.mkdtemp(dir=tmp)], env=env,
                         capture_output=True, text=True, cwd=str(Path(__file__).resolve().parent.parent))
    shutil.rmtree(cache, ignore_errors=True)  # a million rows' caches take gigabytes: one variant's at a time
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if out.returncode or line is None:
        raise RuntimeError(f"{variant} failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(line.removeprefix("RESULT "))


# From here on the TRL-defaults row is left out: it trains other tokens (plain-assistant is like for like).
BIG = 500_000


def ratios(results: list[dict]) -> list[str]:
    """One line per row count: fastkit's time and memory over plain-assistant's (the same tokens trained), and each
    variant's seconds per 1,000 rows (a cost linear in rows keeps that figure flat down the table)."""
    lines = []
    for n in sorted({r["rows_in"] for r in results}):
        at = {r["variant"]: r for r in results if r["rows_in"] == n}
        per = ", ".join(f"{v} {r['total_s'] / n * 1000:.2f} s" for v, r in at.items())
        line = f"- {n:,} rows: per 1,000 rows {per}"
        base, ours = at.get("plain-assistant"), at.get("fastkit")
        if base and ours:
            line += (f"; fastkit / plain-assistant: time {ours['total_s'] / base['total_s']:.2f}x, "
                     f"peak PSS {ours['tree_pss_mib'] / base['tree_pss_mib']:.2f}x, "
                     f"peak RSS {ours['peak_mib'] / base['peak_mib']:.2f}x")
        lines.append(line)
    return lines


def table(results: list[dict], machine: str) -> str:
    """The markdown table: one line per (rows, variant) (one run each: figures, no ratios without a spread)."""
    lines = []
    for r in results:
        lines.append([f"{r['rows_in']:,}", r["variant"], f"{r['read_s']:.1f}", f"{r['prepare_s']:.1f}",
                      f"{r['total_s']:.1f}", f"{r['peak_mib']:,.0f}", f"{r['workers_peak_mib']:,.0f}",
                      f"{r.get('tree_pss_mib', 0):,.0f}", f"{r.get('tree_anon_mib', 0):,.0f}",
                      f"{r['num_proc'] or 1}", f"{r['packed_rows']:,}", f"{r['trained_tokens']:,}"])
    head = ["rows", "variant", "read s", "read -> trainer s", "total s", "peak RSS MiB", "workers' peak RSS MiB",
            "all processes' peak PSS MiB", "of it anonymous MiB", "processes", "packed rows", "tokens with a label"]
    return (f"# Data front door: plain datasets + TRL vs fastkit\n\n{machine}\n\n"
            + markdown_table(head, lines, "rlrrrrrrrrrr") + "\n\n" + "\n".join(ratios(results)) + "\n\n"
            "Multi-turn chats (system prompt, 1-3 assistant turns), twin llama + ChatML tokenizer, one torch "
            "thread, max_length 2048, packing on; each variant in its own process with an empty datasets cache. "
            "plain: TRL's defaults, which train every token of a `messages` row; plain-assistant: "
            "`assistant_only_loss=True` with the twin's template marked by `{% generation %}`, which trains the "
            "tokens fastkit trains (the assistant turns and their end of turn; equal row by row, "
            "tests/test_bench_data.py; from 500,000 rows on, the TRL-defaults row is left out). "
            "fastkit-stream: `load_chat_dataset(..., streaming=True)`, "
            "rows read, checked and tokenized as the trainer draws them; its read -> trainer time includes one "
            "whole pass over its packed rows (the work a table does before training, a stream does while "
            "training). Peak RSS counts pages a forked worker shares with its "
            "parent in both; the PSS column (sampled every 50 ms over the process and its workers) counts each "
            "page once: it is the memory the machine spends. Anonymous: the part only exiting frees (heap, "
            "stacks); the rest is file pages, mostly the memory-mapped Arrow caches, which the kernel drops under "
            "pressure and which grow with the rows for every variant.\n")


def _earlier(parser, path: Path) -> list[dict]:
    """``--with-results``: the JSON lines an earlier run printed (its other lines skipped); a usage error (exit 2)
    naming the line when one is not a result of this bench."""
    out = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        parser.error(f"--with-results {path}: cannot read it ({exc})")
    for i, line in enumerate(lines, 1):
        if not line.startswith("{"):
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            parser.error(f"--with-results {path}: line {i} is not valid JSON ({exc.msg})")
        if not isinstance(row, dict) or not {"variant", "rows_in"} <= set(row):
            parser.error(f"--with-results {path}: line {i} is not a result of this bench (no 'variant' / 'rows_in')")
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("data", __doc__, quick="2,000 rows", gpu="(CPU only: no GPU part)",
                          repeats="(one run per variant)")
    parser.add_argument("--rows", type=positive_int, nargs="+", default=[20_000], help="row counts to measure")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS),
                        help="which variants to run (default: all)")
    parser.add_argument("--with-results", type=readable_file, default=None, metavar="FILE.jsonl",
                        help="results of an earlier run (the JSON lines it printed) to put in the same table")
    args = parse_bench_args(parser, argv)
    counts = [2_000] if args.quick else args.rows
    made_by = bench_command("data")
    results = [] if args.with_results is None else _earlier(parser, args.with_results)
    with tempfile.TemporaryDirectory(prefix="fastkit-bench-data-") as tmp:
        for n in counts:
            file = str(write_file(Path(tmp) / f"chats-{n}.jsonl", n))
            for variant in args.variants:
                if n >= BIG and variant == "plain":
                    continue
                results.append({**_child(variant, file, tmp), "made_by": made_by})
                print(json.dumps(results[-1]), flush=True)  # --with-results reads these lines back
    import torch

    earlier = dict.fromkeys(f"{r['made_by']} > {args.with_results}" for r in results if r.get("made_by") not in
                            (None, made_by))  # how --with-results' file was made: the table's provenance says it
    write_outputs("data", table(results, machine_line(torch.device("cpu"))), out=args.out, quick=args.quick,
                  earlier=list(earlier))
    return 0
