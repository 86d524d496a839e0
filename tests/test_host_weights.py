"""Frozen input embedding and lm_head kept on the host (fastkit.patches.host, loss/streamed.py): exact, revertible,
no device read per step, and counted by the planner.

On this CPU-only machine the "device" is the CPU: the same code runs (gathers, chunk streams, the host-ids
handoff); nothing is pinned. The GPU-only part (pinned buffers, the side-stream double buffer) is the code
path ``device_chunks`` takes for a pinned weight and a CUDA device.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastkit import FastModel, HostWeights, host_stats
from fastkit.errors import FastkitError
from fastkit.families.twins import twin
from fastkit.patches.host import HOST_EMBEDDING, HOST_IDS_KWARG, HOST_LM_HEAD, HostIds, enable_host_weights
from fastkit.patches.host.rows import gather_rows, streamed_linear
from fastkit.patches.loss.patch import CHUNKED_LOSS, enable_chunked_loss
from fastkit.patches.loss.streamed import streamed_token_losses
from fastkit.patching import active_patches, revert, unwrap
from tests.helpers import assert_tensors_close, grads_of
from tests.test_patching import _assert_restored
from tests.test_patching import _contents as _patching_contents


def _contents(model):
    """tests/test_patching's snapshot, without the load report (it stays on revert, by design) and with each
    parameter's device and pinned state (what moving storage to the host changes)."""
    mods, config, experts = _patching_contents(model)
    records = {}
    for name, (own, *_) in mods.items():
        own.pop("_fastkit_report", None)
        state = own.pop("_fastkit_patches", None)  # a new dict after revert: compare what it records
        if state is not None:
            records[name] = {k: list(v.swaps) for k, v in state.items()}
    where = {n: (p.device, p.is_pinned()) for n, p in model.named_parameters()}
    return (mods, config, experts), where, records


def _assert_same(after, before):
    _assert_restored(after[0], before[0])
    assert after[1] == before[1]
    assert after[2].keys() == before[2].keys()
    for name, state in before[2].items():  # the other patches' records (packing, checkpointing) untouched
        assert state.keys() == after[2][name].keys()
        assert all(len(state[k]) == len(after[2][name][k]) and all(x is y for x, y in zip(state[k], after[2][name][k]))
                   for k in state), name

# -- the pure-torch pieces -----------------------------------------------------------------------------------


def _labels(n, v, seed=0):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::4] = -100
    return labels


@pytest.mark.parametrize("rows", [1, 7, 50, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_streamed_cross_entropy_equals_full_logits(rows, bias):
    """nll, entropy, is_top1 and the hidden gradient against F.log_softmax of the full fp32 logits."""
    torch.manual_seed(0)
    n, h, v = 29, 12, 50
    hidden = torch.randn(n, h, requires_grad=True)
    weight, b = torch.randn(v, h) / 2, (torch.randn(v) if bias else None)
    weight[3] = weight[7] = 3 * hidden[1].detach()  # a tie at token 1's maximum, across chunks for rows < 7:
    if b is not None:  # the first maximum is the top-1, as argmax
        b[7] = b[3]
    labels = _labels(n, v)
    labels[1] = 3
    nll, entropy, top1 = streamed_token_losses(hidden, weight, labels, bias=b, rows=rows)
    logp = F.log_softmax(F.linear(hidden, weight, b).float(), dim=-1)  # (N, V)
    valid = labels != -100
    want_nll = torch.where(valid, -logp.gather(1, labels.clamp(min=0)[:, None])[:, 0], 0.0)
    want_ent = torch.where(valid, -(logp.exp() * logp).sum(-1), 0.0)
    torch.testing.assert_close(nll, want_nll, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, want_ent, atol=1e-5, rtol=1e-5)
    assert torch.equal(top1, valid & (logp.argmax(-1) == labels))
    weights = torch.linspace(0.5, 2.0, n)
    (got,) = torch.autograd.grad((nll * weights).sum(), hidden)
    (want,) = torch.autograd.grad((want_nll * weights).sum(), hidden)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_streamed_linear_and_gather_equal_the_device_ops():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 8, requires_grad=True)
    weight, bias = torch.randn(21, 8), torch.randn(21)
    out = streamed_linear(x, weight, bias, 4)  # 6 chunks, the last one short
    want = F.linear(x, weight, bias)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)
    g = torch.randn_like(want)
    torch.testing.assert_close(torch.autograd.grad(out, x, g)[0], torch.autograd.grad(want, x, g)[0],
                               atol=1e-5, rtol=1e-5)
    ids = torch.randint(0, 21, (2, 7))
    assert torch.equal(gather_rows(weight, ids, torch.device("cpu")), F.embedding(ids, weight))


# -- on tiny twins: exact against the unpatched model --------------------------------------------------------


def _lora_twin(family: str):
    model = twin(family, num_hidden_layers=2, tie_word_embeddings=False).train()
    FastModel.patch(model)  # fastkit's row patches, as a user gets them
    peft = FastModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False,
                                    target_experts=family == "gpt_oss", host_weights=HostWeights())
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B = 0 at init would hide half of the gradients
        for name, p in peft.named_parameters():
            if p.requires_grad and "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return peft


def _batch(vocab: int, seq: int = 24, rows: int = 2):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, vocab, (rows, seq), generator=g)
    labels = ids.clone()
    labels[:, : seq // 3] = -100
    return ids, labels


def _step(model, ids, labels, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels, **kwargs)
    out.loss.backward()
    return out.loss.detach(), {k: g.clone() for k, g in grads_of(model).items()}


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt_oss"])
def test_loss_and_every_lora_gradient_equal_unpatched(family):
    """Both weights on the host, with (a) transformers' own loss over the streamed head's logits and (b) fastkit's
    chunked loss streaming the vocabulary; then revert restores the model exactly."""
    model = _lora_twin(family)
    ids, labels = _batch(unwrap(model).config.vocab_size)
    want_loss, want_grads = _step(model, ids, labels)
    before = _contents(unwrap(model))
    assert set(enable_host_weights(model, HostWeights(input_embedding=True, lm_head=True, block_bytes=4 * 48 * 40)))\
        == {HOST_EMBEDDING, HOST_LM_HEAD}
    assert len(want_grads) >= 14  # every adapted module of 2 layers
    for chunked in (False, True):
        if chunked:
            assert enable_chunked_loss(model)[0]
        loss, grads = _step(model, ids, labels, **{HOST_IDS_KWARG: HostIds(ids.clone())})
        torch.testing.assert_close(loss, want_loss, atol=1e-6, rtol=1e-6)
        assert_tensors_close(grads, want_grads, atol=1e-6, rtol=1e-5)
    assert host_stats(model).host_ids == 2 and host_stats(model).no_host_ids == 0
    revert(unwrap(model), [CHUNKED_LOSS, HOST_LM_HEAD, HOST_EMBEDDING])
    _assert_same(_contents(unwrap(model)), before)
    assert _step(model, ids, labels)[0] == want_loss


def test_fused_head_call_answers_like_the_device_chunked_loss():
    """TRL's ``fused_lm_head=True`` call: log_probs, entropy, is_top1, label_mask from the streamed head equal the
    on-device chunked loss's, and so do the gradients."""
    model = _lora_twin("qwen3")
    ids, labels = _batch(unwrap(model).config.vocab_size)
    enable_chunked_loss(model, chunk=5)

    def fused(**kw):
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=labels, fused_lm_head=True, **kw)
        out.loss.backward()
        return out, {k: g.clone() for k, g in grads_of(model).items()}

    want, want_grads = fused()
    enable_host_weights(model, HostWeights(input_embedding=True, lm_head=True, block_bytes=4 * 48 * 64))
    got, got_grads = fused(**{HOST_IDS_KWARG: HostIds(ids)})
    for key in ("loss", "log_probs", "entropy"):
        torch.testing.assert_close(getattr(got, key), getattr(want, key), atol=1e-5, rtol=1e-5)
    assert torch.equal(got.is_top1, want.is_top1) and torch.equal(got.label_mask, want.label_mask)
    assert_tensors_close(got_grads, want_grads, atol=1e-6, rtol=1e-5)


def test_the_host_ids_are_what_the_embedding_reads():
    """The lookup gathers the rows of the host ids it is given (not the device ids), and counts the calls that came
    without them (each a device read on a GPU)."""
    model = _lora_twin("llama")
    enable_host_weights(model, HostWeights(input_embedding=True))
    emb = unwrap(model).get_input_embeddings()
    ids, labels = _batch(unwrap(model).config.vocab_size)
    other = (ids + 1) % unwrap(model).config.vocab_size
    seen = []
    hook = emb.register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
    with torch.no_grad():
        model(input_ids=ids, **{HOST_IDS_KWARG: HostIds(other)})
        model(input_ids=ids)
    hook.remove()
    assert torch.equal(seen[0], F.embedding(other, emb.weight)) and torch.equal(seen[1], F.embedding(ids, emb.weight))
    stats = host_stats(model)
    assert (stats.host_ids, stats.no_host_ids) == (1, 1)
    with pytest.raises(FastkitError, match="CPU tensor"):
        model(input_ids=ids, **{HOST_IDS_KWARG: [1, 2]})


def test_refused_where_it_cannot_apply_and_the_model_is_unchanged():
    full = twin("llama", num_hidden_layers=1, tie_word_embeddings=False).train()  # full fine-tuning: all trainable
    before = _contents(full)
    with pytest.raises(FastkitError, match="input embedding is trainable"):
        enable_host_weights(full, HostWeights(input_embedding=True, lm_head=True))
    _assert_same(_contents(full), before)
    tied = twin("llama", num_hidden_layers=1, tie_word_embeddings=True).requires_grad_(False)
    with pytest.raises(FastkitError, match="tied"):
        enable_host_weights(tied, HostWeights(lm_head=True))
    model = _lora_twin("llama")
    enable_host_weights(model, HostWeights(input_embedding=True, lm_head=True))
    ids, labels = _batch(unwrap(model).config.vocab_size)
    unwrap(model).get_input_embeddings().weight.requires_grad_(True)  # starts training after the patch
    with pytest.raises(FastkitError, match="now trains"):
        model(input_ids=ids, labels=labels)
    with pytest.raises(FastkitError, match="host_weights must be"):
        enable_host_weights(model, True)


def test_modules_to_save_embedding_is_refused_by_get_peft_model():
    model = twin("llama", num_hidden_layers=1, tie_word_embeddings=False)
    FastModel.patch(model)
    with pytest.raises(FastkitError, match="modules_to_save"):
        FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False, modules_to_save=["embed_tokens"],
                                 host_weights=HostWeights(input_embedding=True))


def test_weights_moved_back_by_model_to_return_to_the_host():
    """Note: [host weights survive model.to]: on the CPU the 'device' is the host, so this only checks the bookkeeping
    path stays exact: a forward after model.to() still matches and the weights are host tensors."""
    model = _lora_twin("qwen3")
    ids, labels = _batch(unwrap(model).config.vocab_size)
    want = _step(model, ids, labels)[0]
    enable_host_weights(model, HostWeights(input_embedding=True, lm_head=True))
    model.to("cpu")
    assert _step(model, ids, labels)[0] == pytest.approx(want.item(), rel=1e-6)
    assert unwrap(model).get_input_embeddings().weight.device.type == "cpu"


# -- in the trainer: the collator carries the host ids, no device read per step ------------------------------


def _dataset():
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    sizes = torch.randint(8, 60, (80,), generator=g).tolist()
    return Dataset.from_dict({"text": ["".join(chr(97 + c) for c in torch.randint(0, 26, (n,), generator=g).tolist())
                                       for n in sizes]})


def _train(tmp_path, host: HostWeights, reads):
    from fastkit.families.twins import twin_tokenizer
    from fastkit.training import make_trainer

    torch.manual_seed(0)
    model = twin("qwen3", num_hidden_layers=2, tie_word_embeddings=False)
    FastModel.patch(model, max_seq_length=64)
    model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=True, host_weights=host)
    trainer = make_trainer(model, twin_tokenizer(), _dataset(), max_steps=5, max_seq_length=64, batch_size=2,
                           completion_only_loss=False, output_dir=str(tmp_path / str(host.any)), dashboard="none",
                           logging_steps=5, callbacks=[reads])
    from fastkit.dashboard import MetricsCallback  # it logs every step (make_trainer's default): log points at 5

    trainer.callback_handler.callbacks = [c for c in trainer.callback_handler.callbacks
                                          if not isinstance(c, MetricsCallback)]
    trainer.train()
    return trainer, [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.slow
def test_trainer_steps_read_nothing_more_and_train_the_same(tmp_path):
    from tests.step_reads import StepReads

    plain_reads, host_reads = StepReads(), StepReads()
    _, want = _train(tmp_path, HostWeights(), plain_reads)
    trainer, got = _train(tmp_path, HostWeights(input_embedding=True, lm_head=True), host_reads)
    assert {HOST_EMBEDDING, HOST_LM_HEAD, CHUNKED_LOSS} <= set(active_patches(trainer.model))
    assert got == pytest.approx(want, rel=1e-5)
    stats = host_stats(trainer.model)
    assert stats.host_ids >= 5 and stats.no_host_ids == 0  # every step's lookup used the collator's host ids
    between, plain = host_reads.between_logs(), plain_reads.between_logs()
    assert len(between) >= 3
    assert [s.total for s in between] == [0] * len(between), [dict(s.device) for s in between]
    assert [s.sync_counter for s in between] == [s.sync_counter for s in plain]


def test_make_trainer_refuses_trl_head_with_a_host_lm_head(tmp_path):
    from fastkit.families.twins import twin_tokenizer
    from fastkit.training import make_trainer

    model = twin("qwen3", num_hidden_layers=1, tie_word_embeddings=False)
    FastModel.patch(model, max_seq_length=64)
    model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False,
                                     host_weights=HostWeights(lm_head=True))
    with pytest.raises(FastkitError, match="chunked_loss=False"):
        make_trainer(model, twin_tokenizer(), _dataset(), max_steps=1, max_seq_length=64, output_dir=str(tmp_path),
                     chunked_loss=False, dashboard="none")


def test_a_deepcopys_revert_moves_the_copy_not_the_original(monkeypatch):
    """save_merged merges a deepcopy: its revert must move the copy's storage back, never the original's (the undo
    holds the parameter as data, copied with the model, not in a closure). On a CPU the move is ``.to('cpu')``, so
    which storages it reads is what is checked."""
    import copy

    model = twin("llama", num_hidden_layers=1, tie_word_embeddings=False).requires_grad_(False)
    enable_host_weights(model, HostWeights(input_embedding=True, lm_head=True))
    originals = {p.data_ptr() for p in model.parameters()}
    duplicate = copy.deepcopy(model)
    copies = {p.data_ptr() for p in duplicate.parameters()}
    moved, to = [], torch.Tensor.to

    def spy(self, *args, **kwargs):
        moved.append(self.data_ptr())
        return to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", spy)
    revert(duplicate)
    monkeypatch.setattr(torch.Tensor, "to", to)
    embedding, head = unwrap(duplicate).get_input_embeddings().weight, unwrap(duplicate).lm_head.weight
    assert {embedding.data_ptr(), head.data_ptr()} <= set(moved) <= copies, (moved, originals & set(moved))
    assert not originals & set(moved)  # the original's storage was never moved
    assert HOST_EMBEDDING in active_patches(model) and HOST_LM_HEAD in active_patches(model)
