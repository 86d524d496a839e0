"""4-bit MoE experts: bitsandbytes NF4 storage per expert, dequantized one hit group of experts at a time.

What it replaces. ``load_in_4bit=True`` through transformers' bitsandbytes quantizer turns ``nn.Linear``
into ``Linear4bit`` only; the 3-D expert tensors (``gate_up_proj`` / ``up_proj`` / ``down_proj``
``(E, ·, ·)``) of every ``@use_experts_implementation`` family stay 16-bit, and they are ~95% of the
weights of GPT-OSS-20B and Qwen3-30B-A3B. :func:`quantize_experts` replaces each such parameter, layer by
layer, by an :class:`NF4Experts` module holding the bitsandbytes NF4 format of the whole tensor:
4-bit codes packed two per byte (high nibble first), blockwise absmax (64 values per block) and double
quantization (the absmax bytes quantized with bitsandbytes' 8-bit dynamic map in blocks of 256, plus
an fp32 offset). The bytes are exactly what ``bitsandbytes.functional.quantize_4bit(W, blocksize=64,
compress_statistics=True, quant_type="nf4")`` produces (tests/test_moe_4bit.py); because ``in·out`` is a
multiple of 64, no block crosses an expert, so expert ``e`` is the slice ``packed[e]`` / ``absmax[e]``.

How the experts run. :class:`NF4Experts` is a "weight provider": fastkit's experts forward
(:mod:`fastkit.patches.moe.patch`) hands it the sorted rows and the host-side group ends (the loop path,
one count read-back per layer per forward, see Note: [host counts] in ``moe_routing``), and
:class:`_NF4GroupMM` dequantizes ONLY the experts that received tokens, one hit group at a time
(:func:`hit_groups`: consecutive hit experts, as many as ``MoEConfig.dequant_group_bytes`` allows, at
least one), right before their GEMMs, and again in backward for ``grad_x``. Nothing dequantized is saved
for backward (ctx keeps a reference to the module, whose storage lives anyway), so the extra memory of a
layer is one group's dequantized weights plus their unpacking temporaries (:func:`group_size`: the same
bound ``fastkit.plan`` counts), never ``E`` of them unless they fit the bound. The base weights are
buffers: frozen by construction; LoRA (fastkit's ``ExpertLoRA``) is added per group on top.

Dequantization. ONE call per hit group (Note: [hit groups]). On CUDA the 4-bit values go through
bitsandbytes' kernel (``bitsandbytes.functional.dequantize_4bit`` with a ``QuantState`` of the group's
codes and fp32 absmax; the double quantization is undone first, in torch, because bitsandbytes' nested
state covers the whole tensor and a group's absmax codes need not start on one of its 256-value
blocks). Elsewhere (CPU), or without bitsandbytes, it is pure torch: a 256-entry byte -> two-values
table, times the absmax. Both are bit-exact with bitsandbytes' ``dequantize_4bit`` and with the
per-expert path (``dequant_group_bytes=0``): every value is computed elementwise, the same way, whatever
the group (tests/test_moe_4bit_groups.py). bitsandbytes' own CPU inference path (``Linear4bit`` repacks
its weight after an eval forward and then computes gradients outside autograd) is never entered:
experts never become ``Linear4bit`` here.

GPT-OSS MXFP4 checkpoints. Two ways were built and measured: dequantize + requantize to NF4 (one
format for all six families; NF4 with double quantization costs 4.127 bits per weight vs MXFP4's
4.25), or keep the MXFP4 values. Requantizing adds a second rounding of 0.073 relative RMS against the
shipped MXFP4 values (:func:`requantize_error`, tests/test_moe_4bit.py; NF4 of the original weights:
0.092). Since GPT-OSS was released AS those MXFP4 values, keeping them is exact: :class:`MXFP4Experts`
(same :class:`_NF4GroupMM` loop; e2m1 table times ``2**(scale - 127)``, equal to transformers'
``convert_moe_packed_tensors`` bit for bit, 0.266x of 16-bit). So: MXFP4 kept for GPT-OSS, NF4 for the
16-bit checkpoints of the other families. Both are stored while the checkpoint is read, one projection
at a time (:mod:`fastkit.patches.moe.loading`), so no load holds the 16-bit experts.

What must not change. Logits and LoRA gradients equal those of the same model whose expert weights
are the dequantized values (fp32: to rounding), and equal the per-expert path bit for bit; a hit group
holds at most :func:`group_size` experts (one, when one expert alone exceeds the bound); the hit groups
come from the host ends, never from a device read; no dequantized tensor is saved for backward;
unsupported layouts fail in :func:`quantize_experts` with a :class:`fastkit.errors.FastkitError` that
names the module.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from fastkit import _hf, _torch
from fastkit.errors import FastkitError
from fastkit.patches.sizes import DEQUANT_BYTES_PER_WEIGHT, DEQUANT_GROUP_BYTES, group_size  # planned the same

logger = logging.getLogger(__name__)

BLOCKSIZE = 64
"""Values per absmax block (bitsandbytes' default for 4-bit)."""
NESTED_BLOCKSIZE = 256
"""Absmax values per block of the double quantization (bitsandbytes' ``compress_statistics``)."""
CHUNK_VALUES = 1 << 22
"""Values quantized per pass: temporaries stay ~16 bytes x 4M (64 MiB), whatever the tensor's size (a
GPT-OSS-20B ``gate_up_proj`` has 531M values: quantized in one pass it would need ~8 GB of temporaries)."""
BNB_DEVICES = ("cuda",)
"""Device types whose 4-bit NF4 values go through bitsandbytes' ``dequantize_4bit`` (when it imports);
tests add ``"cpu"`` to run the same call through bitsandbytes' CPU kernel."""


def hit_groups(host_ends: tuple[int, ...], size: int) -> list[tuple[tuple[int, int, int], ...]]:
    """The experts that received rows, ``(expert, first row, end row)``, in chunks of at most ``size``.

    # Note: [hit groups]
    Built from the host ends the loop path already read back (Note: [host counts] in ``routing``): no
    device read, and the backward reuses the same plan from ctx. A chunk of consecutive experts is one
    slice of the codes (no copy, no index); otherwise its index is built on the host (CPU: free; CUDA:
    copied from pinned memory with ``non_blocking=True``, which does not wait for the device). Rows
    stay sorted by expert, so a chunk's rows are one contiguous range too.
    """
    hits, start = [], 0
    for e, end in enumerate(host_ends):
        if end > start:
            hits.append((e, start, end))
        start = end
    return [tuple(hits[i:i + size]) for i in range(0, len(hits), size)]


def _consecutive(ids: tuple[int, ...]) -> bool:
    return ids[-1] - ids[0] == len(ids) - 1


def _index(ids: tuple[int, ...], device: torch.device) -> torch.Tensor | None:
    """``(G,)`` int64 index of non-consecutive experts on ``device`` (Note: [hit groups]); None when consecutive."""
    if _consecutive(ids):
        return None
    if device.type == "cuda":
        return torch.tensor(ids, dtype=torch.long, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(ids, dtype=torch.long, device=device)


def _select(t: torch.Tensor, ids: tuple[int, ...], idx: torch.Tensor | None) -> torch.Tensor:
    """``t (E, ...)`` -> ``(G, ...)`` rows ``ids``: a slice (consecutive) or one ``index_select``."""
    return t.narrow(0, ids[0], len(ids)) if idx is None else t.index_select(0, idx)


def _unpack(pairs: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """``codes (..., m)`` uint8 -> ``(numel, 2)`` fp32: the two values of each byte, from the ``(256, 2)`` table.

    ``index_select`` with an int32 index: 2 + 4 bytes per weight at the peak. ``pairs[codes.int()]`` gives
    the same values but converts the index to int64 first (2 + 4 + 4).
    """
    return pairs.index_select(0, codes.reshape(-1).int())  # (numel, 2)


def _bnb_dequantize(codes: torch.Tensor, absmax: torch.Tensor, blocksize: int, dtype: torch.dtype):
    """bitsandbytes' NF4 kernel on ``codes (G, n/2)`` uint8 and ``absmax (G, n/bs)`` fp32 -> ``(G·n,)``, or None.

    The shape is given flat: bitsandbytes' CPU kernel blocks per row of its shape, its CUDA kernel over
    the flat buffer; flat, both read the format as it is stored (blocks of ``blocksize`` consecutive values).
    """
    if codes.device.type not in BNB_DEVICES:
        return None
    try:
        from bitsandbytes.functional import QuantState, dequantize_4bit
    except ImportError:
        return None
    n = 2 * codes.numel()
    state = QuantState(absmax=absmax.reshape(-1), shape=torch.Size((n,)), blocksize=blocksize, quant_type="nf4",
                       dtype=dtype)
    return dequantize_4bit(codes.reshape(-1, 1), quant_state=state).reshape(-1)  # (n,) (CPU returns (1, n))

NF4_CODE = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
], dtype=torch.float32)
"""bitsandbytes' NF4 table (``get_4bit_type("nf4")``), index = 4-bit code."""


def dynamic_code() -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic map (``create_dynamic_map()``, 256 sorted values), in fp32."""
    data: list[float] = []
    for i in range(7):  # max_exponent_bits=7, total_bits=8, signed
        bounds = torch.linspace(0.1, 1, 2 ** i + 1, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        data += ((10 ** (-6 + i)) * means).tolist() + (-(10 ** (-6 + i)) * means).tolist()
    data += [0.0, 1.0]
    data += [0.0] * (256 - len(data))
    return torch.tensor(sorted(data), dtype=torch.float32)


def _blockwise(flat: torch.Tensor, code: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``flat (n,)`` fp32 -> (nearest code index per value (n,) int32, absmax per block (nb,) fp32).

    bitsandbytes' reference algorithm (backends/default/ops.py): scale by ``1/absmax``, clamp to
    [-1, 1], bucketize against the midpoints of the sorted code. A short last block has its own absmax.
    """
    n = flat.numel()
    full = n - n % blocksize
    blocks = flat[:full].view(-1, blocksize)  # (nb, bs)
    absmax = blocks.abs().amax(dim=-1)  # (nb,)
    scaled = torch.clamp(blocks * (1.0 / absmax.clamp(min=1e-38)).view(-1, 1), -1, 1).reshape(-1)  # (full,)
    if full < n:
        am = flat[full:].abs().max().clamp(min=1e-38)
        absmax = torch.cat([absmax, am.view(1)])
        scaled = torch.cat([scaled, torch.clamp(flat[full:] / am, -1, 1)])
    bounds = (code[:-1] + code[1:]) / 2
    return torch.bucketize(scaled, bounds.to(flat.device), out_int32=True), absmax


def quantize_nf4(w: torch.Tensor, blocksize: int = BLOCKSIZE, double_quant: bool = True) -> dict[str, torch.Tensor]:
    """bitsandbytes' NF4 format of ``w`` (any shape), as plain tensors.

    Returns ``packed`` (n/2,) uint8 (element 2i in the high nibble), ``absmax`` (nb,) fp32, or with
    ``double_quant``: ``absmax`` (nb,) uint8 codes, ``absmax2`` fp32 per 256 of them, ``code2`` (256,)
    and ``offset`` () fp32 (the mean subtracted before the 8-bit quantization).
    """
    src = w.detach().reshape(-1)  # (n,)
    n = src.numel()
    if n % 2:
        raise FastkitError(f"NF4 packs two values per byte; a tensor of {n} values cannot be packed.")
    packed = torch.empty(n // 2, dtype=torch.uint8, device=src.device)  # (n/2,)
    parts = []
    step = CHUNK_VALUES - CHUNK_VALUES % (2 * blocksize)  # whole blocks, an even count: the same bytes as one pass
    for start in range(0, n, step):
        flat = src[start:start + step].float()  # (≤ step,) fp32: the only full-precision copy, one chunk's size
        q, am = _blockwise(flat, NF4_CODE.to(flat.device), blocksize)
        q8 = q.to(torch.uint8)
        packed[start // 2:(start + flat.numel()) // 2] = (q8[::2] << 4) | q8[1::2]
        parts.append(am)
        del q, q8, flat
    absmax = torch.cat(parts)  # (nb,) fp32
    out = {"packed": packed}
    if double_quant:
        offset = absmax.mean()
        code2 = dynamic_code().to(absmax.device)
        q2, absmax2 = _blockwise(absmax - offset, code2, NESTED_BLOCKSIZE)
        out.update(absmax=q2.to(torch.uint8), absmax2=absmax2, code2=code2, offset=offset)
    else:
        out["absmax"] = absmax
    return out


def _pair_table(device: torch.device) -> torch.Tensor:
    """``(256, 2)`` fp32: the two NF4 values of each byte (high nibble first)."""
    b = torch.arange(256, device=device)
    return torch.stack([NF4_CODE.to(device)[b >> 4], NF4_CODE.to(device)[b & 15]], dim=1)


class NF4Experts(nn.Module):
    """One expert projection ``(E, a, b)`` stored in bitsandbytes' NF4 format, dequantized per expert.

    Buffers (frozen by construction): ``packed`` (E, a·b/2) uint8, ``absmax`` (E, a·b/64) fp32 or
    uint8 codes with ``absmax2``/``code2``/``offset`` (double quantization). ``shape`` is the math
    layout ``(E, in, out)`` the experts forward consumes; ``dtype`` the compute dtype.
    """

    def __init__(self, weight: torch.Tensor, transposed: bool, blocksize: int = BLOCKSIZE,
                 double_quant: bool = True):
        super().__init__()
        if weight.dim() != 3 or not weight.dtype.is_floating_point:
            raise FastkitError(f"NF4Experts needs a floating-point (E, a, b) tensor, got {weight.dtype} "
                               f"{tuple(weight.shape)}.")
        e, a, b = weight.shape
        if (a * b) % blocksize:
            raise FastkitError(f"expert matrix {a}x{b} is not a multiple of the NF4 block ({blocksize}); "
                               "experts would share blocks. Use a blocksize that divides it.")
        self.stored_shape = (e, a, b)
        self.transposed = transposed
        """True when the stored layout is already ``(E, in, out)`` (``is_transposed`` experts)."""
        self.blocksize = blocksize
        self._dtype = weight.dtype
        for k, v in quantize_nf4(weight, blocksize, double_quant).items():
            self.register_buffer(k, v.view(e, -1) if k in ("packed", "absmax") else v)
        self._pairs = _pair_table(weight.device)  # Note: [pair table] below

    # -- what moe_routing / moe_lora read -------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def num_experts(self) -> int:
        return self.stored_shape[0]

    @property
    def shape(self) -> torch.Size:
        """``(E, in, out)``: the math layout (what ``moe_routing.in_out`` gives for a tensor)."""
        e, a, b = self.stored_shape
        return torch.Size((e, a, b) if self.transposed else (e, b, a))

    def size(self, dim: int | None = None):
        """Like ``Tensor.size`` on the ``(E, in, out)`` math layout."""
        return self.shape if dim is None else self.shape[dim]

    def _apply(self, fn, recurse=True):  # model.to(dtype) changes the compute dtype, not the codes
        probe = fn(torch.empty(0, dtype=self._dtype))
        if probe.dtype.is_floating_point:
            self._dtype = probe.dtype
        keep = {k: getattr(self, k) for k in ("absmax2", "code2", "offset") if hasattr(self, k)}
        if self.absmax.dtype == torch.float32:
            keep["absmax"] = self.absmax
        out = super()._apply(fn, recurse)
        for k, v in keep.items():  # fp32 statistics and table stay fp32 (moved to the new device only)
            setattr(self, k, v.to(self.packed.device))
        return out

    # -- dequantization -------------------------------------------------------------------------
    @property
    def pairs(self) -> torch.Tensor:
        """``(256, 2)`` fp32 values of each code byte, on the codes' device.

        # Note: [pair table]
        A constant, so not a buffer: transformers' ``from_pretrained`` replaces every non-persistent buffer
        with ``empty_like`` after loading (and re-initializes only the ones it knows), which would leave
        garbage here when experts are stored during the load (patches/moe_4bit_load.py).
        """
        if self._pairs.device != self.packed.device:
            self._pairs = self._pairs.to(self.packed.device)
        return self._pairs

    def absmax_rows(self, ids: tuple[int, ...], idx: torch.Tensor | None = None) -> torch.Tensor:
        """Block absmax of experts ``ids`` ``(G, a·b/64)`` fp32 (double quantization undone as bitsandbytes does)."""
        rows = _select(self.absmax, ids, idx)  # (G, nb)
        if not hasattr(self, "absmax2"):
            return rows
        nb = self.absmax.size(1)
        first = (torch.arange(ids[0], ids[0] + len(ids), device=rows.device) if idx is None else idx) * nb  # (G,)
        block = (first.unsqueeze(1) + torch.arange(nb, device=rows.device)) // NESTED_BLOCKSIZE  # (G, nb) nested block
        return self.code2[rows.long()] * self.absmax2[block] + self.offset  # (G, nb) fp32

    def dequant(self, ids: tuple[int, ...]) -> torch.Tensor:
        """Experts ``ids`` dequantized in ONE call: ``(G, a, b)`` stored layout, compute dtype (bit-exact with bnb).

        Note: [hit groups] for the gather; bitsandbytes' kernel where :data:`BNB_DEVICES` says, else torch.
        """
        g, (_, a, b) = len(ids), self.stored_shape
        idx = _index(ids, self.device)
        codes = _select(self.packed, ids, idx)  # (G, a·b/2) uint8
        absmax = self.absmax_rows(ids, idx)  # (G, nb) fp32
        out = _bnb_dequantize(codes, absmax, self.blocksize, self._dtype)
        if out is not None:
            return out.view(g, a, b)
        vals = _unpack(self.pairs, codes)  # (G·a·b/2, 2) fp32
        vals = vals.view(g, -1, self.blocksize).mul_(absmax.unsqueeze(-1))  # (G, nb, bs)
        return vals.view(g, a, b).to(self._dtype)

    def stored(self, e: int) -> torch.Tensor:
        """Expert ``e`` dequantized, in the stored layout ``(a, b)`` and compute dtype (bit-exact with bnb)."""
        return self.dequant((e,))[0]

    def in_out(self, e: int) -> torch.Tensor:
        """Expert ``e`` as ``(in, out)`` (a view of one fresh dequantized matrix)."""
        w = self.stored(e)
        return w if self.transposed else w.t()

    def in_out_group(self, ids: tuple[int, ...]) -> torch.Tensor:
        """Experts ``ids`` as ``(G, in, out)`` (a view of one fresh dequantized group)."""
        w = self.dequant(ids)  # (G, a, b)
        return w if self.transposed else w.transpose(-2, -1)

    def dequantize(self) -> torch.Tensor:
        """ALL experts in the stored layout ``(E, a, b)`` (tests and export only; the forward never calls it).

        Filled group by group (:func:`group_size` at the default bound): the temporaries stay one group's.
        """
        e, a, b = self.stored_shape
        out = torch.empty(e, a, b, dtype=self._dtype, device=self.device)  # (E, a, b)
        size = group_size(a * b, e)
        for first in range(0, e, size):
            ids = tuple(range(first, min(e, first + size)))
            out[first:first + len(ids)] = self.dequant(ids)
        return out

    def nbytes(self) -> int:
        """Bytes of the quantized storage (codes + statistics)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def group_matmul(self, x: torch.Tensor, host_ends: tuple[int, ...] | None,
                     max_bytes: int | None = None) -> torch.Tensor:
        """``x (S, in)`` sorted rows -> ``(S, out)``: ``x[rows of e] @ W_e`` per expert that got rows.

        Experts are dequantized by hit group (:func:`hit_groups`, :func:`group_size` with ``max_bytes``).
        """
        if host_ends is None:
            raise FastkitError("4-bit experts run on the host-count loop path (MoEConfig.mode='auto' or 'loop').")
        _, a, b = self.stored_shape
        groups = hit_groups(host_ends, group_size(a * b, self.num_experts, max_bytes))
        return _NF4GroupMM.apply(x.to(self._dtype), self, groups)

    def extra_repr(self) -> str:
        dq = "double-quant" if hasattr(self, "absmax2") else "fp32 absmax"
        return f"E={self.num_experts}, in_out={tuple(self.shape[1:])}, nf4, block={self.blocksize}, {dq}"


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""MXFP4's e2m1 values by 4-bit code (transformers' ``FP4_VALUES``)."""


class MXFP4Experts(NF4Experts):
    """GPT-OSS' shipped MXFP4 expert blocks kept as they are, dequantized one expert at a time (exact).

    ``blocks (E, rows, G, 16)`` uint8 (two e2m1 codes per byte, LOW nibble first) and ``scales (E, rows, G)``
    uint8 (e8m0: ``2**(s - 127)`` per 32 values), as in the checkpoint; expert ``e`` dequantizes to
    ``(rows, G·32)`` = ``(out, in)``, the layout transformers' ``convert_moe_packed_tensors`` transposes to
    GPT-OSS' ``(E, in, out)``. Same forward / backward loop as :class:`NF4Experts` (a subclass: "4-bit experts").
    """

    def __init__(self, blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16):
        nn.Module.__init__(self)
        if blocks.dim() == 3:  # transformers declares them (E, rows, G·16)
            blocks = blocks.view(*scales.shape, -1)
        if blocks.dim() != 4 or blocks.shape[:-1] != scales.shape or blocks.size(-1) != 16:
            raise FastkitError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match "
                               "(E, rows, G, 16) / (E, rows, G).")
        e, rows, g, _ = blocks.shape
        self.stored_shape = (e, rows, g * 32)
        self.transposed = False  # stored (out, in)
        self.blocksize = 32
        self._dtype = dtype
        self.register_buffer("packed", blocks.to(torch.uint8).contiguous())
        self.register_buffer("scales", scales.to(torch.uint8).contiguous())
        b = torch.arange(256, device=blocks.device)
        table = torch.tensor(E2M1, device=blocks.device)
        self._pairs = torch.stack([table[b & 15], table[b >> 4]], dim=1)  # (256, 2): LOW nibble first

    def _apply(self, fn, recurse=True):
        probe = fn(torch.empty(0, dtype=self._dtype))
        if probe.dtype.is_floating_point:
            self._dtype = probe.dtype
        return nn.Module._apply(self, fn, recurse)

    def dequant(self, ids: tuple[int, ...]) -> torch.Tensor:
        """Experts ``ids`` as ``(G, out, in)`` in the compute dtype, in ONE call: ``e2m1 · 2**(scale - 127)``.

        The scale multiply is in place (``x · 2**k`` is what ``torch.ldexp`` computes, exact for a power of two).
        """
        g, (_, rows, cols) = len(ids), self.stored_shape
        idx = _index(ids, self.device)
        vals = _unpack(self.pairs, _select(self.packed, ids, idx)).view(g, rows, -1, 32)  # (G, rows, Gc, 32) fp32
        scale = torch.pow(2.0, _select(self.scales, ids, idx).int().sub_(127))  # (G, rows, Gc) fp32
        vals.mul_(scale.unsqueeze(-1))  # (G, rows, Gc, 32)
        return vals.view(g, rows, cols).to(self._dtype)

    def extra_repr(self) -> str:
        return f"E={self.num_experts}, in_out={tuple(self.shape[1:])}, mxfp4 (kept from the checkpoint)"


class _NF4GroupMM(torch.autograd.Function):
    """``x (S, in) @ W_e (in, out)`` per expert, W dequantized per hit group in forward AND again in backward.

    ``groups`` is :func:`hit_groups`' plan (host ints). ctx keeps the module (its quantized buffers exist
    anyway) and the plan, never a dequantized matrix: each group is freed after its GEMMs. The GEMM of
    expert ``e`` is the same ``torch.mm`` on the same rows whatever the group (a slice of a contiguous
    ``(G, a, b)`` group has the strides of a lone expert, and, ``a·b`` being a multiple of 64 values, the
    alignment too), so the result is the per-expert path's bit for bit. The base weight is frozen, so
    backward is ``grad_x`` only.
    """

    @staticmethod
    def forward(ctx, x, weight: NF4Experts, groups):
        out = x.new_empty(x.size(0), weight.shape[-1])  # (S, out): every row lies in one hit expert
        for group in groups:
            w = weight.in_out_group(tuple(e for e, _, _ in group))  # (G, in, out)
            for j, (_, start, end) in enumerate(group):
                torch.mm(x[start:end], w[j], out=out[start:end])  # (n_e, in) @ (in, out)
            del w
        ctx.weight, ctx.groups = weight, groups
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if not ctx.needs_input_grad[0]:
            return None, None, None
        grad_out = grad_out.contiguous()
        grad_x = grad_out.new_empty(grad_out.size(0), ctx.weight.shape[1])  # (S, in)
        for group in ctx.groups:  # Note: [hit groups] the forward's plan: no read-back
            w = ctx.weight.in_out_group(tuple(e for e, _, _ in group))  # (G, in, out)
            for j, (_, start, end) in enumerate(group):
                torch.mm(grad_out[start:end], w[j].t(), out=grad_x[start:end])  # (n_e, out) @ (out, in)
            del w
        return grad_x, None, None


# ----------------------------------------------------------------------------------------------
# A model's experts: quantize layer by layer, storage bytes, the MXFP4 requantization error.
# ----------------------------------------------------------------------------------------------



def _quantize_param(m: nn.Module, pname: str, blocksize: int, double_quant: bool, swap=None) -> int:
    """Replace the 16-bit ``(E, a, b)`` parameter ``m.<pname>`` by :class:`NF4Experts`; 1 if it did.

    With ``swap`` (:class:`fastkit.patching.Swapper`) revert puts back a parameter of the same name, shape,
    dtype and ``requires_grad`` holding the dequantized values: the 16-bit original is dropped on purpose
    (keeping it would cost the memory 4-bit saves), so revert is exact in layout, NF4-rounded in values.
    """
    w = _torch.module_dicts(m)["_parameters"].get(pname)
    if w is None or w.dim() != 3 or w.is_meta or not w.dtype.is_floating_point:
        return 0
    q = NF4Experts(w.data, transposed=m.is_transposed, blocksize=blocksize, double_quant=double_quant)
    if swap is not None:
        grad = w.requires_grad  # a bool: the closure below must not hold the 16-bit weight
        del w
        swap.parameter(m, pname, q, restore=lambda: nn.Parameter(q.dequantize(), requires_grad=grad))
        return 1
    del _torch.module_dicts(m)["_parameters"][pname]
    setattr(m, pname, q)
    return 1


def _dequantize_on_undo(m: nn.Module, pname: str, swap) -> None:
    """Revert of experts that were stored 4-bit as the checkpoint was read: a dequantized parameter back (``m`` is
    the undo's argument, not a closure's: a deepcopy's revert dequantizes the copy, not the original)."""
    swap.on_undo(_put_back_dequantized, m, pname)


def _put_back_dequantized(m: nn.Module, pname: str) -> None:
    q = getattr(m, pname)
    delattr(m, pname)
    m.register_parameter(pname, nn.Parameter(q.dequantize(), requires_grad=True))


def quantize_experts(model: nn.Module, blocksize: int = BLOCKSIZE, double_quant: bool = True, swap=None) -> int:
    """Store every expert weight of ``model`` as :class:`NF4Experts`, one layer at a time. Returns the count.

    Each 16-bit ``(E, ·, ·)`` parameter is quantized and dropped before the next one, so the extra
    memory is one projection's codes. Biases (GPT-OSS) stay 16-bit and are frozen. Raises
    :class:`FastkitError` before changing anything for expert parallelism, or a MoE whose experts have no
    4-bit layout here (DBRX, Llama-4, JetMoE, already-quantized experts such as GPT-OSS' ``Mxfp4`` modules).
    ``swap`` (the loader passes one, through :func:`fastkit.patching.change`): revert dequantizes back
    (see :func:`_quantize_param`), also experts that were stored 4-bit while the checkpoint loaded.
    """
    from fastkit.patches.moe.patch import experts_modules, projection_names  # glue: moe imports nothing from here

    found = experts_modules(model)
    for name, m in model.named_modules():
        if _hf.has_no_4bit_layout(m):
            raise FastkitError(f"{name} ({type(m).__name__}): no 4-bit expert layout in fastkit for this family yet; "
                               "load it with load_in_4bit=False (16-bit experts).")
    for name, m in found:
        if _hf.is_expert_parallel(m):
            raise FastkitError(f"{name}: 4-bit experts with expert parallelism are not supported; turn expert "
                               "parallelism off (no distributed_config / tp_plan) or load_in_4bit=False.")
        for pname in projection_names(m):
            w = _torch.module_dicts(m)["_parameters"].get(pname)
            if not isinstance(getattr(m, pname, None), NF4Experts) and (w is None or w.dim() != 3):
                raise FastkitError(f"{name}.{pname}: expected an (E, a, b) parameter to quantize, got "
                                   f"{type(getattr(m, pname, None)).__name__}.")
    count = 0
    for _name, m in found:
        for pname in projection_names(m):
            if swap is not None and isinstance(getattr(m, pname, None), NF4Experts):
                _dequantize_on_undo(m, pname, swap)  # stored 4-bit as read: nothing to quantize, revert still undoes
                continue
            count += _quantize_param(m, pname, blocksize, double_quant, swap)  # 0 when already NF4 (idempotent)
        for pname, p in m.named_parameters(recurse=False):
            if pname.endswith("_bias"):
                swap.requires_grad(p, False) if swap is not None else p.requires_grad_(False)
    if count:
        logger.info("fastkit: 4-bit experts: %d expert tensors stored NF4 (block %d%s)", count, blocksize,
                ", double quantization" if double_quant else "")
    return count


def has_4bit_experts(model: nn.Module) -> bool:
    """True when ``model`` (or the model under a PEFT wrapper) holds :class:`NF4Experts`."""
    return any(isinstance(m, NF4Experts) for m in model.modules())


def expert_storage_bytes(model: nn.Module) -> tuple[int, int]:
    """``(bytes stored, bytes the same experts take in 16-bit)`` over every :class:`NF4Experts` of ``model``."""
    stored = sixteen = 0
    for m in model.modules():
        if isinstance(m, NF4Experts):
            stored += m.nbytes()
            sixteen += 2 * m.shape.numel()
    return stored, sixteen


def requantize_error(w: torch.Tensor) -> float:
    """Relative RMS error ``|NF4(w) - w| / |w|`` of one ``(E, a, b)`` tensor (e.g. MXFP4-dequantized experts)."""
    q = NF4Experts(w, transposed=True)
    d = q.dequantize().float()
    return float((d - w.float()).norm() / w.float().norm().clamp(min=1e-30))


__all__ = ["BLOCKSIZE", "BNB_DEVICES", "DEQUANT_BYTES_PER_WEIGHT", "DEQUANT_GROUP_BYTES", "E2M1", "MXFP4Experts",
           "NF4Experts", "NF4_CODE", "dynamic_code", "expert_storage_bytes", "group_size", "has_4bit_experts",
           "hit_groups", "quantize_experts", "quantize_nf4", "requantize_error"]
