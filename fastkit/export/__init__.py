"""After training: chat, and every way a model leaves fastkit.

    save.py         ``chat``, ``save_lora`` / ``load_lora`` (PEFT's format), ``save_merged``
    merge.py        shard-by-shard merge of the adapters into the base's safetensors files
    gguf/           ``save_gguf``: the GGUF writer, its family rules (MoE, hybrid, more), vocabularies (BPE, SPM),
                    the Ollama Modelfile and the quantization names (``gguf.quants.QUANTS``); see its __init__
    verified.py     every save verified and atomic: written beside, reloaded, logits compared, swapped in
    adapter_checks.py  load_lora's check of an adapter against the model (family, layers, shapes, ranks)
    menu.py         ``export``: LoRA, merged, a list of GGUF quantizations in one call, the ``ollama create`` line
    hub.py          the Hub upload of what ``export`` verified (create_repo, upload_folder, the model card)

``from fastkit.export import chat, save_lora, save_gguf`` is the public path.
"""

from fastkit._lazy import exports as _exports

# Imported when first used (the CLI reads the quantization names without torch).
_LAZY = {"ExportResult": "menu", "export": "menu", "save_gguf": "fastkit.export.gguf.save", **dict.fromkeys(
    ("chat", "load_lora", "save_lora", "save_merged"), "save")}


__getattr__, __dir__ = _exports(globals(), "fastkit.export", _LAZY)

__all__ = ["ExportResult", "chat", "export", "load_lora", "save_gguf", "save_lora", "save_merged"]
