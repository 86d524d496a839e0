"""Run identity and checks for resuming, and the non-finite loss guard: what ``fastkit.fit`` adds to a run.

A run's identity is the model (name, family, sizes), the adapter config, a fingerprint of the training
data as the trainer sees it (token ids), and the hyperparameters that shape the trajectory (learning
rate and schedule, steps, batch, seed, precision, packing). :class:`RunGuard` writes it into every
checkpoint (``fastkit_run.json``); :func:`check_resumable` compares a checkpoint's with the current
run's and refuses, naming each difference, a checkpoint from another run, one without optimizer state,
and one that ends a finished run (resuming it would train past ``max_steps``).

:class:`RunGuard` also stops a run whose logged loss or gradient norm is not finite (the weights are
no use from that step on) and :func:`fit` raises its message; on fp16 it names the likely cause.
It reads only the numbers the trainer already logs, so it adds no host-device sync.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from fastkit.errors import FastkitError
from fastkit.patching import unwrap

logger = logging.getLogger(__name__)

RUN_FILE = "fastkit_run.json"
HYPERPARAMETERS = ("learning_rate", "max_steps", "num_train_epochs", "per_device_train_batch_size",
                   "gradient_accumulation_steps", "seed", "data_seed", "lr_scheduler_type", "warmup_steps",
                   "weight_decay", "max_grad_norm", "optim", "fp16", "bf16", "max_length", "packing",
                   "completion_only_loss")
"""TrainingArguments / SFTConfig fields that are part of a run's identity."""
OPTIMIZER_FILES = ("optimizer.pt", "optimizer.bin")


def data_fingerprint(dataset) -> str:
    """A hash of the dataset's content as the trainer sees it (every column's Arrow buffers), or its type."""
    table = getattr(getattr(dataset, "data", None), "table", None)
    if table is None:
        return f"{type(dataset).__name__}:{len(dataset) if hasattr(dataset, '__len__') else '?'}"
    h = hashlib.blake2b(digest_size=12)
    for name in sorted(table.column_names):
        h.update(name.encode())
        for chunk in table.column(name).chunks:
            for buf in chunk.buffers():
                if buf is not None:
                    h.update(memoryview(buf))
    h.update(str(len(dataset)).encode())
    return h.hexdigest()


def _plain(value: Any) -> Any:
    """JSON-comparable: sets sorted, enums / dtypes as strings."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple, set)):
        items = [_plain(v) for v in value]
        return sorted(items, key=str) if isinstance(value, set) else items
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(getattr(value, "value", value))


_ADAPTER_RUNTIME = ("base_model_name_or_path", "revision", "inference_mode", "peft_version", "runtime_config")


def run_identity(trainer) -> dict[str, Any]:
    """What makes this run this run (see the module docstring), JSON-ready."""
    base = unwrap(trainer.model)
    config = base.config
    model = {"name_or_path": str(getattr(config, "name_or_path", "")), "model_type": config.model_type,
             **{k: getattr(config, k, None) for k in ("num_hidden_layers", "hidden_size", "vocab_size")}}
    peft = getattr(trainer.model, "peft_config", None) or {}
    adapter = {name: {k: v for k, v in _plain(c.to_dict()).items() if k not in _ADAPTER_RUNTIME}
               for name, c in peft.items()}
    hyper = {k: _plain(getattr(trainer.args, k, None)) for k in HYPERPARAMETERS}
    return {"model": model, "adapter": adapter or None, "data": data_fingerprint(trainer.train_dataset),
            "hyperparameters": hyper}


def differences(saved: dict, now: dict, prefix: str = "") -> list[str]:
    """``"key: checkpoint X, now Y"`` for every leaf that differs between two identities."""
    out = []
    for key in sorted(set(saved) | set(now)):
        a, b, name = saved.get(key), now.get(key), f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, name + ".")
        elif a != b:
            shown = "training data (its content differs)" if key == "data" else None
            out.append(shown or f"{name}: checkpoint {a!r:.60}, now {b!r:.60}")
    return out


def checkpoint_step(folder: str | Path) -> int:
    state = Path(folder) / "trainer_state.json"
    if state.is_file():
        return int(json.loads(state.read_text()).get("global_step", 0))
    return int(str(folder).rsplit("-", 1)[-1]) if str(folder).rsplit("-", 1)[-1].isdigit() else 0


SCHEDULE = ("max_steps", "num_train_epochs", "warmup_steps")
"""The hyperparameters a continued run (``fit(resume=True, extend=True)``) may change: the schedule's length."""


def check_resumable(trainer, folder: str | Path, extend_to: int | None = None) -> None:
    """Raise unless ``folder`` is a checkpoint of this very run, with its optimizer state, not yet finished.

    ``extend_to`` (the new schedule's optimizer steps, ``fit(..., extend=True)``): the run may be finished and
    only its :data:`SCHEDULE` may differ, to a schedule that ends past the checkpoint's step."""
    folder = Path(folder)
    name = folder.name
    if not any((folder / f).is_file() for f in OPTIMIZER_FILES):
        raise FastkitError(f"resume=True: {name} in {str(folder.parent)!r} has no optimizer state (optimizer.pt); "
                           "resuming would restart AdamW from zero and train a different run. Resume from a "
                           "complete checkpoint, or pass resume=False for a new run.")
    run_file = folder / RUN_FILE
    if not run_file.is_file():
        raise FastkitError(f"resume=True: {name} has no {RUN_FILE} (it was not written by fastkit.fit), so it "
                           "cannot be confirmed to be this run's. Pass resume=False for a new run, or "
                           "trainer.train(resume_from_checkpoint=...) to continue it anyway.")
    saved = json.loads(run_file.read_text())
    diff = differences(saved, run_identity(trainer))
    if extend_to is not None:
        diff = [d for d in diff if not d.startswith(tuple(f"hyperparameters.{k}:" for k in SCHEDULE))]
    if diff:
        raise FastkitError(f"resume=True: {name} is from a different run ({'; '.join(diff[:4])}"
                           f"{' ...' if len(diff) > 4 else ''}). Pass resume=False for a new run, or a different "
                           "output_dir.")
    step, max_steps = checkpoint_step(folder), trainer.args.max_steps
    if extend_to is not None and extend_to <= step:
        raise FastkitError(f"extend=True: the schedule now ends at step {extend_to}, not past {name} (step {step}); "
                           "give a larger max_steps (the whole schedule's length) or more epochs.")
    if extend_to is None and max_steps > 0 and step >= max_steps:
        raise FastkitError(f"resume=True: {name} ends a finished run (step {step} of max_steps={max_steps}); there "
                           "is nothing left to train. Use the saved model, continue it with extend=True and a larger "
                           "max_steps, or pass resume=False for a new run.")


def checkpoints(output_dir: str | Path) -> list[Path]:
    """``checkpoint-<step>`` folders in ``output_dir``, oldest first."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and p.name.startswith("checkpoint-")
             and p.name.split("-", 1)[1].isdigit()]
    return sorted(found, key=lambda p: int(p.name.split("-", 1)[1]))


def set_aside_old_checkpoints(output_dir: str | Path) -> None:
    """A new run: earlier checkpoints move to ``output_dir/previous-run`` (the trainer's rotation would mix them)."""
    old = checkpoints(output_dir)
    if not old:
        return
    aside = Path(output_dir) / "previous-run"
    if aside.exists():
        import shutil

        shutil.rmtree(aside)
    aside.mkdir()
    for p in old:
        os.replace(p, aside / p.name)
    logger.info("fastkit: new run; %d checkpoint(s) of the previous run in %s moved to %s (fit(trainer, "
                "resume=True) continues a run instead)", len(old), output_dir, aside)


class RunGuard(TrainerCallback):
    """Writes the run identity into each checkpoint; stops a run whose loss or gradient norm is not finite."""

    def __init__(self, trainer, note: str):
        self.identity = run_identity(trainer)
        self.note = note
        self.problem: str | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        state.fastkit_run = self.note  # "new run" / "resumed from checkpoint-N": the dashboard reads it

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if folder.is_dir():
            (folder / RUN_FILE).write_text(json.dumps(self.identity, indent=1, sort_keys=True) + "\n")

    def on_log(self, args, state, control, logs=None, **kwargs):
        bad = [(k, v) for k, v in (logs or {}).items() if k in ("loss", "grad_norm")
               and isinstance(v, (int, float)) and not math.isfinite(v)]
        if bad and self.problem is None:
            key, value = bad[0]
            self.problem = non_finite_message(key, value, state.global_step, args)
            control.should_training_stop = True
            control.should_save = False  # never checkpoint non-finite weights


def non_finite_message(key: str, value: float, step: int, args) -> str:
    what = "the loss" if key == "loss" else "the gradient norm"
    why = (" On fp16 (T4) this is most often an overflow (fp16 holds at most 65504): lower learning_rate, keep "
           "max_grad_norm, or train in fp32 (fp16=False) / bf16 on a GPU that has it." if getattr(args, "fp16", False)
           else " Lower learning_rate, check the data for empty or huge rows, or keep max_grad_norm on.")
    return (f"Training stopped: {what} was {value} at step {step}; the weights from that step on are not usable "
            f"(no checkpoint was written for it).{why}")


__all__ = ["RUN_FILE", "SCHEDULE", "RunGuard", "check_resumable", "checkpoints", "data_fingerprint", "differences",
           "run_identity", "set_aside_old_checkpoints"]
