"""MoE experts (registry names ``moe``, ``moe_lora``).

    patch.py         glue: ``MoEConfig``, the experts forwards, ``MoEExpertsPatch``, ``attach_experts``
    routing.py       pure torch: one-sort routing, autograd pieces, grouped / loop GEMMs
    lora.py          LoRA on experts per expert group (``add_expert_lora``, save / load / merge)
    peft_format.py   the same factors in PEFT's ``target_parameters`` adapter format
    nf4.py           4-bit experts: NF4 and MXFP4 storage, dequantized per hit group in the forward
    loading.py       quantize experts while the checkpoint loads (peak ~ one layer, not the model)
"""

from fastkit.patches.moe.lora import ExpertLoRA, add_expert_lora, expert_lora_modules, peft_adapts_experts
from fastkit.patches.moe.nf4 import has_4bit_experts, quantize_experts
from fastkit.patches.moe.patch import (
    EXPERTS_KEY,
    LORA_ATTR,
    MoEConfig,
    MoEExpertsPatch,
    attach_experts,
    detach_experts,
    experts_modules,
    fastkit_experts_forward,
)
from fastkit.patches.moe.peft_format import load_expert_lora

__all__ = ["EXPERTS_KEY", "LORA_ATTR", "ExpertLoRA", "MoEConfig", "MoEExpertsPatch", "add_expert_lora",
           "attach_experts", "detach_experts", "expert_lora_modules", "experts_modules", "fastkit_experts_forward",
           "has_4bit_experts", "load_expert_lora", "peft_adapts_experts", "quantize_experts"]
