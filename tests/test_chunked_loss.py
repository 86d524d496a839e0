"""Chunked cross-entropy over the LM head: equal to the standard loss, and without full-row logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastkit.families.twins import twin
from fastkit.patches.loss.chunked import chunked_cross_entropy
from fastkit.patches.loss.patch import CHUNKED_LOSS, enable_chunked_loss
from fastkit.patching import active_patches, revert
from fastkit.plan.memprobe import measure_peak
from tests.helpers import assert_tensors_close, grads_of


def _reference(hidden, weight, bias, labels, num_items_in_batch=None):
    logits = (hidden @ weight.t() + bias).float()  # (N, V)
    if num_items_in_batch is None:
        return F.cross_entropy(logits, labels, ignore_index=-100)
    return F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum") / num_items_in_batch


@pytest.mark.parametrize("num_items_in_batch", [None, 53])
@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_kernel_loss_and_grads_equal_standard(chunk, num_items_in_batch):
    n, h, v = 37, 16, 50
    labels = torch.randint(0, v, (n,))
    labels[::3] = -100  # completion-only masks
    leaves = [torch.randn(n, h), torch.randn(v, h) / 4, torch.randn(v)]
    got = [t.clone().requires_grad_() for t in leaves]
    want = [t.clone().requires_grad_() for t in leaves]
    loss = chunked_cross_entropy(got[0], got[1], labels, bias=got[2], num_items_in_batch=num_items_in_batch,
                                 chunk=chunk)
    ref = _reference(*want, labels, num_items_in_batch)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(loss, ref, atol=1e-6, rtol=1e-6)
    for name, a, b in zip(("hidden", "weight", "bias"), got, want):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_all_ignored_gives_zero_loss_and_grads():
    hidden = torch.randn(5, 8, requires_grad=True)
    weight = torch.randn(11, 8, requires_grad=True)
    loss = chunked_cross_entropy(hidden, weight, torch.full((5,), -100), chunk=2)
    loss.backward()
    assert loss.item() == 0.0 and hidden.grad.abs().sum() == 0 and weight.grad.abs().sum() == 0


def _batch(vocab, seq=24, batch=2):
    ids = torch.randint(3, vocab, (batch, seq))
    labels = ids.clone()
    labels[:, : seq // 3] = -100  # the prompt carries no loss
    return ids, labels


@pytest.mark.parametrize("num_items_in_batch", [None, 40])
def test_patched_model_matches_transformers_loss_and_every_gradient(num_items_in_batch):
    model = twin("qwen3", num_hidden_layers=2, tie_word_embeddings=False).train()
    ids, labels = _batch(model.config.vocab_size)
    extra = {} if num_items_in_batch is None else {"num_items_in_batch": num_items_in_batch}

    def step():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=labels, **extra)
        out.loss.backward()
        return out, {k: g.clone() for k, g in grads_of(model).items()}

    want_out, want_grads = step()
    ok, how = enable_chunked_loss(model, chunk=5)
    assert ok, how
    got_out, got_grads = step()
    assert got_out.logits is None  # no full-row logits in training
    torch.testing.assert_close(got_out.loss, want_out.loss, atol=1e-6, rtol=1e-6)
    assert_tensors_close(got_grads, want_grads, atol=1e-6, rtol=1e-5)
    with torch.no_grad():  # eval / generation keep the original forward and its logits
        assert model(input_ids=ids, labels=labels).logits is not None
    revert(model, [CHUNKED_LOSS])
    assert CHUNKED_LOSS not in active_patches(model) and "forward" not in vars(model)


def test_refuses_transformed_logits():
    model = twin("qwen3", num_hidden_layers=1)
    model.config.final_logit_softcapping = 30.0
    ok, why = enable_chunked_loss(model)
    assert not ok and "final_logit_softcapping" in why


VOCAB = 151_936  # Qwen3's vocabulary


def _step_peak(model, ids, labels, **kwargs) -> int:
    def step():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=labels, **kwargs)
        out.loss.backward()
        return out.loss.detach()

    return measure_peak(step)


def test_big_vocab_step_peak_drops_by_more_than_the_fp32_logits():
    """Side by side on one twin: the step's peak with the chunked loss is lower by at least the fp32 logits.

    1024 tokens here (the fp32 logits are 0.62 GB) to stay light on a shared 2-core runner; docs/plan.md
    has the 4k-token numbers from the same measurement.
    """
    tokens = 1024
    model = twin("qwen3", num_hidden_layers=1, vocab_size=VOCAB, hidden_size=64, tie_word_embeddings=False).train()
    ids, labels = _batch(VOCAB, seq=tokens, batch=1)
    loss_std, peak_std = _step_peak(model, ids, labels)
    enable_chunked_loss(model)
    loss_chunked, peak_chunked = _step_peak(model, ids, labels)
    torch.testing.assert_close(loss_chunked, loss_std, atol=1e-5, rtol=1e-5)
    logits_fp32 = tokens * VOCAB * 4
    assert peak_std - peak_chunked >= logits_fp32, (peak_std, peak_chunked, logits_fp32)


def test_sft_trainer_loss_metrics_and_grads_equal_trl_and_no_full_logits(tmp_path, tokenizer):
    """Under make_trainer the chunked loss answers TRL's fused-head call: same loss, entropy, accuracy and
    gradients as TRL's own head, and the step's peak stays below the fp32 logits."""
    from datasets import Dataset

    from fastkit import FastModel
    from fastkit.patches.loss.patch import route_trainer_loss
    from fastkit.training import make_trainer

    tokens = 1024
    model = twin("qwen3", num_hidden_layers=1, vocab_size=VOCAB, hidden_size=64, tie_word_embeddings=False)
    model = FastModel.get_peft_model(FastModel.patch(model, max_seq_length=tokens), r=4,
                                     use_gradient_checkpointing=False)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.05)
    rows = [{"text": "the quick brown fox jumps over the lazy dog " * 22} for _ in range(2)]
    trainer = make_trainer(model, tokenizer, Dataset.from_list(rows), max_steps=1, max_seq_length=tokens,
                           completion_only_loss=False, output_dir=str(tmp_path), chunked_loss=False)
    batch = next(iter(trainer.get_train_dataloader()))
    n = batch["input_ids"].numel()
    assert n >= 900  # a long packed row: its fp32 logits would be ~0.55 GB

    def step():
        model.zero_grad(set_to_none=True)
        loss = trainer.compute_loss(trainer.model, dict(batch), num_items_in_batch=n - 3)
        loss.backward()
        trainer.flush_metrics()  # make_trainer's trainer keeps metrics on the device until a log point
        metrics = {k: trainer._metrics["train"][k][-1] for k in ("entropy", "mean_token_accuracy")}
        return loss.detach(), metrics, {k: g.clone() for k, g in grads_of(model).items()}

    want_loss, want_metrics, want_grads = step()
    assert CHUNKED_LOSS not in active_patches(model)
    assert route_trainer_loss(trainer)[0]
    (got_loss, got_metrics, got_grads), peak = measure_peak(step)
    torch.testing.assert_close(got_loss, want_loss, atol=1e-5, rtol=1e-5)
    assert got_metrics == pytest.approx(want_metrics, rel=1e-4)
    assert_tensors_close(got_grads, want_grads, atol=1e-6, rtol=1e-4)
    assert peak < n * VOCAB * 4, (peak, n)
    default = make_trainer(model, tokenizer, Dataset.from_list(rows), max_steps=1, max_seq_length=tokens,
                           completion_only_loss=False, output_dir=str(tmp_path))
    assert CHUNKED_LOSS in active_patches(default.model)  # the default off CUDA
