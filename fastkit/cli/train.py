"""``fastkit train``: the notebooks' run from a terminal, with the same defaults and the dashboard as a progress line.

Load (FastModel, patches where they fit) -> data (checked, long rows dropped) -> LoRA -> train
(make_trainer + fit, the terminal dashboard) -> save (LoRA adapters; ``--merged``, ``--gguf`` on
request). Bad options fail before the model loads; bad data fails before the first step.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastkit.cli import export as cli_export

logger = logging.getLogger(__name__)

DEFAULTS = dict(max_seq_length=2048, steps=60, batch_size=1, grad_accumulation=1, lr=2e-4, eval_split=0.0,
                report_to="none", lora_r=16, save_steps=50)
"""The notebooks' parameters-cell defaults (notebooks/_build.py), which the options below share."""


def _number(text: str, convert, ok, what: str):
    """``convert(text)`` when ``ok`` of it, else argparse's error naming ``what`` the option wants."""
    try:
        value = convert(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type: a positive integer (``--steps -1`` is refused here, naming the option)."""
    return _number(text, int, lambda v: v > 0, "a positive integer")


def _positive_float(text: str) -> float:
    """argparse type: a positive, finite number (``--lr inf`` / ``nan`` would train to NaN: refused here)."""
    return _number(text, float, lambda v: v > 0 and math.isfinite(v), "a positive finite number")


def _fraction(text: str) -> float:
    """argparse type: a fraction in [0, 1) (``--eval-split``: the share of rows held out; 0 = none)."""
    return _number(text, float, lambda v: 0 <= v < 1, "a fraction in [0, 1), e.g. 0.05")


def add_parser(sub) -> argparse.ArgumentParser:
    """Register ``fastkit train`` on the ``sub`` subparsers of the main command."""
    d = DEFAULTS
    p = sub.add_parser("train", help="LoRA-train a model on chat data with the live progress line (as the notebooks)",
                       description="LoRA-train MODEL on DATA, as the notebooks do, with a progress line in the "
                                   "terminal. Defaults are the notebooks' parameters cell.")
    p.add_argument("--model", required=True, help="Hub id or local folder (e.g. Qwen/Qwen3-0.6B)")
    p.add_argument("--data", required=True,
                   help="Hub dataset id, a .json/.jsonl/.csv/.parquet file, or offline: 'quickstart' (the quickstart's "
                        "rows) or 'sample' (16 chats in HuggingFaceH4/no_robots' schema, multi-turn rows included)")
    p.add_argument("--drop-invalid", action="store_true",
                   help="drop rows that cannot train (counted in the log) instead of refusing the data")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--steps", type=positive_int, default=None,
                        help=f"optimizer steps (default {d['steps']} unless --epochs)")
    length.add_argument("--epochs", type=_positive_float, default=None, help="passes over the data instead of --steps")
    p.add_argument("--max-seq-length", type=positive_int, default=d["max_seq_length"],
                   help=f"tokens per packed row (default {d['max_seq_length']})")
    p.add_argument("--batch-size", type=positive_int, default=d["batch_size"],
                   help=f"packed rows per micro-batch (default {d['batch_size']})")
    p.add_argument("--grad-accumulation", type=positive_int, default=d["grad_accumulation"],
                   help=f"micro-batches per optimizer step (default {d['grad_accumulation']})")
    p.add_argument("--lr", type=_positive_float, default=d["lr"], help=f"learning rate (default {d['lr']:g})")
    p.add_argument("--eval-split", type=_fraction, default=d["eval_split"],
                   help="fraction of rows held out for eval loss, e.g. 0.05 (default none)")
    p.add_argument("--report-to", default=d["report_to"],
                   help="none, tensorboard, wandb or trackio (installed ones only; default none)")
    p.add_argument("--lora-r", type=positive_int, default=d["lora_r"], help=f"LoRA rank (default {d['lora_r']})")
    p.add_argument("--4bit", dest="load_in_4bit", action="store_true", help="QLoRA: NF4 base weights (CUDA)")
    p.add_argument("--checkpointing", choices=("on", "off", "offload"), default="on",
                   help="gradient checkpointing: on (default), off, or offload (double-buffered CPU offload)")
    p.add_argument("--output-dir", default="outputs/train", help="checkpoints and saved models (default outputs/train)")
    p.add_argument("--save-steps", type=positive_int, default=d["save_steps"],
                   help=f"a checkpoint every that many steps (default {d['save_steps']})")
    p.add_argument("--resume", action="store_true", help="continue the run in --output-dir from its newest checkpoint")
    p.add_argument("--extend", action="store_true",
                   help="with --resume: continue a run (finished or not) for a longer schedule, the --steps or "
                        "--epochs given now; the adapter and optimizer state carry over, only the schedule changes")
    cli_export.add_menu_arguments(p)  # --merged, --gguf Q [Q ...], --name, --push-to-hub, --public
    p.add_argument("--twin", action="store_true",
                   help="a tiny random twin of --model (a Hub id fastkit knows, a model_type, or a local folder with "
                        "a config.json): an offline smoke test")
    return p


INTERRUPTED = 130
"""Exit status of a run stopped by Ctrl-C (the adapters trained so far are saved first)."""


@dataclass
class Prepared:
    """What ``fastkit train`` checked before the model loads."""

    rows: Any
    """The training rows: read, format detected, every row's fields checked (tokens are counted after the load)."""
    resume_from: str | None
    """The checkpoint ``--resume`` continues; None for a new run."""


def preflight(args: argparse.Namespace) -> Prepared:
    """Every check that needs no model, run before it loads (minutes for a 14B model): options, the model folder,
    the GGUF quantization, the output folder, the data (path, format, columns, rows) and the resume state."""
    from fastkit.errors import FastkitError
    from fastkit.training import check_report_to

    if args.extend and not args.resume:
        raise FastkitError("--extend continues a run: give it with --resume (and the longer --steps or --epochs).")
    check_report_to(args.report_to)
    _check_model(args.model, args.twin)
    _check_gguf(args.gguf)
    cli_export.check_menu_arguments(args)  # llama.cpp for K-quants, the Hub token and repos
    _check_output_dir(args.output_dir)
    rows = _read_data(args.data, args.drop_invalid)
    return Prepared(rows=rows, resume_from=_check_resume(args) if args.resume else None)


def _check_model(model: str, twin: bool) -> None:
    """An adapter folder given as ``--model`` (it holds adapter_config.json, no config.json) says so."""
    from fastkit.errors import FastkitError

    path = Path(os.path.expanduser(model))
    if path.is_dir() and (path / "adapter_config.json").is_file() and not (path / "config.json").is_file():
        try:
            base = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
        except (OSError, ValueError):
            base = None
        raise FastkitError(f"--model {model} is a LoRA adapter folder (adapter_config.json, no config.json), not a "
                           f"model: pass its base model as --model{f' ({base})' if base else ''}. To go on training "
                           "a run, use --resume with that run's --output-dir.")
    if twin and path.is_dir() and not (path / "config.json").is_file():
        raise FastkitError(f"--twin --model {model}: that folder has no config.json to build a twin of.")


def _check_gguf(quantizations: list[str] | None) -> None:
    """``--gguf``: the gguf package writing them needs is installed (names: the parser's choices; llama.cpp for
    K-quants: :func:`fastkit.cli.export.check_menu_arguments`)."""
    import importlib.util

    from fastkit.errors import FastkitError

    if quantizations and importlib.util.find_spec("gguf") is None:
        raise FastkitError("--gguf needs the gguf package: pip install 'fastkit-llm[gguf]' (or drop --gguf).")


def _check_output_dir(output_dir: str) -> None:
    """``--output-dir``: a folder (or nothing yet) under a writable folder."""
    from fastkit import checks
    from fastkit.errors import FastkitError

    target = checks.check_save_target(output_dir, "--output-dir")
    existing = target.absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise FastkitError(f"--output-dir {output_dir}: {str(existing)!r} is not a writable folder; pick another one.")


def _read_data(data: str, drop_invalid: bool):
    """``--data`` read and checked without a tokenizer: the file, its format and columns, every row's fields."""
    from fastkit import _quiet
    from fastkit.data import check_rows, normalize_dataset
    from fastkit.data.read import as_dataset
    from fastkit.errors import FastkitError

    _quiet.quiet_progress_bars()
    if data == "quickstart":
        from fastkit.quickstart import quickstart_dataset

        return quickstart_dataset()[0]
    if data == "sample":
        from fastkit.quickstart import NO_ROBOTS_SAMPLE

        data = str(NO_ROBOTS_SAMPLE)
    dataset = as_dataset(data, where="--data")
    if len(dataset) == 0:
        raise FastkitError(f"--data {data}: no rows; give at least one example.")
    return normalize_dataset(check_rows(dataset, drop_invalid))


def _check_resume(args: argparse.Namespace) -> str:
    """``--resume``: the newest checkpoint in ``--output-dir``, with its optimizer and run files, and (without
    ``--extend``) a run that is not finished. Whether it is this run's is checked once the model is loaded."""
    from fastkit.errors import FastkitError
    from fastkit.training import last_checkpoint
    from fastkit.training.identity import check_optimizer_state, checkpoint_step, read_run_file, read_trainer_state

    last = last_checkpoint(args.output_dir)
    if last is None:
        raise FastkitError(f"--resume: no checkpoint-N folder in --output-dir {args.output_dir}; drop --resume for a "
                           "new run there, or give the --output-dir of the run to continue.")
    folder = Path(last)
    check_optimizer_state(folder)  # the same refusals fit(resume=True) gives (flag_words names the flags)
    read_run_file(folder)
    total = int(read_trainer_state(folder).get("max_steps") or 0)
    step = checkpoint_step(folder)
    if args.extend and args.steps is not None and args.steps <= step:
        raise FastkitError(f"--extend: --steps {args.steps} does not reach past {folder.name} (step {step}); give "
                           "a larger --steps (the whole schedule's length) or --epochs.")
    if not args.extend and total and step >= total:
        raise FastkitError(f"--resume: {folder.name} ends a finished run (step {step} of {total}). To train it "
                           "further, add --extend with a longer --steps or --epochs; or drop --resume for a new run.")
    return last


FLAG_WORDS = (
    (r"(?<![-\w])Pass resume=False\b", "Drop --resume"), (r"(?<![-\w])pass resume=False\b", "drop --resume"),
    (r"(?<![-\w])fit\(trainer, resume=True\)", "--resume"), (r"(?<![-\w])resume=True\b", "--resume"),
    (r"(?<![-\w])resume=False\b", "no --resume"), (r"(?<![-\w])extend=True\b", "--extend"),
    (r"(?<![-\w])save_gguf\(quantization=([^)]*)\)", r"--gguf \1"),
    (r"(?<![-\w])drop_invalid=True\b", "--drop-invalid"),
    (r"(?<![-\w])load_in_4bit=True\b", "--4bit"), (r"(?<![-\w])gpu=", "--gpu "),
    (r"(?<![-\w])(output_dir|max_seq_length|eval_split|report_to|batch_size|save_steps)\b=?",
     lambda m: "--" + m.group(1).replace("_", "-") + (" " if m.group(0).endswith("=") else "")),
    (r"(?<![-\w])max_steps\b=?", lambda m: "--steps" + (" " if m.group(0).endswith("=") else "")),
    (r"(?<![-\w])(num_train_epochs|epochs)\b=?", lambda m: "--epochs" + (" " if m.group(0).endswith("=") else "")),
    (r"(?<![-\w])learning_rate\b=?", lambda m: "--lr" + (" " if m.group(0).endswith("=") else "")),
    (r"(?<![-\w])gradient_accumulation_steps\b=?",
     lambda m: "--grad-accumulation" + (" " if m.group(0).endswith("=") else "")),
)
"""(regex, replacement) turning the Python names in fastkit's messages into the CLI's flags."""


def flag_words(text: str) -> str:
    """A fastkit message in the CLI's words: ``resume=False`` -> ``no --resume``, ``output_dir`` ->
    ``--output-dir``, ``max_steps=5`` -> ``--steps 5``, ... (:data:`FLAG_WORDS`)."""
    import re

    for pattern, replacement in FLAG_WORDS:
        text = re.sub(pattern, replacement, text)
    return text


def run(args: argparse.Namespace) -> int:
    """Run ``fastkit train`` with parsed ``args``; returns the exit status (0 when training finished, 130 when
    stopped by Ctrl-C, after the adapters trained so far are saved)."""
    prepared = preflight(args)  # before the model loads
    from fastkit import FastModel
    from fastkit.data import check_dataset
    from fastkit.export import save_lora
    from fastkit.quickstart import NO_ROBOTS_SAMPLE
    from fastkit.training import fit, make_trainer, run_coverage

    model, tokenizer = FastModel.from_pretrained(args.model, max_seq_length=args.max_seq_length,
                                                 load_in_4bit=args.load_in_4bit, twin=args.twin)
    rows = check_dataset(prepared.rows, tokenizer, args.max_seq_length, drop_long=True,
                         drop_invalid=args.drop_invalid)
    for quantization in args.gguf or ():  # the family's GGUF mapping and the tokenizer, before any step
        from fastkit.export.gguf import _check

        _check(model, tokenizer, Path(args.output_dir) / "gguf", quantization)
    checkpointing = {"on": True, "off": False, "offload": "offload"}[args.checkpointing]
    model = FastModel.get_peft_model(model, r=args.lora_r, lora_alpha=args.lora_r,
                                     use_gradient_checkpointing=checkpointing)
    trainer = make_trainer(model, tokenizer, rows, max_steps=args.steps, epochs=args.epochs,
                           batch_size=args.batch_size, gradient_accumulation_steps=args.grad_accumulation,
                           learning_rate=args.lr, max_seq_length=args.max_seq_length, eval_split=args.eval_split,
                           report_to=args.report_to, output_dir=args.output_dir, save_steps=args.save_steps,
                           dashboard="none")
    trainer.fastkit_data = {"sample": str(NO_ROBOTS_SAMPLE), "quickstart": "fastkit's quickstart data"}.get(
        args.data, args.data)  # what the run folder's model card names
    logger.info("fastkit: %s", flag_words(run_coverage(trainer)))
    metrics = fit(trainer, view="terminal", resume=args.resume, extend=args.extend)
    if metrics.status == "interrupted":  # the adapters trained so far; the menu's exports are not made
        logger.info("fastkit: LoRA adapters in %s", save_lora(model, tokenizer, f"{args.output_dir}/lora"))
        return INTERRUPTED
    cli_export.save_after_training(args, model, tokenizer, trainer)  # LoRA + the menu, each verified
    return 0 if metrics.status == "finished" else 1


__all__ = ["DEFAULTS", "FLAG_WORDS", "INTERRUPTED", "Prepared", "add_parser", "flag_words", "preflight", "run"]
