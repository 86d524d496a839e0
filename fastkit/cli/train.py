"""``fastkit train``: the notebooks' run from a terminal, with the same defaults and the dashboard as a progress line.

Load (FastModel, patches where they fit) -> data (checked, long rows dropped) -> LoRA -> train
(make_trainer + fit, the terminal dashboard) -> save (LoRA adapters; ``--merged``, ``--gguf`` on
request). Bad options fail before the model loads; bad data fails before the first step.
"""

from __future__ import annotations

import argparse
import logging

from fastkit.cli import export as cli_export

logger = logging.getLogger(__name__)

DEFAULTS = dict(max_seq_length=2048, steps=60, batch_size=1, grad_accumulation=1, lr=2e-4, eval_split=0.0,
                report_to="none", lora_r=16, save_steps=50)
"""The notebooks' parameters-cell defaults (notebooks/_build.py), which the options below share."""


def positive_int(text: str) -> int:
    """argparse type: a positive integer (``--steps -1`` is refused here, naming the option)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def add_parser(sub) -> argparse.ArgumentParser:
    """Register ``fastkit train`` on the ``sub`` subparsers of the main command."""
    d = DEFAULTS
    p = sub.add_parser("train", help="LoRA-train a model on chat data with the live progress line (as the notebooks)",
                       description="LoRA-train MODEL on DATA, as the notebooks do, with a progress line in the "
                                   "terminal. Defaults are the notebooks' parameters cell.")
    p.add_argument("--model", required=True, help="Hub id or local folder (e.g. Qwen/Qwen3-0.6B)")
    p.add_argument("--data", required=True, help="Hub dataset id, a .json/.jsonl file, or 'quickstart' (offline)")
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
    p.add_argument("--eval-split", type=float, default=d["eval_split"],
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
    cli_export.add_menu_arguments(p)  # --merged, --gguf Q [Q ...], --name, --push-to-hub, --public
    p.add_argument("--twin", action="store_true", help="a tiny random twin of --model (offline smoke test)")
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``fastkit train`` with parsed ``args``; returns the exit status (0 when training finished)."""
    from fastkit import FastModel
    from fastkit.data import check_dataset, load_chat_dataset
    from fastkit.training import check_report_to, fit, make_trainer, run_coverage

    check_report_to(args.report_to)  # before the model loads
    cli_export.check_menu_arguments(args)  # GGUF quantizations, llama.cpp, the Hub token: before it too
    model, tokenizer = FastModel.from_pretrained(args.model, max_seq_length=args.max_seq_length,
                                                 load_in_4bit=args.load_in_4bit, twin=args.twin)
    if args.data == "quickstart":
        from fastkit.quickstart import quickstart_dataset

        rows, _ = quickstart_dataset()
    else:
        rows = load_chat_dataset(args.data)
    rows = check_dataset(rows, tokenizer, args.max_seq_length, drop_long=True)
    checkpointing = {"on": True, "off": False, "offload": "offload"}[args.checkpointing]
    model = FastModel.get_peft_model(model, r=args.lora_r, lora_alpha=args.lora_r,
                                     use_gradient_checkpointing=checkpointing)
    trainer = make_trainer(model, tokenizer, rows, max_steps=args.steps, epochs=args.epochs,
                           batch_size=args.batch_size, gradient_accumulation_steps=args.grad_accumulation,
                           learning_rate=args.lr, max_seq_length=args.max_seq_length, eval_split=args.eval_split,
                           report_to=args.report_to, output_dir=args.output_dir, save_steps=args.save_steps,
                           dashboard="none")
    logger.info("fastkit: %s", run_coverage(trainer))
    metrics = fit(trainer, view="terminal", resume=args.resume)
    cli_export.save_after_training(args, model, tokenizer, trainer)  # LoRA + the menu, verified
    return 0 if metrics.status == "finished" else 1


__all__ = ["DEFAULTS", "add_parser", "run"]
