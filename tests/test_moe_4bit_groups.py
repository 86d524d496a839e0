"""4-bit experts dequantized per hit group: the same bits as per expert, no added sync, the planned bound.

``MoEConfig.dequant_group_bytes=0`` is the per-expert path (one expert per dequantization call); the default
groups every hit expert that fits 8 MiB of transient into one call (all of a twin's), and a small bound
gives groups of two or three, consecutive (one slice of the codes) or not (one ``index_select``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from fastkit.families.twins import twin
from fastkit.patches.moe import nf4
from fastkit.patches.moe.lora import add_expert_lora
from fastkit.patches.moe.nf4 import MXFP4Experts, NF4Experts, group_size, hit_groups, quantize_experts
from fastkit.patches.moe.patch import MoEConfig, MoEExpertsPatch, attach_experts, experts_modules
from fastkit.patching import apply_patch
from fastkit.syncs import SyncCounter
from tests.helpers import forward_backward

PER_EXPERT = 0
SMALL = 2 * 64 * 64 * nf4.DEQUANT_BYTES_PER_WEIGHT  # twins: 2 gate_up experts (64x64), 4 down experts (64x32)


class _Calls(list):
    """Expert ids of each dequantization call, and the transient each call was planned at (``.bytes``)."""

    def __init__(self):
        super().__init__()
        self.bytes: list[int] = []

    def clear(self):
        super().clear()
        self.bytes.clear()


@pytest.fixture
def spy(monkeypatch):
    """Every group of expert ids dequantized in one call, in call order."""
    calls = _Calls()
    for cls in (NF4Experts, MXFP4Experts):
        original = cls.dequant

        def recording(self, ids, original=original):
            calls.append(tuple(ids))
            calls.bytes.append(len(ids) * self.shape[1:].numel() * nf4.DEQUANT_BYTES_PER_WEIGHT)
            return original(self, ids)

        monkeypatch.setattr(cls, "dequant", recording)
    return calls


def _mxfp4_experts(model: torch.nn.Module) -> torch.nn.Module:
    """GPT-OSS twin with MXFP4 experts (random codes, scales near 2**-6): what a GPT-OSS checkpoint keeps."""
    g = torch.Generator().manual_seed(0)
    for _, m in experts_modules(model):
        for name in ("gate_up_proj", "down_proj"):
            e, d_in, d_out = getattr(m, name).shape  # (E, in, out); MXFP4 blocks are (E, out, in/32, 16)
            blocks = torch.randint(0, 256, (e, d_out, d_in // 32, 16), generator=g, dtype=torch.uint8)
            scales = torch.randint(118, 124, (e, d_out, d_in // 32), generator=g, dtype=torch.uint8)
            del m._parameters[name]
            setattr(m, name, MXFP4Experts(blocks, scales, dtype=torch.float32))
    return model


def _model(family: str, bound: int | None, base: torch.nn.Module) -> torch.nn.Module:
    model = copy.deepcopy(base)
    apply_patch(model, MoEExpertsPatch(None, MoEConfig(dequant_group_bytes=bound)))
    torch.manual_seed(0)
    add_expert_lora(model, r=4, lora_alpha=8)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # B starts at zero: values make the A gradients (and the input grads) mean something
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def _four_bit_base(family: str) -> torch.nn.Module:
    model = twin(family.removesuffix("_mxfp4"))
    if family.endswith("_mxfp4"):
        return _mxfp4_experts(model)
    quantize_experts(model)
    return model


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "mixtral", "gpt_oss_mxfp4"])
@pytest.mark.parametrize("shape", [(2, 16), (1, 3)], ids=["32-tokens", "3-tokens"])
def test_hit_groups_give_the_per_expert_bits_logits_and_every_gradient(family, shape, spy):
    base = _four_bit_base(family)
    ids = torch.randint(3, 300, shape, generator=torch.Generator().manual_seed(1))
    want = forward_backward(_model(family, PER_EXPERT, base), ids)
    assert spy and all(len(g) == 1 for g in spy)  # per expert: one expert per call
    for bound in (None, SMALL):
        spy.clear()
        got = forward_backward(_model(family, bound, base), ids)
        assert max(map(len, spy)) > 1  # really batched
        assert torch.equal(got.logits, want.logits) and torch.equal(got.loss, want.loss)
        assert got.grads.keys() == want.grads.keys() and any("lora_A" in n for n in got.grads)
        for name, g in want.grads.items():  # expert LoRA A and B, attention, embeddings: bit for bit
            assert torch.equal(got.grads[name], g), name


def _layer(num_experts=8, size=64, bound=None, dtype=torch.float32):
    model = twin("qwen3_moe", hidden_size=size, moe_intermediate_size=size, num_experts=num_experts,
                 num_experts_per_tok=2, num_hidden_layers=1)
    quantize_experts(model)
    experts = model.model.layers[0].mlp.experts.to(dtype)
    attach_experts(experts, MoEConfig(dequant_group_bytes=bound))
    return experts


def _layer_inputs(tokens: int, experts: tuple[int, ...], size=64, dtype=torch.float32):
    """Tokens routed only to ``experts`` (top-2), so the others get no rows."""
    g = torch.Generator().manual_seed(3)
    pick = torch.tensor(experts)[torch.randint(0, len(experts), (tokens, 2), generator=g)]
    pick[:, 1] = torch.where(pick[:, 1] == pick[:, 0], pick[:, 1].roll(1), pick[:, 1])  # mostly distinct
    hidden = torch.randn(tokens, size, generator=g).to(dtype).requires_grad_(True)
    return hidden, pick, torch.rand(tokens, 2, generator=g).to(dtype).requires_grad_(True)


def _fwd_bwd(experts, hidden, idx, w):
    out = experts(hidden, idx, w)
    grads = torch.autograd.grad(out.float().square().sum(), (hidden, w))
    return out.detach(), grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathered_groups_of_non_consecutive_experts_are_exact(dtype, spy):
    hit = (0, 2, 3, 5, 7)  # gaps: 2-3 is a consecutive pair, 5 and 7 are not neighbours
    hidden, idx, w = _layer_inputs(24, hit, dtype=dtype)
    per = _layer(bound=PER_EXPERT, dtype=dtype)
    want = _fwd_bwd(per, hidden, idx, w)
    one = per.gate_up_proj.shape[1:].numel()
    for size in (2, 3, 8):
        experts = _layer(bound=size * one * nf4.DEQUANT_BYTES_PER_WEIGHT, dtype=dtype)
        spy.clear()
        got = _fwd_bwd(experts, hidden, idx, w)
        assert set(sum(spy, ())) <= set(hit)  # only experts that received tokens are dequantized
        assert any(g[-1] - g[0] != len(g) - 1 for g in spy)  # a gathered (index_select) group ran
        assert torch.equal(got[0], want[0])
        assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))


def test_hit_groups_and_group_size():
    # experts 0, 2, 4 get no rows (their end equals the previous one)
    assert hit_groups((0, 2, 2, 5, 5, 9), 2) == [((1, 0, 2), (3, 2, 5)), ((5, 5, 9),)]
    assert hit_groups((0, 0, 0), 4) == []
    per = 4096 * nf4.DEQUANT_BYTES_PER_WEIGHT
    assert group_size(4096, 8, 0) == 1 and group_size(4096, 8, per - 1) == 1  # at least one
    assert group_size(4096, 8, 3 * per) == 3 and group_size(4096, 8, 100 * per) == 8  # at most E
    assert group_size(4096, 8) == 8  # the default bound holds a twin's whole layer


def test_bitsandbytes_kernel_path_is_the_same_bits(monkeypatch):
    """The CUDA branch (bitsandbytes' ``dequantize_4bit``), run through bitsandbytes' CPU kernel."""
    bnbf = pytest.importorskip("bitsandbytes.functional")
    calls = []
    real = bnbf.dequantize_4bit
    torch.manual_seed(0)
    weights = torch.randn(6, 64, 96) * 0.05  # 96 % 64 != 0: the flat layout matters
    for dtype in (torch.float32, torch.bfloat16):
        for double_quant in (True, False):
            q = NF4Experts(weights, transposed=False, double_quant=double_quant).to(dtype)
            want = {ids: q.dequant(ids) for ids in [(0,), (1, 2, 3), (0, 2, 5), tuple(range(6))]}  # torch
            with monkeypatch.context() as m:
                m.setattr(nf4, "BNB_DEVICES", ("cuda", "cpu"))
                m.setattr(bnbf, "dequantize_4bit", lambda *a, **k: calls.append(1) or real(*a, **k))
                calls.clear()
                for ids, w in want.items():
                    assert torch.equal(q.dequant(ids), w), (dtype, double_quant, ids)
                assert len(calls) == len(want)  # one bitsandbytes call per group


def _syncs(experts, hidden, idx, w):
    with SyncCounter(profile=True) as fwd:
        out = experts(hidden, idx, w)
    with SyncCounter(profile=True) as bwd:
        out.float().square().sum().backward()
    return dict(fwd.by_op), dict(bwd.by_op)


def _profiled_reads(experts, hidden, idx, w) -> int:
    """Host reads the torch profiler sees in one forward + backward (``item`` always calls the first)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        experts(hidden, idx, w).float().square().sum().backward()
    return sum(1 for e in prof.events() if e.name in ("aten::_local_scalar_dense", "aten::nonzero"))


def test_hit_groups_add_no_sync(spy):
    hidden, idx, w = _layer_inputs(24, (0, 2, 3, 5, 7))
    counts = {}
    for bound in (PER_EXPERT, None, 2 * 64 * 64 * nf4.DEQUANT_BYTES_PER_WEIGHT):
        experts = _layer(bound=bound)
        _fwd_bwd(experts, hidden, idx, w)  # warm-up (first-forward checks)
        spy.clear()
        counts[bound] = (_syncs(experts, hidden, idx, w), _profiled_reads(experts, hidden, idx, w))
        assert spy
    print("syncs (fwd by op, bwd by op), profiler reads:", counts)
    # the loop path's ONE read-back per layer forward (host ends + data checks), nothing in backward; the
    # profiler sees no read inside a kernel (the ``tolist`` itself never reaches the dispatcher on a CPU)
    assert counts[PER_EXPERT] == (({"tolist": 1}, {}), 0)
    assert counts[None] == counts[PER_EXPERT]
    assert counts[2 * 64 * 64 * nf4.DEQUANT_BYTES_PER_WEIGHT] == counts[PER_EXPERT]


def _peak_bytes(experts, hidden, idx, w) -> int:
    """Peak bytes allocated above the start of one forward + backward (fastkit.plan.memprobe)."""
    from fastkit.plan.memprobe import measure_peak

    def run():
        experts(hidden, idx, w).sum().backward()

    run()  # warm-up
    return measure_peak(run)[1]


@pytest.mark.parametrize("size", [1, 4])
def test_peak_memory_is_one_group_and_the_planner_counts_that_group(size, spy):
    from fastkit.plan.planner import dequant_group_bytes
    from fastkit.plan.terms import shape_of

    sixteen = twin("qwen3_moe", hidden_size=256, moe_intermediate_size=256, num_experts=16, num_experts_per_tok=2,
                   num_hidden_layers=1).model.layers[0].mlp.experts.requires_grad_(False)
    one = sixteen.gate_up_proj.shape[1:].numel()  # weights of one expert's largest projection
    bound = size * one * nf4.DEQUANT_BYTES_PER_WEIGHT
    attach_experts(sixteen, MoEConfig(mode="loop"))
    experts = _layer(num_experts=16, size=256, bound=bound)
    hidden, idx, w = _layer_inputs(32, tuple(range(16)), size=256)
    base = _peak_bytes(sixteen, hidden, idx, w)  # the same loop on fp32 weights: activations and gradients only
    spy.clear()
    peak = _peak_bytes(experts, hidden, idx, w)
    largest = max(spy.bytes)  # the largest call's transient, over both projections
    planned = dequant_group_bytes(shape_of(experts.config), bound)  # what fastkit.plan adds for this bound
    print(f"hit groups of <= {size} gate_up experts: peak extra {peak / 2**20:.2f} MiB = 16-bit layer "
          f"{base / 2**20:.2f} + {(peak - base) / 2**20:.2f} MiB; planned group {planned / 2**20:.2f} MiB; "
          f"one expert fp32 {one * 4 / 2**20:.2f} MiB")
    assert max(len(g) for g, b in zip(spy, spy.bytes) if b // len(g) == one * nf4.DEQUANT_BYTES_PER_WEIGHT) == size
    assert largest == planned  # the planner counts the largest call the forward makes...
    assert planned == size * one * nf4.DEQUANT_BYTES_PER_WEIGHT  # ...which is what the bound allows
    assert peak - base <= planned  # ...and what it costs is within that count
    assert peak - base > (size - 1) * one * 4  # a group's fp32 values really are alive at once
