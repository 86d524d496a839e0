"""Packed-sequence attention (registry name ``packing``).

    patch.py       glue: collator wrapper, per-batch metadata, attention keys, the decoder swap
    attention.py   pure torch: ``PackedBatch`` and the per-document attention kernels
    compiled.py    the same attention as one ``torch.library`` operator, for torch.compile (layout as a tensor)
    state.py       stateful layers (linear attention, causal conv, SSM) restart per document: the
                   per-document regroup (torch) and the instance swaps the patch makes for a ``stateful`` row
    varlen.py      the same on CUDA in one call of the kernels transformers already uses (causal-conv1d
                   ``seq_idx``, flash-linear-attention ``cu_seqlens``, mamba-ssm ``seq_idx``), where installed
"""

from fastkit.patches.packing.attention import PackedBatch, packed_attention
from fastkit.patches.packing.patch import (
    LENGTHS_KWARG,
    PACKED_KWARG,
    SUPPORTED_BACKENDS,
    PackedAttentionPatch,
    PackedCollator,
    batch_lengths,
    wrap_collator,
)

__all__ = ["LENGTHS_KWARG", "PACKED_KWARG", "SUPPORTED_BACKENDS", "PackedAttentionPatch", "PackedBatch",
           "PackedCollator", "batch_lengths", "packed_attention", "wrap_collator"]
