"""One MoE experts layer at a published shape, its inputs and one step: what ``moe.py`` and ``moe_4bit.py`` share.

Also :class:`PeakMemory`, the peak bytes of tensors alive during a step, tracked by a dispatch mode so the
number means the same on CPU and GPU.
"""

from __future__ import annotations

import copy
import weakref

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


class PeakMemory(TorchDispatchMode):
    """Peak bytes of tensors created inside the context and still alive (storage-level)."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def _track(self, t):
        if not isinstance(t, torch.Tensor):
            return
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self._seen or storage.nbytes() == 0:
            return
        self._seen.add(key)
        n = storage.nbytes()
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, n)

    def _free(self, key, n):
        self._seen.discard(key)
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # views, in-place ops and set_ return storage an input already owns: nothing new is allocated
        inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self._track(t)
        return out


def experts_module(shape: dict, dtype, device):
    from transformers import CONFIG_MAPPING
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    kw = dict(shape)
    model_type = kw.pop("model_type")
    config = CONFIG_MAPPING[model_type](**kw)
    cls = GptOssExperts if model_type == "gpt_oss" else Qwen3MoeExperts
    torch.manual_seed(0)
    with torch.device(device):
        module = cls(config)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02)
    return module.to(dtype).requires_grad_(False)


def inputs(module, tokens: int, top_k: int, dtype, device):
    g = torch.Generator(device="cpu").manual_seed(1)
    h = torch.randn(tokens, module.gate_up_proj.shape[1 if module.is_transposed else 2], generator=g)
    logits = torch.randn(tokens, module.num_experts, generator=g)
    w, idx = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    h = h.to(device, dtype).requires_grad_(True)
    return h, idx.to(device), (w / w.sum(-1, keepdim=True)).to(device, dtype).requires_grad_(True)


def step(module, h, idx, w, backward: bool):
    out = module(h, idx, w)
    if backward:
        out.float().square().mean().backward()
        h.grad = w.grad = None
    return out


def layer_syncs(fn, h, idx, w) -> tuple[int, int]:
    """Host syncs of one forward of ``fn(h, idx, w)`` and of its backward (the loss :func:`step` uses)."""
    from fastkit.syncs import SyncCounter

    with SyncCounter() as fwd:
        out = fn(h, idx, w)
    with SyncCounter() as bwd:
        out.float().square().mean().backward()
    h.grad = w.grad = None
    return fwd.total, bwd.total


def share_weights(module):
    """A second experts module over the SAME weight tensors (PEFT re-wires its own copy's dicts)."""
    twin = copy.copy(module)
    for attr in ("_parameters", "_buffers", "_modules"):
        setattr(twin, attr, dict(getattr(module, attr)))
    return twin
