"""README.md is a user's page, and the pages users read speak of what users have (issue 41).

- README.md stays short (at most :data:`README_MAX_LINES` lines) and keeps the ways in a user looks for: the
  notebooks' page, ``fastkit plan``, the ``ollama create`` line and a link to every docs/*.md page.
- No line of README.md, docs/*.md, notebooks/README.md or a notebook's markdown cell speaks of a lent or borrowed
  machine, of device minutes or a device / transfer budget, or in a tool-call syntax: a user has none of those.
  What is not measured on a GPU says "not yet measured on a GPU"; the GPU tests are ``bash tests/gpu/run.sh`` on
  any CUDA machine (docs/architecture.md).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 170

OFFENDING = [
    (re.compile(r"\blent\b", re.I), "a lent machine"),
    (re.compile(r"\bborrow(?:ed|ing)?\b", re.I), "a borrowed machine"),
    (re.compile(r"\bdevice[- ]minutes?\b|\bminutes? of device\b", re.I), "device minutes"),
    (re.compile(r"\b(?:device|transfer|carry) (?:time )?budget\b|\b\d+ MiB budget\b", re.I), "a device budget"),
    (re.compile(r"\bdevice machine\b|\bGPU (?:draw|session)s?\b|\bdevice call\b", re.I), "a lent machine"),
    (re.compile(r"\bcarried (?:cp\d+ )?wheels?\b|\bwheels? (?:cannot|can|could|must) be carried\b"
                r"|\bcarr(?:y|ied|ying)\b[^.;]{0,40}?(?:\bGPU machine\b|\bdevice\b|\.gpu-wheels)", re.I),
     "carrying wheels to a lent machine"),
    (re.compile(r"\btravels? to the (?:device|GPU)\b", re.I), "carrying wheels to a lent machine"),
    (re.compile(r"\brun\(\s*command\s*=|\bcarry\s*=\s*\[|\btimeout_s\s*=|\bgive_back\b|\bfiles_fetch\b"),
     "a tool-call syntax"),
]
"""What a line may not say, and what it then speaks of."""


def offences(text: str) -> list[tuple[int, str, str]]:
    """``(line number, what it speaks of, the line)`` for each line of ``text`` that a pattern flags."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        for pattern, what in OFFENDING:
            if pattern.search(line):
                out.append((n, what, line.strip()))
                break
    return out


def user_pages() -> dict[str, str]:
    """Every page a user reads: README.md, docs/*.md, notebooks/README.md, the notebooks' markdown cells."""
    pages = {p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8")
             for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "notebooks" / "README.md"]}
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
        pages[nb.relative_to(ROOT).as_posix()] = "\n".join(
            "".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    return pages


PAGES = user_pages()


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move details to docs/*.md and link them")


def test_readme_has_the_ways_in():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for needed in ("notebooks/README.md", "fastkit plan", "ollama create", "fastkit train",
                   "```bash\nbash .ci/run\n```"):
        assert needed in readme, f"README.md does not show {needed!r}"
    unlinked = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if f"(docs/{p.name})" not in readme]
    assert unlinked == [], f"README.md links no docs/{unlinked}"


@pytest.mark.parametrize("page", sorted(PAGES))
def test_page_speaks_of_what_users_have(page):
    found = offences(PAGES[page])
    assert found == [], "\n".join(
        [f"{page}:{n}: speaks of {what}: {line[:160]}" for n, what, line in found]
        + ["say 'not yet measured on a GPU', and `bash tests/gpu/run.sh` (on any CUDA machine) for the GPU tests"])


# Lines these pages held before issue 41 (each must be flagged), and user text that must not be.
FLAGGED = [
    "## The GPU run (a lent H200, ~15 device minutes)",
    '# device: run(command="bash tests/gpu/run.sh", carry=[".gpu-wheels"], timeout_s=480)',
    "bash tests/gpu/run.sh --fetch      # here: the carried cp312 wheels (tests/gpu/wheels.txt) into .gpu-wheels/",
    "GPU lent). No column for the anchor kit (unsloth): its wheels cannot be carried within the 64 MiB budget",
    "run to make when one is lent (none was to this work).",
    "skips what does not fit. Not run yet: no GPU was lent to this task.",
    "yet: no GPU was lent to this work. fla-core 0.6.0 (+ einops) travels to the device machine for the gpu tests",
    "Not yet checked on a GPU (no GPU session was available): the CUDA context, allocator slack,",
    "Not yet compared with a measured peak on a GPU at these lengths (the first GPU draw does that).",
    "for the device machine; test-only helpers (step_reads.py) live here, outside the wheel",
    "Borrowed a GPU for a few device minutes?",
]
NOT_FLAGGED = [
    "(`torch==2.13.0` is the CPU wheel this project is tested with; on a GPU machine install the torch",
    "adapter, optimizer and step count carry over, only the schedule changes",
    "`from_pretrained` refuses only a prediction more than 10% over the budget (the planner's error on",
    "**GPU profile** (`--gpu`; capped at 50 s, `--budget-s 38`): bf16, 8192 tokens, both layer shapes",
    "Not run yet: not yet measured on a GPU. `bash tests/gpu/run.sh` on any CUDA machine runs it.",
    "ids carried by the collator; a silent, excellent, equivalent, prevalent talent",
    "each decoder layer keeps one tensor on the device: its input",
    "bash tests/gpu/run.sh --fetch   # once, with network: the pinned wheels into .gpu-wheels/",
    "bitsandbytes' PyPI releases carry Linux aarch64 wheels (check with `pip download --no-deps bitsandbytes",
]


@pytest.mark.parametrize("line", FLAGGED)
def test_the_patterns_flag_what_the_pages_said(line):
    assert offences(line), line


@pytest.mark.parametrize("line", NOT_FLAGGED)
def test_the_patterns_leave_user_text_alone(line):
    assert offences(line) == [], offences(line)
