"""DPO and GRPO with TRL's own trainers on fastkit's model: packed DPO pairs exact against padded, the reference
from the adapter disabled (no copy), data refused at the door, RL metrics on the dashboard."""

import pytest
import torch

from fastkit import FastkitError, FastModel, SyncCounter, fit
from fastkit.patches.packing import attention as packing_kernels
from fastkit.quickstart.rl_data import math_dataset, preference_dataset, preference_records
from fastkit.training import dpo
from fastkit.training.preference import make_dpo_trainer, make_grpo_trainer
from fastkit.training.rewards import exact_answer, format_reward

SMOL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _lora(name=SMOL, checkpointing=False):
    model, tok = FastModel.from_pretrained(name, max_seq_length=256, twin=True)
    return FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=checkpointing), tok


def _pairs():
    """Three pairs of mixed lengths: prompts of 1-9 words, answers of 1-8 words, chosen longer or shorter."""
    def pair(q, c, r):
        return {"prompt": [{"role": "user", "content": q}], "chosen": [{"role": "assistant", "content": c}],
                "rejected": [{"role": "assistant", "content": r}]}
    return [pair("What is 2+2?", "4", "five, I think, maybe more than that"),
            pair("Name the colour of the sky on a clear day, please.", "Blue, mostly.", "Green"),
            pair("Hi", "Hello! How can I help you today?", "Go away.")]


def _dpo(tmp_path, packing, checkpointing=False, name=SMOL):
    model, tok = _lora(name, checkpointing=checkpointing)
    trainer = make_dpo_trainer(model, tok, _pairs(), max_steps=1, batch_size=3, packing=packing,
                               output_dir=str(tmp_path / f"dpo{packing}"), dashboard="none")
    torch.manual_seed(1)
    for name, p in trainer.model.named_parameters():  # after the trainer: the reference stays the base model
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    return trainer


def _loss_and_grads(trainer):
    batch = trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(3)]))
    trainer.model.train()
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    return loss.detach(), grads, batch


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    return _loss_and_grads(_dpo(tmp_path_factory.mktemp("padded"), packing=False))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_dpo_packed_equals_padded(tmp_path, padded, checkpointing):
    """Chosen and rejected of three pairs in ONE packed row: DPO loss and every LoRA gradient as padded (fp32)."""
    trainer = _dpo(tmp_path, packing=True, checkpointing=checkpointing)
    assert trainer.fastkit_packed
    loss, grads, batch = _loss_and_grads(trainer)
    lengths = batch[dpo.ROW_LENS_KWARG]
    assert len(set(lengths)) == 6 and batch["input_ids"].shape[0] == 6  # 3 chosen + 3 rejected, all lengths differ
    want_loss, want_grads, _ = padded
    assert abs(loss.item() - 0.6931) > 1e-3  # the policy differs from the reference: a real DPO loss
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == want_grads.keys() and len(grads) > 10
    for name, g in grads.items():
        assert g.abs().max() > 0, name
        torch.testing.assert_close(g, want_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_dpo_packed_equals_padded_on_moe_with_its_aux_loss(tmp_path):
    """An MoE twin (qwen3_moe, TRL adds the load-balancing loss): the router logits of the packed row are scattered
    back to the padded layout, so loss, aux loss and every gradient equal the padded batch's."""
    runs = {}
    for packing in (True, False):
        trainer = _dpo(tmp_path, packing=packing, name="Qwen/Qwen3-30B-A3B")
        assert trainer.aux_loss_enabled and trainer.fastkit_packed == packing
        runs[packing] = (*_loss_and_grads(trainer)[:2], trainer._metrics["train"]["aux_loss"])
    (loss, grads, aux), (want_loss, want_grads, want_aux) = runs[True], runs[False]
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    assert aux == pytest.approx(want_aux, rel=1e-5) and aux[0] > 0
    for name, g in grads.items():
        torch.testing.assert_close(g, want_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def _leaky_attention(q, k, v, meta, *, scaling=None, **_):
    """The break: causal attention over the whole packed row, documents NOT kept apart."""
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2)  # (B, H, T, D) -> (B, T, H, D)


def test_dpo_packed_parity_fails_when_documents_attend_to_each_other(tmp_path, padded, monkeypatch):
    """The parity above can fail: with attention not restricted per document the loss moves."""
    trainer = _dpo(tmp_path, packing=True)
    monkeypatch.setattr(packing_kernels, "packed_attention", _leaky_attention)
    loss, grads, _ = _loss_and_grads(trainer)
    want_loss, want_grads, _ = padded
    assert (loss - want_loss).abs() > 1e-3
    assert max((g - want_grads[n]).abs().max().item() for n, g in grads.items()) > 1e-3


def test_dpo_packed_model_pass_has_no_syncs(tmp_path):
    """The policy pass and the reference pass (adapter disabled) of a packed batch: 0 host syncs fwd + bwd."""
    trainer = _dpo(tmp_path, packing=True)
    batch = trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(3)]))
    kwargs = {k: v for k, v in batch.items() if k != "completion_mask"}
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    model = trainer.model
    model.train()
    with SyncCounter() as sc:
        out = model(**kwargs, labels=labels, fused_lm_head=True, use_cache=False)
        out.log_probs.sum().backward()
        with torch.no_grad(), model.disable_adapter():
            model(**kwargs, labels=labels, fused_lm_head=True, use_cache=False)
    assert sc.total == 0, dict(sc.by_op)


def test_reference_is_the_disabled_adapter_without_a_copy(tmp_path):
    model, tok = _lora()
    lora_before = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    trainer = make_dpo_trainer(model, tok, preference_dataset(), max_steps=1, output_dir=str(tmp_path),
                               dashboard="none")
    assert list(trainer.model.peft_config) == ["default"]  # TRL's "ref" adapter copy dropped
    assert sum(p.numel() for n, p in trainer.model.named_parameters() if "lora_" in n) == lora_before
    assert trainer.ref_model is None and "disabled" in trainer.fastkit_reference


def test_a_trained_adapter_stays_the_reference(tmp_path):
    """DPO after SFT: the SFT'd adapter (non-zero B) is the reference, so TRL's frozen 'ref' copy is kept."""
    model, tok = _lora()
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    trainer = make_dpo_trainer(model, tok, preference_dataset(), max_steps=1, output_dir=str(tmp_path),
                               dashboard="none")
    assert "ref" in trainer.model.peft_config and "trained adapter" in trainer.fastkit_reference


def _row(**fields):
    row = preference_records()[0]
    row.update(fields)
    return {k: v for k, v in row.items() if v is not None}


@pytest.mark.parametrize("rows,match", [
    ([_row(), _row(rejected=None)], r"row 2: no 'rejected'"),
    ([_row(), _row(chosen="The capital is Paris.")],
     r"column 'chosen' mixes types: a list in row 1, a string in rows 2"),
    ([_row(chosen=[{"role": "assistant", "content": "Paris"}], rejected=[{"role": "assistant", "content": "Paris"}])],
     r"row 1: 'chosen' and 'rejected' are the same"),
    ([_row(chosen=[{"role": "user", "content": "Paris"}])],
     r"row 1: 'chosen' and 'rejected' must end with an assistant"),
    ([_row(prompt=[{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}])],
     r"row 1 field 'prompt' ends with an assistant"),
    ([_row(chosen=[{"role": "assistant"}])], r"row 1 field 'chosen'\[0\] \(assistant\) has no text 'content'"),
    ([], r"train_dataset is empty"),
])
def test_dpo_bad_pairs_are_refused_naming_the_row(tmp_path, rows, match):
    model, tok = _lora()
    with pytest.raises(FastkitError, match=match):
        make_dpo_trainer(model, tok, rows, max_steps=1, output_dir=str(tmp_path), dashboard="none")


def test_dpo_long_pairs_are_refused_or_dropped(tmp_path):
    model, tok = _lora()
    rows = preference_records()[:4]
    rows[2]["chosen"] = [{"role": "assistant", "content": "word " * 80}]
    with pytest.raises(FastkitError, match=r"row 3 has \d+ tokens .* above max_seq_length=128"):
        make_dpo_trainer(model, tok, rows, max_seq_length=128, max_steps=1, output_dir=str(tmp_path),
                         dashboard="none")
    trainer = make_dpo_trainer(model, tok, rows, max_seq_length=128, drop_long=True, max_steps=1,
                               output_dir=str(tmp_path), dashboard="none")
    assert len(trainer.train_dataset) == 3


def test_dpo_needs_a_lora_model_and_known_options(tmp_path):
    model, tok = FastModel.from_pretrained(SMOL, max_seq_length=256, twin=True)
    with pytest.raises(FastkitError, match="get_peft_model"):
        make_dpo_trainer(model, tok, preference_dataset(), output_dir=str(tmp_path))
    model, tok = _lora()
    with pytest.raises(FastkitError, match="bta"):
        make_dpo_trainer(model, tok, preference_dataset(), output_dir=str(tmp_path), bta=0.1)


def test_dpo_fit_shows_margin_and_accuracy(tmp_path):
    model, tok = _lora(checkpointing=True)
    trainer = make_dpo_trainer(model, tok, preference_dataset(), max_steps=2, batch_size=2,
                               output_dir=str(tmp_path), dashboard="none")
    metrics = fit(trainer, view="none")
    assert metrics.status == "finished" and trainer.state.fastkit_run == "new run"
    assert {"rewards/margins", "rewards/accuracies"} <= set(metrics.rl)
    assert [s for s, _ in metrics.rl_history["rewards/margins"]] == [1, 2]


def test_grpo_trains_with_shipped_rewards_and_shows_them(tmp_path):
    model, tok = _lora("Qwen/Qwen3-0.6B", checkpointing=True)
    trainer = make_grpo_trainer(model, tok, math_dataset(4), reward_funcs=[format_reward, exact_answer],
                                max_steps=2, num_generations=2, max_completion_length=6, output_dir=str(tmp_path),
                                dashboard="none")
    assert trainer.ref_model is None and trainer.args.use_cpu
    assert trainer.fastkit_packed  # the log-prob passes on packed rows (tests/test_grpo_pack.py: exact)
    rebound = [k for k, v in vars(trainer).items() if callable(v) and callable(getattr(type(trainer), k, None))]
    assert not rebound, f"methods replaced on the instance instead of overridden in the class: {rebound}"
    metrics = fit(trainer, view="none")
    assert metrics.status == "finished"
    assert {"reward", "kl", "completions/mean_length", "completions/clipped_ratio", "rewards/format_reward/mean",
            "rewards/exact_answer/std"} <= set(metrics.rl)
    assert 1 <= metrics.rl["completions/mean_length"] <= 6


def test_grpo_refuses_prompts_and_columns_before_generating(tmp_path):
    model, tok = _lora("Qwen/Qwen3-0.6B")  # 256 tokens: completions of 32 leave 224 for a prompt
    rows = [{"prompt": [{"role": "user", "content": "1+1?"}], "solution": "2"}]
    with pytest.raises(FastkitError, match=r"reward function 'exact_answer' needs the column 'answer'"):
        make_grpo_trainer(model, tok, rows, reward_funcs=[exact_answer], max_completion_length=32,
                          output_dir=str(tmp_path))
    rows = [{"prompt": [{"role": "user", "content": "1+1?"}], "answer": "2"},
            {"prompt": [{"role": "user", "content": "2+2?"}], "answer": " "}]
    with pytest.raises(FastkitError, match=r"row 2 field 'answer' is empty"):
        make_grpo_trainer(model, tok, rows, reward_funcs=[exact_answer], max_completion_length=32,
                          output_dir=str(tmp_path))
    rows = [{"prompt": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}], "answer": "2"}]
    with pytest.raises(FastkitError, match=r"row 1 field 'prompt' ends with an assistant"):
        make_grpo_trainer(model, tok, rows, reward_funcs=[exact_answer], max_completion_length=32,
                          output_dir=str(tmp_path))
    with pytest.raises(FastkitError, match=r"num_generations=1"):
        make_grpo_trainer(model, tok, math_dataset(2), reward_funcs=[exact_answer], num_generations=1,
                          max_completion_length=32,
                          output_dir=str(tmp_path))
    with pytest.raises(FastkitError, match=r"row 1: the prompt has \d+ tokens, above max_prompt_length=8"):
        make_grpo_trainer(model, tok, math_dataset(2), reward_funcs=[exact_answer], max_prompt_length=8,
                          max_completion_length=32,
                          output_dir=str(tmp_path))
    with pytest.raises(FastkitError, match=r"max_completion_length=256 leaves no room for a prompt within the "
                                           r"model's 256 tokens"):  # the completions would fill max_seq_length
        make_grpo_trainer(model, tok, math_dataset(2), reward_funcs=[exact_answer], output_dir=str(tmp_path))


def test_trl_reference_pass_keeps_fastkit_offloaded_checkpointing(tmp_path):
    """TRL turns checkpointing off and on around its no-grad reference pass, which would put transformers' plain
    checkpoint function back on every layer; fastkit's offloaded one must survive a DPO step."""
    from fastkit import _hf
    from fastkit.patches.offload.pipeline import OffloadedCheckpoint
    from fastkit.patches.offload.testing import OffloadTestConfig

    model, tok = FastModel.from_pretrained(SMOL, max_seq_length=256, twin=True)
    cfg = OffloadTestConfig(force_cpu_stream=True, min_tokens=1, min_bytes=0)
    model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing="offload", offload_config=cfg)
    layers = _hf.checkpointed_layers(model)
    assert layers and all(isinstance(_hf.checkpoint_function(m), OffloadedCheckpoint) for m in layers)
    trainer = make_dpo_trainer(model, tok, preference_dataset(), max_steps=1, output_dir=str(tmp_path),
                               dashboard="none")
    trainer.train()
    assert all(isinstance(_hf.checkpoint_function(m), OffloadedCheckpoint) for m in _hf.checkpointed_layers(model))


def test_dpo_resumes_only_its_own_run(tmp_path):
    """fit(resume=True) continues a DPO run from its checkpoint and refuses one with another beta, naming it."""
    import shutil

    def trainer(beta):
        model, tok = _lora()
        return make_dpo_trainer(model, tok, preference_dataset(), beta=beta, max_steps=2, save_steps=1,
                                output_dir=str(tmp_path), dashboard="none")

    fit(trainer(0.1), view="none")
    shutil.rmtree(tmp_path / "checkpoint-2")
    with pytest.raises(FastkitError, match=r"beta: checkpoint 0.1, now 0.2"):
        fit(trainer(0.2), view="none", resume=True)
    again = trainer(0.1)
    metrics = fit(again, view="none", resume=True)
    assert again.state.fastkit_run == "resumed from checkpoint-1" and metrics.resumed_from == 1


@pytest.mark.parametrize("form", ["text", "implicit prompt"])
def test_dpo_other_pair_forms_train_packed(tmp_path, form):
    """Text pairs (prompt / chosen / rejected strings) and chat pairs without a prompt column (TRL takes the shared
    first turns as the prompt) pass the checks and run packed."""
    rows = preference_records()[:4]
    if form == "text":
        rows = [{k: row[k][0]["content"] for k in ("prompt", "chosen", "rejected")} for row in rows]
    else:
        rows = [{"chosen": row["prompt"] + row["chosen"], "rejected": row["prompt"] + row["rejected"]} for row in rows]
    model, tok = _lora()
    trainer = make_dpo_trainer(model, tok, rows, max_steps=1, batch_size=2, output_dir=str(tmp_path),
                               dashboard="none")
    assert trainer.fastkit_packed
    batch = trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(2)]))
    assert len(batch[dpo.ROW_LENS_KWARG]) == 4
    loss = trainer.compute_loss(trainer.model, batch)
    assert torch.isfinite(loss) and abs(loss.item() - 0.6931) < 1e-3  # fresh adapter: policy == reference


def test_revert_removes_what_the_dpo_trainer_changed(tmp_path):
    import fastkit
    from fastkit.patches.layout import decoder as _decoder

    model, tok = _lora()
    decoder = _decoder(model.get_base_model())
    trainer = make_dpo_trainer(model, tok, preference_dataset(), max_steps=1, output_dir=str(tmp_path),
                               dashboard="none")
    assert trainer.fastkit_packed and getattr(decoder.forward, "_fastkit_dpo_packed", False)
    assert "is_gradient_checkpointing" in vars(model)
    fastkit.revert(model)
    assert "is_gradient_checkpointing" not in vars(model)
    assert not hasattr(decoder.forward, "_fastkit_dpo_packed")  # the packing patch's wrapper went with it too
    assert not hasattr(decoder.forward, "_fastkit_packing")
