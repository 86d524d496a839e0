"""make_trainer's config step is pure: the SFTConfig values follow from the TrainOptions and the device alone."""

from fastkit.training import TrainOptions, sft_config

BASE = TrainOptions(output_dir="out", max_steps=40, learning_rate=2e-4, batch_size=2, max_seq_length=512, seed=1,
                    save_steps=None)
DEVICE = dict(cuda=False, optim="adamw_torch", precision={"bf16": False, "fp16": False})


def test_defaults_without_eval_or_checkpoints():
    c = sft_config(BASE, evaluate=False, **DEVICE)
    assert c["save_strategy"] == "no" and "eval_strategy" not in c and c["activation_checkpointing"] is False
    assert c["max_length"] == 512 and c["packing_strategy"] == "bfd" and c["warmup_steps"] == 4
    assert c["dataloader_pin_memory"] is False and c["optim"] == "adamw_torch" and c["bf16"] is False
    assert (c["max_steps"], c["num_train_epochs"]) == (40, 1.0)


def test_eval_checkpoints_and_overrides_win():
    options = BASE.replace(save_steps=10, sft={"optim": "sgd", "max_grad_norm": 0.5})
    c = sft_config(options, evaluate=True, **{**DEVICE, "cuda": True})
    assert (c["save_strategy"], c["save_steps"], c["save_total_limit"]) == ("steps", 10, 2)
    assert (c["eval_strategy"], c["eval_steps"], c["per_device_eval_batch_size"]) == ("steps", 10, 2)
    assert c["optim"] == "sgd" and c["max_grad_norm"] == 0.5 and c["dataloader_pin_memory"] is True
    assert sft_config(BASE.replace(eval_steps=7), evaluate=True, **DEVICE)["eval_steps"] == 7


def test_epochs_the_loads_length_and_early_stopping():
    c = sft_config(BASE.replace(epochs=2, max_seq_length=None), evaluate=True, max_seq_length=1024, **DEVICE)
    assert (c["max_steps"], c["num_train_epochs"], c["max_length"]) == (-1, 2.0, 1024)
    c = sft_config(BASE.replace(early_stopping_patience=2), evaluate=True, **DEVICE)
    assert (c["metric_for_best_model"], c["greater_is_better"]) == ("eval_loss", False)


def test_the_config_step_does_not_touch_its_inputs():
    options = BASE.replace(sft={"optim": "sgd"})
    before = options.to_dict()
    assert sft_config(options, evaluate=False, **DEVICE)["optim"] == "sgd" and options.to_dict() == before
