"""Chunked cross-entropy (registry name ``chunked_loss``): the loss without full fp32 logits.

    patch.py     glue: ``ChunkedLossPatch``, ``enable_chunked_loss``, ``route_trainer_loss``
    chunked.py   pure torch: the chunked cross-entropy autograd function
"""

from fastkit.patches.loss.chunked import chunked_cross_entropy
from fastkit.patches.loss.patch import CHUNKED_LOSS, ChunkedLossPatch, enable_chunked_loss, route_trainer_loss

__all__ = ["CHUNKED_LOSS", "ChunkedLossPatch", "chunked_cross_entropy", "enable_chunked_loss", "route_trainer_loss"]
