"""make_trainer's config step is pure: the SFTConfig values follow from its arguments alone."""

from fastkit.training import sft_config

BASE = dict(output_dir="out", max_steps=40, learning_rate=2e-4, batch_size=2, gradient_accumulation_steps=1,
            max_seq_length=512, packing=True, completion_only_loss=True, seed=1, save_steps=None, eval_steps=None,
            evaluate=False, cuda=False, optim="adamw_torch", precision={"bf16": False, "fp16": False}, overrides={})


def test_defaults_without_eval_or_checkpoints():
    c = sft_config(**BASE)
    assert c["save_strategy"] == "no" and "eval_strategy" not in c and c["activation_checkpointing"] is False
    assert c["max_length"] == 512 and c["packing_strategy"] == "bfd" and c["warmup_steps"] == 4
    assert c["dataloader_pin_memory"] is False and c["optim"] == "adamw_torch" and c["bf16"] is False


def test_eval_checkpoints_and_overrides_win():
    c = sft_config(**{**BASE, "save_steps": 10, "evaluate": True, "cuda": True,
                      "overrides": {"warmup_steps": 0, "optim": "sgd"}})
    assert (c["save_strategy"], c["save_steps"], c["save_total_limit"]) == ("steps", 10, 2)
    assert (c["eval_strategy"], c["eval_steps"], c["per_device_eval_batch_size"]) == ("steps", 4, 2)
    assert c["warmup_steps"] == 0 and c["optim"] == "sgd" and c["dataloader_pin_memory"] is True
    assert sft_config(**{**BASE, "evaluate": True, "eval_steps": 7})["eval_steps"] == 7


def test_the_config_step_does_not_touch_its_inputs():
    overrides = {"seed": 5}
    before = dict(overrides)
    assert sft_config(**{**BASE, "overrides": overrides})["seed"] == 5 and overrides == before
