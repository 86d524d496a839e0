"""ZeroSyncSFTTrainer: the same log history as trl.SFTTrainer, and no device read between log points."""

from __future__ import annotations

import math

import pytest
import torch

from fastkit.families.twins import twin, twin_tokenizer
from fastkit.loader import FastModel
from fastkit.patches.packing import wrap_collator
from fastkit.training.trainer import ZeroSyncSFTTrainer, host_values
from tests.step_reads import StepReads

TIMING = ("runtime", "per_second")


def _dataset():
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    sizes = torch.randint(8, 60, (120,), generator=g).tolist()
    texts = ["".join(chr(97 + c) for c in torch.randint(0, 26, (n,), generator=g).tolist()) for n in sizes]
    return Dataset.from_dict({"text": texts})


def _poisoned(cls, at_step: int):
    """``cls`` whose loss *value* is NaN at one step (its gradient stays finite: the NaN term is detached)."""

    class Poisoned(cls):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if self.state.global_step == at_step:
                loss = loss + loss.detach() * float("nan")
            return loss

    return Poisoned


def _train(cls, tmp_path, *, packing=True, steps=7, logging_steps=3, accumulation=1, reads=None):
    from trl import SFTConfig

    torch.manual_seed(0)
    model = twin("qwen3", num_hidden_layers=2).train()
    if packing:
        FastModel.patch(model, patches=["packing"])
    args = SFTConfig(output_dir=str(tmp_path / cls.__name__), max_steps=steps, per_device_train_batch_size=2,
                     gradient_accumulation_steps=accumulation, packing=packing, max_length=64, use_cpu=True,
                     bf16=False, report_to=[], logging_steps=logging_steps, save_strategy="no", learning_rate=1e-3,
                     seed=0, data_seed=0, disable_tqdm=True)
    trainer = cls(model=model, args=args, train_dataset=_dataset(), processing_class=twin_tokenizer())
    if packing:
        trainer.data_collator = wrap_collator(trainer.data_collator)
    if reads is not None:
        trainer.add_callback(reads)
    trainer.train()
    assert trainer.args.logging_nan_inf_filter  # restored after train
    return [{k: v for k, v in h.items() if not any(t in k for t in TIMING)} for h in trainer.state.log_history]


def _assert_same_logs(got, want):
    assert len(got) == len(want) and len(want) >= 3
    for g, w in zip(got, want):
        assert g.keys() == w.keys(), (g, w)
        for k in w:
            same = (math.isnan(g[k]) and math.isnan(w[k])) if isinstance(w[k], float) and math.isnan(w[k]) \
                else g[k] == w[k]
            assert same, f"step {w.get('step')}: {k} = {g[k]!r}, TRL logs {w[k]!r}"


@pytest.mark.slow
def test_same_logs_as_trl_and_no_device_read_between_log_points(tmp_path):
    from trl import SFTTrainer

    trl_reads, our_reads = StepReads(), StepReads()
    want = _train(SFTTrainer, tmp_path, reads=trl_reads)
    got = _train(ZeroSyncSFTTrainer, tmp_path, reads=our_reads)
    _assert_same_logs(got, want)
    assert {"entropy", "mean_token_accuracy", "num_tokens", "grad_norm", "loss"} <= set(want[0])

    between = our_reads.between_logs()
    assert len(between) >= 3
    assert [s.total for s in between] == [0] * len(between), [dict(s.device) for s in between]
    # The counter sees TRL's reads (loss filter, num_valid branches, metric .item()s) on the same steps.
    assert all(s.device["is_nonzero"] == 4 and s.device["item"] == 3 for s in trl_reads.between_logs())
    # Host reads (AdamW's CPU step counters) are seen and set apart, not missed.
    assert all(s.excluded["optimizer step counter"] > 0 for s in between)


@pytest.mark.slow
def test_nan_loss_filter_and_padded_token_count_match_trl(tmp_path):
    """A NaN loss value at step 3 (filtered by the mean since the last log), gradient accumulation, padded
    batches (the token count from the attention mask, on the device)."""
    from trl import SFTTrainer

    kw = dict(packing=False, steps=6, logging_steps=2, accumulation=2)
    want = _train(_poisoned(SFTTrainer, 3), tmp_path, **kw)
    got = _train(_poisoned(ZeroSyncSFTTrainer, 3), tmp_path, **kw)
    _assert_same_logs(got, want)
    assert all(math.isfinite(h["loss"]) for h in want if "loss" in h)  # the filter did act


def test_host_values_reads_exact_floats():
    values = [torch.tensor(1 / 3), torch.tensor(7, dtype=torch.int64), torch.tensor(float("nan"))]
    got = host_values(values)
    assert got[0] == float(torch.tensor(1 / 3).item()) and got[1] == 7 and math.isnan(got[2])
    assert host_values([]) == []
