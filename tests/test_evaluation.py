"""fastkit.evaluate: base and tuned side by side on held-out rows (issue 57).

Each metric is checked both ways (a check that always passed, or never, is red here), the loss is the training
loss's own number, the base is the model without its adapter, forgetting is 0 for an untouched adapter and grows
with a changed one, and a Ctrl-C keeps the rows done. Tiny twins; the real-model proof is in docs/eval.md.
"""

import copy
import dataclasses
import json
import math

import pytest
import torch

from fastkit import FastkitError, FastModel
from fastkit.evaluation import EvalOptions, evaluate
from fastkit.evaluation import checks as ck
from fastkit.evaluation.forgetting import FORGETTING_WARN
from fastkit.evaluation.general_text import GENERAL_TEXT
from fastkit.evaluation.report import EvalReport
from fastkit.evaluation.rows import EvalRow, eval_rows, last_span
from fastkit.evaluation.score import RowResult, answer_nll
from fastkit.quickstart.data import heldout_records

SMOL = "HuggingFaceTB/SmolLM2-135M-Instruct"
FAST = dict(max_rows=3, max_new_tokens=6, forgetting_tokens=6, sampled=False)


@pytest.fixture(scope="module")
def lora():
    torch.manual_seed(0)
    model, tok = FastModel.from_pretrained(SMOL, max_seq_length=128, twin=True)
    return FastModel.get_peft_model(model, r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"]), tok


def _nudge(model, scale: float) -> dict:
    """LoRA B weights set to ``scale`` x a fixed random tensor; returns the old ones (to restore)."""
    old = {}
    g = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            old[name] = p.detach().clone()
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return old


def _restore(model, old: dict) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in old:
                p.copy_(old[name])


# ---- the checks: each passes and fails ---------------------------------------------------------------------------

@pytest.mark.parametrize(("fn", "answer", "reference", "want"), [
    (ck.exact, " The capital is Paris. ", "the capital is paris", True),
    (ck.exact, "The capital is Paris, I think", "The capital is Paris", False),
    (ck.contains, "I am sure it is Paris.", "paris", True),
    (ck.contains, "It is Lyon.", "Paris", False),
    (ck.contains, "anything", "", False),
    (ck.valid_json, '{"a": 1}', "", True),
    (ck.valid_json, '{"a": 1', "", False),
])
def test_built_in_checks_pass_and_fail(fn, answer, reference, want):
    assert fn(answer, reference, "") is want


def test_user_checks_by_name_pass_and_fail(tmp_path, monkeypatch):
    (tmp_path / "mychecks.py").write_text(
        "def short(answer):\n    return len(answer) < 10\n"
        "def score(answer, reference, prompt):\n    return 0.5 if prompt in answer else 0\n"
        "def bad(answer):\n    return 'yes'\n")
    monkeypatch.chdir(tmp_path)
    regex, short, score, bad = ck.parse_checks("regex:^\\{,mychecks.py:short,mychecks.py:score,mychecks.py:bad")
    assert regex.fn("{x", "", "") and not regex.fn("x{", "", "")
    assert short.fn("tiny", "", "") and not short.fn("far too long here", "", "")
    assert score.fn("q: hi", "", "q:") and not score.fn("hi", "", "q:")
    with pytest.raises(FastkitError, match="returned 'yes'.*True/False"):
        bad.fn("a", "", "")


@pytest.mark.parametrize(("spec", "match"), [
    ("regex:(", "not a regular expression"),
    ("nosuch.py:fn", "cannot import 'nosuch.py'.*no such file"),
    ("json:fn", "cannot import 'json'|has no function"),
    ("fastkit.evaluation.checks:nothing", "has no function 'nothing'"),
    ("exact", "runs on every answer already"),
    ("bleu", "unknown check 'bleu'"),
    ("", "is not a check"),
])
def test_a_check_that_cannot_run_is_refused_by_name(spec, match):
    with pytest.raises(FastkitError, match=match):
        ck.parse_checks([spec])


# ---- rows ---------------------------------------------------------------------------------------------------------

def test_last_span():
    assert last_span([0, 1, 1, 0, 1, 1, 1, 0]) == (4, 7)
    assert last_span([1, 1]) == (0, 2)
    assert last_span([0, 0]) == (0, 0)


def test_rows_split_at_the_last_answer_as_training_tokenizes(lora):
    _, tok = lora
    rows = eval_rows(heldout_records()[:2], tok)
    for row in rows:
        assert row.mask[row.answer_start:row.answer_end] == [1] * len(row.reference_ids)
        assert not any(row.mask[:row.answer_start])
        assert '"topic"' in tok.decode(row.reference_ids)
        assert tok.decode(row.prompt_ids).rstrip().endswith("assistant")  # the template's header: answer next
    with pytest.raises(FastkitError, match="no rows"):
        eval_rows([], tok)


def test_the_loss_is_the_training_loss(lora):
    """answer_nll / tokens equals transformers' own loss with the non-answer tokens labelled -100."""
    model, tok = lora
    row = eval_rows(heldout_records()[:1], tok)[0]
    nll, n = answer_nll(model, row)
    ids = torch.tensor([row.input_ids])
    labels = ids.masked_fill(torch.tensor([row.mask]) == 0, -100)
    with torch.no_grad():
        want = model(input_ids=ids, labels=labels).loss
    assert n == sum(row.mask[1:])
    assert nll / n == pytest.approx(float(want), rel=1e-5)


# ---- the report's numbers -----------------------------------------------------------------------------------------

def test_metrics_count_passes_per_model():
    """Base answers wrong, tuned right on one row of two: the table says 0% -> 50% and the tuned model is ahead."""
    from fastkit.evaluation import _report

    class Tok:
        @staticmethod
        def decode(ids, skip_special_tokens=True):
            return {1: "Q?", 2: "Paris"}[ids[0]] if ids else ""

    rows = [EvalRow(1, [1, 2], [0, 1], 1, 2), EvalRow(2, [1, 2], [0, 1], 1, 2)]
    results = [(RowResult(2.0, 1, "Lyon", None), RowResult(1.0, 1, "Paris", None)),
               (RowResult(2.0, 1, "{}", None), RowResult(1.0, 1, "Lyon", None))]
    report = _report(rows, results, list(ck.BUILT_IN) + ck.parse_checks("json"), Tok(),
                     EvalOptions(sampled=False), None, False)
    assert report.metrics["exact"] == (0.0, 0.5) and report.metrics["contains"] == (0.0, 0.5)
    assert report.metrics["json"] == (0.5, 0.0)
    assert report.metrics["loss"] == (2.0, 1.0) and report.ahead("loss") and report.ahead("exact")
    assert not report.ahead("json")
    assert [e.row for e in report.examples] == [1, 2]  # row 1 flipped two checks, row 2 one
    assert "| exact | 0% | 50% | +50 pts |" in report.table()


# ---- whole evaluations on a twin ----------------------------------------------------------------------------------

def test_an_untouched_adapter_equals_its_base(lora):
    model, tok = lora
    report = evaluate(model, tok, heldout_records(), **FAST)
    assert report.rows == 3
    for name, (base, tuned) in report.metrics.items():
        assert base == pytest.approx(tuned, abs=1e-6), name
    assert report.forgetting.drift == pytest.approx(0, abs=1e-6) and not report.forgetting.warned
    assert report.forgetting.forgetting == pytest.approx(0, abs=1e-6) and report.forgetting.text_tokens > 500
    assert report.examples == []  # nothing changed, nothing to show


def test_a_changed_adapter_drifts_and_the_base_is_the_model_without_it(lora):
    model, tok = lora
    old = _nudge(model, 0.05)
    try:
        report = evaluate(model, tok, heldout_records(), **FAST)
        plain, _ = FastModel.from_pretrained(SMOL, max_seq_length=128, twin=True)  # the same seeded twin weights
        plain.load_state_dict({k.replace("base_model.model.", "").replace(".base_layer", ""): v
                               for k, v in model.state_dict().items() if "lora_" not in k})
        separate = evaluate(model, tok, heldout_records(), base=plain, **FAST)
    finally:
        _restore(model, old)
    base_loss, tuned_loss = report.metrics["loss"]
    assert base_loss != pytest.approx(tuned_loss, abs=1e-4)
    assert report.forgetting.drift > 1e-4
    assert report.forgetting.tuned_perplexity != pytest.approx(report.forgetting.base_perplexity)
    assert report.forgetting.forgetting != pytest.approx(0, abs=1e-5)
    assert separate.metrics["loss"] == pytest.approx(report.metrics["loss"], rel=1e-5)
    assert separate.forgetting.drift == pytest.approx(report.forgetting.drift, rel=1e-4)
    assert separate.forgetting.forgetting == pytest.approx(report.forgetting.forgetting, rel=1e-4)


# ---- forgetting: a model that knows the general text, scrambled -------------------------------------------------

@pytest.fixture(scope="module")
def knows_the_text():
    """A twin trained for a few steps on the general text: it reads it better than chance, so it has something to
    forget."""
    torch.manual_seed(0)
    model, tok = FastModel.from_pretrained(SMOL, max_seq_length=128, twin=True)
    rows = [tok(text)["input_ids"] for text in GENERAL_TEXT]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])  # [36, width]
    labels = torch.tensor([r + [-100] * (width - len(r)) for r in rows])  # padding not learned
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(20):
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval(), tok


def _scrambled(model):
    """A copy with every weight tensor's entries shuffled."""
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in out.parameters():
            p.copy_(p.flatten()[torch.randperm(p.numel(), generator=g)].view_as(p))
    return out


@torch.no_grad()
def _text_loss(model, tok) -> tuple[float, int]:
    """transformers' own loss over the general text, summed per token (every token after each paragraph's first)."""
    total, tokens = 0.0, 0
    for text in GENERAL_TEXT:
        ids = torch.tensor([tok(text)["input_ids"]])
        total += float(model(input_ids=ids, labels=ids).loss) * (ids.shape[1] - 1)
        tokens += ids.shape[1] - 1
    return total, tokens


def test_scrambled_weights_forget_and_warn(knows_the_text, caplog):
    model, tok = knows_the_text
    scrambled = _scrambled(model)
    report = evaluate(scrambled, tok, heldout_records(), base=model, **FAST)
    f = report.forgetting
    (base_nll, n), (tuned_nll, _) = _text_loss(model, tok), _text_loss(scrambled, tok)
    assert f.forgetting == pytest.approx((tuned_nll - base_nll) / n, rel=1e-4) and f.text_tokens == n
    assert f.forgetting > 3 * FORGETTING_WARN and f.warned and f.threshold == FORGETTING_WARN
    assert f.tuned_text_perplexity > f.base_text_perplexity
    assert "WARNING" in report.summary() and "may have lost what it could do before" in caplog.text
    assert report.to_dict()["forgetting"]["warned"] is True


def test_an_identical_model_forgets_nothing(knows_the_text, caplog):
    model, tok = knows_the_text
    report = evaluate(copy.deepcopy(model), tok, heldout_records(), base=model, **FAST)
    f = report.forgetting
    assert f.forgetting == pytest.approx(0, abs=1e-6) and f.drift == pytest.approx(0, abs=1e-6) and not f.warned
    assert f.base_text_perplexity == pytest.approx(f.tuned_text_perplexity)
    assert "WARNING" not in report.summary() and "may have lost" not in caplog.text


@pytest.mark.parametrize(("tuned_nll", "warned"), [(12.9, False), (13.1, True), (7.0, False)])
def test_the_warning_is_the_text_loss_rise_against_the_threshold(tuned_nll, warned):
    from fastkit.evaluation.forgetting import summarize
    from fastkit.evaluation.report import forgetting_line

    f = summarize((10.0, tuned_nll, 10), (50.0, 5.0, 9.0, 10), threshold=0.3)  # drift 5.0 alone never warns
    assert f.forgetting == pytest.approx((tuned_nll - 10.0) / 10) and f.drift == pytest.approx(5.0)
    assert f.base_text_perplexity == pytest.approx(math.e) and f.tuned_perplexity == pytest.approx(math.exp(0.9))
    assert f.warned is warned and ("WARNING" in forgetting_line(f)) is warned


def test_sampled_answers_are_seeded_and_the_callers_rng_untouched(lora):
    model, tok = lora
    old = _nudge(model, 0.05)
    try:
        torch.manual_seed(123)
        state = torch.get_rng_state()
        runs = [evaluate(model, tok, heldout_records(), max_rows=2, max_new_tokens=6, forgetting=False, seed=s)
                for s in (0, 0, 5)]
        assert torch.equal(torch.get_rng_state(), state)
    finally:
        _restore(model, old)
    assert runs[0].to_dict() == runs[1].to_dict()
    assert "exact (sampled)" in runs[0].metrics


def test_ctrl_c_keeps_the_rows_done(lora, monkeypatch):
    import fastkit.evaluation as ev

    model, tok = lora
    calls = {"n": 0}
    real = ev.score_row

    def interrupting(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # row 2's base
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(ev, "score_row", interrupting)
    report = evaluate(model, tok, heldout_records(), **FAST)
    assert report.rows == 1 and report.interrupted and report.forgetting is None
    assert "(interrupted)" in report.summary()
    assert model.training is True or model.training is False  # mode restored below
    calls["n"] = 0
    monkeypatch.setattr(ev, "score_row", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):  # nothing done: nothing to report
        evaluate(model, tok, heldout_records(), **FAST)


def test_train_mode_restored(lora):
    model, tok = lora
    model.train()
    evaluate(model, tok, heldout_records(), max_rows=1, max_new_tokens=2, forgetting=False, sampled=False)
    assert model.training


def test_save_writes_the_report(lora, tmp_path):
    model, tok = lora
    report = evaluate(model, tok, heldout_records(), output_dir=str(tmp_path / "eval"), **FAST)
    files = sorted(p.name for p in (tmp_path / "eval").iterdir())
    assert files == ["plot.png", "report.md", "results.json"]
    saved = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert saved == json.loads(json.dumps(report.to_dict()))
    assert report.table() in (tmp_path / "eval" / "report.md").read_text()
    assert (tmp_path / "eval" / "plot.png").read_bytes()[:4] == b"\x89PNG"
    assert "<table>" in report._repr_html_()


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(max_rows=0), "max_rows must be a whole number >= 1"),
    (dict(max_new_tokens=1.5), "max_new_tokens must be a whole number"),
    (dict(examples=-1), "examples must be"),
    (dict(forgetting_warn=0), "forgetting_warn must be a number above 0"),
    (dict(tempreature=0.3), "unknown option"),
    (dict(checks="regex:("), "not a regular expression"),
])
def test_bad_options_are_refused_before_any_model_runs(lora, kwargs, match, monkeypatch):
    import fastkit.evaluation as ev

    model, tok = lora
    monkeypatch.setattr(ev, "score_row", lambda *a, **k: pytest.fail("a model ran"))
    with pytest.raises(FastkitError, match=match):
        evaluate(model, tok, heldout_records(), **kwargs)


def test_no_base_to_compare_is_refused(lora):
    model, tok = lora
    plain, _ = FastModel.from_pretrained(SMOL, max_seq_length=128, twin=True)
    with pytest.raises(FastkitError, match="no LoRA adapter to disable.*base="):
        evaluate(plain, tok, heldout_records())
    with pytest.raises(FastkitError, match="base= is the tuned model itself"):
        evaluate(model, tok, heldout_records(), base=model)
    with pytest.raises(FastkitError, match="row 1 trains no token"):
        evaluate(model, tok, [{"input_ids": [1, 2, 3], "completion_mask": [0, 0, 0]}], **FAST)


def test_report_type():
    assert EvalReport(0, {}).summary().startswith("# Before / after: 0 held-out rows")


# ---- after a run: fit(compare=True) -------------------------------------------------------------------------------

def _trainer(lora, tmp_path, **kwargs):
    """make_trainer on a LoRA twin of its own: a run trains its adapter, and the module's shared ``lora`` model must
    stay untouched for the tests above, whatever the order (FASTKIT_TEST_ORDER=reverse ran a fit first)."""
    from fastkit.quickstart.data import quickstart_dataset
    from fastkit.training import make_trainer

    _, tok = lora
    torch.manual_seed(0)
    model, _ = FastModel.from_pretrained(SMOL, max_seq_length=128, twin=True)
    model = FastModel.get_peft_model(model, r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"])
    train, _ = quickstart_dataset()
    return make_trainer(model, tok, train, max_steps=1, max_seq_length=128, output_dir=str(tmp_path / "run"),
                        **kwargs)


def test_the_runs_packed_eval_set_is_split_back_into_its_documents(lora, tmp_path):
    """Every document of the packed eval set is one held-out row exactly as training tokenized it."""
    from fastkit.data.formats import row_tokens
    from fastkit.evaluation.rows import unpacked
    from fastkit.quickstart.data import quickstart_dataset

    _, tok = lora
    trainer = _trainer(lora, tmp_path, eval_split=6)
    assert "seq_lengths" in trainer.eval_dataset.column_names  # packed: several documents per row
    docs = unpacked(trainer.eval_dataset)
    assert len(docs) == 6
    train, _ = quickstart_dataset()
    every = {tuple(row_tokens(dict(r), tok)[0]) for r in train}
    for doc in docs:
        ids, mask = row_tokens(doc, tok)
        assert tuple(ids) in every and any(mask)
    assert len(unpacked(trainer.eval_dataset, max_rows=4)) == 4


def test_compare_without_an_eval_set_is_refused_before_training(lora, tmp_path):
    with pytest.raises(FastkitError, match="compare=True .*no eval set.*eval_split"):
        _trainer(lora, tmp_path, compare=True)
    from fastkit import fit

    trainer = _trainer(lora, tmp_path)
    with pytest.raises(FastkitError, match="fit\\(compare=True\\).*no eval set"):
        fit(trainer, view="none", compare=True)
    assert trainer.state.global_step == 0


def test_compare_after_a_run_reports_in_its_folder(lora, tmp_path, monkeypatch):
    import fastkit.evaluation as ev
    from fastkit import fit

    @dataclasses.dataclass
    class Short(EvalOptions):  # a short comparison
        max_rows: int = 3
        max_new_tokens: int = 6
        forgetting_tokens: int = 6
        sampled: bool = False

    monkeypatch.setattr(ev, "EvalOptions", Short)
    trainer = _trainer(lora, tmp_path, eval_split=4, compare=True)
    metrics = fit(trainer, view="none")
    assert metrics.status == "finished" and metrics.comparison.rows == 3
    assert (tmp_path / "run" / "eval" / "results.json").is_file()
    assert fit(_trainer(lora, tmp_path, eval_split=4), view="none").comparison is None  # not asked: not run
