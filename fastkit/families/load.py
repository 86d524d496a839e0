"""What ``FastModel`` does with a built model: patch it by its row (or, for a family the table does not know, by the
census self-check on its own twin), and the ``twin=True`` load (a tiny random model of the same architecture and an
in-process tokenizer instead of a download, :mod:`fastkit.families.twins`)."""

from __future__ import annotations

import logging
import os

import torch

from fastkit import checks, registry
from fastkit.errors import FastkitError
from fastkit.families.patch import patch_with_facts
from fastkit.families.vision import vision_twin, vision_twin_processor, wants_vision
from fastkit.patching import unwrap

logger = logging.getLogger("fastkit")


def patch_model(model: torch.nn.Module, max_seq_length: int, patches, log: bool) -> torch.nn.Module:
    """:meth:`FastModel.patch` after its check (the loaders checked ``max_seq_length`` already).

    Note: [max_seq_length] checked once per load, where the config is known (``_preflight``; a twin, whose context
    is not the real model's: a positive int in ``load_twin``), and carried once: on the load report
    (``report(model).max_seq_length``), which the banner, checkpoint offload and ``make_trainer`` read.
    """
    model = unwrap(model)
    facts = registry.facts_for(model.config.model_type)
    if facts is not None or patches is None:
        return patch_with_facts(model, facts, max_seq_length=max_seq_length, patches=patches, log=log)
    from fastkit.families.census import self_check

    return patch_with_facts(model, *self_check(model.config), max_seq_length=max_seq_length, patches=patches,
                            log=log)


def load_twin(name: str, device: torch.device, max_seq_length: int, patches, dtype: torch.dtype | None = None,
               vision: bool | None = None):
    """``FastModel.from_pretrained(name, twin=True)``: a tiny random model of ``name``'s family and a twin tokenizer
    (a processor for a vision-language family), patched as a real load would be; ``max_seq_length`` checked against
    the real model's context where its config is at hand."""
    from fastkit.families.twins import TWIN_PREFIX, twin, twin_bpe_tokenizer, twin_family  # a twin load only

    checks.check_max_seq_length(max_seq_length, _real_config(name))  # the real model's context, where known
    name = _twin_name(name)
    try:
        family, overrides = twin_family(name)
    except ValueError as exc:
        raise FastkitError(str(exc)) from exc
    family = _twin_vision_family(family, vision)
    logger.info("fastkit: twin=True: a tiny random %s stands in for %s (no download)", family, name)
    if wants_vision(registry.facts_for(family), vision, family):
        return _load_vision_twin(name, family, device, max_seq_length, patches, dtype)
    model = twin(family, num_hidden_layers=2, **overrides).to(device, dtype=dtype or torch.float32)
    # its saves say which twin to rebuild (twins are deterministic): PEFT reads the instance attribute
    model.config._name_or_path = model.name_or_path = TWIN_PREFIX + name
    tokenizer = twin_bpe_tokenizer()  # with merges, so a twin's GGUF export is one llama.cpp loads
    patch_model(model, max_seq_length, patches, log=True)
    return model, tokenizer


def _twin_vision_family(family: str, vision: bool | None) -> str:
    """``vision=True`` on a twin whose stand-in is a composite's text model (``google/gemma-3-4b-it`` ->
    ``gemma3_text``): the vision row whose config builds that text model (``gemma3``)."""
    row = registry.facts_for(family)
    if vision is not True or (row is not None and row.vision is not None):
        return family
    from transformers import CONFIG_MAPPING

    for model_type, facts in registry.MODEL_TABLE.items():
        if facts.vision is not None and CONFIG_MAPPING[model_type]().get_text_config().model_type == family:
            return model_type
    return family


def _load_vision_twin(name: str, family: str, device: torch.device, max_seq_length: int, patches,
                      dtype: torch.dtype | None):
    """A tiny random vision-language twin and its processor (:mod:`fastkit.families.vision`)."""
    from fastkit.families.twins import TWIN_PREFIX

    model = vision_twin(family).to(device, dtype=dtype or torch.float32)
    model.config._name_or_path = model.name_or_path = TWIN_PREFIX + name
    processor = vision_twin_processor(family)
    patch_model(model, max_seq_length, patches, log=True)
    return model, processor


def _real_config(name: str):
    """The config of the model a twin stands in for, when it is at hand without a download (a local config.json,
    or a config fastkit ships): its context bounds the twin's ``max_seq_length`` as a real load's would."""
    import json

    from fastkit.plan.source import config_from_dict, known_config

    path = os.path.expanduser(name)
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    values = None
    if os.path.basename(file) == "config.json" and os.path.isfile(file):
        try:
            with open(file, encoding="utf-8") as f:
                values = json.load(f)
        except (OSError, ValueError):
            return None  # _twin_name names the broken file
    elif not os.path.exists(path):
        values = known_config(name)
    if not isinstance(values, dict) or not values.get("model_type"):
        return None
    try:
        return config_from_dict(dict(values))
    except FastkitError:
        return None


def _twin_name(name: str) -> str:
    """``twin=True`` on a local folder (or its config.json): the model_type its config.json names."""
    import json
    from pathlib import Path

    path = Path(os.path.expanduser(name))
    config = path / "config.json" if path.is_dir() else path
    if not (config.name == "config.json" and config.is_file()):
        return name
    try:
        values = json.loads(config.read_text())
    except ValueError as exc:
        raise FastkitError(f"twin=True: {str(config)!r} is not valid JSON ({exc}).") from exc
    if not isinstance(values, dict):
        raise FastkitError(f"twin=True: {str(config)!r} holds a {type(values).__name__}, not a model config mapping.")
    model_type = values.get("model_type")
    if not model_type:
        raise FastkitError(f"twin=True: {str(config)!r} names no model_type to build a twin of.")
    logger.info("fastkit: twin=True: %s is a local %s config", name, model_type)
    return str(model_type)


__all__ = ["load_twin", "patch_model"]
