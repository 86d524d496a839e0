"""One set of options (issue 33): TrainOptions / LoraOptions behind make_trainer, ``fastkit train``'s generated
flags, its ``--config`` YAML and ``--print-config``.

- Every ``trl.SFTConfig`` field reaches the SFTConfig values make_trainer builds, names and values, from a YAML
  file and from the flags (a non-default value of its type per field; the options -> SFTConfig function, no model).
- Kebab and snake spellings (and the older flag names) give the same options; flags override the file.
- A typo (file key, flag, ``--sft`` name, an SFTConfig value) is refused before the model loads, naming it.
- A YAML written by ``--print-config`` reproduces the run: the same resolved options, and on a twin the same run
  identity (data fingerprint, hyperparameters, adapter); the trainer's args carry the pass-through values.
- The keyword form of make_trainer and ``options=`` give identical SFTConfigs.
"""

from __future__ import annotations

import argparse
import json

import pytest

from fastkit import cli
from fastkit.cli import train as cli_train
from fastkit.cli.config import file_layer, resolve
from fastkit.errors import FastkitError
from fastkit.training import options as options_module
from fastkit.training.compile import TRL_FIELDS as TRL_COMPILE
from fastkit.training.options import TrainOptions, sft_fields
from fastkit.training.run import sft_config

NOT_EXPRESSIBLE = {"parallelism_config": "an accelerate.ParallelismConfig object, not a YAML value"}
"""SFTConfig fields no file or flag can carry (Python objects): set them through make_trainer's keywords."""
OWN = {  # SFTConfig names that are fastkit options: a valid non-default value for each, and what SFTConfig gets
    "output_dir": ("out-x", "out-x"), "per_device_train_batch_size": (2, 2), "num_train_epochs": (2.0, 2.0),
    "learning_rate": (1e-4, 1e-4), "lr_scheduler_type": ("cosine", "cosine"), "warmup_steps": (2, 2),
    "weight_decay": (0.01, 0.01), "gradient_accumulation_steps": (3, 3), "logging_steps": (3, 3),
    "report_to": ("wandb", ["wandb"]), "eval_steps": (4, 4), "save_steps": (5, 5), "save_total_limit": (3, 3),
    "seed": (11, 11), "max_length": (512, 512), "packing": (False, False), "completion_only_loss": (False, False),
}
ALONE = {"max_steps": (7, 7)}
"""Checked in a run of its own (max_steps and num_train_epochs exclude each other)."""
COLLIDES = ("push_to_hub",)
"""SFTConfig names that mean a fastkit option of another kind (the export menu's REPO): under sft: / --sft."""


def _value(name: str, hint, default):
    """A valid, non-default value of SFTConfig's field ``name`` (its type's kind)."""
    from fastkit.training.options import accepts

    number = default if isinstance(default, (int, float)) and not isinstance(default, bool) else 0
    for candidate in (not default if isinstance(default, bool) else None, number + 3, number + 0.25,
                      True, {"key": True}, ["a", "b"], f"x-{name}"):
        if candidate is not None and candidate != default and accepts(hint, candidate):
            return candidate
    raise AssertionError(f"no value for {name}: {hint}")


def _cases() -> dict[str, tuple[object, object]]:
    """SFTConfig field -> (value given, value SFTConfig must get), every field but :data:`NOT_EXPRESSIBLE`."""
    from trl import SFTConfig

    defaults = {f.name: f.default for f in __import__("dataclasses").fields(SFTConfig)}
    cases = {}
    for name, hint in sft_fields().items():
        if name in NOT_EXPRESSIBLE or name in ALONE:
            continue
        value = OWN[name] if name in OWN else (_value(name, hint, defaults[name]),) * 2
        cases[name] = value
    return cases


@pytest.fixture
def trackers(monkeypatch):
    """wandb counts as installed (report_to is checked against what is installed)."""
    monkeypatch.setattr(options_module, "available_trackers", lambda: ["tensorboard", "wandb", "trackio"])


def _config(train: TrainOptions) -> dict:
    return sft_config(train, evaluate=True, cuda=False, optim="adamw_torch",
                      precision={"use_cpu": True, "bf16": False, "fp16": False})


def _cli_text(value) -> list[str]:
    if isinstance(value, bool):
        return [str(value).lower()]
    if isinstance(value, list):
        return [str(v) for v in value]
    return [json.dumps(value)] if isinstance(value, dict) else [str(value)]


def _parse(argv: list[str]) -> argparse.Namespace:
    """``fastkit train ARGV`` parsed and resolved as the command does (nothing loaded)."""
    parser = argparse.ArgumentParser(prog="fastkit")
    cli_train.add_parser(parser.add_subparsers(dest="command"))
    return cli_train.resolved_args(parser.parse_args(["train", *argv]))


def test_every_sft_field_reaches_the_config_from_yaml_and_from_flags(trackers, tmp_path):
    import yaml

    cases = _cases()
    assert set(cases) | set(ALONE) | set(NOT_EXPRESSIBLE) == set(sft_fields())  # a new TRL field is tested too
    top = {k: v for k, (v, _) in cases.items() if k not in COLLIDES}
    file = tmp_path / "run.yaml"
    file.write_text(yaml.safe_dump({"model": "m", "data": "sample", "eval_split": 0.1, **top,
                                    "sft": {k: cases[k][0] for k in COLLIDES}}))
    argv = ["--model", "m", "--data", "sample", "--eval-split", "0.1"]
    for name, (value, _) in cases.items():
        if name in COLLIDES:
            argv += ["--sft", f"{name}={_cli_text(value)[0]}"]
        else:
            argv += [f"--{name.replace('_', '-')}", *_cli_text(value)]
    for where, args in (("yaml", _parse(["--config", str(file)])), ("flags", _parse(argv))):
        config = _config(args.train)
        wrong = {n: (config.get(n, "<missing>"), want) for n, (_, want) in cases.items()
                 if config.get(n) != want and n not in TRL_COMPILE}  # folded into TrainOptions.compile
        assert not wrong, (where, wrong)
    for name, (value, want) in ALONE.items():
        assert _config(_parse(["--model", "m", "--data", "sample", f"--{name}", str(value)]).train)[name] == want


@pytest.mark.parametrize("spellings", [
    (["--lora-alpha", "8"], ["--lora_alpha", "8"]),
    (["--max-grad-norm", "0.5"], ["--max_grad_norm", "0.5"], ["--sft", "max_grad_norm=0.5"]),
    (["--grad-accumulation", "2"], ["--gradient-accumulation-steps", "2"], ["--gradient_accumulation_steps", "2"]),
    (["--steps", "9"], ["--max-steps", "9"], ["--max_steps", "9"]),
    (["--lr", "1e-3"], ["--learning-rate", "0.001"], ["--learning_rate", "1e-3"], ["--sft", "learning_rate=1e-3"]),
    (["--epochs", "2"], ["--num-train-epochs", "2"], ["--num_train_epochs", "2.0"]),
    (["--warmup-ratio", "0.1"], ["--warmup_steps", "0.1"]),
    (["--4bit"], ["--load-in-4bit", "true"], ["--load_in_4bit"]),
])
def test_kebab_snake_and_old_flag_names_are_one_option(spellings):
    resolved = [_parse(["--model", "m", "--data", "sample", *argv]).resolved.to_dict() for argv in spellings]
    assert all(r == resolved[0] for r in resolved), resolved
    assert resolved[0] != _parse(["--model", "m", "--data", "sample"]).resolved.to_dict()  # the flag did something


def test_flags_override_the_file(tmp_path):
    file = tmp_path / "run.yaml"
    file.write_text("model: m\ndata: sample\nlearning_rate: 1e-3\nmax_steps: 10\nlora_r: 8\n"
                    "max_grad_norm: 0.3\nsft: {adam_beta1: 0.8, weight_decay: 0.1}\n")  # weight_decay: an option's name
    from_file = _parse(["--config", str(file)])
    assert (from_file.train.learning_rate, from_file.train.max_steps, from_file.lora.lora_r) == (1e-3, 10, 8)
    assert from_file.train.sft == {"max_grad_norm": 0.3, "adam_beta1": 0.8} and from_file.train.weight_decay == 0.1
    args = _parse(["--config", str(file), "--lr", "5e-4", "--epochs", "1", "--max-grad-norm", "0.7"])
    assert (args.train.learning_rate, args.train.epochs, args.train.max_steps) == (5e-4, 1, None)
    assert args.lora.lora_r == 8 and args.train.sft == {"max_grad_norm": 0.7, "adam_beta1": 0.8}


@pytest.fixture
def no_load(monkeypatch):
    from fastkit import FastModel

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the check")

    monkeypatch.setattr(FastModel, "from_pretrained", loaded)


def _refused(capsys, *argv: str) -> str:
    try:
        rc = cli.main(["train", *argv])
    except SystemExit as stop:  # argparse's own refusal of a flag
        rc = stop.code
    err = capsys.readouterr().err
    assert rc == 2 and "loaded before the check" not in err, (rc, err)
    return err


def test_typos_are_refused_before_the_model_loads(no_load, capsys, tmp_path):
    base = ["--model", "m", "--data", "sample", "--output-dir", str(tmp_path / "out")]
    file = tmp_path / "run.yaml"
    file.write_text("model: m\ndata: sample\nlora_alpah: 8\n")
    err = _refused(capsys, "--config", str(file))
    assert f"--config {file}: unknown option 'lora_alpah'; did you mean 'lora_alpha'?" in err, err
    file.write_text("model: m\ndata: sample\nsft: {max_grad_nrom: 1}\n")
    assert "'max_grad_nrom' is not a trl.SFTConfig field; did you mean 'max_grad_norm'?" in _refused(
        capsys, "--config", str(file))
    file.write_text("model: m\ndata: sample\nadam_beta1: fast\n")
    assert "adam_beta1='fast': trl.SFTConfig.adam_beta1 takes a float" in _refused(capsys, "--config", str(file))
    assert "did you mean 'max_grad_norm'" in _refused(capsys, *base, "--sft", "max_grad_nrom=1")
    assert "unrecognized arguments: --lora-alpah" in _refused(capsys, *base, "--lora-alpah", "8")
    assert "did you mean 'cosine'" in _refused(capsys, *base, "--lr-scheduler-type", "cosin")
    # a value only SFTConfig itself knows is wrong: built once in the preflight, before the load
    assert "adamw_troch is not a valid OptimizerNames" in _refused(capsys, *base, "--optim", "adamw_troch")
    with pytest.raises(FastkitError, match="did you mean 'warmup_steps'"):
        TrainOptions.from_kwargs(None, warmpu_steps=3)


def test_print_config_reproduces_the_run(tmp_path, capsys):
    """--print-config's YAML, read back with --config: the same resolved options; and on a twin the same trainer
    (run identity: data fingerprint + hyperparameters + adapter), its args carrying the pass-through values."""
    from fastkit.training.identity import run_identity

    argv = ["--model", "HuggingFaceTB/SmolLM2-135M-Instruct", "--twin", "--data", "sample?max_rows=6",
            "--steps", "2", "--max-seq-length", "128", "--lora-r", "4", "--lora-alpha", "8", "--use-rslora",
            "--checkpointing", "off", "--warmup-ratio", "0.5", "--max-grad-norm", "0.5", "--adam-beta2", "0.99",
            "--lr-scheduler-type", "cosine", "--output-dir", str(tmp_path / "run"), "--save-steps", "2"]
    assert cli.main(["train", *argv, "--print-config"]) == 0
    file = tmp_path / "printed.yaml"
    file.write_text(capsys.readouterr().out)
    flags, again = _parse(argv), _parse(["--config", str(file)])
    assert again.resolved.to_dict() == flags.resolved.to_dict()
    identities = []
    for args in (flags, again):
        model, _, trainer = cli_train.build(args, cli_train.preflight(args))
        identities.append(run_identity(trainer))
        assert (trainer.args.max_grad_norm, trainer.args.adam_beta2, trainer.args.warmup_steps) == (0.5, 0.99, 0.5)
        assert trainer.args.lr_scheduler_type == "cosine" and trainer.args.max_steps == 2
        adapter = model.peft_config["default"]
        assert (adapter.r, adapter.lora_alpha, adapter.use_rslora) == (4, 8, True)
    assert identities[0] == identities[1]
    assert identities[0]["hyperparameters"]["warmup_steps"] == 0.5 and len(identities[0]["data"]) == 24


def test_keywords_and_options_make_the_same_trainer(tmp_path):
    from fastkit import FastModel
    from fastkit.quickstart import quickstart_dataset
    from fastkit.training import make_trainer

    model, tok = FastModel.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct", max_seq_length=128, twin=True)
    model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False)
    rows = quickstart_dataset()[0].select(range(24))
    common = dict(max_seq_length=128, output_dir=str(tmp_path), dashboard="none")
    by_keywords = make_trainer(model, tok, rows, max_steps=3, learning_rate=1e-4, warmup_ratio=0.2,
                               eval_split=0.25, early_stopping_patience=2, max_grad_norm=0.5, **common)
    options = TrainOptions(max_steps=3, learning_rate=1e-4, warmup_steps=0.2, eval_split=0.25,
                           early_stopping_patience=2, sft={"max_grad_norm": 0.5}, **common)
    by_options = make_trainer(model, tok, rows, options=options)
    assert by_keywords.args.to_dict() == by_options.args.to_dict()
    assert by_options.args.metric_for_best_model == "eval_loss" and by_options.args.greater_is_better is False
    assert any(type(cb).__name__ == "EarlyStoppingCallback" for cb in by_options.callback_handler.callbacks)
    with pytest.raises(FastkitError, match="early_stopping_patience watches the eval loss"):
        make_trainer(model, tok, rows, options=options.replace(eval_split=0.0))


def test_lora_options_reach_get_peft_model():
    from fastkit import FastModel, LoraOptions

    model, _ = FastModel.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct", max_seq_length=64, twin=True)
    peft = FastModel.get_peft_model(model, options=LoraOptions(lora_r=4, lora_alpha=16, lora_dropout=0.1,
                                                                  target_modules=["q_proj", "v_proj"],
                                                                  use_rslora=True, checkpointing="off"))
    c = peft.peft_config["default"]
    assert (c.r, c.lora_alpha, c.lora_dropout, sorted(c.target_modules), c.use_rslora) == (
        4, 16, 0.1, ["q_proj", "v_proj"], True)
    with pytest.raises(FastkitError, match="lora_dropout must be"):
        LoraOptions(lora_dropout=1.5)


def test_file_values_written_as_text_are_read_as_numbers(tmp_path):
    """PyYAML reads 1e-4 as a string (YAML 1.1): a float option still gets the number."""
    options, sft = file_layer({"learning_rate": "1e-4", "adam_epsilon": "1e-6"}, "run.yaml")
    assert options == {"learning_rate": 1e-4} and sft == {"adam_epsilon": 1e-6}
    assert resolve({"model": "m", "data": "sample"}, None).train.max_steps == 60  # resolved, so the YAML says it


def test_config_data_paths_are_read_from_the_files_folder(tmp_path, monkeypatch):
    """``data: qa.csv`` in runs/a.yaml is runs/qa.csv wherever fastkit train starts (as a string, with a query,
    as a mapping, in a list); a path not beside the file (cwd, Hub id, offline name) stays as written."""
    import yaml

    runs, elsewhere = tmp_path / "runs", tmp_path / "elsewhere"
    (runs / "data").mkdir(parents=True)
    elsewhere.mkdir()
    (runs / "qa.csv").write_text("question,answer\nq,a\n")
    (runs / "data" / "chats.jsonl").write_text("{}\n")
    (elsewhere / "local.jsonl").write_text("{}\n")
    config = runs / "a.yaml"
    config.write_text(yaml.safe_dump({"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "data": [
        "qa.csv?columns=prompt:question,completion:answer&weight=2", {"path": "data/chats.jsonl", "weight": 1},
        "local.jsonl", "sample", "HuggingFaceH4/no_robots"]}))
    monkeypatch.chdir(elsewhere)
    data = _parse(["--config", str(config)]).resolved.run.data
    assert data == [f"{runs / 'qa.csv'}?columns=prompt:question,completion:answer&weight=2",
                    {"path": str(runs / "data" / "chats.jsonl"), "weight": 1},
                    "local.jsonl", "sample", "HuggingFaceH4/no_robots"]
    config.write_text(yaml.safe_dump({"data": "qa.csv"}))  # one source, and a relative --config path
    monkeypatch.chdir(tmp_path)
    assert _parse(["--config", "runs/a.yaml", "--model", "x"]).resolved.run.data == "runs/qa.csv"
    assert _parse(["--config", "runs/a.yaml", "--model", "x", "--data", "qa.csv"]).resolved.run.data == "qa.csv"
