"""What every benchmark shares: CLI arguments, the device, timing, table and byte formatting, output.

- :func:`bench_parser`: ``--quick``, ``--gpu``, ``--repeats``, ``--out`` with the same meaning in every bench.
- :func:`bench_device`: ``--gpu`` without CUDA raises :class:`~fastkit.errors.GPUOnlyError` before any
  work; :func:`run_cli` prints that message and returns exit status 2.
- :func:`markdown_table` and ``fmt_bytes`` (:mod:`fastkit.units`, fastkit's own): one table renderer, one byte
  formatter.
- :func:`write_outputs`: ``bench_<name>.md`` (+ ``.png``) into ``--out``, and nowhere else: a full run without
  ``--out`` is refused by :func:`parse_bench_args` before any work; a ``--quick`` run without ``--out`` writes to
  a fresh temp folder (so it never overwrites the committed tables in ``assets/``).
- Noise: :func:`fmt_ms` (median, min and spread of interleaved repeats), :func:`fmt_ratio` (a ratio with the
  range of its per-repeat ratios), :func:`load_line` (the machine's load, for every table header).
- :class:`TimeBudget`: ``--budget-s`` counted from process start (the OS's start time: no clock runs at
  import); a bench skips its remaining cases (with a note) when the budget is near
  and rewrites its table after every case, so a capped GPU run still leaves a table.
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
from typing import Any

import torch

from fastkit.device import describe_device
from fastkit.errors import FastkitError, GPUOnlyError

ASSETS = "assets"
"""Where the committed tables live (pass ``--out assets`` from the repo root to refresh them)."""

_QUICK_DIRS: dict[str, Path] = {}
NOISY = 0.10
"""Spread ((max-min)/median) above which a cell is marked noisy."""


# -- command line ------------------------------------------------------------------------------
def plain(text: str) -> str:
    """``text`` without reST markup for a terminal: ``code`` -> code, :func:`name` -> name."""
    import re

    return re.sub(r"(?::[a-z]+:)?`+([^`]+?)`+", r"\1", text)


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1 (``--rows 0`` or ``-5`` is a usage error, exit 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive whole number (give 1 or more)")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a positive number")
    return value


def readable_file(text: str) -> Path:
    """An argparse type: an existing regular file."""
    path = Path(text).expanduser()
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text}: {'not a file' if path.exists() else 'no such file'}")
    return path


class ParsedOnly(Exception):  # noqa: N818 -- a signal, not an error
    """Raised by :func:`parse_bench_args` under :func:`parse_only`: the parsed arguments, nothing run."""

    def __init__(self, parsed: argparse.Namespace):
        super().__init__("parsed only")
        self.parsed = parsed


_PARSE_ONLY: list[bool] = []


def parse_only(name: str, argv: Sequence[str]) -> argparse.Namespace:
    """What ``python -m benchmarks NAME ARGV`` would run with, read by that bench's own parser, nothing run (a
    usage error is its SystemExit(2)): the check that a documented command runs as written."""
    import importlib

    module = importlib.import_module(f"benchmarks.{name}")
    _PARSE_ONLY.append(True)
    try:
        module.main(list(argv))
    except ParsedOnly as signal:
        return signal.parsed
    finally:
        _PARSE_ONLY.pop()
    raise AssertionError(f"benchmarks.{name}.main did not parse through parse_bench_args")


def bench_parser(name: str, doc: str, *, quick: str, gpu: str, repeats: str) -> argparse.ArgumentParser:
    """The parser every ``fastkit bench <name>`` starts from; each bench adds its own knobs.

    ``quick``, ``gpu``, ``repeats``: what those flags mean for this bench (shown in ``--help``).
    """
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks {name}",
                                     description=plain(doc.strip().splitlines()[0]))
    parser.add_argument("--quick", action="store_true",
                        help=f"CI smoke run: {quick}. Writes to a temp folder unless --out is given")
    parser.add_argument("--gpu", action="store_true",
                        help=f"GPU profile: {gpu}. Needs CUDA: without it the bench stops before any work (exit 2)")
    parser.add_argument("--repeats", "--reps", type=positive_int, default=None, help=repeats)
    parser.add_argument("--out", default=None,
                        help=f"folder for bench_{name}.md / .png (required for a full run, e.g. --out {ASSETS}; "
                             "with --quick a temp folder by default)")
    parser.add_argument("--budget-s", type=positive_float, default=None,
                        help="seconds (from process start) this run may take: remaining cases are skipped, with a "
                             "note in the table, when the next one would not fit (default: no limit)")
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
    """Run a bench's ``main``; a :class:`FastkitError` (``--gpu`` without CUDA, nothing measured) is printed
    as one line (no traceback) and gives exit status 2."""
    try:
        return int(main(argv) or 0)
    except FastkitError as exc:
        print(f"benchmarks: {exc}", file=sys.stderr)
        return 2


# -- measuring ---------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    """Wait for queued device work (no-op on CPU) so a timer measures it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


CLOCKS = ("wall", "cpu")
"""``--clock``: ``wall`` (perf_counter) or ``cpu`` (this thread's CPU time: CPU device, 1 torch thread only)."""


def clock_for(name: str, device: torch.device) -> Callable[[], float]:
    """The timer a bench measures with. ``"cpu"``: ``time.thread_time``, the CPU time of the calling thread,
    which on a shared machine leaves out the time other processes held the core. It is the whole cost only
    where all the work runs on that thread: the CPU device with ``torch.set_num_threads(1)`` (CPU autograd
    runs backward on the calling thread too). Anything else is refused before any work."""
    if name == "wall":
        return time.perf_counter
    if name != "cpu" or device.type != "cpu" or torch.get_num_threads() != 1:
        raise FastkitError(f"--clock {name!r}: 'cpu' needs the CPU device and 1 torch thread (--threads 1); "
                           f"here {device.type}, {torch.get_num_threads()} threads. Use --clock wall.")
    return time.thread_time


def timed(fn: Callable[[], object], device: torch.device, clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds ``fn`` takes, device work included (``clock``: :func:`clock_for`)."""
    sync(device)
    start = clock()
    fn()
    sync(device)
    return clock() - start


def median(xs: Iterable[float]) -> float:
    """Median, ``nan`` for no samples."""
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def machine_line(device: torch.device, load: str | None = None) -> str:
    """What the numbers were measured on, and the machine's load (``load``, else measured now)."""
    return (f"{describe_device(device)}; torch {torch.__version__}; {platform.python_implementation()} "
            f"{platform.python_version()}; {time.strftime('%Y-%m-%d')}; {load or load_line()}")


def _busy_others(threshold: float = 20.0, window: float = 0.3) -> str:
    """Other processes using more than ``threshold`` % of a CPU over ``window`` seconds (psutil), or why unknown."""
    try:
        import psutil
    except ImportError:
        return "other processes: unknown (no psutil)"
    mine = {os.getpid(), *(c.pid for c in psutil.Process().children(recursive=True))}
    procs = [p for p in psutil.process_iter(["name"]) if p.pid not in mine]
    for p in procs:
        try:
            p.cpu_percent(None)
        except psutil.Error:
            pass
    time.sleep(window)
    busy = []
    for p in procs:
        try:
            pct = p.cpu_percent(None)
        except psutil.Error:
            continue
        if pct >= threshold:
            busy.append((pct, p.info.get("name") or str(p.pid)))
    if not busy:
        return "no other process busy"
    busy.sort(reverse=True)
    names = ", ".join(f"{n} {pct:.0f}%" for pct, n in busy[:4])
    return f"{len(busy)} other process(es) busy (>{threshold:.0f}% CPU: {names})"


def parse_bench_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)``; a full run without ``--out`` stops here (exit 2), before any work."""
    args = parser.parse_args(argv)
    if args.out is None and not args.quick:
        parser.error(f"--out is required for a full run (e.g. --out {ASSETS} from the repo root); "
                     "a --quick run writes to a temp folder")
    if _PARSE_ONLY:
        raise ParsedOnly(args)
    mark_start()  # the tables of this run name the commit and date it started from
    return args


def _process_start() -> float:
    """This process's start on the ``time.time()`` clock (psutil reads it from the OS); now without psutil."""
    try:
        import psutil
    except ImportError:
        return time.time()
    return psutil.Process().create_time()


def load_line() -> str:
    """The machine's load for a table header: load averages, CPU count, busy other processes, a verdict."""
    cpus = os.cpu_count() or 1
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return f"load unknown on {cpus} CPUs"
    others = _busy_others()
    # the 1-minute average lags (a bench run just before this one still counts): busy processes decide,
    # a load above the CPU count means something this sampling missed
    quiet = one < cpus and others == "no other process busy"
    verdict = "quiet" if quiet else "UNDER LOAD: absolute times inflated, read the spreads"
    return f"load avg {one:.2f}/{five:.2f}/{fifteen:.2f} on {cpus} CPUs, {others}: {verdict}"


class TimeBudget:
    """Seconds a bench run may take, counted from process start (``None``: no limit)."""

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self.skipped: list[str] = []
        self._start = _process_start()  # a budget counts the interpreter start and the imports too

    def elapsed(self) -> float:
        return time.time() - self._start

    def allows(self, estimate_s: float = 0.0) -> bool:
        """Whether work expected to take ``estimate_s`` still fits."""
        return self.seconds is None or self.elapsed() + estimate_s <= self.seconds

    def skip(self, what: str) -> None:
        self.skipped.append(what)
        print(f"budget: skipping {what} ({self.elapsed():.0f} s of {self.seconds:.0f} s used)", flush=True)

    def note(self) -> str:
        """A line for the table ('' when nothing was skipped)."""
        if not self.skipped:
            return ""
        return f"Skipped for time (budget {self.seconds:.0f} s): {'; '.join(self.skipped)}.\n"


def spread(xs: Sequence[float]) -> float:
    """(max - min) / median of repeats: 0 for one sample."""
    m = median(xs)
    return (max(xs) - min(xs)) / m if len(xs) > 1 and m > 0 else 0.0


def fmt_ms(xs_ms: Sequence[float], digits: int = 1) -> str:
    """Repeats in ms as ``median (min x, spread y%)``; ``noisy`` when the spread exceeds :data:`NOISY`."""
    if not xs_ms:
        return "-"
    m, lo = median(xs_ms), min(xs_ms)
    if len(xs_ms) == 1:
        return f"{m:.{digits}f} (1 rep)"
    s = spread(xs_ms)
    return f"{m:.{digits}f} (min {lo:.{digits}f}, spread {s:.0%}{', noisy' if s > NOISY else ''})"


def ratios(num: Sequence[float], den: Sequence[float]) -> list[float]:
    """Per-repeat ratios of interleaved pairs; unequal counts: every combination."""
    if len(num) == len(den):
        return [a / b for a, b in zip(num, den) if b > 0]
    return [a / b for a in num for b in den if b > 0]


def fmt_ratio(num: Sequence[float], den: Sequence[float], digits: int = 2) -> str:
    """``num / den`` as ``median× [min–max]`` of the per-repeat ratios; ``within noise`` when the range holds 1."""
    rs = ratios(num, den)
    if not rs:
        return "-"
    m = median(rs)
    if len(rs) == 1:
        return f"{m:.{digits}f}× [1 rep: no spread]"
    lo, hi = min(rs), max(rs)
    flag = " within noise" if lo <= 1.0 <= hi else ""
    return f"{m:.{digits}f}× [{lo:.{digits}f}–{hi:.{digits}f}]{flag}"


# -- formatting --------------------------------------------------------------------------------
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
    """``out`` when given; else a fresh temp folder for a quick run (never assets/); a full run must be told."""
    if out is not None:
        return Path(out)
    if not quick:
        raise ValueError(f"bench {name}: a full run writes only where --out says (e.g. --out {ASSETS})")
    # one temp folder per bench and process: the table is rewritten there after every case
    if name not in _QUICK_DIRS or not _QUICK_DIRS[name].exists():
        _QUICK_DIRS[name] = Path(tempfile.mkdtemp(prefix=f"fastkit-bench-{name}-"))
    return _QUICK_DIRS[name]


def check_measured(name: str, markdown: str) -> None:
    """Raise when the bench's markdown has tables but not one row of measurements in them."""
    import re

    rows = [line for line in markdown.splitlines() if line.lstrip().startswith("|")]
    separators = [line for line in rows if re.fullmatch(r"\s*\|[\s:|-]+\|\s*", line)]
    skipped = "Skipped for time" in markdown  # a spent --budget-s: an empty table that says why is written
    if separators and not skipped and len(rows) - 2 * len(separators) <= 0:  # each: header, separator, data
        raise FastkitError(f"fastkit bench {name}: nothing was measured (no table rows; check the case / model names "
                           "given), so no table was written.")


PROVENANCE = "Made by"
"""Start of the line every written table ends with: the commit, machine, date and command that made it."""


def _git_state() -> tuple[str, str]:
    """``(short sha, " + uncommitted changes" or "")`` of the clone the benchmarks run from."""
    import subprocess

    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    sha = git("rev-parse", "--short=10", "HEAD") or "unknown"
    # the tables themselves (assets/) do not count: a run that rewrites a committed table is not "dirty" by it
    dirty = " + uncommitted changes" if git("status", "--porcelain", "--untracked-files=no", "--", ".",
                                            ":!assets") else ""
    return sha, dirty


_STARTED: dict[str, Any] = {}  # the commit and date when this process first asked: a run's tables name its start


def mark_start() -> None:
    """Take the commit and the date a run starts from (:func:`parse_bench_args` does, before any work)."""
    import datetime

    _STARTED["git"] = _git_state()
    _STARTED["when"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def bench_command(name: str) -> str:
    """The command this process runs as ``python -m benchmarks NAME ...`` (what a table's provenance quotes)."""
    args = sys.argv[1:]
    if args[:1] and (args[0] == name or name.startswith(f"{args[0]}_")):  # NAME or a table of it (sft_compile)
        name, args = args[0], args[1:]  # python -m benchmarks NAME ... / fastkit bench NAME ...
    return " ".join(["python -m benchmarks", name, *args])


def provenance(name: str, earlier: Sequence[str] = ()) -> str:
    """``Made by commit <sha>[ + uncommitted changes] on <machine>, <UTC date>: <command>.`` The commit and the
    date are the run's start (:func:`mark_start`), so a long run's rewrites never pick up later commits."""
    if not _STARTED:
        mark_start()
    sha, dirty = _STARTED["git"]
    machine = f"{platform.node() or 'unknown host'} ({platform.system()} {platform.machine()}, {os.cpu_count()} CPUs)"
    before = "".join(f"`{c}`, then " for c in earlier)  # the runs whose printed results this one's table adds
    return f"{PROVENANCE} commit {sha}{dirty} on {machine}, {_STARTED['when']}: {before}`{bench_command(name)}`."


def write_outputs(name: str, markdown: str, plot: Callable[[], Any] | None = None, *,
                  out: str | os.PathLike | None = None, quick: bool = False, earlier: Sequence[str] = ()) -> Path:
    """Write ``bench_<name>.md``, print it, then draw ``bench_<name>.png`` from ``plot()`` (a matplotlib figure).

    The table is written before the plot is even built, so a plot that fails (matplotlib absent, as on
    the GPU machine) never costs the table: the failure is logged and the bench still succeeds.
    Returns the markdown file's path; see :func:`output_dir` for where it goes.
    """
    check_measured(name, markdown)  # a typo that selects no case never replaces a committed table
    markdown = markdown.rstrip() + "\n\n" + provenance(name, earlier) + "\n"
    folder = output_dir(name, out, quick)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"bench_{name}.md"
    path.write_text(markdown)
    print(markdown)
    print(f"written: {path}")
    if plot is not None:
        _save_plot(plot, folder / f"bench_{name}.png")
    return path


def _save_plot(plot: Callable[[], Any], path: Path) -> None:
    try:
        figure = plot()
    except ImportError as exc:  # matplotlib is optional (the `notebook` extra); the table is what counts
        print(f"plot skipped ({exc}); the table above is complete", flush=True)
        return
    figure.savefig(path, dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(figure)
    print(f"written: {path}")


def agg_pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
