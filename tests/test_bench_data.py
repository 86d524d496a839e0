"""benchmarks/data.py's memory figures: the PSS of a process tree (forked workers' shared pages counted once)."""

from __future__ import annotations

import os
import time

from benchmarks.data import PssSampler, _tree_pss_mib, table


def test_tree_pss_counts_this_process_and_a_child_that_allocates():
    total, anon = _tree_pss_mib(os.getpid())
    assert total > 10 and 0 < anon <= total, (total, anon)
    sampler = PssSampler(every=0.01)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a child that allocates 200 MiB of its own and holds it
        os.close(read)
        block = bytearray(200 << 20)
        for i in range(0, len(block), 4096):
            block[i] = 1
        os.write(write, b"x")
        time.sleep(0.5)
        os._exit(0)
    os.close(write)
    os.read(read, 1)
    time.sleep(0.2)
    os.waitpid(pid, 0)
    peak, peak_anon = sampler.stop()
    assert peak_anon >= anon + 150, (anon, peak_anon)  # the child's private pages are in the tree's figure


def test_the_table_shows_each_memory_column():
    row = {"rows_in": 20000, "variant": "fastkit", "read_s": 1.0, "prepare_s": 2.0, "total_s": 3.0, "peak_mib": 700,
           "workers_peak_mib": 500, "tree_pss_mib": 1000, "tree_anon_mib": 650, "num_proc": 2, "packed_rows": 10,
           "trained_tokens": 99}
    text = table([row], "machine")
    assert "all processes' peak PSS MiB" in text and "of it anonymous MiB" in text
    assert "| 20,000 | fastkit | 1.0 | 2.0 | 3.0 | 700 | 500 | 1,000 | 650 | 2 | 10 | 99 |" in text, text
