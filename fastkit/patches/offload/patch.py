"""The ``offload`` patch: double-buffered activation-checkpoint reload, swapped into a transformers model.

What it replaces. Under non-reentrant gradient checkpointing each decoder layer keeps only its
input ``(B, T, H)`` on the device; backward recomputes the layer from it. transformers'
``offload=True`` wraps each checkpoint in ``save_on_cpu(pin_memory=True)``: it copies that input
to *fresh* pinned memory on the compute stream and copies it back on demand, so every reload
stalls the backward (single buffer, no overlap). TRL's ``activation_offloading`` copies out on a
side stream but still reloads only when autograd asks. This patch swaps each checkpointed layer's
checkpoint function (the ``_gradient_checkpointing_func`` instance attribute transformers sets,
reached through :mod:`fastkit._hf`) for :class:`~fastkit.patches.offload.pipeline.OffloadedCheckpoint`,
which runs the *same* ``torch.utils.checkpoint`` call inside saved-tensor hooks that keep the input
in a reused host buffer and bring it back one layer early (:mod:`fastkit.patches.offload.pipeline`,
pure torch, holds that pipeline and its Notes on streams and buffer lifetimes).

This file is the glue: :class:`OffloadConfig`, :func:`decide` (which mode this machine gets),
the host-RAM checks, :class:`OffloadPatch` and :func:`enable_offload`.

Why build on ``torch.utils.checkpoint`` (non-reentrant) with saved-tensor hooks rather than an
own autograd Function: the checkpoint already saves exactly the layer's positional inputs through
``saved_tensors_hooks`` (one pack per input, one unpack right before the recompute), replays the
CPU and CUDA RNG state (dropout masks are identical), replays autocast, stops the recompute early
and checks that the recompute saved the same tensors. Keyword arguments -- the packed-batch
metadata (``cu_seq_lens_q/k``, ``max_length_q/k``), position embeddings, masks -- are bound into
``partial(forward, self, **kwargs)`` by transformers and reach the recompute untouched. Only the
*storage* of the saved input changes, so gradients are bitwise those of plain checkpointing.

What must not change: the tensor handed to the recompute has the input's shape, dtype, device and
values; no host sync inside a layer; ``fastkit.patching.revert`` restores the original checkpoint
function object on every layer. The pipeline's time model is in its module docstring
(checked in ``fastkit bench offload``, docs/offload.md).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch

from fastkit import _hf, registry
from fastkit.device import host_ram
from fastkit.errors import FastkitError
from fastkit.patches.offload.pipeline import OffloadController, OffloadedCheckpoint, OffloadStats
from fastkit.patches.offload.streams import CopyStreams, CpuStreams, CudaStreams, Throttle
from fastkit.patching import Swapper, apply_patch, report, unwrap
from fastkit.units import GiB, MiB, fmt_bytes

logger = logging.getLogger(__name__)

CONTROLLER_ATTR = "_fastkit_offload"


@dataclass
class OffloadConfig:
    """When and how checkpoint inputs are offloaded. Defaults fit a single consumer GPU."""

    min_tokens: int = 512
    """Keep a layer input on the device when it holds fewer tokens (``numel / hidden``, all rows of
    the batch) than this: below ~512 tokens the copies cost more than the memory is worth."""
    min_bytes: int = 1 * MiB
    """Keep a layer input on the device when it is smaller than this many bytes."""
    skip_last_layer: bool = True
    """Keep the last checkpointed layer's input on the device: backward needs it first, right
    after the forward ends, so offloading it can only add a copy to the critical path."""
    double_buffer: bool = True
    """Prefetch the next layer's input while the current layer recomputes (two device buffers).
    False: single buffer, each reload waits (the ``L*(c+g)`` baseline, for comparison)."""
    vram_headroom_bytes: int = 1 * GiB
    """Below this much free device memory at enable time, use a single device buffer."""
    pinned_budget_bytes: int | None = None
    """Most bytes of host staging buffers (pinned where pinning works). Layers that would go over
    it keep their input on the device (plain checkpointing for that layer, logged once). None:
    the host RAM available at enable time minus ``host_ram_reserve_bytes``."""
    host_ram_reserve_bytes: int = 2 * GiB
    """Host RAM left for everything else (data loader, optimizer state on CPU, the notebook)."""
    expected_tokens: int | None = None
    """Tokens per micro-batch (batch x sequence) for the host-RAM check before training. None: the
    fastkit load report's ``max_seq_length`` (batch 1) when there is one, else no up-front check."""
    pin_memory: bool = True
    """Use page-locked host buffers (fast async copies); falls back to pageable when pinning fails."""

    def check_host_ram(self, nbytes: int, held: int) -> None:
        """Raise :class:`FastkitError` when ``nbytes`` more of host RAM (``held`` already in staging buffers)
        would leave less than ``host_ram_reserve_bytes`` available. Called by the pipeline's host pool."""
        _require_host_ram(nbytes, self.host_ram_reserve_bytes,
                          f"another {nbytes / MiB:.0f} MiB of host RAM (already holding {held / GiB:.2f} GiB)",
                          " or shorter sequences")


@dataclass
class Decision:
    """What :func:`decide` chose, and why."""

    mode: str
    """``"double-buffer"``, ``"single-buffer"`` or ``"checkpoint"`` (no offload)."""
    reason: str
    """One human sentence, logged by :func:`enable_offload`."""
    device: torch.device
    """Where the model's activations live."""

    def describe(self) -> str:
        if self.mode == "checkpoint":
            return f"checkpoint (offload skipped: {self.reason})"
        return self.mode


def _model_device(model: torch.nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def decide(model: torch.nn.Module, config: OffloadConfig) -> Decision:
    """Pick the offload mode for ``model`` on this machine. Reads device facts; changes nothing."""
    device = _model_device(model)
    buffers = "double-buffer" if config.double_buffer else "single-buffer"
    if _seam(config, "force_cpu_stream", False):  # fastkit.patches.offload.testing.OffloadTestConfig only
        if device.type != "cpu":
            raise FastkitError(f"OffloadTestConfig.force_cpu_stream=True runs the pipeline on a CPU model; this model "
                               f"is on {device}. Leave force_cpu_stream off on a GPU.")
        return Decision(buffers, "CPU copy stream forced (test/benchmark pipeline)", device)
    if device.type != "cuda":
        return Decision("checkpoint", f"no CUDA device (model on {device}): activations already live in host "
                        "memory, so there is nothing to offload", device)
    props = torch.cuda.get_device_properties(device)
    if getattr(props, "is_integrated", False):
        return Decision("checkpoint", f"{props.name} has unified memory: host and device share the same RAM, "
                        "so a copy frees nothing and only costs bandwidth", device)
    free, _ = torch.cuda.mem_get_info(device)
    if config.double_buffer and free < config.vram_headroom_bytes:
        return Decision("single-buffer", f"free VRAM {free / GiB:.2f} GiB is below the "
                        f"{config.vram_headroom_bytes / GiB:.2f} GiB headroom for a second buffer", device)
    return Decision(buffers, f"{props.name}, {free / GiB:.1f} GiB free", device)


def checkpointed_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers whose checkpoint inputs are offloaded, in forward order (a PEFT wrapper is looked
    through): every checkpointed layer of a text model; of a vision-language model (a row with vision facts whose
    language model is there), the language model's decoder layers only.

    Why not the vision tower's blocks too (transformers checkpoints them as well; they keep plain
    checkpointing, their inputs stay on the device): the pipeline is one chain of layer inputs that every
    forward runs from its layer 0 (:meth:`OffloadedCheckpoint.__call__` starts the chain there), and the tower
    does not run on a text-only batch, so a chain starting in the tower would not restart on such a step; the
    tower's inputs are ``(patches, vision hidden)``, not the ``(B, T, text hidden)`` the up-front host-RAM check
    (:func:`check_host_budget`) counts per layer, and their size is known only once the images are seen. The
    language model's layers are where a long row's activations are (text and image tokens alike, every layer).
    """
    base = unwrap(model)
    return _hf.checkpointed_layers(_language_model(base) or base)


def _language_model(model: torch.nn.Module) -> torch.nn.Module | None:
    """The language model of a vision-language ``model`` (its row's ``vision.language_model`` path), else None."""
    config = getattr(model, "config", None)
    facts = registry.facts_for(getattr(config, "model_type", None) or "")
    if facts is None or facts.vision is None:
        return None
    try:
        return model.get_submodule(facts.vision.language_model)
    except AttributeError:  # the family's text model loaded alone (Gemma 3 without vision=True)
        return None


def _hidden_size(model: torch.nn.Module) -> int | None:
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    return getattr(text, "hidden_size", None)


def check_host_budget(model: torch.nn.Module, tokens: int, config: OffloadConfig | None = None) -> int:
    """Raise :class:`FastkitError` if offloading ``tokens`` per micro-batch cannot fit in host RAM.

    Returns the host bytes the offloaded layer inputs will need (one buffer per offloaded layer).
    """
    config = config or OffloadConfig()
    hidden = _hidden_size(model)
    layers = checkpointed_layers(model)
    if hidden is None or not layers:
        return 0
    n_off = len(layers) - (1 if config.skip_last_layer else 0)
    elem = next(model.parameters()).element_size()
    need = n_off * tokens * hidden * elem
    _require_host_ram(need, config.host_ram_reserve_bytes,
                      f"{need / GiB:.2f} GiB of host RAM ({n_off} layers x {tokens} tokens x hidden {hidden} x "
                      f"{elem} B)",
                      ", a shorter max_seq_length or a smaller batch")
    return need


def _require_host_ram(need: int, reserve: int, what: str, advice: str) -> None:
    """Raise :class:`FastkitError` when ``need`` more bytes of host RAM would leave less than ``reserve``
    available: the up-front check (:func:`check_host_budget`) and the pipeline's runtime one share it.
    ``advice`` follows "Use use_gradient_checkpointing=True (no offload)" as written (its own separator)."""
    avail, total = host_ram()
    if need > avail - reserve:
        raise FastkitError(
            f"Activation offload needs {what}, but only {avail / GiB:.2f} of {total / GiB:.2f} GiB is available "
            f"and {reserve / GiB:.2f} GiB is kept in reserve. Use use_gradient_checkpointing=True (no offload)"
            f"{advice}.")


def _is_plain_checkpoint(func: Any) -> str | None:
    """Why ``func`` is not ``partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)``."""
    from torch.utils.checkpoint import checkpoint

    if isinstance(func, OffloadedCheckpoint):
        return "offload is already active on a layer"
    if not isinstance(func, functools.partial) or func.func is not checkpoint:
        return (f"the checkpoint function is {getattr(func, '__name__', type(func).__name__)}, not "
                "torch.utils.checkpoint.checkpoint (transformers' offload=True or a custom one is active)")
    if func.keywords.get("use_reentrant", True) is not False:
        return "reentrant checkpointing saves no tensors through hooks; enable it with use_reentrant=False"
    return None


class OffloadPatch:
    """The ``offload`` patch: swap each checkpointed layer's checkpoint function (see module docstring)."""

    name = registry.OFFLOAD

    def __init__(self, config: OffloadConfig | None = None, decision: Decision | None = None) -> None:
        self.config = config if isinstance(config, OffloadConfig) else OffloadConfig()
        self.decision = decision

    def check(self, model: torch.nn.Module) -> str | None:
        layers = checkpointed_layers(model)
        if not layers:
            return "gradient checkpointing is not enabled (call model.gradient_checkpointing_enable first)"
        for layer in layers:
            reason = _is_plain_checkpoint(_hf.checkpoint_function(layer))
            if reason:
                return reason
        decision = self.decision or decide(model, self.config)
        if decision.mode == "checkpoint":
            return decision.reason
        return None

    def apply(self, model: torch.nn.Module, swap: Swapper) -> None:
        decision = self.decision or decide(model, self.config)
        layers = checkpointed_layers(model)
        controller = OffloadController(_make_streams(decision, self.config), self.config, len(layers),
                                       decision.mode == "double-buffer", _host_budget(self.config))
        for i, layer in enumerate(layers):
            _hf.set_checkpoint_function(layer, OffloadedCheckpoint(_hf.checkpoint_function(layer), controller, i),
                                        swap)
        swap.setattr(model, CONTROLLER_ATTR, controller)


def _seam(config: OffloadConfig, name: str, default):
    """A test seam's value: only :class:`fastkit.patches.offload.testing.OffloadTestConfig` has them, a user's config
    never."""
    return getattr(config, name, default)


def _make_streams(decision: Decision, config: OffloadConfig) -> CopyStreams:
    trace = _seam(config, "trace", False)
    if decision.device.type == "cuda":
        return CudaStreams(decision.device, trace=trace)
    return CpuStreams(throttle=_seam(config, "throttle", None), trace=trace)


def _host_budget(config: OffloadConfig) -> int:
    if config.pinned_budget_bytes is not None:
        return config.pinned_budget_bytes
    avail, _ = host_ram()
    return max(0, avail - config.host_ram_reserve_bytes)


def offload_controller(model: torch.nn.Module) -> OffloadController | None:
    """The active :class:`OffloadController` of ``model`` (a PEFT wrapper is looked through), or None."""
    return getattr(unwrap(model), CONTROLLER_ATTR, None)


def offload_active(model: torch.nn.Module) -> bool:
    """True when every checkpointed layer still runs :class:`OffloadedCheckpoint`.

    ``Trainer(args.activation_checkpointing=True)`` re-enables checkpointing in its ``__init__`` and
    replaces every layer's checkpoint function, silently dropping the offload: models prepared by
    fastkit must be trained with ``activation_checkpointing=False`` (checkpointing is already on).
    """
    layers = checkpointed_layers(model)
    return bool(layers) and all(isinstance(_hf.checkpoint_function(m), OffloadedCheckpoint) for m in layers)


def _expected_tokens(model: torch.nn.Module, config: OffloadConfig) -> int | None:
    if config.expected_tokens is not None:
        return config.expected_tokens
    rep = report(model)
    return rep.max_seq_length if rep is not None else None


def enable_offload(model: torch.nn.Module, config: OffloadConfig | None = None) -> str:
    """Turn plain (non-reentrant) gradient checkpointing on ``model`` into offloaded checkpointing.

    Call after ``model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant":
    False})``. Returns the mode in effect: ``"double-buffer"``, ``"single-buffer"`` or
    ``"checkpoint (offload skipped: <reason>)"``; the decision is logged. Raises
    :class:`FastkitError` when the host RAM cannot hold the offloaded activations.
    """
    config = config or OffloadConfig()
    decision = decide(model, config)
    if decision.mode == "checkpoint":
        logger.warning("fastkit: activation offload requested, but %s; training with plain gradient "
                       "checkpointing.", decision.reason)
        return decision.describe()
    tokens = _expected_tokens(model, config)
    if tokens is not None:
        check_host_budget(model, tokens, config)
    ok, how = apply_patch(model, OffloadPatch(config, decision))
    if not ok:
        logger.warning("fastkit: activation offload not applied (%s); training with plain gradient checkpointing.",
                       how)
        return f"checkpoint (offload skipped: {how})"
    where = ("the language model's decoder layers; the vision tower keeps plain checkpointing"
             if _language_model(unwrap(model)) is not None else "checkpointed layers")
    logger.info("fastkit: activation offload %s on %d %s (%s)", decision.mode, len(checkpointed_layers(model)),
                where, decision.reason)
    return decision.mode


__all__ = ["CONTROLLER_ATTR", "Decision", "OffloadConfig", "OffloadController", "OffloadPatch", "OffloadStats",
           "OffloadedCheckpoint", "Throttle", "check_host_budget", "checkpointed_layers", "decide", "enable_offload",
           "fmt_bytes", "offload_active", "offload_controller"]
