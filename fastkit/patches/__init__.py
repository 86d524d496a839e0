"""The three fastkit patches (and LoRA on experts), each split into transformers glue and pure-torch math.

Glue files decide where a patch applies and swap it into a model through :mod:`fastkit.patching`;
every private transformers / TRL / PEFT name they need goes through :mod:`fastkit._hf`. Pure-torch
files import only the standard library, torch, numpy, :mod:`fastkit.errors` and each other
(tests/test_hf_compat.py checks it), so their logic is testable without a model.

Packed sequences (registry name ``packing``):
    packing.py            glue: collator wrapper, per-batch metadata, attention keys, the decoder swap
    packed_attention.py   pure torch: ``PackedBatch`` and the per-document attention kernels

Checkpoint offload (``offload``):
    offload.py            glue: ``OffloadConfig``, ``decide``, host-RAM checks, ``OffloadPatch``, ``enable_offload``
    offload_pipeline.py   pure torch: pack/unpack hooks, host and device buffer pools, prefetch, the Notes
    streams.py            pure torch: the copy stream on CUDA or on a CPU worker thread

MoE experts (``moe``, ``moe_lora``):
    moe.py                glue: ``MoEConfig``, the experts forwards, ``MoEExpertsPatch``, ``attach_experts``
    moe_routing.py        pure torch: one-sort routing, autograd pieces, grouped / loop GEMMs
    moe_lora.py           LoRA on experts per expert group (``add_expert_lora``, save / load / merge)
"""
