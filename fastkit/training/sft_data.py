"""The SFT trainer's rows: checked (:func:`fastkit.data.check_dataset`) and tokenized once, an eval set held out
or checked like them, and the options that need rows of a kind (a stream, an eval set, packing) refused before any
work."""

from __future__ import annotations

from typing import Any

import torch

from fastkit.data import check_dataset
from fastkit.data.stream import is_stream
from fastkit.errors import FastkitError
from fastkit.patching import active_patches, report, unwrap
from fastkit.training.options import TrainOptions


def check_stream_options(train_dataset, options: TrainOptions, epochs: float | None) -> None:
    """What a stream (an IterableDataset: its length unknown) cannot do, refused before any work."""
    if not is_stream(train_dataset):
        return
    if epochs is not None:
        raise FastkitError(f"epochs={epochs:g} needs the data's length, which a stream (streaming=True, an "
                           "IterableDataset) does not know ahead; give max_steps instead.")
    if options.eval_split:
        raise FastkitError("eval_split holds rows out of a dataset whose length is known, and the training data is "
                           "a stream (streaming=True): give make_trainer an eval_dataset (a file, a Dataset or a "
                           "stream) instead, or train without streaming.")


def _check_eval_options(options: TrainOptions, eval_dataset) -> None:
    """Options that need an eval set, refused without one (before any work)."""
    has_eval = eval_dataset is not None or bool(options.eval_split)
    if options.eval_steps is not None and not has_eval:
        raise FastkitError("eval_steps is set but there is no eval set: give eval_dataset or eval_split "
                           "(or drop eval_steps).")
    if options.early_stopping_patience is not None and not has_eval:
        raise FastkitError("early_stopping_patience watches the eval loss, but there is no eval set: give "
                           "eval_dataset or eval_split (or drop early_stopping_patience).")
    if options.compare and not has_eval:
        raise FastkitError("compare=True compares base and tuned on held-out rows, but there is no eval set: give "
                           "eval_split (0.05, or a number of rows) or eval_dataset (or drop compare).")
    if eval_dataset is not None and options.eval_split:
        raise FastkitError("Give eval_dataset or eval_split, not both.")


def _check_packing_supported(model: torch.nn.Module, packing: bool) -> None:
    """packing=True on a model without fastkit's packing patch would let packed documents attend to each other."""
    base = unwrap(model)
    if packing and "packing" not in active_patches(base) and getattr(base.config, "model_type", None) is not None:
        rep = report(base)
        why = "" if rep is None else next(iter(v for k, v in rep.skipped.items() if k in ("packing", "all")), "")
        raise FastkitError(f"packing=True, but model_type {base.config.model_type!r} has no active fastkit packing "
                           f"patch{f' ({why})' if why else ''}, so packed documents would attend to each other. Pass "
                           "packing=False (or load the model through FastModel with patches='auto' for a family in "
                           "fastkit's table, docs/coverage.md).")


def _pre_tokenize(args) -> bool:
    """Whether fastkit hands TRL its rows tokenized (as TRL would tokenize them, so TRL skips it): unless TRL's own
    tokenization differs from plain rows' (assistant-only masks, another chat template, another text field)."""
    return not (args.assistant_only_loss or getattr(args, "chat_template_path", None)
                or args.dataset_text_field != "text" or (args.dataset_kwargs or {}).get("skip_prepare_dataset"))


def _checked_data(options: TrainOptions, train_dataset, eval_dataset, tokenizer, max_seq_length: int,
                  tokenize: bool = False):
    """(train, eval) checked by :func:`fastkit.data.check_dataset`; ``eval_split`` rows held out of train.
    ``tokenize``: both returned tokenized (``check_dataset(tokenize=True)``)."""
    check = dict(packing=options.packing, drop_long=options.drop_long, drop_invalid=options.drop_invalid,
                 tokenize=tokenize)
    dataset = check_dataset(train_dataset, tokenizer, max_seq_length, **check)
    dataset, split = split_eval(dataset, None, options.eval_split, options.seed)
    if eval_dataset is not None:
        return dataset, check_dataset(eval_dataset, tokenizer, max_seq_length, where="eval_dataset", **check)
    return dataset, split


def _arrives_tokenized(data: Any) -> bool:
    """Whether the caller's data came with its own ``input_ids`` (a Dataset, a dict of columns or dict rows)."""
    if isinstance(data, dict):
        return "input_ids" in data
    if isinstance(data, (list, tuple)):
        return bool(data) and isinstance(data[0], dict) and "input_ids" in data[0]
    return "input_ids" in (getattr(data, "column_names", None) or ())


def _check_token_ids(dataset, model: torch.nn.Module, where: str) -> None:
    """Pre-tokenized rows' ids within the model's embedding rows (an id past them is an IndexError mid-step). Read
    only for data that arrived tokenized: the scan pages the token columns in."""
    if dataset is None or is_stream(dataset) or "input_ids" not in dataset.column_names or len(dataset) == 0:
        return
    import pyarrow.compute as pc

    rows = unwrap(model).get_input_embeddings().weight.shape[0]
    low, high = 0, 0
    for batch in dataset.select_columns(["input_ids"]).with_format("arrow").iter(batch_size=8192):
        ids = pc.list_flatten(batch["input_ids"])
        if len(ids):
            found = pc.min_max(ids)
            low, high = min(low, found["min"].as_py()), max(high, found["max"].as_py())
    if low < 0 or high >= rows:
        bad = high if high >= rows else low
        raise FastkitError(f"{where}: a token id {bad} is outside the model's vocabulary (ids 0 to {rows - 1}): the "
                           "rows were tokenized by another tokenizer. Tokenize them with this model's tokenizer, or "
                           "give the text and let fastkit tokenize it.")


def _early_stopping(options: TrainOptions) -> list[Any]:
    """transformers' EarlyStoppingCallback on the eval loss, when ``early_stopping_patience`` is set."""
    if options.early_stopping_patience is None:
        return []
    from transformers import EarlyStoppingCallback

    return [EarlyStoppingCallback(options.early_stopping_patience, options.early_stopping_threshold)]


def split_eval(dataset, eval_dataset, eval_split: float | int, seed: int):
    """(train, eval): ``eval_split`` rows (a fraction or a count) of ``dataset`` held out, seeded."""
    if not eval_split:
        return dataset, eval_dataset
    if eval_dataset is not None:
        raise FastkitError("Give eval_dataset or eval_split, not both.")
    split = dataset.train_test_split(test_size=_eval_count(eval_split, len(dataset)), seed=seed, shuffle=True)
    return split["train"], split["test"]


def _eval_count(eval_split: float | int, n: int) -> int:
    """Rows ``eval_split`` (a fraction or a count) holds out of ``n``; a FastkitError unless each side keeps one."""
    count = round(eval_split * n) if isinstance(eval_split, float) and eval_split < 1 else eval_split
    if isinstance(eval_split, bool) or not isinstance(count, int) or not 1 <= count < n:
        raise FastkitError(f"eval_split must be a fraction in (0, 1) or a row count in [1, {n - 1}] of the "
                           f"{n} training rows (at least one row each side), got {eval_split!r}.")
    return count


__all__ = ["check_stream_options", "split_eval"]
