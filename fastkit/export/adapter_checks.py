"""Checks that an adapter folder fits a model before PEFT loads it: family, layers, targets, ranks, shapes.

PEFT loads an adapter onto any model and drops (with at most a warning) the tensors whose module does
not exist: an adapter from another family or a model with other layers then "loads" with part of it
missing. :func:`check_adapter_fits` reads only the adapter file's header (names and shapes, no
tensors) and refuses, naming the first tensor that does not fit and why. ``save_lora`` writes the
model's family and sizes beside the adapter (:data:`INFO_FILE`), so a different family is named as such.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from fastkit.errors import FastkitError
from fastkit.patching import unwrap

INFO_FILE = "fastkit_adapter.json"
_INFO_KEYS = ("model_type", "num_hidden_layers", "hidden_size", "vocab_size")
_PREFIX = "base_model.model."


def model_info(model: torch.nn.Module) -> dict[str, Any]:
    """The base model's family and sizes, as ``save_lora`` records them."""
    config = unwrap(model).config
    return {k: getattr(config, k, None) for k in _INFO_KEYS}


def write_info(model: torch.nn.Module, folder: Path) -> None:
    (Path(folder) / INFO_FILE).write_text(json.dumps(model_info(model), indent=1, sort_keys=True) + "\n")


def _header(file: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    from fastkit.checks import check_safetensors_file

    check_safetensors_file(file, "Adapter file")  # truncated, or bytes after the last tensor: named

    with safe_open(str(file), framework="pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def _module_shapes(module: torch.nn.Module) -> tuple[int, int] | None:
    """``(in, out)`` of a linear / embedding (LoRA-wrapped or not); None for other modules."""
    base = getattr(module, "base_layer", module)
    if isinstance(base, torch.nn.Embedding):
        return base.num_embeddings, base.embedding_dim
    if hasattr(base, "in_features") and hasattr(base, "out_features"):
        return int(base.in_features), int(base.out_features)
    return None


def _clean(path: str) -> str:
    return path.replace(".base_layer", "")


def check_adapter_fits(model: torch.nn.Module, folder: str | Path, config: dict[str, Any]) -> None:
    """Raise unless every tensor in ``folder``'s adapter has a module of the right shape in ``model``."""
    folder = Path(folder)
    info_file = folder / INFO_FILE
    if info_file.is_file():
        saved, now = json.loads(info_file.read_text()), model_info(model)
        diff = [f"{k}: adapter {saved.get(k)!r}, model {now[k]!r}" for k in _INFO_KEYS
                if saved.get(k) is not None and saved.get(k) != now[k]]
        if diff:
            raise FastkitError(f"load_lora({str(folder)!r}): the adapter was trained on another model "
                               f"({'; '.join(diff)}). Load it onto the model it was trained from.")
    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        raise FastkitError(f"load_lora({str(folder)!r}): no adapter_model.safetensors (fastkit reads safetensors "
                           "adapters only); give the folder save_lora wrote.")
    modules = dict(unwrap(model).named_modules())
    clean = {_clean(k): m for k, m in modules.items()}
    r_default, patterns = config.get("r"), dict(config.get("rank_pattern") or {})
    for key, shape in _header(weights).items():
        body = key.removeprefix(_PREFIX)
        path, sep, rest = body.partition(".lora_")
        path = _clean(path) if sep else _clean(body.rsplit(".", 1)[0])
        module = clean.get(path)
        if module is None:
            raise FastkitError(f"load_lora({str(folder)!r}): the adapter holds {key!r} but the model has no module "
                               f"{path!r}{_layers_hint(path, modules)}; it was trained on a different model.")
        if not sep:  # modules_to_save: a full copy of the module's parameter
            param = dict(module.named_parameters()).get(body.rsplit(".", 1)[1])
            if param is not None and tuple(param.shape) != shape:
                raise FastkitError(f"load_lora: {key} has shape {shape}, the model's {path} {tuple(param.shape)}.")
            continue
        dims = _module_shapes(module)
        if dims is None or len(shape) != 2 or not rest.startswith(("A.", "B.", "embedding_A", "embedding_B")):
            continue  # expert target_parameters, DoRA magnitudes: PEFT / fastkit's loader check those
        rank = next((v for k, v in patterns.items() if path.endswith(k.split("(?<=")[-1].strip("^$"))), r_default)
        a_side = rest.startswith(("A.", "embedding_A"))
        want_in, want_out = dims
        r_found, feat = (shape[0], shape[1]) if a_side and not rest.startswith("embedding") else (shape[1], shape[0])
        if rest.startswith("embedding_A"):
            r_found, feat = shape[0], shape[1]
        expected_feat = want_in if a_side else want_out
        if feat != expected_feat:
            raise FastkitError(f"load_lora: {key} has shape {shape}, but the model's {path} has "
                               f"{'in' if a_side else 'out'} size {expected_feat}; the adapter was trained on a "
                               "different model.")
        if rank is not None and r_found != rank:
            raise FastkitError(f"load_lora: {key} has rank {r_found}, adapter_config.json says r={rank}; the adapter "
                               "folder is inconsistent (save it again with save_lora).")


def _layers_hint(path: str, modules: dict) -> str:
    layers = sorted({int(p.split("layers.")[1].split(".")[0]) for p in modules if "layers." in p
                     and p.split("layers.")[1].split(".")[0].isdigit()})
    return f" (the model has layers 0..{layers[-1]})" if layers and "layers." in path else ""


__all__ = ["INFO_FILE", "check_adapter_fits", "model_info", "write_info"]
