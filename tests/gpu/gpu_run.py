"""The prepared GPU run for the bare device machine (driven by tests/gpu/run.sh).

The device machine (one H200, python 3.12, torch 2.11, transformers 5.17) has no network, and may lack
trl, datasets' pyarrow, bitsandbytes, matplotlib and pytest-timeout. Only the working tree travels
(64 MiB with carried wheels), at most 8 result files come back, and the session's device time is
15 minutes, start-up included. So:

    bash tests/gpu/run.sh --fetch            # here: pinned cp312 wheels into .gpu-wheels/ (git-ignored)
    bash tests/gpu/run.sh [--only STEP,...]  # there (carry .gpu-wheels): refuse or install, test, profile
    bash tests/gpu/rehearse.sh               # CI: the same command in the device's package set, offline

Every step writes into $OUT as it goes (run.log streams, summary.md is rewritten after each step,
bench tables are copied every few seconds), so a run killed at any second returns what it had;
summary.md says what to rerun. Without CUDA (the rehearsal) the GPU tests skip and each bench runs
its CPU ``--quick`` profile through the same code: only "no CUDA" may stop anything there.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PINS = ROOT / "tests" / "gpu" / "wheels.txt"
WHEELS = ROOT / ".gpu-wheels"
BUDGET = 64 * 2**20  # bytes the device tool carries: tree + carried wheels
MAX_FILES = 8  # result files that come back
DEVICE_PYTHON = "3.12"


def platform_args(python_version: str) -> list[str]:
    return ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp",
            "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_24_x86_64",
            "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64"]


@dataclass(frozen=True)
class Step:
    """One step of the device run."""

    name: str
    """What ``--only`` and summary.md call it."""
    cap_s: int
    """Wall-clock cap; the step is killed (and recorded as a timeout) past it."""
    needs_trl: bool = False
    """Needs TRL, hence ``datasets`` and its pyarrow: skipped (recorded) where those do not import."""


# Caps sum to 400 s; install + checks take ~25 s more: ~7 minutes, and `--only gpu-tests` ~3.5. gpu-tests has
# the most (63 tests, and the first triton compile of the fla kernels); bench-sft is skipped where TRL is not carried.
STEPS = [Step("gpu-tests", 200), Step("bench-packed", 60), Step("bench-offload", 50), Step("bench-moe", 50),
         Step("bench-sft", 40, needs_trl=True)]
TEST_TIMEOUT_S = 60  # per GPU test (pytest-timeout): one hung test costs a third of its step, not the step
MARGIN_S = 12  # of each bench cap: interpreter start, imports and packing, outside the bench's own --budget-s
RESULT_FILES = ["summary.md", "run.log", "junit.xml", "bench_packed.md", "bench_offload.md", "bench_moe.md",
                "bench_sft.md", "figures.tar.gz"]


# -- pins and wheels --------------------------------------------------------------------------------


def pins() -> list[tuple[str, str]]:
    """``(name==version, group)`` per carried wheel."""
    out = []
    for line in PINS.read_text().splitlines():
        line = line.split("#", 1)[0].split()
        if line:
            out.append((line[0], line[1] if len(line) > 1 else "core"))
    return out


def _wheel_for(pin: str, folder: Path) -> Path | None:
    name, version = pin.split("==")
    stem = name.replace("-", "_").lower()
    for whl in folder.glob("*.whl"):
        parts = whl.name.split("-")
        if parts[0].lower() == stem and parts[1] == version:
            return whl
    return None


def fetch(dest: Path, python_version: str = DEVICE_PYTHON) -> list[Path]:
    """Download every pinned wheel (for ``python_version``, manylinux x86_64) into ``dest``; others removed."""
    dest.mkdir(parents=True, exist_ok=True)
    wanted = []
    for pin, _ in pins():
        whl = _wheel_for(pin, dest)
        if whl is None:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                            *platform_args(python_version), "-d", str(dest), pin], check=True)
            whl = _wheel_for(pin, dest)
            if whl is None:
                raise SystemExit(f"pip download {pin} produced no matching wheel in {dest}")
        wanted.append(whl)
    for stale in set(dest.glob("*.whl")) - set(wanted):
        stale.unlink()
    return wanted


def tree_bytes() -> int:
    """Bytes of what the device tool sends: tracked files plus untracked files git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout.decode()
    return sum((ROOT / p).stat().st_size for p in out.split("\0") if p and (ROOT / p).is_file())


def check_budget(wheels: list[Path]) -> list[str]:
    tree, carried = tree_bytes(), sum(w.stat().st_size for w in wheels)
    mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    print(f"budget: tree {mib(tree)} + wheels {mib(carried)} = {mib(tree + carried)} of {mib(BUDGET)}")
    return [] if tree + carried <= BUDGET else [f"tree + wheels = {mib(tree + carried)} > {mib(BUDGET)}"]


# -- the summary, rewritten after every step --------------------------------------------------------


@dataclass
class Summary:
    """summary.md in $OUT: header, one row per step, what to rerun. Rewritten on every change."""

    out: Path
    header: list[str] = field(default_factory=list)
    rows: list[tuple[str, str, str]] = field(default_factory=list)
    state: str = "starting"

    def write(self) -> None:
        lines = ["# fastkit GPU run", "", f"state: {self.state}", "", *self.header, "",
                 "| step | result | time |", "|---|---|---|", *(f"| {a} | {b} | {c} |" for a, b, c in self.rows)]
        rerun = [name for name, result, _ in self.rows if not result.startswith(("ok", "skipped"))]
        if rerun:
            lines += ["", f"rerun: `bash tests/gpu/run.sh --only {','.join(rerun)}` (carry .gpu-wheels)"]
        (self.out / "summary.md").write_text("\n".join(lines) + "\n")

    def refuse(self, why: str) -> int:
        self.state = f"refused before any step: {why}"
        self.write()
        print(self.state, file=sys.stderr)
        return 3


# -- installing and checking what was carried ------------------------------------------------------


def install(wheels: list[Path], target: Path) -> None:
    """The device's install path: no deps, no index, into a folder named ``site-packages`` (dill pickles
    modules by value from any path without that name)."""
    assert target.name == "site-packages"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", str(target), *map(str, wheels)], check=True)


def _env(paths: list[Path]) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", MPLBACKEND="Agg")
    env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), str(ROOT)])
    return env


VERSION_CHECK = """
import importlib, importlib.metadata as md, sys
site = sys.argv[1].split(",")
modules = {"huggingface_hub": "huggingface_hub", "pytest-timeout": "pytest_timeout", "fla-core": "fla"}
for pin in sys.argv[2:]:
    name, version = pin.split("==")
    dist = md.distribution(name)
    where = str(dist.locate_file(""))
    assert dist.version == version, f"{name} {dist.version} is imported, {version} was carried"
    assert any(where.startswith(s) for s in site), f"{name} resolves to {where}, not the carried copy"
    importlib.import_module(modules.get(name, name.replace("-", "_")))
import torch, fastkit, fastkit.patches, fastkit.training, fastkit.dashboard
cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA"
print(sys.version.split()[0], "torch", torch.__version__, "|", cuda)
"""


def _probe(code: str, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], env=env, cwd=ROOT, capture_output=True, text=True)


def _last_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit {proc.returncode}, nothing on stderr"


TESTS_ONLY = "varlen"
"""The wheel group on the path of the GPU tests only: with flash-linear-attention importable, transformers routes
every gated-DeltaNet twin through its triton kernels, which a bench's CPU profile (the rehearsal) cannot run."""


def prepare(work: Path, summary: Summary) -> tuple[dict, dict, bool, str] | str:
    """Install the carried wheels and check them; ``(env, tests_env, trl_usable, versions)`` or why the run is
    refused (``tests_env``: ``env`` plus the tests-only group)."""
    carried = pins()
    missing = [pin for pin, _ in carried if _wheel_for(pin, WHEELS) is None]
    if missing:
        return (f"no carried wheel for {', '.join(missing)} in {WHEELS.name}/ (run `bash tests/gpu/run.sh "
                "--fetch` here, then carry .gpu-wheels)")
    sites = {}
    for group in sorted({g for _, g in carried}):
        sites[group] = work / group / "site-packages"
        shutil.rmtree(sites[group], ignore_errors=True)  # only what is carried now, nothing left from a run before
        install([_wheel_for(p, WHEELS) for p, g in carried if g == group], sites[group])
    trl_usable = True
    probe = _probe("import datasets, trl", _env(list(sites.values())))
    if probe.returncode:  # datasets needs pyarrow / pandas / xxhash: not importable here; drop the whole group
        trl_usable = False
        summary.header.append(f"TRL group not usable here ({_last_line(probe)}); steps needing TRL are skipped")
    usable = [s for g, s in sites.items() if trl_usable or g != "trl"]
    env, tests_env = _env([s for s in usable if s != sites.get(TESTS_ONLY)]), _env(usable)
    active = [p for p, g in carried if trl_usable or g != "trl"]
    check = _probe(VERSION_CHECK, tests_env, ",".join(str(s) for s in sites.values()), *active)
    if check.returncode:
        return f"carried packages are not the ones imported: {_last_line(check)}"
    return env, tests_env, trl_usable, check.stdout.strip()


# -- the steps ------------------------------------------------------------------------------------


def step_argv(step: Step, out: Path, bench: Path, cuda: bool) -> list[str]:
    if step.name == "gpu-tests":
        return [sys.executable, "-m", "pytest", "tests/gpu", "-m", "gpu", "-v", "-rA", "-p", "no:cacheprovider",
                "--timeout", str(TEST_TIMEOUT_S), "--durations=10", f"--junitxml={out / 'junit.xml'}"]
    which = step.name.removeprefix("bench-")
    profile = ["--gpu", "--budget-s", str(step.cap_s - MARGIN_S)] if cuda else ["--quick"]
    return [sys.executable, "-m", "benchmarks", which, *profile, "--out", str(bench / which)]


class TableSync:
    """Copies bench tables from the work folder into $OUT every few seconds while a step runs, so a
    run killed mid-bench still returns the table the bench had written so far."""

    def __init__(self, bench: Path, out: Path, every_s: float = 3.0) -> None:
        self.bench, self.out, self.every_s = bench, out, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> TableSync:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sync()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sync()

    def sync(self) -> None:
        for table in self.bench.glob("*/bench_*.md"):
            shutil.copy(table, self.out / table.name)


REHEARSAL_CAP_S = 600  # without CUDA the caps (sized for the H200's 15 minutes) would make a slow CPU flaky


def run_step(step: Step, argv: list[str], env: dict, log, bench: Path, out: Path, cap_s: int) -> str:
    log.write(f"\n===== {step.name}: {' '.join(argv[1:])}\n")
    log.flush()
    with TableSync(bench, out):
        try:
            rc = subprocess.run(argv, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                timeout=cap_s).returncode
        except subprocess.TimeoutExpired:
            return f"timeout after {cap_s} s"
    return "ok" if rc == 0 else f"failed (exit {rc}; see run.log)"


def pack_figures(bench: Path, out: Path) -> None:
    figures = sorted(bench.glob("*/*.png"))
    if figures:
        with tarfile.open(out / "figures.tar.gz", "w:gz") as tar:
            for fig in figures:
                tar.add(fig, arcname=fig.name)


def device_run(out: Path, only: list[str] | None) -> int:
    """On the GPU machine (or the rehearsal): refuse or install, run the steps, results into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    summary = Summary(out)
    unknown = sorted(set(only or []) - {s.name for s in STEPS})
    if unknown:
        return summary.refuse(f"unknown step(s) {', '.join(unknown)}; steps: {', '.join(s.name for s in STEPS)}")
    work = Path(os.environ.get("FASTKIT_GPU_WORK") or tempfile.mkdtemp(prefix="fastkit-gpu-"))
    shutil.rmtree(work / "bench", ignore_errors=True)
    ready = prepare(work, summary)
    if isinstance(ready, str):
        return summary.refuse(ready)
    env, tests_env, trl_usable, versions = ready
    cuda = "no CUDA" not in versions
    summary.header[:0] = [f"python / torch / device: {versions}",
                          f"carried: {', '.join(p for p, _ in pins())}"]
    if not cuda:
        summary.header.append("no CUDA: GPU tests skip, benches run their CPU --quick profile (a rehearsal)")
    bench = work / "bench"
    steps = [s for s in STEPS if only is None or s.name in only]
    with open(out / "run.log", "a", buffering=1) as log:
        for i, step in enumerate(steps, 1):
            summary.state = f"running {step.name} ({i}/{len(steps)})"
            summary.write()
            t0 = time.monotonic()
            if step.needs_trl and not trl_usable:
                result = "skipped: needs TRL, and datasets does not import here (see above)"
            else:
                cap_s = step.cap_s if cuda else REHEARSAL_CAP_S
                step_env = tests_env if step.name == "gpu-tests" else env
                result = run_step(step, step_argv(step, out, bench, cuda), step_env, log, bench, out, cap_s)
            summary.rows.append((step.name, result, f"{time.monotonic() - t0:.0f} s of {step.cap_s} s"))
            print(f"{step.name}: {result}", flush=True)
            pack_figures(bench, out)
    failed = [r for r in summary.rows if not r[1].startswith(("ok", "skipped"))]
    summary.state = "finished" + (f", {len(failed)} step(s) not ok" if failed else ", all steps ok")
    summary.write()
    print((out / "summary.md").read_text())
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fetch", action="store_true", help="download the carried wheels into .gpu-wheels/")
    ap.add_argument("--python-version", default=DEVICE_PYTHON, help="--fetch: the interpreter they are for")
    ap.add_argument("--only", default=None, help=f"comma-separated steps ({', '.join(s.name for s in STEPS)})")
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-results"), help="results folder")
    args = ap.parse_args(argv)
    if args.fetch:
        return 1 if check_budget(fetch(WHEELS, args.python_version)) else 0
    return device_run(Path(args.out), args.only.split(",") if args.only else None)


if __name__ == "__main__":
    raise SystemExit(main())
