"""GGUF for llama.cpp, Ollama and LM Studio: one public entry, :func:`save_gguf` (also ``fastkit.export.save_gguf``).

    save.py       ``save_gguf``: write, read back with transformers' GGUF reader, compare, swap in (verified, atomic)
    writer.py     ``write_gguf``: tensor names and layouts, rope order, the header, the llama.cpp quantizer
                  (``quantize_with_llama_cpp`` for the K-quants); each family's rules read from its row's
                  :class:`fastkit.registry.GGUFRules`
    moe.py        the MoE / MLA families' tensors and keys (experts, shared experts, routers, MLA's kv_b_proj)
    hybrid.py     the hybrid families' recurrent layers (short convolutions, gated DeltaNet, Mamba2)
    more.py       per-layer metadata arrays, fused-qkv / Conv1D layouts of the other dense families
    vocab.py      the tokenizer keys (byte-level BPE, the pre-tokenizer names llama.cpp knows)
    spm.py        SentencePiece-style vocabularies, written as llama.cpp's SPM model
    mmproj.py     vision-language models: the text model split off for writer.py, and the mmproj (vision tower +
                  projector) llama.cpp's multimodal library loads beside it (SmolVLM / Idefics3, Gemma 3)
    modelfile.py  the Ollama Modelfile: a Go TEMPLATE that renders what apply_chat_template renders
    quants.py     the quantization names as data (``QUANTS``; no torch: the CLI's flags read it)
    llamacpp.py   llama.cpp itself: every GGUF load there (without the extra CPU buffer types that crash on
                  virtualised Xeons) and its quantizer, run in a child process

Nothing here is imported with the package: ``fastkit.export.gguf.quants`` costs no torch. The names the old module
``fastkit.export.gguf`` had (``write_gguf``, ``QUANTS``, ...) are still served from here, for old imports.
"""

from fastkit._lazy import exports as _exports

_LAZY = {
    "save_gguf": "save",
    # the old module fastkit.export.gguf's names (before round 4 it was the writer): served for old imports
    **dict.fromkeys(("LLAMA_CPP_QUANTS", "QUANTIZATIONS", "QUANTS", "WRITTEN", "QuantSpec", "K_QUANTS"), "quants"),
    **dict.fromkeys(("check_weights", "llama3_rope_factors", "merged_parameters", "num_experts",
                     "quantize_with_llama_cpp", "write_gguf"), "writer"),
}

__getattr__, __dir__ = _exports(globals(), "fastkit.export.gguf", _LAZY)

__all__ = ["save_gguf"]
