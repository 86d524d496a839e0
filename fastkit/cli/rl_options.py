"""``fastkit dpo`` / ``fastkit kto`` / ``fastkit grpo``'s options: the same options system as ``fastkit train``
(fastkit.cli.config).

Each command's options are dataclass fields with their help text, flags and checks (:func:`fastkit.training.options.
option`): :class:`fastkit.cli.config.RunOptions` (what to train and save, less ``data_mix``), :class:`DpoOptions`,
:class:`KtoOptions` or :class:`GrpoOptions` (the keyword arguments of ``make_dpo_trainer`` / ``make_kto_trainer`` /
``make_grpo_trainer``) and :class:`fastkit.training.options.LoraOptions`. Every other field of TRL's ``DPOConfig`` /
``KTOConfig`` / ``GRPOConfig`` passes
through by name (``--trl NAME=VALUE``, its own flag, or a key of the file; checked against the installed TRL's
dataclass). Flags are generated as ``fastkit train``'s are (``--steps`` / ``--max-steps`` / ``--max_steps``, ...);
``--config FILE`` reads the same names (any spelling; flags win over the file, the file over the defaults) and
``--print-config`` writes the resolved YAML, which ``--config`` reads back to the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastkit.checks import check_bool, check_non_negative_int, check_positive
from fastkit.cli import config as cli_config
from fastkit.cli.config import ConfigFileError, RunOptions
from fastkit.errors import FastkitError
from fastkit.training.options import (
    DEFAULT_MAX_STEPS,
    LoraOptions,
    _check_fields,
    _dashboard,
    _number,
    _output_dir,
    _plain,
    _report_to,
    check_sft_value,
    dump_yaml,
    option,
    trl_hints,
)

_positive_or_none = functools.partial(check_positive, allow_none=True)
_number_or_none = functools.partial(_number, allow_none=True)

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
                                  flags=("--lr",), check=_number)
    batch_size: int = option(1, "DPO: pairs per device step; KTO: rows (at least 2); GRPO: prompts",
                             aliases=("per_device_train_batch_size",), check=check_positive)
    gradient_accumulation_steps: int = option(1, "device steps per optimizer step", flags=("--grad-accumulation",),
                                              check=check_positive)
    max_seq_length: int | None = option(None, "tokens the model is loaded with (DPO: a pair's prompt + longer "
                                        "answer at most; KTO: a row's prompt + completion)", check=_positive_or_none)
    beta: float = option(0.1, "KL strength against the reference (the adapter disabled)",
                         check=functools.partial(_number, low_open=False))
    seed: int = option(3407, "seed of the run (data order, sampling, LoRA init)",
                       check=check_non_negative_int)
    save_steps: int | None = option(None, "a checkpoint every that many steps in output_dir (2 kept; None: none)",
                                    check=_positive_or_none)
    output_dir: str = option("outputs", "checkpoints and saved models", check=_output_dir)
    report_to: str | list[str] = option("none", "none, tensorboard, wandb or trackio (installed ones only)",
                                        check=_report_to)
    dashboard: str = option("auto", "auto, html, widget, terminal or none", check=_dashboard)

    def __post_init__(self) -> None:
        _check_fields(self)
        if self.max_steps is not None and self.epochs is not None:
            raise FastkitError("Give max_steps or epochs, not both.")

    def trainer_kwargs(self) -> dict[str, Any]:
        """make_dpo_trainer's / make_grpo_trainer's keyword arguments these options mean."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if out["max_steps"] is None and out["epochs"] is None:
            out["max_steps"] = DEFAULT_MAX_STEPS
        return out

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


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
                         check=_number)
    packing: bool = _packing()
    drop_long: bool = _drop_long("pairs")


@dataclass
class KtoOptions(RlOptions):
    """``fastkit kto``: :func:`fastkit.training.make_kto_trainer`'s options."""

    beta: float = option(0.1, "KTO's KL strength against the reference (the adapter disabled); positive",
                         check=_number)
    desirable_weight: float = option(1.0, "weight of the desirable rows' loss (label true)", check=_number)
    undesirable_weight: float = option(1.0, "weight of the undesirable rows' loss (label false)", check=_number)
    drop_long: bool = _drop_long("rows")


@dataclass
class GrpoOptions(RlOptions):
    """``fastkit grpo``: :func:`fastkit.training.make_grpo_trainer`'s options."""

    beta: float = option(0.04, "KL strength against the reference (the adapter disabled); 0 skips the reference "
                         "pass", check=functools.partial(_number, low_open=False))
    packing: bool = _packing()
    reward: list[str] = option(help="reward functions: format, tags, exact_answer, length (fastkit.training."
                               "rewards), or module:function / path/to/file.py:function; several: format,length",
                               factory=lambda: ["format", "exact_answer"], check=_rewards)
    num_generations: int = option(4, "completions per prompt (at least 2: GRPO compares them)",
                                  check=lambda n, v: _generations(n, v))
    max_completion_length: int = option(256, "tokens per completion at most", check=check_positive)
    temperature: float = option(1.0, "sampling temperature of the completions", check=_number)
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


@dataclass(frozen=True)
class Command:
    """One RL command: its name, options class, TRL config, CLI defaults and the options ``--help`` shows."""

    name: str
    options: type
    trl_config: str
    defaults: dict
    common: tuple[str, ...]

    def groups(self) -> tuple[type, ...]:
        return (RunOptions, self.options, LoraOptions)


_COMMON = ("model", "data", "max_steps", "epochs", "learning_rate", "batch_size", "gradient_accumulation_steps",
           "max_seq_length", "beta", "lora_r", "load_in_4bit", "output_dir", "merged", "twin")
COMMANDS = {
    "dpo": Command("dpo", DpoOptions, "DPOConfig", dict(max_seq_length=2048, save_steps=50,
                                                         output_dir="outputs/dpo", dashboard="none"),
                   _COMMON + ("drop_long",)),
    "kto": Command("kto", KtoOptions, "KTOConfig", dict(max_seq_length=2048, save_steps=50, batch_size=2,
                                                         output_dir="outputs/kto", dashboard="none"),
                   _COMMON + ("desirable_weight", "undesirable_weight", "drop_long")),
    "grpo": Command("grpo", GrpoOptions, "GRPOConfig", dict(max_seq_length=2048, save_steps=50,
                                                            output_dir="outputs/grpo", dashboard="none"),
                    _COMMON + ("reward", "num_generations", "max_completion_length", "temperature")),
}
"""``fastkit dpo``, ``fastkit kto`` and ``fastkit grpo``."""
DATA_HELP = {"dpo": "preference pairs (prompt, chosen, rejected: text or chat messages): a .json/.jsonl/.csv/"
                    ".parquet file, a folder, a Hub dataset id, or 'sample' (fastkit's shipped pairs)",
             "kto": "unpaired feedback (prompt, completion, label: true for a desirable completion; text or chat "
                    "messages; or preference pairs, unpaired): a file, a folder, a Hub dataset id, or 'sample' "
                    "(fastkit's shipped pairs, unpaired)",
             "grpo": "prompts (a 'prompt' column, text or chat messages, and the columns the rewards read): a file, a "
                     "folder, a Hub dataset id, or 'sample' (fastkit's shipped math prompts with an 'answer' column)"}
"""``--data``'s help: one source (fastkit train's mixes several)."""
SKIPPED = ("data_mix",)
"""RunOptions fields these commands do not take (one --data source)."""


def fields(command: Command) -> dict[str, dataclasses.Field]:
    """Every option name of ``command`` -> its field, in the YAML's order."""
    return {f.name: f for cls in command.groups() for f in dataclasses.fields(cls) if f.name not in SKIPPED}


def aliases(command: Command) -> dict[str, str]:
    """TRL's names of fastkit's options (``num_train_epochs`` -> ``epochs``), and the names make_*_trainer sets
    itself from them (``max_length``, ``per_device_train_batch_size``)."""
    out = {a: f.name for f in dataclasses.fields(command.options) for a in f.metadata.get("aliases", ())}
    if command.name in ("dpo", "kto"):
        out["max_length"] = "max_seq_length"
    return out


def spellings(command: Command) -> dict[str, str]:
    """Every spelling a flag of ``command`` has, without dashes -> its field (a --config file takes each)."""
    out = {}
    for name, f in fields(command).items():
        for flag in cli_config._option_strings(name, f.metadata):
            out[flag.lstrip("-")] = name
    return {**out, **aliases(command)}


def taken(command: Command) -> set[str]:
    """TRL config names fastkit's options set (not passed through)."""
    return set(fields(command)) | set(aliases(command))


# -- the flags ----------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser, command: Command, trl: bool, common_only: bool) -> None:
    """Every option of ``command`` as a flag on ``p`` (defaults suppressed); ``trl``: the TRL config's other fields
    too (imports TRL); ``common_only``: ``--help`` shows :attr:`Command.common` only (the others still parse)."""
    from fastkit.export.gguf.quants import QUANTIZATIONS

    titles = {RunOptions: "what to train and save", command.options: f"training (make_{command.name}_trainer)",
              LoraOptions: "LoRA (fastkit.LoraOptions)"}
    groups = {cls: p.add_argument_group(title) for cls, title in titles.items()}
    length = groups[command.options].add_mutually_exclusive_group()
    owner = {f.name: cls for cls in command.groups() for f in dataclasses.fields(cls)}
    for name, f in fields(command).items():
        group = length if name in ("max_steps", "epochs") else groups[owner[name]]
        action = cli_config._add_field(group, f, QUANTIZATIONS, command.defaults, command.name)
        if name == "data":
            action.nargs, action.help = None, DATA_HELP[command.name]
        if common_only and name not in command.common:
            action.help = argparse.SUPPRESS
    cli_config.add_run_flags(p, "every option, TRL's config fields included")
    if trl:
        cli_config._add_sft_arguments(p, command.trl_config, taken(command), key="trl")


OWN_FLAGS = ("-h", "--help", "--help-all", "--config", "--print-config", "--print_config", "--resume", "--extend")


def needs_trl_flags(command: Command, argv: list[str]) -> bool:
    """True when ``argv`` names a flag that is not one of fastkit's options (a TRL config field, or a typo the
    full parser then names); fastkit's own flags parse without importing TRL."""
    own = {f"--{s}" for s in spellings(command)} | set(OWN_FLAGS)
    return any(a.startswith("--") and a.split("=", 1)[0] not in own for a in argv if a != "--")


# -- resolving: defaults, then the file, then the flags ------------------------------------------------------
@dataclass
class Resolved:
    """A resolved ``fastkit dpo`` / ``fastkit grpo``: what the run uses, and the YAML that reproduces it."""

    command: Command
    run: RunOptions
    options: RlOptions
    lora: LoraOptions
    trl: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        run = {k: v for k, v in vars(self.run).items() if k not in SKIPPED}
        run["data"] = cli_config.data_yaml(run["data"])
        menu = {k: run.pop(k) for k in cli_config.MENU}
        return {**run, **self.options.to_dict(), **self.lora.to_dict(), **menu, "trl": _plain(self.trl)}


def flag_layer(command: Command, given: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(options, TRL fields) given as flags."""
    options, trl = {}, {}
    alias = aliases(command)
    for dest, value in given.items():
        if dest == "trl":  # --trl NAME=VALUE; a name fastkit's options set sets that option
            options.update({alias.get(k, k): v for k, v in value if k in taken(command)})
            trl.update({k: v for k, v in value if k not in taken(command)})
        elif dest.startswith("trl:"):
            trl[dest[4:]] = cli_config._list_value(dest[4:], value, command.trl_config)
        else:
            options[dest] = value[0] if cli_config._one_text(dest, value) else value
    if isinstance(options.get("data"), list):
        options["data"] = _one_source(options["data"], "--data")
    cli_config._twice(dict(given.get("trl") or []), [d for d in given if d != "trl"], alias, "trl")
    return options, trl


def _one_source(data: list, where: str) -> Any:
    if len(data) != 1:
        raise FastkitError(f"{where}: give one data source (got {len(data)}); fastkit train mixes several, "
                           "preference and RL runs read one.")
    return data[0]


def file_layer(command: Command, config: dict[str, Any], path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(options, TRL fields) of a ``--config`` file: any spelling of a flag, TRL's fields at the top level or under
    ``trl:``; an unknown key is refused naming it and the file, one option set by two keys naming both."""
    where, names, hints = f"--config {path}", spellings(command), trl_hints(command.trl_config)
    options, trl, seen = {}, {}, {}
    for key, value in config.items():
        if key == "trl":
            named = _file_trl(command, value, where)
            for name in named:
                cli_config.claim(seen, name, f"trl: {name}", where)
            trl.update(named)
        elif key in names:
            name = names[key]
            cli_config.claim(seen, name, key, where)
            options[name] = _file_value(fields(command)[name], value, where, path)
        elif isinstance(key, str) and key.replace("-", "_") in hints:
            cli_config.claim(seen, key.replace("-", "_"), key, where)
            trl.update(_file_trl(command, {key.replace("-", "_"): value}, where))
        else:
            raise ConfigFileError(_unknown(command, where, str(key)))
    return options, trl


def _file_value(f: dataclasses.Field, value: Any, where: str, path: str) -> Any:
    if f.name == "data" and isinstance(value, list):
        value = _one_source(value, where + ": data")
    value = cli_config._file_value(f, value, where)
    if f.name == "data":
        value = cli_config.beside_file(value, Path(os.path.expanduser(path)).parent)
    return value


def _file_trl(command: Command, mapping: Any, where: str) -> dict[str, Any]:
    if not isinstance(mapping, dict):
        raise ConfigFileError(f"{where}: trl: give a mapping of trl.{command.trl_config} fields, got {mapping!r:.80}.")
    out = {}
    for name, value in mapping.items():
        if name in taken(command):
            raise ConfigFileError(f"{where}: trl: {name} is set by fastkit's option "
                                  f"{aliases(command).get(name, name)}: give it at the top level.")
        try:
            if isinstance(value, str) and name in trl_hints(command.trl_config):
                value = cli_config.sft_value(name, value, command.trl_config)
            check_sft_value(str(name), value, command.trl_config)
        except FastkitError as exc:
            raise ConfigFileError(f"{where}: {exc}") from exc
        out[name] = value
    return out


def _unknown(command: Command, where: str, key: str) -> str:
    import difflib

    close = difflib.get_close_matches(key, [*spellings(command), *trl_hints(command.trl_config)], n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{where}: unknown option {key!r}{hint} (fastkit {command.name}'s options and trl.{command.trl_config} " \
           "fields are known)."


def resolve(command: Command, given: dict[str, Any], config_path: str | None) -> Resolved:
    """Defaults, then the file, then the flags: one checked :class:`Resolved`."""
    layers = [file_layer(command, cli_config.read_file(config_path), config_path)] if config_path else []
    split, trl = cli_config.layered(command.defaults, [*layers, flag_layer(command, given)], command.groups())
    return Resolved(command=command, run=RunOptions(**split[RunOptions]), options=command.options(
        **split[command.options]), lora=LoraOptions(**split[LoraOptions]), trl=trl)


def print_config(resolved: Resolved) -> str:
    """The YAML ``--print-config`` writes (and the run saves as output_dir/fastkit_config.yaml)."""
    return dump_yaml(resolved.to_dict(), f"fastkit {resolved.command.name} --config FILE reproduces this run.")


__all__ = ["COMMANDS", "SHIPPED_REWARDS", "Command", "DpoOptions", "GrpoOptions", "KtoOptions", "Resolved", "RlOptions",
           "add_arguments", "aliases", "fields", "file_layer", "flag_layer", "needs_trl_flags", "print_config",
           "resolve", "reward_names", "spellings", "taken"]
