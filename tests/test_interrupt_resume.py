"""Ctrl-C leaves a run that can be continued (issue 54, item 5): a KeyboardInterrupt during training writes
``checkpoint-<step>`` (adapter, optimizer, scheduler, RNG, run identity) even without ``save_steps``, the message says
so and how to continue (``fit(trainer, resume=True)``; the CLI: the command as typed with ``--resume``), and the
resumed run trains the remaining steps to the same losses as a run never interrupted."""

from __future__ import annotations

import logging
import shlex

import pytest
from transformers import TrainerCallback

from fastkit import FastModel, cli
from fastkit.quickstart import quickstart_dataset
from fastkit.training import fit, make_trainer


class _CtrlC(TrainerCallback):
    """Ctrl-C during the step after ``after`` optimizer steps (its forward), once."""

    def __init__(self, after: int):
        self.after, self.fired = after, False

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.after and not self.fired:
            self.fired = True
            raise KeyboardInterrupt


def _trainer(tokenizer, out, callbacks=()):
    model, _ = FastModel.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct", max_seq_length=128, twin=True)
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, lora_dropout=0.1)  # dropout: the RNG resumes too
    train, _ = quickstart_dataset()
    return make_trainer(model, tokenizer, train, max_steps=5, max_seq_length=128, batch_size=2, learning_rate=1e-3,
                        output_dir=str(out), save_steps=None, callbacks=list(callbacks))


def _losses(trainer) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def test_ctrl_c_writes_a_checkpoint_that_resume_continues(tmp_path, tokenizer, fastkit_log):
    full = _trainer(tokenizer, tmp_path / "full")
    fit(full, view="none")
    stopped = _trainer(tokenizer, tmp_path / "run", [_CtrlC(after=2)])
    m = fit(stopped, view="none")
    assert m.status == "interrupted" and m.step == 2
    assert (tmp_path / "run" / "checkpoint-2" / "optimizer.pt").is_file()
    assert (f"interrupted at step 2/5; checkpoint-2 written ({tmp_path / 'run' / 'checkpoint-2'}); continue with: "
            "fit(trainer, resume=True)") in fastkit_log.text
    resumed = _trainer(tokenizer, tmp_path / "run")
    m = fit(resumed, view="none", resume=True)
    assert m.status == "finished" and resumed.state.fastkit_run == "resumed from checkpoint-2"
    assert resumed.state.global_step == 5
    got, want = _losses(resumed), _losses(full)
    assert set(got) >= {3, 4, 5} and all(got[s] == pytest.approx(want[s], rel=1e-5) for s in (3, 4, 5)), (got, want)


def test_ctrl_c_before_the_first_step_says_there_is_nothing_to_continue(tmp_path, tokenizer, fastkit_log):
    m = fit(_trainer(tokenizer, tmp_path / "run", [_CtrlC(after=0)]), view="none")
    assert m.status == "interrupted" and not list((tmp_path / "run").glob("checkpoint-*"))
    assert "interrupted before the first step; nothing was trained" in fastkit_log.text


@pytest.mark.slow
def test_the_cli_says_how_to_continue_and_resume_does(tmp_path, monkeypatch, caplog):
    import fastkit.training

    real_fit = fastkit.training.fit

    def fit_with_ctrl_c(trainer, **kwargs):
        trainer.add_callback(_CtrlC(after=2))
        return real_fit(trainer, **kwargs)

    argv = ["train", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct", "--twin", "--data", "sample", "--steps", "4",
            "--max-seq-length", "128", "--lora-r", "4", "--output-dir", str(tmp_path / "run")]
    with monkeypatch.context() as m, caplog.at_level(logging.INFO, logger="fastkit"):
        m.setattr(fastkit.training, "fit", fit_with_ctrl_c)
        assert cli.main(argv) == 130
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert f"interrupted at step 2/4; checkpoint-2 written ({tmp_path / 'run' / 'checkpoint-2'}); continue with: " \
           f"fastkit {shlex.join(argv)} --resume" in said, said
    assert (tmp_path / "run" / "lora" / "adapter_model.safetensors").is_file()  # the adapters, as before
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fastkit"):
        assert cli.main([*argv, "--resume"]) == 0
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert "resumed from checkpoint-2" in said and "training finished at step 4/4" in said, said
