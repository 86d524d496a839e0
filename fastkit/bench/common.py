"""Helpers every benchmark shares: device sync, timing, the machine line, writing table + plot."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from fastkit.device import describe_device


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


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def machine_line(device: torch.device) -> str:
    """What the numbers were measured on, for the table header."""
    return (f"{describe_device(device)}; torch {torch.__version__}; {platform.python_implementation()} "
            f"{platform.python_version()}; {time.strftime('%Y-%m-%d')}")


def write_outputs(name: str, markdown: str, figure=None, out_dir: str | os.PathLike | None = None) -> Path:
    """Write ``bench_<name>.md`` (and ``.png`` from a matplotlib figure) under ``out_dir`` (default assets/)."""
    out = Path(out_dir or "assets")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"bench_{name}.md").write_text(markdown)
    if figure is not None:
        figure.savefig(out / f"bench_{name}.png", dpi=120, bbox_inches="tight")
    return out / f"bench_{name}.md"
