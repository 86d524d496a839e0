"""The dashboard collects and shows what DPO / GRPO users watch, from TRL's own log keys; SFT logs show none."""

from types import SimpleNamespace

from transformers import TrainerControl, TrainerState

from fastkit.dashboard import MetricsCallback, progress_line, stat_rows, summary_text
from fastkit.dashboard.callbacks import is_rl_key
from fastkit.dashboard.render import rl_rows
from tests.helpers import FakeClock

GRPO_LOG = {"loss": 0.01, "learning_rate": 1e-5, "grad_norm": 0.3, "num_tokens": 400.0,
            "completions/mean_length": 87.5, "completions/clipped_ratio": 0.25, "completions/min_length": 12.0,
            "rewards/format_reward/mean": 0.5, "rewards/format_reward/std": 0.5,
            "rewards/exact_answer/mean": 0.125, "rewards/exact_answer/std": 0.33,
            "reward": 0.625, "reward_std": 0.7, "frac_reward_zero_std": 0.0, "kl": 0.0021, "entropy": 1.2,
            "clip_ratio/region_mean": 0.0}
DPO_LOG = {"loss": 0.69, "learning_rate": 5e-5, "grad_norm": 1.0, "rewards/chosen": 0.02, "rewards/rejected": -0.01,
           "rewards/accuracies": 0.75, "rewards/margins": 0.03, "logps/chosen": -20.0, "logits/chosen": 0.1}


def _log(logs_per_step):
    cb = MetricsCallback(warmup_steps=0, clock=FakeClock(0.0))
    args, control = SimpleNamespace(use_cpu=True), TrainerControl()
    state = TrainerState(max_steps=len(logs_per_step), is_world_process_zero=True)
    cb.on_train_begin(args, state, control, model=None)
    for i, logs in enumerate(logs_per_step):
        cb.on_step_begin(args, state, control)
        state.global_step = i + 1
        cb.on_step_end(args, state, control)
        cb.on_log(args, state, control, logs=dict(logs))
    return cb.metrics


def test_grpo_rewards_per_function_kl_length_and_clipping_are_shown():
    m = _log([GRPO_LOG, {**GRPO_LOG, "reward": 0.75, "kl": 0.004}])
    assert m.rl["reward"] == 0.75 and m.rl_history["kl"] == [(1, 0.0021), (2, 0.004)]
    assert "completions/min_length" not in m.rl and "entropy" not in m.rl  # only what the panel shows
    rows = {k: v for k, v in rl_rows(m).items()}
    assert rows["reward"].value == "0.75 ± 0.7"
    assert rows["reward:format_reward"].value == "0.5 ± 0.5" and rows["reward:exact_answer"].value == "0.125 ± 0.33"
    assert rows["kl"].value == "0.004" and rows["completion_length"].value == "87.5"
    assert rows["clipped_ratio"].value == "25%"
    assert set(rows) <= set(stat_rows(m))
    line = progress_line(m)
    assert "reward 0.75 ± 0.7" in line and "kl 0.004" in line and "len 88" in line
    assert "exact_answer" in summary_text(m)


def test_dpo_margin_and_accuracy_are_shown():
    m = _log([DPO_LOG])
    rows = rl_rows(m)
    assert rows["dpo_margin"].value == "0.03" and rows["dpo_accuracy"].value == "75%"
    assert "margin 0.03" in progress_line(m) and "acc 75%" in progress_line(m)
    assert "Pair accuracy" in summary_text(m) and "Reward margin" in summary_text(m)


def test_kto_margin_and_kl_are_shown_without_a_pair_accuracy():
    """KTO logs a margin (desirable - undesirable reward) and a KL estimate, no pair accuracy: no DPO label."""
    m = _log([{"loss": 0.5, "learning_rate": 1e-4, "grad_norm": 0.5, "kl": 0.25, "rewards/chosen": 0.5,
               "rewards/rejected": 0.25, "rewards/margins": 0.25}])
    rows = rl_rows(m)
    assert rows["dpo_margin"].value == "0.25" and rows["kl"].value == "0.25" and "dpo_accuracy" not in rows
    assert "Reward margin" in summary_text(m) and "DPO" not in summary_text(m)


def test_sft_logs_add_no_rl_rows():
    m = _log([{"loss": 2.0, "learning_rate": 1e-4, "grad_norm": 0.5, "num_tokens": 100, "mean_token_accuracy": 0.4,
               "entropy": 1.0}])
    assert m.rl == {} and rl_rows(m) == {}
    assert not any(is_rl_key(k) for k in ("loss", "entropy", "mean_token_accuracy", "logps/chosen", "rewards/x"))
