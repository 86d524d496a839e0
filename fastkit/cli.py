"""``fastkit`` command line: ``fastkit quickstart``, ``fastkit plan MODEL``,
``fastkit bench {packed,offload,moe,sft} ...`` (from a clone: the benchmarks live in the repository's
``benchmarks/`` folder, outside the wheel; ``python -m benchmarks ...`` is the same).

``python -m fastkit ...`` is the same command.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from pathlib import Path

BENCHES = ("packed", "offload", "moe", "sft")


def _positive_int(text: str) -> int:
    """argparse type: a positive integer (``--steps -1`` is refused here, naming the option)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _quickstart(args: argparse.Namespace) -> int:
    from fastkit.quickstart import QuickstartConfig, run

    config = QuickstartConfig(max_steps=args.steps, max_seq_length=args.max_seq_length, twin=args.twin,
                              output_dir=args.output_dir)
    run(config)
    return 0


def _plan(args: argparse.Namespace) -> int:
    from fastkit.errors import FastkitError
    from fastkit.plan import plan

    try:
        gpu = float(args.gpu) if args.gpu.replace(".", "", 1).isdigit() else args.gpu
        result = plan(args.model, gpu=gpu, max_seq_length=args.max_seq_length, batch_size=args.batch_size, r=args.r,
                      load_in_4bit=args.load_in_4bit, offload=args.offload, expert_lora=args.expert_lora)
    except FastkitError as exc:
        print(f"fastkit plan: {exc}", file=sys.stderr)
        return 2
    print(result.table())
    return 0 if result.fits else 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="fastkit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    qs = sub.add_parser("quickstart", help="LoRA-tune SmolLM2-135M-Instruct offline and show before/after answers")
    qs.add_argument("--steps", type=_positive_int, default=20, help="optimizer steps (default 20)")
    qs.add_argument("--max-seq-length", type=_positive_int, default=256, help="tokens per packed row (default 256)")
    qs.add_argument("--output-dir", default="outputs/quickstart")
    qs.add_argument("--twin", action="store_true", help="tiny random twin instead of the real weights (smoke test)")
    pl = sub.add_parser("plan", help="predict a LoRA/QLoRA run's GPU memory from the model's config alone")
    pl.add_argument("model", help="local folder, config.json, or Hub id (only its config.json is read)")
    pl.add_argument("--gpu", default="t4", help="t4, l4, a100-40, rtx-8g, rtx-16g, spark, or GiB (default t4)")
    pl.add_argument("--max-seq-length", type=_positive_int, default=2048, help="tokens per row (default 2048)")
    pl.add_argument("--batch-size", type=_positive_int, default=1, help="rows per micro-batch (default 1)")
    pl.add_argument("--r", type=_positive_int, default=16, help="LoRA rank (default 16)")
    pl.add_argument("--4bit", dest="load_in_4bit", action="store_true", help="QLoRA: NF4 base weights")
    pl.add_argument("--offload", action="store_true", help="fastkit's checkpoint offload")
    pl.add_argument("--no-expert-lora", dest="expert_lora", action="store_false",
                    help="4-bit MoE: LoRA on the linear layers only (default: the experts too, as get_peft_model)")
    bench = sub.add_parser("bench", help="side-by-side benchmarks: " + ", ".join(BENCHES))
    bench.add_argument("name", choices=BENCHES)
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the benchmark (see --help of each)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.command == "quickstart":
        return _quickstart(args)
    if args.command == "plan":
        return _plan(args)
    return _bench(args)


def _bench(args: argparse.Namespace) -> int:
    """Run ``benchmarks/<name>.py`` of the clone this fastkit comes from (or the working directory's)."""
    clone = Path(__file__).resolve().parents[1]
    if (clone / "benchmarks" / "__main__.py").is_file() and str(clone) not in sys.path:
        sys.path.append(str(clone))
    try:
        bench_main = importlib.import_module("benchmarks.__main__").main
    except ModuleNotFoundError:
        print("fastkit bench: the benchmarks are not part of the installed package; run them from a clone of "
              "the repository: python -m benchmarks NAME --out DIR", file=sys.stderr)
        return 2
    return bench_main([args.name, *args.rest])


if __name__ == "__main__":
    raise SystemExit(main())
