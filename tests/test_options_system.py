"""One options system for every training command (issue 55): ``fastkit train``, ``dpo``, ``kto`` and ``grpo`` are each
a :class:`fastkit.cli.config.Command`, differing only in their fields; their flags, ``--config`` files and
``--print-config`` go through its one resolver. A new command with a resolver of its own fails here."""

from __future__ import annotations

import pytest

from fastkit.cli import _parser, config, main, rl_options
from fastkit.cli import eval as cli_eval

COMMANDS = {"train": config.TRAIN, **rl_options.COMMANDS, "eval": cli_eval.EVAL}
ARGV = {name: ["--model", "m", "--data", "sample", "--steps", "7", "--lora-r", "4"] for name in COMMANDS}
ARGV["eval"] = ["--model", "m", "--adapter", "a", "--data", "sample", "--max-rows", "7", "--check", "json"]
SET = dict.fromkeys(COMMANDS, "max_steps: 7") | {"eval": "max_rows: 7"}


def test_every_command_with_print_config_is_declared_in_the_one_system():
    from fastkit._stdlib import argparse_flags

    names = argparse_flags(_parser([])[0])
    with_config = {name for name in names  # each command's flags are built when it runs (orpo only refuses)
                   if name != "orpo" and "--print-config" in argparse_flags(_parser([name])[0])[name][1]}
    assert with_config == set(COMMANDS)
    assert all(isinstance(command, config.Command) and command.name == name for name, command in COMMANDS.items())


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_print_config_round_trips_through_the_one_resolver(name, tmp_path, capsys, monkeypatch):
    seen = []
    resolve = config.Command.resolve
    monkeypatch.setattr(config.Command, "resolve", lambda self, *args: seen.append(self.name) or resolve(self, *args))
    assert main([name, *ARGV[name], "--print-config"]) == 0
    first = capsys.readouterr().out
    assert f"fastkit {name} --config FILE reproduces this run." in first and SET[name] in first, first
    file = tmp_path / "run.yaml"
    file.write_text(first)
    assert main([name, "--config", str(file), "--print-config"]) == 0
    assert capsys.readouterr().out == first
    assert seen == [name, name]
