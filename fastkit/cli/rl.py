"""``fastkit dpo``, ``fastkit kto`` and ``fastkit grpo``: preference tuning and reasoning RL from a terminal, as
``fastkit train``.

Load (FastModel, patches where they fit) -> LoRA -> ``make_dpo_trainer`` / ``make_kto_trainer`` /
``make_grpo_trainer`` -> ``fit`` with the progress line -> save (LoRA adapters, verified; ``--merged``, ``--gguf`` on
request). Options, ``--config`` and ``--print-config``: :mod:`fastkit.cli.config` (their fields:
:mod:`fastkit.cli.rl_options`). Everything that needs no model is checked before it loads (the options, TRL's config,
the model folder, the output folder, the data row by row, the reward functions): a bad input exits 2 naming the flag
or file. Under ``torchrun`` a refusal on any rank ends every rank, as for ``fastkit train``.

``--data sample`` is fastkit's shipped set: preference pairs for DPO (and KTO, unpaired), math word problems with an
``answer`` column for GRPO (:mod:`fastkit.quickstart.rl_data`).
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import Any

from fastkit.cli import rl_options
from fastkit.cli import train as cli_train
from fastkit.cli.config import Command, print_config
from fastkit.cli.config import resolved_args as resolve_args
from fastkit.cli.rl_options import COMMANDS

logger = logging.getLogger(__name__)

HELP = {"dpo": "DPO: LoRA-tune a model on preference pairs (prompt, chosen, rejected)",
        "kto": "KTO: LoRA-tune a model on unpaired feedback (prompt, completion, label: desirable or not)",
        "grpo": "GRPO: LoRA-tune a model on prompts, scored by reward functions"}


def add_parser(sub, name: str, argv: list[str]) -> argparse.ArgumentParser:
    """Register ``fastkit dpo`` / ``kto`` / ``grpo`` on ``sub`` (:meth:`fastkit.cli.config.Command.add_parser`)."""
    return COMMANDS[name].add_parser(sub, argv, HELP[name], HELP[name])


ORPO_REFUSAL = ("ORPO is not available: TRL 1.16 ships ORPOTrainer only under trl.experimental (no stable API), so "
                "fastkit does not wrap it. Use fastkit dpo on preference pairs (prompt, chosen, rejected), after "
                "fastkit train for SFT, or fastkit kto on unpaired feedback (prompt, completion, label).")


def add_orpo_parser(sub) -> argparse.ArgumentParser:
    """``fastkit orpo``: listed, so that it says why it is not there and what to use instead."""
    return sub.add_parser("orpo", help="ORPO: not available (TRL 1.16 has it only under trl.experimental); use dpo",
                          description=ORPO_REFUSAL, add_help=True, prefix_chars="-")


def refuse_orpo(argv: list[str]) -> None:
    """``fastkit orpo ...`` (any flags): a FastkitError saying why, before argparse reads the flags; ``--help``
    prints the same words."""
    if argv[:1] == ["orpo"] and not {"-h", "--help"} & set(argv):
        from fastkit.errors import FastkitError

        raise FastkitError(ORPO_REFUSAL)


def resolved_args(args: argparse.Namespace) -> argparse.Namespace:
    """The flags, the ``--config`` file and the defaults as one checked namespace
    (:func:`fastkit.cli.config.resolved_args`)."""
    out = resolve_args(args, COMMANDS[args.command])
    out.data_label = _data_label(out.resolved.command, out.resolved.run.data)
    return out


def _data_label(command: Command, data: Any) -> str:
    if data == "sample":
        return {"dpo": "fastkit's shipped preference pairs", "kto": "fastkit's shipped preference pairs, unpaired",
                "grpo": "fastkit's shipped math prompts"}[command.name]
    return str(data)


@dataclass
class Prepared:
    """What ``fastkit dpo`` / ``kto`` / ``grpo`` checked before the model loads."""

    rows: Any
    """The training rows (a ``datasets.Dataset``), every row checked (KTO: unpaired, labels bool)."""
    rewards: list | None
    """GRPO: the reward functions ``--reward`` names, imported."""
    resume_from: str | None
    """The checkpoint ``--resume`` continues; None for a new run."""


def preflight(args: argparse.Namespace) -> Prepared:
    """Every check that needs no model, before it loads: options, TRL's config, the model and output folders, the
    export menu, the data row by row, the reward functions, the resume state."""
    command = args.resolved.command
    cli_train.check_job(args)
    _check_trl_config(command, args.resolved.trl)
    rows, rewards = check_rows(command, read_data(command, args.data), args)
    return Prepared(rows=rows, rewards=rewards, resume_from=cli_train.check_resume(args) if args.resume else None)


def check_rows(command: Command, rows, args: argparse.Namespace) -> tuple[Any, list | None]:
    """``(rows, reward functions)``: the rows checked without a tokenizer (DPO's pairs, KTO's unpaired rows, GRPO's
    prompts and the columns the rewards read); GRPO's reward functions imported."""
    where = f"--data {args.data}"
    if command.name == "dpo":
        from fastkit.training.dpo import check_pairs

        check_pairs(rows, None, where=where)
        return rows, None
    if command.name == "kto":
        from fastkit.training import kto

        return kto.check_rows(kto.unpaired(rows, where), None, where), None
    from fastkit.training.grpo import check_prompt_rows, wrap_reward_funcs

    rewards = reward_functions(args.options.reward)
    check_prompt_rows(rows, wrap_reward_funcs(rewards), where=where)
    return rows, rewards


def _check_trl_config(command: Command, trl: dict[str, Any]) -> None:
    """TRL's DPOConfig / KTOConfig / GRPOConfig with the pass-through fields, built once before the model loads (its own
    refusals: a scheduler or optimizer name, a loss type...)."""
    import tempfile

    import torch
    import trl as trl_module

    from fastkit.errors import FastkitError

    cuda = torch.cuda.is_available()
    base = dict(output_dir=tempfile.gettempdir(), report_to=[], bf16=False, fp16=False,
                activation_checkpointing=False, **({} if cuda else {"use_cpu": True}))
    try:
        getattr(trl_module, command.trl_config)(**{**base, **trl})
    except (ValueError, TypeError) as exc:
        raise FastkitError(f"trl.{command.trl_config} refuses the options: {' '.join(str(exc).split())}") from exc


def read_data(command: Command, data: Any):
    """``--data``: a file, a folder or a Hub dataset id (``fastkit.data.read.as_dataset``), or ``sample``."""
    if data == "sample":
        from fastkit.quickstart.rl_data import math_dataset, preference_dataset

        return math_dataset() if command.name == "grpo" else preference_dataset()  # KTO unpairs the pairs
    from fastkit.data.read import as_dataset

    return as_dataset(data, where=f"--data {data}")


def reward_functions(value: Any) -> list:
    """``--reward``'s functions: the shipped ones by name, others imported from ``module:function`` or
    ``path/to/file.py:function``; a FastkitError naming the one that cannot be found."""
    from fastkit import checks
    from fastkit.training import rewards

    out = []
    for name in rl_options.reward_names(value):
        if name in rl_options.SHIPPED_REWARDS or name in rl_options.SHIPPED_REWARDS.values():
            out.append(getattr(rewards, rl_options.SHIPPED_REWARDS.get(name, name)))
        else:
            out.append(checks.user_function(name, "--reward"))
    return out


def build(args: argparse.Namespace, prepared: Prepared):
    """(model, tokenizer, trainer) of a resolved run: load, LoRA, make_dpo_trainer / make_kto_trainer /
    make_grpo_trainer (which check the rows again with the tokenizer: the chat template, lengths), nothing trained
    yet."""
    from fastkit import FastModel
    from fastkit.training import make_dpo_trainer, make_grpo_trainer, make_kto_trainer

    options = args.options
    model, tokenizer = FastModel.from_pretrained(args.model, max_seq_length=options.max_seq_length,
                                                 load_in_4bit=args.load_in_4bit, twin=args.twin)
    model = FastModel.get_peft_model(model, options=args.lora, random_state=options.seed)
    kwargs = {**options.trainer_kwargs(), **args.resolved.trl}
    name = args.resolved.command.name
    if name in ("dpo", "kto"):
        make = make_dpo_trainer if name == "dpo" else make_kto_trainer
        trainer = make(model, tokenizer, prepared.rows, **kwargs)
    else:
        trainer = make_grpo_trainer(model, tokenizer, prepared.rows, reward_funcs=prepared.rewards,
                                    **_grpo_kwargs(kwargs))
    # the data the run folder's model card names; the config fit saves as output_dir/fastkit_config.yaml and the
    # command that reads it back
    trainer.update_record(data=args.data_label, config=args.resolved.to_dict(), command=args.resolved.command.name)
    return model, tokenizer, trainer


def _grpo_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """make_grpo_trainer's keywords: max_seq_length is the load's (the prompt limit follows from it); the reward
    functions are imported by the preflight."""
    return {k: v for k, v in kwargs.items() if k not in ("max_seq_length", "reward")}


def run(args: argparse.Namespace) -> int:
    """Run ``fastkit dpo`` / ``kto`` / ``grpo`` with parsed ``args``; the exit status (0 done, 130 stopped by Ctrl-C
    after the adapters trained so far are saved). Rank-aware as ``fastkit train``."""
    args = resolved_args(args)
    if args.print_config:  # nothing is loaded; TRL's fields given were checked against its dataclass's types
        print(print_config(args.resolved), end="")
        return 0
    from fastkit.distributed import ranks
    from fastkit.training import fit

    ranks.quiet_replicas()  # a torchrun job: the main process prints, the others warn only
    prepared = ranks.agreed(preflight, args)  # before the model loads; a refusal on any rank ends every rank
    model, tokenizer, trainer = build(args, prepared)
    trainer.update_record(resume_hint=cli_train.resume_command(args))  # Ctrl-C's message: how to continue
    metrics = fit(trainer, view="terminal", resume=args.resume, extend=args.extend)
    return cli_train.save_run(args, model, tokenizer, trainer, metrics.status)  # FSDP: gathered, saved once


__all__ = ["ORPO_REFUSAL", "Prepared", "add_orpo_parser", "add_parser", "build", "check_rows", "preflight", "read_data",
           "refuse_orpo", "resolved_args", "reward_functions", "run"]
