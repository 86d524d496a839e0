"""After training: chat, and every way a model leaves fastkit.

    save.py         ``chat``, ``save_lora`` / ``load_lora`` (PEFT's format), ``save_merged``, ``save_gguf``
    merge.py        shard-by-shard merge of the adapters into the base's safetensors files
    gguf.py         the GGUF writer (tensor names, rope order, quantization per tensor)
    gguf_vocab.py   the GGUF tokenizer keys and the Ollama Modelfile

``from fastkit.export import chat, save_lora, save_gguf`` is the public path.
"""

from fastkit.export.save import chat, load_lora, save_gguf, save_lora, save_merged

__all__ = ["chat", "load_lora", "save_gguf", "save_lora", "save_merged"]
