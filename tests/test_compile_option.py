"""``TrainOptions.compile`` (issue 56): off / regions / model through the one options system, TRL's torch_compile
folded into it, a compiled run's losses equal the eager run's, ``fastkit.revert`` uncompiles, and the dashboard shows
"compiling" and keeps compile time out of steps/s (a fake clock)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import TrainerControl, TrainerState

from fastkit import FastModel, revert
from fastkit.cli.config import resolve
from fastkit.dashboard import MetricsCallback
from fastkit.dashboard.render import progress_line, progress_text, stat_rows
from fastkit.errors import FastkitError
from fastkit.patches.layout import decoder_layers
from fastkit.quickstart import quickstart_dataset
from fastkit.training import TrainOptions, fit, make_trainer, sft_config
from tests.helpers import FakeClock

SMOL = "HuggingFaceTB/SmolLM2-135M-Instruct"
MOE = "Qwen/Qwen3-30B-A3B"
"""An MoE twin: fastkit's routing, PEFT's parameter LoRA on its experts, transformers' router-logit capture hooks."""
HYBRID = "lfm2"
"""A hybrid twin: short-conv layers (fastkit::per_document_mixer, packing/compiled_state.py) beside attention ones."""
BACKEND = {"torch_compile_backend": "aot_eager"}
"""dynamo + AOT autograd without code generation: what compile traces, at a test's cost (inductor generates C++)."""


# -- the option ---------------------------------------------------------------------------------------
def test_the_option_takes_three_values_and_names_them_when_wrong():
    assert TrainOptions().compile == "off"
    assert TrainOptions(compile="regions").compile == "regions"
    with pytest.raises(FastkitError, match="compile.*off.*regions.*model"):
        TrainOptions(compile="fast")


@pytest.mark.parametrize("sft, given, want", [({"torch_compile": True}, "off", "model"),
                                              ({"torch_compile_backend": "aot_eager"}, "off", "model"),
                                              ({"torch_compile_mode": "max-autotune"}, "off", "model"),
                                              ({"torch_compile": True}, "regions", "regions"),
                                              ({}, "regions", "regions")])
def test_trls_torch_compile_folds_into_the_option_and_never_reaches_sftconfig(sft, given, want):
    options = TrainOptions(compile=given, sft=sft)
    assert options.compile == want
    config = sft_config(options, evaluate=False, cuda=False, optim="adamw_torch", precision={})
    assert not {"torch_compile", "torch_compile_backend", "torch_compile_mode"} & config.keys()


def test_two_answers_to_one_question_are_refused():
    with pytest.raises(FastkitError, match="disagree"):
        TrainOptions(compile="regions", sft={"torch_compile": False})


def test_the_cli_flag_and_yaml_key(tmp_path, capsys):
    from fastkit import cli

    assert resolve({"model": "m", "data": "sample", "compile": "regions"}, None).train.compile == "regions"
    assert cli.main(["train", "--model", "m", "--data", "sample", "--compile", "model", "--print-config"]) == 0
    assert "compile: model" in capsys.readouterr().out
    with pytest.raises(SystemExit) as bad:
        cli.main(["train", "--model", "m", "--data", "sample", "--compile", "fast", "--print-config"])
    assert bad.value.code == 2 and "regions" in capsys.readouterr().err


# -- a compiled run -----------------------------------------------------------------------------------
def _run(tmp_path, compile: str, steps: int = 3, checkpointing: bool | str = True, model_id: str = SMOL):
    torch.manual_seed(0)
    model, tok = FastModel.from_pretrained(model_id, max_seq_length=128, twin=True)
    model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=checkpointing)  # on: as users train
    rows = quickstart_dataset()[0].select(range(24))
    trainer = make_trainer(model, tok, rows, max_steps=steps, output_dir=str(tmp_path), dashboard="none",
                           compile=compile, sft=BACKEND if compile != "off" else {})
    return trainer, fit(trainer, view="none")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["regions"])
def test_a_compiled_run_trains_like_the_eager_one_and_reverts(tmp_path, how):
    """Tolerance: aot_eager runs the same aten ops as eager in the same order (no fusion, no re-association), so
    the losses agree to fp32 rounding of a few ops (rtol 1e-5); a wrong graph (a lost LoRA path, a stale
    document layout) moves a loss by 1e-2 and more."""
    torch._dynamo.reset()
    _, eager = _run(tmp_path / "eager", "off")
    trainer, compiled = _run(tmp_path / how, how)
    assert compiled.status == "finished"
    want = [loss for _, loss in eager.loss_history]
    got = [loss for _, loss in compiled.loss_history]
    assert len(got) == 3
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    assert compiled.compiles >= 1 and compiled.compile_s > 0 and eager.compiles == 0
    targets = decoder_layers(trainer.model) if how == "regions" else [trainer.model]
    assert all(t._compiled_call_impl is not None for t in targets)
    revert(trainer.model)
    assert all(t._compiled_call_impl is None for t in targets)


@pytest.mark.slow
@pytest.mark.parametrize("model_id", [SMOL, MOE, HYBRID])
def test_regions_compile_below_the_checkpoint_without_a_break(tmp_path, model_id):
    """With checkpointing (a run as users train; fastkit's offload: the next test), each layer's checkpoint runs the
    compiled forward: no graph break (the checkpoint inside the graph broke on transformers' layer: the whole layer
    ran eager; on MoE, transformers' router and attention output-capture hooks broke it at every call, a ContextVar
    read), one trace serves every layer (the packed batch's attention count is a tensor, not a per-layer
    guard), at most four graphs (the packed forward and its recompute, which runs under the model's own attention
    key; each static, then with dynamic shapes), and the losses equal the eager run's. Tolerance as above."""
    from torch._dynamo.utils import counters

    from fastkit.training.compile import CompiledBelowCheckpoint

    torch._dynamo.reset()
    _, eager = _run(tmp_path / "eager", "off", steps=4, model_id=model_id)
    counters.clear()
    trainer, compiled = _run(tmp_path / "regions", "regions", steps=4, model_id=model_id)
    breaks = dict(counters["graph_break"])
    assert breaks == {}, list(breaks)[:3]
    # MoE: the forward captures the router logits for the aux loss, the recompute in backward does not (as eagerly:
    # the collector is the forward's only): one graph pair more. The hybrid: two kinds of layer (short conv,
    # attention), each traced on its own: up to twice the dense bound (measured 6)
    assert 1 <= counters["frames"]["ok"] <= {MOE: 6, HYBRID: 8}.get(model_id, 4), dict(counters["frames"])
    torch.testing.assert_close(torch.tensor([loss for _, loss in compiled.loss_history]),
                               torch.tensor([loss for _, loss in eager.loss_history]), rtol=1e-5, atol=1e-6)
    layers = decoder_layers(trainer.model)
    assert all(isinstance(layer._gradient_checkpointing_func, CompiledBelowCheckpoint) for layer in layers)
    note = f"each decoder layer ({len(layers)}), below its checkpoint"
    assert trainer.model.get_base_model().fastkit_compiled == note
    revert(trainer.model)
    assert not hasattr(trainer.model.get_base_model(), "fastkit_compiled")
    assert not any(isinstance(getattr(layer, "_gradient_checkpointing_func", None), CompiledBelowCheckpoint)
                   for layer in layers)
    assert all(layer._compiled_call_impl is None for layer in layers)


def test_offloaded_checkpointing_keeps_its_pipeline_under_regions():
    """fastkit's offloaded checkpoint (the CPU copy stream, copies throttled and their destinations poisoned first,
    as tests/test_offload.py runs it) around the compiled layers: the same loss and every LoRA gradient as eager
    plain checkpointing (aot_eager: the same kernels; tolerance as above), each layer input offloaded and
    prefetched one layer early as eagerly, and no graph break."""
    from torch._dynamo.utils import counters

    from fastkit.patches.offload import enable_offload, offload_controller
    from fastkit.training.compile import compile_model
    from tests.test_offload import LAYERS, base, build, cfg, train_steps

    torch._dynamo.reset()
    ref = train_steps(build(lora=True, dropout=0.0))
    model = build(lora=True, dropout=0.0)
    assert enable_offload(base(model), cfg(double_buffer=True)) == "double-buffer"
    assert compile_model(model, "regions", "aot_eager") == LAYERS
    counters.clear()
    got = train_steps(model)
    assert dict(counters["graph_break"]) == {} and counters["frames"]["ok"] >= 1
    for (l0, g0), (l1, g1) in zip(ref, got):
        torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
        assert g0.keys() == g1.keys() and len(g0) > 0
        for name in g0:
            torch.testing.assert_close(g1[name], g0[name], rtol=1e-5, atol=1e-6, msg=name)
    stats = offload_controller(model).stats
    assert stats.offloaded == 2 * (LAYERS - 1) and stats.prefetched > 0 and stats.device_transient == 0


def test_model_compiles_the_module_the_trainer_calls_once_and_reverts():
    """``model``: the PEFT wrapper the trainer calls is compiled (its call; nothing runs here), once however often
    it is asked; ``regions``: every decoder layer; revert puts each uncompiled call back."""
    from fastkit.training.compile import compile_model

    model, _ = FastModel.from_pretrained(SMOL, max_seq_length=64, twin=True)
    model = FastModel.get_peft_model(model, r=4)
    assert compile_model(model, "model", "aot_eager") == 1
    assert model.get_base_model().fastkit_compiled == "the whole model"  # the run summary's "torch.compile" line
    first = model._compiled_call_impl
    assert first is not None and compile_model(model, "model", "aot_eager") == 1 and model._compiled_call_impl is first
    assert compile_model(model, "regions", "aot_eager") == len(decoder_layers(model)) >= 2
    revert(model)
    assert model._compiled_call_impl is None
    assert all(layer._compiled_call_impl is None for layer in decoder_layers(model))
    assert compile_model(model, "off") == 0 and model._compiled_call_impl is None


# -- the dashboard ------------------------------------------------------------------------------------
def test_compile_time_is_shown_and_left_out_of_the_rates():
    """Each step 1 s; the first also compiles for 40 s (dynamo's start / end callbacks): steps/s stays 1.0."""
    clock = FakeClock(0.0)
    cb = MetricsCallback(warmup_steps=0, clock=clock)
    seen = []
    cb.add_listener(lambda event, m: seen.append((event, progress_line(m), progress_text(m))))
    args = SimpleNamespace(use_cpu=True, eval_strategy="no", eval_steps=None)
    state, control = TrainerState(max_steps=4, is_world_process_zero=True), TrainerControl()
    cb.on_train_begin(args, state, control, model=None)
    from torch._dynamo.callback import callback_handler

    for step in range(1, 5):
        cb.on_step_begin(args, state, control)
        if step == 1:
            callback_handler.run_start_callbacks(None)  # what dynamo calls around a compile
            clock.now += 40.0
            callback_handler.run_end_callbacks(None)
        clock.now += 1.0
        state.global_step, state.num_input_tokens_seen = step, 100 * step
        cb.on_step_end(args, state, control)
    cb.on_train_end(args, state, control)
    m = cb.metrics
    assert m.steps_per_s == pytest.approx(1.0) and m.tokens_per_s == pytest.approx(100.0)
    assert m.compile_s == pytest.approx(40.0) and m.compiles == 1 and not m.compiling
    assert m.elapsed_s == pytest.approx(44.0)
    compiling = [s for s in seen if s[0] == "compile"]
    assert len(compiling) == 1 and "| compiling |" in compiling[0][1] and "compiling ·" in compiling[0][2]
    assert stat_rows(m)["compile_time"].value == "0:40, 1 graph (not in steps/s, tokens/s)"
    assert cb._compile_started not in callback_handler.start_callbacks  # nothing left behind after the run
