"""Packed-sequence patch: host-device syncs per train step, counted (fastkit.syncs.SyncCounter)."""

from __future__ import annotations

import pytest
import torch

from fastkit import SyncCounter
from fastkit.patches.packing.patch import LENGTHS_KWARG

try:  # shared helpers; tests/ is a package here, a plain folder elsewhere
    from tests.test_packing import LENGTHS, _packed, _pair, checkpointing_on
except ImportError:  # pragma: no cover
    from test_packing import LENGTHS, _packed, _pair, checkpointing_on


@pytest.mark.parametrize("layers", [2, 8])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_zero_syncs_per_train_step(layers, checkpointing):
    base, patched = _pair("llama", layers=layers)
    for m in (base, patched):
        m.train()
        if checkpointing:
            checkpointing_on(m)
    ids, pos = _packed()
    counts = {}
    for name, model, extra in (("unpatched", base, {}), ("fastkit", patched, {LENGTHS_KWARG: LENGTHS})):
        with SyncCounter(profile=True) as sc:  # profile: reads inside backend kernels count too
            model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False, **extra).loss.backward()
        counts[name] = sc.total
    assert counts["fastkit"] == 0
    assert counts["unpatched"] >= 1  # find_packed_sequence_indices: one per forward on sdpa


def test_trl_flash_kwargs_cost_one_sync_per_batch_not_per_layer():
    """Without wrap_collator, TRL's cu_seq_lens_q is read back once per batch (CPU kernel needs host lengths)."""
    _, patched = _pair("llama", layers=8)
    patched.train()
    checkpointing_on(patched)
    ids, pos = _packed()
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    with SyncCounter() as sc:
        patched(input_ids=ids, position_ids=pos, labels=ids, use_cache=False, cu_seq_lens_q=cu,
                max_length_q=max(LENGTHS)).loss.backward()
    assert sc.total == 1
