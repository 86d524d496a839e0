"""The GPU table the planner budgets with: one row per ``--gpu`` name, each card's memory as torch reports it.

A row's ``gib`` is ``torch.cuda.get_device_properties(d).total_memory / 2**30`` on that card (the memory the
driver leaves after its own reservations, ECC included), the lowest of the readings in ``source``, rounded down
to 0.01 GiB. The CUDA context, cuBLAS workspace and kernels live inside that memory: the planner counts them
once, as its own component (``fastkit.plan.CUDA_CONTEXT``), never in these figures. ``check_fits`` on a live GPU
budgets with the same reading, so ``--gpu t4`` and a run on a T4 get the same verdict.

Rows whose figure was not read from torch on such a card say so in ``source`` ("spec sheet minus reserved, not
read from torch"): the card's memory less the share the driver reserves on a measured card of its kind.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fastkit.errors import FastkitError
from fastkit.units import GiB


@dataclass(frozen=True)
class GpuCard:
    """One ``--gpu`` name: the budget the planner uses for it and where the figure comes from."""

    gib: float
    """Total memory in GiB as torch reports it (``total_memory / 2**30``), before the CUDA context."""
    source: str
    """Where ``gib`` comes from: the card and the torch reading(s), or how it was derived when not read."""
    unified: bool = False
    """The GPU allocates from the host's own memory (``get_device_properties(d).is_integrated``)."""
    bf16: bool = True
    """The card computes in bf16 (Ampere and later); False: fastkit trains in fp16 there."""


DERIVED = "spec sheet minus reserved, not read from torch"
"""The ``source`` prefix of a row whose figure is derived, not read from torch on the card."""

TORCH = "torch's total_memory on"
"""The ``source`` prefix of a row read from torch on the card."""

CARDS: dict[str, GpuCard] = {
    "t4": GpuCard(14.74, f"{TORCH} a Colab Tesla T4 16 GB: 15,095 MiB ('Max memory = 14.741 GB'); other drivers "
                         "read 15,102-15,109 MiB", bf16=False),
    "l4": GpuCard(22.16, f"{TORCH} a Colab NVIDIA L4 24 GB: 22.168 GiB ('Max memory = 22.168 GB')"),
    "a10g": GpuCard(22.05, f"{TORCH} an NVIDIA A10G 24 GB (AWS g5): 22,587 MiB"),
    "rtx-8g": GpuCard(7.64, f"{DERIVED}: 8,192 MiB less ~360 MiB, what torch's reading leaves on the 12 and 16 GB "
                            "GeForce cards (rtx-12g, rtx-16g)"),
    "rtx-12g": GpuCard(11.65, f"{TORCH} a GeForce RTX 3060 12 GB: 11,931-12,044 MiB"),
    "rtx-16g": GpuCard(15.67, f"{TORCH} a GeForce RTX 4080 16 GB: 16,049 MiB"),
    "rtx-24g": GpuCard(23.69, f"{TORCH} a GeForce RTX 3090 24 GB: 24,259-24,268 MiB (an RTX 4090 reads 24,563)"),
    "a100-40": GpuCard(39.39, f"{TORCH} a Colab A100-SXM4-40GB: 39.394 GiB ('Max memory = 39.394 GB'); other "
                              "drivers read 39.557 GiB and 40,536 MiB"),
    "l40s": GpuCard(44.52, f"{TORCH} an NVIDIA L40S 48 GB: 45,589 MiB"),
    "a100-80": GpuCard(79.15, f"{TORCH} an A100 80GB PCIe: 79.151 GiB ('Max memory = 79.151 GB')"),
    "h100": GpuCard(79.18, f"{TORCH} an H100 80GB HBM3 (SXM): 81,082-81,090 MiB"),
    "gh200": GpuCard(95.01, f"{DERIVED}: the GH200's 96 GiB HBM3 less the H100 80GB's share (81,082 of 81,920 "
                            "MiB); its LPDDR5X is separate memory"),
    "h200": GpuCard(139.8, f"{TORCH} an NVIDIA H200 141 GB HBM3e: 143,156 MiB"),
    "spark": GpuCard(119.0, f"{DERIVED}: DGX Spark (GB10) 128 GB = 119.2 GiB, ONE pool for the CPU and the GPU",
                     unified=True),
}
"""Every GPU the planner knows by name (``--gpu`` accepts these or a number of GiB)."""

GPUS: dict[str, float] = {name: card.gib for name, card in CARDS.items()}
"""Budget in GiB by name: :data:`CARDS`' ``gib``."""
UNIFIED = frozenset(name for name, card in CARDS.items() if card.unified)
"""GPUs in :data:`CARDS` that allocate from the host's own memory (``get_device_properties(d).is_integrated``:
DGX Spark's GB10, Jetson; Apple's MPS would be one). There "host" bytes (activation offload, host weights,
pinned buffers) come out of the same pool as the GPU's, so the plan counts them against the budget, and
neither the advice nor FastModel's ``"auto"`` turns them on. Grace-Hopper (``gh200``) is not one: its GPU
allocates HBM, and host memory is a second pool behind NVLink-C2C, so offload there frees HBM as on a PCIe card."""
NO_BF16 = frozenset(name for name, card in CARDS.items() if not card.bf16)
"""GPUs in :data:`CARDS` without bf16 (pre-Ampere), where fastkit trains in fp16; a GiB number is planned as bf16."""


def gpu_name(gpu):
    """The one spelling of a ``gpu=`` value, taken where it enters the planner (``plan``): a name stripped and
    lower-cased (``"T4 "`` plans exactly as ``"t4"``), a number of GiB as it is. A number that is not finite or
    not above 0 is refused here, naming it."""
    if isinstance(gpu, str):
        return gpu.strip().lower()
    if isinstance(gpu, (int, float)) and not isinstance(gpu, bool):
        if not math.isfinite(gpu) or gpu <= 0:
            raise FastkitError(f"gpu={gpu!r}: a GPU's memory in GiB must be a finite number above 0 (e.g. 24), "
                               "or a GPU name such as 't4'.")
        return gpu
    return gpu


# -- budgets -----------------------------------------------------------------------------------------
def gpu_budget(gpu: str | float | int) -> int | None:
    """Usable bytes of a GPU name or a number of GiB; None for ``"cpu"``."""
    if isinstance(gpu, (int, float)) and not isinstance(gpu, bool):
        return int(gpu_name(gpu) * GiB)
    name = str(gpu).strip().lower()
    if name == "cpu":
        return None
    if name in CARDS:
        return int(CARDS[name].gib * GiB)
    try:
        gib = float(name.removesuffix("gib").removesuffix("gb"))
    except ValueError:
        gib = -1.0
    if gib > 0:
        return int(gpu_name(gib) * GiB)  # "inf" / "1e400" refused there, naming the size
    raise FastkitError(f"gpu={gpu!r} is not a GPU the planner knows. Use one of {', '.join(GPUS)}, "
                       "'cpu', or a number of GiB (e.g. 24).")


def is_unified(gpu: str | float | int) -> bool:
    """True for a GPU name in :data:`UNIFIED` (a number of GiB is planned as a discrete card)."""
    return isinstance(gpu, str) and gpu.strip().lower() in UNIFIED


UNIFIED_NOTE = ("unified memory: host and GPU share one pool, so activation offload and host weights save nothing "
                "and are counted against it; FastModel never turns them on here")
