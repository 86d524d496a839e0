"""Patch a loaded model by its family's row, and say what was done (the load banner).

The loader calls :func:`patch_with_facts` after loading; the census (:mod:`fastkit.families.census`) calls it on
tiny twins. It lives here, not in the loader, so the census and the loader do not import each other.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from fastkit import _hf, checks, registry
from fastkit.device import GiB, describe_device, memory_snapshot, pick_device
from fastkit.patches.host.patch import HostWeights
from fastkit.patching import active_patches, apply_patch, set_report, unwrap

logger = logging.getLogger("fastkit")


@dataclass
class LoadReport:
    """What ``FastModel`` did to a model; also shown as the banner and by the dashboard."""

    model_type: str
    """``config.model_type`` of the loaded model."""
    device: str
    """Where the model runs, in words."""
    dtype: str
    """Parameter dtype."""
    attn_implementation: str
    """Attention backend transformers dispatches to (a fastkit key when packing is active)."""
    max_seq_length: int
    """Longest sequence (or packed row) the user intends to train on."""
    active: dict[str, str] = field(default_factory=dict)
    """Active patch name -> how it got there."""
    skipped: dict[str, str] = field(default_factory=dict)
    """Patch name -> why it does not apply."""
    memory_plan: str = ""
    """The memory planner's verdict for this run (:mod:`fastkit.plan`), when one was made at load."""
    checkpointing: bool | str = True
    """What ``get_peft_model(use_gradient_checkpointing="auto")`` turns on: ``"offload"`` where the plan
    fits only with checkpoint offload (:attr:`fastkit.plan.Plan.needs_offload`), else ``True``."""
    host_weights: HostWeights = field(default_factory=HostWeights)
    """What ``get_peft_model(host_weights="auto")`` keeps in host memory: the frozen input embedding and / or
    lm_head where the load-time plan needs them (:func:`fastkit.plan.check_fits`)."""
    notes: list[str] = field(default_factory=list)
    """What the user should know about this family (the row's note, a self-check verdict), one line each."""

    def banner(self) -> str:
        mem = memory_snapshot(pick_device())
        lines = [
            f"fastkit: {self.model_type} on {self.device}, {self.dtype}, attention={self.attn_implementation}, "
            f"max_seq_length={self.max_seq_length}",
        ]
        if mem.device != "cpu":  # on the host the device line above already gives the RAM free (describe_device)
            lines.append(f"fastkit: memory free {mem.free / GiB:.1f} of {mem.total / GiB:.1f} GiB")
        for name, how in self.active.items():
            lines.append(f"fastkit:   + {name}: {how}")
        for name, why in self.skipped.items():
            lines.append(f"fastkit:   - {name}: {why}")
        for note in self.notes:
            lines.append(f"fastkit: note: {note}")
        if self.memory_plan:
            lines.append(f"fastkit: plan: {self.memory_plan}")
        return "\n".join(lines)


def patch_with_facts(model: torch.nn.Module, facts: registry.ModelFacts | None, verdict: str | None = None, *,
                     max_seq_length: int = 2048, patches: str | list[str] | None = "auto",
                     self_verified: bool = False, log: bool = True) -> torch.nn.Module:
    """Patch ``model`` by the row ``facts`` (None: unpatched, packed batches refused) and log the banner.

    ``verdict`` is the self-check's line for a family not in the table (shown in the banner). ``log=False``: the
    caller logs the banner once it has added to the report (the loader: memory plan, fp16, composite notes).
    """
    model = unwrap(model)
    config = model.config
    self_verified = self_verified or bool(verdict and verdict.startswith("self-verified"))
    rep = LoadReport(config.model_type, describe_device(model.device), str(model.dtype).replace("torch.", ""),
                     str(_hf.attn_implementation(config)), max_seq_length)
    if facts is None:
        if verdict is None:
            logger.warning("fastkit: model_type %r is not in fastkit's table; it loads unpatched (plain "
                           "transformers). Known: see docs/coverage.md", config.model_type)
        rep.skipped["all"] = verdict or f"unknown model_type {config.model_type!r}"
    else:
        if self_verified:
            rep.notes.append(verdict or "self-verified on a tiny twin of its own config")
        if facts.note:
            rep.notes.append(facts.note)
        wanted = checks.resolve_patches(patches, registry.PATCH_FACTORIES)
        wanted = registry.patch_names_for(facts) if wanted == "auto" else wanted
        refused = vision_refusals(model, facts)
        rep.skipped.update({name: why for name, why in refused.items() if name in wanted})
        for name in [n for n in wanted if n not in refused]:
            ok, how = apply_patch(model, registry.build_patch(name, facts))
            (rep.active if ok else rep.skipped)[name] = how
        rep.attn_implementation = str(_hf.attn_implementation(config))
    if registry.PACKING not in active_patches(model):  # a packed batch would mix documents: refuse it
        from fastkit.patches.layout import decoder

        checks.install_packed_guard(model, decoder(model), check_positions=facts is None)
    set_report(model, rep)
    if log:
        logger.info(rep.banner())
    return model


def is_vision_model(model: torch.nn.Module, facts: registry.ModelFacts | None) -> bool:
    """``model`` is the vision-language model of its row (the row's vision tower is there), not its text model."""
    if facts is None or facts.vision is None:
        return False
    try:
        unwrap(model).get_submodule(facts.vision.tower)
    except AttributeError:
        return False
    return True


def vision_refusals(model: torch.nn.Module, facts: registry.ModelFacts) -> dict[str, str]:
    """Patch name -> why it is refused on this vision-language model (nothing is applied, the model stays as is)."""
    if not is_vision_model(model, facts):
        return {}
    return {registry.PACKING: facts.vision.packing_refusal} if facts.vision.packing_refusal else {}


__all__ = ["LoadReport", "is_vision_model", "patch_with_facts", "vision_refusals"]
