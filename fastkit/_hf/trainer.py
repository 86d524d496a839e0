"""The Trainer, TRL's trainers and accelerate: private state fastkit reads or writes during a run, transformers'
progress printers, FSDP on CPU processes. Part of :mod:`fastkit._hf` (its docstring says the rules).
"""

from __future__ import annotations

import os
from typing import Any

import torch


def prepare_inputs(trainer, batch: dict) -> dict:
    """A collated batch as ``training_step`` receives it (on the device): ``trainer._prepare_inputs(batch)``.

    checked: transformers 5.24, 5.25, trl 1.16 (``SFTTrainer``).
    Can go when the Trainer exposes its input preparation publicly.
    """
    return trainer._prepare_inputs(batch)


def save_checkpoint(trainer) -> str:
    """Write ``output_dir/checkpoint-<global_step>`` as ``trainer.train()`` does at a save step (the adapter, optimizer,
    scheduler, RNG states, trainer_state.json; ``save_total_limit`` applied), then run the ``on_save`` callbacks (the
    run identity fastkit's resume checks). ``trainer._save_checkpoint(model, trial=None)``; returns the folder.

    checked: transformers 5.24, 5.25 (``_save_checkpoint(self, model, trial)``).
    Can go when the Trainer exposes saving a resumable checkpoint publicly.
    """
    trainer._save_checkpoint(trainer.model, trial=None)
    trainer.control = trainer.callback_handler.on_save(trainer.args, trainer.state, trainer.control)
    return os.path.join(trainer.args.output_dir, f"checkpoint-{trainer.state.global_step}")


def trainer_loss_accumulator(trainer) -> torch.Tensor:
    """The device tensor the Trainer sums step losses into between log points: ``trainer._tr_loss``.

    Created by ``_inner_training_loop``, read (``.item()``) and zeroed in ``_maybe_log_save_evaluate``.
    checked: transformers 5.24, 5.25.
    Can go when the Trainer exposes its loss accumulator publicly (fastkit reads it for the zero-sync loss log).
    """
    return trainer._tr_loss


def steps_since_log(trainer) -> int:
    """``1 + global_step - _globalstep_last_logged``: the divisor ``_run_epoch``'s NaN/Inf loss filter uses.

    checked: transformers 5.24, 5.25.
    Can go when the Trainer exposes the steps since its last log publicly.
    """
    return 1 + trainer.state.global_step - trainer._globalstep_last_logged


def sft_metrics(trainer) -> dict:
    """TRL's per-mode metric lists, ``SFTTrainer._metrics`` (``{"train": defaultdict(list), "eval": ...}``);
    ``SFTTrainer.log`` averages each list and clears it.

    checked: trl 1.16.
    Can go when TRL exposes its per-mode metric lists publicly.
    """
    return trainer._metrics


def sft_token_total(trainer) -> int:
    """``SFTTrainer._total_train_tokens``: the running token count TRL logs as ``num_tokens``. checked: trl 1.16.
    Can go when TRL exposes its token count publicly.
    """
    return trainer._total_train_tokens


def set_sft_token_total(trainer, total: int) -> None:
    """Write ``SFTTrainer._total_train_tokens``. checked: trl 1.16.
    Can go when TRL exposes its token count publicly (resume writes it back).
    """
    trainer._total_train_tokens = total


def sft_tp_size(trainer) -> int:
    """``SFTTrainer._tp_size``: tensor-parallel ranks that see the same batch (TRL divides token counts by it).

    checked: trl 1.16.
    Can go when TRL exposes its tensor-parallel size publicly.
    """
    return trainer._tp_size


def grpo_tokenizer(trainer):
    """The tokenizer a ``trl.GRPOTrainer`` pads and decodes with: ``GRPOTrainer._tokenizer`` (the processing class,
    or its ``.tokenizer`` for a processor); fastkit's packed log-prob pass reads its ``pad_token_id``.

    checked: trl 1.16.
    Can go when TRL exposes the GRPO trainer's tokenizer publicly.
    """
    return trainer._tokenizer


PROGRESS_CALLBACKS = frozenset({("transformers.trainer_callback", "ProgressCallback"),
                                ("transformers.trainer_callback", "PrinterCallback"),
                                ("transformers.utils.notebook", "NotebookProgressCallback")})
"""(module, class name) of transformers' progress printers (transformers 5.24)."""


def is_progress_callback(callback: Any) -> bool:
    """transformers' progress printers (``ProgressCallback``, ``PrinterCallback``, ``NotebookProgressCallback``).

    Told by the class's module and name (its own or a base's), never by importing them:
    ``transformers.utils.notebook`` imports IPython, which a terminal install does not have (issue 30).
    """
    return any((cls.__module__, cls.__name__) in PROGRESS_CALLBACKS for cls in type(callback).__mro__)


def accelerate_state_made() -> bool:
    """True once accelerate's process state (``PartialState``, shared by every ``Accelerator``) was made in this
    process: processes forked from it would inherit it.
    checked: accelerate 1.16 (``PartialState._shared_state``, the dict its ``initialized`` property reads).
    Can go when accelerate offers a module-level check for ``PartialState`` (``accelerate.state.is_initialized``
    reads ``AcceleratorState`` only).
    """
    from accelerate.state import PartialState

    return bool(PartialState._shared_state)


def fsdp_dropped_on_cpu(trainer) -> bool:
    """True when the job asked for FSDP (``accelerate launch --use_fsdp``, ``ACCELERATE_USE_FSDP=true``) and
    accelerate dropped it: on CPU processes (``DistributedType.MULTI_CPU``) ``AcceleratorState`` keeps no FSDP
    plugin and the Trainer wraps the model in DDP, silently.
    checked: accelerate 1.16 (``AcceleratorState.__init__`` takes ``fsdp_plugin`` only in its GPU-type branch).
    Can go when accelerate keeps the FSDP plugin for ``DistributedType.MULTI_CPU``.
    """
    from accelerate.utils import DistributedType, parse_flag_from_env

    state = trainer.accelerator.state
    return (parse_flag_from_env("ACCELERATE_USE_FSDP", default=False) and getattr(state, "fsdp_plugin", None) is None
            and state.distributed_type == DistributedType.MULTI_CPU)


def fsdp_on_cpu(trainer) -> None:
    """Give the Trainer's accelerator the FSDP plugin accelerate dropped on CPU (:func:`fsdp_dropped_on_cpu`), from
    the same environment (``FSDP_VERSION``, ``FSDP_AUTO_WRAP_POLICY``, ...), so ``accelerator.prepare`` shards the
    model with torch's ``fully_shard`` over the gloo group instead of wrapping it in DDP.
    checked: accelerate 1.16, transformers 5.25 (``AcceleratorState.fsdp_plugin`` / ``distributed_type``, the
    Trainer's ``is_fsdp_enabled`` read after it made its accelerator). Can go when accelerate keeps the FSDP plugin
    for ``DistributedType.MULTI_CPU``.
    """
    from accelerate import FullyShardedDataParallelPlugin
    from accelerate.utils import DistributedType

    state = trainer.accelerator.state
    state.fsdp_plugin = FullyShardedDataParallelPlugin()
    state.distributed_type = DistributedType.FSDP
    trainer.is_fsdp_enabled = True
