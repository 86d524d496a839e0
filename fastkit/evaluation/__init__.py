"""Did it work, and what did it cost? The base and the tuned model side by side on held-out rows.

    report = fastkit.evaluate(model, tokenizer, heldout_rows)   # a LoRA model: base = its adapter disabled
    report                                                     # a table in a notebook
    report.save("outputs/eval")                                # report.md, results.json, plot.png

What it measures (docs/eval.md): the loss and perplexity on the answers' tokens; greedy and seeded answers checked
for exact match, containing the reference, and the user's checks (``json``, ``regex:...``, ``file.py:fn``); the
prompts whose answers changed most; forgetting (:mod:`fastkit.evaluation.forgetting`); with ``lm_eval=TASKS``,
lm-evaluation-harness benchmarks on both (:mod:`fastkit.evaluation.lm_eval`). Rows are scored one at a
time, base then tuned, so Ctrl-C leaves a report of the rows done.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import time
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import torch

from fastkit.errors import FastkitError
from fastkit.evaluation.checks import BUILT_IN, Check, parse_checks
from fastkit.evaluation.forgetting import FORGETTING_WARN, GENERAL_PROMPTS, Forgetting
from fastkit.evaluation.report import EvalReport, Example
from fastkit.evaluation.rows import EvalRow, eval_rows
from fastkit.evaluation.score import Generation, RowResult, score_row

logger = logging.getLogger("fastkit")


@dataclass
class EvalOptions:
    """What an evaluation runs."""

    max_rows: int = 64
    """Held-out rows scored (the first ones)."""
    max_new_tokens: int = 128
    """At most this many tokens per generated answer."""
    checks: tuple[str, ...] = ()
    """The user's checks on each answer, besides exact match and contains: ``json``, ``regex:PATTERN``,
    ``path/to/file.py:function`` or ``module:function`` (``fn(answer[, reference[, prompt]]) -> bool``)."""
    sampled: bool = True
    """Also one sampled answer per row (temperature 0.7, top_p 0.95), seeded per row."""
    seed: int = 0
    """Row i's sampled answer uses seed + i, for both models."""
    examples: int = 5
    """How many prompts to show side by side (the ones whose answers changed most)."""
    forgetting: bool = True
    """Measure forgetting on general text and drift on general prompts (:mod:`fastkit.evaluation.forgetting`)."""
    forgetting_tokens: int = 48
    """Tokens of the base model's answer per general prompt (drift)."""
    forgetting_warn: float = FORGETTING_WARN
    """Forgetting (the general text's loss rise, nats/token) above which the report warns."""
    lm_eval: tuple[str, ...] = ()
    """lm-evaluation-harness tasks run on both models (``hellaswag``, ``arc_easy``, a local task's name; the ``eval``
    extra; :mod:`fastkit.evaluation.lm_eval`); none by default."""
    lm_eval_include: str | None = None
    """A folder of local lm-eval task YAML files (lm-eval's ``include_path``)."""
    lm_eval_limit: int | None = None
    """Rows per lm-eval task at most (lm-eval's ``limit``); None: every row."""

    def check(self) -> None:
        """A FastkitError naming the first field out of range."""
        for name in ("max_rows", "max_new_tokens", "forgetting_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise FastkitError(f"evaluate: {name} must be a whole number >= 1, got {value!r}.")
        if isinstance(self.examples, bool) or not isinstance(self.examples, int) or self.examples < 0:
            raise FastkitError(f"evaluate: examples must be a whole number >= 0, got {self.examples!r}.")
        if not isinstance(self.forgetting_warn, (int, float)) or not self.forgetting_warn > 0:
            raise FastkitError(f"evaluate: forgetting_warn must be a number above 0, got {self.forgetting_warn!r}.")
        limit = self.lm_eval_limit
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise FastkitError(f"evaluate: lm_eval_limit must be a whole number >= 1 or None, got {limit!r}.")


def _options(options: EvalOptions | None, kwargs: dict[str, Any]) -> EvalOptions:
    known = {f.name for f in fields(EvalOptions)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise FastkitError(f"evaluate: unknown option(s) {', '.join(unknown)}; the options are "
                           f"{', '.join(sorted(known))}.")
    out = replace(options or EvalOptions(), **kwargs)
    if isinstance(out.checks, str):
        out.checks = tuple(s.strip() for s in out.checks.split(",") if s.strip())
    from fastkit.evaluation.lm_eval import task_names

    out.lm_eval = task_names(out.lm_eval)
    out.check()
    return out


@contextlib.contextmanager
def _as_base(model: torch.nn.Module, base: torch.nn.Module | None):
    """The base model: ``base`` when given, else ``model`` with its LoRA adapter disabled."""
    if base is not None:
        yield base
        return
    with model.disable_adapter():
        yield model


def _check_models(model: torch.nn.Module, base: torch.nn.Module | None) -> None:
    if base is None and not callable(getattr(model, "disable_adapter", None)):
        raise FastkitError("evaluate: the model has no LoRA adapter to disable, so there is no base to compare "
                           "with; pass the base model too: evaluate(tuned, tokenizer, rows, base=base_model).")
    if base is model:
        raise FastkitError("evaluate: base= is the tuned model itself; pass the model before training, or leave "
                           "base out to compare a LoRA model with its adapter disabled.")


def evaluate(model: torch.nn.Module, tokenizer, data, *, base: torch.nn.Module | None = None,
             options: EvalOptions | None = None, output_dir: str | None = None, **kwargs: Any) -> EvalReport:
    """The tuned ``model`` and its base side by side on held-out ``data`` (a Dataset, a list of rows or anything
    ``fastkit`` reads as training data: a file, a folder). ``base``: the model before training; left out, a LoRA
    model's adapter is disabled for the base's answers. Options: :class:`EvalOptions` fields as keywords.
    ``output_dir``: where to save the report (:meth:`EvalReport.save`)."""
    options = _options(options, kwargs)
    _check_models(model, base)
    if options.lm_eval and not isinstance(model, torch.nn.Module):
        raise FastkitError(f"evaluate: lm_eval runs on a transformers model, not on {type(model).__name__} (a GGUF "
                           "in llama.cpp); run it on the merged model or the LoRA, and the GGUF without lm_eval.")
    checks = list(BUILT_IN) + parse_checks(options.checks, "checks")
    if options.lm_eval:  # installed, the names known, the folder there: before any model runs
        from fastkit.evaluation import lm_eval as lm

        lm.resolve(options.lm_eval, options.lm_eval_include)
    rows = eval_rows(_dataset(data), tokenizer, options.max_rows)
    gen = Generation(options.max_new_tokens, options.sampled, options.seed)
    modes = _eval_mode(model, base)
    try:
        results, interrupted = _score_rows(model, base, tokenizer, rows, gen)
        forgetting = None
        if options.forgetting and not interrupted:
            forgetting = _forgetting(model, base, tokenizer, options)
        benchmarks = _benchmarks(model, base, tokenizer, options) if options.lm_eval and not interrupted else {}
    finally:
        for m, was_training in modes:
            m.train(was_training)
    report = _report(rows[:len(results)], results, checks, tokenizer, options, forgetting, interrupted)
    report.benchmarks = benchmarks
    report.tuned = getattr(model, "label", "")
    if output_dir is not None:
        report.save(output_dir)
        logger.info("fastkit eval: report in %s", output_dir)
    return report


def evaluate_run(trainer, options: EvalOptions | None = None) -> EvalReport:
    """``fit(compare=True)``: a fastkit trainer's model (its LoRA adapter disabled for the base) on the run's own eval
    set, as the run tokenized it (packed rows split back into documents); the report in ``output_dir/eval``."""
    import os

    model = trainer.accelerator.unwrap_model(trainer.model)
    if trainer.eval_dataset is None:
        raise FastkitError("compare needs the run's eval set: give eval_split or eval_dataset.")
    out = os.path.join(trainer.args.output_dir, "eval")
    logger.info("fastkit: comparing base and tuned on the run's held-out rows (report in %s)", out)
    return evaluate(model, trainer.processing_class, trainer.eval_dataset, options=options, output_dir=out)


def _dataset(data):
    if isinstance(data, list) or hasattr(data, "column_names"):
        return data
    from fastkit.data.read import load_chat_dataset

    return load_chat_dataset(data, split="test")


def _eval_mode(model, base) -> list[tuple[torch.nn.Module, bool]]:
    modes = [(m, m.training) for m in (model, base) if m is not None]
    for m, _ in modes:
        m.eval()
    return modes


def _score_rows(model, base, tokenizer, rows: list[EvalRow], gen: Generation):
    """``([(base result, tuned result)] per row, interrupted)``; Ctrl-C after the first row keeps the rows done."""
    results: list[tuple[RowResult, RowResult]] = []
    start, every = time.perf_counter(), max(1, len(rows) // 10)
    try:
        for i, row in enumerate(rows, 1):
            with _as_base(model, base) as before:
                base_result = score_row(before, tokenizer, row, gen)
            results.append((base_result, score_row(model, tokenizer, row, gen)))
            if i % every == 0 or i == len(rows):
                logger.info("fastkit eval: %d/%d rows (base and tuned), %.0f s", i, len(rows),
                            time.perf_counter() - start)
    except KeyboardInterrupt:
        if not results:
            raise
        logger.warning("fastkit eval: interrupted after %d of %d rows; the report covers those", len(results),
                       len(rows))
        return results, True
    return results, False


def _forgetting(model, base, tokenizer, options: EvalOptions) -> Forgetting:
    from fastkit.evaluation import forgetting as fg

    result = fg.summarize(_text_sums(model, base, tokenizer), _drift_sums(model, base, tokenizer, options),
                          options.forgetting_warn)
    if result.warned:
        logger.warning("fastkit eval: forgetting %.3f nats/token (the loss on general text rose from perplexity %.2f "
                       "to %.2f) is above %s: the tuned model may have lost what it could do before (docs/eval.md)",
                       result.forgetting, result.base_text_perplexity, result.tuned_text_perplexity,
                       options.forgetting_warn)
    return result


def _benchmarks(model, base, tokenizer, options: EvalOptions) -> dict[str, dict[str, tuple[float, float]]]:
    """lm-eval's tasks on the base, then on the tuned model: ``{task: {metric: (base, tuned)}}``."""
    from fastkit.evaluation import lm_eval as lm

    args = (options.lm_eval, options.lm_eval_include)
    logger.info("fastkit eval: lm-eval %s on the base and the tuned model", ", ".join(options.lm_eval))
    with _as_base(model, base) as before:
        base_scores = lm.run(before, tokenizer, *args, limit=options.lm_eval_limit)
    return lm.side_by_side(base_scores, lm.run(model, tokenizer, *args, limit=options.lm_eval_limit))


def _text_sums(model, base, tokenizer) -> tuple[float, float, int]:
    """``(NLL under base, NLL under tuned, tokens)`` over the general text, each paragraph scored as plain text."""
    from fastkit.evaluation import forgetting as fg
    from fastkit.evaluation.general_text import GENERAL_TEXT

    base_nll = tuned_nll = 0.0
    tokens = 0
    for text in GENERAL_TEXT:
        ids = fg.text_ids(tokenizer, text)
        with _as_base(model, base) as before:
            base_lp = fg.answer_log_probs(before, ids[:1], ids[1:])  # every token after the first is scored
        _, b, t = fg.drift_terms(base_lp, fg.answer_log_probs(model, ids[:1], ids[1:]), ids[1:])
        base_nll, tuned_nll, tokens = base_nll + b, tuned_nll + t, tokens + len(ids) - 1
    return base_nll, tuned_nll, tokens


def _drift_sums(model, base, tokenizer, options: EvalOptions) -> tuple[float, float, float, int]:
    """``(KL, NLL under base, NLL under tuned, tokens)`` over the base's greedy answers to the general prompts."""
    from fastkit.evaluation import forgetting as fg

    sums = [0.0, 0.0, 0.0]
    tokens = 0
    for prompt in GENERAL_PROMPTS:
        ids = fg.probe_ids(tokenizer, prompt)
        with _as_base(model, base) as before:
            answer = fg.base_answer(before, tokenizer, ids, options.forgetting_tokens)
            if not answer:
                continue
            base_lp = fg.answer_log_probs(before, ids, answer)
        tuned_lp = fg.answer_log_probs(model, ids, answer)
        for k, value in enumerate(fg.drift_terms(base_lp, tuned_lp, answer)):
            sums[k] += value
        tokens += len(answer)
    return sums[0], sums[1], sums[2], tokens


def _report(rows, results, checks: list[Check], tokenizer, options: EvalOptions, forgetting, interrupted) -> EvalReport:
    metrics: dict[str, tuple[float, float]] = {}
    loss = tuple(sum(r[k].nll for r in results) / max(sum(r[k].tokens for r in results), 1) for k in (0, 1))
    metrics["loss"] = loss
    metrics["perplexity"] = tuple(float(torch.tensor(x).exp()) for x in loss)
    asked = [(row, pair) for row, pair in zip(rows, results) if row.prompt_ids]
    texts = {row.index: (_decode(tokenizer, row.prompt_ids), _decode(tokenizer, row.reference_ids)) for row, _ in asked}
    passes: dict[int, dict[str, tuple[bool, bool]]] = {}
    for mode in ("greedy", "sampled") if options.sampled else ("greedy",):
        for check in checks:
            name = check.name + (" (sampled)" if mode == "sampled" else "")
            got = {row.index: tuple(check.fn(getattr(r, mode), texts[row.index][1], texts[row.index][0])
                                    for r in pair) for row, pair in asked}
            if asked:
                metrics[name] = tuple(sum(g[k] for g in got.values()) / len(asked) for k in (0, 1))
            if mode == "greedy":
                for index, flags in got.items():
                    passes.setdefault(index, {})[name] = flags
    examples = _examples(asked, texts, passes, options.examples)
    return EvalReport(len(results), metrics, examples, forgetting, interrupted, asdict(options))


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True).strip()


def _examples(asked, texts, passes, n: int) -> list[Example]:
    """The ``n`` rows whose greedy answers changed most: checks that flipped, then how different the texts are."""
    out = []
    for row, (before, after) in asked:
        flipped = sum(b != t for b, t in passes.get(row.index, {}).values())
        differ = 1 - difflib.SequenceMatcher(None, before.greedy, after.greedy).ratio()
        if flipped + differ == 0:
            continue  # the same answer and the same checks: nothing to show
        prompt, reference = texts[row.index]
        out.append(Example(row.index, prompt[-300:], reference, before.greedy, after.greedy, flipped + differ))
    out.sort(key=lambda e: (-e.change, e.row))
    return out[:n]


__all__ = ["EvalOptions", "EvalReport", "Example", "Forgetting", "evaluate", "evaluate_run"]
