"""``fastkit train``: the notebooks' run from a terminal, with the same defaults and the dashboard as a progress line.

Load (FastModel, patches where they fit) -> data (checked, long rows dropped) -> LoRA -> train
(make_trainer + fit, the terminal dashboard) -> save (LoRA adapters; ``--merged``, ``--gguf`` on
request). Bad options fail before the model loads; bad data fails before the first step.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastkit.cli import export as cli_export
from fastkit.cli.model_facts import model_facts

logger = logging.getLogger(__name__)


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


def add_parser(sub, argv: list[str] | None = None) -> argparse.ArgumentParser:
    """Register ``fastkit train`` on the ``sub`` subparsers of the main command (:meth:`fastkit.cli.config.Command.
    add_parser`: its flags, from fastkit.TrainOptions, fastkit.LoraOptions and trl.SFTConfig, when it runs)."""
    from fastkit.cli.config import TRAIN

    return TRAIN.add_parser(sub, argv, "LoRA-train a model on chat data with the live progress line (as the notebooks)",
                            "LoRA-train MODEL on DATA", " Defaults are the notebooks'.")


INTERRUPTED = 130
"""Exit status of a run stopped by Ctrl-C (the adapters trained so far are saved first)."""


@dataclass
class Prepared:
    """What ``fastkit train`` checked before the model loads."""

    rows: Any
    """The training rows: read, format detected, every row's fields checked (tokens are counted after the load)."""
    resume_from: str | None
    """The checkpoint ``--resume`` continues; None for a new run."""
    images: bool = False
    """``rows`` are image + text rows (a list of dicts, images checked): the model loads as vision-language."""


def preflight(args: argparse.Namespace) -> Prepared:
    """Every check that needs no model, run before it loads (minutes for a 14B model): options, the model folder,
    the GGUF quantization, the output folder, the data (path, format, columns, rows) and the resume state."""
    from fastkit.plan.source import check_hub_answers

    if not args.twin:  # a Hub id out of reach: refused in seconds, before the heavy imports and the data
        check_hub_answers(args.model)
    from fastkit.extras import require
    from fastkit.training.run import check_stream_options

    check_job(args)
    images = _image_data(args)  # image + text rows: checked here, every image opened
    vlm = images is not None or _loads_as_vision(args.model, args.twin)
    if vlm:  # its processor reads images with Pillow, text rows too
        require("PIL", f"--model {args.model} (a vision-language model)")
        _vision_defaults(args, images is not None)
    _check_sft_config(args.train, args.load_in_4bit)
    if images is None:
        rows = _read_data(args.data, args.drop_invalid, args.train.seed, streaming=args.train.streaming,
                          mix=args.data_mix)
        check_stream_options(rows, args.train, args.train.epochs)  # a stream's limits, before the model loads
        rows = _as_chats(rows, args.model) if vlm else rows
    return Prepared(rows=images if images is not None else rows,
                    resume_from=check_resume(args) if args.resume else None, images=images is not None)


def check_job(args: argparse.Namespace) -> None:
    """What every training command (train, dpo, kto, grpo) checks before its data: --extend, the trackers, the model
    folder and its config, --gguf, the export menu, the output folder, the exports under FSDP."""
    from fastkit.errors import FastkitError
    from fastkit.training import check_report_to

    if args.extend and not args.resume:
        raise FastkitError("--extend continues a run: give it with --resume (and the longer --steps or --epochs).")
    check_report_to(args.report_to)
    _check_model(args.model, args.twin)
    _check_model_config(args.model, args.twin, args.lora.target_modules)
    _check_gguf(args.gguf)
    cli_export.check_menu_arguments(args)  # llama.cpp for K-quants, the Hub token and repos
    _check_output_dir(args.output_dir)
    _check_fsdp_exports(args)


def _image_data(args: argparse.Namespace) -> list[dict] | None:
    """``--data`` of image + text rows (a .jsonl / .json / .parquet file, image paths relative to its folder:
    :func:`fastkit.data.vision.read_image_rows`), checked before the model loads: a text model refused, the options
    that do not apply to image rows refused, every image opened (a missing or unreadable one named by row and
    path), the --eval-split count; None for text data."""
    from fastkit.data.vision import check_image_files, read_image_rows
    from fastkit.errors import FastkitError
    from fastkit.extras import require
    from fastkit.training.run import split_rows

    rows = read_image_rows(args.data, "--data")
    if rows is None:
        return None
    require("PIL", f"--data {args.data_label} (image + text rows)", "Or train on text rows.")
    model_type, facts = model_facts(args.model, args.twin)
    if model_type is not None and not _vision_family(model_type, facts, args.twin):
        raise FastkitError(f"--data {args.data_label} holds image + text rows, but --model {args.model} is a text "
                           f"model ({model_type}): give a vision-language model (Qwen2.5-VL, Qwen3-VL, SmolVLM, "
                           "Idefics3, Gemma 3: docs/vision.md), or text rows.")
    check_image_files(rows, "--data", model_type)
    split_rows(rows, args.train.eval_split, args.train.seed)  # the count, as make_trainer splits them
    return rows


def _vision_family(model_type: str, facts, twin: bool) -> bool:
    """Whether ``model_type`` loads as a vision-language model (a twin of a composite's text model, as Gemma 3's
    ``gemma3_text``: its composite's row)."""
    if facts is not None and facts.vision is not None:
        return True
    if not twin:
        return False
    from transformers import CONFIG_MAPPING

    from fastkit import registry

    return any(row.vision is not None and row.text_config
               and CONFIG_MAPPING[name]().get_text_config().model_type == model_type
               for name, row in registry.MODEL_TABLE.items())


def _loads_as_vision(model: str, twin: bool) -> bool:
    """``--model`` is a family that loads only as a vision-language model (Qwen2.5-VL, SmolVLM, ...; Gemma 3 loads
    its text model for text rows)."""
    _, facts = model_facts(model, twin)
    return facts is not None and facts.vision is not None and not facts.text_config


def _vision_defaults(args: argparse.Namespace, images: bool) -> None:
    """A run that trains a vision-language model (image rows, or a family that loads only as one): the options that
    do not apply refused (--streaming, --drop-invalid), and packing off unless --packing was given (then refused:
    its rows train padded, one example each)."""
    from fastkit.errors import FastkitError
    from fastkit.training.run import check_vision_options

    check_vision_options(args.train)
    if not args.train.packing:
        return
    what = "image + text rows" if images else f"--model {args.model} (a vision-language model)"
    if "packing" in args.explicit:
        raise FastkitError(f"--packing: {what} train as padded rows, one example each (fastkit train does not "
                           "pack them); drop --packing.")
    args.train = args.train.replace(packing=False)
    args.resolved.options = args.train  # the saved fastkit_config.yaml says so
    args.packing_note = f"fastkit: {what}: packing off for this run (padded rows, one example each; the packing " \
                        "patch the load lists stays unused)"  # logged after the load banner, which lists the patches


def _as_chats(rows, model: str):
    """Text rows for a vision-language model, which trains on chats: prompt / completion rows as chats; plain text
    and pre-tokenized rows refused (its processor renders chats)."""
    from fastkit.data.sources import kind_of, to_kind
    from fastkit.errors import FastkitError

    kind = kind_of(rows)
    if kind in ("text", "tokenized"):
        held = "plain text" if kind == "text" else "token ids"
        raise FastkitError(f"--model {model} is a vision-language model: it trains on chats ('messages', or "
                           f"prompt / completion rows), and --data holds {held} rows. Give chat rows, or a text "
                           "model.")
    return rows if kind == "messages" else to_kind(rows, "messages")


def _check_fsdp_exports(args: argparse.Namespace) -> None:
    """Under FSDP the model is sharded across the processes: fastkit train saves the LoRA (gathered, once); the
    merged weights, GGUF files and the upload are made afterwards, from that folder, in one process."""
    from fastkit.distributed import ranks
    from fastkit.errors import FastkitError

    asked = [flag for flag, on in (("--merged", args.merged), ("--gguf", args.gguf),
                                   ("--push-to-hub", args.push_to_hub)) if on]
    if asked and ranks.fsdp_asked():
        raise FastkitError(f"{', '.join(asked)} under FSDP: the model is sharded across the processes, and merging "
                           "or exporting needs it whole in one. Train with FSDP (the LoRA is saved, gathered), then "
                           f"run `fastkit export --model {args.output_dir}/lora ...` in one process.")


def _check_sft_config(options, load_in_4bit: bool) -> None:
    """The trl.SFTConfig these options make, built once before the model loads (its own refusals: a scheduler or
    optimizer name, a strategy...), for this machine's device as make_trainer will see it."""
    import torch

    from fastkit.plan import default_optimizer
    from fastkit.training.run import build_sft_config, sft_config

    cuda = torch.cuda.is_available()
    precision = {"bf16": False, "fp16": False} if cuda else {"use_cpu": True, "bf16": False, "fp16": False}
    build_sft_config(sft_config(options, evaluate=bool(options.eval_split), cuda=cuda,
                                optim=default_optimizer("cuda" if cuda else "cpu", load_in_4bit), precision=precision))


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


def _check_model_config(model: str, twin: bool, target_modules) -> None:
    """A local ``--model``'s config.json (a field of the wrong type) and ``--target-modules`` against the modules it
    builds, on the meta device: before the data is read and any weight loads. (A twin or a Hub id: at the load.)"""
    if twin:
        return
    from fastkit.loader import check_target_modules, meta_model

    built = meta_model(model)
    if built is not None:
        check_target_modules(built, target_modules)


def _check_gguf(quantizations: list[str] | None) -> None:
    """``--gguf``: the gguf package writing them needs is installed (names: the parser's choices; llama.cpp for
    K-quants: :func:`fastkit.cli.export.check_menu_arguments`)."""
    from fastkit.extras import require

    if quantizations:
        require("gguf", "--gguf", "Or drop --gguf.")


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


def _read_data(data, drop_invalid: bool, seed: int = 3407, streaming: bool = False, mix: str = "concat"):
    """``--data`` read and checked without a tokenizer: every source (``fastkit.data.load_sources``: the file, its
    format and mapped columns, every row's fields), mixed by weight, seeded."""
    from fastkit.data.sources import load_sources

    return load_sources(data, seed=seed, drop_invalid=drop_invalid, streaming=streaming, mix=mix)


def check_resume(args: argparse.Namespace) -> str:
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
    if (folder / "adapter_config.json").is_file():
        from fastkit.checks import read_adapter_config

        read_adapter_config(folder, "--resume")
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
    (r"(?<![-\w])drop_invalid=True\b", "--drop-invalid"), (r"(?<![-\w])streaming=True\b", "--streaming"),
    (r"(?<![-\w])load_in_4bit=True\b", "--4bit"), (r"(?<![-\w])gpu=", "--gpu "),
    (r"(?<![-\w])(output_dir|max_seq_length|eval_split|report_to|batch_size|save_steps|target_modules|"
     r"max_prompt_length|max_completion_length|num_generations)\b=?",
     lambda m: "--" + m.group(1).replace("_", "-") + (" " if m.group(0).endswith("=") else "")),
    (r"(?<![-\w])max_steps\b=?", lambda m: "--steps" + (" " if m.group(0).endswith("=") else "")),
    (r"(?<![-\w])(?<!\d )(num_train_epochs|epochs)\b=?",  # "1.00 epochs over ..." is a count, not the option
     lambda m: "--epochs" + (" " if m.group(0).endswith("=") else "")),
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


def resolved_args(args: argparse.Namespace) -> argparse.Namespace:
    """The parsed flags, the ``--config`` file and the defaults as one checked namespace
    (:func:`fastkit.cli.config.resolved_args`), the training options also as ``.train``."""
    from fastkit.cli.config import TRAIN
    from fastkit.cli.config import resolved_args as resolve_args

    out = resolve_args(args, TRAIN)
    out.train = out.options
    for name in ("max_seq_length", "drop_invalid", "epochs"):
        setattr(out, name, getattr(out.train, name))
    out.data_label = data_label(out.resolved.run.data)
    return out


def data_label(data) -> str:
    """What the run folder's and the Hub's model cards call ``--data``: the path (the shipped file for 'sample'),
    or the sources of a mix."""
    from fastkit.data.samples import NO_ROBOTS_SAMPLE
    from fastkit.data.sources import as_sources

    named = {"sample": str(NO_ROBOTS_SAMPLE), "quickstart": "fastkit's quickstart data"}
    labels = [named.get(s.path, s.label) for s in as_sources(data)]
    return labels[0] if len(labels) == 1 else "a mix of " + ", ".join(labels)


def run(args: argparse.Namespace) -> int:
    """Run ``fastkit train`` with parsed ``args``; returns the exit status (0 when training finished, 130 when
    stopped by Ctrl-C, after the adapters trained so far are saved). Under ``torchrun`` every rank trains, the
    main one prints and saves, and every rank returns the same status (:mod:`fastkit.ranks`)."""
    from fastkit.cli.config import print_config

    args = resolved_args(args)
    if args.print_config:  # nothing is loaded; SFTConfig fields given are checked by building the SFTConfig
        if args.train.sft:  # (TRL's import); fastkit's own options were checked as they were read
            _check_sft_config(args.train, args.load_in_4bit)
        print(print_config(args.resolved), end="")
        return 0
    from fastkit.distributed import ranks

    ranks.quiet_replicas()  # a torchrun job: the main process prints, the others warn only
    prepared = ranks.agreed(preflight, args)  # before the model loads; a refusal on any rank ends every rank
    from fastkit.training import fit, run_coverage

    model, tokenizer, trainer = build(args, prepared)
    logger.info("fastkit: %s", flag_words(run_coverage(trainer)))
    trainer.update_record(resume_hint=resume_command(args))  # Ctrl-C's message: how to continue its checkpoint
    metrics = fit(trainer, view="terminal", resume=args.resume, extend=args.extend)  # its status on every rank
    if metrics.comparison is not None:  # --compare: base and tuned on the held-out rows (fastkit.evaluate)
        from fastkit.evaluation.report import forgetting_line

        report = metrics.comparison
        print(report.table() + ("\n" + forgetting_line(report.forgetting) if report.forgetting else ""))
    return save_run(args, model, tokenizer, trainer, metrics.status)


def resume_command(args: argparse.Namespace) -> str:
    """The command line that continues this run from its newest checkpoint: as typed, with ``--resume``."""
    import shlex

    argv = list(getattr(args, "argv", None) or ["train", "..."])
    return "fastkit " + shlex.join(argv + ([] if "--resume" in argv else ["--resume"]))


def save_run(args: argparse.Namespace, model, tokenizer, trainer, status: str) -> int:
    """What a finished (or Ctrl-C'd) ``fastkit train`` / ``dpo`` / ``kto`` / ``grpo`` run saves, on every rank; its
    exit status. FSDP: every rank gathers the LoRA, the main one saves it (the menu's exports were refused in the
    preflight); one process or DDP: the main process saves, the others wait for its verdict."""
    from fastkit.distributed import ranks
    from fastkit.export.sharded import is_sharded, save_sharded_lora

    if status not in ("interrupted", "finished"):
        raise RuntimeError(f"training ended with status {status!r}, not 'finished'")
    if is_sharded(trainer.model):
        path = save_sharded_lora(trainer.model, tokenizer, f"{args.output_dir}/lora")
        if path is not None:
            print(f"LoRA adapters: {path} (verified)")
    elif status == "interrupted":  # the adapters trained so far; the menu's exports are not made
        ranks.agreed(_save_interrupted, args, model, tokenizer, main_only=True)
    else:
        ranks.agreed(cli_export.save_after_training, args, model, tokenizer, trainer, main_only=True)  # verified
    if ranks.is_main():
        print(next_steps(f"{args.output_dir}/lora"))
    return INTERRUPTED if status == "interrupted" else 0


def next_steps(lora: str) -> str:
    """What to do with the adapters a run saved in ``lora``: the chat and export commands, with that path."""
    path = shlex.quote(lora)
    return (f"Next: fastkit chat --model {path}                      # talk to it\n"
            f"      fastkit export --model {path} --gguf q8_0 --name my-model   # a GGUF + Ollama Modelfile")


def _save_interrupted(args: argparse.Namespace, model, tokenizer) -> None:
    """The LoRA adapters of an interrupted run (what the steps done so far trained)."""
    from fastkit.export import save_lora

    logger.info("fastkit: LoRA adapters in %s", save_lora(model, tokenizer, f"{args.output_dir}/lora"))


def build(args: argparse.Namespace, prepared: Prepared):
    """(model, tokenizer, trainer) of a resolved ``fastkit train``: load, LoRA, make_trainer with the options, which
    checks the rows with the tokenizer as it tokenizes them, once (nothing trained yet)."""
    from fastkit import FastModel
    from fastkit.training import make_trainer

    options = args.train
    model, tokenizer = FastModel.from_pretrained(args.model, max_seq_length=options.max_seq_length,
                                                 load_in_4bit=args.load_in_4bit, twin=args.twin,
                                                 **({"vision": True} if prepared.images else {}))
    if getattr(args, "packing_note", None):
        logger.info(args.packing_note)
    for quantization in args.gguf or ():  # the family's GGUF mapping and the tokenizer, before any step
        from fastkit.export.gguf.writer import check_before_writing as _check

        _check(model, tokenizer, Path(args.output_dir) / "gguf", quantization)
    model = FastModel.get_peft_model(model, options=args.lora, random_state=options.seed)
    trainer = make_trainer(model, tokenizer, prepared.rows, options=options)  # rows checked + tokenized there, once
    # the data the run folder's model card names; the config fit saves as output_dir/fastkit_config.yaml
    trainer.update_record(data=args.data_label, config=args.resolved.to_dict())
    return model, tokenizer, trainer


__all__ = ["FLAG_WORDS", "INTERRUPTED", "Prepared", "add_parser", "build", "check_job", "check_resume", "data_label",
           "flag_words", "next_steps", "preflight", "resolved_args", "resume_command", "run", "save_run"]
