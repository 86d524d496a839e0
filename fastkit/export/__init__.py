"""After training: chat, and every way a model leaves fastkit.

    save.py         ``chat``, ``save_lora`` / ``load_lora`` (PEFT's format), ``save_merged``, ``save_gguf``
    merge.py        shard-by-shard merge of the adapters into the base's safetensors files
    gguf.py         the GGUF writer ``write_gguf`` (tensor names, rope order, quantization per tensor: ``QUANTS``)
                    (gguf_moe.py: MoE / MLA families' rules; gguf_hybrid.py: recurrent layers' rules)
    gguf_vocab.py   the GGUF tokenizer keys (byte-level BPE; gguf_spm.py: SentencePiece-style)
    modelfile.py    the Ollama Modelfile: a Go TEMPLATE that renders what apply_chat_template renders
    verified.py     every save verified and atomic: written beside, reloaded, logits compared, swapped in
    adapter_checks.py  load_lora's check of an adapter against the model (family, layers, shapes, ranks)
    menu.py         ``export``: LoRA, merged, a list of GGUF quantizations in one call, the ``ollama create`` line
    hub.py          the Hub upload of what ``export`` verified (create_repo, upload_folder, the model card)

``from fastkit.export import chat, save_lora, save_gguf`` is the public path.
"""

from fastkit._lazy import exports as _exports

# Imported when first used (the CLI reads the quantization names without torch).
_LAZY = {"ExportResult": "menu", "export": "menu", **dict.fromkeys(
    ("chat", "load_lora", "save_gguf", "save_lora", "save_merged"), "save")}


__getattr__, __dir__ = _exports(globals(), "fastkit.export", _LAZY)

__all__ = ["ExportResult", "chat", "export", "load_lora", "save_gguf", "save_lora", "save_merged"]
