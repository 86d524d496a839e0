"""GRPO's log-prob passes on one packed row (fastkit/training/grpo_pack.py): one GRPO step's reference log-probs, loss
and every LoRA gradient equal TRL's padded step (fp32 twin; left-padded prompts and completions of different
lengths), host syncs of the packed passes counted, the per-document restriction shown to matter."""

from __future__ import annotations

import contextlib

import pytest
import torch
from trl import GRPOTrainer

from fastkit import FastModel, SyncCounter
from fastkit.patches.packing import attention as packing_kernels
from fastkit.training import grpo_pack
from fastkit.training.preference import make_grpo_trainer
from fastkit.training.rewards import completion_text

SMOL = "HuggingFaceTB/SmolLM2-135M-Instruct"
COMPLETION_LENGTHS = (5, 2, 7, 3, 6, 1)  # tokens before the EOS, per completion (2 prompts x G=3)


def chars(completions, **kwargs):
    """A reward that differs between completions (so every advantage is non-zero)."""
    return [float(len(completion_text(c))) for c in completions]


def _prompts():
    """Two prompts of different lengths (so the shorter is left-padded), each repeated G=3 times as TRL samples."""
    short = {"prompt": [{"role": "user", "content": "Hi"}]}
    long = {"prompt": [{"role": "user", "content": "Count the apples: Ana has three and gets four more, so?"}]}
    return [short] * 3 + [long] * 3


def _trainer(tmp_path):
    model, tok = FastModel.from_pretrained(SMOL, max_seq_length=256, twin=True)
    model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False)
    trainer = make_grpo_trainer(model, tok, [p for p in _prompts()[2:4]], reward_funcs=[chars], num_generations=3,
                                max_completion_length=8, beta=0.1, max_steps=1, batch_size=2,
                                output_dir=str(tmp_path), dashboard="none")
    torch.manual_seed(1)
    for name, p in trainer.model.named_parameters():  # the policy differs from the reference (adapter disabled)
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    return trainer


def _fixed_generation(trainer):
    """TRL's own ``_generate`` once, then its completions cut to COMPLETION_LENGTHS + EOS: the same rows each call."""
    generate = GRPOTrainer._generate.__get__(trainer)
    torch.manual_seed(0)
    out = list(generate([r["prompt"] for r in _prompts()]))
    eos, tok = trainer.eos_token_ids[0], trainer._tokenizer
    out[1] = [ids[:n] + [eos] for ids, n in zip(out[1], COMPLETION_LENGTHS, strict=True)]
    out[3] = [[{"role": "assistant", "content": tok.decode(ids, skip_special_tokens=True)}] for ids in out[1]]
    assert len({len(p) for p in out[0]}) == 2  # two prompt lengths: left padding
    return lambda prompts: tuple(out)


def _generating(trainer, fake) -> None:
    """``trainer`` generates ``fake``'s fixed rows, through fastkit's recorder of their lengths."""
    trainer._generate = lambda prompts: trainer.record_rows(fake(prompts))


@contextlib.contextmanager
def _padded(trainer, fake):
    """TRL's own methods (fastkit's packed passes turned off), generating ``fake``."""
    trainer._packs_logps = False
    trainer._generate = fake
    try:
        yield
    finally:
        trainer._packs_logps = True
        _generating(trainer, fake)


def _step(trainer):
    """One GRPO step's scored batch, loss and LoRA gradients (fp32, dropout-free LoRA)."""
    trainer.model.train()
    batch = trainer._generate_and_score_completions(_prompts())
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(trainer.model, batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    return batch, loss.detach(), grads


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    trainer = _trainer(tmp_path_factory.mktemp("grpo"))
    assert trainer.fastkit_packed
    trainer.current_gradient_accumulation_steps = 1  # what Trainer's loop sets before compute_loss
    fake = _fixed_generation(trainer)
    _generating(trainer, fake)
    packed = _step(trainer)
    with _padded(trainer, fake):
        padded = _step(trainer)
    return trainer, fake, packed, padded


def test_packed_grpo_step_equals_padded(runs):
    """Reference log-probs, the loss and every LoRA gradient of one GRPO step: packed as padded.

    Tolerance: TRL's padded pass numbers positions from the left edge of the padded row (position_ids = arange), so a
    left-padded prompt starts at position k > 0 there and at 0 in the packed row; RoPE makes attention depend on
    the distance between positions only, but cos/sin of the shifted angles round differently in fp32 (~1e-7
    relative per rotation), which is the rtol 1e-5 on log-probs / loss and 1e-4 on gradients below; the break
    (documents attending to each other) moves them by 1e-2 and more.
    """
    _, _, (batch, loss, grads), (want_batch, want_loss, want_grads) = runs
    assert [c for _, c in batch[grpo_pack.ROWS_KEY]] == [n + 1 for n in COMPLETION_LENGTHS]
    mask = want_batch["completion_mask"].bool()
    assert mask.sum(1).tolist() == [n + 1 for n in COMPLETION_LENGTHS]
    torch.testing.assert_close(batch["advantages"], want_batch["advantages"])
    assert want_batch["advantages"].abs().min() > 0
    torch.testing.assert_close(batch["ref_per_token_logps"][mask], want_batch["ref_per_token_logps"][mask],
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == want_grads.keys() and len(grads) > 10
    for name, g in grads.items():
        assert g.abs().max() > 0, name
        torch.testing.assert_close(g, want_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def _leaky_attention(q, k, v, meta, *, scaling=None, **_):
    """The break: causal attention over the whole packed row, documents NOT kept apart."""
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2)  # (B, H, T, D) -> (B, T, H, D)


def test_documents_attending_to_each_other_is_caught(runs, monkeypatch):
    """The parity above can fail: with attention not kept per document (the break) the loss and gradients move."""
    trainer, fake, _, (want_batch, want_loss, want_grads) = runs
    monkeypatch.setattr(packing_kernels, "packed_attention", _leaky_attention)
    _generating(trainer, fake)
    batch, loss, grads = _step(trainer)
    worst = max((g - want_grads[n]).abs().max().item() for n, g in grads.items())
    mask = batch["completion_mask"].bool()
    ref_moved = (batch["ref_per_token_logps"][mask] - want_batch["ref_per_token_logps"][mask]).abs().max().item()
    print(f"break: loss moved {(loss - want_loss).abs().item():.2e}, a gradient {worst:.2e}, a reference log-prob "
          f"{ref_moved:.2e}")
    assert worst > 1e-3 and ref_moved > 1e-2


def _passes(trainer, batch, rows) -> None:
    """The reference pass (adapter disabled, no grad) and the policy's pass + backward on ``batch``."""
    trainer._fastkit_rows = rows
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)  # (R, P + C)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    keep = batch["completion_ids"].size(1)
    try:
        with trainer.model.disable_adapter(), torch.no_grad():
            trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, keep)
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, keep, compute_entropy=True)
        (logps * batch["completion_mask"]).sum().backward()
    finally:
        trainer._fastkit_rows = None


def test_packed_passes_add_no_host_sync(runs, monkeypatch):
    """The packed reference pass and policy pass + backward: 0 host syncs; the padded ones: the mask builder's."""
    trainer, _, (batch, _, _), _ = runs
    monkeypatch.setattr(grpo_pack, "_check_spans", lambda *a: None)  # a CPU-only check, not on the GPU path
    trainer.model.train()
    with SyncCounter() as packed:
        _passes(trainer, batch, batch[grpo_pack.ROWS_KEY])
    with SyncCounter() as padded:
        _passes(trainer, batch, None)  # no lengths: TRL's padded passes
    print(f"host syncs, reference + policy pass + backward: packed {packed.total}, padded {padded.total} "
          f"{dict(padded.by_op)}")
    assert packed.total == 0, dict(packed.by_op)
    assert padded.total > 0


def test_fit_with_accumulation_carries_each_rows_lengths(tmp_path, monkeypatch):
    """Through fit: TRL generates for 2 accumulation steps at once, shuffles and splits the rows; each pass's spans
    are checked against its own attention_mask (the CPU check), so lengths that did not travel with their rows fail."""
    from fastkit import fit
    from fastkit.quickstart.rl_data import math_dataset

    checked = []
    check = grpo_pack._check_spans
    monkeypatch.setattr(grpo_pack, "_check_spans", lambda mask, spans: (checked.append(len(spans)), check(mask, spans)))
    model, tok = FastModel.from_pretrained(SMOL, max_seq_length=256, twin=True)
    model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False)
    trainer = make_grpo_trainer(model, tok, math_dataset(4), reward_funcs=[chars], num_generations=2,
                                max_completion_length=6, max_steps=1, batch_size=1, gradient_accumulation_steps=2,
                                output_dir=str(tmp_path), dashboard="none")
    assert trainer.fastkit_packed
    assert fit(trainer, view="none").status == "finished"
    assert checked == [4, 2, 2]  # the reference pass on the generation batch, then the policy pass per micro-batch
