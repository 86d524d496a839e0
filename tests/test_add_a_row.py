"""Adding a family with no special needs is one registry row and nothing else: with the row added at run
time, the twin, the census (packed parity, syncs, revert), the planner and the loader's banner all follow."""

from __future__ import annotations

import torch

from fastkit import registry
from fastkit.families.census import check_family
from fastkit.families.twins import twin, twin_config
from fastkit.loader import FastModel
from fastkit.patching import active_patches, report, revert
from fastkit.plan import plan


def test_one_row_added_at_run_time_gives_twin_parity_planner_and_revert(monkeypatch):
    monkeypatch.delitem(registry.MODEL_TABLE, "phi3")  # as if fastkit had never heard of phi3
    monkeypatch.setitem(registry.MODEL_TABLE, "phi3", registry.ModelFacts("phi3"))  # the one line a newcomer adds
    result = check_family("phi3")  # tiny twin, packed vs per document, logits + every gradient, syncs, revert
    assert result.status == "exact", (result.failed, result.reason)
    assert {"packed", "revert"} <= set(result.passed), result.passed
    model = twin("phi3")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    FastModel.patch(model)
    assert "packing" in active_patches(model)
    assert "self-verified" not in report(model).banner()  # patched by its row, not by the run-time self-check
    assert revert(model) == ["packing"] and active_patches(model) == []
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    verdict = plan(twin_config("phi3"), gpu="t4", max_seq_length=512).verdict()
    assert "fits" in verdict
