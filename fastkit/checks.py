"""Input checks for loading, training and saving: every bad input a :class:`FastkitError` naming the field.

Each function here runs before any work (weights read, a step taken, a file written) or right after
a save to prove it happened. The dataset row checks live in :mod:`fastkit.data.rules`; the packed
metadata checks in :mod:`fastkit.patches.packing.patch`.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastkit.errors import FastkitError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

DTYPE_NAMES: dict[str, str] = {
    "fp16": "float16", "float16": "float16", "half": "float16",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp32": "float32", "float32": "float32", "float": "float32",
}
"""The dtype names fastkit takes -> the ``torch`` attribute (names, so that importing this module needs no torch)."""


def resolve_dtype(dtype: Any) -> torch.dtype | None:
    """``dtype`` as a ``torch.dtype`` (None and ``"auto"`` stay None: pick from the device)."""
    import torch

    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        name = dtype.strip().lower().removeprefix("torch.")
        if name == "auto":
            return None
        if name in DTYPE_NAMES:
            return getattr(torch, DTYPE_NAMES[name])
    raise FastkitError(f"dtype={dtype!r} is not a dtype fastkit knows. Pass a torch.dtype (torch.bfloat16) or one "
                       f"of {', '.join(repr(n) for n in DTYPE_NAMES)} or 'auto'.")


def resolve_patches(patches: Any, known) -> str | list[str]:
    """``"auto"``, or the list of patch names ``patches`` asks for (a single name may be a str)."""
    if patches == "auto":
        return "auto"
    if patches is None:
        return []
    names = [patches] if isinstance(patches, str) else patches
    if not isinstance(names, (list, tuple, set)) or not all(isinstance(n, str) for n in names):
        raise FastkitError(f"patches={patches!r}: give 'auto', None, a patch name or a list of names "
                           f"({', '.join(known)}).")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise FastkitError(f"Unknown patch {unknown[0]!r} in patches={patches!r}; known: {', '.join(known)} "
                           "(or 'auto' / None).")
    return list(names)


def check_hf_kwargs(hf_kwargs: dict) -> None:
    """Keyword arguments passed to transformers cannot switch off the safetensors-only rule."""
    if "use_safetensors" in hf_kwargs and hf_kwargs["use_safetensors"] is not True:
        raise FastkitError(f"use_safetensors={hf_kwargs['use_safetensors']!r}: fastkit loads weights only from "
                           "safetensors (or GGUF via gguf_file=), never pickle. Drop use_safetensors, or convert "
                           "the checkpoint to safetensors first.")


def check_twin_options(dtype: torch.dtype | None, load_in_4bit: bool) -> None:
    """``twin=True`` honours ``dtype``; it cannot honour 4-bit (a random twin is not quantized)."""
    if load_in_4bit:
        raise FastkitError("load_in_4bit=True with twin=True: a twin is a tiny random model in 16/32-bit and is "
                           "never quantized. Drop load_in_4bit for the twin, or load the real model (twin=False).")


def check_safetensors_files(name_or_path: str) -> None:
    """Each ``*.safetensors`` in a local folder holds exactly the bytes its header promises; names the bad file."""
    path = Path(os.path.expanduser(str(name_or_path)))
    if not path.is_dir():
        return
    for file in sorted(path.glob("*.safetensors")):
        check_safetensors_file(file)


def check_safetensors_file(file: str | Path, what: str = "Weights file") -> None:
    """``file`` is a whole safetensors file: its header reads, and the file ends where its last tensor does (a
    truncated copy, and one with bytes after its last tensor -- appended to, or two files joined -- are refused
    naming the file: safetensors' own SafetensorError names neither the file nor the cause)."""
    file = Path(file)
    size = file.stat().st_size
    try:
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError(f"header of {n} bytes in a {size}-byte file")
            header = json.loads(f.read(n))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (struct.error, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise FastkitError(f"{what} {file} is not a readable safetensors file ({exc}); it is truncated "
                           "or corrupt. Download or save it again.") from exc
    if 8 + n + end > size:
        raise FastkitError(f"{what} {file} is truncated: {size} bytes on disk, its header needs "
                           f"{8 + n + end}. Download or save it again.")
    if 8 + n + end < size:
        raise FastkitError(f"{what} {file} has {size - 8 - n - end} bytes after its last tensor ({size} bytes on "
                           f"disk, its header describes {8 + n + end}): it was appended to or joined with another "
                           "file. Download or save it again.")


def read_adapter_config(folder: str | Path, who: str) -> dict:
    """A folder's ``adapter_config.json`` as a mapping: the one reader of it (load_lora, ``fastkit export``,
    ``--resume``, the expert adapters). Broken JSON is named with the file and the error's position, not a raw
    JSONDecodeError; ``who`` says which call or flag read it."""
    file = Path(folder) / "adapter_config.json"
    try:
        values = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise FastkitError(f"{who}: {file} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}, "
                           f"char {exc.pos}); save the adapter again, or fix that file.") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise FastkitError(f"{who}: {file} cannot be read ({exc}); save the adapter again.") from exc
    if not isinstance(values, dict):
        raise FastkitError(f"{who}: {file} holds a {type(values).__name__}, not the mapping of an adapter config; "
                           "save the adapter again.")
    return values


def check_save_target(path: str | Path, what: str = "path") -> Path:
    """``path`` must be a folder (or not exist yet): a save into an existing file writes nothing."""
    if not isinstance(path, (str, os.PathLike)) or not str(path).strip():
        raise FastkitError(f"{what} must be a folder path, got {path!r}.")
    target = Path(os.path.expanduser(str(path)))
    if any(len(os.fsencode(part)) > 255 for part in target.parts):
        raise FastkitError(f"{what}: a folder name in {str(target)[:80]!r}... is over 255 bytes; file systems allow "
                           "255. Pass a shorter name.")
    if target.exists() and not target.is_dir():
        raise FastkitError(f"{what}={str(target)!r} is an existing file, not a folder: the model would not be saved. "
                           "Pass a folder path (it is created if missing).")
    return target


def check_saved(path: Path, pattern: str, what: str) -> None:
    """Raise unless the save left a ``pattern`` file in ``path`` (a save that did not happen never passes)."""
    if not any(Path(path).glob(pattern)):
        raise FastkitError(f"{what}: nothing matching {pattern!r} was written to {str(path)!r}; the save did not "
                           "happen. Check the folder is writable and has space.")


def check_max_steps(max_steps: Any) -> None:
    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps <= 0:
        raise FastkitError(f"max_steps must be a positive int (optimizer steps to run), got {max_steps!r}.")


def check_max_seq_length(max_seq_length: Any, config: Any = None) -> None:
    """The one max_seq_length check (loader, twins, planner, make_trainer): a positive int and, given the
    model's ``config``, within its context (the text config's ``max_position_embeddings``, so composite
    vision-language configs are checked too)."""
    if isinstance(max_seq_length, bool) or not isinstance(max_seq_length, int) or max_seq_length <= 0:
        raise FastkitError(f"max_seq_length must be a positive int (tokens per row), got {max_seq_length!r}.")
    if config is None:
        return
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    context = getattr(text, "max_position_embeddings", None)
    if isinstance(context, int) and max_seq_length > context:
        raise FastkitError(f"max_seq_length={max_seq_length} is longer than the model's context "
                           f"(max_position_embeddings={context}); positions past it are untrained. Use at most "
                           f"{context}.")


def check_positive(name: str, value: Any, integer: bool = True, allow_none: bool = False) -> None:
    """``value`` is a positive int (or number, ``integer=False``); the message names the option."""
    if value is None and allow_none:
        return
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not value > 0 or value != value:
        what = "a positive int" if integer else "a positive number"
        raise FastkitError(f"{name} must be {what}{' or None' if allow_none else ''}, got {value!r}.")


def check_non_negative_int(name: str, value: Any) -> None:
    """``value`` is an int >= 0 (a seed, a step count), not a bool."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise FastkitError(f"{name} must be a non-negative int, got {value!r}.")


def check_bool(name: str, value: Any, allow_none: bool = False) -> None:
    if not (isinstance(value, bool) or value is None and allow_none):
        raise FastkitError(f"{name} must be True or False{' (or None)' if allow_none else ''}, got {value!r}.")


def check_choice(name: str, value: Any, choices: tuple) -> None:
    """``value`` is one of ``choices``; else the message lists them, with the closest as a did-you-mean."""
    import difflib

    if value not in choices:
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise FastkitError(f"{name}={value!r} is not one of {', '.join(repr(c) for c in choices)}{hint}.")


def check_known_options(where: str, given: dict, known) -> None:
    """Keyword options a function passes on (``**sft_overrides``): a typo is named, with the closest match."""
    import difflib

    known = set(known)
    for name in given:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise FastkitError(f"{where}: unknown option {name!r}{hint}")


def check_lora_options(*, r, lora_alpha, lora_dropout, target_modules, bias, use_gradient_checkpointing) -> None:
    """get_peft_model's options, each refused with its name before PEFT sees it."""
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise FastkitError(f"LoRA rank r must be a positive int, got {r!r}.")
    if isinstance(lora_alpha, bool) or not isinstance(lora_alpha, (int, float)) or not 0 < lora_alpha < float("inf"):
        raise FastkitError(f"lora_alpha must be a positive number, got {lora_alpha!r}.")
    if isinstance(lora_dropout, bool) or not isinstance(lora_dropout, (int, float)) or not 0 <= lora_dropout < 1:
        raise FastkitError(f"lora_dropout must be a number in [0, 1), got {lora_dropout!r}.")
    if not (target_modules == "all-linear" or isinstance(target_modules, str) and target_modules
            or isinstance(target_modules, (list, tuple, set)) and target_modules
            and all(isinstance(t, str) and t for t in target_modules)):
        raise FastkitError(f"target_modules must be 'all-linear', a module name / regex, or a non-empty list of "
                           f"module names, got {target_modules!r}.")
    if bias not in ("none", "all", "lora_only"):
        raise FastkitError(f"bias must be 'none', 'all' or 'lora_only', got {bias!r}.")
    if use_gradient_checkpointing not in (True, False, "offload", "auto", "unsloth"):
        raise FastkitError(f"use_gradient_checkpointing must be 'auto', True, False or 'offload', got "
                           f"{use_gradient_checkpointing!r}.")


# -- packed batches reaching a model without the packing patch ----------------------------------------
PACKED_KEYS = ("fastkit_seq_lens", "cu_seq_lens_q")


def refuse_packed_batch(module: torch.nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook: a packed batch on a model whose attention would mix its documents raises.

    Packed batches are recognised by their metadata keys (TRL's padding-free ``cu_seq_lens_q``,
    fastkit's ``fastkit_seq_lens``): no tensor is read. ``make_trainer(packing=True)`` refuses such a
    model before that.
    """
    if getattr(getattr(module, "forward", None), "_fastkit_packing", False):
        return None  # the packing patch was applied after the guard: packed batches are handled
    packed = [k for k in PACKED_KEYS if kwargs.get(k) is not None]
    if packed:
        model_type = getattr(getattr(module, "config", None), "model_type", "?")
        raise FastkitError(f"{packed[0]}: a packed batch reached model_type {model_type!r}, which has no fastkit "
                           "packing patch; its attention would let the packed documents see each other. Train with "
                           "packing=False (make_trainer(..., packing=False)).")
    return None


def refuse_packed_positions(module: torch.nn.Module, args: tuple, kwargs: dict):
    """:func:`refuse_packed_batch`, plus padding-free packed rows given by ``position_ids`` alone.

    For a model family fastkit does not know (its upstream attention may ignore ``position_ids``, as
    phi3's does): in training, without an attention mask, a row whose positions restart at 0 holds
    several documents. Reading that costs one host read per forward, only on such models.
    """
    import torch

    refuse_packed_batch(module, args, kwargs)
    pos = kwargs.get("position_ids")
    if (module.training and kwargs.get("attention_mask") is None and isinstance(pos, torch.Tensor)
            and pos.dim() == 2 and pos.size(1) > 1 and bool((pos[:, 1:] == 0).any())):  # (B, T): a restart
        model_type = getattr(getattr(module, "config", None), "model_type", "?")
        raise FastkitError(f"position_ids restart inside a row: a padding-free packed batch reached model_type "
                           f"{model_type!r}, which has no fastkit packing patch; its attention would let the packed "
                           "documents see each other. Train with packing=False (make_trainer(..., packing=False)).")
    return None


def install_packed_guard(model: torch.nn.Module, decoder: torch.nn.Module | None = None,
                         check_positions: bool = False) -> None:
    """Make packed batches raise on ``model`` (when the packing patch is not active); idempotent.

    The hook sits on the decoder (``decoder``, else ``model``): PEFT calls the causal-LM ``forward``
    directly, which skips hooks on the causal-LM module but not on the decoder it calls.
    ``check_positions`` (families not in fastkit's table) also refuses rows packed by ``position_ids`` alone.
    The hook is registered through :func:`fastkit.patching.change` (record ``"packed_guard"``), so
    ``fastkit.revert`` removes it.
    """
    from fastkit import _torch
    from fastkit.patching import change

    target = decoder if decoder is not None else model
    hook = refuse_packed_positions if check_positions else refuse_packed_batch
    if not any(h in _torch.forward_pre_hooks(target) for h in (refuse_packed_batch, refuse_packed_positions)):
        change(model, "packed_guard", lambda swap: swap.hook(target, hook, with_kwargs=True))


def user_function(spec: str, flag: str):
    """The function ``module:function`` or ``path/to/file.py:function`` names; a FastkitError naming the spec when
    the module cannot be imported (its own error quoted) or has no such function. ``flag`` names the option in the
    message (``--reward``, ``--check``). The reward functions and the evaluation's checks are named this way."""
    import importlib

    where, _, attr = spec.rpartition(":")
    try:
        module = _load_file(where) if where.endswith(".py") else importlib.import_module(where)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 -- the user's file failed at import: its error, exit 2
        raise FastkitError(f"{flag} {spec}: cannot import {where!r} ({type(exc).__name__}: "
                           f"{' '.join(str(exc).split())[:200]}).") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise FastkitError(f"{flag} {spec}: {where!r} has no function {attr!r}.")
    return fn


def _load_file(path: str):
    """The user's ``file.py``, imported as a module of its own."""
    import importlib.util

    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"no such file {path}" if not file.exists() else f"{path} is not a file")
    spec = importlib.util.spec_from_file_location(f"fastkit_user_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


__all__ = ["check_bool", "check_choice", "check_known_options", "check_non_negative_int", "check_positive",
           "check_hf_kwargs", "check_max_seq_length", "check_max_steps", "check_safetensors_file",
           "check_safetensors_files",
           "check_save_target", "check_saved", "check_twin_options", "install_packed_guard", "resolve_dtype",
           "user_function",
           "resolve_patches"]
