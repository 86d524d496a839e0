"""Device, dtype and memory facts, read through torch (not NVML, which fails on GB10)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch

from fastkit.units import GiB, compute_dtype_name


def pick_device() -> torch.device:
    """CUDA if present, else CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def compute_dtype(cuda: bool, bf16: bool) -> torch.dtype:
    """:func:`fastkit.units.compute_dtype_name`'s rule as a torch dtype (fp32 CPU, bf16 GPU, fp16 pre-Ampere)."""
    return getattr(torch, compute_dtype_name(cuda, bf16))


def auto_dtype(device: torch.device) -> torch.dtype:
    """:func:`compute_dtype` for ``device`` (bf16 support read from the GPU itself, emulation excluded)."""
    cuda = device.type == "cuda"
    return compute_dtype(cuda, cuda and torch.cuda.is_bf16_supported(including_emulation=False))


def host_ram() -> tuple[int, int]:
    """(available, total) host RAM in bytes, through psutil (Linux, macOS and Windows alike)."""
    import psutil

    vm = psutil.virtual_memory()
    return int(vm.available), int(vm.total)


def process_rss() -> int:
    """Resident memory of this process in bytes (0 if unknown)."""
    import psutil

    try:
        return int(psutil.Process().memory_info().rss)
    except psutil.Error:
        return 0


@dataclass
class MemorySnapshot:
    """Memory now, in bytes. Device fields are 0 on CPU; host fields always filled."""

    device: str
    """'cuda:0' or 'cpu'."""
    allocated: int = 0
    """Bytes held by live tensors (torch.cuda.memory_allocated)."""
    reserved: int = 0
    """Bytes held by the caching allocator (torch.cuda.memory_reserved)."""
    peak: int = 0
    """Peak allocated since the last reset (torch.cuda.max_memory_allocated); process RSS on CPU."""
    peak_reserved: int = 0
    """Peak reserved by the caching allocator since the last reset (torch.cuda.max_memory_reserved): what
    predicts an out-of-memory error. Process RSS on CPU."""
    total: int = 0
    """Device memory in total (mem_get_info); host RAM total on CPU."""
    free: int = 0
    """Device memory free now (mem_get_info); host RAM available on CPU."""
    host_rss: int = 0
    """Resident host memory of this process."""

    def as_dict(self) -> dict:
        return asdict(self)


def memory_snapshot(device: torch.device | None = None) -> MemorySnapshot:
    """Read memory through torch on CUDA, psutil on the host."""
    device = device or pick_device()
    rss = process_rss()
    if device.type == "cuda" and torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info(device)
        return MemorySnapshot(str(device), torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device),
                              torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device),
                              total, free, rss)
    avail, total = host_ram()
    return MemorySnapshot("cpu", rss, rss, rss, rss, total, avail, rss)


def describe_device(device: torch.device) -> str:
    """One human line: GPU name and memory, or CPU cores and RAM."""
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        kind = ", unified memory" if getattr(p, "is_integrated", False) else ""
        return f"{p.name} (sm{p.major}{p.minor}, {p.total_memory / GiB:.1f} GiB{kind})"
    avail, total = host_ram()
    return f"CPU ({os.cpu_count()} cores, {avail / GiB:.1f}/{total / GiB:.1f} GiB RAM free)"
