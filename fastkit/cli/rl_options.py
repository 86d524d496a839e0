"""``fastkit dpo`` / ``fastkit kto`` / ``fastkit grpo``: their option fields, declared as commands of the one options
system (:class:`fastkit.cli.config.Command`: flags, ``--config``, ``--print-config`` as ``fastkit train``'s).

Each command's options are :class:`fastkit.cli.config.JobOptions` (what to train and save, less ``data_mix``: one
``--data`` source), :class:`DpoOptions`, :class:`KtoOptions` or :class:`GrpoOptions` (the keyword arguments of
``make_dpo_trainer`` / ``make_kto_trainer`` / ``make_grpo_trainer``) and :class:`fastkit.training.options.LoraOptions`.
Every other field of TRL's ``DPOConfig`` / ``KTOConfig`` / ``GRPOConfig`` passes through by name (``--trl NAME=VALUE``,
its own flag, or a key of the file; checked against the installed TRL's dataclass).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from fastkit.checks import check_bool, check_non_negative_int, check_positive
from fastkit.cli.config import Command
from fastkit.errors import FastkitError
from fastkit.training.options import (
    DEFAULT_MAX_STEPS,
    check_dashboard,
    check_fields,
    check_number,
    check_output_dir,
    check_trackers,
    option,
    plain,
)

_positive_or_none = functools.partial(check_positive, allow_none=True)
_number_or_none = functools.partial(check_number, allow_none=True)

SHIPPED_REWARDS = {"format": "format_reward", "tags": "tags_reward", "exact_answer": "exact_answer",
                   "length": "length_reward"}
"""``--reward`` names -> the function in :mod:`fastkit.training.rewards` (its own name works too)."""


def _rewards(name: str, value: Any) -> None:
    """``--reward``: shipped names (:data:`SHIPPED_REWARDS`) or ``module:function`` / ``file.py:function``, as a
    list or one comma-separated text; checked here by form (the functions are imported by the preflight)."""
    items = reward_names(value)
    known = {*SHIPPED_REWARDS, *SHIPPED_REWARDS.values()}
    for item in items:
        if item not in known and not (":" in item and all(part.strip() for part in item.rsplit(":", 1))):
            raise FastkitError(f"{name}: {item!r} is neither a shipped reward ({', '.join(SHIPPED_REWARDS)}) nor "
                               "module:function (or path/to/file.py:function).")


def _generations(name: str, value: Any) -> None:
    check_positive(name, value)
    if value < 2:
        raise FastkitError(f"{name}={value}: GRPO compares completions of the same prompt, give at least 2.")


def reward_names(value: Any) -> list[str]:
    """``--reward``'s value as a list of names (``"format,length"`` and ``["format", "length"]`` alike)."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) for i in items):
        raise FastkitError(f"reward must be names (format, tags, exact_answer, length, module:function), got "
                           f"{value!r}.")
    names = [n.strip() for item in items for n in item.split(",") if n.strip()]
    if not names:
        raise FastkitError("reward: give at least one reward function.")
    return names


@dataclass
class RlOptions:
    """What ``fastkit dpo``, ``kto`` and ``grpo`` share: the make_*_trainer run options."""

    max_steps: int | None = option(None, "optimizer steps to run (default 60 unless epochs is set)",
                                   flags=("--steps",), check=_positive_or_none)
    epochs: float | None = option(None, "passes over the data instead of max_steps", aliases=("num_train_epochs",),
                                  check=_number_or_none)
    learning_rate: float = option(5e-5, "AdamW learning rate (LoRA; TRL's 1e-6 default is for full fine-tuning)",
                                  flags=("--lr",), check=check_number)
    batch_size: int = option(1, "DPO: pairs per device step; KTO: rows (at least 2); GRPO: prompts",
                             aliases=("per_device_train_batch_size",), check=check_positive)
    gradient_accumulation_steps: int = option(1, "device steps per optimizer step", flags=("--grad-accumulation",),
                                              check=check_positive)
    max_seq_length: int | None = option(None, "tokens the model is loaded with (DPO: a pair's prompt + longer "
                                        "answer at most; KTO: a row's prompt + completion)", check=_positive_or_none)
    beta: float = option(0.1, "KL strength against the reference (the adapter disabled)",
                         check=functools.partial(check_number, low_open=False))
    seed: int = option(3407, "seed of the run (data order, sampling, LoRA init)",
                       check=check_non_negative_int)
    save_steps: int | None = option(None, "a checkpoint every that many steps in output_dir (2 kept; None: none)",
                                    check=_positive_or_none)
    output_dir: str = option("outputs", "checkpoints and saved models", check=check_output_dir)
    report_to: str | list[str] = option("none", "none, tensorboard, wandb or trackio (installed ones only)",
                                        check=check_trackers)
    dashboard: str = option("auto", "auto, html, widget, terminal or none", check=check_dashboard)

    def __post_init__(self) -> None:
        check_fields(self)
        if self.max_steps is not None and self.epochs is not None:
            raise FastkitError("Give max_steps or epochs, not both.")

    def trainer_kwargs(self) -> dict[str, Any]:
        """make_dpo_trainer's / make_grpo_trainer's keyword arguments these options mean."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if out["max_steps"] is None and out["epochs"] is None:
            out["max_steps"] = DEFAULT_MAX_STEPS
        return out

    def to_dict(self) -> dict[str, Any]:
        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


def _packing() -> Any:
    """DPO's and GRPO's ``packing`` option (KTO's rows are padded)."""
    return option(True, "run the rows of a step as one padding-free packed row (where fastkit's packing patch is "
                  "active; exact against padded)", check=check_bool)


def _drop_long(rows: str) -> Any:
    """DPO's and KTO's ``drop_long`` option."""
    return option(False, f"drop {rows} longer than max_seq_length (logged) instead of refusing the data",
                  check=check_bool)


@dataclass
class DpoOptions(RlOptions):
    """``fastkit dpo``: :func:`fastkit.training.make_dpo_trainer`'s options."""

    beta: float = option(0.1, "DPO's KL strength against the reference (the adapter disabled); positive",
                         check=check_number)
    packing: bool = _packing()
    drop_long: bool = _drop_long("pairs")


@dataclass
class KtoOptions(RlOptions):
    """``fastkit kto``: :func:`fastkit.training.make_kto_trainer`'s options."""

    beta: float = option(0.1, "KTO's KL strength against the reference (the adapter disabled); positive",
                         check=check_number)
    desirable_weight: float = option(1.0, "weight of the desirable rows' loss (label true)", check=check_number)
    undesirable_weight: float = option(1.0, "weight of the undesirable rows' loss (label false)", check=check_number)
    drop_long: bool = _drop_long("rows")


@dataclass
class GrpoOptions(RlOptions):
    """``fastkit grpo``: :func:`fastkit.training.make_grpo_trainer`'s options."""

    beta: float = option(0.04, "KL strength against the reference (the adapter disabled); 0 skips the reference "
                         "pass", check=functools.partial(check_number, low_open=False))
    packing: bool = _packing()
    reward: list[str] = option(help="reward functions: format, tags, exact_answer, length (fastkit.training."
                               "rewards), or module:function / path/to/file.py:function; several: format,length",
                               factory=lambda: ["format", "exact_answer"], check=_rewards)
    num_generations: int = option(4, "completions per prompt (at least 2: GRPO compares them)",
                                  check=lambda n, v: _generations(n, v))
    max_completion_length: int = option(256, "tokens per completion at most", check=check_positive)
    temperature: float = option(1.0, "sampling temperature of the completions", check=check_number)
    max_prompt_length: int | None = option(None, "refuse longer prompts (default: max_seq_length less "
                                           "max_completion_length)", check=_positive_or_none)

    def __post_init__(self) -> None:
        _rewards("reward", self.reward)
        self.reward = reward_names(self.reward)  # "format,length" -> ["format", "length"]
        super().__post_init__()
        seq, completion = self.max_seq_length, self.max_completion_length
        if self.max_prompt_length is None and seq is not None and completion >= seq:
            raise FastkitError(f"max_completion_length={completion} leaves no room for a prompt within "
                               f"max_seq_length={seq} (prompts get max_seq_length less max_completion_length): raise "
                               "max_seq_length or lower max_completion_length.")


DATA_HELP = {"dpo": "preference pairs (prompt, chosen, rejected: text or chat messages): a .json/.jsonl/.csv/"
                    ".parquet file, a folder, a Hub dataset id, or 'sample' (fastkit's shipped pairs)",
             "kto": "unpaired feedback (prompt, completion, label: true for a desirable completion; text or chat "
                    "messages; or preference pairs, unpaired): a file, a folder, a Hub dataset id, or 'sample' "
                    "(fastkit's shipped pairs, unpaired)",
             "grpo": "prompts (a 'prompt' column, text or chat messages, and the columns the rewards read): a file, a "
                     "folder, a Hub dataset id, or 'sample' (fastkit's shipped math prompts with an 'answer' column)"}
"""``--data``'s help: one source (fastkit train's mixes several)."""
_COMMON = ("model", "data", "max_steps", "epochs", "learning_rate", "batch_size", "gradient_accumulation_steps",
           "max_seq_length", "beta", "lora_r", "load_in_4bit", "output_dir", "merged", "twin")
_RL = dict(skipped=("data_mix",))
"""What the RL commands share: one --data source (fastkit train mixes several)."""
COMMANDS = {
    "dpo": Command("dpo", DpoOptions, "DPOConfig", dict(max_seq_length=2048, save_steps=50, output_dir="outputs/dpo",
                                                         dashboard="none"), _COMMON + ("drop_long",),
                   data_help=DATA_HELP["dpo"], extra_aliases={"max_length": "max_seq_length"}, **_RL),
    "kto": Command("kto", KtoOptions, "KTOConfig", dict(max_seq_length=2048, save_steps=50, batch_size=2,
                                                         output_dir="outputs/kto", dashboard="none"),
                   _COMMON + ("desirable_weight", "undesirable_weight", "drop_long"), data_help=DATA_HELP["kto"],
                   extra_aliases={"max_length": "max_seq_length"}, **_RL),
    "grpo": Command("grpo", GrpoOptions, "GRPOConfig", dict(max_seq_length=2048, save_steps=50,
                                                            output_dir="outputs/grpo", dashboard="none"),
                    _COMMON + ("reward", "num_generations", "max_completion_length", "temperature"),
                    data_help=DATA_HELP["grpo"], **_RL),
}
"""``fastkit dpo``, ``fastkit kto`` and ``fastkit grpo``."""

__all__ = ["COMMANDS", "SHIPPED_REWARDS", "DpoOptions", "GrpoOptions", "KtoOptions", "RlOptions", "reward_names"]
