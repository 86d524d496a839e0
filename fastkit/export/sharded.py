"""The LoRA of a model FSDP2 has sharded (``accelerate launch`` with ``fsdp_version: 2``: every parameter a
``DTensor`` shard): gathered from every rank, saved once by the main process, verified.

A sharded model cannot be saved by one process alone (each holds a slice of every adapter) nor run by one (its
forward all-gathers from every rank), so :func:`save_sharded_lora` is called on every rank: the trainable
parameters are gathered whole onto the main process's CPU (torch's ``get_model_state_dict`` with
``full_state_dict``, ``ignore_frozen_params``: the base weights stay sharded), which writes PEFT's adapter folder
from them and checks the file: every tensor read back equals the gathered one, bit for bit. The single-process
check (reload and compare logits) needs a forward of the whole model in one process: not done under FSDP.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from fastkit import checks
from fastkit.distributed import ranks
from fastkit.errors import FastkitError

logger = logging.getLogger("fastkit")


def is_sharded(model: torch.nn.Module) -> bool:
    """True when ``model``'s parameters are FSDP2 shards (``torch.distributed.tensor.DTensor``)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def gather_lora(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters whole, on the main process's CPU (an empty dict elsewhere). Every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    return get_model_state_dict(model, options=options)


def save_sharded_lora(model: torch.nn.Module, tokenizer, path: str | Path) -> str | None:
    """Save the LoRA adapters of an FSDP2-sharded PEFT ``model`` (and the tokenizer) to ``path``, once; called on
    every rank (the gather is a collective). Returns the path on the main process, None elsewhere."""
    if not hasattr(model, "peft_config"):
        raise FastkitError("save_sharded_lora needs a PEFT model (FastModel.get_peft_model).")
    state = gather_lora(model)
    return ranks.agreed(_write, model, tokenizer, path, state, main_only=True)


def _write(model: torch.nn.Module, tokenizer, path: str | Path, state: dict[str, torch.Tensor]) -> str:
    from fastkit.export import hub
    from fastkit.export import verified as saving
    from fastkit.export.adapter_checks import write_info

    path = checks.check_save_target(path)
    with saving.staged_folder(path, "save_lora", model) as tmp:
        model.save_pretrained(str(tmp), safe_serialization=True, state_dict=state)
        checks.check_saved(tmp, "*.safetensors", "save_lora")
        write_info(model, tmp)
        tokenizer.save_pretrained(str(tmp))
        written = verify_written(model, tmp, state)
        hub.write_card(tmp, "lora", model, str(path), True)
    logger.info("fastkit: save_lora verified (FSDP): the %d tensors written equal the ones gathered from %d "
                "processes", written, ranks.world_size())
    return str(path)


def verify_written(model: torch.nn.Module, folder: Path, state: dict[str, torch.Tensor]) -> int:
    """The adapter file's tensors equal ``state``'s (PEFT's names: adapter name dropped), bit for bit; their count."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    want = get_peft_model_state_dict(model, state_dict=state)
    got = load_file(str(Path(folder) / "adapter_model.safetensors"))
    if set(got) != set(want) or not want:
        raise FastkitError(f"save_lora (FSDP): the adapter file holds {len(got)} tensors, the gathered LoRA "
                           f"{len(want)}; nothing was replaced.")
    for name, tensor in want.items():
        if not torch.equal(got[name], tensor.to(got[name].dtype)):
            raise FastkitError(f"save_lora (FSDP): {name} in the file differs from the gathered one; nothing was "
                               "replaced.")
    return len(want)
