"""``fastkit eval``: the base and the tuned model side by side on held-out rows (:func:`fastkit.evaluate`).

    fastkit eval --run outputs/train                                   # a run: its base, LoRA and eval split
    fastkit eval --model BASE --adapter OUTPUT/lora --data heldout.jsonl
    fastkit eval --model BASE --tuned OUTPUT/merged_16bit --data heldout.jsonl
    fastkit eval --run outputs/train --lm-eval hellaswag,arc_easy                # + lm-eval's benchmarks on both

``--run`` reads the folder ``fastkit train`` wrote (``fastkit_config.yaml`` and ``lora/``): the base model, the data
and the rows it held out (``eval_split``, ``seed``), split again as training split them. The report goes to
``RUN/eval/`` (``report.md``, ``results.json``, ``plot.png``) unless ``--output-dir``. Its options are
:class:`fastkit.EvalOptions`' fields, declared in the one options system (:class:`fastkit.cli.config.Command`:
flags, ``--config``, ``--print-config``). Everything that can be checked without a model is checked first (exit 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastkit.checks import check_non_negative_int, check_positive
from fastkit.cli.config import Command, print_config
from fastkit.errors import FastkitError
from fastkit.training.options import check_number, option, plain

logger = logging.getLogger(__name__)


def _text(name: str, value: Any) -> None:
    if value is not None and not (isinstance(value, str) and value.strip()):
        raise FastkitError(f"{name} must be a non-empty string, got {value!r}.")


def _flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise FastkitError(f"{name} must be true or false, got {value!r}.")


def _data(name: str, value: Any) -> None:
    from fastkit.data.sources import as_sources

    if value is not None:
        as_sources(value)


def _checks(name: str, value: Any) -> None:
    from fastkit.evaluation.checks import parse_checks

    parse_checks(check_names(value), "--check")  # every name resolved (a file imported) before any model loads


def _lm_eval(name: str, value: Any) -> None:
    from fastkit.evaluation.lm_eval import task_names

    task_names(value)  # the form only: installed and known names are checked in preflight (lm-eval indexes ~10 s)


def _lm_eval_include(name: str, value: Any) -> None:
    from fastkit.evaluation.lm_eval import check_include

    _text(name, value)
    check_include(value)


def check_names(value: Any) -> tuple[Any, ...]:
    """``--check``'s values as one tuple of names (``json,regex:x`` and ``[json, regex:x]`` alike)."""
    out: list[Any] = []
    for item in [value] if isinstance(value, str) else list(value or ()):
        out += [p.strip() for p in item.split(",") if p.strip()] if isinstance(item, str) else [item]
    return tuple(out)


@dataclass
class EvalJob:
    """What ``fastkit eval`` compares: a run folder, or a base model with an adapter or a tuned model."""

    run: str | None = option(None, "a folder fastkit train wrote: its base model, its LoRA (RUN/lora), its data and "
                             "the rows it held out (eval_split, seed)", check=_text, text=True)
    model: str | None = option(None, "the base model (Hub id or folder), with --adapter or --tuned", check=_text,
                               text=True)
    adapter: str | None = option(None, "a LoRA folder (OUTPUT/lora) put on --model", check=_text, text=True)
    tuned: str | None = option(None, "a merged model folder (OUTPUT/merged_16bit) compared with --model",
                               check=_text, text=True)
    gguf_file: str | None = option(None, "a GGUF file (fastkit export --gguf) run in llama.cpp as the tuned model, "
                                   "compared with --model or --run's base (needs llama-cpp-python)", check=_text,
                                   text=True, flags=("--gguf",), argparse=dict(metavar="FILE"))
    data: Any = option(None, "held-out rows: a .json/.jsonl/.csv/.parquet file, a folder, a Hub dataset id or an "
                       "offline name (default with --run: the rows the run held out)", check=_data)
    twin: bool = option(False, "the tiny random twin of --model (offline tests)", check=_flag)
    max_seq_length: int | None = option(None, "tokens the models load with (default: the run's, else 2048); "
                                        "longer rows are dropped (logged)",
                                        check=functools.partial(check_positive, allow_none=True))
    output_dir: str | None = option(None, "where report.md, results.json and plot.png go (default: RUN/eval, or "
                                    "eval/ beside --adapter / --tuned)", check=_text, text=True)


@dataclass
class EvalFlags:
    """:class:`fastkit.EvalOptions`' fields as ``fastkit eval``'s options (the same names and defaults)."""

    max_rows: int = option(64, "held-out rows scored (the first ones)", check=check_positive)
    max_new_tokens: int = option(128, "tokens per generated answer at most", check=check_positive)
    checks: list[str] = option(help="your checks on each answer, besides exact and contains: json, regex:PATTERN, "
                               "path/to/file.py:function or module:function (repeat the flag, or a comma list; "
                               "default none)",
                               factory=list, flags=("--check",), check=_checks, text=True,
                               argparse=dict(action="extend", nargs="+", metavar="SPEC"))
    sampled: bool = option(True, "also one seeded sampled answer per row (temperature 0.7)", check=_flag,
                           negation="--no-sampled")
    seed: int = option(0, "row i's sampled answer uses seed + i, for both models", check=check_non_negative_int)
    examples: int = option(5, "prompts shown side by side (the ones that changed most)",
                           check=check_non_negative_int)
    forgetting: bool = option(True, "measure forgetting on general text and drift on general prompts shipped with "
                              "fastkit", check=_flag, negation="--no-forgetting")
    forgetting_tokens: int = option(48, "tokens of the base model's answer per general prompt (drift)",
                                    check=check_positive)
    forgetting_warn: float = option(0.3, "forgetting (the general text's loss rise, nats/token) above which the "
                                    "report warns", check=check_number)
    lm_eval: list[str] = option(help="lm-evaluation-harness tasks run on both models, lm-eval's own numbers "
                                "(hellaswag,arc_easy or a local task's name; repeat the flag or a comma list; needs "
                                "pip install 'fastkit-llm[eval]'; default none)",
                                factory=list, check=_lm_eval, text=True,
                                argparse=dict(action="extend", nargs="+", metavar="TASKS"))
    lm_eval_include: str | None = option(None, "a folder of your own lm-eval task YAML files (lm-eval's "
                                         "include_path)", check=_lm_eval_include, text=True,
                                         argparse=dict(metavar="DIR"))
    lm_eval_limit: int | None = option(None, "rows per lm-eval task at most (default: every row)",
                                       check=functools.partial(check_positive, allow_none=True))

    def to_dict(self) -> dict[str, Any]:
        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def eval_options(self):
        """The :class:`fastkit.EvalOptions` these options mean."""
        from fastkit.evaluation import EvalOptions
        from fastkit.evaluation.lm_eval import task_names

        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return EvalOptions(**{**values, "checks": check_names(self.checks), "lm_eval": task_names(self.lm_eval)})


COMMON = ("run", "model", "adapter", "tuned", "gguf_file", "data", "twin", "output_dir", "max_rows", "max_new_tokens",
          "checks", "sampled", "seed", "examples", "forgetting", "forgetting_warn", "lm_eval", "lm_eval_include")
EVAL = Command("eval", EvalFlags, None, {}, COMMON, title="evaluation (fastkit.EvalOptions)",
               help_all="every option", data_help=EvalJob.__dataclass_fields__["data"].metadata["help"], job=EvalJob,
               lora=None, required=(), job_title="what to compare", run_flags=False)
"""``fastkit eval``: :class:`EvalJob` and :class:`EvalFlags` (no LoRA options, no TRL pass-through)."""


def add_parser(sub, argv: list[str] | None = None) -> argparse.ArgumentParser:
    """Register ``fastkit eval`` on the ``sub`` subparsers of the main command."""
    from fastkit.cli.config import OneSpellingFormatter

    p = sub.add_parser("eval", formatter_class=OneSpellingFormatter, allow_abbrev=False,
                       help="the base and the tuned model side by side on held-out rows (loss, answers checked, "
                       "forgetting)",
                       description="Compare the base and the tuned model on held-out rows: the answers' loss and "
                       "perplexity, greedy and sampled answers checked (exact, contains, your checks), the answers "
                       "that changed most, and forgetting on general prompts. Every option is also a key of a "
                       "--config YAML file (flags override it); --print-config shows the resolved file.",
                       usage="fastkit eval (--run RUN [--gguf FILE] | --model BASE (--adapter LORA | --tuned MERGED | "
                             "--gguf FILE) --data DATA) [options]")
    short = argv is not None and bool({"-h", "--help"} & set(argv)) and "--help-all" not in argv
    EVAL.add_arguments(p, trl=False, common_only=short)
    return p


@dataclass
class Plan:
    """What ``fastkit eval`` checked before any model loads."""

    model: str
    twin: bool
    adapter: Path | None
    tuned: str | None
    gguf: Path | None
    """A GGUF file run in llama.cpp as the tuned model (``--gguf``)."""
    rows: Any
    """The rows read (the run's whole data with ``split``; else the held-out rows)."""
    split: dict[str, Any] | None
    """The run's split: its data options (eval_split, seed, drop_long, ...); None for --data."""
    max_seq_length: int
    output_dir: Path
    tokenizer_from: Path | None = None
    """A folder whose tokenizer (the chat template trained with) replaces the base's: the adapter's, the run's."""


def run(args: argparse.Namespace) -> int:
    """``fastkit eval`` with parsed ``args``; 0 when the report is written."""
    given = {k: v for k, v in vars(args).items() if k not in ("config", "print_config", "help_all", "argv",
                                                               "command")}
    resolved = EVAL.resolve(given, args.config)
    if args.print_config:
        print(print_config(resolved), end="")
        return 0
    plan = preflight(resolved.run, resolved.options)
    report = _evaluate(plan, resolved.options.eval_options())
    _print(report, plan.output_dir)
    return 0


def preflight(job: EvalJob, flags: EvalFlags) -> Plan:
    """Every check without a model: the form (--run, or --model with --adapter / --tuned and --data), the run folder,
    the adapter, the data (read), the checks, the output folder."""
    from fastkit.plan.source import check_hub_answers

    _checks("--check", flags.checks)
    _check_form(job)
    plan = _from_run(job) if job.run else _from_models(job)
    if not plan.twin:  # a Hub id out of reach: refused in seconds, not after the loader's retries
        check_hub_answers(plan.model)
    if plan.gguf is not None:
        if flags.lm_eval:
            raise FastkitError(f"--gguf {job.gguf_file} with --lm-eval: lm-evaluation-harness runs on a transformers "
                               "model; run --lm-eval with --adapter / --tuned / --run, and --gguf without it.")
        from fastkit.export.gguf.llamacpp import require

        require("fastkit eval --gguf")
    if flags.lm_eval or flags.lm_eval_include:  # installed, every task name known, the folder there
        from fastkit.evaluation.lm_eval import resolve

        resolve(flags.lm_eval, flags.lm_eval_include)
    return plan


def _check_form(job: EvalJob) -> None:
    if job.run and (job.model or job.adapter or job.tuned):
        given = ", ".join(f"--{n}" for n in ("model", "adapter", "tuned") if getattr(job, n))
        raise FastkitError(f"--run {job.run} and {given}: a run folder names its base model and adapter; give "
                           "--run alone (with --data to score other rows, --gguf to score its GGUF), or --model "
                           "with --adapter, --tuned or --gguf.")
    if job.run:
        return
    if not job.model:
        raise FastkitError("give --run RUN (a folder fastkit train wrote), or --model BASE with --adapter LORA, "
                           "--tuned MERGED or --gguf FILE, and --data.")
    tuned = [flag for flag, given in (("--adapter", job.adapter), ("--tuned", job.tuned), ("--gguf", job.gguf_file))
             if given]
    if len(tuned) != 1:
        raise FastkitError(f"--model {job.model}: give one of --adapter LORA (a LoRA folder on it), --tuned MERGED "
                           "(a merged model) or --gguf FILE (its GGUF in llama.cpp), not "
                           + (" and ".join(tuned) + "." if tuned else "neither."))
    if job.data is None:
        raise FastkitError("--data: give the held-out rows to score (a file, a folder, a Hub dataset id or an "
                           "offline name); only --run knows its own held-out rows.")


def _from_run(job: EvalJob) -> Plan:
    folder = Path(job.run).expanduser()
    config = _run_config(folder, job.run)
    gguf = _gguf(job.gguf_file)
    adapter = None if gguf else _adapter(folder / "lora", f"--run {job.run}")
    seq = job.max_seq_length or config.get("max_seq_length") or 2048
    out = _output_dir(job.output_dir, gguf.parent / "eval" if gguf else folder / "eval")
    if job.data is not None:
        rows, split = _read(job.data), None
    else:
        split = _run_split(config, job.run)
        from fastkit.cli.config import beside_file

        rows = _read(beside_file(config["data"], folder), split["seed"], split["drop_invalid"], split["data_mix"])
    return Plan(config["model"], bool(config.get("twin")) or job.twin, adapter, None, gguf, rows, split, seq, out,
                folder / "lora")


def _gguf(path: str | None) -> Path | None:
    from fastkit.evaluation.gguf import check_file

    return check_file(path) if path else None


def _run_config(folder: Path, label: str) -> dict[str, Any]:
    from fastkit.cli.config import read_file
    from fastkit.training.options import CONFIG_FILE

    if not folder.is_dir():
        raise FastkitError(f"--run {label}: {'not a folder' if folder.exists() else 'no such folder'}; give the "
                           "--output-dir of a fastkit train run.")
    if not (folder / CONFIG_FILE).is_file():
        raise FastkitError(f"--run {label}: no {CONFIG_FILE} there, so not a folder fastkit train wrote; give a "
                           "run's --output-dir, or --model BASE --adapter LORA --data DATA.")
    config = read_file(str(folder / CONFIG_FILE))
    if not isinstance(config.get("model"), str) or config.get("data") is None:
        raise FastkitError(f"--run {label}: {CONFIG_FILE} names no model or no data; give --model BASE --adapter "
                           "LORA --data DATA instead.")
    return config


def _run_split(config: dict[str, Any], label: str) -> dict[str, Any]:
    """The run's options that decide which rows it held out; refused where it held out none or cannot say."""
    if "eval_split" not in config:
        raise FastkitError(f"--run {label}: not a fastkit train run (no eval_split: a dpo / kto / grpo run); give "
                           "--data with held-out rows to score.")
    if not config["eval_split"]:
        raise FastkitError(f"--run {label}: the run held out no rows (eval_split 0); give --data with held-out rows "
                           "(rows it did not train on), or train with --eval-split 0.05.")
    if config.get("streaming"):
        raise FastkitError(f"--run {label}: a streaming run holds out no rows; give --data with held-out rows.")
    names = ("eval_split", "seed", "drop_long", "drop_invalid", "packing", "data_mix")
    defaults = dict(seed=3407, drop_long=True, drop_invalid=False, packing=True, data_mix="concat")
    return {n: config.get(n, defaults.get(n)) for n in names}


def _adapter(path: Path, where: str) -> Path:
    from fastkit.checks import read_adapter_config

    if not (path / "adapter_config.json").is_file():
        raise FastkitError(f"{where}: no LoRA adapter in {path} (no adapter_config.json); was the run stopped before "
                           "it saved? Give a folder save_lora wrote.")
    kind = read_adapter_config(path, where).get("peft_type", "LORA")
    if kind != "LORA":
        raise FastkitError(f"{where}: {path} holds a {kind} adapter; fastkit evaluates LoRA adapters.")
    return path


def _from_models(job: EvalJob) -> Plan:
    adapter = _adapter(Path(job.adapter).expanduser(), f"--adapter {job.adapter}") if job.adapter else None
    gguf = _gguf(job.gguf_file)
    if job.tuned and not (Path(job.tuned).expanduser() / "config.json").is_file():
        raise FastkitError(f"--tuned {job.tuned}: no config.json there; give a merged model folder (fastkit export "
                           "--merged writes OUTPUT/merged_16bit), or a LoRA folder as --adapter.")
    out = _output_dir(job.output_dir, (adapter or gguf or Path(job.tuned).expanduser()).parent / "eval")
    return Plan(job.model, job.twin, adapter, job.tuned, gguf, _read(job.data), None, job.max_seq_length or 2048, out,
                adapter)


def _read(data, seed: int = 3407, drop_invalid: bool = False, mix: str = "concat"):
    """The data read as training reads it (files, folders, offline names, ?columns=...), before any model loads."""
    from fastkit.data.sources import load_sources

    return load_sources(data, seed=seed, drop_invalid=drop_invalid, mix=mix)


def _output_dir(given: str | None, default: Path) -> Path:
    """Where the report goes: ``--output-dir``, else ``default``; a file there refused."""
    from fastkit import checks

    path = Path(given).expanduser() if given else default
    if path.exists() and not path.is_dir():
        raise FastkitError(f"--output-dir {given or path}: a file is there, not a folder; give a folder for the "
                           "report (it is created if missing).")
    checks.check_save_target(str(path), "--output-dir")
    return path


def heldout(rows, tokenizer, split: dict[str, Any] | None, max_seq_length: int):
    """The rows to score: ``rows`` checked as training checks them (long rows dropped, logged); for a run, then
    the rows it held out, split again as ``make_trainer`` split them (the same count, seed and shuffle)."""
    from fastkit.data import check_dataset

    if split is None:
        return check_dataset(rows, tokenizer, max_seq_length, drop_long=True, where="--data")
    checked = check_dataset(rows, tokenizer, max_seq_length, packing=split["packing"], drop_long=split["drop_long"],
                            drop_invalid=split["drop_invalid"])
    from fastkit.training.sft_data import split_eval

    try:  # make_trainer's own split: the same count, seed and shuffle
        return split_eval(checked, None, split["eval_split"], split["seed"])[1]
    except FastkitError as exc:
        raise FastkitError(f"the run's eval_split {split['eval_split']!r} does not fit the {len(checked)} rows its "
                           f"data has now ({exc}); has the data changed since it trained? Give --data with held-out "
                           "rows.") from exc


def _evaluate(plan: Plan, options):
    from fastkit import evaluate

    model, tokenizer, base = _load(plan, options)
    try:
        rows = heldout(plan.rows, tokenizer, plan.split, plan.max_seq_length)
        logger.info("fastkit eval: %d held-out rows%s", len(rows), " (the run's eval split)" if plan.split else "")
        return evaluate(model, tokenizer, rows, base=base, options=options, output_dir=str(plan.output_dir))
    finally:
        if plan.gguf is not None:
            model.close()


def _load(plan: Plan, options):
    """``(tuned model, its tokenizer, base model or None)``: a LoRA on its base (the base is the adapter disabled),
    or two models (a merged folder, or a GGUF in llama.cpp)."""
    from fastkit import FastModel

    base, tokenizer = FastModel.from_pretrained(plan.model, max_seq_length=plan.max_seq_length, twin=plan.twin)
    if plan.tokenizer_from is not None and (plan.tokenizer_from / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer  # the chat template the adapter was trained with

        tokenizer = AutoTokenizer.from_pretrained(str(plan.tokenizer_from))
    if plan.gguf is not None:
        from fastkit.evaluation.gguf import context_for, load_gguf

        n_ctx = context_for(tokenizer, plan.max_seq_length, options)
        return load_gguf(plan.gguf, base, tokenizer, n_ctx), tokenizer, base
    if plan.adapter is None:
        tuned, tokenizer = FastModel.from_pretrained(plan.tuned, max_seq_length=plan.max_seq_length)
        return tuned, tokenizer, base
    from fastkit.export import load_lora

    return load_lora(base, plan.adapter, is_trainable=False), tokenizer, None


def _print(report, folder: Path) -> None:
    from fastkit.evaluation.report import forgetting_line

    print(report.title())
    print(report.table())
    if report.forgetting is not None:
        print(forgetting_line(report.forgetting))
    if report.benchmarks:
        print("lm-evaluation-harness (lm-eval's own numbers):")
        print(report.benchmark_table())
    if report.examples:
        top = report.examples[0]
        print(f"{len(report.examples)} answers changed most (report.md shows them); row {top.row}: "
              f"base {_short(top.base)!r} -> tuned {_short(top.tuned)!r}")
    else:
        print("No answer changed between the base and the tuned model.")
    print(f"Report: {folder}/report.md, results.json, plot.png")


def _short(text: str, n: int = 60) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[:n - 3] + "..."


__all__ = ["EVAL", "EvalFlags", "EvalJob", "Plan", "add_parser", "check_names", "heldout", "preflight", "run"]
