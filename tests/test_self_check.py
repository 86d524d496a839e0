"""The loader's self-check: a family not in the table is patched only if the census passes on its own twin."""

from __future__ import annotations

import pytest
import torch

from fastkit import registry
from fastkit.errors import FastkitError
from fastkit.families.twins import tiny_config
from fastkit.loader import FastModel
from fastkit.patches.packing import LENGTHS_KWARG
from fastkit.patching import active_patches, report
from fastkit.training.run import _check_packing_supported


def _model(model_type: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(model_type), dtype=torch.float32)


def test_a_family_without_a_row_passes_the_self_check_and_trains_a_packed_step(monkeypatch):
    monkeypatch.delitem(registry.MODEL_TABLE, "phi3")  # a newer transformers' family fastkit has no row for
    model = FastModel.patch(_model("phi3"))
    assert "packing" in active_patches(model)
    assert "self-verified" in report(model).banner()
    lengths = [7, 9, 16]
    ids = torch.randint(3, 300, (1, sum(lengths)))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    model.train()
    out = model(input_ids=ids, labels=ids, position_ids=pos, use_cache=False, **{LENGTHS_KWARG: [lengths]})
    out.loss.backward()
    opt.step()
    assert torch.isfinite(out.loss)


def test_a_family_that_fails_the_self_check_loads_unpatched_and_packing_is_refused():
    model = FastModel.patch(_model("nemotron"))  # no row: its decoder layer drops **kwargs
    assert active_patches(model) == []
    why = report(model).skipped["all"]
    assert "self-check failed (calls)" in why
    with pytest.raises(FastkitError, match=r"self-check failed \(calls\)"):
        _check_packing_supported(model, packing=True)


def test_a_hybrid_fails_the_self_check_naming_the_check(monkeypatch):
    """With its row (``stateful``) falcon_h1 packs exactly; without one the self-check's plain row names no
    stateful layer, so the packing patch refuses it (mamba state would carry across documents)."""
    assert "packing" in active_patches(FastModel.patch(_model("falcon_h1")))
    monkeypatch.delitem(registry.MODEL_TABLE, "falcon_h1")
    model = FastModel.patch(_model("falcon_h1"))
    assert active_patches(model) == []
    why = report(model).skipped["all"]
    assert "self-check failed (refused)" in why and "carry state across packed documents" in why


def test_a_composite_checkpoint_loads_its_text_model_with_a_banner_line(tmp_path):
    """gemma3 (vision + text): the row's text_config and key renames load the text model alone, same weights."""
    from transformers import AutoModelForCausalLM

    from tests.helpers import save_twin

    cfg = tiny_config("gemma3")
    cfg.vision_config.update(dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                  image_size=28, patch_size=14))
    cfg.mm_tokens_per_image = 4
    torch.manual_seed(0)
    full = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    path = save_twin(full, tmp_path / "gemma3")
    model, _ = FastModel.from_pretrained(path, max_seq_length=256)
    assert model.config.model_type == "gemma3_text" and "packing" in active_patches(model)
    assert registry.MODEL_TABLE["gemma3"].note in report(model).banner()
    ids = torch.randint(3, 300, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, full(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
