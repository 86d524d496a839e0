"""Frozen weights kept in host memory (registry names ``host_embedding``, ``host_lm_head``).

    patch.py   glue: ``HostWeights`` (the knob), the two patches, the host-ids collator, ``enable_host_weights``
    rows.py    pure torch: pinned row gather, double-buffered row-chunk streaming, ``StreamedLinear``

The streamed cross-entropy over a host lm_head is in :mod:`fastkit.patches.loss.streamed`.
"""

from fastkit.patches.host.patch import (
    HOST_EMBEDDING,
    HOST_IDS_KWARG,
    HOST_LM_HEAD,
    HostEmbeddingPatch,
    HostIds,
    HostIdsCollator,
    HostLMHeadPatch,
    HostStats,
    HostWeights,
    enable_host_weights,
    host_stats,
    wrap_collator,
)

__all__ = ["HOST_EMBEDDING", "HOST_IDS_KWARG", "HOST_LM_HEAD", "HostEmbeddingPatch", "HostIds", "HostIdsCollator",
           "HostLMHeadPatch", "HostStats", "HostWeights", "enable_host_weights", "host_stats", "wrap_collator"]
