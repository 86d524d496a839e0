"""One set of training options for the API, the CLI, YAML files and the notebooks.

:class:`TrainOptions` holds every knob :func:`fastkit.training.make_trainer` takes, each field with its default
and its help text (field metadata, as TRL's ``SFTConfig`` does); :class:`LoraOptions` the adapter's knobs for
``FastModel.get_peft_model(model, options=...)``. ``fastkit train`` generates its flags from these fields
(:mod:`fastkit.cli.config`), a YAML file (``--config``) names the same fields, and every notebook's parameters
cell fills them. Any other ``trl.SFTConfig`` field passes through by name in ``TrainOptions.sft``: names are
checked against SFTConfig's fields (with a did-you-mean) and values against their types when the options are
made, before a model loads; SFTConfig itself then checks the values it knows (scheduler and optimizer names, ...)
before the data is read.

    options = TrainOptions(max_steps=200, learning_rate=1e-4, warmup_steps=10, sft={"max_grad_norm": 0.5})
    trainer = make_trainer(model, tokenizer, data, options=options)

What must not change: the keyword form ``make_trainer(model, tok, data, max_steps=..., warmup_ratio=...)`` builds
the same :class:`TrainOptions` (:meth:`TrainOptions.from_kwargs`), so both give the same SFTConfig.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import math
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fastkit.checks import check_bool, check_choice, check_non_negative_int, check_positive
from fastkit.errors import FastkitError


def option(default: Any = None, help: str = "", *, flags: tuple[str, ...] = (), factory=None, **meta) -> Any:
    """A dataclass field with its help text and CLI spellings in the metadata (``flags``: older flag names that
    keep working, first in argparse's messages)."""
    metadata = {"help": help, "flags": flags, **meta}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


TRACKERS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
            "trackio": ("trackio", "trackio")}
"""report_to name -> (module that must be importable, pip package)."""


def available_trackers() -> list[str]:
    """The ``report_to`` trackers installed here (tensorboard, wandb, trackio)."""
    import importlib.util

    return [name for name, (module, _) in TRACKERS.items() if importlib.util.find_spec(module) is not None]


def trackers(report_to: str | Sequence[str] | None) -> list[str]:
    """``report_to`` as TrainingArguments' list ('none' dropped), unchecked."""
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    return [n for n in names if n != "none"]


def check_report_to(report_to: str | Sequence[str] | None) -> list[str]:
    """``report_to`` as a list for TrainingArguments; refuses an unknown or uninstalled tracker by name."""
    names = trackers(report_to)
    installed = available_trackers()
    for name in names:
        if name not in TRACKERS:
            raise FastkitError(f"report_to={name!r} is not one fastkit sets up; use 'none' or one of "
                               f"{', '.join(TRACKERS)}.")
        if name not in installed:
            raise FastkitError(f"report_to={name!r}, but {TRACKERS[name][0]} is not installed: "
                               f"pip install {TRACKERS[name][1]} (or report_to='none').")
    return names


DEFAULT_MAX_STEPS = 60
EVALS_PER_RUN = 5
"""Evaluations a run makes by default (``eval_steps=None``), at most; the trainer adds one after the last step
(transformers' DefaultFlowCallback) when the cadence does not fall on it."""
EVAL_EVERY_AT_LEAST = 10
"""By default a run evaluates at most once every this many steps: a short smoke run evaluates once, at its end."""


def default_eval_steps(total_steps: int) -> int:
    """``eval_steps`` of a ``total_steps`` run when none is given: about :data:`EVALS_PER_RUN` evaluations, never more
    often than every :data:`EVAL_EVERY_AT_LEAST` steps (6 steps: at the end only; 60: every 12; 1,000: every 200)."""
    return max(EVAL_EVERY_AT_LEAST, -(-max(1, total_steps) // EVALS_PER_RUN))
"""Optimizer steps of a run that sets neither max_steps nor epochs."""


# -- value checks beyond fastkit.checks' check_positive / check_bool / check_choice, one per kind of option --
def check_number(name: str, value: Any, low: float = 0.0, low_open: bool = True, high: float = math.inf,
            allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low) and value < high
    if not ok:
        kind = ("a positive" if low_open else "a non-negative") if low == 0 else f"a (> {low:g})"
        span = f" below {high:g}" if high < math.inf else ""
        raise FastkitError(f"{name} must be {kind} finite number{span}{' or None' if allow_none else ''}, "
                           f"got {value!r}.")


def _eval_split(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 \
            or isinstance(value, float) and value >= 1:
        raise FastkitError(f"{name} must be a fraction in [0, 1) of the training rows (e.g. 0.05) or a row count, "
                           f"got {value!r}.")


def check_trackers(name: str, value: Any) -> None:
    if not (isinstance(value, str) or isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)):
        raise FastkitError(f"{name} must be a tracker name or a list of them, got {value!r}.")
    check_report_to(value)


def check_output_dir(name: str, value: Any) -> None:
    """A folder path (whether it can be written is checked where the run starts: make_trainer, the CLI's preflight)."""
    import os

    if not isinstance(value, (str, os.PathLike)) or not str(value).strip():
        raise FastkitError(f"{name} must be a folder path, got {value!r}.")


def _targets(name: str, value: Any) -> None:
    ok = isinstance(value, str) and value or isinstance(value, (list, tuple)) and value and all(
        isinstance(t, str) and t for t in value)
    if not ok:
        raise FastkitError(f"{name} must be 'all-linear', a module name / regex, or a non-empty list of module names, "
                           f"got {value!r}.")


CHECKPOINTING = {"auto": "auto", "on": True, "off": False, "offload": "offload", True: True, False: False}
"""LoraOptions.checkpointing's values -> get_peft_model's use_gradient_checkpointing."""


def _checkpointing(name: str, value: Any) -> None:
    if not any(value is k or value == k and not isinstance(k, bool) for k in CHECKPOINTING):
        raise FastkitError(f"{name} must be 'auto', 'on' (or True), 'off' (or False) or 'offload', got {value!r}.")


def _compile(name: str, value: Any) -> None:
    from fastkit.training.compile import CHOICES

    check_choice(name, value, CHOICES)


def check_dashboard(name: str, value: Any) -> None:
    from fastkit.dashboard.choices import VIEWS

    check_choice(name, value, VIEWS)


_SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup")
"""The usual ``lr_scheduler_type`` names (transformers' ``SchedulerType`` has them all): taken without importing it."""


def _scheduler(name: str, value: Any) -> None:
    if value in _SCHEDULERS:
        return
    from transformers.trainer_utils import SchedulerType

    name_given = value.value if isinstance(value, SchedulerType) else value
    check_choice(name, name_given, tuple(m.value for m in SchedulerType))


def _sft(name: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise FastkitError(f"{name} must be a mapping of trl.SFTConfig field names to values, got {value!r}.")
    for key, item in value.items():
        check_sft_value(key, item)


# -- the options --------------------------------------------------------------------------------------------
@dataclass
class TrainOptions:
    """Every training knob of :func:`fastkit.training.make_trainer` (``fastkit train`` and the notebooks fill the
    same fields); ``sft`` passes any other ``trl.SFTConfig`` field through by name. Checked when made."""

    max_steps: int | None = option(None, "optimizer steps to run (default 60 unless epochs is set)",
                                   flags=("--steps",), check=functools.partial(check_positive, allow_none=True))
    """Optimizer steps; None with ``epochs`` None means 60. Give this or ``epochs``, not both."""
    epochs: float | None = option(None, "passes over the data instead of max_steps", aliases=("num_train_epochs",),
                                  check=functools.partial(check_number, allow_none=True))
    """Passes over the (packed) training rows, instead of ``max_steps``."""
    learning_rate: float = option(2e-4, "peak learning rate", flags=("--lr",), check=check_number)
    """Peak learning rate of the schedule."""
    lr_scheduler_type: str = option("linear", "learning-rate schedule: linear, cosine, constant_with_warmup, ... "
                                    "(transformers' SchedulerType)", check=lambda n, v: _scheduler(n, v))
    """transformers' scheduler name (``SFTConfig.lr_scheduler_type``)."""
    warmup_steps: float | None = option(None, "warm-up steps (a value below 1: that fraction of the run, as "
                                        "warmup_ratio was); default min(5, a tenth of the run)",
                                        aliases=("warmup_ratio",),
                                        check=functools.partial(check_number, low_open=False, allow_none=True))
    """Steps of linear warm-up; below 1 a fraction of the run (transformers 5 folded ``warmup_ratio`` in here, so
    that name sets this field too); None: min(5, run // 10)."""
    weight_decay: float = option(0.0, "AdamW weight decay", check=functools.partial(check_number, low_open=False))
    """Decoupled weight decay of the optimizer."""
    batch_size: int = option(1, "rows (packed rows with packing) per micro-batch per device",
                             aliases=("per_device_train_batch_size",), check=check_positive)
    """Rows per micro-batch per device (``per_device_train_batch_size``)."""
    gradient_accumulation_steps: int = option(1, "micro-batches per optimizer step", flags=("--grad-accumulation",),
                                              check=check_positive)
    """Micro-batches per optimizer step: a larger batch for no extra memory."""
    max_seq_length: int | None = option(None, "tokens per (packed) row; default the length the model was loaded "
                                        "with", aliases=("max_length",),
                                        check=functools.partial(check_positive, allow_none=True))
    """Tokens per row (``SFTConfig.max_length``); None: the load's ``max_seq_length``."""
    packing: bool = option(True, "pack short examples into full rows (fastkit's packing patch keeps them apart)",
                           check=check_bool)
    """Pack examples into rows of ``max_seq_length`` tokens (TRL's bfd packing, attention per document)."""
    completion_only_loss: bool = option(True, "train on the responses only (the prompt tokens are masked)",
                                        check=check_bool)
    """Loss on the completion / assistant tokens only."""
    drop_long: bool = option(False, "drop rows longer than max_seq_length (logged) instead of refusing the data",
                             check=check_bool)
    """Drop over-long rows (counted in the log) instead of refusing the data."""
    drop_invalid: bool = option(False, "drop rows that cannot train (logged) instead of refusing the data",
                                check=check_bool)
    """Drop rows with nothing to train (counted in the log) instead of refusing the data."""
    streaming: bool = option(False, "read the data a few rows at a time as training draws them (larger than RAM; "
                             "Hub datasets streamed); needs max_steps", check=check_bool)
    """Stream the training data (:mod:`fastkit.data.stream`): rows read, checked and tokenized as the trainer draws
    them, never all in memory; the run's length is ``max_steps`` (a stream's length is not known ahead)."""
    seed: int = option(3407, "seed of the run (data order, dropout, eval split, LoRA init in fastkit train)",
                       check=check_non_negative_int)
    """Random seed (``seed`` and ``data_seed``)."""
    eval_split: float = option(0.0, "hold out this fraction of the rows (0.05), or this many rows (200), for an "
                               "eval loss; 0: none", check=_eval_split)
    """Held-out share (0 < x < 1) or row count of the training data; 0: no eval set from it."""
    eval_steps: int | None = option(None, "evaluate every that many steps, and after the last (default: about 5 "
                                    "times a run, at most every 10 steps)",
                                    check=functools.partial(check_positive, allow_none=True))
    """Steps between evaluations when there is an eval set (one more after the last step); None:
    :func:`default_eval_steps` of the run's length."""
    early_stopping_patience: int | None = option(
        None, "stop when the eval loss has not improved for that many evaluations (needs an eval set)",
        check=functools.partial(check_positive, allow_none=True))
    """transformers' EarlyStoppingCallback on the eval loss; None: no early stopping."""
    early_stopping_threshold: float = option(0.0, "how much the eval loss must improve to count as better",
                                             check=functools.partial(check_number, low_open=False))
    """Minimum improvement of the eval loss that resets the patience."""
    compare: bool = option(False, "after training, the base and the tuned model side by side on the held-out rows "
                           "(eval_split / eval_dataset): output_dir/eval/report.md (docs/eval.md)", check=check_bool)
    """``fastkit.evaluate`` after the run on its eval set: answer loss, checked answers, forgetting (needs an eval
    set; the report lands in ``output_dir/eval``)."""
    save_steps: int | None = option(None, "a checkpoint every that many steps in output_dir (None: none)",
                                    check=functools.partial(check_positive, allow_none=True))
    """Steps between checkpoints; None saves none."""
    save_total_limit: int | None = option(2, "checkpoints kept (the newest); None keeps all",
                                          check=functools.partial(check_positive, allow_none=True))
    """How many checkpoints stay in ``output_dir`` (older ones are deleted by the trainer)."""
    logging_steps: int | None = option(None, "log (and draw the dashboard's curves) every that many steps; "
                                       "default every step", check=functools.partial(check_positive, allow_none=True))
    """Steps between log points (each log point reads the loss from the device); None: every step."""
    output_dir: str = option("outputs", "checkpoints and saved models", check=check_output_dir)
    """Folder of the checkpoints (and of ``fastkit_config.yaml``, the options a run used)."""
    report_to: str | list[str] = option("none", "none, tensorboard, wandb or trackio (installed ones only)",
                                        check=check_trackers)
    """Experiment trackers, one or a list (each must be installed)."""
    dashboard: str = option("auto", "auto, html, widget, terminal or none", check=check_dashboard)
    """Which dashboard make_trainer attaches (``fit`` shows its own)."""
    measure_syncs: bool = option(False, "count host-device syncs of one step (a debug switch)", check=check_bool)
    """Count the host-device syncs of one step on the dashboard."""
    chunked_loss: bool | None = option(None, "fastkit's chunked cross-entropy (default: on off CUDA)",
                                       check=functools.partial(check_bool, allow_none=True))
    """fastkit's chunked loss instead of TRL's fused LM head; None: on off CUDA."""
    compile: str = option("off", "torch.compile: off, regions (each decoder layer, compiled once) or model (the "
                          "whole model); TRL's torch_compile means model", check=_compile)
    """``torch.compile`` of the run (:mod:`fastkit.training.compile`): ``regions`` compiles each decoder layer (fast to
    compile; with checkpointing on, docs/step.md says what falls back to eager), ``model`` the whole model; backend
    and mode from ``sft['torch_compile_backend']`` / ``sft['torch_compile_mode']`` (default inductor)."""
    sft: dict[str, Any] = option(help="any other trl.SFTConfig field by name, e.g. {'max_grad_norm': 0.5}",
                                 factory=dict, check=_sft)
    """Other ``trl.SFTConfig`` fields, passed through as given (they win over fastkit's defaults)."""

    def __post_init__(self) -> None:
        from fastkit.training.compile import fold_trl_fields

        self.compile = fold_trl_fields(self.compile, self.sft)
        self.check()

    def check(self) -> None:
        """Every field checked, naming it (also after a field was assigned: make_trainer checks again)."""
        check_fields(self)
        if self.max_steps is not None and self.epochs is not None:
            raise FastkitError(f"Give max_steps or epochs, not both (got max_steps={self.max_steps!r}, "
                               f"epochs={self.epochs!r}): set the other to None.")
        taken = {a: f.name for f in dataclasses.fields(self) for a in (f.name, *f.metadata.get("aliases", ()))}
        for key in self.sft:
            if key in taken:
                raise FastkitError(f"sft[{key!r}]: {key} is TrainOptions.{taken[key]}; set it there (one place "
                                   "for each option).")

    @classmethod
    def from_kwargs(cls, options: TrainOptions | None = None, **kwargs: Any) -> TrainOptions:
        """``options`` (or the defaults) with ``kwargs`` applied: TrainOptions fields (or their SFTConfig names,
        e.g. ``num_train_epochs``) by name, any other SFTConfig field into ``sft``."""
        fields, sft = split_names(kwargs)
        return (options or cls()).replace(**fields, sft={**(options.sft if options else {}), **sft})

    def replace(self, **changes: Any) -> TrainOptions:
        """A copy with ``changes`` (checked). Setting ``max_steps`` clears ``epochs`` and the other way round."""
        if changes.get("max_steps") is not None and "epochs" not in changes:
            changes["epochs"] = None
        if changes.get("epochs") is not None and "max_steps" not in changes:
            changes["max_steps"] = None
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain values, field order (``sft`` last): what ``fastkit_config.yaml`` holds."""
        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


@dataclass
class LoraOptions:
    """The LoRA adapter's knobs, for ``FastModel.get_peft_model(model, options=LoraOptions(...))`` and
    ``fastkit train``. Checked when made."""

    lora_r: int = option(16, "LoRA rank", check=check_positive)
    """Rank of the low-rank factors."""
    lora_alpha: float | None = option(None, "LoRA scale numerator (default: lora_r, a scale of 1)",
                                      check=functools.partial(check_number, allow_none=True))
    """The adapter's scale is lora_alpha / lora_r (rsLoRA: / sqrt(lora_r)); None: lora_r."""
    lora_dropout: float = option(0.0, "dropout on the adapter's input",
                                 check=functools.partial(check_number, low_open=False, high=1.0))
    """Dropout before the LoRA factors, in [0, 1)."""
    target_modules: str | list[str] = option("all-linear", "modules to adapt: all-linear, a regex, or names",
                                             check=_targets)
    """'all-linear', a module-name regex, or a list of module names."""
    use_rslora: bool = option(False, "rank-stabilized LoRA (scale lora_alpha / sqrt(lora_r))", check=check_bool)
    """PEFT's rsLoRA scaling."""
    target_experts: bool = option(False, "also adapt MoE experts (fastkit's per-expert-group LoRA)", check=check_bool)
    """Adapt mixture-of-experts experts too."""
    finetune_vision_layers: bool = option(False, "vision-language models: also adapt the vision tower and projector "
                                          "(default: the language model only)", check=check_bool)
    """A vision-language model's ``"all-linear"`` LoRA covers its vision tower and projector too (Unsloth's name);
    False: the language model only. Refused on a text model."""
    checkpointing: bool | str = option("auto", "gradient checkpointing: auto (offload where the memory plan needs "
                                       "it), on, off, or offload (double-buffered CPU offload)",
                                       check=_checkpointing)
    """'auto', 'on' / True, 'off' / False, or 'offload'."""

    def __post_init__(self) -> None:
        check_fields(self)

    def peft_kwargs(self) -> dict[str, Any]:
        """The ``FastModel.get_peft_model`` arguments these options mean."""
        check_fields(self)
        targets = self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)
        kwargs = dict(r=self.lora_r, lora_alpha=self.lora_alpha if self.lora_alpha is not None else self.lora_r,
                      lora_dropout=self.lora_dropout, target_modules=targets, target_experts=self.target_experts,
                      use_gradient_checkpointing=CHECKPOINTING[self.checkpointing])
        if self.use_rslora:
            kwargs["use_rslora"] = True
        if self.finetune_vision_layers:
            kwargs["finetune_vision_layers"] = True
        return kwargs

    def replace(self, **changes: Any) -> LoraOptions:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


def check_fields(options) -> None:
    for f in dataclasses.fields(options):
        f.metadata["check"](f.name, getattr(options, f.name))


def plain(value: Any) -> Any:
    """YAML-ready: tuples as lists, enums as their values, mappings copied."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value.value if isinstance(value, enum.Enum) else value


# -- names: TrainOptions fields, their SFTConfig spellings, and the pass-through ----------------------------
def aliases() -> dict[str, str]:
    """SFTConfig's name -> the TrainOptions field that sets it (``num_train_epochs`` -> ``epochs``)."""
    return {a: f.name for f in dataclasses.fields(TrainOptions) for a in f.metadata.get("aliases", ())}


def split_names(values: dict[str, Any], where: str = "make_trainer") -> tuple[dict[str, Any], dict[str, Any]]:
    """``values`` -> (TrainOptions fields, SFTConfig pass-through); an unknown name is refused with the closest."""
    own = {f.name for f in dataclasses.fields(TrainOptions)} - {"sft"}
    alias = aliases()
    fields, sft, given = {}, {}, {}
    for name, value in values.items():
        if name in own or name in alias:
            first = given.setdefault(alias.get(name, name), name)
            if first != name:  # epochs= and num_train_epochs= : which one wins would be a guess
                raise FastkitError(f"{where}: {first}= and {name}= both set {alias.get(name, name)}; give one.")
            fields[alias.get(name, name)] = value
        elif name in sft_fields():
            sft.update(_sft_beside(sft, {name: value}, where))
        elif name == "sft" and isinstance(value, dict):  # sft={...} beside the keywords: one place per field
            sft.update(_sft_beside(sft, value, where))
        else:
            raise FastkitError(unknown_name(where, name))
    return fields, sft


def _sft_beside(sft: dict[str, Any], value: dict[str, Any], where: str) -> dict[str, Any]:
    for key in value:
        if key in sft:
            raise FastkitError(f"{where}: {key}= and sft[{key!r}] both set {key}; give one.")
    return value


def unknown_name(where: str, name: str, extra: tuple[str, ...] = ()) -> str:
    """The message for an unknown option, with the closest TrainOptions / LoraOptions / SFTConfig name."""
    known = [*option_names(), *sft_fields(), *extra]
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return (f"{where}: unknown option {name!r}{hint} (TrainOptions, LoraOptions and trl.SFTConfig fields are "
            "known).")


def option_names() -> list[str]:
    """Every TrainOptions and LoraOptions field name and SFTConfig alias."""
    names = [f.name for cls in (TrainOptions, LoraOptions) for f in dataclasses.fields(cls)]
    return names + list(aliases())


@functools.lru_cache(maxsize=4)
def trl_hints(config: str = "SFTConfig") -> dict[str, Any]:
    """The TRL config class ``config``'s (``SFTConfig``, ``DPOConfig``, ``GRPOConfig``) field name -> resolved type
    (the installed TRL's own dataclass)."""
    import trl

    cls = getattr(trl, config)
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def sft_fields() -> dict[str, Any]:
    """trl.SFTConfig's init fields and their types (:func:`trl_hints`)."""
    return trl_hints("SFTConfig")


def check_sft_value(name: str, value: Any, config: str = "SFTConfig") -> None:
    """``value`` has a type the TRL ``config``'s field ``name`` takes (unknown names refused with the closest one)."""
    hints = trl_hints(config)
    if name not in hints:
        close = difflib.get_close_matches(name, list(hints), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        where = "sft" if config == "SFTConfig" else "trl"
        raise FastkitError(f"{where}: {name!r} is not a trl.{config} field{hint or '.'}")
    if not accepts(hints[name], value):
        raise FastkitError(f"{name}={value!r}: trl.{config}.{name} takes {type_words(hints[name])}.")


def _union_args(hint: Any) -> tuple | None:
    origin = typing.get_origin(hint)
    return typing.get_args(hint) if origin is typing.Union or origin is types.UnionType else None


def accepts(hint: Any, value: Any) -> bool:
    """Whether ``value`` fits the type ``hint`` (int for float fields; an enum's value for the enum)."""
    members = _union_args(hint)
    if members is not None:
        return any(accepts(m, value) for m in members)
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if origin is typing.Literal:
        return any(value is a or value == a and type(value) is type(a) for a in typing.get_args(hint))
    if origin in (list, dict):
        inner = typing.get_args(hint)
        items = value if origin is list else list(value.values()) if isinstance(value, dict) else ()
        return isinstance(value, origin) and (not inner or all(accepts(inner[-1], v) for v in items))
    return _accepts_class(hint, value)


def _accepts_class(hint: Any, value: Any) -> bool:
    if hint is bool:
        return isinstance(value, bool)
    if hint in (int, float):
        return not isinstance(value, bool) and isinstance(value, (int, float) if hint is float else int)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return isinstance(value, hint) or value in [m.value for m in hint]
    return isinstance(hint, type) and isinstance(value, hint)


def type_words(hint: Any) -> str:
    """A type in words for a message: 'a float', 'one of linear, cosine, ...', 'a list of str or None'."""
    members = _union_args(hint)
    if members is not None:
        return " or ".join(dict.fromkeys(type_words(m) for m in members))
    origin = typing.get_origin(hint)
    if hint is type(None):
        return "None"
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    if origin in (list, dict):
        return f"a {origin.__name__}"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        values = [m.value for m in hint]
        return f"one of {', '.join(map(str, values[:12]))}{', ...' if len(values) > 12 else ''}"
    return f"a {getattr(hint, '__name__', str(hint))}"


# -- the YAML a run saves (fastkit train --config reads it back) ---------------------------------------------
CONFIG_FILE = "fastkit_config.yaml"
"""The options a run used, written into its output_dir by :func:`fastkit.training.fit`."""


def dump_yaml(config: dict[str, Any], header: str = "") -> str:
    """``config`` as YAML, keys in the given order (``fastkit train --config`` reads it back)."""
    import yaml

    text = yaml.safe_dump(plain(config), sort_keys=False, allow_unicode=True, default_flow_style=None, width=100)
    return "".join(f"# {line}\n" for line in header.splitlines()) + text


def write_config(folder: str, config: dict[str, Any], command: str = "train") -> str:
    """``folder/fastkit_config.yaml`` (written whole, then renamed into place); returns its path. ``command``: the
    fastkit command that reads it back (train, dpo, grpo)."""
    import os

    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, CONFIG_FILE)
    partial = f"{path}.partial"
    with open(partial, "w", encoding="utf-8") as f:
        f.write(dump_yaml(config, f"The options of this run (fastkit {command} --config FILE reads them back)."))
    os.replace(partial, path)
    return path


__all__ = ["CONFIG_FILE", "DEFAULT_MAX_STEPS", "EVALS_PER_RUN", "EVAL_EVERY_AT_LEAST", "TRACKERS", "LoraOptions",
           "TrainOptions", "accepts", "aliases", "available_trackers", "check_dashboard", "check_fields",
           "check_number", "check_output_dir", "check_report_to", "check_sft_value", "check_trackers",
           "default_eval_steps", "dump_yaml", "option", "option_names", "plain", "sft_fields", "split_names",
           "trackers", "trl_hints", "type_words", "unknown_name", "write_config"]
