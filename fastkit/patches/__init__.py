"""The fastkit patches, one subpackage each, split into transformers glue and pure-torch math.

Glue files (``patch.py``) decide where a patch applies and swap it into a model through
:mod:`fastkit.patching`; every private transformers / TRL / PEFT name they need goes through
:mod:`fastkit._hf`. Pure-torch files import only the standard library, torch, numpy,
:mod:`fastkit.errors` and each other (tests/test_hf_compat.py checks it), so their logic is testable
without a model. Each subpackage's ``__init__`` re-exports its public names
(``from fastkit.patches.moe import add_expert_lora``).

sizes.py: the byte budgets the patches work within (loss chunk, 4-bit dequantization groups), no torch:
    ``fastkit plan`` counts the same numbers without importing torch.
layout.py: where a causal LM keeps its decoder (``decoder``, ``decoder_layers``): the one lookup every patch reads.

packing/ (registry name ``packing``):
    patch.py       glue: collator wrapper, per-batch metadata, attention keys, the decoder swap
    attention.py   pure torch: ``PackedBatch`` and the per-document attention kernels
    state.py       stateful layers (linear attention, causal conv, SSM) restart per document: the
                   per-document regroup (torch) and the instance swaps the patch makes for a ``stateful`` row
    varlen.py      the same restart inside one call of the CUDA kernels transformers already uses (``varlen`` row)

offload/ (``offload``):
    patch.py       glue: ``OffloadConfig``, ``decide``, host-RAM checks, ``OffloadPatch``, ``enable_offload``
    pipeline.py    pure torch: pack/unpack hooks, host and device buffer pools, prefetch, the Notes
    streams.py     pure torch: the copy stream on CUDA or on a CPU worker thread
    checkpointing.py  ``enable_checkpointing``: plain or offloaded gradient checkpointing, revertible
    testing.py     test-only seams (``OffloadTestConfig``: the CPU copy stream, throttles, traces)

moe/ (``moe``, ``moe_lora``; the 4-bit experts are the loader's change ``4bit_experts``):
    patch.py       glue: ``MoEConfig``, the experts forwards, ``MoEExpertsPatch``, ``attach_experts``
    routing.py     pure torch: one-sort routing, autograd pieces, grouped / loop GEMMs
    lora.py        LoRA on experts per expert group (``add_expert_lora``, save / load / merge)
    peft_format.py the same factors in PEFT's ``target_parameters`` format
    nf4.py         4-bit experts (NF4 / MXFP4 storage); loading.py: quantized while the checkpoint loads
    linear_4bit.py NF4 attention linears beside MXFP4 experts (GPT-OSS), the change ``4bit_linears``

host/ (``host_embedding``, ``host_lm_head``):
    patch.py       glue: ``HostWeights`` (the knob), the two patches, the host-ids collator, ``enable_host_weights``
    rows.py        torch only: pinned row gather, double-buffered row-chunk streaming, ``StreamedLinear``

fp16/ (``fp16_residual``):
    patch.py       the residual stream in fp32 under fp16 compute (bf16-trained models on a T4)

loss/ (``chunked_loss``):
    patch.py       glue: ``ChunkedLossPatch``, ``route_trainer_loss``
    chunked.py     pure torch: chunked cross-entropy
    streamed.py    cross-entropy over a host lm_head, the vocabulary streamed in row chunks (with host/rows.py)
"""
