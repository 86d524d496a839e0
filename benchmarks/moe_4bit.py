"""The 4-bit rows of ``python -m benchmarks moe``: one experts layer with 16-bit vs 4-bit expert weights.

Side by side, interleaved in one process, at the layer shapes of :mod:`benchmarks.moe`:

- ``fastkit 16-bit experts``: fastkit's experts forward on the 16-bit weights (the reference);
- ``fastkit 4-bit, per-expert dequant``: the same weights stored NF4 (:mod:`fastkit.patches.moe.nf4`), each
  expert that received tokens dequantized once in forward and once in backward, one call per expert
  (``MoEConfig(dequant_group_bytes=0)``);
- ``fastkit 4-bit, hit groups``: the same NF4 modules, the experts that received tokens dequantized in
  one call per hit group (the default bound, 8 MiB of transient per call); on CUDA through
  bitsandbytes' ``dequantize_4bit``, on CPU in torch. Its time is also given against the per-expert row;
- ``Linear4bit loop (anchor-style)``, CUDA + bitsandbytes only: one ``bnb.nn.Linear4bit`` per expert
  projection, tokens gathered per expert with ``nonzero`` and scattered back with ``index_add_``,
  the way per-expert QLoRA kits run MoE layers (SwiGLU for both shapes: for GPT-OSS it stands in for
  the clamped SwiGLU, the GEMMs are the same). Its CPU path is never timed (see moe_4bit).

Forward + backward with the expert weights frozen (the QLoRA setting): input and routing-weight
gradients. Per path: time (median, min, spread), the ratio to 16-bit with its range, host syncs of
one forward / backward (:class:`fastkit.SyncCounter`), the bytes the expert weights take, and the peak
extra memory of one forward + backward (the dispatch-mode tracker of the LoRA rows, so CPU and GPU
numbers mean the same).
"""

from __future__ import annotations

import gc
import time

import torch

from benchmarks.common import fmt_ms, fmt_ratio, markdown_table, timed
from benchmarks.moe_layer import PeakMemory, experts_module, inputs, layer_syncs, share_weights, step
from fastkit.units import fmt_bytes

REFERENCE = "fastkit 16-bit experts"
PER_EXPERT = "fastkit 4-bit, per-expert dequant"
GROUPS = "fastkit 4-bit, hit groups"
LOOP = "Linear4bit loop (anchor-style)"


def _loop_linear4bit(module: torch.nn.Module, compute_dtype: torch.dtype) -> torch.nn.ModuleList:
    """One bitsandbytes ``Linear4bit`` (NF4) per expert projection: ``[gate_up_0, down_0, gate_up_1, ...]``."""
    import bitsandbytes as bnb

    layers = torch.nn.ModuleList()
    for e in range(module.num_experts):
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(module, name)[e]  # (a, b)
            w = w.t() if module.is_transposed else w  # Linear stores (out, in)
            lin = bnb.nn.Linear4bit(w.size(1), w.size(0), bias=False, compute_dtype=compute_dtype, quant_type="nf4")
            lin.weight = bnb.nn.Params4bit(w.detach().cpu().contiguous(), requires_grad=False, quant_type="nf4")
            layers.append(lin)
    return layers.to(module.gate_up_proj.device)


def _loop_forward(layers: torch.nn.ModuleList, h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per expert: ``nonzero`` its tokens, gate_up -> SwiGLU -> down, ``index_add`` back (h (T, H) -> (T, H))."""
    out = torch.zeros_like(h)
    for e in range(len(layers) // 2):
        tok, k = torch.nonzero(idx == e, as_tuple=True)  # (n_e,) token rows and their top-k slots
        if tok.numel() == 0:
            continue
        gate, up = layers[2 * e](h[tok]).chunk(2, dim=-1)  # (n_e, I) each
        y = layers[2 * e + 1](torch.nn.functional.silu(gate) * up)  # (n_e, H)
        out = out.index_add(0, tok, y * w[tok, k, None].to(y.dtype))
    return out


def _storage(obj) -> int:
    return sum(b.numel() * b.element_size() for b in list(obj.parameters()) + list(obj.buffers()))


def bench_4bit(name: str, shape: dict, tokens: int, reps: int, dtype, device, clock=None) -> list[dict]:
    """Rows ``shape, impl, tokens, fwd_bwd_ms (list), storage_bytes, peak_bytes`` for one layer shape."""
    from fastkit.patches.moe.nf4 import expert_storage_bytes, quantize_experts
    from fastkit.patches.moe.patch import MoEConfig, attach_experts

    sixteen = experts_module(shape, dtype, device)
    attach_experts(sixteen, MoEConfig(validate="off"), name="bench.experts")
    h, idx, w = inputs(sixteen, tokens, shape["num_experts_per_tok"], dtype, device)
    holder = torch.nn.Module()
    holder.experts = share_weights(sixteen)  # its own parameter dict: NF4 replaces the 16-bit tensors there only
    quantize_experts(holder)
    per_expert = share_weights(holder.experts)  # the same NF4 modules, its own per-layer config
    attach_experts(holder.experts, MoEConfig(validate="off"), name="bench.experts")
    attach_experts(per_expert, MoEConfig(validate="off", dequant_group_bytes=0), name="bench.experts")
    four = expert_storage_bytes(holder)[0]
    runs = {REFERENCE: (sixteen, sum(p.numel() * p.element_size() for p in sixteen.parameters() if p.dim() == 3)),
            PER_EXPERT: (per_expert, four), GROUPS: (holder.experts, four)}
    if device.type == "cuda":
        try:
            loop = _loop_linear4bit(sixteen, dtype)
            runs[LOOP] = (lambda a, b, c: _loop_forward(loop, a, b, c), _storage(loop))
        except ImportError:
            pass
    peaks, syncs, times = {}, {}, {impl: [] for impl in runs}
    for impl, (fn, _) in runs.items():
        step(fn, h, idx, w, True)  # warm-up
        syncs[impl] = layer_syncs(fn, h, idx, w)
        gc.collect()
        tracker = PeakMemory()
        with tracker:
            step(fn, h, idx, w, True)
        peaks[impl] = tracker.peak
    for _ in range(reps):
        for impl, (fn, _) in runs.items():  # interleaved: every path sees the same machine state
            times[impl].append(1e3 * timed(lambda fn=fn: step(fn, h, idx, w, True), device, clock or time.perf_counter))
    rows = [dict(shape=name, impl=impl, tokens=tokens, fwd_bwd_ms=times[impl], storage_bytes=nbytes,
                 peak_bytes=peaks[impl], syncs_fwd=syncs[impl][0], syncs_bwd=syncs[impl][1])
            for impl, (_, nbytes) in runs.items()]
    del runs, holder, sixteen, per_expert
    gc.collect()
    return rows


def table_4bit(rows: list[dict]) -> str:
    cells = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        group = [r for r in rows if r["shape"] == shape]
        ref = next(r for r in group if r["impl"] == REFERENCE)
        per = next((r for r in group if r["impl"] == PER_EXPERT), None)
        for r in group:
            vs_per = fmt_ratio(per["fwd_bwd_ms"], r["fwd_bwd_ms"]) if r["impl"] == GROUPS and per else ""
            cells.append([shape, r["tokens"], r["impl"], fmt_ms(r["fwd_bwd_ms"]),
                          "1 (reference)" if r is ref else fmt_ratio(r["fwd_bwd_ms"], ref["fwd_bwd_ms"]), vs_per,
                          f"{r['syncs_fwd']} / {r['syncs_bwd']}", fmt_bytes(r["storage_bytes"], "MiB"),
                          f"{r['storage_bytes'] / ref['storage_bytes']:.3f}x", fmt_bytes(r["peak_bytes"], "MiB")])
    return "\n".join([
        "4-bit experts, one layer forward+backward (expert weights frozen; peak extra memory and syncs are counted, "
        "not timed). time / 16-bit > 1 means slower than fastkit on 16-bit weights; per-expert / hit groups > 1 "
        "means the hit groups are faster than one dequantization per expert (same process, interleaved):", "",
        markdown_table(["shape", "tokens", "path", "fwd+bwd ms", "time / 16-bit [range]",
                        "per-expert / hit groups [range]", "syncs fwd/bwd", "expert weights", "bytes vs reference",
                        "peak extra memory"], cells)])


__all__ = ["GROUPS", "LOOP", "PER_EXPERT", "REFERENCE", "bench_4bit", "table_4bit"]
