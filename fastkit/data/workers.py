"""How many processes fastkit's (and TRL's) passes over a dataset use: ``dataset_num_proc``.

Small datasets stay in this process (starting workers costs more than it saves); larger ones use the cores
there are, capped (each worker holds its own copy of the tokenizer). ``FASTKIT_DATA_WORKERS`` overrides it.
"""

from __future__ import annotations

import os

MIN_ROWS_PER_WORKER = 5_000
"""A second process only pays off past about this many rows each (measured on multi-turn chat rows)."""
MAX_WORKERS = 8
"""The most processes used by default, whatever the core count."""


def cpu_cores() -> int:
    """The cores this process may run on (its affinity where the platform has it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def data_workers(n_rows: int) -> int | None:
    """``num_proc`` for a pass over ``n_rows`` rows: None (this process) when one would do, else up to the cores."""
    forced = os.environ.get("FASTKIT_DATA_WORKERS")
    if forced and forced.strip().isdigit():
        n = int(forced)
    else:
        n = min(cpu_cores(), MAX_WORKERS, max(1, n_rows // MIN_ROWS_PER_WORKER))
    return n if n > 1 else None


__all__ = ["MAX_WORKERS", "MIN_ROWS_PER_WORKER", "cpu_cores", "data_workers"]
