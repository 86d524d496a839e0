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


def test_plain_assistant_trains_the_tokens_fastkit_trains_row_by_row(tmp_path):
    """The benchmark's like-for-like baseline: plain TRL with ``assistant_only_loss`` and the twin's template marked
    by ``{% generation %}`` tokenizes each row to fastkit's ids and trains the same tokens of it."""
    import torch

    from benchmarks.data import plain_dataset, plain_trainer, write_file
    from fastkit import FastModel
    from fastkit.data import load_chat_dataset
    from fastkit.families.twins import twin, twin_tokenizer
    from fastkit.training import make_trainer

    torch.set_num_threads(1)
    file = str(write_file(tmp_path / "chats.jsonl", 120))
    plain = plain_trainer(twin("llama", seed=0), twin_tokenizer(), plain_dataset(file), str(tmp_path / "plain"),
                          assistant_only=True, packing=False).train_dataset
    model = FastModel.patch(twin("llama", seed=0), max_seq_length=2048)
    ours = make_trainer(model, twin_tokenizer(), load_chat_dataset(file), max_steps=1, max_seq_length=2048,
                        output_dir=str(tmp_path / "fastkit"), dashboard="none", packing=False).train_dataset

    def trained(ds):
        return [sum(1 for v in labels if v != -100) for labels in ds["labels"]]

    assert len(plain) == len(ours) == 120
    assert plain["input_ids"] == ours["input_ids"]
    counts = trained(ours)
    assert min(counts) > 0 and counts == trained(plain), (counts[:8], trained(plain)[:8])
