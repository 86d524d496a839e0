"""A trained LoRA twin saved the way a run leaves it (base checkpoint on disk, ``OUTPUT/lora``), for the export
menu, Hub and ``fastkit chat`` tests."""

from __future__ import annotations

from pathlib import Path

from fastkit import FastModel
from fastkit.export import save_lora
from fastkit.families.twins import twin, twin_bpe_tokenizer
from tests.helpers import train_lora_steps


def trained_twin(root: Path, steps: int = 3):
    """``(model, tokenizer, lora folder)``: a llama twin whose base is a local checkpoint in ``root/base``
    (SmolLM2's pre-tokenizer, BPE merges: what llama.cpp reads), LoRA-trained ``steps`` steps and saved to
    ``root/run/lora``."""
    base = root / "base"
    twin("llama").save_pretrained(base, safe_serialization=True)
    twin_bpe_tokenizer("smollm").save_pretrained(base)
    model, tokenizer = FastModel.from_pretrained(str(base), max_seq_length=64)
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False)
    model = train_lora_steps(model, steps, lr=3e-2)
    lora = Path(save_lora(model, tokenizer, root / "run" / "lora"))
    return model, tokenizer, lora
