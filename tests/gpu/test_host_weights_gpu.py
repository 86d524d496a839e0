"""On a CUDA GPU: host weights (fastkit.patches.host) from pinned memory, double-buffered, without a sync; exact."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu


def test_streamed_loss_from_pinned_memory_equals_device_loss_without_a_sync():
    from fastkit.patches.host.rows import to_host
    from fastkit.patches.loss.chunked import token_losses
    from fastkit.patches.loss.streamed import streamed_token_losses

    torch.manual_seed(0)
    n, h, v = 2048, 256, 50_000
    weight = torch.randn(v, h, device="cuda") / 16
    host = to_host(weight)
    assert host.is_pinned()
    labels = torch.randint(0, v, (n,), device="cuda")
    labels[::3] = -100
    hidden = torch.randn(n, h, device="cuda", requires_grad=True)
    want = token_losses(hidden, weight, labels)
    (want_g,) = torch.autograd.grad(want[0].sum(), hidden)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing CUDA call raises
    try:
        got = streamed_token_losses(hidden, host, labels, rows=4096)  # 13 chunks, the last one short
        (got_g,) = torch.autograd.grad(got[0].sum(), hidden)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for a, b in zip(got[:2], want[:2]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)
    assert torch.equal(got[2], want[2])
    torch.testing.assert_close(got_g, want_g, atol=1e-5, rtol=1e-4)


def test_pinned_gathers_in_flight_never_see_a_later_batch():
    """Note: [pinned gather buffer lifetime]: many gathers queued back to back behind a slow kernel."""
    from fastkit.patches.host.rows import gather_rows, to_host

    weight = torch.randn(20_000, 512, device="cuda")
    host = to_host(weight)
    outs, ids = [], []
    slow = torch.randn(4096, 4096, device="cuda")
    for i in range(32):
        batch = torch.randint(0, 20_000, (2, 1024), generator=torch.Generator().manual_seed(i))
        _ = slow @ slow  # keep the stream busy so the copies are still queued when the host moves on
        outs.append(gather_rows(host, batch, torch.device("cuda")))
        ids.append(batch.cuda())
    for out, batch in zip(outs, ids):
        assert torch.equal(out, F.embedding(batch, weight))


def test_twin_lora_step_equal_with_the_weights_off_the_gpu():
    from fastkit import FastModel, HostWeights, host_stats
    from fastkit.families.twins import twin
    from fastkit.patches.host import HOST_IDS_KWARG, HostIds, enable_host_weights
    from fastkit.patches.loss.patch import enable_chunked_loss

    model = twin("qwen3", num_hidden_layers=2, tie_word_embeddings=False, vocab_size=60_000).cuda().train()
    FastModel.patch(model)
    model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=True, host_weights=HostWeights())
    ids = torch.randint(3, 60_000, (1, 512))
    labels = ids.clone()

    def step(**kw):
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids.cuda(), labels=labels.cuda(), **kw).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    want, want_g = step()
    before = torch.cuda.memory_allocated()
    enable_host_weights(model, HostWeights(input_embedding=True, lm_head=True, block_bytes=2**24))
    enable_chunked_loss(model)
    emb = model.get_base_model().get_input_embeddings().weight
    assert emb.device.type == "cpu" and emb.is_pinned()
    assert before - torch.cuda.memory_allocated() >= 2 * emb.numel() * emb.element_size()
    model.cuda()  # what the Trainer / accelerate do: the weights come back to the host at the next forward
    got, got_g = step(**{HOST_IDS_KWARG: HostIds(ids)})
    assert emb.device.type == "cpu" and host_stats(model).rehomed == ["the input embedding"]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for name in want_g:
        torch.testing.assert_close(got_g[name], want_g[name], atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
