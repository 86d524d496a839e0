"""The prepared GPU run for the bare device machine, and its CPU dry run (driven by tests/gpu/run.sh).

The device machine (one H200, python 3.12, torch 2.11) has no network and lacks trl, datasets and
bitsandbytes; its transformers is older than fastkit needs. Only the working tree travels (64 MiB
with carried wheels) and at most 8 result files come back. So:

    tests/gpu/run.sh --fetch     # here: download the pinned cp312 wheels into .gpu-wheels/ (ignored)
    device run: bash tests/gpu/run.sh   (carry .gpu-wheels)   # there: install, test, profile, pack
    tests/gpu/run.sh --dry-run   # CI: same download + install path into a scratch target, import
                                 # fastkit from it, collect the GPU tests, check the 64 MiB budget

Steps have time caps that add up to ~7 minutes, so a rerun still fits the 15-minute budget. A step
that fails or times out is recorded and the run goes on. Results: <= 8 files in $OUT.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PINS = ROOT / "tests" / "gpu" / "wheels.txt"
WHEELS = ROOT / ".gpu-wheels"
BUDGET = 64 * 2**20  # bytes the device tool carries: tree + carried wheels
MAX_FILES = 8  # result files that come back
PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
            "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_24_x86_64",
            "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64"]

# The device profile: (step, cap in seconds). Caps sum to 400 s (<= 420); install + packing take ~20 s more.
STEPS = [("gpu-tests", 180), ("bench-packed", 60), ("bench-offload", 50), ("bench-moe", 50), ("bench-sft", 60)]
BENCH_ARGS = {
    "packed": ["--gpu"],
    "offload": ["--gpu"],
    "moe": ["--gpu"],
    "sft": ["--gpu"],
}
MARGIN_S = 12  # of each bench cap: interpreter start, imports and packing, outside the bench's own --budget-s
FIXED_FILES = ["summary.md", "junit.xml", "logs.tar.gz"]  # + one bench_<name>.md per bench step


def plan(out: Path, bench: Path) -> list[tuple[str, int, list[str]]]:
    """The device run's steps: (name, cap in seconds, argv). A bench gets ``--budget-s`` = cap - MARGIN_S so
    it skips its remaining cases (and still writes its table) before the cap kills it."""
    steps = []
    for name, secs in STEPS:
        if name == "gpu-tests":
            argv = [sys.executable, "-m", "pytest", "tests/gpu", "-m", "gpu", "-q", "-rA", "-p", "no:cacheprovider",
                    "--timeout", "90", f"--junitxml={out / 'junit.xml'}"]
        else:
            which = name[6:]
            argv = [sys.executable, "-m", "benchmarks", which, *BENCH_ARGS[which],
                    "--budget-s", str(secs - MARGIN_S), "--out", str(bench / which)]
        steps.append((name, secs, argv))
    return steps


def result_files() -> list[str]:
    """Names of the files a device run leaves in $OUT (at most MAX_FILES come back)."""
    return FIXED_FILES + [f"bench_{name[6:]}.md" for name, _ in STEPS if name.startswith("bench-")]


def pins() -> list[str]:
    lines = PINS.read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


def _wheel_for(pin: str, folder: Path) -> Path | None:
    name, version = pin.split("==")
    stem = name.replace("-", "_").lower()
    for whl in folder.glob("*.whl"):
        parts = whl.name.split("-")
        if parts[0].lower() == stem and parts[1] == version:
            return whl
    return None


def fetch(dest: Path) -> list[Path]:
    """Download every pinned wheel (cp312, manylinux x86_64) into ``dest``; stale versions are removed."""
    dest.mkdir(parents=True, exist_ok=True)
    wanted = []
    for pin in pins():
        whl = _wheel_for(pin, dest)
        if whl is None:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLATFORM, "-d", str(dest),
                            pin], check=True)
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


def install(wheels: list[Path], target: Path, cross: bool) -> None:
    """Install the carried wheels without deps or network into ``target`` (``cross``: as for cp312)."""
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--upgrade", "--target", str(target)]
    subprocess.run(cmd + (PLATFORM if cross else []) + [str(w) for w in wheels], check=True)


def _env(site: Path) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT)])
    return env


IMPORT_CHECK = """
import importlib, importlib.metadata as md, sys
site = sys.argv[1]
for pin in sys.argv[2:]:
    name, version = pin.split("==")
    mod = {"bitsandbytes": "bitsandbytes"}.get(name, name.replace("-", "_"))
    dist = md.distribution(name)
    where = str(dist.locate_file(""))
    assert dist.version == version, f"{name}: {dist.version} imported, {version} pinned"
    assert where.startswith(site), f"{name} resolves to {where}, not the carried copy in {site}"
    importlib.import_module(mod)
import fastkit, fastkit.patches, fastkit.training, fastkit.dashboard
print("imports ok: fastkit from", fastkit.__file__)
"""


def dry_run() -> int:
    """CPU rehearsal of the device run: download, budget, install into a scratch target, import, collect."""
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="fastkit-gpu-dry-") as tmp:
        wheels = fetch(Path(tmp) / "wheels")
        problems += check_budget(wheels)
        site = Path(tmp) / "site"
        install(wheels, site, cross=True)
        env = _env(site)
        r = subprocess.run([sys.executable, "-c", IMPORT_CHECK, str(site), *pins()], env=env, cwd=ROOT)
        if r.returncode:
            problems.append("carried packages or fastkit failed to import from the scratch target")
        r = subprocess.run([sys.executable, "-m", "pytest", "tests/gpu", "-m", "gpu", "--collect-only", "-q",
                            "-p", "no:cacheprovider"], env=env, cwd=ROOT, capture_output=True, text=True)
        collected = [ln for ln in r.stdout.splitlines() if "::" in ln]
        print(f"collected {len(collected)} GPU tests")
        if r.returncode or not collected:
            problems.append(f"GPU test collection failed (rc={r.returncode}):\n{r.stdout[-3000:]}{r.stderr[-2000:]}")
        for name, _, argv in plan(Path(tmp) / "out", Path(tmp) / "bench"):
            if name.startswith("bench-"):  # the device argv parses; without CUDA: GPUOnlyError, exit 2, no work
                env_cpu = dict(env, CUDA_VISIBLE_DEVICES="")
                r = subprocess.run(argv, env=env_cpu, cwd=ROOT, capture_output=True, text=True)
                if r.returncode != 2 or "--gpu needs a CUDA GPU" not in r.stderr:
                    problems.append(f"{' '.join(argv[1:])} on CPU: rc={r.returncode}, expected the GPUOnlyError "
                                    f"(exit 2): {r.stderr[-1000:]}")
    if len(result_files()) > MAX_FILES:
        problems.append(f"the run would return {len(result_files())} files, more than {MAX_FILES}")
    for p in problems:
        print("PROBLEM:", p, file=sys.stderr)
    print("dry run:", "ok" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


def _step(name: str, secs: int, argv: list[str], env: dict, logs: Path, summary: list[str]) -> None:
    t0 = time.time()
    with open(logs / f"{name}.log", "w") as log:
        try:
            rc = subprocess.run(argv, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=secs).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    summary.append(f"| {name} | {rc} | {time.time() - t0:.0f} s of {secs} s |")
    print(summary[-1], flush=True)


def device_run(out: Path) -> int:
    """On the GPU machine: install carried wheels, run GPU tests and profiles, pack <= 8 result files."""
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="fastkit-gpu-"))
    logs, bench = work / "logs", work / "bench"
    logs.mkdir()
    wheels = [w for p in pins() if (w := _wheel_for(p, WHEELS)) is not None]
    site = work / "site"
    if wheels:
        install(wheels, site, cross=False)
    env = _env(site)
    probe = subprocess.run([sys.executable, "-c", "import torch, transformers, sys; print(sys.version.split()[0], "
                            "torch.__version__, transformers.__version__, torch.cuda.get_device_name(0))"],
                           env=env, capture_output=True, text=True)
    versions = probe.stdout.strip() or probe.stderr[-500:]
    summary = ["# fastkit GPU run", "", f"python/torch/transformers/device: {versions}",
               f"carried wheels: {', '.join(w.name for w in wheels) or 'none'}", "",
               "| step | rc | time |", "|---|---|---|"]
    for name, secs, argv in plan(out, bench):
        _step(name, secs, argv, env, logs, summary)
    for table in sorted(bench.glob("*/*.md")):
        shutil.copy(table, out / table.name)
    (out / "summary.md").write_text("\n".join(summary) + "\n")
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        tar.add(logs, arcname="logs")
        if bench.exists():
            tar.add(bench, arcname="bench")
    print("\n".join(summary))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--fetch", action="store_true", help="download the carried wheels into .gpu-wheels/")
    mode.add_argument("--dry-run", action="store_true", help="CPU rehearsal (what CI runs)")
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-results"), help="results folder (device run)")
    args = ap.parse_args(argv)
    if args.fetch:
        return 1 if check_budget(fetch(WHEELS)) else 0
    if args.dry_run:
        return dry_run()
    return device_run(Path(args.out))


if __name__ == "__main__":
    raise SystemExit(main())
