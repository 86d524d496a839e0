"""Round-6 hostile matrix of the RL surfaces (issue 53): GRPO's reward values and reward files, KTO / DPO columns
and labels, through the functions and through ``fastkit grpo`` / ``kto`` / ``dpo`` (exit 2 naming the input, before
the model loads, or the run refused naming the reward function).

The rules (docs/rl.md, "Rewards" and "KTO"): a reward None is counted (TRL's "not applicable"), said at its first
batch and summed up at the end; 3 batches in a row that no function scored end the run (exit 2, the functions
named); NaN / inf / bool / text / wrong count / no list are refused at once naming the function and the value; a
reward file that fails at import is exit 2 naming it and its error. KTO labels: bools, 0 / 1, and those as text
(a CSV column); null is "null 'label'"; rows holding DPO's and KTO's columns are refused by both commands.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

from fastkit.cli import main
from fastkit.errors import FastkitError
from fastkit.training import grpo, kto
from fastkit.training.grpo import UNSCORED_BATCHES, CheckedReward, RewardCounts

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
TWIN = ["--model", MODEL, "--twin", "--steps", "2", "--max-seq-length", "128", "--lora-r", "4"]
NAN = math.nan


# -- reward values -------------------------------------------------------------------------------------------
def _batch(*columns):
    """A (completions, functions) reward batch in TRL's form: None as NaN."""
    return torch.tensor([[NAN if v is None else v for v in row] for row in zip(*columns)], dtype=torch.float32)


def test_a_batch_no_function_scored_is_said_and_three_in_a_row_end_the_run(caplog):
    counts = RewardCounts(["fmt", "judge"])
    with caplog.at_level(logging.WARNING, logger="fastkit"):
        counts.add(_batch([1.0, None], [None, None]))  # completion 1 scored by no function
        counts.add(_batch([None, None], [None, None]))
        counts.add(_batch([None, None], [None, None]))
    assert "1 of 2 completions got None from every reward function ('fmt', 'judge')" in caplog.text, caplog.text
    assert counts.in_row == 2 and counts.unscored == 5 and counts.none == [5, 6]
    with pytest.raises(FastkitError, match=rf"'fmt', 'judge' returned None for every completion of "
                                           rf"{UNSCORED_BATCHES} batches in a row"):
        counts.add(_batch([None, None], [None, None]))
    assert counts.summary() == ("GRPO rewards over the run: 'fmt' None for 7 of 8; 'judge' None for 8 of 8 (every "
                                "one: never applicable?); 7 of 8 completions scored by no function (advantage 0, not "
                                "trained on)")


def test_a_scored_batch_resets_the_row_and_no_none_says_nothing():
    counts = RewardCounts(["fmt"])
    for _ in range(UNSCORED_BATCHES - 1):
        counts.add(_batch([None, None]))
    counts.add(_batch([0.0, None]))  # one usable reward: the row of unscored batches ends
    for _ in range(UNSCORED_BATCHES - 1):
        counts.add(_batch([None, None]))
    assert counts.in_row == UNSCORED_BATCHES - 1
    clean = RewardCounts(["fmt"])
    clean.add(_batch([0.0, 1.0]))
    assert clean.summary() is None


def _returns(value):
    def reward(completions, **kwargs):
        return value(len(completions)) if callable(value) else value
    return reward


@pytest.mark.parametrize("value, said", [
    (lambda n: [NAN] * n, "returned nan for completion 0"),
    (lambda n: [math.inf] * n, "returned inf for completion 0"),
    (lambda n: [True] * n, "returned bool 'True' for completion 0"),
    (lambda n: ["0.5"] * n, "returned str '0.5' for completion 0"),
    (lambda n: [[1.0]] * n, "returned list '[1.0]' for completion 0"),
    (lambda n: [1.0] * (n + 1), "returned 3 values for 2 completions"),
    (lambda n: [], "returned 0 values for 2 completions"),
    (None, "returned None for a batch of 2 completions"),
    (0.5, "returned float for 2 completions"),
    ("1,0", "returned str for 2 completions"),
    ({"a": 1}, "returned dict for 2 completions"),
], ids=["nan", "inf", "bool", "text", "nested", "too-many", "empty", "none", "scalar", "string", "dict"])
def test_reward_values_refused_at_once_naming_the_function(value, said):
    wrapped = CheckedReward(_returns(value))
    with pytest.raises(FastkitError, match=r"reward function 'reward' " + said.replace("[", r"\[").replace("]", r"\]")):
        wrapped(prompts=["p", "q"], completions=["a", "b"])


def test_a_reward_that_raises_or_exits_is_named_with_the_completion():
    def judge(completions, **kwargs):
        if any("b" in c for c in completions):
            raise SystemExit(1)
        return [0.0] * len(completions)

    with pytest.raises(FastkitError, match=r"reward function 'judge' raised SystemExit: 1 on completion 1 "
                                           r"\(prompt 'q'\)"):
        CheckedReward(judge)(prompts=["p", "q"], completions=["a", "b"])


def test_reward_values_taken_none_counted():
    wrapped = CheckedReward(_returns(lambda n: [None, 1]))
    assert wrapped(prompts=["p", "q"], completions=["a", "b"]) == [None, 1.0]
    import numpy as np

    assert CheckedReward(_returns(np.array([0.5, 1.0])))(prompts=["p", "q"], completions=["a", "b"]) == [0.5, 1.0]


# -- reward files and the GRPO CLI ---------------------------------------------------------------------------
@pytest.fixture
def no_load(monkeypatch):
    from fastkit import FastModel

    def load(*args, **kwargs):
        raise AssertionError("the model loaded before the input was checked")

    monkeypatch.setattr(FastModel, "from_pretrained", load)


REWARD_FILES = {
    "raises": ('raise ValueError("no API key")\n', "cannot import '{file}' (ValueError: no API key)"),
    "exits": ("import sys\nsys.exit(4)\n", "cannot import '{file}' (SystemExit: 4)"),
    "name-error": ("x = undefined_name\n", "cannot import '{file}' (NameError: name 'undefined_name'"),
    "syntax": ("def f(:\n", "cannot import '{file}' (SyntaxError"),
    "latin-1": (b'NAME = "caf\xe9"\ndef f(completions, **kw):\n    return [0.0] * len(completions)\n',
                "cannot import '{file}' (SyntaxError"),
    "no-function": ("y = 1\n", "'{file}' has no function 'f'"),
    "not-callable": ("f = 3\n", "'{file}' has no function 'f'"),
    "missing": (None, "cannot import '{file}' (FileNotFoundError: no such file {file})"),
    "directory": ("dir", "cannot import '{file}' (FileNotFoundError: {file} is not a file)"),
}


@pytest.mark.parametrize("case", sorted(REWARD_FILES))
def test_reward_file_problems_exit_2_naming_the_file(tmp_path, capsys, no_load, case):
    text, said = REWARD_FILES[case]
    file = tmp_path / "my_rewards.py"
    if text == "dir":
        file.mkdir()
    elif isinstance(text, bytes):
        file.write_bytes(text)
    elif text is not None:
        file.write_text(text)
    rc = main(["grpo", *TWIN, "--data", "sample", "--max-completion-length", "16", "--reward", f"{file}:f",
               "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert f"fastkit grpo: --reward {file}:f: " + said.format(file=file) in err, err


def test_reward_module_failing_at_import_exits_2(tmp_path, capsys, no_load, monkeypatch):
    (tmp_path / "judge_zz.py").write_text("import json\njson.loads('{')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rc = main(["grpo", *TWIN, "--data", "sample", "--max-completion-length", "16", "--reward", "judge_zz:f",
               "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and "--reward judge_zz:f: cannot import 'judge_zz' (JSONDecodeError: Expecting" in err, err


NONE_REWARD = "def nothing(completions, **kwargs):\n    return [None for _ in completions]\n"


def test_grpo_whose_reward_never_scores_exits_2_naming_it_and_saves_nothing(tmp_path, capsys, caplog):
    (tmp_path / "rw.py").write_text(NONE_REWARD)
    out = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="fastkit"):
        rc = main(["grpo", *TWIN, "--steps", "6", "--max-seq-length", "256", "--data", "sample", "--num-generations",
                   "2", "--max-completion-length", "4", "--reward", f"{tmp_path / 'rw.py'}:nothing",
                   "--output-dir", str(out)])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert f"reward function(s) 'nothing' returned None for every completion of {UNSCORED_BATCHES} batches" in err, err
    assert "got None from every reward function ('nothing')" in caplog.text
    assert "training finished" not in caplog.text and not (out / "lora").exists()


# -- KTO labels and columns, DPO columns ---------------------------------------------------------------------
def _rows(path, lines: str | bytes):
    path.write_bytes(lines if isinstance(lines, bytes) else lines.encode())
    return str(path)


KTO_CSV = "prompt,completion,label\nHi,Hello,{a}\nYo,Hey,{b}\n"


@pytest.mark.parametrize("a, b, want", [
    ("true", "false", [True, False]), ("1", "0", [True, False]), ("TRUE", " False", [True, False]),
    ("0", "true", [False, True]),
])
def test_kto_csv_labels_read_as_the_docs_say(tmp_path, a, b, want):
    from fastkit.data.read import as_dataset

    rows = as_dataset(_rows(tmp_path / "k.csv", KTO_CSV.format(a=a, b=b)), where="x")
    checked = kto.check_rows(kto.unpaired(rows, "x"), None, "x")
    assert checked["label"][:] == want and checked.features["label"].dtype == "bool"


BOTH = '{"prompt": "Hi", "completion": "a", "label": true, "chosen": "x", "rejected": "y"}\n' \
       '{"prompt": "Yo", "completion": "b", "label": false, "chosen": "u", "rejected": "v"}\n'


@pytest.mark.parametrize("command, name, text, said", [
    ("kto", "k.csv", KTO_CSV.format(a="yes", b="no"), "--data {data} row 1 field 'label' must be true or false "
                                                       "(or 1 / 0): whether the completion is desirable, got str "
                                                       "'yes'"),
    ("kto", "k.csv", KTO_CSV.format(a="1", b=""), "--data {data} row 2 field 'label' must be true or false"),
    ("kto", "k.csv", KTO_CSV.format(a="1", b="2"), "row 2 field 'label' must be true or false (or 1 / 0): whether the "
                                                   "completion is desirable, got str '2'"),
    ("kto", "k.csv", KTO_CSV.format(a="1", b="1"), "--data {data}: all 2 rows are desirable (label true)"),
    ("kto", "k.jsonl", '{"prompt": "Hi", "completion": "a", "label": true}\n{"prompt": "Yo", "completion": "b", '
                       '"label": null}\n', "--data {data} row 2: null 'label' (empty or left out in that row)"),
    ("kto", "k.jsonl", '{"prompt": "Hi", "completion": "a", "label": true}\n{"prompt": "Yo", "completion": null, '
                       '"label": false}\n', "--data {data} row 2: null 'completion'"),
    ("kto", "k.jsonl", '{"prompt": "Hi", "completion": "a"}\n', "--data {data} row 1: no 'label' field"),
    ("kto", "k.jsonl", '{"prompt": "Hi", "completion": "a", "label": 0.5}\n', "got float 0.5"),
    ("kto", "k.jsonl", BOTH, "--data {data} holds both preference pairs (columns 'chosen', 'rejected') and unpaired "
                             "rows (columns 'completion', 'label')"),
    ("dpo", "k.jsonl", BOTH, "--data {data} holds both preference pairs"),
    ("kto", "k.csv", "", "{data}"),
    ("kto", "k.jsonl", b'{"prompt": "caf\xe9", "completion": "a", "label": true}\n', "{data}"),
    ("dpo", "k.jsonl", '{"prompt": "Hi", "chosen": null, "rejected": "b"}\n', "--data {data} row 1"),
])
def test_kto_and_dpo_rows_exit_2_naming_them(tmp_path, capsys, no_load, command, name, text, said):
    data = _rows(tmp_path / name, text)
    rc = main([command, *TWIN, "--data", data, "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith(f"fastkit {command}: ") and said.format(data=data) in err, err


def test_kto_data_that_is_a_directory_or_device_exits_2(tmp_path, capsys, no_load):
    for data in (str(tmp_path), "/dev/null"):
        rc = main(["kto", *TWIN, "--data", data, "--output-dir", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert rc == 2 and f"--data {data}" in err, err


def test_grpo_prompt_rows_refused_by_form(tmp_path):
    from datasets import Dataset

    funcs = grpo.wrap_reward_funcs([_returns(lambda n: [0.0] * n)])
    for rows, said in (([{"prompt": None}], "row 1 field 'prompt' must be text"),
                       ([{"prompt": "  "}], "row 1 field 'prompt' is empty"),
                       ([{"prompt": 3}], "row 1 field 'prompt' must be text or a list of messages, got int")):
        with pytest.raises(FastkitError, match=said):
            grpo.check_prompt_rows(Dataset.from_list(rows), funcs)
