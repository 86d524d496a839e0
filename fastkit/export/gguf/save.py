"""``save_gguf``: the GGUF package's one public entry (re-exported as :func:`fastkit.export.save_gguf`).

It writes through :func:`fastkit.export.gguf.writer.write_gguf` into a staged folder, reads the file back with
transformers' GGUF reader and compares it with the model (:mod:`fastkit.export.verified`), then swaps it in.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch

from fastkit import _hf, checks, registry
from fastkit.errors import FastkitError
from fastkit.export import verified as saving
from fastkit.patching import unwrap

logger = logging.getLogger("fastkit")


def save_gguf(model: torch.nn.Module, tokenizer, path: str | Path, quantization: str = "q8_0",
              name: str | None = None, verify: bool | None = None) -> str:
    """Write a GGUF (LoRA merged, tokenizer and chat template embedded) and an Ollama ``Modelfile`` into
    folder ``path``; ``quantization`` is ``"f16"``, ``"bf16"``, ``"q8_0"`` or ``"q4_0"`` (written by fastkit), or
    ``"q4_k_m"`` / ``"q5_k_m"`` / ``"q6_k"`` (llama.cpp's quantizer; needs ``fastkit-llm[llamacpp]``). Returns the
    .gguf path. See :mod:`fastkit.export.gguf.writer` and docs/export.md. A SmolVLM / Idefics3, Gemma 3 or
    Qwen2.5-VL model (pass its processor) is written as llama.cpp runs it: the text GGUF plus
    ``<name>-mmproj-f16.gguf``, the vision tower and projector (:mod:`fastkit.export.gguf.mmproj`, docs/vision.md).

    Verified and atomic (:mod:`fastkit.export.verified`): both files are written into a temporary sibling folder,
    transformers' GGUF reader loads the .gguf and its logits must match the in-memory model (within the
    quantization's tolerance), then each file replaces its earlier version with ``os.replace`` (other files in
    ``path``, a merged model saved there included, are kept: :mod:`fastkit.export.owned`). ``name``
    is a file stem: folders, spaces and quotes are removed, so nothing lands outside ``path``.
    """
    from fastkit.export.gguf import mmproj
    from fastkit.export.gguf.writer import write_gguf

    path = checks.check_save_target(path)
    vision, processor = None, None
    if mmproj.writes(model):  # a vision-language model: its text model here, the mmproj beside it (mmproj.py)
        vision, processor = model, tokenizer
        model, tokenizer = mmproj.split(model, processor)
    config = unwrap(model).config
    check_verify = saving.should_verify(model, torch.float16, verify, "save_gguf")
    if check_verify and not _gguf_reader_loads(config):
        check_verify = False
        logger.warning("fastkit: save_gguf: transformers' GGUF reader cannot load a %s file, so its read-back check "
                       "is skipped (tests/test_llamacpp_round_trip.py, tests/test_vision_gguf.py run it in llama.cpp)",
                       config.model_type)
    reference = None
    if check_verify:
        reference = saving.logits_of(model, saving.probe_ids(unwrap(model).get_input_embeddings().weight.shape[0]))
    with saving.staged_folder(path, "save_gguf", model, prune=False) as tmp:  # other quantizations stay
        written = Path(write_gguf(model, tokenizer, tmp, quantization=quantization, name=name))
        if check_verify:
            quantized = getattr(unwrap(model), "is_loaded_in_4bit", False) or getattr(unwrap(model),
                                                                                      "is_loaded_in_8bit", False)
            if quantized:  # merged into reloaded 16-bit base weights: the check is that it loads and runs
                saving.verify_reload(model, lambda: _reload_gguf(written, config), float("inf"), "save_gguf",
                                     reference=reference)
            else:
                _verify_read_back(model, written, config, quantization, reference)
        if vision is not None:
            _write_mmproj(vision, processor, tmp / mmproj.file_name(written.name), written.stem)
        modelfile = (tmp / "Modelfile").exists()
    out = saving.output_folder(path, "save_gguf")
    if not modelfile:  # its template cannot be a TEMPLATE: no stale Modelfile of ours beside the new GGUF
        from fastkit.export.owned import remove_own

        remove_own(out, "Modelfile")
    return str(out / written.name)


def _write_mmproj(model: torch.nn.Module, processor, file: Path, name: str) -> None:
    """The vision tower + projector as llama.cpp's mmproj beside the text GGUF, read back and compared."""
    from fastkit.export.gguf import mmproj

    mmproj.write_mmproj(model, processor, file, name)
    worst = mmproj.check_mmproj(model, file)
    logger.info("fastkit: save_gguf: %s read back, every tensor within %.2g of its scale", file.name, worst)


def _verify_read_back(model: torch.nn.Module, written: Path, config, quantization: str,
                      reference: torch.Tensor) -> None:
    """The file read back by transformers' GGUF reader, in two checks whose bounds follow from what they compare.

    1. Tensors: every tensor read back is the merged model's within the rounding of one quantization block
       (:func:`fastkit.export.gguf.writer.check_weights`, :attr:`QuantSpec.weight_tolerance`: f16 2^-11 of the
       value, q8_0 half a step of absmax/127, ...). A wrong name, layout, permutation or missing expert is off by
       the tensor's own scale.
    2. The model around them: the reloaded model (the file's metadata, architecture and tensor names, through the
       reader) given the model's exact weights must give the in-memory logits within the arithmetic noise of the
       in-memory dtype (:data:`fastkit.export.verified.TOLERANCE`, as a save_merged in that dtype). Same weights on
       both sides, so no rounding enters: a wrong rope base, norm epsilon, head count or tie shows here.

    What the rounding itself does to the logits is measured and logged, not bounded: it depends on how well
    conditioned the model is, not on the file (a twin diverged by a loss spike moved 0.012 of its logit scale at f16
    while every tensor was within 2^-11; a qwen3_moe twin's q8_0 flips an expert choice: 0.09)."""
    from fastkit.export.gguf.writer import check_weights
    from fastkit.export.merge import training_dtype

    try:
        reloaded = _reload_gguf(written, config)
    except Exception as exc:  # noqa: BLE001 -- whatever the reader says, the save is refused with it
        raise FastkitError(f"save_gguf: the output does not load back ({type(exc).__name__}: {str(exc)[:200]}); "
                           "nothing was replaced.") from exc
    ids = saving.probe_ids(unwrap(model).get_input_embeddings().weight.shape[0])
    rounded = saving.logits_of(reloaded, ids)  # the file as read: only logged
    worst = check_weights(model, reloaded, quantization, exact=True)  # then the model's exact weights in it
    dtype = training_dtype(model)
    exact = saving.compare_logits(saving.logits_of(reloaded, ids), reference,
                                  saving.TOLERANCE.get(dtype, saving.TOLERANCE[torch.float32]), "save_gguf")
    moved = (rounded - reference).abs().max().item() / (reference.abs().max().item() or 1.0)
    logger.info("fastkit: save_gguf verified: reloaded, every tensor within %.2g of its scale (%s rounding), the "
                "file's model on the exact weights within %.2g of the logit scale; %s moves the logits by %.2g of "
                "their scale", worst, quantization, exact, quantization, moved)


def _gguf_reader_loads(config) -> bool:

    row = registry.gguf_row(getattr(config, "model_type", None))
    return row is None or row.gguf.reader


def _reload_gguf(file: Path, config) -> torch.nn.Module:
    """transformers' GGUF reader. Its metadata table lacks qwen3's head_dim / MoE sizes: those get the config."""
    from transformers import AutoModelForCausalLM


    kw = {}
    facts = registry.gguf_row(config.model_type)
    if facts is None or facts.gguf.reader_config:
        plain = copy.deepcopy(config)
        for key in ("quantization_config",):
            if hasattr(plain, key):
                delattr(plain, key)
        kw["config"] = plain
    with _hf.quiet_gguf_reader():  # its tqdm bar ("Converting and de-quantizing GGUF tensors") would be the only one
        return AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=torch.float32, **kw)


__all__ = ["save_gguf"]
