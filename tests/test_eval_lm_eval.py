"""``fastkit eval --lm-eval TASKS`` (issue 57): lm-evaluation-harness run on the base and the tuned model.

Offline, on local task files written here (a multiple-choice task and a loglikelihood task over jsonl rows) and a
tiny twin with a LoRA adapter whose B is nonzero: the numbers fastkit reports equal those lm-eval computes by hand in
a separate process that never imports fastkit (``lm_eval.simple_evaluate`` on the saved safetensors base, with
lm-eval's own ``peft=`` for the adapter), exactly; the adapter moves them; a missing lm-eval names the install line;
bad input exits 2 before any model loads.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from fastkit import FastkitError, FastModel, cli
from fastkit.evaluation import lm_eval as lm

SMOL = "HuggingFaceTB/SmolLM2-135M-Instruct"
TASKS = "tiny_mc,tiny_ll"
FAST = ["--max-rows", "2", "--max-new-tokens", "4", "--no-sampled", "--no-forgetting"]
MC = [("The sky on a clear day is", ["blue", "green", "loud", "square"], 0),
      ("Two plus two equals", ["three", "four", "five", "seven"], 1),
      ("Water freezes at zero degrees", ["Kelvin", "Fahrenheit", "Celsius", "Rankine"], 2),
      ("The capital of France is", ["Berlin", "Madrid", "Rome", "Paris"], 3),
      ("A cat says", ["moo", "meow", "woof", "quack"], 1),
      ("The opposite of hot is", ["warm", "cold", "red", "fast"], 1),
      ("A week has this many days:", ["five", "six", "seven", "ten"], 2),
      ("Bees make", ["milk", "silk", "honey", "wool"], 2)]
LL = [("The sun rises in the", "east"), ("One, two,", "three"), ("Snow is", "white"), ("Fish live in", "water"),
      ("Grass is", "green"), ("Ice is", "cold")]


@pytest.fixture(scope="module")
def installed():
    """lm-eval: skipped where it is not installed; in CI (CI=true: .ci/run installs the ``eval`` extra) a failure."""
    import importlib.util
    import os

    if importlib.util.find_spec("lm_eval") is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("lm_eval is not importable in CI: .ci/run must install fastkit-llm[eval]")
        pytest.skip("lm-eval is not installed (pip install 'fastkit-llm[eval]')")


@pytest.fixture(scope="module")
def tasks(tmp_path_factory, installed) -> Path:
    """A folder of two lm-eval tasks over jsonl rows written here (lm-eval's ``json`` dataset: no download)."""
    folder = tmp_path_factory.mktemp("tasks")
    mc, ll = folder / "mc.jsonl", folder / "ll.jsonl"
    mc.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in MC))
    ll.write_text("".join(json.dumps({"text": t, "next": n}) + "\n" for t, n in LL))
    common = {"dataset_path": "json", "test_split": "test"}
    (folder / "tiny_mc.yaml").write_text(yaml.safe_dump({
        "task": "tiny_mc", **common, "dataset_kwargs": {"data_files": {"test": str(mc)}},
        "output_type": "multiple_choice", "doc_to_text": "{{question}}", "doc_to_choice": "{{choices}}",
        "doc_to_target": "answer", "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}]}))
    (folder / "tiny_ll.yaml").write_text(yaml.safe_dump({
        "task": "tiny_ll", **common, "dataset_kwargs": {"data_files": {"test": str(ll)}},
        "output_type": "loglikelihood", "doc_to_text": "{{text}}", "doc_to_target": " {{next}}",
        "metric_list": [{"metric": "perplexity"}, {"metric": "acc"}]}))
    return folder


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``(the twin base saved as safetensors, its LoRA adapter with a nonzero B saved, the PEFT model, tokenizer)``."""
    root = tmp_path_factory.mktemp("models")
    model, tok = FastModel.from_pretrained(SMOL, max_seq_length=128, twin=True)  # the seeded twin weights
    model.save_pretrained(root / "base", safe_serialization=True)
    tok.save_pretrained(root / "base")
    lora = FastModel.get_peft_model(model, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"])
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    lora.save_pretrained(root / "lora")
    return root / "base", root / "lora", lora, tok


BY_HAND = textwrap.dedent("""
    import json, sys
    import lm_eval
    from lm_eval.tasks import TaskManager
    base, lora, include, tasks = sys.argv[1:]
    manager = TaskManager(include_path=include, include_defaults=False)
    out = {}
    for side, args in (("base", f"pretrained={base}"), ("tuned", f"pretrained={base},peft={lora}")):
        res = lm_eval.simple_evaluate(model="hf", model_args=args, tasks=tasks.split(","), task_manager=manager,
                                      batch_size=1, device="cpu", log_samples=False)
        out[side] = res["results"]
    print("RESULTS " + json.dumps(out))
""")


def _by_hand(base: Path, lora: Path, tasks: Path) -> dict:
    """lm-eval alone in a fresh process (fastkit never imported): its results for the base and base + adapter."""
    done = subprocess.run([sys.executable, "-c", BY_HAND, str(base), str(lora), str(tasks), TASKS],
                          capture_output=True, text=True, timeout=300, cwd=tasks)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULTS "))
    return json.loads(line[len("RESULTS "):])


def test_the_numbers_are_lm_evals_own_by_hand(saved, tasks, tmp_path, capsys):
    """fastkit eval --lm-eval on base + adapter: each number equals lm-eval's by hand, exactly; the adapter (nonzero
    B) moves them."""
    base, lora_dir, _, _ = saved
    out = tmp_path / "report"
    assert cli.main(["eval", "--model", SMOL, "--twin", "--adapter", str(lora_dir), "--data", "quickstart-heldout",
                     "--lm-eval", TASKS, "--lm-eval-include", str(tasks), "--output-dir", str(out), *FAST]) == 0
    ours = json.loads((out / "results.json").read_text())["lm_eval"]
    hand = _by_hand(base, lora_dir, tasks)
    want = {"tiny_mc": ("acc", "acc_norm"), "tiny_ll": ("perplexity", "acc")}
    for task, names in want.items():
        assert set(ours[task]) == set(names), ours[task]
        for name in names:
            for side in ("base", "tuned"):
                assert ours[task][name][side] == hand[side][task][f"{name},none"], (task, name, side)
    ppl = ours["tiny_ll"]["perplexity"]
    assert ppl["base"] != ppl["tuned"]  # the adapter is on for tuned, off for base
    assert ours["tiny_mc"]["acc"] != ours["tiny_mc"]["acc_norm"] or ppl["base"] > 1  # real numbers, not defaults
    report = (out / "report.md").read_text()
    assert "## Benchmarks (lm-evaluation-harness)" in report and "| tiny_ll | perplexity |" in report
    assert "| tiny_mc | acc_norm |" in capsys.readouterr().out
    print("by hand:", json.dumps({s: {t: {k: v for k, v in r.items() if k.endswith(",none") and "stderr" not in k}
                                      for t, r in hand[s].items()} for s in hand}))


@pytest.mark.slow
def test_the_lm_eval_command_by_hand(saved, tasks, tmp_path):
    """lm-eval's own command line (``python -m lm_eval run --model hf``) on the saved base + adapter: the numbers
    fastkit's run gives for the PEFT model object, exactly."""
    base, lora_dir, model, tok = saved
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", "hf", "--model_args",
           f"pretrained={base},peft={lora_dir}", "--tasks", TASKS, "--include_path", str(tasks), "--batch_size", "1",
           "--device", "cpu", "--output_path", str(tmp_path / "out")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    (file,) = (tmp_path / "out").rglob("results_*.json")
    theirs = lm.metrics(json.loads(file.read_text()))
    assert lm.run(model, tok, TASKS, tasks) == theirs and set(theirs) == {"tiny_mc", "tiny_ll"}


def test_run_on_the_model_object_adapter_on_and_off(saved, tasks, tmp_path):
    """lm.run on the PEFT model, adapter on and disabled, differ; the caller's random state and train mode are left
    as they were; lm-eval's limit reaches it."""
    _, lora_dir, model, tok = saved
    model.train()
    state = torch.random.get_rng_state()
    tuned = lm.run(model, tok, TASKS, tasks)
    with model.disable_adapter():
        base = lm.run(model, tok, TASKS, tasks)
    assert torch.equal(torch.random.get_rng_state(), state) and model.training
    assert tuned["tiny_ll"]["perplexity"] != base["tiny_ll"]["perplexity"]
    assert lm.run(model, tok, ["tiny_ll"], tasks, limit=2)["tiny_ll"] != tuned["tiny_ll"]  # lm-eval's limit


def test_metrics_are_numbers_named_by_filter():
    results = {"results": {"t": {"alias": "t", "acc,none": 0.5, "acc_stderr,none": 0.1, "exact_match,strict": 1,
                                 "exact_match_stderr,strict": "N/A", "sample_len": 4}}}
    assert lm.metrics(results) == {"t": {"acc": 0.5, "exact_match (strict)": 1.0}}


def test_without_lm_eval_the_install_line(monkeypatch, saved, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    _, lora_dir, model, tok = saved
    with pytest.raises(FastkitError, match=r"needs lm-eval, which is not installed: pip install 'fastkit-llm\[eval\]'"):
        lm.run(model, tok, "hellaswag")
    rc = cli.main(["eval", "--model", SMOL, "--twin", "--adapter", str(lora_dir), "--data", "quickstart-heldout",
                   "--lm-eval", "hellaswag"])
    assert rc == 2 and "pip install 'fastkit-llm[eval]'" in capsys.readouterr().err


def _hostile(tmp: Path, tasks: Path, lora_dir: Path) -> dict[str, tuple[list[str], str]]:
    (tmp / "file.yaml").write_text("task: x\n")
    (tmp / "empty").mkdir()
    return {
        "include_missing": (["--lm-eval", "tiny_mc", "--lm-eval-include", str(tmp / "nope")], "no such folder"),
        "include_a_file": (["--lm-eval", "tiny_mc", "--lm-eval-include", str(tmp / "file.yaml")],
                           f"a file, not a folder; give the folder that holds it ({tmp})"),
        "include_empty": (["--lm-eval", "tiny_mc", "--lm-eval-include", str(tmp / "empty")], "holds no .yaml"),
        "no_task": (["--lm-eval", ",", "--lm-eval-include", str(tasks)], "give at least one task name"),
        "include_without_task": (["--lm-eval-include", str(tasks)], "give at least one task name"),
        "unknown_task": (["--lm-eval", "tiny_mc,tiny_mcq", "--lm-eval-include", str(tasks)],
                         "unknown task 'tiny_mcq' (close: tiny_mc"),
        "limit_zero": (["--lm-eval", "tiny_mc", "--lm-eval-include", str(tasks), "--lm-eval-limit", "0"],
                       "lm_eval_limit must be a positive int"),
    }


CASES = ["include_missing", "include_a_file", "include_empty", "no_task", "include_without_task", "unknown_task",
         "limit_zero"]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_exits_2_before_any_model_loads(case, tasks, saved, tmp_path, capsys, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(FastModel, "from_pretrained", refuse)
    argv, message = _hostile(tmp_path, tasks, saved[1])[case]
    ok = ["--model", SMOL, "--twin", "--adapter", str(saved[1]), "--data", "quickstart-heldout"]
    try:
        rc = cli.main(["eval", *ok, *argv])
    except SystemExit as exc:
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2, err
    assert message in err, err
    assert "Traceback" not in err


def test_the_matrix_lists_every_case(tmp_path, tasks, saved):
    assert sorted(_hostile(tmp_path, tasks, saved[1])) == sorted(CASES)
