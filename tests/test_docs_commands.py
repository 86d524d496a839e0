"""Every line of the docs, tables and code that says a thing was tested / measured with a command, or a table's
provenance ("Made by commit ...: `command`"), names a command that runs as written (issue 53): each command is read
by the parser of the program it names (fastkit's, a benchmark's, accelerate's, torchrun's), and ``fastkit train /
dpo / kto / grpo`` commands also resolve their options (``--print-config``: nothing loads). Running them all would
be too slow; the parsers accepting them is the check. A claim line that names flags without the command they go
with (``tested with --cpu --mixed_precision no``) is refused: it cannot be run as written.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CLAIM = re.compile(r"(?i)(?<!not )(?<!not yet )\b(tested|measured)\b[^.]*\bwith\b|\bmade by commit\b")
"""A line claiming a command: "tested with", "measured ... with", a table's "Made by commit"."""
PROGRAMS = ("fastkit", "python", "accelerate", "torchrun", "bash")
SCANNED = ("README.md", "docs/*.md", "docs/*.yaml", "assets/*.md", "fastkit/**/*.py", "benchmarks/*.py",
           "notebooks/_build.py")


def _commands(text: str) -> list[str]:
    """The backticked spans of ``text`` that start with a program (after ``VAR=value`` settings)."""
    out = []
    for span in re.findall(r"`([^`]+)`", text):
        words = [w for w in span.split() if not re.fullmatch(r"[A-Z_]+=\S*", w)]
        if words and words[0] in PROGRAMS:
            out.append(span)
    return out


def claims() -> list[tuple[str, int, str, list[str]]]:
    """``(file, line number, line, commands)`` of every claim line (the next line too when it ends with ':')."""
    found = []
    for pattern in SCANNED:
        for path in sorted(ROOT.glob(pattern)):
            lines = path.read_text(encoding="utf-8").splitlines()
            for i, line in enumerate(lines):
                if not CLAIM.search(line):
                    continue
                text = line + ("\n" + lines[i + 1] if line.rstrip().endswith(":") and i + 1 < len(lines) else "")
                found.append((str(path.relative_to(ROOT)), i + 1, text, _commands(text)))
    return found


def _flags_without_command(text: str) -> list[str]:
    """``--flags`` of a claim line outside its backticked commands."""
    return re.findall(r"(?<![\w`])--[a-z][\w-]*", re.sub(r"`+[^`]*`+", "", text))


def _words(command: str) -> list[str]:
    """``command``'s words: ``VAR=value`` settings dropped, cut before a shell redirect or pipe."""
    words = [w for w in shlex.split(command) if not re.fullmatch(r"[A-Z_]+=\S*", w)]
    for i, w in enumerate(words):
        if w in (">", ">>", "|", "&&", ";", "2>&1"):
            return words[:i]
    return words


def _redirect_target(command: str) -> str | None:
    words = shlex.split(command)
    return words[words.index(">") + 1] if ">" in words else None


def check_fastkit(argv: list[str]) -> None:
    """``fastkit ARGV``: the CLI's parser accepts it; the training commands and eval resolve their options too."""
    from fastkit.cli import main, parse_args

    if argv[:1] == ["bench"]:
        return check_bench(argv[1], argv[2:])
    parse_args(list(argv))
    if argv[:1] and argv[0] in ("train", "dpo", "kto", "grpo", "eval"):
        assert main([*argv, "--print-config"]) == 0, argv
    return None


def check_bench(name: str, argv: list[str]) -> None:
    from benchmarks.common import parse_only

    parse_only(name, argv)


def check_accelerate(argv: list[str]) -> None:
    """``accelerate launch ...``: accelerate's parser; the script's own arguments by fastkit's; never ``--cpu``
    beside a multi-process config file (accelerate then starts one process, without FSDP)."""
    import yaml
    from accelerate.commands.launch import launch_command_parser

    args = launch_command_parser().parse_args(argv)
    if args.config_file:
        config = yaml.safe_load((ROOT / args.config_file).read_text())
        assert not (args.cpu and int(config.get("num_processes", 1)) > 1), \
            f"--cpu with {args.config_file} (num_processes {config['num_processes']}) starts one process"
    if args.module and args.training_script == "fastkit":
        check_fastkit(args.training_script_args)


def check_torchrun(argv: list[str]) -> None:
    from torch.distributed.run import get_args_parser

    args = get_args_parser().parse_args(argv)
    if args.module and args.training_script == "fastkit":
        check_fastkit(args.training_script_args)


def check_command(command: str) -> None:
    words = _words(command)
    program, rest = words[0], words[1:]
    if program == "fastkit":
        return check_fastkit(rest)
    if program == "python" and rest[:2] == ["-m", "fastkit"]:
        return check_fastkit(rest[2:])
    if program == "python" and rest[:2] == ["-m", "benchmarks"]:
        return check_bench(rest[2], rest[3:])
    if program == "python" and rest[:1] == ["-m"]:
        module = ROOT / (rest[1].replace(".", "/") + ".py")
        assert module.is_file(), f"no module {rest[1]}"
        return None
    if program == "accelerate":
        assert rest[:1] == ["launch"], command
        return check_accelerate(rest[1:])
    if program == "torchrun":
        return check_torchrun(rest)
    assert program == "bash" and (ROOT / rest[0]).is_file(), command
    return None


CLAIMS = claims()


def test_the_claims_are_found():
    """The finder is not vacuous: the FSDP2 config's and every bench table's commands are among them."""
    named = {(file, cmd.split()[0 if cmd.startswith("python") else 0]) for file, _, _, cmds in CLAIMS
             for cmd in cmds}
    files = {file for file, _ in named}
    assert "docs/fsdp2.yaml" in files and "assets/bench_data.md" in files, sorted(files)
    assert sum(len(c) for *_, c in CLAIMS) >= 8, CLAIMS


@pytest.mark.parametrize("file, line, text, commands", CLAIMS, ids=[f"{f}:{n}" for f, n, _, _ in CLAIMS])
def test_a_claimed_command_runs_as_written(file, line, text, commands, tmp_path):
    assert not _flags_without_command(text), \
        f"{file}:{line} names flags {_flags_without_command(text)} without the command they go with"
    made = []
    try:
        for command in commands:
            try:
                check_command(command)
            except SystemExit as stop:
                raise AssertionError(f"{file}:{line}: `{command}` does not parse (exit {stop.code})") from None
            target = _redirect_target(command)
            if target and not Path(target).exists():  # a later command of the line reads what this one wrote
                Path(target).write_text('{"variant": "fastkit", "rows_in": 1}\n')
                made.append(Path(target))
    finally:
        for path in made:
            path.unlink()
