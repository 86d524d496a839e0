"""The front door (issue 30): what a new user runs first works on a bare install, on multi-turn chats.

- The terminal entry points (``fastkit train`` with ``--gguf``, ``fastkit quickstart``, ``fastkit plan``, the
  public imports) run in a subprocess where IPython, ipywidgets, matplotlib and Jupyter are not installed
  (``tests/bare/sitecustomize.py`` hides them, exactly as an environment that never had them).
- ``check_dataset`` accepts its own output; multi-turn chats in no_robots' schema (the shipped sample) train
  with a mask on every assistant turn, and the trainer trains exactly the tokens ``preview_masks`` shows.
- ``fastkit train`` refuses bad input before the model loads, in the CLI's own words (flags, not kwargs);
  Ctrl-C exits 130 with the adapters saved; ``--resume --extend`` continues a finished run.
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

from fastkit import cli
from fastkit.quickstart import NO_ROBOTS_SAMPLE

ROOT = Path(__file__).resolve().parents[1]
BARE = ROOT / "tests" / "bare"
TWIN = ["--model", "HuggingFaceTB/SmolLM2-135M-Instruct", "--twin", "--max-seq-length", "256", "--lora-r", "4",
        "--checkpointing", "off"]
HEAD = re.compile(r"row (\d+): (\d+) of (\d+) tokens trained")


def _bare(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    """``python *argv`` with the notebook stack hidden (tests/bare first on PYTHONPATH), offline."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(BARE), str(ROOT)]), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def test_the_blocker_hides_the_notebook_stack(tmp_path):
    code = ("import importlib.util\n"
            "for name in ('IPython', 'ipywidgets', 'matplotlib', 'jupyter_client', 'ipykernel', 'nbformat'):\n"
            "    assert importlib.util.find_spec(name) is None, name\n"
            "    try:\n"
            "        __import__(name)\n"
            "    except ModuleNotFoundError:\n"
            "        continue\n"
            "    raise SystemExit(name + ' imported')\n"
            "import torch, transformers, trl, datasets  # everything else is still there\n"
            "print('hidden')")
    done = _bare("-c", code, cwd=tmp_path)
    assert done.returncode == 0 and "hidden" in done.stdout, done.stderr[-2000:]


@pytest.mark.slow
def test_terminal_entry_points_run_without_ipython_widgets_matplotlib_jupyter(tmp_path):
    from fastkit.families.twins import twin_config

    imports = _bare("-c", "import fastkit, fastkit.cli, fastkit.data, fastkit.export, fastkit.plan, "
                    "fastkit.training, fastkit.quickstart, fastkit.dashboard", cwd=tmp_path)
    assert imports.returncode == 0, imports.stderr[-2000:]
    train = _bare("-m", "fastkit", "train", *TWIN, "--data", "sample", "--steps", "2", "--save-steps", "2",
                  "--output-dir", str(tmp_path / "run"), "--gguf", "q8_0", cwd=tmp_path)
    assert train.returncode == 0, train.stderr[-3000:]
    assert "training finished at step 2/2" in train.stderr
    assert any((tmp_path / "run" / "gguf").glob("*.gguf")) and (tmp_path / "run" / "lora").is_dir()
    # one progress display: no datasets / TRL bars, no gguf-py temp paths
    assert "examples/s" not in train.stderr and ".gguf.partial" not in train.stderr, train.stderr[-3000:]
    quick = _bare("-m", "fastkit", "quickstart", "--twin", "--steps", "1", "--output-dir", str(tmp_path / "qs"),
                  cwd=tmp_path)
    assert quick.returncode == 0, quick.stderr[-3000:]
    assert (tmp_path / "qs" / "lora" / "adapter_model.safetensors").is_file()
    twin_config("llama").save_pretrained(tmp_path / "llama")
    plan = _bare("-m", "fastkit", "plan", str(tmp_path / "llama"), "--gpu", "t4", cwd=tmp_path)
    assert plan.returncode == 0 and "GiB" in plan.stdout, plan.stdout[-2000:] + plan.stderr[-2000:]


def test_upstream_progress_bars_are_off_unless_asked(tmp_path):
    code = ("import datasets\nfrom fastkit.data import check_dataset\n"
            "from fastkit.families.twins import twin_tokenizer\n"
            "check_dataset([{'text': 'hi'}], twin_tokenizer(), 64)\n"
            "print(datasets.is_progress_bar_enabled())")
    env = {k: v for k, v in os.environ.items() if k != "HF_DATASETS_DISABLE_PROGRESS_BARS"}
    quiet = subprocess.run([sys.executable, "-c", code], env=dict(env, PYTHONPATH=str(ROOT)), capture_output=True,
                           text=True, timeout=300)
    shown = subprocess.run([sys.executable, "-c", code], env=dict(env, FASTKIT_SHOW_UPSTREAM_WARNINGS="1",
                           PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=300)
    assert quiet.stdout.split()[-1] == "False", quiet.stderr[-2000:]
    assert shown.stdout.split()[-1] == "True", shown.stderr[-2000:]


# -- data: idempotent, multi-turn, masks -----------------------------------------------------------------
def _sample():
    from fastkit.data import load_chat_dataset

    return load_chat_dataset(NO_ROBOTS_SAMPLE)


def test_sample_has_no_robots_schema_with_multi_turn_rows():
    rows = [json.loads(line) for line in NO_ROBOTS_SAMPLE.read_text().splitlines()]
    assert all(set(r) == {"prompt", "prompt_id", "messages", "category"} for r in rows)
    assert all(r["prompt"] == next(m["content"] for m in r["messages"] if m["role"] == "user") for r in rows)
    assert all(len(r["prompt_id"]) == 64 and all(set(m) == {"content", "role"} for m in r["messages"]) for r in rows)
    turns = [sum(m["role"] == "assistant" for m in r["messages"]) for r in rows]
    assert sum(t >= 2 for t in turns) >= 4 and max(turns) >= 3
    assert any(r["messages"][0]["role"] == "system" and turns[i] >= 2 for i, r in enumerate(rows))


def test_check_dataset_accepts_its_own_output(tokenizer):
    from fastkit.data import check_dataset

    multi = check_dataset(_sample(), tokenizer, 512)
    assert multi.column_names == ["input_ids", "completion_mask"]
    again = check_dataset(multi, tokenizer, 512)
    assert again[:] == multi[:]
    single = check_dataset(_sample().select([0, 1, 3]), tokenizer, 512)  # one answer each: prompt/completion
    assert {"prompt", "completion"} <= set(single.column_names) and not isinstance(single[0]["prompt"], str)
    assert check_dataset(single, tokenizer, 512)[:] == single[:]


def test_every_assistant_turn_is_trained_and_nothing_else(tokenizer):
    from fastkit.data import check_dataset, preview_masks

    rows = _sample()
    checked = check_dataset(rows, tokenizer, 512)
    for i, row in enumerate(rows):
        ids, mask = checked[i]["input_ids"], checked[i]["completion_mask"]
        trained = tokenizer.decode([t for t, b in zip(ids, mask) if b])
        answers = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        assert trained == "".join(f"{a}<|im_end|>\n" for a in answers), (i, trained)
    # preview_masks counts, row by row, what check_dataset will train (raw chats and checked rows alike)
    raw = [m.groups() for m in HEAD.finditer(preview_masks(rows, tokenizer, n=len(rows)))]
    assert [(str(i), str(sum(r["completion_mask"])), str(len(r["input_ids"]))) for i, r in enumerate(checked)] == raw


def test_tool_messages_train_only_the_assistant_turns(tokenizer):
    from fastkit.data import check_dataset

    chat = [{"role": "system", "content": "You can call tools."}, {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "Calling weather(Oslo)."}, {"role": "tool", "content": "4 C, rain"},
            {"role": "assistant", "content": "It is 4 C and raining."}]
    out = check_dataset([{"messages": chat}] * 2, tokenizer, 512)
    trained = tokenizer.decode([t for t, b in zip(out[0]["input_ids"], out[0]["completion_mask"]) if b])
    assert trained == "Calling weather(Oslo).<|im_end|>\nIt is 4 C and raining.<|im_end|>\n"


@pytest.mark.slow
def test_trainer_trains_the_tokens_preview_masks_counts(tmp_path):
    """make_trainer on check_dataset's output (what the CLI and the notebooks pass): after TRL's label and packing
    passes, the trained tokens are exactly the sum of preview_masks' per-row counts."""
    from fastkit import FastModel
    from fastkit.data import check_dataset, preview_masks
    from fastkit.training import make_trainer

    model, tok = FastModel.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct", twin=True, max_seq_length=256)
    model = FastModel.get_peft_model(model, r=4, lora_alpha=4, use_gradient_checkpointing=False)
    rows = _sample()
    trainer = make_trainer(model, tok, check_dataset(rows, tok, 256), max_steps=1, max_seq_length=256,
                           output_dir=str(tmp_path), dashboard="none")
    counts = [int(m.group(2)) for m in HEAD.finditer(preview_masks(rows, tok, n=len(rows)))]
    packed = trainer.train_dataset  # TRL's packed rows: labels -100 where nothing is trained
    trained = sum(sum(label != -100 for label in row) for row in packed["labels"])
    assert len(counts) == len(rows) and trained == sum(counts)
    assert sorted(n for r in packed["seq_lengths"] for n in r) == sorted(
        int(m.group(3)) for m in HEAD.finditer(preview_masks(rows, tok, n=len(rows))))


# -- the CLI: checks before the load, flags in messages, Ctrl-C, --extend --------------------------------------
@pytest.fixture
def no_load(monkeypatch):
    """FastModel.from_pretrained raises: a check that ran after it would show as this error, not its own."""
    from fastkit import FastModel

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the check")

    monkeypatch.setattr(FastModel, "from_pretrained", loaded)


def _train_fails(capsys, *argv: str) -> str:
    rc = cli.main(["train", *argv])
    err = capsys.readouterr().err
    assert rc == 2, (rc, err)
    assert "loaded before the check" not in err and err.startswith("fastkit train: "), err
    return err


def test_bad_input_is_refused_before_the_model_loads(no_load, capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("fastkit.plan.source.hub_unanswered", lambda: None)  # the Hub answers: the data speaks first
    base = ["--model", "Qwen/Qwen3-14B", "--output-dir", str(tmp_path / "out")]
    err = _train_fails(capsys, *base, "--data", str(tmp_path / "missing.jsonl"))
    assert "missing.jsonl" in err
    (tmp_path / "bad.jsonl").write_text('{"question": "2+2?", "answer": "4"}\n')
    assert "'answer', 'question'" in _train_fails(capsys, *base, "--data", str(tmp_path / "bad.jsonl"))
    with pytest.raises(SystemExit) as stop:  # --gguf takes the one quantization list as argparse choices
        cli.main(["train", *base, "--data", "sample", "--gguf", "q3_x"])
    assert stop.value.code == 2 and "--gguf: invalid choice: 'q3_x'" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    err = _train_fails(capsys, "--model", "m", "--data", "sample", "--output-dir", str(tmp_path / "file"))
    assert "--output-dir=" in err and "existing file" in err
    err = _train_fails(capsys, *base, "--data", "sample", "--resume")
    assert "--resume: no checkpoint-N folder" in err and "drop --resume" in err
    assert "with --resume" in _train_fails(capsys, *base, "--data", "sample", "--extend")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"base_model_name_or_path": "Qwen/Qwen3-0.6B"}')
    err = _train_fails(capsys, "--model", str(adapter), "--data", "sample")
    assert "LoRA adapter folder" in err and "(Qwen/Qwen3-0.6B)" in err


@pytest.mark.parametrize("flag, value", [("--lr", "inf"), ("--lr", "nan"), ("--eval-split", "1.5"),
                                         ("--eval-split", "1.0"), ("--eval-split", "-0.1"), ("--eval-split", "-3")])
def test_options_out_of_range_are_refused_by_the_parser(no_load, capsys, flag, value):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["train", "--model", "m", "--data", "sample", flag, value])
    assert exit_.value.code == 2 and f"argument {flag}" in capsys.readouterr().err


def test_messages_name_cli_flags_not_python_kwargs():
    from fastkit.cli.train import flag_words

    said = flag_words("resume=True: checkpoint-3 is from a different run. Pass resume=False for a new run, or a "
                      "different output_dir; max_steps=5, learning_rate, max_seq_length=128, gpu=24, --epochs")
    assert said == ("--resume: checkpoint-3 is from a different run. Drop --resume for a new run, or a different "
                    "--output-dir; --steps 5, --lr, --max-seq-length 128, --gpu 24, --epochs")


def test_the_coverage_line_keeps_its_epoch_count_in_words():
    """'1.00 epochs over 20 examples' counts passes: it is not the --epochs option (it read '1.00 --epochs over')."""
    from fastkit.cli.train import flag_words

    line = "One run: 3 steps × 1 packed row = 3 of 3 rows: 1.00 epochs over 20 examples."
    assert flag_words(line) == line
    assert flag_words("More steps (max_steps) or epochs see more.") == "More steps (--steps) or --epochs see more."


def test_model_card_names_the_base_model_and_the_data(tmp_path):
    from fastkit.training.card import model_card_sentence

    (tmp_path / "chats.jsonl").write_text("{}")
    assert model_card_sentence("Qwen/Qwen3-0.6B", "HuggingFaceH4/no_robots") == (
        "This model is a fine-tuned version of [Qwen/Qwen3-0.6B](https://huggingface.co/Qwen/Qwen3-0.6B), trained on "
        "[HuggingFaceH4/no_robots](https://huggingface.co/datasets/HuggingFaceH4/no_robots) with fastkit.")
    local = model_card_sentence(str(tmp_path), str(tmp_path / "chats.jsonl"))
    assert f"`{tmp_path}`" in local and f"`{tmp_path / 'chats.jsonl'}`" in local and "None" not in local


def test_run_folder_model_card_is_rewritten_after_trl_writes_it(tmp_path):
    from types import SimpleNamespace

    import torch

    from fastkit.training.card import ModelCardMixin
    from fastkit.training.record import RunRecord

    class Trl:
        def create_model_card(self, model_name=None):  # what TRL 1.16 writes for a model loaded from a folder
            (tmp_path / "README.md").write_text("# Model Card\n\nThis model is a fine-tuned version of "
                                                "[None](https://huggingface.co/None).\n\n## Quick start\n")

    class Trainer(ModelCardMixin, Trl):  # fastkit's trainers: the card's sentence as a method override
        pass

    model = torch.nn.Linear(1, 1)
    model.config = SimpleNamespace(_name_or_path=str(tmp_path / "SmolLM2"))
    trainer = Trainer()
    trainer.args, trainer.model = SimpleNamespace(output_dir=str(tmp_path)), model
    trainer.run_record = RunRecord(data="HuggingFaceH4/no_robots")
    trainer.create_model_card(model_name="run")
    card = (tmp_path / "README.md").read_text()
    assert "[None]" not in card and f"`{tmp_path / 'SmolLM2'}`" in card and "## Quick start" in card
    assert "[HuggingFaceH4/no_robots](https://huggingface.co/datasets/HuggingFaceH4/no_robots)" in card


def test_twin_of_a_local_config_folder(tmp_path):
    from fastkit import FastModel
    from fastkit.families.twins import twin_config

    twin_config("qwen3").save_pretrained(tmp_path / "qwen3-local")
    model, _ = FastModel.from_pretrained(str(tmp_path / "qwen3-local"), twin=True, max_seq_length=128)
    assert model.config.model_type == "qwen3"


@pytest.mark.slow
def test_ctrl_c_exits_130_with_the_adapters_saved(monkeypatch, tmp_path, capsys):
    from transformers import TrainerCallback

    import fastkit.training

    real_fit = fastkit.training.fit

    class Interrupt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            raise KeyboardInterrupt

    def fit(trainer, **kwargs):
        trainer.add_callback(Interrupt())
        return real_fit(trainer, **kwargs)

    monkeypatch.setattr(fastkit.training, "fit", fit)
    rc = cli.main(["train", *TWIN, "--data", "sample", "--steps", "5", "--output-dir", str(tmp_path)])
    assert rc == 130
    assert (tmp_path / "lora" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_resume_extend_continues_a_finished_run(tmp_path, caplog, capsys):
    run = [*TWIN, "--data", "sample", "--save-steps", "2", "--output-dir", str(tmp_path)]
    assert cli.main(["train", *run, "--steps", "2"]) == 0
    assert cli.main(["train", *run, "--steps", "2", "--resume"]) == 2
    assert "ends a finished run" in capsys.readouterr().err  # before the model loads
    with caplog.at_level(logging.INFO, logger="fastkit"):
        assert cli.main(["train", *run, "--steps", "4", "--resume", "--extend"]) == 0
    assert "continued from checkpoint-2, schedule extended to 4 steps" in caplog.text
    state = json.loads((tmp_path / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["global_step"] == 4 and state["max_steps"] == 4
    assert [h["step"] for h in state["log_history"] if "loss" in h] == [1, 2, 3, 4]  # the old steps kept
    # the old 2-step schedule's rates, then the 4-step one's at steps 3-4 (linear from --lr 2e-4, no warmup: issue 41)
    lrs = [h["learning_rate"] for h in state["log_history"] if "loss" in h]
    assert lrs == pytest.approx([2e-4, 1e-4, 1e-4, 5e-5], rel=1e-6)
    import torch  # AdamW's own step count: 4 only if the optimizer state of steps 1-2 carried over

    optimizer = torch.load(tmp_path / "checkpoint-4" / "optimizer.pt", weights_only=False)
    assert {float(s["step"]) for s in optimizer["state"].values()} == {4.0}
    card = (tmp_path / "README.md").read_text()
    assert "[None]" not in card and f"trained on `{NO_ROBOTS_SAMPLE}`" in card, card


def test_progress_lines_show_their_own_steps_loss_and_lr(caplog):
    """The terminal line of step N carries step N's loss and learning rate (not step N-1's: the Trainer calls the
    step-end callbacks before it logs), so the last line and the summary agree."""
    from types import SimpleNamespace

    from transformers import TrainerControl, TrainerState

    from fastkit.dashboard import MetricsCallback
    from fastkit.dashboard.views import TerminalView
    from tests.helpers import FakeClock

    clock = FakeClock(10.0)
    cb = MetricsCallback(warmup_steps=1, clock=clock)
    cb.add_listener(TerminalView(every_s=0.0))
    args, control = SimpleNamespace(use_cpu=True), TrainerControl()
    state = TrainerState(max_steps=4, is_world_process_zero=True)
    with caplog.at_level(logging.INFO, logger="fastkit"):
        cb.on_train_begin(args, state, control, model=None)
        for step in range(1, 5):
            clock.now += 1.0
            state.global_step = step
            cb.on_step_end(args, state, control)
            cb.on_log(args, state, control, logs={"loss": 2.0 / step, "learning_rate": 1e-3 / step})
        cb.on_train_end(args, state, control)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("fastkit: step ")]
    for line in lines:
        step = int(line.split()[2].split("/")[0])
        if step > 1:
            assert f"loss {2.0 / step:.4f}" in line and f"lr {1e-3 / step:.2e}" in line, line
    assert lines[-1].startswith("fastkit: step 4/4")
    summary = next(r.getMessage() for r in caplog.records if "Learning rate" in r.getMessage())
    assert f"{1e-3 / 4:.2e}" in summary
