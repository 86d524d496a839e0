"""``fastkit eval --gguf FILE`` / :class:`fastkit.evaluation.gguf.LlamaCppModel` (issue 57): the tuned model as the
GGUF users run, in llama.cpp, beside its base in transformers.

The GGUF is scored on the tokenizer's own ids (never re-tokenized), so a GGUF of a model scores as that model does in
transformers. The tolerance: an f16 GGUF of weights that are exactly f16 holds the same numbers; llama.cpp's CPU
matmuls round the activations to f16 (a relative error of ~5e-4 per product), so the loss (a mean over hundreds of
tokens) agrees to ~1e-4 nats (measured 1.2e-5 on this twin) and ``LOSS_TOL`` = 2e-3 holds with room, while the
tuned weights move the loss by ~2e-2 (the test checks the two are further apart than the tolerance). Tiny twins,
offline; the files load llama.cpp (the ``llamacpp`` stage of CI).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fastkit import FastModel, cli, evaluate
from fastkit.evaluation.gguf import LlamaCppModel, load_gguf
from tests.helpers import require_llama_cpp

SMOL = "HuggingFaceTB/SmolLM2-135M-Instruct"
FAST = dict(max_rows=3, max_new_tokens=6, forgetting_tokens=6)
LOSS_TOL = 2e-3


@pytest.fixture(scope="module", autouse=True)
def _llama_cpp():
    """llama-cpp-python: fails in CI, skips elsewhere when missing (at collection it would skip CI's suite stage)."""
    return require_llama_cpp()


def _twin(seed_shift: float = 0.0):
    model, tok = FastModel.from_pretrained(SMOL, max_seq_length=256, twin=True)
    if seed_shift:
        torch.manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * seed_shift)
    with torch.no_grad():  # weights exactly representable in f16: the f16 GGUF holds the same numbers
        for p in model.parameters():
            p.copy_(p.half().float())
    return model.eval(), tok


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """``(base, tuned, tokenizer, tuned's f16 GGUF path)``."""
    from fastkit.export.gguf import save_gguf

    base, tok = _twin()
    tuned, _ = _twin(0.02)
    path = save_gguf(tuned, tok, str(tmp_path_factory.mktemp("gguf")), quantization="f16")
    return base, tuned, tok, path


def _rows():
    from fastkit.data.sources import load_sources

    return load_sources("quickstart-heldout")


def test_a_gguf_scores_as_the_model_it_was_exported_from(models):
    base, tuned, tok, path = models
    want = evaluate(tuned, tok, _rows(), base=base, **FAST).to_dict()
    gguf = load_gguf(path, base, tok, n_ctx=1024)
    try:
        got = evaluate(gguf, tok, _rows(), base=base, **FAST).to_dict()
    finally:
        gguf.close()
    loss, ref = got["metrics"]["loss"], want["metrics"]["loss"]
    assert loss["base"] == ref["base"]  # the base is the same transformers model in both
    assert abs(loss["tuned"] - ref["tuned"]) < LOSS_TOL, (loss, ref)
    assert abs(ref["tuned"] - ref["base"]) > 5 * LOSS_TOL  # the check can tell the tuned model from the base
    for key in ("tuned_text_perplexity", "drift", "tuned_perplexity"):
        assert got["forgetting"][key] == pytest.approx(want["forgetting"][key], rel=2e-3), key
    assert got["rows"] == want["rows"] == 3


def test_greedy_answers_are_llama_cpps_argmax(models):
    """Teacher-forced: each token of llama.cpp's greedy answer is the argmax of llama.cpp's own logits there."""
    base, _, tok, path = models
    gguf = load_gguf(path, base, tok, n_ctx=256)
    try:
        prompt = tok.apply_chat_template([{"role": "user", "content": "Name a colour."}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]
        out = gguf.generate(torch.tensor([prompt]), max_new_tokens=8)[0].tolist()
        assert out[:len(prompt)] == prompt and len(out) > len(prompt)
        logits = gguf(input_ids=torch.tensor([out])).logits[0]  # [T, V]
        assert logits[len(prompt) - 1:-1].argmax(-1).tolist() == out[len(prompt):]
        torch.manual_seed(5)
        sampled = gguf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=True, temperature=0.7, top_p=0.95)
        torch.manual_seed(5)
        again = gguf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=True, temperature=0.7, top_p=0.95)
        assert sampled.tolist() == again.tolist()  # seeded: the same seed, the same answer
    finally:
        gguf.close()


def test_a_gguf_of_another_vocabulary_is_refused(models, tmp_path):
    from fastkit.errors import FastkitError
    from fastkit.export.gguf import save_gguf

    base, _, tok, _ = models
    other, other_tok = _twin()  # another model's file: its vocabulary 64 tokens longer
    other_tok.add_tokens([f"<extra_{i}>" for i in range(64)])
    other.resize_token_embeddings(len(other_tok))
    path = save_gguf(other, other_tok, str(tmp_path), quantization="f16")
    with pytest.raises(FastkitError, match="its vocabulary is not the base model's tokenizer"):
        load_gguf(path, base, tok, n_ctx=256)


def test_lm_eval_on_a_gguf_is_refused(models):
    from fastkit.errors import FastkitError

    base, _, tok, path = models
    gguf = load_gguf(path, base, tok, n_ctx=256)
    try:
        with pytest.raises(FastkitError, match="lm_eval runs on a transformers model"):
            evaluate(gguf, tok, _rows(), base=base, lm_eval=["arc_easy"], **FAST)
    finally:
        gguf.close()


@pytest.fixture(scope="module")
def run_with_gguf(tmp_path_factory) -> tuple[Path, Path]:
    """A 2-step ``fastkit train`` twin run holding out 4 rows, and its LoRA exported as an f16 GGUF."""
    out = tmp_path_factory.mktemp("evalgguf") / "run"
    assert cli.main(["train", "--model", SMOL, "--twin", "--data", "quickstart", "--steps", "2", "--max-seq-length",
                     "128", "--lora-r", "4", "--checkpointing", "off", "--eval-split", "4", "--output-dir",
                     str(out)]) == 0
    assert cli.main(["export", "--model", str(out / "lora"), "--gguf", "f16", "--out-dir", str(out / "export")]) == 0
    return out, next((out / "export").rglob("*.gguf"))


def test_fastkit_eval_run_with_its_gguf(run_with_gguf, capsys):
    run, gguf = run_with_gguf
    assert cli.main(["eval", "--run", str(run), "--gguf", str(gguf), "--max-rows", "2", "--max-new-tokens", "4",
                     "--forgetting-tokens", "4"]) == 0
    out = capsys.readouterr().out
    report = gguf.parent / "eval"
    results = json.loads((report / "results.json").read_text())
    assert results["rows"] == 2 and set(results["metrics"]["loss"]) == {"base", "tuned"}
    assert (report / "report.md").is_file() and f"Report: {report}/report.md" in out
    assert results["tuned"] == f"{gguf.name} in llama.cpp" and f"(tuned: {gguf.name} in llama.cpp)" in out


def _main(argv: list[str]) -> int:
    try:
        return cli.main(argv)
    except SystemExit as exc:
        return exc.code


def _hostile(tmp: Path, run: Path, gguf: Path) -> dict[str, tuple[list[str], str]]:
    (tmp / "not.gguf").write_text("hello")
    (tmp / "folder.gguf").mkdir()
    model = ["--model", SMOL, "--twin", "--data", "quickstart"]
    return {
        "missing": ([*model, "--gguf", str(tmp / "nope.gguf")], "no such file"),
        "a_folder": ([*model, "--gguf", str(tmp / "folder.gguf")], "not a file"),
        "not_gguf": ([*model, "--gguf", str(tmp / "not.gguf")], "not a GGUF file"),
        "device": ([*model, "--gguf", "/dev/null"], "not a file" if not Path("/dev/null").is_file() else "GGUF"),
        "empty": ([*model, "--gguf", ""], "--gguf"),
        "with_adapter": ([*model, "--gguf", str(gguf), "--adapter", str(run / "lora")], "not --adapter and --gguf"),
        "with_lm_eval": (["--run", str(run), "--gguf", str(gguf), "--lm-eval", "arc_easy"],
                         "lm-evaluation-harness runs"),
        "run_with_model": (["--run", str(run), "--gguf", str(gguf), "--model", SMOL, "--twin"], "a run folder names"),
    }


CASES = ["missing", "a_folder", "not_gguf", "device", "empty", "with_adapter", "with_lm_eval", "run_with_model"]


@pytest.mark.parametrize("case", CASES)
def test_bad_gguf_input_exits_2_before_any_model_loads(case, run_with_gguf, tmp_path, capsys, monkeypatch):
    run, gguf = run_with_gguf
    argv, message = _hostile(tmp_path, run, gguf)[case]

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(FastModel, "from_pretrained", refuse)
    rc = _main(["eval", *argv])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert message in err, err


def test_without_llama_cpp_the_install_line_is_given(run_with_gguf, capsys, monkeypatch):
    import sys

    run, gguf = run_with_gguf
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    assert _main(["eval", "--run", str(run), "--gguf", str(gguf)]) == 2
    assert "llama-cpp-python, which is not installed" in capsys.readouterr().err


def test_the_matrix_lists_every_case(run_with_gguf, tmp_path):
    assert sorted(_hostile(tmp_path, *run_with_gguf)) == sorted(CASES)


def test_a_row_longer_than_the_context_is_refused(models):
    from fastkit.errors import FastkitError

    base, _, tok, path = models
    gguf = load_gguf(path, base, tok, n_ctx=16)
    try:
        assert isinstance(gguf, LlamaCppModel)
        with pytest.raises(FastkitError, match="longer than the context"):
            gguf(input_ids=torch.ones(1, 17, dtype=torch.long))
    finally:
        gguf.close()
