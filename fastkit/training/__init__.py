"""Training: TRL's trainers made by fastkit, run under the dashboard, resumed only where it is the same run.

    run.py        ``make_trainer`` / ``fit``: the notebook API, a few lines each; ``run_coverage``
    base.py       ``FastTrainerMixin``: what every fastkit trainer is on top of TRL's (the dashboard first among its
                  callbacks, the model card as a method, ``train(resume=, extend=)``); record.py: ``RunRecord``, the
                  one frozen record of a run (options, config, data, command, identity...) on the trainer
    trainer.py    ``ZeroSyncSFTTrainer`` (TRL's step without its host-device reads) and ``FastSFTTrainer`` (it as a
                  fastkit trainer: packed lengths and host ids in the collator, the chunked loss, epoch step counts)
    session.py    a fastkit run: new run / resume / extend, the config saved, Ctrl-C a clean stop; step counts
    args.py       the TrainingArguments defaults every trainer shares (``training_args``), SFT's ``sft_config``
    sft_data.py   the SFT rows checked and tokenized once; vision.py: image + text rows; card.py: the model card
    preference.py ``make_dpo_trainer`` / ``make_kto_trainer`` / ``make_grpo_trainer``: ``FastDPOTrainer`` /
                  ``FastKTOTrainer`` / ``FastGRPOTrainer`` over TRL's own (dpo.py: pairs checked and packed; kto.py:
                  KTO's unpaired rows checked; grpo.py: prompts and reward functions checked; grpo_pack.py: the
                  log-prob passes on packed prompt + completion rows; rewards.py: reward functions to start from)
    options.py    ``TrainOptions`` / ``LoraOptions``: every knob with its help text and default, for make_trainer,
                  ``fastkit train`` (flags and YAML) and the notebooks; other SFTConfig fields pass through
    identity.py   the run identity kept in each checkpoint (model, adapter, data fingerprint, hyperparameters),
                  ``RunGuard`` and ``check_resumable``

``from fastkit.training import make_trainer, fit`` is the public path.
"""

from fastkit._lazy import exports as _exports

# Imported when first used: ``fastkit.training.options`` (the CLI's flags, the YAML) needs neither torch nor TRL.
_LAZY = {
    "LoraOptions": "options", "TrainOptions": "options", "make_dpo_trainer": "preference",
    "make_grpo_trainer": "preference", "make_kto_trainer": "preference", **dict.fromkeys(
        ("TRACKERS", "available_trackers", "check_distributed_mode", "check_report_to", "fit", "last_checkpoint",
         "make_trainer", "planned_steps", "run_coverage", "sft_config", "steps_per_epoch"), "run"),
}


__getattr__, __dir__ = _exports(globals(), "fastkit.training", _LAZY)

__all__ = ["TRACKERS", "LoraOptions", "TrainOptions", "available_trackers", "check_distributed_mode",
           "check_report_to", "fit", "last_checkpoint", "make_dpo_trainer", "make_grpo_trainer", "make_kto_trainer",
           "make_trainer", "planned_steps", "run_coverage", "sft_config", "steps_per_epoch"]
