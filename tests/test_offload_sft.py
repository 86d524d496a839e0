"""A 30-step TRL SFTTrainer run: identical losses with and without offloaded checkpointing.

The model comes to the trainer with checkpointing (and offload) already enabled by fastkit, so the
trainer is told ``activation_checkpointing=False``: with it on, ``Trainer.__init__`` calls
``activation_checkpointing_enable`` again and replaces every layer's checkpoint function (the
plain-checkpointing run would be unchanged; the offloaded one would silently lose its offload).
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from fastkit.families.twins import twin
from fastkit.loader import enable_checkpointing
from fastkit.patches.offload.patch import enable_offload, offload_controller
from tests.test_offload import cfg

STEPS = 30


def sft_losses(tokenizer, tmp_path, offload: bool) -> tuple[list[float], object]:
    from trl import SFTConfig, SFTTrainer

    model = twin("qwen3", num_hidden_layers=3, attention_dropout=0.1).train()
    enable_checkpointing(model, True)
    if offload:
        assert enable_offload(model, cfg()) == "double-buffer"
    texts = [f"Question {i}: what is {i} + {i}? Answer: {2 * i}." for i in range(2 * STEPS)]
    args = SFTConfig(output_dir=str(tmp_path / ("off" if offload else "plain")), max_steps=STEPS,
                     per_device_train_batch_size=2, learning_rate=2e-3, logging_steps=1, use_cpu=True,
                     report_to=[], activation_checkpointing=False, save_strategy="no", seed=0, max_length=64,
                     dataloader_num_workers=0, disable_tqdm=True)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"text": texts}),
                         processing_class=tokenizer)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, model


@pytest.mark.slow
def test_sft_losses_identical_with_offload(tokenizer, tmp_path):
    plain, plain_model = sft_losses(tokenizer, tmp_path, offload=False)
    offloaded, model = sft_losses(tokenizer, tmp_path, offload=True)
    assert len(plain) == STEPS
    assert offloaded == plain
    assert plain[-1] < plain[0]  # it trained
    stats = offload_controller(model).stats
    assert stats.offloaded == stats.prefetched == 2 * STEPS  # 2 of 3 layers offloaded and prefetched per step
    assert stats.host_reuses > 0 and stats.device_transient == 0
    for (name, p0), (_, p1) in zip(plain_model.named_parameters(), model.named_parameters()):
        assert torch.equal(p0, p1), name  # final weights bitwise equal
