"""The options system of every training command: ``fastkit train``, ``dpo``, ``kto`` and ``grpo`` (and ``fastkit
eval``: a :class:`Command` without LoRA options or a TRL pass-through, :mod:`fastkit.cli.eval`).

A command is a :class:`Command`: its option groups (dataclasses, one field per option with its help text, flags and
check: :class:`JobOptions`, the command's training options, :class:`~fastkit.training.options.LoraOptions`), the TRL
config class its other fields pass through to, and its defaults. From that one description come its flags (each
field in kebab and snake case, older names such as ``--steps`` first, every other TRL config field as a flag and
``--sft`` / ``--trl NAME=VALUE``), its ``--config`` YAML (the same names; unknown keys refused naming the key and
the file), the resolution (defaults < file < flags, one :class:`Resolved`) and ``--print-config`` (the resolved
YAML, which ``--config`` reads back to the same run). Bad flag values exit 2 with argparse's message; bad file
values are a FastkitError naming the key and the file. ``fastkit train`` is :data:`TRAIN` (below); the RL commands
are declared in :mod:`fastkit.cli.rl_options`.

Why not transformers' ``HfArgumentParser`` / TRL's ``TrlParser`` (judged in issue 46, transformers 5.25, TRL 1.16):
they would be larger here, not smaller (the checks, aliases, both spellings, the pass-through, the strict YAML and
``--print-config`` stay, plus adapters), and lose messages: ``HfArgumentParser(LoraOptions)`` raises ``TypeError:
_StoreAction.__init__() got an unexpected keyword argument 'flags'``; with the metadata stripped, the default of
``checkpointing: bool | str = "auto"`` fails its own bool type; its YAML keeps ``r: sixteen`` unchecked and names an
unknown key without the file or a did-you-mean. Startup: ``fastkit train --help`` 0.42-0.47 s; ``from transformers
import HfArgumentParser`` alone 1.99 s, ``from trl import TrlParser`` 0.93 s.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastkit.errors import FastkitError
from fastkit.training.options import (
    DEFAULT_MAX_STEPS,
    LoraOptions,
    TrainOptions,
    accepts,
    check_sft_value,
    dump_yaml,
    option,
    plain,
    trl_hints,
    type_words,
    unknown_name,
)


def _str(name: str, value: Any) -> None:
    if not (isinstance(value, str) and value.strip()):
        raise FastkitError(f"{name} must be a non-empty string, got {value!r}.")


def _optional_str(name: str, value: Any) -> None:
    if value is not None:
        _str(name, value)


def _data(name: str, value: Any) -> None:
    from fastkit.data.sources import as_sources

    as_sources(value)  # parsed (paths, ?columns=...&weight=...), not read: the preflight reads them


def _data_mix(name: str, value: Any) -> None:
    from fastkit.checks import check_choice
    from fastkit.data.sources import MIXES

    check_choice(name, value, MIXES)


def _flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise FastkitError(f"{name} must be true or false, got {value!r}.")


def _gguf(name: str, value: Any) -> None:
    from fastkit.export.gguf.quants import QUANTIZATIONS

    items = [value] if isinstance(value, str) else value
    if value is not None and not (isinstance(items, list) and items and all(q in QUANTIZATIONS for q in items)):
        raise FastkitError(f"{name} must be a list of quantizations from {', '.join(QUANTIZATIONS)}, got {value!r}.")


@dataclass
class JobOptions:
    """What a training command (``fastkit train``, ``dpo``, ``kto``, ``grpo``) trains and saves, beside its
    training and LoRA options."""

    model: str | None = option(None, "Hub id or local folder (e.g. Qwen/Qwen3-0.6B)", check=_optional_str)
    """The model to train (required, as a flag or in the file)."""
    data: Any = option(None, "one or more sources: a Hub dataset id, a .json/.jsonl/.csv/.parquet file, or offline "
                       "'sample' / 'quickstart'; each may end in ?columns=prompt:question,completion:answer&"
                       "weight=2&max_rows=500&split=train", check=lambda n, v: v is None or _data(n, v))
    """A source string, or a list of source strings / mappings (fastkit.data.DataSource); required."""
    data_mix: str = option("concat", "how several sources mix: concat (every row of each; a weight repeats rows), "
                           "interleave_under / interleave_over (a weight is a share; stop when the first / last "
                           "source runs out)", check=lambda n, v: _data_mix(n, v))
    """:data:`fastkit.data.sources.MIXES`: ``concat`` keeps every row; the interleaves draw rows by weight share."""
    load_in_4bit: bool = option(False, "QLoRA: NF4 base weights (CUDA)", flags=("--4bit",), check=_flag)
    """Load the base weights in 4-bit (bitsandbytes NF4)."""
    twin: bool = option(False, "a tiny random twin of --model (a Hub id fastkit knows, a model_type, or a local "
                        "folder with a config.json): an offline smoke test", check=_flag)
    """Train a tiny random model of the same architecture instead (offline)."""
    merged: bool = option(False, "also save a merged 16-bit model", check=_flag)
    """Save a merged 16-bit model after training."""
    gguf: list[str] | None = option(None, "GGUFs at these quantizations", check=_gguf)
    """GGUF quantizations to write after training (with an Ollama Modelfile)."""
    name: str | None = option(None, "the GGUF's name", check=_optional_str)
    """The GGUF files' and the Ollama model's name."""
    push_to_hub: str | None = option(None, "upload each verified folder to the Hub", check=_optional_str)
    """Hub repository (LoRA; REPO-merged, REPO-GGUF for the others)."""
    public: bool = option(False, "create the Hub repositories public", check=_flag)
    """Public Hub repositories (default private)."""


MENU = ("merged", "gguf", "name", "push_to_hub", "public")
"""JobOptions' export-menu fields (fastkit.cli.export's flags), last in the YAML before the pass-through."""
OWN_FLAGS = ("-h", "--help", "--help-all", "--config", "--print-config", "--print_config", "--resume", "--extend")
"""The flags every training command has beside its options (:func:`add_run_flags`)."""


@dataclass(frozen=True)
class Command:
    """One training command: everything its flags, ``--config`` file and ``--print-config`` differ in."""

    name: str
    options: type
    """Its training options (TrainOptions, DpoOptions, ...), between JobOptions and LoraOptions."""
    trl_config: str | None
    """The TRL config class its other fields pass through to (``SFTConfig``, ``DPOConfig``, ...); None: no
    pass-through (``fastkit eval``: no trainer)."""
    defaults: dict[str, Any]
    """Where the command's defaults differ from the fields' (the notebooks')."""
    common: tuple[str, ...]
    """The options ``--help`` shows (``--help-all``: every one)."""
    key: str = "trl"
    """The pass-through: ``--trl NAME=VALUE`` and the file's ``trl:`` mapping (``sft`` for fastkit train)."""
    title: str = ""
    """``--help``'s heading of the training options (default: ``training (make_<name>_trainer)``)."""
    help_all: str = "every option, TRL's config fields included"
    data_help: str | None = None
    """One ``--data`` source, with this help (None: several sources, mixed: fastkit train)."""
    skipped: tuple[str, ...] = ()
    """JobOptions fields the command does not take."""
    extra_aliases: dict[str, str] = field(default_factory=dict)
    """TRL names the command sets itself from an option (DPO's ``max_length`` from ``max_seq_length``)."""
    sft_rules: bool = False
    """fastkit train's older pass-through rules: a TRL name of a training option under ``sft:`` sets that option (the
    RL commands refuse it there), a text value stays text where the field takes text, and an unknown key's
    did-you-mean is drawn from the options' field names."""
    job: type = JobOptions
    """Its first option group (``what to train and save``; ``fastkit eval``: what to compare)."""
    lora: type | None = LoraOptions
    """Its LoRA options (None: a command that trains nothing)."""
    required: tuple[str, ...] = ("model", "data")
    """Options the resolution refuses to leave unset."""
    job_title: str = "what to train and save"
    run_flags: bool = True
    """``--resume`` / ``--extend`` (a training run's)."""

    def groups(self) -> tuple[type, ...]:
        return tuple(cls for cls in (self.job, self.options, self.lora) if cls is not None)

    def fields(self) -> dict[str, tuple[type, dataclasses.Field]]:
        """Every option name -> (its dataclass, its field), in the YAML's order."""
        return {f.name: (cls, f) for cls in self.groups() for f in dataclasses.fields(cls)
                if f.name not in self.skipped}

    def aliases(self) -> dict[str, str]:
        """TRL's names of the options (``num_train_epochs`` -> ``epochs``) and those make_*_trainer sets from them."""
        own = {a: f.name for f in dataclasses.fields(self.options) for a in f.metadata.get("aliases", ())}
        return {**own, **self.extra_aliases}

    def spellings(self) -> dict[str, str]:
        """Every name an option takes on the command line, without dashes (``steps``, ``max-steps``, ``lr``, ...), and
        its TRL aliases -> the option's field: a --config file takes each of them."""
        out = {flag.lstrip("-"): name for name, (_, f) in self.fields().items()
               for flag in _option_strings(name, f.metadata)}
        return {**out, **self.aliases()}

    def taken(self) -> set[str]:
        """TRL config names the options set (no flag of their own, not passed through)."""
        return set(self.fields()) | set(self.aliases())

    def moved(self) -> set[str]:
        """Names that set an option when given in the pass-through (``--sft learning_rate=...``)."""
        if not self.sft_rules:
            return self.taken()
        return {f.name for f in dataclasses.fields(self.options)} - {self.key} | set(self.aliases())

    # -- the flags ----------------------------------------------------------------------------------------------
    def add_parser(self, sub, argv: list[str] | None, help: str, lead: str, tail: str = ""):
        """Register the command on the ``sub`` subparsers; its flags only when it runs (``argv``; None: every
        flag): ``--help`` shows the usual options without importing TRL, ``--help-all`` every one (TRL's too)."""
        p = sub.add_parser(self.name, help=help, allow_abbrev=False, formatter_class=OneSpellingFormatter,
                           description=f"{lead}, as the notebooks do, with a progress line in the terminal. Every "
                                       "option is also a key of a --config YAML file (flags override it); "
                                       f"--print-config shows the resolved file.{tail}",
                           usage=f"fastkit {self.name} --model MODEL --data DATA [--config FILE] [options] (--help: "
                                 "the usual options; --help-all: every one)")
        if argv is None:
            self.add_arguments(p)
        elif argv[:1] == [self.name]:  # (another command runs: the name only, nothing of the training stack imported)
            short = bool({"-h", "--help"} & set(argv)) and "--help-all" not in argv
            trl = "--help-all" in argv or not short and self.needs_trl_flags(argv[1:])
            self.add_arguments(p, trl=trl, common_only=short)
        return p

    def add_arguments(self, p: argparse.ArgumentParser, trl: bool = True, common_only: bool = False) -> None:
        """Every option as a flag on ``p`` (defaults suppressed: :meth:`resolve` knows what was given); ``trl``: the
        TRL config's other fields too (imports TRL); ``common_only``: ``--help`` shows :attr:`common` only."""
        from fastkit.export.gguf.quants import QUANTIZATIONS

        titles = {self.job: self.job_title, self.options: self.title or f"training (make_{self.name}_trainer)",
                  **({self.lora: "LoRA (fastkit.LoraOptions)"} if self.lora else {})}
        groups = {cls: p.add_argument_group(title) for cls, title in titles.items()}
        length = groups[self.options].add_mutually_exclusive_group()
        for name, (cls, f) in self.fields().items():
            if name == self.key:
                continue  # set from the file or --sft / --trl NAME=VALUE
            action = _add_field(length if name in ("max_steps", "epochs") else groups[cls], f, QUANTIZATIONS,
                                self.defaults, self.name)
            if name == "data" and self.data_help:
                action.nargs, action.help = None, self.data_help
            if common_only and name not in self.common:
                action.help = argparse.SUPPRESS
        add_run_flags(p, self.help_all, self.run_flags)
        if trl and self.trl_config:
            _add_trl_arguments(p, self.trl_config, self.taken(), self.key)

    def needs_trl_flags(self, argv: list[str]) -> bool:
        """True when ``argv`` names a flag that is not one of fastkit's options: a TRL config field (or a typo, which
        the full parser then names). fastkit's own flags parse without importing TRL."""
        own = {f"--{s}" for s, name in self.spellings().items() if name != self.key} | set(OWN_FLAGS)
        return bool(self.trl_config) and any(a.startswith("--") and a.split("=", 1)[0] not in own
                                             for a in argv if a != "--")

    # -- the file, the flags, the defaults: one resolved configuration ------------------------------------------
    def flag_layer(self, given: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """(options, TRL fields) given as flags: single values of list-or-text options back to text."""
        options, trl, alias, moved = {}, {}, self.aliases(), self.moved()
        for dest, value in given.items():
            if dest == self.key:  # --sft / --trl NAME=VALUE; a name an option sets sets that option
                options.update({alias.get(k, k): v for k, v in value if k in moved})
                trl.update({k: v for k, v in value if k not in moved})
            elif dest.startswith(f"{self.key}:"):
                name = dest.split(":", 1)[1]
                trl[name] = _list_value(name, value, self.trl_config)
            else:
                options[dest] = value[0] if _one_text(dest, value) else value
        if isinstance(options.get("data"), list) and len(options["data"]) == 1:
            options["data"] = options["data"][0]
        _twice(dict(given.get(self.key) or []), [d for d in given if d != self.key], alias, self.key)
        return options, trl

    def file_layer(self, config: dict[str, Any], path: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """(options, TRL fields) of a ``--config`` file: any spelling of a flag, TRL's fields at the top level (as
        their flags too: ``max-grad-norm``) or under the pass-through key, values coerced (``1e-4`` written as text)
        and checked; an unknown key is refused naming it and the file, one option set by two keys naming both."""
        where, names, hints = f"--config {path}", self.spellings(), self._hints()
        fields, alias, moved = self.fields(), self.aliases(), self.moved()
        options, trl, seen = {}, {}, {}
        for key, value in config.items():
            if key == self.key:
                for name, item in self._pass_through(value, where).items():
                    own = alias.get(name, name) if name in moved else None
                    claim(seen, own or name, f"{self.key}: {name}", where)
                    if own:
                        options[own] = self._file_value(fields[own][1], item, where, path)
                    else:
                        trl[name] = item
            elif key in names:
                claim(seen, names[key], key, where)
                options[names[key]] = self._file_value(fields[names[key]][1], value, where, path)
            elif isinstance(key, str) and key.replace("-", "_") in hints:
                claim(seen, key.replace("-", "_"), key, where)
                trl.update(self._pass_through({key.replace("-", "_"): value}, where))
            else:
                raise ConfigFileError(self._unknown(where, str(key)))
        return options, trl

    def _file_value(self, f: dataclasses.Field, value: Any, where: str, path: str) -> Any:
        if f.name == "data" and self.data_help and isinstance(value, list):
            value = _one_source(value, where + ": data")
        value = _checked(f, value, where)
        return beside_file(value, Path(os.path.expanduser(path)).parent) if f.name == "data" else value

    def _pass_through(self, mapping: Any, where: str) -> dict[str, Any]:
        """The file's TRL config fields (the ``sft:`` / ``trl:`` mapping), each value coerced and checked."""
        if not isinstance(mapping, dict):
            raise ConfigFileError(f"{where}: {self.key}: give a mapping of trl.{self.trl_config} fields, got "
                                  f"{mapping!r:.80}.")
        hints, out = trl_hints(self.trl_config), {}
        for name, value in mapping.items():
            if not self.sft_rules and name in self.taken():
                raise ConfigFileError(f"{where}: {self.key}: {name} is set by fastkit's option "
                                      f"{self.aliases().get(name, name)}: give it at the top level.")
            try:
                if isinstance(value, str) and name in hints and not (self.sft_rules and accepts(hints[name], value)):
                    value = sft_value(name, value, self.trl_config)  # '1e-4' read as text by YAML
                check_sft_value(str(name), value, self.trl_config)
            except FastkitError as exc:
                raise ConfigFileError(f"{where}: {exc}") from exc
            out[name] = value
        return out

    def _unknown(self, where: str, key: str) -> str:
        if self.sft_rules:
            return unknown_name(where, key)
        close = difflib.get_close_matches(key, [*self.spellings(), *self._hints()], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        trl = f" and trl.{self.trl_config} fields" if self.trl_config else ""
        return f"{where}: unknown option {key!r}{hint} (fastkit {self.name}'s options{trl} are known)."

    def _hints(self) -> dict[str, Any]:
        return trl_hints(self.trl_config) if self.trl_config else {}

    def resolve(self, given: dict[str, Any], config_path: str | None) -> Resolved:
        """Defaults, then the file, then the flags: one checked :class:`Resolved` (the step count resolved, so the
        YAML says it; ``model`` and ``data`` required)."""
        layers = [self.file_layer(read_file(config_path), config_path)] if config_path else []
        values, trl = dict(self.defaults), {}
        for options, extra in [*layers, self.flag_layer(given)]:
            _apply(values, options)
            trl.update(extra)
        if "max_steps" in self.fields() and values.get("max_steps") is None and values.get("epochs") is None:
            values["max_steps"] = DEFAULT_MAX_STEPS
        for needed in self.required:
            if values.get(needed) is None:
                raise FastkitError(f"give --{needed} (or {needed}: in the --config file).")
        split = {cls: {k: v for k, v in values.items() if k in {f.name for f in dataclasses.fields(cls)}}
                 for cls in self.groups()}
        own = {self.key: trl} if self.key in {f.name for f in dataclasses.fields(self.options)} else {}
        return Resolved(self, self.job(**split[self.job]), self.options(**split[self.options], **own),
                        self.lora(**split[self.lora]) if self.lora else None, trl)


def _apply(values: dict[str, Any], layer: dict[str, Any]) -> None:
    """One layer over the ones before; a layer that sets max_steps or epochs replaces both."""
    if layer.get("max_steps") is not None or layer.get("epochs") is not None:
        values.pop("max_steps", None)
        values.pop("epochs", None)
    values.update(layer)


@dataclass
class Resolved:
    """A resolved command: what the run uses, and the YAML that reproduces it."""

    command: Command
    run: JobOptions
    options: Any
    """The command's training options (fastkit train's :class:`~fastkit.training.options.TrainOptions`, ...)."""
    lora: LoraOptions | None
    trl: dict[str, Any] = field(default_factory=dict)
    """The TRL config fields passed through (fastkit train's are also ``options.sft``)."""

    @property
    def train(self) -> Any:
        """fastkit train's name of :attr:`options`."""
        return self.options

    def to_dict(self) -> dict[str, Any]:
        """The YAML's mapping: job, training and LoRA options in field order, the export menu, the pass-through."""
        run = {k: v for k, v in vars(self.run).items() if k not in self.command.skipped}
        run["data"] = data_yaml(run["data"]) if run.get("data") is not None else None
        menu = {k: run.pop(k) for k in MENU if k in run}
        options, key = self.options.to_dict(), self.command.key
        extra = options.pop(key) if key in options else plain(self.trl)
        lora = self.lora.to_dict() if self.lora else {}
        return {**run, **options, **lora, **menu, **({key: extra} if self.command.trl_config else {})}


def print_config(resolved: Resolved) -> str:
    """The YAML ``--print-config`` writes (and the run saves as output_dir/fastkit_config.yaml)."""
    return dump_yaml(resolved.to_dict(), f"fastkit {resolved.command.name} --config FILE reproduces this run.")


# -- flags ------------------------------------------------------------------------------------------------
def _option_strings(name: str, meta) -> list[str]:
    """Older flag names first (argparse's messages use the first), then kebab, snake and SFTConfig's names."""
    names = [*meta.get("flags", ()), f"--{name.replace('_', '-')}", f"--{name}"]
    for alias in meta.get("aliases", ()):
        names += [f"--{alias.replace('_', '-')}", f"--{alias}"]
    return list(dict.fromkeys(names))


def scalar(text: str) -> Any:
    """A flag's text as YAML would read it, numbers written any way Python reads them (``1e-4``)."""
    low = text.strip().lower()
    if low in ("none", "null", "~"):
        return None
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    if text.lstrip().startswith(("[", "{")):
        import yaml

        try:
            return strict_yaml(text, "the value")
        except yaml.YAMLError:
            return text
    return text


def _argparse_type(convert):
    """``convert`` as an argparse ``type``: a FastkitError becomes argparse's message (exit 2, naming the flag)."""
    def typed(text: str) -> Any:
        try:
            return convert(text)
        except FastkitError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    return typed


def _field_type(name: str, f: dataclasses.Field):
    """argparse ``type`` for one option: the text converted, then the field's own check."""
    def convert(text: str) -> Any:
        value = _eval_split(text) if name == "eval_split" and _is_number(text) else _typed(f, text)
        f.metadata["check"](name, value)
        return value

    return _argparse_type(convert)


def _eval_split(text: str) -> float | int:
    """``--eval-split``: a whole number is a row count (``3``), anything else a fraction (``0.05``), as in Python."""
    try:
        return int(text)
    except ValueError:
        return float(text)


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _typed(f: dataclasses.Field, text: str) -> Any:
    """Text as the field's kind: strings stay text (``--name 007``), the rest as :func:`scalar` reads it."""
    if f.name in ("model", "output_dir", "name", "push_to_hub", "data", "target_modules", "report_to",
                  "lr_scheduler_type", "dashboard", "reward") or f.name == "checkpointing" and text in ("on", "off") \
            or f.metadata.get("text"):
        return text
    return scalar(text)


def _is_list(f: dataclasses.Field) -> bool:
    return f.name in ("data", "gguf", "target_modules", "report_to", "reward")


def _is_bool(f: dataclasses.Field) -> bool:
    return isinstance(f.default, bool) and f.name != "checkpointing" or f.name == "chunked_loss"


def _add_field(group, f: dataclasses.Field, menu_choices: tuple[str, ...], defaults: dict,
               command: str) -> argparse.Action:
    """One option as a flag (``defaults``: where the command's defaults differ from the field's)."""
    default = defaults.get(f.name, f.default)
    shown = "" if default is None or "default" in f.metadata["help"] else f" (default {default})"
    shown = f" (fastkit {command}'s default: {default})" if f.name in defaults else shown
    kwargs: dict[str, Any] = dict(dest=f.name, default=argparse.SUPPRESS, help=f.metadata["help"] + shown)
    if _is_bool(f):
        kwargs.update(nargs="?", const=True, metavar="BOOL")
    elif _is_list(f):
        kwargs.update(nargs="+")
    if f.name == "gguf":
        kwargs.update(choices=menu_choices, metavar="Q", help=f"GGUFs (with an Ollama Modelfile) at these "
                      f"quantizations: {', '.join(menu_choices)} (q4_k_m, q5_k_m, q6_k need pip install "
                      "'fastkit-llm[llamacpp]')")
    else:
        kwargs["type"] = _field_type(f.name, f)
    strings = ["--gguf"] if f.name == "gguf" else _option_strings(f.name, f.metadata)
    kwargs.setdefault("metavar", strings[0].lstrip("-").replace("-", "_").upper())  # --steps STEPS, --lr LR
    kwargs.update(f.metadata.get("argparse", {}))  # a field's own argparse settings (fastkit eval's --check extends)
    if f.metadata.get("negation"):  # --no-sampled: the field set to False (a flag, not a --config key)
        group.add_argument(f.metadata["negation"], dest=f.name, action="store_const", const=False,
                           default=argparse.SUPPRESS, help=f"the same as --{f.name.replace('_', '-')} false")
    return group.add_argument(*strings, **kwargs)


class OneSpellingFormatter(argparse.HelpFormatter):
    """Help that shows each option once, by its first (shortest, most used) spelling: ``--steps N``, not the
    three spellings it also takes (``--max-steps``, ``--max_steps``: every one works on the command line and as a
    --config key)."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings:
            return super()._format_action_invocation(action)
        if action.nargs == 0:  # -h, --help; --resume (its snake_case twin left out)
            return ", ".join(s for s in action.option_strings if "_" not in s) or action.option_strings[0]
        return f"{action.option_strings[0]} {self._format_args(action, self._get_default_metavar_for_optional(action))}"


def add_run_flags(p: argparse.ArgumentParser, help_all: str, resume: bool = True) -> None:
    """The flags every training command has beside its options: the options file, printing it, resuming (where
    ``resume``)."""
    p.add_argument("--config", metavar="FILE", default=None,
                   help="a YAML file of these options (fastkit_config.yaml of a run, or --print-config's output); "
                        "flags override it")
    p.add_argument("--print-config", "--print_config", action="store_true",
                   help="write the resolved options as YAML to stdout and exit (nothing is loaded)")
    if resume:
        p.add_argument("--resume", action="store_true",
                       help="continue the run in --output-dir from its newest checkpoint")
        p.add_argument("--extend", action="store_true",
                       help="with --resume: continue a run (finished or not) for a longer schedule, the --steps or "
                            "--epochs given now; the adapter and optimizer state carry over, only the schedule "
                            "changes")
    p.add_argument("--help-all", action="store_true", help=help_all)


def _add_trl_arguments(p: argparse.ArgumentParser, config: str, taken: set[str], key: str) -> None:
    """Every other field of the TRL ``config`` (trl.SFTConfig for fastkit train) as a flag (its first sentence as
    help), and ``--<key> NAME=VALUE`` (``--sft``; ``--trl`` for DPO / GRPO). ``taken``: names fastkit's options set."""
    group = p.add_argument_group(f"trl.{config} fields, passed to the trainer as given (see TRL's docs)")
    group.add_argument(f"--{key}", nargs="+", action="extend", default=argparse.SUPPRESS, metavar="NAME=VALUE",
                       type=_argparse_type(functools.partial(_sft_pair, config=config)), dest=key,
                       help=f"any {config} field by name, e.g. --{key} max_grad_norm=0.5")
    helps = _sft_helps(config)
    for name, hint in trl_hints(config).items():
        if name in taken:
            continue
        kwargs: dict[str, Any] = dict(dest=f"{key}:{name}", default=argparse.SUPPRESS, help=helps.get(name, ""),
                                      type=_argparse_type(functools.partial(sft_value, name, config=config)),
                                      metavar=name.upper())
        if hint is bool or accepts(hint, True) and not accepts(hint, "x"):
            kwargs.update(nargs="?", const=True, metavar="BOOL")
        elif accepts(hint, ["x"]):
            kwargs.update(nargs="+", type=str)
        group.add_argument(*dict.fromkeys([f"--{name.replace('_', '-')}", f"--{name}"]), **kwargs)


def _sft_helps(config: str = "SFTConfig") -> dict[str, str]:
    """Each field's help of the TRL ``config`` class, first sentence, in plain text (no reST / Markdown markup)."""
    import trl

    out = {}
    for f in dataclasses.fields(getattr(trl, config)):
        text = " ".join(str(f.metadata.get("help", "")).split())
        text = re.sub(r"`+([^`]*)`+", r"\1", text).replace("%", "%%")
        out[f.name] = re.split(r"(?<=\.)\s", text, maxsplit=1)[0][:200]
    return out


def sft_value(name: str, text: str, config: str = "SFTConfig") -> Any:
    """A flag's text as the TRL ``config``'s field ``name`` takes it (a number, a bool, a JSON/YAML mapping, or
    text)."""
    hint = trl_hints(config)[name]
    if text.lstrip().startswith(("[", "{")):  # a mapping or list written out: it parses, or the flag is named
        import yaml

        try:
            strict_yaml(text, f"{name}={text!r:.60}")
        except yaml.YAMLError as exc:
            raise FastkitError(f"{name}={text!r:.80} is not valid JSON / YAML ({' '.join(str(exc).split())[:120]}); "
                               f"write it as a mapping, e.g. {name}='{{\"key\": 1}}'.") from exc
    value = scalar(text)
    if accepts(hint, value):
        return value
    if accepts(hint, text):
        return text
    raise FastkitError(f"{name}={text!r}: trl.{config}.{name} takes {type_words(hint)}.")


def _sft_pair(text: str, config: str = "SFTConfig") -> tuple[str, Any]:
    """``--sft NAME=VALUE``: the name checked against the TRL ``config``'s fields, the value against its type."""
    name, sep, value = text.partition("=")
    if not sep:
        raise FastkitError(f"{text!r}: give NAME=VALUE, e.g. max_grad_norm=0.5.")
    if name not in trl_hints(config):
        check_sft_value(name, None, config)  # the did-you-mean
    converted = sft_value(name, value, config)
    check_sft_value(name, converted, config)
    return name, converted


# -- the file -----------------------------------------------------------------------------------------------
class ConfigFileError(FastkitError):
    """A bad ``--config`` file: its message names the file's keys as written (not rewritten into flags)."""

    verbatim = True


def strict_yaml(text: str, where: str) -> Any:
    """YAML read safely and strictly, the one rule for fastkit's files and flag values: no alias (``*name``: a few
    hundred bytes of nested aliases expand to gigabytes, and the file a run saves would be written out expanded),
    no key twice in one mapping (which value wins would be a guess). Either is a ConfigFileError naming ``where``
    and the line."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                raise ConfigFileError(f"{where}: line {event.start_mark.line + 1} uses the YAML alias "
                                      f"*{event.anchor}; fastkit reads plain values only: write the value out.")
            return super().compose_node(parent, index)

        def construct_mapping(self, node, deep=False):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    first = seen.setdefault(key, line)
                except TypeError:  # an unhashable key: PyYAML's own error says so
                    continue
                if first != line:
                    raise ConfigFileError(f"{where}: key {key!r} is given twice (lines {first} and {line}); "
                                          "give it once.")
            return super().construct_mapping(node, deep)

    return yaml.load(text, Loader=StrictLoader)  # noqa: S506 -- a SafeLoader subclass


MAX_CONFIG_BYTES = 1 << 20
"""The largest ``--config`` file read: an options file is a few hundred bytes; a bigger one is another file."""


def read_file(path: str) -> dict[str, Any]:
    """``--config FILE``: a YAML mapping of option names (values checked by :func:`resolve`)."""
    import yaml

    file = Path(os.path.expanduser(path))
    if not file.is_file():
        kind = "a folder" if file.is_dir() else "not a regular file (a device, a pipe, ...)" if file.exists() else None
        raise ConfigFileError(f"--config {path}: {kind}; give the YAML file itself." if kind else
                              f"--config {path}: no such file.")
    if file.stat().st_size > MAX_CONFIG_BYTES:
        raise ConfigFileError(f"--config {path}: {file.stat().st_size:,} bytes, more than an options file holds "
                              f"({MAX_CONFIG_BYTES:,} at most): is it the data file? Give the data as --data.")
    try:
        loaded = strict_yaml(file.read_text(encoding="utf-8"), f"--config {path}")
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigFileError(f"--config {path}: not valid YAML ({' '.join(str(exc).split())[:200]}).") from exc
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigFileError(f"--config {path}: the file must hold a mapping of option names to values, "
                           f"got a {type(loaded).__name__}.")
    return loaded


def claim(seen: dict[str, str], name: str, key: str, where: str) -> None:
    """Record that the file's ``key`` sets option ``name``; a second key setting it (another spelling, or the same
    name at the top level and under ``sft:`` / ``trl:``) is refused naming both: which one wins would be a guess."""
    first = seen.setdefault(name, key)
    if first != key:
        raise ConfigFileError(f"{where}: {first!r} and {key!r} both set {name}: keep one of them.")


def beside_file(data: Any, folder: Path) -> Any:
    """A config file's data sources with each relative file path read from the file's own ``folder``.

    ``data: qa.csv`` in ``runs/a.yaml`` means ``runs/qa.csv``, wherever ``fastkit train`` is started. A path not
    found there is kept as written (the working directory, a Hub dataset id or an offline name), so a
    ``fastkit_config.yaml`` a run wrote, whose paths name its working directory, still runs from that directory.
    """
    if isinstance(data, list):
        return [beside_file(item, folder) for item in data]
    if isinstance(data, dict) and isinstance(data.get("path"), str):
        return {**data, "path": _beside(data["path"], folder)}
    if isinstance(data, str):
        from fastkit.data.sources import split_query

        path, query = split_query(data)  # DataSource.parse's split
        return _beside(path, folder) + ("" if query is None else "?" + query)
    return data


def _beside(path: str, folder: Path) -> str:
    expanded = os.path.expanduser(path)
    if os.path.isabs(expanded) or not (folder / expanded).exists():
        return path
    return os.path.normpath(folder / expanded)


def _checked(f: dataclasses.Field, value: Any, where: str) -> Any:
    if isinstance(value, str) and not _is_list(f) and f.name not in ("model", "name", "output_dir") \
            and not f.metadata.get("text"):
        value = scalar(value) if _is_number(value) else value
    if f.name == "gguf" and isinstance(value, str):
        value = [value]
    try:
        f.metadata["check"](f.name, value)
    except FastkitError as exc:
        raise ConfigFileError(f"{where}: {exc}") from exc
    return value


def _one_text(dest: str, value: list) -> bool:
    """A flag's single value kept as text: ``--report-to``'s; ``--target-modules``' when it is ``all-linear`` or a
    regex. A plain module name (``--target-modules q_proj``) stays a list of names: PEFT reads a string as a regex
    over the full module name, which a bare name never matches."""
    import re

    if dest not in ("target_modules", "report_to") or len(value) != 1:
        return False
    return dest == "report_to" or value[0] == "all-linear" or not re.fullmatch(r"[\w.]+", str(value[0]))


def _twice(pairs: dict[str, Any], dests: list[str], alias: dict[str, str], key: str) -> None:
    """``--sft NAME=VALUE`` / ``--trl NAME=VALUE`` naming an option another flag of the command sets: refused
    naming both (which one wins would be a guess)."""
    for name in pairs:
        for dest in dests:
            if dest.split(":")[-1] in (name, alias.get(name, name)):
                raise ConfigFileError(f"--{key} {name}=... and --{dest.split(':')[-1].replace('_', '-')} both set "
                                   f"{alias.get(name, name)}: give it once.")


def _list_value(name: str, value: Any, config: str = "SFTConfig") -> Any:
    """A list-valued TRL ``config`` field's flag: one value kept as such where the field takes it, checked."""
    if isinstance(value, list):
        value = value[0] if len(value) == 1 and accepts(trl_hints(config)[name], value[0]) else value
        check_sft_value(name, value, config)
    return value


def _one_source(data: list, where: str) -> Any:
    if len(data) != 1:
        raise FastkitError(f"{where}: give one data source (got {len(data)}); fastkit train mixes several, "
                           "preference and RL runs read one.")
    return data[0]


def data_yaml(data: Any) -> Any:
    """``data`` in its YAML form: a path string for one plain source, else a list of source mappings."""
    from fastkit.data.sources import as_sources

    listed = [s.to_mapping() for s in as_sources(data)]
    listed = [m["path"] if list(m) == ["path"] else m for m in listed]
    return listed[0] if len(listed) == 1 and isinstance(listed[0], str) else listed


CONTROL = ("config", "print_config", "resume", "extend", "help_all", "argv", "command", "run")
"""The parsed arguments that are not options."""


def resolved_args(args: argparse.Namespace, command: Command) -> argparse.Namespace:
    """The parsed flags, the ``--config`` file and the defaults as one checked namespace: ``.resolved``
    (:class:`Resolved`), ``.options`` / ``.lora``, the job's fields by name (what the preflight and the export menu
    read), ``output_dir``, ``report_to``, ``steps`` (None for an --epochs run) and ``explicit`` (the option names given
    as flags or in the --config file, not defaults)."""
    given = {k: v for k, v in vars(args).items() if k not in CONTROL}
    resolved = command.resolve(given, args.config)
    out = argparse.Namespace(config=args.config, print_config=args.print_config, resume=args.resume,
                             extend=args.extend, argv=getattr(args, "argv", None), **vars(resolved.run))
    out.resolved, out.options, out.lora = resolved, resolved.options, resolved.lora
    out.output_dir, out.report_to = resolved.options.output_dir, resolved.options.report_to
    out.steps = resolved.options.max_steps if resolved.options.epochs is None else None
    out.explicit = set(given) | (set(read_file(args.config)) if args.config else set())
    return out


# -- fastkit train ------------------------------------------------------------------------------------------
CLI_DEFAULTS = dict(max_seq_length=2048, save_steps=50, output_dir="outputs/train", drop_long=True, dashboard="none")
"""Where ``fastkit train`` differs from make_trainer's defaults (the notebooks' values): a checkpoint every 50
steps, long rows dropped (counted in the log), the progress line instead of the notebook dashboard."""
COMMON = ("model", "data", "max_steps", "epochs", "learning_rate", "batch_size", "gradient_accumulation_steps",
          "max_seq_length", "lora_r", "lora_alpha", "load_in_4bit", "eval_split", "output_dir", "merged", "gguf",
          "push_to_hub", "twin")
"""The options ``fastkit train --help`` shows (``--help-all``: every one, TRL's SFTConfig fields included)."""
TRAIN = Command("train", TrainOptions, "SFTConfig", CLI_DEFAULTS, COMMON, key="sft",
                title="training (fastkit.TrainOptions)", sft_rules=True,
                help_all="every option: the ones above, the rest of TrainOptions / LoraOptions and TRL's SFTConfig")
"""``fastkit train``: JobOptions, TrainOptions and LoraOptions; any other trl.SFTConfig field passes through."""
resolve, file_layer, flag_layer, needs_sft_flags = TRAIN.resolve, TRAIN.file_layer, TRAIN.flag_layer, \
    TRAIN.needs_trl_flags

__all__ = ["CLI_DEFAULTS", "COMMON", "CONTROL", "MENU", "OWN_FLAGS", "TRAIN", "Command", "ConfigFileError",
           "JobOptions", "OneSpellingFormatter", "Resolved", "add_run_flags", "beside_file", "claim", "data_yaml",
           "file_layer", "flag_layer", "needs_sft_flags", "print_config", "read_file", "resolve", "resolved_args",
           "scalar", "sft_value", "strict_yaml"]
