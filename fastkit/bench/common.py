"""What every benchmark shares: CLI arguments, the device, timing, table and byte formatting, output.

- :func:`bench_parser`: ``--quick``, ``--gpu``, ``--repeats``, ``--out`` with the same meaning in every bench.
- :func:`bench_device`: ``--gpu`` without CUDA raises :class:`~fastkit.errors.GPUOnlyError` before any
  work; :func:`run_cli` prints that message and returns exit status 2.
- :func:`markdown_table` and :func:`fmt_bytes`: one table renderer, one byte formatter.
- :func:`write_outputs`: ``bench_<name>.md`` (+ ``.png``) into ``--out``, else ``assets/``; a ``--quick``
  run never overwrites the committed tables: without ``--out`` it writes to a fresh temp folder.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

from fastkit.device import describe_device
from fastkit.errors import GPUOnlyError

ASSETS = "assets"
"""Where full runs write their tables by default (relative to the working directory: run from the repo root)."""

_UNITS = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "B": 1}


# -- command line ------------------------------------------------------------------------------
def bench_parser(name: str, doc: str, *, quick: str, gpu: str, repeats: str) -> argparse.ArgumentParser:
    """The parser every ``fastkit bench <name>`` starts from; each bench adds its own knobs.

    ``quick``, ``gpu``, ``repeats``: what those flags mean for this bench (shown in ``--help``).
    """
    parser = argparse.ArgumentParser(prog=f"fastkit bench {name}", description=doc.strip().splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"CI smoke run: {quick}. Writes to a temp folder unless --out is given")
    parser.add_argument("--gpu", action="store_true",
                        help=f"GPU profile: {gpu}. Needs CUDA: without it the bench stops before any work (exit 2)")
    parser.add_argument("--repeats", "--reps", type=int, default=None, help=repeats)
    parser.add_argument("--out", default=None,
                        help=f"folder for bench_{name}.md / .png (default: {ASSETS}/; with --quick a temp folder)")
    return parser


def bench_device(gpu: bool) -> torch.device:
    """The device to measure on: the current CUDA device for ``--gpu``, else the CPU.

    Raises :class:`GPUOnlyError` (before any work) when ``--gpu`` is asked for without CUDA.
    """
    if not gpu:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise GPUOnlyError("--gpu needs a CUDA GPU and torch.cuda.is_available() is False here; "
                           "run without --gpu for the CPU profile.")
    return torch.device("cuda", torch.cuda.current_device())


def run_cli(main: Callable[[list[str] | None], int | None], argv: list[str] | None = None) -> int:
    """Run a bench's ``main``; a :class:`GPUOnlyError` is printed (no traceback) and gives exit status 2."""
    try:
        return int(main(argv) or 0)
    except GPUOnlyError as exc:
        print(f"fastkit bench: {exc}", file=sys.stderr)
        return 2


# -- measuring ---------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    """Wait for queued device work (no-op on CPU) so a timer measures it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds ``fn`` takes, device work included."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def median(xs: Iterable[float]) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def machine_line(device: torch.device) -> str:
    """What the numbers were measured on, for the table header."""
    return (f"{describe_device(device)}; torch {torch.__version__}; {platform.python_implementation()} "
            f"{platform.python_version()}; {time.strftime('%Y-%m-%d')}")


# -- formatting --------------------------------------------------------------------------------
def fmt_bytes(n: float | None, unit: str | None = None, *, unknown: str = "-") -> str:
    """Bytes for a table: ``1.50 GiB``, ``12.0 MiB``, ``24.0 KiB``, ``512 B``; ``0`` for none at all.

    ``unit`` ('GiB', 'MiB', 'KiB', 'B') fixes the unit (a column that compares sizes); by default the
    largest unit that keeps the number >= 1. GiB get two decimals, MiB and KiB one. ``None`` -> ``unknown``.
    """
    if n is None:
        return unknown
    if n == 0:
        return "0"
    if unit is None:
        unit = next((u for u, size in _UNITS.items() if abs(n) >= size), "B")
    value = n / _UNITS[unit]
    if unit == "B":
        return f"{int(value)} B"
    return f"{value:.2f} {unit}" if unit == "GiB" else f"{value:.1f} {unit}"


def markdown_table(columns: Sequence[str], rows: Iterable[Sequence[object]], align: str = "") -> str:
    """A markdown table: header, separator, one line per row (cells through ``str``).

    ``align``: one letter per column, ``l`` (default) or ``r`` (numbers).
    """
    align = align.ljust(len(columns), "l")
    sep = "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"
    lines = ["| " + " | ".join(columns) + " |", sep]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


# -- output ------------------------------------------------------------------------------------
def output_dir(name: str, out: str | os.PathLike | None, quick: bool) -> Path:
    """``out`` when given; else a fresh temp folder for a quick run (never assets/), else ``assets/``."""
    if out is not None:
        return Path(out)
    if quick:
        return Path(tempfile.mkdtemp(prefix=f"fastkit-bench-{name}-"))
    return Path(ASSETS)


def write_outputs(name: str, markdown: str, figure=None, *, out: str | os.PathLike | None = None,
                  quick: bool = False) -> Path:
    """Write ``bench_<name>.md`` (and ``.png`` from a matplotlib figure, then closed) and print the table.

    Returns the markdown file's path; see :func:`output_dir` for where it goes.
    """
    folder = output_dir(name, out, quick)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"bench_{name}.md"
    path.write_text(markdown)
    if figure is not None:
        figure.savefig(folder / f"bench_{name}.png", dpi=110, bbox_inches="tight")
        import matplotlib.pyplot as plt

        plt.close(figure)
    print(markdown)
    print(f"written: {path}")
    return path


def agg_pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
