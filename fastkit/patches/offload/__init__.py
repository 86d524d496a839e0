"""Double-buffered activation-checkpoint reload (registry name ``offload``).

    patch.py      glue: ``OffloadConfig``, ``decide``, host-RAM checks, ``OffloadPatch``, ``enable_offload``
    pipeline.py   pure torch: pack/unpack hooks, host and device buffer pools, prefetch, the Notes
    streams.py    pure torch: the copy stream on CUDA or on a CPU worker thread
"""

from fastkit.patches.offload.patch import (
    CONTROLLER_ATTR,
    Decision,
    OffloadConfig,
    OffloadPatch,
    checkpointed_layers,
    decide,
    enable_offload,
    offload_active,
    offload_controller,
)

__all__ = ["CONTROLLER_ATTR", "Decision", "OffloadConfig", "OffloadPatch", "checkpointed_layers", "decide",
           "enable_offload", "offload_active", "offload_controller"]
