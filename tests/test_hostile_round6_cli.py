"""Round-6 hostile matrix of the command-line surfaces (issue 53): the options file and flags (two spellings of one
option, file forms), streams (a fingerprint that tells files apart, drops counted in all), run folders holding the
user's files, ``fastkit bench data``'s arguments, several processes, and the leftovers of earlier rounds (a GGUF
write that comes up short, a safetensors file with trailing bytes, ``?weight=1e300``).

The rules (docs/usage.md "Options files" / "Streaming" / "Run folders", docs/sft.md): one option set twice in a file
or a command line, in any two spellings or forms, is refused naming both (the same flag repeated: the last wins);
``--config`` is one regular YAML file of at most 1 MiB; a stream's fingerprint is its files' sizes and first and
last 64 KiB (a moved file is the same data, another file is not); a run folder's README.md that fastkit did not write
is kept and the model card not written; a usage error is exit 2 everywhere.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fastkit.cli import main
from fastkit.errors import FastkitError

ROOT = Path(__file__).resolve().parents[1]
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


# -- one option, two spellings ---------------------------------------------------------------------------------
FILE_TWICE = [
    ("train", "max-grad-norm: 0.5\nmax_grad_norm: 0.7\n", "'max-grad-norm' and 'max_grad_norm' both set max_grad_norm"),
    ("train", "lr: 1e-4\nsft:\n  learning_rate: 2e-4\n", "'lr' and 'sft: learning_rate' both set learning_rate"),
    ("train", "epochs: 1\nnum_train_epochs: 2\n", "'epochs' and 'num_train_epochs' both set epochs"),
    ("train", "max_grad_norm: 0.5\nsft:\n  max_grad_norm: 0.7\n",
     "'max_grad_norm' and 'sft: max_grad_norm' both set max_grad_norm"),
    ("train", "num_train_epochs: 2\nsft:\n  num_train_epochs: 3\n",
     "'num_train_epochs' and 'sft: num_train_epochs' both set epochs"),
    ("train", "lora_r: 4\nlora-r: 8\n", "'lora_r' and 'lora-r' both set lora_r"),
    ("train", "steps: 2\nmax_steps: 3\n", "'steps' and 'max_steps' both set max_steps"),
    ("dpo", "max-grad-norm: 0.5\nmax_grad_norm: 0.7\n", "'max-grad-norm' and 'max_grad_norm' both set max_grad_norm"),
    ("dpo", "max_grad_norm: 0.5\ntrl:\n  max_grad_norm: 0.7\n",
     "'max_grad_norm' and 'trl: max_grad_norm' both set max_grad_norm"),
    ("kto", "epochs: 1\nnum_train_epochs: 2\n", "'epochs' and 'num_train_epochs' both set epochs"),
    ("grpo", "lr: 2e-4\nlearning-rate: 1e-4\n", "'lr' and 'learning-rate' both set learning_rate"),
]


def _config(tmp_path, command: str, body: str) -> Path:
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n' if command != "train" else '{"text": "hi"}\n')
    file = tmp_path / "run.yaml"
    file.write_text(f"model: m\ndata: {data}\n{body}")
    return file


@pytest.mark.parametrize("command, body, said", FILE_TWICE, ids=[f"{c}-{i}" for i, (c, _, _) in enumerate(FILE_TWICE)])
def test_one_option_twice_in_a_file_is_refused_naming_both(tmp_path, capsys, command, body, said):
    file = _config(tmp_path, command, body)
    assert main([command, "--config", str(file), "--print-config"]) == 2
    assert f"fastkit {command}: --config {file}: {said}: keep one of them." in capsys.readouterr().err


FLAGS_TWICE = [
    ("train", ["--lr", "1e-4", "--learning-rate", "2e-4"], "--lr and --learning-rate both set learning_rate"),
    ("train", ["--max-steps", "2", "--steps", "3"], "--max-steps and --steps both set max_steps"),
    ("train", ["--max-grad-norm", "0.5", "--max_grad_norm", "0.7"],
     "--max-grad-norm and --max_grad_norm both set max_grad_norm"),
    ("train", ["--lr", "2e-4", "--sft", "learning_rate=1e-4"],
     "--sft learning_rate=... and --learning-rate both set learning_rate"),
    ("train", ["--max-grad-norm", "0.5", "--sft", "max_grad_norm=0.7"],
     "--sft max_grad_norm=... and --max-grad-norm both set max_grad_norm"),
    ("dpo", ["--lr", "2e-4", "--trl", "learning_rate=1e-4"],
     "--trl learning_rate=... and --learning-rate both set learning_rate"),
    ("grpo", ["--num-generations", "2", "--num_generations", "4"],
     "--num-generations and --num_generations both set num_generations"),
]


@pytest.mark.parametrize("command, flags, said", FLAGS_TWICE, ids=[" ".join(f[::2]) for _, f, _ in FLAGS_TWICE])
def test_one_option_twice_on_the_command_line_is_refused(tmp_path, capsys, command, flags, said):
    data = _config(tmp_path, command, "").parent / "d.jsonl"
    try:
        rc = main([command, "--model", "m", "--data", str(data), *flags, "--print-config"])
    except SystemExit as stop:  # argparse's usage error
        rc = stop.code
    assert rc == 2 and said in capsys.readouterr().err


def test_the_same_flag_repeated_takes_the_last_and_config_twice_is_refused(tmp_path, capsys):
    file = _config(tmp_path, "train", "steps: 3\n")
    assert main(["train", "--config", str(file), "--steps", "2", "--steps", "5", "--print-config"]) == 0
    assert "max_steps: 5\n" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:
        main(["train", "--config", str(file), f"--config={file}", "--print-config"])
    assert stop.value.code == 2 and "--config given twice" in capsys.readouterr().err


def test_make_trainer_keywords_twice_are_refused():
    from fastkit.training.options import TrainOptions

    for kwargs, said in ((dict(epochs=1, num_train_epochs=2), "epochs= and num_train_epochs= both set epochs"),
                         (dict(max_grad_norm=0.5, sft={"max_grad_norm": 0.7}), "max_grad_norm= and sft['max_grad_n"),
                         (dict(sft={"max_grad_norm": 0.7}, max_grad_norm=0.5), "max_grad_norm= and sft['max_grad_n")):
        with pytest.raises(FastkitError, match=said.replace("[", r"\[")):
            TrainOptions.from_kwargs(**kwargs)


# -- the options file itself -----------------------------------------------------------------------------------
def _write(path: Path, content: str | bytes) -> Path:
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


@pytest.mark.parametrize("case, said", [
    ("missing", "no such file."),
    ("folder", "a folder; give the YAML file itself."),
    ("device", "not a regular file (a device, a pipe, ...)"),
    ("huge", "more than an options file holds (1,048,576 at most): is it the data file?"),
    ("latin-1", "not valid YAML ('utf-8' codec can't decode byte 0xe9"),
    ("list", "the file must hold a mapping of option names to values, got a list."),
    ("wrong-type", "steps must be"),
    ("null-model", "give --model (or model: in the --config file)."),
    ("unknown", "unknown option 'stepz' (TrainOptions, LoraOptions and trl.SFTConfig fields are known)"),
    ("alias", "uses the YAML alias *a"),
])
def test_options_file_forms_exit_2_naming_the_file(tmp_path, capsys, case, said):
    file = {"missing": lambda: tmp_path / "nope.yaml",
            "folder": lambda: tmp_path,
            "device": lambda: Path("/dev/null"),
            "huge": lambda: _write(tmp_path / "big.yaml", "# padding\n" * 120_000),
            "latin-1": lambda: _write(tmp_path / "l.yaml", b"model: caf\xe9\ndata: sample\n"),
            "list": lambda: _write(tmp_path / "l.yaml", "- model\n- data\n"),
            "wrong-type": lambda: _write(tmp_path / "w.yaml", "model: m\ndata: sample\nsteps: many\n"),
            "null-model": lambda: _write(tmp_path / "n.yaml", "model: null\ndata: sample\n"),
            "unknown": lambda: _write(tmp_path / "u.yaml", "model: m\ndata: sample\nstepz: 3\n"),
            "alias": lambda: _write(tmp_path / "a.yaml", "model: &a m\ndata: *a\n")}[case]()
    assert main(["train", "--config", str(file), "--print-config"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fastkit train: --config {file}") or "give --model" in err, err
    assert said in err, err


def test_options_file_empty_bom_and_data_beside_it(tmp_path, capsys, monkeypatch):
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "qa.jsonl").write_text('{"text": "hi"}\n')
    empty = _write(runs / "empty.yaml", "")
    assert main(["train", "--config", str(empty), "--model", "m", "--data", "sample", "--print-config"]) == 0
    capsys.readouterr()
    bom = _write(runs / "bom.yaml", b"\xef\xbb\xbfmodel: m\ndata: qa.jsonl\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # relative data is read beside the file, from any working directory
    assert main(["train", "--config", str(bom), "--print-config"]) == 0
    assert f"data: {runs / 'qa.jsonl'}\n" in capsys.readouterr().out


# -- streams: the fingerprint, the drops, the run folder's README -----------------------------------------------
def _chats(path: Path, n: int, word: str, bad_every: int = 0) -> str:
    rows = [{"messages": [{"role": "user", "content": f"{word} {i}"},
                          {"role": "assistant", "content": "" if bad_every and i % bad_every == 0 else f"a{i} " * 3}]}
            for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _stream(file: str):
    from fastkit.data import load_chat_dataset

    return load_chat_dataset(file, streaming=True)


def test_a_streams_fingerprint_tells_files_apart_without_reading_them_all(tmp_path):
    from fastkit.data.stream import FINGERPRINT_BYTES
    from fastkit.training.identity import _data_key, data_fingerprint

    a = _chats(tmp_path / "a.jsonl", 3000, "q")
    key = _data_key(data_fingerprint(_stream(a)))
    assert os.path.getsize(a) > 2 * FINGERPRINT_BYTES  # the middle of the file is not read
    moved = tmp_path / "moved.jsonl"
    moved.write_bytes(Path(a).read_bytes())
    assert _data_key(data_fingerprint(_stream(str(moved)))) == key  # where the file lies is not the data
    assert f"of {a} (" in data_fingerprint(_stream(a))
    other = _chats(tmp_path / "b.jsonl", 3000, "other")
    assert _data_key(data_fingerprint(_stream(other))) != key
    with open(moved, "a") as f:  # rows appended: its size and end differ
        f.write(json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]})
                + "\n")
    assert _data_key(data_fingerprint(_stream(str(moved)))) != key
    from datasets import IterableDataset

    def rows(word):
        return IterableDataset.from_generator(lambda: ({"text": f"{word} {i}"} for i in range(50)))
    assert data_fingerprint(rows("x")) == data_fingerprint(rows("x")) != data_fingerprint(rows("y"))
    assert "its first 16 rows" in data_fingerprint(rows("x"))


def test_a_mixed_streams_fingerprint_reads_every_source(tmp_path):
    from fastkit.data import load_sources
    from fastkit.data.stream import source_files

    a, b = _chats(tmp_path / "a.jsonl", 20, "q"), _chats(tmp_path / "b.jsonl", 20, "r")
    assert set(source_files(load_sources([a, b], streaming=True))) == {a, b}


TWIN = ["--model", MODEL, "--twin", "--max-seq-length", "256", "--lora-r", "4", "--streaming", "--save-steps", "1"]


@pytest.mark.slow
def test_streaming_resume_on_other_data_drops_counted_and_the_users_readme_kept(tmp_path, capsys, caplog):
    """One run: a stream with untrainable rows (--drop-invalid) into a folder holding the user's README.md; then
    --resume --extend on another file is refused naming both files; the user's README.md never changed."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "README.md").write_text("# my notes\n")
    bad = _chats(tmp_path / "b.jsonl", 300, "q", bad_every=7)
    with caplog.at_level(logging.INFO, logger="fastkit"):
        rc = main(["train", *TWIN, "--data", bad, "--drop-invalid", "--steps", "2", "--output-dir", str(out)])
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert rc == 0, text
    assert "train_dataset: 43 row(s) of the stream dropped in all (drop_invalid / drop_long" in text, text
    assert f"{out / 'README.md'} is not a model card fastkit wrote: kept as it is" in text
    assert (out / "README.md").read_text() == "# my notes\n"
    dropped = json.loads((out / "checkpoint-2" / "fastkit_run.json").read_text())["stream_dropped"]
    assert dropped["rows"] == 43 and dropped["drops"] >= 43, dropped  # the run record says it too
    other = _chats(tmp_path / "a.jsonl", 300, "other")
    rc = main(["train", *TWIN, "--data", other, "--steps", "3", "--resume", "--extend", "--output-dir", str(out)])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert f"training data: the checkpoint trained on {bad} (" in err and f"this run streams {other} (" in err, err
    assert (out / "README.md").read_text() == "# my notes\n"


def test_a_model_card_fastkit_wrote_is_replaced_anything_else_kept(tmp_path, caplog):
    from types import SimpleNamespace

    from fastkit.training.card import CARD_LINE, CARD_MARKER, ModelCardMixin
    from fastkit.training.record import RunRecord

    writes = []

    class Trl:
        def create_model_card(self, *args, **kwargs):  # TRL's: writes output_dir/README.md
            writes.append(1)
            (tmp_path / "README.md").write_text(f"# card\n{CARD_LINE}[None] trained on x.\n")

    class Trainer(ModelCardMixin, Trl):  # fastkit's trainers: the card's sentence as a method override
        pass

    config = SimpleNamespace(_name_or_path="HuggingFaceTB/SmolLM2-135M-Instruct")
    trainer = Trainer()
    trainer.args, trainer.model = SimpleNamespace(output_dir=str(tmp_path)), SimpleNamespace(config=config)
    trainer.run_record = RunRecord(data="data.jsonl")
    trainer.create_model_card()  # no README: written, with the marker
    first = (tmp_path / "README.md").read_text()
    assert first.endswith(CARD_MARKER + "\n") and "trained on `data.jsonl` with fastkit." in first
    trainer.create_model_card()  # fastkit's own: replaced (one marker)
    assert len(writes) == 2 and (tmp_path / "README.md").read_text().count(CARD_MARKER) == 1
    for users in ("# mine\n", f"# TRL's card\n{CARD_LINE}[x](y) trained on z.\n", ""):
        (tmp_path / "README.md").write_text(users)
        with caplog.at_level(logging.WARNING, logger="fastkit"):
            trainer.create_model_card()
        assert (tmp_path / "README.md").read_text() == users and len(writes) == 2
    assert "is not a model card fastkit wrote: kept as it is" in caplog.text


# -- fastkit bench data -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, said", [
    (["--rows", "0"], "argument --rows: 0 is not a positive whole number"),
    (["--rows", "-5"], "argument --rows: -5 is not a positive whole number"),
    (["--rows", "1e3"], "argument --rows: '1e3' is not a whole number"),
    (["--repeats", "0"], "argument --repeats/--reps: 0 is not a positive whole number"),
    (["--budget-s", "nan"], "argument --budget-s: nan is not a positive number"),
    (["--with-results", "/no/such.jsonl"], "argument --with-results: /no/such.jsonl: no such file"),
    (["--with-results", "/dev"], "argument --with-results: /dev: not a file"),
    (["--with-results", "{foreign}"], "line 1 is not a result of this bench"),
    (["--with-results", "{broken}"], "line 1 is not valid JSON"),
    (["--variants", "nosuch"], "argument --variants: invalid choice: 'nosuch'"),
    ([], "--out is required for a full run"),
])
def test_bench_data_usage_errors_exit_2(tmp_path, capsys, args, said):
    foreign = _write(tmp_path / "f.jsonl", '{"a": 1}\n')
    broken = _write(tmp_path / "g.jsonl", '{"variant": \n')
    args = [a.format(foreign=foreign, broken=broken) for a in args]
    out = [] if not args else ["--out", str(tmp_path / "o")]
    with pytest.raises(SystemExit) as stop:
        main(["bench", "data", *args, *out])
    assert stop.value.code == 2 and said in capsys.readouterr().err


@pytest.mark.parametrize("bench, flag", [("moe", "--tokens"), ("moe", "--rank"), ("moe", "--threads"),
                                         ("moe", "--batched-gib"), ("offload", "--layers"), ("offload", "--seq"),
                                         ("packed", "--layers"), ("packed", "--tokens"), ("packed", "--mean-doc"),
                                         ("sft", "--steps"), ("sft", "--max-len"), ("sft", "--docs"), ("sft", "--r"),
                                         ("sft", "--logging-steps")])
def test_every_benchs_counts_below_one_are_usage_errors(capsys, bench, flag):
    from benchmarks.common import parse_only

    for value in ("0", "-3"):
        with pytest.raises(SystemExit) as stop:
            parse_only(bench, [flag, value, "--quick"])
        assert stop.value.code == 2 and f"argument {flag}" in capsys.readouterr().err
    parse_only(bench, [flag, "2", "--quick"])


# -- several processes ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_two_processes_refuse_kto_rows_with_both_column_sets_once(tmp_path):
    data = _write(tmp_path / "both.jsonl", '{"prompt": "Hi", "completion": "a", "label": true, "chosen": "x", '
                                           '"rejected": "y"}\n')
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
               TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "fastkit", "kto", "--model", MODEL, "--twin", "--data", str(data), "--output-dir",
                           str(tmp_path / "out")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "exitcode  : 2" in output, output[-3000:]
    assert output.count("holds both preference pairs (columns 'chosen', 'rejected') and unpaired rows") == 1, \
        output[-3000:]


# -- leftovers of earlier rounds --------------------------------------------------------------------------------
@pytest.mark.parametrize("weight, said", [("1e300", "weight=1e+300 would use each row 1e+300 times; the most is "
                                                    "10,000"),
                                          ("1e309", "weight must be a positive number"),
                                          ("10001", "weight=10001 would use each row 10001 times")])
def test_a_huge_source_weight_is_refused_naming_the_source(weight, said):
    from fastkit.data.sources import DataSource

    with pytest.raises(FastkitError, match=re.escape(f"data source 'qa.jsonl': {said}")):
        DataSource.parse(f"qa.jsonl?weight={weight}")


def test_a_safetensors_file_with_trailing_bytes_is_named(tmp_path):
    import torch
    from safetensors.torch import save_file

    from fastkit.checks import check_safetensors_files
    from fastkit.export.adapter_checks import _header

    file = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(4)}, str(file))
    check_safetensors_files(str(tmp_path))
    with open(file, "ab") as f:
        f.write(b"junk!")
    with pytest.raises(FastkitError, match=rf"Weights file {file} has 5 bytes after its last tensor"):
        check_safetensors_files(str(tmp_path))
    with pytest.raises(FastkitError, match=rf"Adapter file {file} has 5 bytes after its last tensor"):
        _header(file)


def test_a_gguf_write_that_comes_up_short_is_a_full_disk(tmp_path, monkeypatch):
    import gguf

    from fastkit import FastModel
    from fastkit.export import save_gguf

    def short(*args, **kwargs):  # numpy's tofile on a full disk: no errno
        raise OSError("8192 requested and 5184 written")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", short)
    model, tok = FastModel.from_pretrained(MODEL, twin=True, max_seq_length=64)
    said = (r"The disk is full: writing SmolLM2-135M-Instruct-f16\.gguf stopped \(a short write: 8192 requested and "
            r"5184 written\); it needs [\d,]+ bytes, [\d,]+ bytes free")
    with pytest.raises(FastkitError, match=said):
        save_gguf(model, tok, tmp_path / "gguf", quantization="f16", verify=False)
    assert not [p for p in tmp_path.rglob("*.gguf")]
