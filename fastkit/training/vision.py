"""The SFT trainer of a vision-language model: image + text rows read, their images fetched and checked, handed to
TRL as they are and collated by the model's processor (the loss on assistant turns only)."""

from __future__ import annotations

import logging
import os

from fastkit.data.vision import VisionCollator, fetch_images
from fastkit.errors import FastkitError
from fastkit.patching import change, unwrap
from fastkit.training.card import data_name
from fastkit.training.options import TrainOptions
from fastkit.training.record import RunRecord
from fastkit.training.sft_data import _early_stopping, _eval_count

logger = logging.getLogger(__name__)


def vision_trainer(model, processor, data, args, options: TrainOptions, callbacks, max_seq_length: int):
    """The SFT trainer of a vision-language model: ``data`` = (train, eval or None) rows checked
    (:func:`fastkit.data.vision.rows_within`; ``eval_split`` rows held out of train, seeded), then handed to TRL as
    they are, collated by the processor with the loss on assistant turns only; the dashboard attached and the
    options kept as for text (:func:`fastkit.training.fit` runs it)."""
    from fastkit.training.trainer import FastSFTTrainer

    rows, eval_rows = _vision_rows(data, processor, options, max_seq_length)
    if options.packing:  # the family's packing patch is active, but this collator pads
        logger.info("fastkit: packing=True: image + text rows are collated as padded rows, one example each")
    args.remove_unused_columns = False  # the collator reads messages and images
    args.dataset_kwargs = {**(args.dataset_kwargs or {}), "skip_prepare_dataset": True}
    change(model, "use_cache", lambda swap: swap.setattr(unwrap(model).config, "use_cache", False))
    # the rows stay Python objects (PIL images), the datasets hold their indices into train + eval rows; the
    # digests make the run's data fingerprint (resume checks it)
    train = _row_indices(rows, 0)
    held = _row_indices(eval_rows, len(rows)) if eval_rows else None
    record = RunRecord(options=options, config=options.to_dict(), data=data_name(data[0]), examples=len(rows),
                       log_every_step=options.logging_steps is None)
    return FastSFTTrainer(model=model, args=args, train_dataset=train, eval_dataset=held, processing_class=processor,
                          data_collator=VisionCollator(processor, max_seq_length, rows + eval_rows),
                          callbacks=[*callbacks, *_early_stopping(options)], record=record)


def check_vision_options(options: TrainOptions) -> None:
    """What does not apply to image + text rows, refused before they are read (packing: the model's own check)."""
    if options.streaming:
        raise FastkitError("streaming=True: image + text rows are read whole (each row's images are checked before "
                           "any step); drop streaming=True.")
    if options.drop_invalid:
        raise FastkitError("drop_invalid=True applies to text rows; a bad image + text row is refused by name: fix "
                           "or remove it and drop drop_invalid=True.")


def _vision_rows(data, processor, options: TrainOptions, max_seq_length: int) -> tuple[list, list]:
    """(train rows, eval rows) read (a file: :func:`~fastkit.data.vision.read_image_rows`), URLs fetched, checked
    (``drop_long`` drops the long ones), ``eval_split`` rows held out of train (seeded)."""
    train, held = (_image_rows(d, where) for d, where in zip(data, ("train_dataset", "eval_dataset")))
    train = _within(train, processor, options, max_seq_length, "train_dataset")
    if held is not None:
        return train, _within(held, processor, options, max_seq_length, "eval_dataset")
    return split_rows(train, options.eval_split, options.seed)


def _image_rows(data, where: str) -> list | None:
    from fastkit.data.vision import read_image_rows

    if data is None:
        return None
    if isinstance(data, (str, os.PathLike)):  # an image-row file, else anything as_dataset reads
        from fastkit.data.read import as_dataset

        read = read_image_rows(data, where)
        data = read if read is not None else as_dataset(data, where=where)
    return fetch_images(list(data))  # every URL fetched once, before any step


def _within(rows: list, processor, options: TrainOptions, max_seq_length: int, where: str) -> list:
    from fastkit.data.vision import rows_within

    return [row for row, _ in rows_within(rows, processor, max_seq_length, where=where, drop_long=options.drop_long)]


def split_rows(rows: list, eval_split: float | int, seed: int) -> tuple[list, list]:
    """(train, eval): ``eval_split`` rows (a fraction or a count) of ``rows`` held out, seeded; no split: (rows, [])."""
    if not eval_split:
        return rows, []
    import random

    held = set(random.Random(seed).sample(range(len(rows)), _eval_count(eval_split, len(rows))))
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]


def _row_indices(rows: list, start: int):
    """The Dataset a vision trainer iterates: each row's index into the collator's rows, and its content digest."""
    from datasets import Dataset

    from fastkit.data.vision import ROW_KEY, row_digest

    return Dataset.from_dict({ROW_KEY: list(range(start, start + len(rows))),
                              "fastkit_row_digest": [row_digest(r) for r in rows]})


__all__ = ["check_vision_options", "split_rows", "vision_trainer"]
