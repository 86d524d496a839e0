"""fp16 safety for bf16-trained models (registry name ``fp16_residual``): the residual stream in fp32.

    patch.py     ``Fp16ResidualPatch``, ``protect_fp16`` (applied by ``FastModel`` for fp16 compute of a
                 checkpoint not saved in fp16)
"""

from fastkit.patches.fp16.patch import FP16_RESIDUAL, Fp16ResidualPatch, protect_fp16

__all__ = ["FP16_RESIDUAL", "Fp16ResidualPatch", "protect_fp16"]
