"""fastkit command line: fastkit quickstart, fastkit train --model M --data D, fastkit dpo / kto / grpo --model M
--data D, fastkit eval --run RUN, fastkit plan MODEL,
fastkit bench {packed,offload,moe,sft,data} (from a clone: the benchmarks live in the repository's benchmarks/
folder, outside the wheel; python -m benchmarks is the same). python -m fastkit is the same command.

Errors are one line on stderr (no traceback; set FASTKIT_DEBUG=1 for one), and the exit status says which kind:

- 0: done (fastkit plan: the run fits, with what fastkit turns on by itself unless a memory knob is asked);
- 1: fastkit plan: the run does not fit (the table says by how much, and the fastkit train flags that would fit);
- 2: bad input (a bad option, a model or file that is not there, a FastkitError): fix the command;
- 3: failed: something went wrong while running (a bug, out of memory, ...): the line names it;
- 130: interrupted (Ctrl-C).

Under torchrun every rank of fastkit train (dpo, kto, grpo) exits with the same status; an error every rank learned of
(fastkit.ranks.agreed) is printed once, by the main process.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from pathlib import Path

from fastkit.cli import chat as cli_chat
from fastkit.cli import eval as cli_eval
from fastkit.cli import export as cli_export
from fastkit.cli import rl as cli_rl
from fastkit.cli import train as cli_train

BENCHES = ("packed", "offload", "moe", "sft", "data")
EXIT_OK, EXIT_DOES_NOT_FIT, EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


def _quickstart(args: argparse.Namespace) -> int:
    from fastkit.quickstart import QuickstartConfig, run

    config = QuickstartConfig(max_steps=args.steps, max_seq_length=args.max_seq_length, twin=args.twin,
                              output_dir=args.output_dir)
    run(config)
    return 0


def _plan(args: argparse.Namespace) -> int:
    """``fastkit plan``: the set-up ``fastkit train`` would run (its defaults: what the load-time plan turns on)
    unless a memory knob is asked, its table, then what else fits, in ``fastkit train``'s flags."""
    from fastkit.plan import plan

    gpu = float(args.gpu) if args.gpu.replace(".", "", 1).isdigit() else args.gpu
    knobs = _asked_knobs(args)
    default = None if knobs is not None else _default_setup(args, gpu)
    result = plan(args.model, gpu=gpu, max_seq_length=args.max_seq_length, batch_size=args.batch_size, r=args.r,
                  load_in_4bit=args.load_in_4bit, expert_lora=args.expert_lora, gpus=args.gpus, fsdp=args.fsdp,
                  interface="cli", **(knobs or (default[1] if default else {})), **_rl_options(args))
    if result.longest:  # --max-seq-length max: the longest row per setup, then the asked setup's table at its own
        print(result.longest_table() + f"\n\nThe asked setup at {result.inputs.max_seq_length:,} tokens:\n")
    print(result.table())
    if default is not None:
        _print_default(args, gpu, default[0])
    elif not result.fits and knobs is None and not result.longest:
        _print_with_4bit(args, gpu)
    if result.across is not None:
        _print_across(result)
    return EXIT_OK if result.fits else EXIT_DOES_NOT_FIT


def _asked_knobs(args: argparse.Namespace) -> dict | None:
    """The memory knobs asked by flag (``--checkpointing on|off|offload``, ``--offload``, ``--host-*``) as
    :class:`fastkit.plan.PlanInputs` fields; None: none asked, fastkit's defaults decide (``--checkpointing auto``)."""
    if args.checkpointing == "auto" and not (args.offload or args.host_embedding or args.host_lm_head):
        return None
    offload = args.offload or args.checkpointing == "offload"
    return dict(offload=offload, checkpointing=offload or args.checkpointing != "off",
                host_embedding=args.host_embedding, host_lm_head=args.host_lm_head)


def _default_setup(args: argparse.Namespace, gpu) -> tuple[str, dict] | None:
    """What fastkit's defaults turn on for this run (:func:`fastkit.plan.planner.default_setup`); not searched for
    ``--max-seq-length max`` (its table has every setup) nor planned across GPUs (the ranks each decide)."""
    from fastkit.plan.planner import default_setup

    if args.max_seq_length == "max" or args.gpus > 1:
        return None
    return default_setup(args.model, gpu, args.max_seq_length, args.load_in_4bit)


def _rl_options(args: argparse.Namespace) -> dict:
    """``--kind dpo|grpo`` and GRPO's flags as :class:`fastkit.plan.PlanInputs` fields (SFT: none)."""
    if args.kind == "sft":
        return {}
    return dict(kind=args.kind, num_generations=args.num_generations, max_completion_length=args.max_completion_length,
                max_prompt_length=args.max_prompt_length, beta=args.beta)


def _seq_length(text: str):
    """``--max-seq-length``: a positive int, or ``max`` (the planner searches the longest row that fits)."""
    return "max" if text.strip().lower() == "max" else cli_train.positive_int(text)


def _print_default(args: argparse.Namespace, gpu, what: str) -> None:
    """The table above is fastkit's default set-up, not plain checkpointing: say what it turned on and why."""
    from fastkit.plan import plan
    from fastkit.units import GiB

    plain = plan(args.model, gpu=gpu, max_seq_length=args.max_seq_length, batch_size=args.batch_size, r=args.r,
                 load_in_4bit=args.load_in_4bit, expert_lora=args.expert_lora, **_rl_options(args))
    decided = "" if (args.r, args.batch_size, args.kind) == (16, 1, "sft") else \
        " (decided as the model loads, for LoRA r=16, batch 1)"
    command = "train" if args.kind == "sft" else args.kind
    print(f"\nThis is fastkit's default set-up (fastkit {command} --checkpointing auto, the default; "
          f"FastModel.get_peft_model's defaults): plain checkpointing would need {plain.total / GiB:.2f} GiB, "
          f"{'fits' if plain.fits else 'does NOT fit'} on {plain.inputs.gpu}, so it turns on {what}{decided}. "
          "The plain set-up's table: add --checkpointing on.")


def _print_with_4bit(args: argparse.Namespace, gpu) -> None:
    """16-bit weights that do not fit: whether ``--4bit`` with fastkit's default set-up does (one knob, then the
    load-time plan turns on what it needs)."""
    from fastkit.plan import plan
    from fastkit.units import GiB

    if args.load_in_4bit or args.gpus > 1 or args.kind != "sft" or args.r is None:
        return
    default = _default_setup(argparse.Namespace(**{**vars(args), "load_in_4bit": True}), gpu)
    result = plan(args.model, gpu=gpu, max_seq_length=args.max_seq_length, batch_size=args.batch_size, r=args.r,
                  load_in_4bit=True, expert_lora=args.expert_lora, **(default[1] if default else {}))
    if result.fits:
        how = f" (fastkit's default set-up then turns on {default[0]})" if default else ""
        print(f"\nWith --4bit (QLoRA): predicted {result.total / GiB:.2f} GiB, fits on {result.inputs.gpu}{how}.")


def _print_across(result) -> None:
    """One GPU does not fit: the fewest GPUs of this kind that do (``Plan.across``)."""
    from fastkit.units import GiB

    n, fsdp, total = result.across
    how, flag = ("FSDP2", " --fsdp") if fsdp else ("DDP", "")
    print(f"\nAcross GPUs: {n} x {result.inputs.gpu} with {how} fit ({total / GiB:.2f} GiB per GPU). The table for "
          f"it: add --gpus {n}{flag}.")


def _flags(inputs) -> str:
    """The ``fastkit plan`` flags that ask for the knobs of ``inputs`` (a :class:`fastkit.plan.PlanInputs`)."""
    flags = {"offload": "--offload", "host_embedding": "--host-embedding", "host_lm_head": "--host-lm-head"}
    return " ".join(flag for field, flag in flags.items() if getattr(inputs, field))


def main(argv: list[str] | None = None) -> int:
    """Run one command; see the module docstring for the exit statuses."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv and not argv[0].startswith("-") else "fastkit"
    try:
        return _main(argv)
    except SystemExit:
        raise
    except KeyboardInterrupt as exc:
        if not _reported_elsewhere(exc):
            print(f"fastkit {command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 -- every error becomes one line and an exit status
        if os.environ.get("FASTKIT_DEBUG") == "1":
            raise
        status, line = _error_line(exc)
        if not _reported_elsewhere(exc):
            print(f"fastkit {command}: {line}", file=sys.stderr)
        return status


def _reported_elsewhere(exc: BaseException) -> bool:
    """An error every rank of a multi-process run agreed on (fastkit.ranks): only the main process prints it."""
    if not getattr(exc, "fastkit_agreed", False):
        return False
    from fastkit.distributed.ranks import reported_elsewhere

    return reported_elsewhere(exc)


def _error_line(exc: Exception) -> tuple[int, str]:
    """(exit status, the one line saying what went wrong); another rank's error (fastkit.ranks) as that rank's."""
    from fastkit.distributed.ranks import OtherRankFailed
    from fastkit.errors import FastkitError

    kind, text = type(exc).__name__, str(exc)
    bad_input = isinstance(exc, (FastkitError, FileNotFoundError))
    if isinstance(exc, OtherRankFailed):
        if exc.interrupted:
            return EXIT_INTERRUPTED, f"interrupted (rank {exc.rank})"
        kind, text, bad_input = exc.kind, f"{exc.message} (rank {exc.rank})", exc.bad_input
    text = " ".join(text.split())
    if not getattr(exc, "verbatim", False):  # a --config file's errors keep its keys as written
        text = cli_train.flag_words(text) or kind  # the CLI's flags, not kwargs
    return (EXIT_BAD_INPUT, text[:400]) if bad_input else (EXIT_FAILED, f"failed: {kind}: {text[:400]}")


def parse_args(argv: list[str]) -> argparse.Namespace:
    """What ``fastkit ARGV`` would run with, read by the CLI's own parser; nothing is run (a usage error is
    argparse's SystemExit(2)). The check that a documented command runs as written (tests/test_docs_commands.py)."""
    parser, argv = _parser(argv)
    return parser.parse_args(argv)


def _main(argv: list[str]) -> int:
    parser, argv = _parser(argv)
    args = parser.parse_args(argv)
    args.argv = argv  # the command as typed: an interrupted run's message says how to continue it
    _one_spelling(parser, argv)
    return _run(args)


def _one_spelling(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """Two spellings of one option in one command (``--lr 1e-4 --learning-rate 2e-4``), or ``--config`` twice, are
    refused naming both (which one wins would be a guess; a ``--config`` file left out entirely). The same flag
    repeated is argparse's rule: the last one wins (``--steps 2 ... --steps 5``)."""
    from fastkit._stdlib import argparse_flags

    sub = argparse_flags(parser).get(argv[0]) if argv else None
    if sub is None:
        return
    parser_of, flags = sub
    seen: dict[str, str] = {}
    for word in argv[1:argv.index("--") if "--" in argv else len(argv)]:
        flag = word.split("=", 1)[0]
        dest = flags.get(flag)
        if dest is None:
            continue
        first = seen.setdefault(dest, flag)
        if first != flag:
            parser_of.error(f"{first} and {flag} both set {dest.split(':')[-1]}: give it once.")
    if sum(w.split("=", 1)[0] == "--config" for w in argv) > 1:
        parser_of.error("--config given twice: one options file per run (flags override it).")


def _parser(argv: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """fastkit's parser for ``argv`` (a command's flags are built when it runs) and the argv it parses."""
    parser = argparse.ArgumentParser(prog="fastkit", description=__doc__)
    parser.add_argument("--version", action="version", version=f"fastkit-llm {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_quickstart_parser(sub)
    if argv[:1] in (["train"], ["dpo"], ["kto"], ["grpo"], ["eval"]) and "--help-all" in argv:  # every option
        argv = [*argv, "--help"]
    cli_train.add_parser(sub, argv)  # a command's flags (TRL's fields among them) are built when it runs
    for name in ("dpo", "kto", "grpo"):
        cli_rl.add_parser(sub, name, argv)
    cli_rl.add_orpo_parser(sub)
    cli_rl.refuse_orpo(argv)  # TRL 1.16 has ORPO only under trl.experimental: say so, whatever the flags
    cli_export.add_parser(sub)
    cli_chat.add_parser(sub)
    cli_eval.add_parser(sub, argv)
    _add_plan_parser(sub)
    bench = sub.add_parser("bench", help="side-by-side benchmarks: " + ", ".join(BENCHES))
    bench.add_argument("name", choices=BENCHES)
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for the benchmark (see --help of each)")
    return parser, argv


def _run(args: argparse.Namespace) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from fastkit import _quiet

    _check_hub(args)
    if args.command != "plan" and not getattr(args, "print_config", False):  # those load nothing (no datasets)
        _quiet.quiet_progress_bars()  # every command: fastkit's lines are the terminal's only progress display
    if args.command == "quickstart":
        return _quickstart(args)
    if args.command == "plan":
        return _plan(args)
    if args.command == "train":
        return cli_train.run(args)
    if args.command in ("dpo", "kto", "grpo"):
        return cli_rl.run(args)
    if args.command in ("export", "chat"):
        return args.run(args)
    if args.command == "eval":
        return cli_eval.run(args)
    return _bench(args)


def _check_hub(args: argparse.Namespace) -> None:
    """A ``--model`` Hub id out of reach and not cached: refused in seconds, before torch and datasets are imported
    (as ``fastkit plan`` does; huggingface_hub would retry for half a minute per file)."""
    model = getattr(args, "model", None)
    if args.command in ("train", "dpo", "kto", "grpo", "export", "chat", "eval") and isinstance(model, str) \
            and not getattr(args, "twin", False) and not getattr(args, "print_config", False) \
            and not getattr(args, "config", None):  # a --config file may make it a twin: its preflight checks
        from fastkit.plan.source import check_hub_answers

        check_hub_answers(model)


def _version() -> str:
    """This fastkit's version (the package's, as installed), for ``fastkit --version``."""
    from fastkit import __version__

    return __version__


def _add_quickstart_parser(sub) -> None:
    qs = sub.add_parser("quickstart", help="LoRA-tune SmolLM2-135M-Instruct offline and show before/after answers")
    qs.add_argument("--steps", type=cli_train.positive_int, default=20, help="optimizer steps (default 20)")
    qs.add_argument("--max-seq-length", type=cli_train.positive_int, default=256,
                    help="tokens per packed row (default 256)")
    qs.add_argument("--output-dir", default="outputs/quickstart",
                    help="where the LoRA adapters are saved, in <dir>/lora (default outputs/quickstart)")
    qs.add_argument("--twin", action="store_true", help="tiny random twin instead of the real weights (smoke test)")


def _add_plan_parser(sub) -> None:
    pl = sub.add_parser("plan", help="predict a LoRA/QLoRA run's GPU memory from the model's config alone")
    pl.add_argument("model", help="local folder, config.json, or Hub id (only its config.json is read)")
    pl.add_argument("--gpu", default="t4", help="t4, l4, a10g, rtx-8g, rtx-12g, rtx-16g, rtx-24g, a100-40, l40s, "
                    "a100-80, h100, gh200, h200, spark (unified memory), or a number of GiB, e.g. 24 (default t4)")
    pl.add_argument("--max-seq-length", type=_seq_length, default=2048,
                    help="tokens per row (default 2048), or max: the longest packed row that fits, per setup")
    pl.add_argument("--batch-size", type=cli_train.positive_int, default=1, help="rows per micro-batch (default 1)")
    pl.add_argument("--lora-r", "--r", dest="r", type=cli_train.positive_int, default=16,
                    help="LoRA rank (default 16)")
    pl.add_argument("--4bit", dest="load_in_4bit", action="store_true", help="QLoRA: NF4 base weights")
    pl.add_argument("--checkpointing", choices=("auto", "on", "off", "offload"), default="auto",
                    help="as fastkit train's: auto (the default: plain checkpointing, or what fastkit turns on by "
                    "itself where that does not fit: offload, then the embedding and lm_head on the host), on "
                    "(plain, nothing else), off, offload")
    pl.add_argument("--offload", action="store_true", help="fastkit's checkpoint offload (--checkpointing offload)")
    pl.add_argument("--no-expert-lora", dest="expert_lora", action="store_false",
                    help="4-bit MoE: LoRA on the linear layers only (default: the experts too, as get_peft_model)")
    pl.add_argument("--host-embedding", action="store_true",
                    help="the frozen input embedding in host memory (fastkit.HostWeights(input_embedding=True))")
    pl.add_argument("--host-lm-head", action="store_true",
                    help="the frozen lm_head in host memory, streamed by the chunked loss (HostWeights(lm_head=True))")
    pl.add_argument("--kind", choices=("sft", "dpo", "grpo"), default="sft",
                    help="sft (default); dpo: --batch-size pairs, chosen + rejected packed, the reference pass; "
                    "grpo: --batch-size prompts x --num-generations completions (generation's KV cache, the "
                    "reference pass, the log-prob pass) and the largest G / completion length that fit")
    pl.add_argument("--num-generations", type=cli_train.positive_int, default=8, help="GRPO: completions per prompt")
    pl.add_argument("--max-completion-length", type=cli_train.positive_int, default=512,
                    help="GRPO: tokens per completion (default 512)")
    pl.add_argument("--max-prompt-length", type=cli_train.positive_int, default=None,
                    help="GRPO: tokens per prompt (default: --max-seq-length less --max-completion-length)")
    pl.add_argument("--beta", type=float, default=0.04, help="GRPO: KL strength; 0 skips the reference pass")
    pl.add_argument("--gpus", type=cli_train.positive_int, default=1,
                    help="GPUs the run trains on: the peak per GPU (default 1); DDP unless --fsdp")
    pl.add_argument("--fsdp", action="store_true",
                    help="with --gpus N: FSDP2, parameters, gradients and optimizer state sharded by N")


def _bench(args: argparse.Namespace) -> int:
    """Run ``benchmarks/<name>.py`` of the clone this fastkit comes from (or the working directory's)."""
    clone = Path(__file__).resolve().parents[1]
    if (clone / "benchmarks" / "__main__.py").is_file() and str(clone) not in sys.path:
        sys.path.append(str(clone))
    try:
        bench_main = importlib.import_module("benchmarks.__main__").main
    except ModuleNotFoundError:
        print("fastkit bench: the benchmarks are not part of the installed package; run them from a clone of "
              "the repository: python -m benchmarks NAME --out DIR", file=sys.stderr)
        return 2
    return bench_main([args.name, *args.rest])


if __name__ == "__main__":
    raise SystemExit(main())
