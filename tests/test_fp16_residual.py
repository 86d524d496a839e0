"""fp16 safety: a twin scaled to overflow fp16 the way bf16-trained models do, plain vs fp16_residual."""

from __future__ import annotations

import copy

import torch

from fastkit.families.twins import twin
from fastkit.patches.fp16 import FP16_RESIDUAL, protect_fp16
from fastkit.patching import active_patches, revert

IDS = torch.randint(3, 259, (2, 24), generator=torch.Generator().manual_seed(0))


def _overflowing_twin():
    """A massive-activation channel, as bf16-trained models grow one: 3e4 from the embedding, +1.5e4 from
    every MLP. Each block's output stays below fp16's 65,504; the residual stream passes it at layer 2."""
    torch.manual_seed(0)
    model = twin("llama", num_hidden_layers=4, tie_word_embeddings=False, mlp_bias=True).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 3e4
        for layer in model.model.layers:
            layer.mlp.down_proj.bias[0] = 1.5e4
    return model


def _first_nonfinite(model) -> str | None:
    """Name of the first module (in call order) whose output is not finite."""
    seen: list[str] = []

    def hook(name):
        def check(module, args, out):
            out = out[0] if isinstance(out, tuple) else out
            if isinstance(out, torch.Tensor) and not seen and not out.isfinite().all():
                seen.append(name)
        return check

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n]
    try:
        with torch.no_grad():
            model(input_ids=IDS)
    finally:
        for h in handles:
            h.remove()
    return seen[0] if seen else None


def test_plain_fp16_overflows_in_the_residual_stream_and_the_patch_fixes_it():
    ref_model = _overflowing_twin()
    with torch.no_grad():
        ref = ref_model(input_ids=IDS).logits  # fp32
    half = copy.deepcopy(ref_model).half()
    # Where it breaks: a decoder layer's residual sum, while every block (attention, MLP) output is finite.
    assert _first_nonfinite(half) == "model.layers.2"

    assert protect_fp16(half) == (True, "applied") and FP16_RESIDUAL in active_patches(half)
    assert _first_nonfinite(half) is None
    out = half(input_ids=IDS, labels=IDS)
    assert out.logits.dtype == torch.float16  # the head still computes in fp16
    torch.testing.assert_close(out.logits.float(), ref, atol=2e-3, rtol=2e-3)  # fp16 rounding of O(1) logits
    out.loss.backward()
    assert all(p.grad.isfinite().all() for p in half.parameters() if p.grad is not None)

    revert(half, [FP16_RESIDUAL])
    assert _first_nonfinite(half) == "model.layers.2"  # reverted: plain fp16 again


def test_refuses_outside_fp16():
    model = twin("llama", num_hidden_layers=1)
    ok, why = protect_fp16(model)
    assert not ok and "not float16" in why and FP16_RESIDUAL not in active_patches(model)


def test_packed_eager_attention_logits_do_not_overflow_in_fp16():
    """GPT-OSS path (sinks -> per-document eager): q.k of 300 x 300 x 1 in 8 dims is 720,000 > 65,504."""
    from fastkit.patches.packing.attention import PackedBatch, eager_per_doc

    meta = PackedBatch(rows=1, row_len=16, lengths_host=[[6, 10]], max_seqlen=10)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g) for _ in range(3))
    q, k = q.sign() * 300, k.sign() * 300
    sinks = torch.zeros(2)
    ref = eager_per_doc(q, k, v, meta, scaling=8 ** -0.5, dropout=0.0, window=None, softcap=None, sinks=sinks,
                        training=False)
    got = eager_per_doc(q.half(), k.half(), v.half(), meta, scaling=8 ** -0.5, dropout=0.0, window=None,
                        softcap=None, sinks=sinks.half(), training=False)
    assert got.dtype == torch.float16 and got.isfinite().all()
    torch.testing.assert_close(got.float(), ref, atol=2e-3, rtol=2e-3)


def test_fastmodel_protects_fp16_compute_of_a_bf16_checkpoint(tmp_path):
    from fastkit import FastModel
    from tests.helpers import save_twin

    save_twin(twin("llama", num_hidden_layers=1).to(torch.bfloat16), tmp_path / "bf16")
    model, _ = FastModel.from_pretrained(str(tmp_path / "bf16"), max_seq_length=64, dtype="fp16", patches=None)
    assert FP16_RESIDUAL in active_patches(model)
    model, _ = FastModel.from_pretrained(str(tmp_path / "bf16"), max_seq_length=64, dtype="fp32", patches=None)
    assert FP16_RESIDUAL not in active_patches(model)
