"""KTO (issue 45) with TRL's own KTOTrainer on fastkit's model: unpaired rows refused at the door naming the row,
2 steps on a twin with the disabled adapter as the reference (no copy), and ``fastkit kto`` from a --config file;
ORPO refused, naming what to use instead."""

import logging

import pytest
import torch
from trl import KTOTrainer

from fastkit import FastkitError, FastModel, fit
from fastkit.cli import main
from fastkit.data.read import as_dataset
from fastkit.quickstart.rl_data import preference_records
from fastkit.training import kto, make_kto_trainer

SMOL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _lora():
    model, tok = FastModel.from_pretrained(SMOL, max_seq_length=256, twin=True)
    return FastModel.get_peft_model(model, r=4), tok


def _row(question="What is 2+2?", answer="4", label=True, chat=True):
    if not chat:
        return {"prompt": question, "completion": answer, "label": label}
    return {"prompt": [{"role": "user", "content": question}],
            "completion": [{"role": "assistant", "content": answer}], "label": label}


def _rows(n=4, chat=True):
    """n rows, desirable and undesirable alternating, of mixed lengths."""
    return [_row(f"Question {i}: what is {i} plus {i}?" + " Think." * (i % 3), f"{2 * i}." if i % 2 == 0 else "No.",
                 i % 2 == 0, chat) for i in range(n)]


def _check(rows):
    return kto.check_rows(as_dataset(rows), None)


@pytest.mark.parametrize("rows, match", [
    ([_row(chat=False), {"prompt": "Hi", "completion": "Yo"}],
     r"train_dataset row 2: null 'label' \(empty or left out in that row\)"),
    ([_row(label="yes"), _row(label="no")], r"row 1 field 'label' must be true or false \(or 1 / 0\).*'yes'"),
    ([_row(label=1), _row(label=2)], r"row 2 field 'label' must be true or false .*int 2"),
    ([_row(), _row()], r"all 2 rows are desirable \(label true\)\. KTO weighs desirable against undesirable"),
    ([_row(label=0), _row(label=0)], r"all 2 rows are undesirable \(label false\)"),
    ([_row(chat=False), _row(answer=" ", label=False, chat=False)], r"row 2 field 'completion' must be non-empty"),
    ([_row(), {**_row(label=False), "completion": [{"role": "user", "content": "x"}]}],
     r"row 2 field 'completion' must end with an assistant message"),
    ([{**_row(), "prompt": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}],
     r"row 1 field 'prompt' ends with an assistant message"),
    ([_row(), {**_row(label=False), "completion": [{"role": "assistant"}]}],
     r"row 2 field 'completion'\[0\] \(assistant\) has no text 'content'"),
    ([], r"train_dataset is empty"),
])
def test_bad_rows_are_refused_naming_the_row(rows, match):
    with pytest.raises(FastkitError, match=match):
        _check(rows)


def test_labels_0_and_1_read_as_bools_and_pairs_unpair_side_by_side():
    checked = _check([_row(label=1), _row(label=0)])
    assert checked.features["label"].dtype == "bool" and checked["label"] == [True, False]
    pairs = as_dataset(preference_records()[:3])
    rows = kto.check_rows(kto.unpaired(pairs), None)
    assert len(rows) == 6 and rows["label"] == [True, False] * 3  # each batch of 2 holds both labels
    assert rows[1]["completion"] == pairs[0]["rejected"] and rows[2]["prompt"] == pairs[1]["prompt"]
    with pytest.raises(FastkitError, match=r"row 2: 'chosen' and 'rejected' are the same"):  # DPO's pair checks
        kto.unpaired(as_dataset([pairs[0], {**pairs[1], "rejected": pairs[1]["chosen"]}]))


def test_make_kto_trainer_trains_two_steps_with_the_disabled_adapter_as_reference(tmp_path):
    model, tok = _lora()
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    n_params = sum(p.numel() for p in model.parameters())
    trainer = make_kto_trainer(model, tok, _rows(6), max_steps=2, learning_rate=1e-3, output_dir=str(tmp_path),
                               dashboard="none")
    assert isinstance(trainer, KTOTrainer) and type(trainer).__name__ == "FastKTOTrainer"  # TRL's, fastkit's run
    assert trainer.args.per_device_train_batch_size == 2
    assert trainer.ref_model is None and list(trainer.model.peft_config) == ["default"]  # TRL's "ref" copy dropped
    assert sum(p.numel() for p in model.parameters()) == n_params and "disabled" in trainer.fastkit_reference
    metrics = fit(trainer, view="none")
    assert metrics.status == "finished" and trainer.state.global_step == 2
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(x)) for x in losses), losses
    assert {"kl", "rewards/chosen", "rewards/rejected"} <= set(metrics.rl)
    moved = [n for n, p in model.named_parameters() if "lora_B" in n and (p - lora[n]).abs().max() > 0]
    assert len(moved) == sum("lora_B" in n for n in lora), moved[:3]  # every LoRA B trained


def test_the_reference_pass_is_the_base_model(tmp_path):
    """With the adapter moved off zero after the trainer was made, TRL's reference log-probs are the base model's
    (adapter disabled), not the policy's."""
    model, tok = _lora()
    trainer = make_kto_trainer(model, tok, _rows(2), max_steps=1, output_dir=str(tmp_path), dashboard="none")
    torch.manual_seed(0)
    for name, p in trainer.model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    batch = trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(2)]))
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    kwargs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels,
                  fused_lm_head=True, use_cache=False)
    with torch.no_grad():
        ref = trainer.compute_ref_log_probs(trainer.model, batch)[0]
        policy = trainer.model(**kwargs).log_probs.sum(-1)
        with trainer.model.disable_adapter():
            base = trainer.model(**kwargs).log_probs.sum(-1)
    assert (policy - base).abs().max() > 1e-3  # the adapter matters
    torch.testing.assert_close(ref, base, rtol=1e-5, atol=1e-5)


def test_long_rows_are_refused_or_dropped_and_kl_completions_repaired(tmp_path):
    model, tok = _lora()
    rows = _rows(6)
    rows[2]["completion"] = [{"role": "assistant", "content": "word " * 80}]
    with pytest.raises(FastkitError, match=r"train_dataset row 3 has \d+ tokens .* above max_seq_length=96"):
        make_kto_trainer(model, tok, rows, max_seq_length=96, max_steps=1, output_dir=str(tmp_path),
                         dashboard="none")
    trainer = make_kto_trainer(model, tok, rows, max_seq_length=96, drop_long=True, max_steps=1,
                               output_dir=str(tmp_path), dashboard="none")
    data = trainer.train_dataset
    assert len(data) == 5 and data["label"] == [True, False, False, True, False]
    c, kl = data["completion_ids"], data["KL_completion_ids"]
    assert kl == [c[1], c[0], c[3], c[2], c[4]]  # each batch of 2 rotated, as TRL pairs them (none from row 2)
    assert trainer.data_collator.max_length == 96 and trainer.args.max_length == 96


def test_options_are_checked(tmp_path):
    model, tok = _lora()
    with pytest.raises(FastkitError, match=r"batch_size=1: KTO estimates its KL baseline"):
        make_kto_trainer(model, tok, _rows(), batch_size=1, output_dir=str(tmp_path))
    with pytest.raises(FastkitError, match="undesirable_weight"):
        make_kto_trainer(model, tok, _rows(), undesirable_weight=0, output_dir=str(tmp_path))
    with pytest.raises(FastkitError, match="bta"):
        make_kto_trainer(model, tok, _rows(), output_dir=str(tmp_path), bta=0.1)
    base, tok = FastModel.from_pretrained(SMOL, max_seq_length=256, twin=True)
    with pytest.raises(FastkitError, match="get_peft_model"):
        make_kto_trainer(base, tok, _rows(), output_dir=str(tmp_path))


def test_kto_resumes_only_its_own_run(tmp_path):
    """fit(resume=True) continues a KTO run and refuses one with other loss weights, naming the difference."""
    def trainer(weight):
        model, tok = _lora()
        return make_kto_trainer(model, tok, _rows(4), desirable_weight=weight, max_steps=2, save_steps=1,
                                output_dir=str(tmp_path), dashboard="none")

    fit(trainer(1.0), view="none")
    with pytest.raises(FastkitError, match=r"desirable_weight: checkpoint 1.0, now 1.5"):
        fit(trainer(1.5), view="none", resume=True)


# -- fastkit kto ---------------------------------------------------------------------------------------------
def test_kto_config_file_trains_two_steps_and_saves_a_verified_adapter(tmp_path, caplog, capsys):
    import json

    out, data, config = tmp_path / "run", tmp_path / "rows.jsonl", tmp_path / "run.yaml"
    data.write_text("".join(json.dumps({**r, "label": int(r["label"])}) + "\n" for r in _rows(4, chat=False)))
    config.write_text(f"model: {SMOL}\ntwin: true\ndata: {data.name}\nsteps: 2\nmax-seq-length: 128\nlora-r: 4\n"
                      f"desirable-weight: 1.2\nlr: 1e-3\noutput-dir: {out}\n")
    with caplog.at_level(logging.INFO, logger="fastkit"):
        rc = main(["kto", "--config", str(config)])
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert rc == 0, text
    assert "training finished at step 2/2" in text and "save_lora verified" in text, text
    assert "KTO labels 0 / 1 read as false / true" in text
    from safetensors.torch import load_file

    tensors = load_file(str(out / "lora" / "adapter_model.safetensors"))
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in tensors.items())
    saved = (out / "fastkit_config.yaml").read_text()
    assert "desirable_weight: 1.2\n" in saved and "batch_size: 2\n" in saved, saved
    capsys.readouterr()
    assert main(["kto", "--config", str(out / "fastkit_config.yaml"), "--print-config"]) == 0
    assert capsys.readouterr().out.split("\n", 1)[1] == saved.split("\n", 1)[1]


def test_orpo_says_why_not_and_what_to_use(capsys):
    assert main(["orpo", "--model", "m", "--data", "sample"]) == 2
    err = capsys.readouterr().err
    assert "fastkit orpo: ORPO is not available: TRL 1.16 ships ORPOTrainer only under trl.experimental" in err
    assert "Use fastkit dpo" in err and "fastkit kto" in err
