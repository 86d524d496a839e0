"""Packed-sequence patch end to end: TRL SFTTrainer(packing=True) losses per step, patched vs unpatched."""

from __future__ import annotations

import pytest
import torch

import fastkit.patches.packing.patch as packing
from fastkit.families.twins import twin, twin_tokenizer
from fastkit.loader import FastModel
from fastkit.patches.packing.patch import LENGTHS_KWARG, wrap_collator
from tests.helpers import assert_tensors_close


def _dataset():
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    sizes = torch.randint(8, 60, (120,), generator=g).tolist()
    texts = ["".join(chr(97 + c) for c in torch.randint(0, 26, (n,), generator=g).tolist()) for n in sizes]
    return Dataset.from_dict({"text": texts})


def _train(patched: bool, tmp_path, steps: int, calls: list):
    from trl import SFTConfig, SFTTrainer

    model = twin("llama", num_hidden_layers=2).train()
    if patched:
        FastModel.patch(model, patches=["packing"])
    args = SFTConfig(output_dir=str(tmp_path / ("patched" if patched else "unpatched")), max_steps=steps,
                     per_device_train_batch_size=2, packing=True, max_length=64, use_cpu=True, bf16=False,
                     gradient_checkpointing=True, report_to=[], logging_steps=1, save_strategy="no",
                     learning_rate=1e-3, seed=0, data_seed=0, disable_tqdm=True, adam_epsilon=1e-4)
    # adam_epsilon=1e-4, not 1e-8: per-document attention and the masked dense attention sum in another order, and
    # Adam's m/sqrt(v) turns a ~0 gradient entry into a step of ~lr whatever the sign of its rounding noise (a whole
    # 1e-3 step on one CPU and not another: issue 58, tests/test_packing_state.py). With 1e-4 the update moves by
    # ~lr x noise / eps, far below the weight tolerance below.
    trainer = SFTTrainer(model=model, args=args, train_dataset=_dataset(), processing_class=twin_tokenizer())
    if patched:
        # SFTTrainer refuses a custom collator with padding-free: wrap the one it built.
        trainer.data_collator = wrap_collator(trainer.data_collator)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.slow
def test_sft_packing_losses_match_unpatched_per_step(tmp_path, monkeypatch):
    calls: list[int] = []
    real = packing.kernels.packed_attention

    def counting(q, k, v, meta, **kw):
        calls.append(meta.rows)
        return real(q, k, v, meta, **kw)

    monkeypatch.setattr(packing.kernels, "packed_attention", counting)
    steps = 30
    want, want_w = _train(False, tmp_path, steps, calls)
    assert not calls
    got, got_w = _train(True, tmp_path, steps, calls)
    assert len(calls) >= steps * 2 * 2  # every step, every layer, forward + recompute went through fastkit
    assert len(got) == len(want) == steps
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-5)
    assert want[-1] < want[0] - 0.5  # it learns
    assert_tensors_close(got_w, want_w, rtol=1e-4, atol=1e-5, what="weight")


def test_trl_batch_carries_host_lengths():
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    collator = wrap_collator(DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True))
    batch = collator([{"input_ids": list(range(3, 12)), "seq_lengths": [4, 5]}])
    assert batch[LENGTHS_KWARG] == [[4, 5]]
    assert batch["max_length_q"] == 5 and batch["cu_seq_lens_q"].tolist() == [0, 4, 9]
