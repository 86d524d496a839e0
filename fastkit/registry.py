"""Per-model facts in one table: which fastkit patches apply to which ``model_type``.

Adding a model is adding a row. A model type that is not in the table loads unpatched, with one
log line saying so. The patch implementations live in :mod:`fastkit.patches` (``packing.py``,
``moe.py``, ``offload.py``, ``moe_lora.py``); :data:`PATCH_FACTORIES` names the load-time ones so this
module imports none of them (they import the patch names from here).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

PACKING = "packing"
"""Packed-sequence attention (:mod:`fastkit.patches.packing`), applied at load."""
MOE = "moe"
"""Sort-based MoE experts (:mod:`fastkit.patches.moe`), applied at load."""
OFFLOAD = "offload"
"""Double-buffered checkpoint offload (:mod:`fastkit.patches.offload`), applied by ``enable_checkpointing``."""
MOE_LORA = "moe_lora"
"""LoRA on MoE experts per expert group (:mod:`fastkit.patches.moe_lora`), applied by ``add_expert_lora``."""

# patch name -> "module:class" constructed as ``cls(facts)``; imported only when used.
PATCH_FACTORIES: dict[str, str] = {
    PACKING: "fastkit.patches.packing:PackedAttentionPatch",
    MOE: "fastkit.patches.moe:MoEExpertsPatch",
}


@dataclass(frozen=True)
class ModelFacts:
    """What fastkit needs to know about one ``model_type``."""

    model_type: str
    """The ``config.model_type`` this row describes."""
    packing: bool = True
    """The packed-attention patch supports this family's attention module."""
    moe: bool = False
    """The family has ``@use_experts_implementation`` experts that fastkit's router can run."""
    attention_sinks: bool = False
    """Per-head learned sinks in the softmax (GPT-OSS): SDPA cannot express them."""
    sliding_window: bool = False
    """Some or all layers attend within a window (``config.sliding_window`` / ``layer_types``)."""
    softcap: bool = False
    """Attention logits are soft-capped (Gemma-2 style): needs a kernel that supports it."""
    default_attn: str = "sdpa"
    """The exact attention backend to load with when flash-attn is not installed."""
    note: str = ""
    """Anything a user should know, shown in the load banner."""
    stateful: tuple[str, ...] = ()
    """Class names of the layers that carry state along the sequence (linear attention, causal conv, SSM);
    the packing patch restarts each at every document start (:mod:`fastkit.patches.packing.state`)."""


MODEL_TABLE: dict[str, ModelFacts] = {
    f.model_type: f
    for f in [
        ModelFacts("llama"),
        ModelFacts("mistral", sliding_window=True),
        ModelFacts("qwen2", sliding_window=True),
        ModelFacts("qwen3", sliding_window=True),
        ModelFacts("qwen3_moe", moe=True, sliding_window=True),
        ModelFacts("qwen2_moe", moe=True, sliding_window=True),
        ModelFacts("mixtral", moe=True, sliding_window=True),
        ModelFacts("olmoe", moe=True),
        ModelFacts("deepseek_v3", moe=True, note="MLA attention: q/k and v head sizes differ"),
        ModelFacts("dbrx", packing=False, moe=True, note="experts looped upstream; fastkit routes them"),
        ModelFacts("llama4_text", packing=False, moe=True, note="experts looped upstream; fastkit routes them"),
        ModelFacts("gpt_oss", moe=True, attention_sinks=True, sliding_window=True, default_attn="eager",
                   note="attention sinks: sdpa cannot express them upstream"),
    ]
}

# ---- Hybrid (stateful) families: packing exact because their stateful layers restart per document
# (fastkit/patches/packing/state.py; proof: tests/test_packing_state.py, table: docs/packing.md). ----
_GDN = "gated DeltaNet (causal conv1d + chunked delta-rule state) restarts per document"
_MAMBA = "Mamba mixer (causal conv1d + SSM scan state) restarts per document"
MODEL_TABLE.update({f.model_type: f for f in [
    ModelFacts("qwen3_5_text", stateful=("Qwen3_5GatedDeltaNet",), note=_GDN),
    ModelFacts("qwen3_5_moe_text", stateful=("Qwen3_5MoeGatedDeltaNet",), note=_GDN),
    ModelFacts("qwen3_next", stateful=("Qwen3NextGatedDeltaNet",), note=_GDN),
    ModelFacts("lfm2", stateful=("Lfm2ShortConv",), note="short causal conv restarts per document"),
    ModelFacts("lfm2_moe", stateful=("Lfm2MoeShortConv",), note="short causal conv restarts per document"),
    ModelFacts("falcon_h1", stateful=("FalconH1Mixer",), note=_MAMBA),
    ModelFacts("jamba", stateful=("JambaMambaMixer",), note=_MAMBA),
    ModelFacts("granitemoehybrid", stateful=("GraniteMoeHybridMambaLayer",), note=_MAMBA),
    ModelFacts("nemotron_h", stateful=("NemotronHMamba2Mixer",), note=_MAMBA),
    ModelFacts("bamba", stateful=("BambaMixer",), note=_MAMBA),
    ModelFacts("zamba2", stateful=("Zamba2MambaMixer",), note=_MAMBA),
    ModelFacts("kimi_linear", stateful=("KimiLinearDeltaAttention",),
               note="Kimi delta attention (causal convs + chunked delta-rule state) restarts per document"),
]})


def facts_for(model_type: str) -> ModelFacts | None:
    """The table row for ``model_type``, or None for a model fastkit does not know."""
    return MODEL_TABLE.get(model_type)


def patch_names_for(facts: ModelFacts) -> list[str]:
    """Load-time patches that apply to a family, in application order."""
    names = []
    if facts.packing:
        names.append(PACKING)
    if facts.moe:
        names.append(MOE)
    return names


def build_patch(name: str, facts: ModelFacts):
    """Instantiate the patch called ``name`` for a family (imports its module on first use)."""
    module_name, cls_name = PATCH_FACTORIES[name].split(":")
    return getattr(importlib.import_module(module_name), cls_name)(facts)
