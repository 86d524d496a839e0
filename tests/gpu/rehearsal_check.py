"""Reads what a rehearsed device run (tests/gpu/rehearse.sh) left in $OUT and fails unless only "no CUDA"
stopped anything: the run was not refused, every step is ok (or skipped for the one recorded reason, TRL
without datasets' pyarrow), every GPU test was collected and skipped for want of CUDA, no test errored,
each bench that ran wrote its table, at most 8 result files came back, and the tree + wheels fit 64 MiB.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_run  # noqa: E402

MIN_GPU_TESTS = 30


def problems(out: Path, rc: int, expect_trl: bool = False) -> list[str]:
    """What went wrong in a rehearsed run; ``expect_trl``: the image has datasets' pyarrow, so a step that needs
    TRL must have run (the newer device image)."""
    found = []
    summary = (out / "summary.md").read_text() if (out / "summary.md").exists() else ""
    print(summary)
    if "refused" in summary or not summary:
        return [f"the run was refused or left no summary (exit {rc})"]
    if rc != 0:
        found.append(f"the device command exited {rc}")
    results = _step_results(summary)
    found += [f"step {name}: {result}" for name, result in results.items()
              if not (result == "ok" or (result.startswith("skipped: needs TRL") and not expect_trl))]
    if len(results) != len(gpu_run.STEPS):
        found.append(f"{len(results)} of {len(gpu_run.STEPS)} steps recorded")
    found += _junit(out / "junit.xml")
    for name, result in results.items():
        table = f"bench_{name.removeprefix('bench-')}.md"
        if name.startswith("bench-") and result == "ok" and not (out / table).exists():
            found.append(f"{name} ran but {table} is not in $OUT")
    files = [p for p in out.rglob("*") if p.is_file()]
    if len(files) > gpu_run.MAX_FILES:
        found.append(f"{len(files)} result files, more than {gpu_run.MAX_FILES}: {[p.name for p in files]}")
    wheels = [w for p, _ in gpu_run.pins() if (w := gpu_run._wheel_for(p, gpu_run.WHEELS))]
    found += gpu_run.check_budget(wheels)
    return found


def _step_results(summary: str) -> dict[str, str]:
    """step name -> its result cell, from summary.md's step table."""
    names = {s.name for s in gpu_run.STEPS}
    rows = ([c.strip() for c in line.strip().strip("|").split("|")] for line in summary.splitlines())
    return {cells[0]: cells[1] for cells in rows if len(cells) == 3 and cells[0] in names}


def _junit(path: Path) -> list[str]:
    if not path.exists():
        return ["no junit.xml: the GPU tests did not run to the end"]
    cases = ET.parse(path).getroot().iter("testcase")
    out, n = [], 0
    for case in cases:
        n += 1
        skipped = case.find("skipped")
        if case.find("failure") is not None or case.find("error") is not None:
            out.append(f"GPU test {case.get('name')} failed or errored")
        elif skipped is None or "CUDA" not in (skipped.get("message") or ""):
            out.append(f"GPU test {case.get('name')} was not skipped for want of CUDA")
    if n < MIN_GPU_TESTS:
        out.append(f"only {n} GPU tests collected (expected >= {MIN_GPU_TESTS})")
    return out


if __name__ == "__main__":
    found = problems(Path(sys.argv[1]), int(sys.argv[2]), expect_trl="--expect-trl" in sys.argv[3:])
    for p in found:
        print("REHEARSAL PROBLEM:", p, file=sys.stderr)
    print("rehearsal check:", "ok" if not found else f"{len(found)} problem(s)")
    raise SystemExit(1 if found else 0)
