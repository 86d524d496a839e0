"""Run identity and checks for resuming, and the non-finite loss guard: what ``fastkit.fit`` adds to a run.

A run's identity is the model (name, family, sizes), the adapter config, a fingerprint of the training
data as the trainer sees it (token ids), and the hyperparameters that shape the trajectory (learning
rate and schedule, steps, batch, seed, precision, packing). :class:`RunGuard` writes it into every
checkpoint (``fastkit_run.json``); :func:`check_resumable` compares a checkpoint's with the current
run's and refuses, naming each difference, a checkpoint from another run, an incomplete one (optimizer,
scheduler, RNG state, trainer state, adapter weights, a parsable run file: :func:`check_complete`), and
one that ends a finished run (resuming it would train past ``max_steps``).

:class:`RunGuard` also stops a run whose logged loss or gradient norm is not finite (the weights are
no use from that step on) and :func:`fit` raises its message; on fp16 it names the likely cause.
It reads only the numbers the trainer already logs, so it adds no host-device sync.

:class:`ExtendedSchedule` (``fit(resume=True, extend=True)``) starts the continued steps on the new schedule's
rate, not on the one the checkpoint's schedule ended at.
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

from fastkit import checks
from fastkit.errors import FastkitError
from fastkit.patching import unwrap
from fastkit.training.record import record_of

logger = logging.getLogger(__name__)

RUN_FILE = "fastkit_run.json"
HYPERPARAMETERS = ("learning_rate", "max_steps", "num_train_epochs", "per_device_train_batch_size",
                   "gradient_accumulation_steps", "seed", "data_seed", "lr_scheduler_type", "warmup_steps",
                   "weight_decay", "max_grad_norm", "optim", "fp16", "bf16", "max_length", "packing",
                   "completion_only_loss", "beta", "loss_type", "num_generations", "max_completion_length",
                   "temperature", "desirable_weight", "undesirable_weight")
"""TrainingArguments / SFTConfig / DPOConfig / KTOConfig / GRPOConfig fields that are part of a run's identity (a
field the trainer's config lacks reads None on both sides)."""
OPTIMIZER_FILES = ("optimizer.pt", "optimizer.bin")
RECORD_ONLY = "stream_dropped"
"""A checkpoint record's key that is not part of the run's identity: a stream's rows dropped so far (drop_invalid /
drop_long: ``{"rows": distinct rows, "drops": drops}``)."""


def data_fingerprint(dataset) -> str:
    """A hash of the dataset's content as the trainer sees it (every column's Arrow buffers); a stream's
    (:func:`fastkit.data.stream.stream_fingerprint`), or its type."""
    table = getattr(getattr(dataset, "data", None), "table", None)
    if table is None:
        from fastkit.data.stream import is_stream, stream_fingerprint

        if is_stream(dataset):  # its files' sizes, first and last bytes (read whole, it may not fit)
            return stream_fingerprint(dataset)
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
            "hyperparameters": hyper, "processes": processes(trainer)}


def processes(trainer) -> dict[str, int]:
    """How many processes train (``world_size``) and the rows of one optimizer step across them (``global_batch``:
    per-device batch x gradient accumulation x processes)."""
    world = int(getattr(trainer.args, "world_size", 1) or 1)
    per_step = int(trainer.args.per_device_train_batch_size) * int(trainer.args.gradient_accumulation_steps)
    return {"world_size": world, "global_batch": per_step * world}


def check_same_processes(saved: dict, now: dict, name: str) -> None:
    """Refuse a checkpoint saved by another number of processes, naming both (a record without them: before
    fastkit wrote them, one process)."""
    before = saved.get("processes") or {"world_size": 1, "global_batch": None}
    if before["world_size"] == now["world_size"]:
        return

    def words(p: dict) -> str:
        batch = f", global batch {p['global_batch']}" if p.get("global_batch") else ""
        return f"{p['world_size']} process{'es' if p['world_size'] > 1 else ''}{batch}"

    raise FastkitError(f"resume=True: {name} was saved by a run on {words(before)}; this run has {words(now)}. The "
                       "data order, the random states (one file per process) and how many rows a step is all follow "
                       f"the number of processes: resume it on {before['world_size']} "
                       f"(torchrun --nproc_per_node {before['world_size']}, accelerate launch --num_processes "
                       f"{before['world_size']}), or start a new run (resume=False, or another output_dir).")


def differences(saved: dict, now: dict, prefix: str = "") -> list[str]:
    """``"key: checkpoint X, now Y"`` for every leaf that differs between two identities."""
    out = []
    for key in sorted((set(saved) | set(now)) - {RECORD_ONLY}):
        a, b, name = saved.get(key), now.get(key), f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, name + ".")
        elif key == "data" and _data_key(a) != _data_key(b):
            out.append(_data_words(a, b))
        elif a != b and key != "data":
            out.append(f"{name}: checkpoint {a!r:.60}, now {b!r:.60}")
    return out


def _data_key(fingerprint: Any) -> Any:
    """What resume compares of a data fingerprint: a stream's hash (not where its files lie), else all of it."""
    text = str(fingerprint)
    return text.split()[1] if text.startswith("stream ") else fingerprint


def _data_words(saved: Any, now: Any) -> str:
    streams = [str(x) for x in (saved, now) if str(x).startswith("stream ")]
    if not streams:
        return "training data (its content differs)"

    def named(x: Any) -> str:
        text = str(x)
        return text.split(" of ", 1)[1] if text.startswith("stream ") else f"{text:.40}"

    return f"training data: the checkpoint trained on {named(saved)}, this run streams {named(now)}"


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
    check_optimizer_state(folder)  # an interrupted save says so first (the same in any world size)
    saved = read_run_file(folder)
    now = run_identity(trainer)
    check_same_processes(saved, now["processes"], name)  # before the per-process files are looked for
    saved.setdefault("processes", now["processes"])  # a record from before they were written: one process
    check_complete(trainer, folder)
    diff = differences(saved, now)
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


def _has(folder: Path, *patterns: str) -> bool:
    return any(any(folder.glob(p)) for p in patterns)


def missing_pieces(trainer, folder: Path) -> list[str]:
    """What a checkpoint needs for the trainer to restore the run exactly, and ``folder`` lacks (in words)."""
    missing = []
    if not _has(folder, "scheduler.pt"):
        missing.append("scheduler.pt (the learning-rate schedule; without it transformers restores neither "
                       "the schedule nor the optimizer)")
    world = int(getattr(trainer.args, "world_size", 1) or 1)
    rng = "rng_state.pth" if world == 1 else f"rng_state_{int(getattr(trainer.args, 'process_index', 0))}.pth"
    if not _has(folder, rng):  # what transformers reads for this process (one per rank when distributed)
        missing.append(f"{rng} (the random state: dropout and data order would differ)")
    if hasattr(trainer.model, "peft_config") and not _has(folder, "adapter_model.safetensors", "adapter_model.bin",
                                                          "pytorch_model_fsdp*"):
        missing.append("adapter_model.safetensors (the adapter weights)")
    if hasattr(trainer.model, "peft_config") and not _has(folder, "adapter_config.json", "pytorch_model_fsdp*"):
        missing.append("adapter_config.json (the adapter's configuration)")
    elif not hasattr(trainer.model, "peft_config") and not _has(folder, "model*.safetensors", "pytorch_model*"):
        missing.append("model.safetensors (the model weights)")
    return missing


def check_complete(trainer, folder: Path) -> None:
    """Refuse a checkpoint missing any piece of the run's state, naming it, before the trainer reads it."""
    name = _named(folder)
    check_optimizer_state(folder)
    read_trainer_state(folder)
    if (folder / "adapter_config.json").is_file():  # PEFT's load would raise a raw JSONDecodeError
        checks.read_adapter_config(folder, "resume=True")
    missing = missing_pieces(trainer, folder)
    if missing:
        raise FastkitError(f"resume=True: {name} is incomplete (an interrupted save, or files moved): missing "
                           f"{'; '.join(missing)}. Resume from an earlier, complete checkpoint (delete this one), "
                           "or pass resume=False for a new run.")


def _named(folder: Path) -> str:
    return f"{folder.name} in {str(folder.parent)!r}"


def check_optimizer_state(folder: Path) -> None:
    """Refuse a checkpoint without the optimizer's state (resuming would restart AdamW from zero)."""
    if not _has(folder, *OPTIMIZER_FILES, "optimizer_*"):
        raise FastkitError(f"resume=True: {_named(folder)} has no optimizer state (optimizer.pt); resuming would "
                           "restart AdamW from zero and train a different run. Resume from a complete checkpoint, or "
                           "pass resume=False for a new run.")


def read_trainer_state(folder: Path) -> dict:
    """The checkpoint's ``trainer_state.json``, refused clearly when missing or unreadable."""
    return _read_json(folder / "trainer_state.json", _named(folder), "the step, logs and data position")


def _read_json(file: Path, name: str, what: str) -> dict:
    if not file.is_file():
        raise FastkitError(f"resume=True: {name} has no {file.name} ({what}); it is incomplete. Resume from an "
                           "earlier, complete checkpoint, or pass resume=False for a new run.")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise FastkitError(f"resume=True: {name}: {file.name} is not valid JSON ({exc}; truncated by an interrupted "
                           "save?). Resume from an earlier checkpoint, or pass resume=False for a new run.") from exc
    if not isinstance(data, dict):
        raise FastkitError(f"resume=True: {name}: {file.name} holds {type(data).__name__}, not an object; it was "
                           "not written by this run. Pass resume=False for a new run.")
    return data


def read_run_file(folder: Path) -> dict:
    """The run identity stored in checkpoint ``folder`` (:data:`RUN_FILE`), refused clearly when unreadable."""
    if not (folder / RUN_FILE).is_file():
        raise FastkitError(f"resume=True: {folder.name} has no {RUN_FILE} (it was not written by fastkit.fit), so it "
                           "cannot be confirmed to be this run's. Pass resume=False for a new run, or "
                           "trainer.train(resume_from_checkpoint=...) to continue it anyway.")
    return _read_json(folder / RUN_FILE, folder.name, "fastkit's record of the run")


def checkpoints(output_dir: str | Path) -> list[Path]:
    """``checkpoint-<step>`` folders in ``output_dir``, oldest first."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and p.name.startswith("checkpoint-")
             and p.name.split("-", 1)[1].isdigit()]
    return sorted(found, key=lambda p: int(p.name.split("-", 1)[1]))


PREVIOUS_RUN = "previous-run"
CHECKPOINT_FILES = ("optimizer.pt", "optimizer.bin", "scheduler.pt", "scaler.pt", "rng_state*.pth",
                    "trainer_state.json", "training_args.bin", "adapter_model.safetensors", "adapter_model.bin",
                    "adapter_config.json", "README.md", "model*.safetensors", "model.safetensors.index.json",
                    "pytorch_model*.bin", "config.json", "generation_config.json", "tokenizer*", "vocab.*",
                    "merges.txt", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
                    "fastkit_*", RUN_FILE)
"""File names the trainer (and fastkit) write into a checkpoint: a folder holding only these is a checkpoint."""


def foreign_files(folder: Path) -> list[str]:
    """The files under ``folder`` that are not a checkpoint's own (empty: ``folder`` is purely a checkpoint)."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if not p.is_dir()
                  and (p.parent != folder or p.is_symlink() or not any(p.match(n) for n in CHECKPOINT_FILES)))


def set_aside_old_checkpoints(output_dir: str | Path) -> None:
    """A new run: earlier checkpoints move to ``output_dir/previous-run`` (the trainer's rotation would mix them).

    The checkpoints an older run left in ``previous-run`` are removed only when they hold nothing but a
    checkpoint's files (:data:`CHECKPOINT_FILES`); anything else there (a user's notes, a checkpoint with
    a file added) is kept as it is and named in the log, and a checkpoint that would collide with a kept
    one moves in under a new name.
    """
    old = checkpoints(output_dir)
    if not old:
        return
    aside = Path(output_dir) / PREVIOUS_RUN
    if aside.exists() and not aside.is_dir() or aside.is_symlink():
        raise FastkitError(f"A new run moves the previous run's checkpoints to {str(aside)!r}, which is a file (or "
                           "link) fastkit did not make. Move it away, or pass resume=True to continue that run.")
    kept = _clear_previous_run(aside)
    aside.mkdir(exist_ok=True)
    for p in old:
        os.replace(p, _free_name(aside / p.name))
    logger.info("fastkit: new run; %d checkpoint(s) of the previous run in %s moved to %s (fit(trainer, "
                "resume=True) continues a run instead)%s", len(old), output_dir, aside,
                f"; kept there as they are (not a checkpoint's files): {kept[:5]}" if kept else "")


def _clear_previous_run(aside: Path) -> list[str]:
    """Remove the pure checkpoints in ``aside``; returns the names of what is kept."""
    import shutil

    if not aside.is_dir():
        return []
    kept = []
    for entry in sorted(aside.iterdir()):
        if entry.is_dir() and not entry.is_symlink() and entry.name.startswith("checkpoint-") \
                and not foreign_files(entry):
            shutil.rmtree(entry)
        else:
            kept.append(entry.name)
    return kept


def _free_name(path: Path) -> Path:
    """``path``, or ``path-1``, ``path-2``... when something is already there."""
    candidate, n = path, 0
    while os.path.lexists(candidate):
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


def check_trainable(model) -> None:
    """Refuse, before the first step, a model with nothing to train (it would fail at the first backward)."""
    if any(p.requires_grad for p in model.parameters()):
        return
    hint = (" load_lora(model, path, is_trainable=False) loads an adapter for inference only; load it with "
            "is_trainable=True to go on training it." if hasattr(model, "peft_config") else
            " Add LoRA adapters first (FastModel.get_peft_model).")
    raise FastkitError(f"fit: no parameter of the model is trainable (every requires_grad is False).{hint}")


class RunGuard(TrainerCallback):
    """Writes the run identity into each checkpoint; stops a run whose loss or gradient norm is not finite."""

    def __init__(self, trainer, note: str):
        check_trainable(trainer.model)
        self.identity = run_identity(trainer)
        self.dropped = record_of(trainer).dropped  # a stream's drops (fastkit.data.stream.DropCount)
        self.note = note
        self.problem: str | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        state.fastkit_run = self.note  # "new run" / "resumed from checkpoint-N": the dashboard reads it

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if args.should_save and folder.is_dir():  # the process that wrote the checkpoint (one per job)
            record = dict(self.identity)
            if self.dropped is not None:  # the record of the run so far, not its identity (resume ignores it)
                record[RECORD_ONLY] = {"rows": len(self.dropped.rows), "drops": self.dropped.count}
            (folder / RUN_FILE).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")

    def on_log(self, args, state, control, logs=None, **kwargs):
        bad = [(k, v) for k, v in (logs or {}).items() if k in ("loss", "grad_norm")
               and isinstance(v, (int, float)) and not math.isfinite(v)]
        if bad and self.problem is None:
            key, value = bad[0]
            self.problem = non_finite_message(key, value, state.global_step, args)
            control.should_training_stop = True
            control.should_save = False  # never checkpoint non-finite weights


class ExtendedSchedule(TrainerCallback):
    """``fit(resume=True, extend=True)``: the continued steps follow the new schedule from the checkpoint's step on.

    The trainer builds its scheduler for the new length, then loads the checkpoint's scheduler state into it. That
    brings back the step count (right), but also the rate the old schedule set last (wrong: the first continued
    step would train at it, 0 after a linear decay). Before the first step, this puts the rate of the new schedule
    at the checkpoint's step in its place (:func:`restart_schedule_at`)."""

    def on_train_begin(self, args, state, control, lr_scheduler=None, **kwargs):
        restart_schedule_at(lr_scheduler, state.global_step)


def restart_schedule_at(scheduler, step: int) -> None:
    """Set the optimizer's rate (and ``get_last_lr()``) to what ``scheduler``'s own schedule gives after ``step``
    optimizer steps: the rate step ``step + 1`` trains at.

    Only a step-indexed schedule (a ``LambdaLR``: every transformers ``lr_scheduler_type`` but the plateau ones,
    which follow the eval metric, not the step) is moved; another is left as the checkpoint restored it (logged).
    """
    import torch

    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        logger.info("fastkit: extend: the %s scheduler is not indexed by the step; kept as the checkpoint left it",
                    type(scheduler).__name__)
        return
    restored = scheduler.get_last_lr()[0]
    scheduler.last_epoch = step - 1
    scheduler.step()  # last_epoch back at ``step``; its rate written into the optimizer's param groups
    logger.info("fastkit: extend: learning rate %.3g from step %d on the new schedule (the checkpoint's: %.3g)",
                scheduler.get_last_lr()[0], step + 1, restored)


def non_finite_message(key: str, value: float, step: int, args) -> str:
    what = "the loss" if key == "loss" else "the gradient norm"
    why = (" On fp16 (T4) this is most often an overflow (fp16 holds at most 65504): lower learning_rate, keep "
           "max_grad_norm, or train in fp32 (fp16=False) / bf16 on a GPU that has it." if getattr(args, "fp16", False)
           else " Lower learning_rate, check the data for empty or huge rows, or keep max_grad_norm on.")
    return (f"Training stopped: {what} was {value} at step {step}; the weights from that step on are not usable "
            f"(no checkpoint was written for it).{why}")


__all__ = ["RUN_FILE", "SCHEDULE", "ExtendedSchedule", "RunGuard", "check_complete", "check_resumable",
           "check_same_processes", "checkpoints", "data_fingerprint", "differences", "missing_pieces", "processes",
           "read_run_file", "restart_schedule_at", "run_identity", "set_aside_old_checkpoints"]
