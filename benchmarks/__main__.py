"""``python -m benchmarks NAME [ARGS]``: run one benchmark (``--help`` after NAME for its arguments)."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from benchmarks import NAMES


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("name", choices=NAMES)
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the benchmark (see --help of each)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from benchmarks.common import run_cli

    module = importlib.import_module(f"benchmarks.{args.name}")
    return run_cli(module.main, args.rest)  # --gpu without CUDA: the message, exit status 2


if __name__ == "__main__":
    raise SystemExit(main())
