"""The byte budgets the patches work within, which the planner counts as they are (no torch here).

``fastkit plan`` answers from these numbers without importing torch; the patches import them from here, so a
change to a budget changes the forward and the plan together.
"""

from __future__ import annotations

CHUNK_BYTES = 128 * 2**20
"""Default budget for one chunk's fp32 logits (a chunk is ``CHUNK_BYTES // (4 * V)`` tokens;
``fastkit.patches.loss.chunked``, and the host lm_head's row blocks)."""

DEQUANT_BYTES_PER_WEIGHT = 8
"""Transient bytes per weight of a dequantization, an upper bound on every path: NF4 in torch peaks at the
int32 byte index (2) + the fp32 values (4), then the fp32 values + the 16-bit result (2), + the gathered
codes (0.5) when the group is not consecutive; MXFP4 the same (its scale multiply is in place). Measured
with the profiler's memory events: 6.06 (consecutive) / 6.56 (gathered) NF4, 6.50 MXFP4, fp32 or bf16
(tests/test_moe_4bit_groups.py). bitsandbytes' CUDA kernel writes the 16-bit result (2) + fp32 absmax directly."""
DEQUANT_GROUP_BYTES = 8 * 2**20
"""Default bound on one hit group's dequantization transient (``MoEConfig.dequant_group_bytes``): a
group holds ``bound // (weights per expert x DEQUANT_BYTES_PER_WEIGHT)`` experts, at least one.

Why 8 MiB (measured on this CPU, one thread, 32 experts dequantized in groups of G): a call costs a fixed
overhead plus bandwidth, and a large group's temporaries stop fitting the caches and the allocator's
reused blocks. 16 KiB of transient per expert: G=1 1.07 ms, G=32 0.11 ms; 0.25 MiB: 2.16 -> 1.18 ms (G=32);
2 MiB: 9.3 ms (G=1), 8.5 (G=4), 21.9 (G=32); 6 MiB: 25.8 (G=1), 26.3 (G=4), 88 (G=32); Qwen3-30B-A3B's
24 MiB experts: G=2 5% slower than G=1. So groups pay while they stay small: twins, quick benches and
small experts go in one call; Qwen3-30B-A3B (12-24 MiB per expert) and GPT-OSS-20B (127 MiB) stay at
one expert per call, and plan exactly as per-expert dequantization did."""


def group_size(weights_per_expert: int, num_experts: int, max_bytes: int | None = None) -> int:
    """Experts dequantized in one call: as many as ``max_bytes`` of transient allows, at least 1, at most E.

    ``max_bytes`` None: :data:`DEQUANT_GROUP_BYTES`; 0: one expert per call (the per-expert path).
    ``fastkit.plan`` counts ``group_size(...) x weights_per_expert x DEQUANT_BYTES_PER_WEIGHT``.
    """
    bound = DEQUANT_GROUP_BYTES if max_bytes is None else max_bytes
    return max(1, min(num_experts, bound // max(1, weights_per_expert * DEQUANT_BYTES_PER_WEIGHT)))


__all__ = ["CHUNK_BYTES", "DEQUANT_BYTES_PER_WEIGHT", "DEQUANT_GROUP_BYTES", "group_size"]
