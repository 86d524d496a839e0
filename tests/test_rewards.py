"""The shipped reward functions score what their docstrings say; a user's broken reward function is named, with
the row, instead of failing deep inside TRL; the shipped RL data sets hold true facts."""

import functools

import pytest

from fastkit import FastkitError
from fastkit.quickstart.rl_data import math_records, preference_records
from fastkit.training import rewards
from fastkit.training.grpo import CheckedReward, needed_columns, wrap_reward_funcs


def _chat(text):
    return [{"role": "assistant", "content": text}]


def test_format_reward_wants_think_then_answer_and_nothing_else():
    good = "<think>2 and 2 make 4</think>\n<answer>4</answer>"
    cases = [good, _chat(good), "<answer>4</answer>", "<think>x</think><answer>4</answer> and more",
             "<think></think><answer>4</answer>", "<answer>4</answer><think>x</think>"]
    assert rewards.format_reward(cases) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert rewards.tags_reward(["<think>a</think><answer>b</answer>", "<think>a", "none"]) == [1.0, 0.25, 0.0]


def test_exact_answer_compares_the_final_answer_normalized():
    completions = ["<think>3+4</think><answer>7</answer>", "<answer> 1,000 </answer>", "so it is 3.0",
                   "<answer>8</answer>", "no number here", _chat("<answer>$12.50</answer>"), "5 then 6"]
    answers = ["7", "1000", "3", "7", "7", "12.5", "6"]
    assert rewards.exact_answer(completions, answer=answers) == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    with pytest.raises(ValueError):  # one answer per completion, zip(strict=True)
        rewards.exact_answer(["<answer>1</answer>"], answer=["1", "2"])


def test_length_reward_peaks_at_the_target():
    ids = [[0] * n for n in (0, 50, 100, 150, 250)]
    assert rewards.length_reward([""] * 5, completion_ids=ids, target_tokens=100) == [0.0, 0.5, 1.0, 0.5, 0.0]
    short = functools.partial(rewards.length_reward, target_tokens=2)
    assert wrap_reward_funcs([short])[0].__name__ == "length_reward"


def _bad_on_row_2(prompts, completions, answer, **kwargs):
    return [1.0 if int(a) > 0 else 0.0 for a in answer]  # row 2's answer is not a number


def _call(fn, n=4):
    wrapped = CheckedReward(fn)
    return wrapped(prompts=[f"q{i}" for i in range(n)], completions=[f"c{i}" for i in range(n)],
                   completion_ids=[[1]] * n, answer=["1", "2", "two", "4"][:n], trainer_state=None)


def test_a_reward_function_that_raises_is_named_with_its_row():
    with pytest.raises(FastkitError, match=r"reward function '_bad_on_row_2' raised ValueError: .* on completion 2 "
                                           r"\(prompt 'q2'\)"):
        _call(_bad_on_row_2)


@pytest.mark.parametrize("fn,match", [
    (lambda prompts, completions, **kw: None, r"'<lambda>' returned None for a batch of 4"),
    (lambda prompts, completions, **kw: [1.0] * 3, r"returned 3 values for 4 completions"),
    (lambda prompts, completions, **kw: [1.0, "high", 0.0, 0.0],
     r"returned str 'high' for completion 1 \(prompt 'q1'\)"),
    (lambda prompts, completions, **kw: [1.0, 0.0, float("nan"), 0.0], r"returned nan for completion 2"),
    (lambda prompts, completions, **kw: 1.0, r"returned float for 4 completions"),
])
def test_a_reward_function_returning_the_wrong_thing_is_named(fn, match):
    with pytest.raises(FastkitError, match=match):
        _call(fn)


def test_none_for_one_completion_stays_trls_not_applicable():
    assert _call(lambda prompts, completions, **kw: [1, None, 0.5, 0]) == [1.0, None, 0.5, 0.0]


def test_reward_funcs_are_checked_when_given():
    with pytest.raises(FastkitError, match="reward_funcs is empty"):
        wrap_reward_funcs([])
    with pytest.raises(FastkitError, match="is not callable"):
        wrap_reward_funcs([3])
    with pytest.raises(FastkitError, match="two functions named the same"):
        wrap_reward_funcs([rewards.format_reward, rewards.format_reward])
    assert needed_columns(rewards.exact_answer) == ["answer"]
    assert needed_columns(rewards.format_reward) == []


def test_shipped_sets_hold_true_facts_and_held_out_pairs_are_new():
    for row in math_records(48):
        question = row["prompt"][-1]["content"]
        nums = [int(w) for w in question.replace("?", " ").replace(".", " ").split() if w.isdigit()]
        op = {"more": lambda a, b: a + b, "away": lambda a, b: a - b, "each": lambda a, b: a * b}
        kind = next(k for k in op if k in question)
        assert int(row["answer"]) == op[kind](*nums), question
    train, held = preference_records("train"), preference_records("heldout")
    assert len(train) == 56 and len(held) == 16
    for row in train + held:
        q, c, r = row["prompt"][0]["content"], row["chosen"][0]["content"], row["rejected"][0]["content"]
        assert c != r and c.split(" is ")[0] == r.split(" is ")[0]  # same words up to the fact
        if " plus " in q:
            a, b = (int(x) for x in q[len("What is "):-1].split(" plus "))
            assert c.endswith(f"is {a + b}.") and not r.endswith(f"is {a + b}.")
    assert not {row["prompt"][0]["content"] for row in train} & {row["prompt"][0]["content"] for row in held}
