"""``fastkit eval`` (issue 57): a run folder, or a base with an adapter or a tuned model, compared on held-out rows.

Bad input exits 2 with a message before any model loads (the load is made to fail here: a load would exit 3); a
``fastkit train`` run is evaluated on the rows it held out, split again exactly as training split them; the
adapter + data form writes the same report. Tiny twins, offline.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from fastkit import cli

SMOL = "HuggingFaceTB/SmolLM2-135M-Instruct"
FAST = ["--max-rows", "2", "--max-new-tokens", "4", "--forgetting-tokens", "4"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A ``fastkit train`` twin run of 2 steps holding out 4 rows of the quickstart data."""
    out = tmp_path_factory.mktemp("eval") / "run"
    assert cli.main(["train", "--model", SMOL, "--twin", "--data", "quickstart", "--steps", "2", "--max-seq-length",
                     "128", "--lora-r", "4", "--checkpointing", "off", "--eval-split", "4", "--output-dir",
                     str(out)]) == 0
    return out


def _fake_run(root: Path, name: str = "fake", lora: bool = True, **config) -> Path:
    """A run folder as fastkit train writes it (its options file, a LoRA config), without weights: enough for
    every check made before a model loads."""
    folder = root / name
    (folder / "lora").mkdir(parents=True)
    values = dict(model=SMOL, data="quickstart", twin=True, max_seq_length=128, seed=3407, eval_split=4)
    values.update(config)
    (folder / "fastkit_config.yaml").write_text(yaml.safe_dump({k: v for k, v in values.items() if v != "-"}))
    if lora:
        (folder / "lora" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    return folder


def _hostile(tmp: Path) -> dict[str, tuple[list[str], str]]:
    """case -> (fastkit eval's arguments, a piece of the message)."""
    run = str(_fake_run(tmp))
    (tmp / "file.txt").write_text("x")
    (tmp / "empty").mkdir()
    (tmp / "checks.py").write_text("def is_short(answer):\n    return len(answer) < 20\n")
    ok = ["--model", SMOL, "--twin", "--adapter", f"{run}/lora", "--data", "quickstart"]
    return {
        "run_missing": (["--run", str(tmp / "nope")], "no such folder"),
        "run_is_a_file": (["--run", str(tmp / "file.txt")], "not a folder"),
        "run_without_config": (["--run", str(tmp / "empty")], "no fastkit_config.yaml there"),
        "run_without_adapter": (["--run", str(_fake_run(tmp, "nolora", lora=False))], "no LoRA adapter in"),
        "run_config_broken": (["--run", str(_broken_config(tmp))], "not valid YAML"),
        "run_config_without_model": (["--run", str(_fake_run(tmp, "nomodel", model="-"))], "names no model"),
        "run_held_out_nothing": (["--run", str(_fake_run(tmp, "nosplit", eval_split=0))], "held out no rows"),
        "run_of_dpo": (["--run", str(_fake_run(tmp, "dpo", eval_split="-"))], "not a fastkit train run"),
        "run_streaming": (["--run", str(_fake_run(tmp, "stream", streaming=True))], "streaming run"),
        "run_model_out_of_reach": (["--run", str(_fake_run(tmp, "hub", model="nobody/no-such-model", twin=False))],
                                   "'nobody/no-such-model''s config.json is not in the local cache"),
        "run_and_model": (["--run", run, "--model", SMOL, "--twin"], "a run folder names its base model"),
        "run_and_adapter": (["--run", run, "--adapter", f"{run}/lora"], "and --adapter"),
        "nothing": (["--max-rows", "2"], "give --run RUN"),
        "model_alone": (["--model", SMOL, "--twin", "--data", "quickstart"], "not neither"),
        "adapter_and_tuned": ([*ok, "--tuned", str(tmp / "empty")], "not --adapter and --tuned"),
        "no_data": (["--model", SMOL, "--twin", "--adapter", f"{run}/lora"], "--data: give the held-out rows"),
        "adapter_not_lora": ([*ok[:4], str(tmp / "empty"), *ok[5:]], "no adapter_config.json"),
        "tuned_not_a_model": (["--model", SMOL, "--twin", "--tuned", str(tmp / "empty"), "--data", "quickstart"],
                              "no config.json there"),
        "data_missing": ([*ok[:-1], str(tmp / "nope.jsonl")], "does not exist"),
        "data_empty_folder": ([*ok[:-1], str(tmp / "empty")], "holds no data files"),
        "run_data_missing": (["--run", run, "--data", str(tmp / "nope.jsonl")], "does not exist"),
        "check_unknown": ([*ok, "--check", "bogus"], "unknown check 'bogus'"),
        "check_bad_regex": ([*ok, "--check", "json,regex:("], "not a regular expression"),
        "check_no_file": ([*ok, "--check", str(tmp / "none.py") + ":fn"], "cannot import"),
        "check_no_function": ([*ok, "--check", str(tmp / "checks.py") + ":nope"], "has no function 'nope'"),
        "check_builtin": ([*ok, "--check", "exact"], "runs on every answer already"),
        "max_rows_zero": ([*ok, "--max-rows", "0"], "max_rows must be a positive int"),
        "max_new_tokens_text": ([*ok, "--max-new-tokens", "many"], "max_new_tokens must be a positive int"),
        "seed_negative": ([*ok, "--seed", "-1"], "seed must be a non-negative int"),
        "examples_fraction": ([*ok, "--examples", "1.5"], "examples must be a non-negative int"),
        "forgetting_warn_zero": ([*ok, "--forgetting-warn", "0"], "forgetting_warn must be a positive"),
        "sampled_twice": ([*ok, "--sampled", "--no-sampled"], "both set sampled"),
        "output_dir_is_a_file": ([*ok, "--output-dir", str(tmp / "file.txt")], "a file is there"),
        "config_unknown_key": (["--config", str(_yaml(tmp, {"run": run, "max_row": 2}))], "did you mean 'max_row"),
        "config_bad_value": (["--config", str(_yaml(tmp, {"run": run, "max_rows": -2}))], "max_rows must be"),
        "config_bad_check": (["--config", str(_yaml(tmp, {"run": run, "checks": ["json", "nope"]}))],
                             "unknown check 'nope'"),
    }


def _broken_config(tmp: Path) -> Path:
    folder = _fake_run(tmp, "broken")
    (folder / "fastkit_config.yaml").write_text("model: [unclosed\n")
    return folder


def _yaml(tmp: Path, values: dict) -> Path:
    file = tmp / f"options{len(list(tmp.glob('options*.yaml')))}.yaml"
    file.write_text(yaml.safe_dump(values))
    return file


CASES = [
    "run_missing", "run_is_a_file", "run_without_config", "run_without_adapter", "run_config_broken",
    "run_config_without_model", "run_held_out_nothing", "run_of_dpo", "run_streaming", "run_model_out_of_reach",
    "run_and_model",
    "run_and_adapter", "nothing", "model_alone", "adapter_and_tuned", "no_data", "adapter_not_lora",
    "tuned_not_a_model", "data_missing", "data_empty_folder", "run_data_missing", "check_unknown", "check_bad_regex",
    "check_no_file", "check_no_function", "check_builtin", "max_rows_zero", "max_new_tokens_text", "seed_negative",
    "examples_fraction", "forgetting_warn_zero", "sampled_twice", "output_dir_is_a_file", "config_unknown_key",
    "config_bad_value", "config_bad_check"]


@pytest.fixture
def no_load(monkeypatch):
    """Any model load fails (exit 3): a case that exits 2 was refused before it."""
    from fastkit import FastModel

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(FastModel, "from_pretrained", refuse)


@pytest.mark.parametrize("case", CASES)
def test_bad_input_exits_2_before_any_model_loads(case, tmp_path, capsys, no_load):
    argv, message = _hostile(tmp_path)[case]
    rc = _main(["eval", *argv])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert message in err, err


def test_the_matrix_lists_every_case(tmp_path):
    assert sorted(_hostile(tmp_path)) == sorted(CASES)


def _main(argv: list[str]) -> int:
    try:
        return cli.main(argv)
    except SystemExit as exc:  # argparse's refusals
        return exc.code


def test_a_run_is_evaluated_on_the_rows_it_held_out(run_dir, capsys):
    assert cli.main(["eval", "--run", str(run_dir), "--check", "json", *FAST]) == 0
    out = capsys.readouterr().out
    results = json.loads((run_dir / "eval" / "results.json").read_text())
    assert results["rows"] == 2 and set(results["metrics"]["loss"]) == {"base", "tuned"}
    assert {"exact", "contains", "json", "json (sampled)", "perplexity"} <= set(results["metrics"])
    assert results["options"]["checks"] == ["json"] and results["forgetting"]["drift"] >= 0
    assert results["forgetting"]["text_tokens"] > 0 and isinstance(results["forgetting"]["warned"], bool)
    assert (run_dir / "eval" / "report.md").is_file()
    assert "| loss |" in out and "Forgetting: " in out and "Drift on general prompts" in out
    assert f"Report: {run_dir / 'eval'}/report.md" in out


def test_the_run_split_is_the_trainers(run_dir):
    """The rows ``fastkit eval --run`` scores are the rows make_trainer held out of that run's data (the same
    tokens, in the same order), not rows it trained on."""
    from fastkit import FastModel
    from fastkit.cli import eval as cli_eval
    from fastkit.data.sources import load_sources
    from fastkit.evaluation.rows import eval_rows
    from fastkit.training import TrainOptions, make_trainer

    model, tok = FastModel.from_pretrained(SMOL, max_seq_length=128, twin=True)
    plan = cli_eval.preflight(cli_eval.EvalJob(run=str(run_dir)), cli_eval.EvalFlags())
    assert plan.split["eval_split"] == 4 and plan.adapter == run_dir / "lora" and plan.twin
    ours = eval_rows(cli_eval.heldout(plan.rows, tok, plan.split, plan.max_seq_length), tok)
    options = TrainOptions(max_steps=1, eval_split=4, max_seq_length=128, dashboard="none", packing=False,
                           output_dir=str(run_dir.parent / "split"))  # unpacked: one held-out row per row
    lora = FastModel.get_peft_model(model, r=4, target_modules=["q_proj"])
    trainer = make_trainer(lora, tok, load_sources("quickstart", seed=options.seed), options=options)
    theirs = eval_rows(trainer.eval_dataset, tok)
    assert [r.input_ids for r in ours] == [r.input_ids for r in theirs] and len(ours) == 4
    trained = {tuple(r.input_ids) for r in eval_rows(trainer.train_dataset, tok)}
    assert not trained & {tuple(r.input_ids) for r in ours}


def test_an_adapter_on_its_base_with_data(run_dir, tmp_path, capsys):
    out = tmp_path / "report"
    check = "fastkit.quickstart.data:follows_format"
    assert cli.main(["eval", "--model", SMOL, "--twin", "--adapter", str(run_dir / "lora"), "--data",
                     "quickstart-heldout", "--check", check, "--no-sampled", "--no-forgetting", "--output-dir",
                     str(out), *FAST]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["rows"] == 2 and "exact (sampled)" not in results["metrics"] and "forgetting" not in results
    assert check in results["metrics"]
    assert "| exact |" in capsys.readouterr().out


def test_quickstart_heldout_is_an_offline_name_the_quickstart_does_not_train_on():
    from fastkit.data.sources import load_sources
    from fastkit.quickstart.data import heldout_records

    held = load_sources("quickstart-heldout")
    assert list(held["messages"]) == [row["messages"] for row in heldout_records()] and len(held) == 16
    trained = {row["messages"][0]["content"] for row in load_sources("quickstart")}
    assert not trained & {row[0]["content"] for row in held["messages"]}


def test_a_merged_model_scores_as_its_adapter(run_dir, tmp_path):
    """--tuned MERGED (two models) gives the numbers --adapter gives (the base is the adapter disabled)."""
    assert cli.main(["export", "--model", str(run_dir / "lora"), "--merged", "--out-dir", str(tmp_path)]) == 0
    common = ["--model", SMOL, "--twin", "--data", "quickstart", "--no-sampled", "--no-forgetting", *FAST]
    for form, path in (("--adapter", run_dir / "lora"), ("--tuned", tmp_path / "merged_16bit")):
        assert cli.main(["eval", form, str(path), *common, "--output-dir", str(tmp_path / form)]) == 0
    adapter, merged = (json.loads((tmp_path / f / "results.json").read_text())["metrics"]["loss"]
                       for f in ("--adapter", "--tuned"))
    assert adapter["tuned"] != adapter["base"]
    assert merged == pytest.approx(adapter, abs=1e-4)


def test_print_config_reads_back_and_flags_override_the_file(tmp_path, capsys):
    argv = ["eval", "--run", "r", "--check", "json", "--check", "regex:^x,json", "--no-forgetting", "--seed", "3"]
    assert cli.main([*argv, "--print-config"]) == 0
    text = capsys.readouterr().out
    values = yaml.safe_load(text)
    assert values["checks"] == ["json", "regex:^x,json"] and values["forgetting"] is False and values["seed"] == 3
    file = tmp_path / "eval.yaml"
    file.write_text(text)
    assert cli.main(["eval", "--config", str(file), "--seed", "4", "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == {**values, "seed": 4}


def test_help_shows_the_usual_options_and_help_all_every_one(capsys):
    for flag, shown in (("--help", False), ("--help-all", True)):
        with pytest.raises(SystemExit):
            cli.main(["eval", flag])
        text = capsys.readouterr().out
        assert "--run RUN" in text and "--check SPEC" in text and "--no-sampled" in text
        assert ("--forgetting-tokens" in text) is shown, text


def test_the_flags_are_eval_options_fields():
    """fastkit eval's options are fastkit.EvalOptions' fields, with its defaults (a field added there and not
    here, or a default changed on one side, is red)."""
    import dataclasses

    from fastkit.cli.eval import EvalFlags
    from fastkit.evaluation import EvalOptions

    ours = {f.name: f.default if f.default is not dataclasses.MISSING else tuple(f.default_factory())
            for f in dataclasses.fields(EvalFlags)}
    assert ours == {f.name: f.default for f in dataclasses.fields(EvalOptions)}
    flags = EvalFlags(checks=["json,regex:^a", "tests/x.py:fn"], sampled=False)
    assert flags.eval_options() == EvalOptions(checks=("json", "regex:^a", "tests/x.py:fn"), sampled=False)
