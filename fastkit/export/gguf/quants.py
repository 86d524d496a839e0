"""The GGUF quantization names fastkit takes, as data: what :func:`fastkit.export.gguf.writer.write_gguf` stores, who
makes each one (fastkit or llama.cpp's own quantizer) and the read-back tolerances. No torch here: the CLI's flags
read it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QuantSpec:
    """One ``quantization`` name of :func:`write_gguf`: how its tensors are stored, what the file says, who makes it,
    and how far transformers' read-back may be from the model (:func:`fastkit.export.save_gguf`'s check)."""

    ggml_type: str
    """The ``gguf.GGMLQuantizationType`` of its weight matrices (llama.cpp's mix may differ per tensor)."""
    file_type: str
    """The ``gguf.LlamaFileType`` written as ``general.file_type``."""
    llama_ftype: int | None
    """llama.cpp's ``llama_ftype`` when llama.cpp's own quantizer makes it (``llama_model_quantize``, from a 16-bit
    file fastkit writes first); None: fastkit writes it itself (gguf-py)."""
    tolerance: float
    """What the rounding moved the logits by on the twins and SmolLM2 (``max|Δlogit| / max|logit|``; measured: f16
    2e-4, bf16 2e-3, q8_0 6e-3 (SmolLM2 3e-2), q4_0 9e-2), with margin: the bound tests/test_export_llamacpp.py
    holds llama.cpp's logits of the file to. Not save_gguf's check: how far rounding moves logits depends on the
    model (a diverged twin: 0.012 at f16), so save_gguf bounds each tensor (``weight_tolerance``) and checks the
    model around them on exact weights (``fastkit.export.gguf.save._verify_read_back``)."""
    weight_tolerance: float
    """Allowed ``max|Δw| / max|w|`` per tensor read back (:func:`check_weights`, every save_gguf): the rounding of
    one block (q8_0: half a step of absmax/127 <= 0.4%; q4_0: absmax/16 = 6%; f16: 2^-11); a wrong layout (rows
    permuted, halves swapped) is off by the tensor's whole size."""


QUANTS: dict[str, QuantSpec] = {
    "f16": QuantSpec("F16", "MOSTLY_F16", None, 1e-2, 1e-3),
    "bf16": QuantSpec("BF16", "MOSTLY_BF16", None, 4e-2, 8e-3),
    "q8_0": QuantSpec("Q8_0", "MOSTLY_Q8_0", None, 8e-2, 1e-2),
    "q4_0": QuantSpec("Q4_0", "MOSTLY_Q4_0", None, 0.3, 0.1),
    "q4_k_m": QuantSpec("Q4_K", "MOSTLY_Q4_K_M", 15, 0.3, 0.1),
    "q5_k_m": QuantSpec("Q5_K", "MOSTLY_Q5_K_M", 17, 0.15, 0.05),
    "q6_k": QuantSpec("Q6_K", "MOSTLY_Q6_K", 18, 0.1, 0.03),
}
"""Every quantization name save_gguf takes (Ollama's default is ``q4_k_m``)."""
QUANTIZATIONS = tuple(QUANTS)
WRITTEN = tuple(q for q, spec in QUANTS.items() if spec.llama_ftype is None)
"""Quantizations fastkit writes itself (pure Python, gguf-py)."""
LLAMA_CPP_QUANTS = {q: spec.llama_ftype for q, spec in QUANTS.items() if spec.llama_ftype is not None}
"""Quantizations made by llama.cpp's own quantizer (value: its ``llama_ftype``)."""

K_QUANTS = tuple(LLAMA_CPP_QUANTS)
"""The quantizations llama.cpp's own quantizer makes (they need llama-cpp-python)."""
