"""``fastkit`` command line: ``fastkit quickstart``, ``fastkit bench {packed,offload,moe,sft} ...``.

``python -m fastkit ...`` is the same command.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

BENCHES = ("packed", "offload", "moe", "sft")


def _quickstart(args: argparse.Namespace) -> int:
    from fastkit.quickstart import QuickstartConfig, run

    config = QuickstartConfig(max_steps=args.steps, max_seq_length=args.max_seq_length, twin=args.twin,
                              output_dir=args.output_dir)
    run(config)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="fastkit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    qs = sub.add_parser("quickstart", help="LoRA-tune SmolLM2-135M-Instruct offline and show before/after answers")
    qs.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    qs.add_argument("--max-seq-length", type=int, default=256, help="tokens per packed row (default 256)")
    qs.add_argument("--output-dir", default="outputs/quickstart")
    qs.add_argument("--twin", action="store_true", help="tiny random twin instead of the real weights (smoke test)")
    bench = sub.add_parser("bench", help="side-by-side benchmarks: " + ", ".join(BENCHES))
    bench.add_argument("name", choices=BENCHES)
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the benchmark (see --help of each)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.command == "quickstart":
        return _quickstart(args)
    from fastkit.bench.common import run_cli

    module = importlib.import_module(f"fastkit.bench.{args.name}")
    return run_cli(module.main, args.rest)  # --gpu without CUDA: the message, exit status 2


if __name__ == "__main__":
    raise SystemExit(main())
