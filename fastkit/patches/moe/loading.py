"""4-bit experts at load time: quantize each expert projection as the checkpoint is read.

What it replaces. Quantizing after ``from_pretrained`` returns (:func:`fastkit.patches.moe.nf4.quantize_experts`)
needs the whole model in 16-bit first: ~42 GB of host RAM for GPT-OSS-20B (its MXFP4 experts are
expanded to bf16 by transformers), where a Colab runtime has ~12.7 GB. :class:`QuantizeWhileLoading` runs
inside ``from_pretrained`` instead (through ``fastkit._hf.on_param_loaded``) and stores each expert
projection 4-bit the moment transformers sets it.

Which 4-bit format. 16-bit checkpoints (Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3, Qwen2-MoE) get NF4
(:class:`~fastkit.patches.moe.nf4.NF4Experts`, bitsandbytes' bytes). GPT-OSS ships its experts AS MXFP4
values; transformers expands them to bf16, where every one of those values is exact (``e2m1 · 2**k``),
so :func:`mxfp4_from_values` recovers MXFP4 blocks that dequantize to exactly the shipped values and
:class:`~fastkit.patches.moe.nf4.MXFP4Experts` keeps them: no second rounding (NF4 of those values
would add 0.073 relative RMS error, tests/test_moe_4bit.py) at 0.266x of 16-bit. When the values are
not exactly MXFP4 (a fine-tuned bf16 GPT-OSS, or an fp16 load that rounded them), NF4 is used.

What must not change. At most one 16-bit expert projection is alive at any time during the load
(``peak_16bit_bytes``, tests/test_moe_4bit_load.py); the stored experts equal what
``quantize_experts`` stores after a plain load, byte for byte; MXFP4 is kept only when it reproduces
the loaded values exactly (checked expert by expert with ``torch.equal``).
"""

from __future__ import annotations

import torch
from torch import nn

from fastkit import _hf, _torch
from fastkit.patches.moe.nf4 import BLOCKSIZE, E2M1, MXFP4Experts, _quantize_param
from fastkit.patches.moe.patch import experts_modules, projection_names


def mxfp4_from_values(w: torch.Tensor) -> MXFP4Experts | None:
    """Experts ``w (E, in, out)`` whose values are exactly MXFP4 as :class:`MXFP4Experts`, else None.

    Per block of 32 ``in`` values of one output row: ``k = floor(log2(max|v|)) - 2`` puts the largest
    magnitude in [4, 8), i.e. on e2m1's 4 or 6, and every other value of an MXFP4 block then lands on an
    e2m1 code too (a smaller shared exponent only doubles codes, which stay in the table up to 6).
    """
    e, d_in, d_out = w.shape
    if d_in % 32 or not w.dtype.is_floating_point:
        return None
    mags = torch.tensor(E2M1[:8], device=w.device)  # sorted magnitudes, code = index (sign in bit 3)
    blocks = torch.empty(e, d_out, d_in // 32, 16, dtype=torch.uint8, device=w.device)
    scales = torch.empty(e, d_out, d_in // 32, dtype=torch.uint8, device=w.device)
    for i in range(e):  # one expert at a time: the temporaries stay one expert's size
        v = w[i].t().float().reshape(d_out, d_in // 32, 32)  # (out, G, 32): the checkpoint's block layout
        amax = v.abs().amax(-1)  # (out, G)
        k = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=1e-38))) - 2, torch.zeros_like(amax))
        if k.min() < -127 or k.max() > 127:
            return None
        x = v / torch.exp2(k).unsqueeze(-1)  # (out, G, 32): e2m1 values when w is MXFP4
        idx = torch.searchsorted(mags, x.abs().contiguous()).clamp_(max=7)  # (out, G, 32)
        code = idx | (torch.signbit(x).to(idx.dtype) << 3)  # (out, G, 32) 4-bit codes
        blocks[i] = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)  # (out, G, 16), low nibble first
        scales[i] = (k + 127).to(torch.uint8)
    kept = MXFP4Experts(blocks, scales, dtype=w.dtype)
    if all(torch.equal(kept.in_out(i), w[i]) for i in range(e)):
        return kept
    return None


class QuantizeWhileLoading:
    """Quantize each expert projection the moment the loader sets it (``_hf.on_param_loaded`` callback).

    # Note: [quantize as read]
    transformers builds the model on the meta device and sets one converted target at a time (a fused
    ``experts.gate_up_proj`` is stacked from its per-expert checkpoint tensors, or expanded from
    GPT-OSS' MXFP4 blocks, right before it is set). Storing it 4-bit right there and dropping the 16-bit
    tensor means at most ONE 16-bit expert projection exists at any time, on the host (CPU load) or on
    the GPU (``device_map``): the load peaks at the 4-bit model plus one projection, not the 16-bit model.
    """

    def __init__(self, keep_mxfp4: bool = False, blocksize: int = BLOCKSIZE, double_quant: bool = True):
        self.keep_mxfp4 = keep_mxfp4
        """Try :func:`mxfp4_from_values` first (an MXFP4 checkpoint: GPT-OSS)."""
        self.blocksize, self.double_quant = blocksize, double_quant
        self.nf4 = 0
        """Expert projections stored NF4 during the load."""
        self.mxfp4 = 0
        """Expert projections kept as their exact MXFP4 blocks."""
        self.peak_16bit_bytes = 0
        """Largest total of 16-bit expert bytes alive in the model at any callback (before storing 4-bit)."""
        self._experts: list[nn.Module] | None = None

    def _alive_16bit(self) -> int:
        return sum(p.numel() * p.element_size() for m in self._experts for pname in projection_names(m)
                   if isinstance(p := _torch.module_dicts(m)["_parameters"].get(pname), torch.Tensor) and not p.is_meta)

    def __call__(self, model: nn.Module, target_name: str) -> None:
        module_path, _, pname = target_name.rpartition(".")
        m = model.get_submodule(module_path) if module_path else model
        if not _hf.is_decorated_experts(m) or pname not in projection_names(m) or _hf.is_expert_parallel(m):
            return  # expert parallelism: quantize_experts refuses it with a message after the load
        if self._experts is None:
            self._experts = [e for _, e in experts_modules(model)]
        self.peak_16bit_bytes = max(self.peak_16bit_bytes, self._alive_16bit())
        w = _torch.module_dicts(m)["_parameters"].get(pname)
        if self.keep_mxfp4 and w is not None and not w.is_meta and m.is_transposed:
            kept = mxfp4_from_values(w.data)  # GPT-OSS experts are (E, in, out): is_transposed
            if kept is not None:
                del _torch.module_dicts(m)["_parameters"][pname]
                setattr(m, pname, kept)
                self.mxfp4 += 1
                return
        self.nf4 += _quantize_param(m, pname, self.blocksize, self.double_quant)

    def summary(self) -> str:
        return (f"{self.nf4} expert projections stored NF4, {self.mxfp4} kept MXFP4, at most "
                f"{self.peak_16bit_bytes / 2**20:.1f} MiB of 16-bit experts alive during the load")


__all__ = ["QuantizeWhileLoading", "mxfp4_from_values"]
