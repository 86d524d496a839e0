"""Image + text chat rows for vision-language models: checked before the model loads, collated with the loss on
assistant turns only.

A row is ``{"messages": [...], "images": [...]}``: messages as for text, where a message's ``content`` may be a
list of parts (``{"type": "text", "text": ...}``, ``{"type": "image"}``), and ``images`` the images those parts
stand for, in order (local paths or PIL images). :func:`check_vision_rows` names the first bad row: a missing or
unreadable image, a count of image parts that is not the count of images, a row whose image tokens (what the
processor expands each image into) push it past ``max_seq_length``. :class:`VisionCollator` renders each row with
the processor's chat template, expands and tokenizes it with its images, and trains the assistant turns only
(each turn's span: where the render of the messages before it with the generation prompt ends, to where the
render through it ends, as for text chats in :mod:`fastkit.data.chat_masks`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

from fastkit.errors import FastkitError

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
ROW_KEY = "fastkit_row"
"""The column of row indices a trainer's dataset holds, :class:`VisionCollator` looking each row up."""


def is_processor(obj: Any) -> bool:
    """A multimodal processor (a tokenizer and an image processor), not a tokenizer."""
    return hasattr(obj, "image_processor") and hasattr(obj, "tokenizer")


def image_parts(messages: Sequence[dict]) -> int:
    """How many ``{"type": "image"}`` parts the messages hold."""
    return sum(1 for m in messages if isinstance(m.get("content"), list)
               for part in m["content"] if isinstance(part, dict) and part.get("type") == "image")


def open_image(image: Any, row: int, index: int):
    """``image`` (a path or a PIL image) as an RGB PIL image; a FastkitError naming the row and the image."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if not isinstance(image, (str, os.PathLike)):
        raise FastkitError(f"row {row}: images[{index}] is a {type(image).__name__}; give a local path or a PIL image.")
    path = os.path.expanduser(str(image))
    if str(image).startswith(("http://", "https://")):
        raise FastkitError(f"row {row}: images[{index}] is a URL ({image}); download it first and give its path.")
    if not os.path.isfile(path):
        raise FastkitError(f"row {row}: images[{index}] {path!r} does not exist.")
    try:
        with Image.open(path) as img:
            return img.convert("RGB")
    except (OSError, UnidentifiedImageError) as exc:
        raise FastkitError(f"row {row}: images[{index}] {path!r} is not a readable image ({exc}).") from exc


def row_images(row: dict, index: int) -> list:
    """The row's images opened, after checking their count against its image parts."""
    messages, images = row.get("messages"), row.get("images") or []
    if not isinstance(messages, list) or not messages:
        raise FastkitError(f"row {index}: no 'messages' list (a vision row is {{'messages': [...], 'images': [...]}}).")
    if not isinstance(images, (list, tuple)):
        images = [images]
    parts = image_parts(messages)
    if parts > len(images):
        raise FastkitError(f"row {index}: {parts} image parts ({{'type': 'image'}}) but {len(images)} image(s) in its "
                           "'images' column; give one image per image part.")
    if parts < len(images):
        raise FastkitError(f"row {index}: {len(images)} images but only {parts} image part(s) in its messages; each "
                           "image needs a {'type': 'image'} part where it belongs in the chat.")
    return [open_image(img, index, i) for i, img in enumerate(images)]


def _render(processor, messages: list[dict], generation_prompt: bool = False) -> str:
    return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _ids(processor, text: str, images: list) -> list[int]:
    out = processor(text=[text], images=[images] if images else None, return_tensors=None)
    ids = out["input_ids"][0]
    return ids.tolist() if hasattr(ids, "tolist") else list(ids)


def encode_row(row: dict, processor, index: int = 0) -> tuple[list[int], list[int]]:
    """``(input_ids, mask)`` of one row: every token as the processor makes it (images expanded), mask 1 on the
    assistant turns."""
    messages, images = row["messages"], row_images(row, index)
    ids = _ids(processor, _render(processor, messages), images)
    mask = [0] * len(ids)
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        seen = images[:image_parts(messages[:i])]
        start = len(_ids(processor, _render(processor, messages[:i], True), seen))
        through = _ids(processor, _render(processor, messages[:i + 1]), images[:image_parts(messages[:i + 1])])
        if ids[:len(through)] != through:
            raise FastkitError(f"row {index}: the chat template does not render turn {i} as a prefix of the whole "
                               "chat; its assistant span cannot be masked exactly.")
        mask[start:len(through)] = [1] * (len(through) - start)
    if not any(mask):
        raise FastkitError(f"row {index}: no assistant turn to train on.")
    return ids, mask


def check_vision_rows(rows, processor, max_seq_length: int) -> int:
    """Check every row before the model loads (images readable, one per image part, each row within
    ``max_seq_length`` with its image tokens); the first bad row raises a FastkitError naming it. Returns the
    longest row's tokens."""
    image_token = getattr(processor, "image_token", None)
    image_id = processor.tokenizer.convert_tokens_to_ids(image_token) if image_token else None
    longest = n = 0
    for index, row in enumerate(rows):
        n += 1
        ids, _ = encode_row(row, processor, index)
        if len(ids) > max_seq_length:
            n_image = sum(1 for t in ids if t == image_id) if image_id is not None else 0
            raise FastkitError(f"row {index}: {len(ids)} tokens ({n_image} of them image tokens, "
                               f"{len(row_images(row, index))} image(s)) is longer than max_seq_length="
                               f"{max_seq_length}; raise max_seq_length, use smaller images, or drop the row.")
        longest = max(longest, len(ids))
    logger.info("fastkit: %d image + text rows checked; the longest is %d tokens", n, longest)
    return longest


class VisionCollator:
    """Rows -> a padded batch the model takes (``input_ids``, ``attention_mask``, the processor's image tensors,
    ``labels`` = the ids on assistant turns, -100 elsewhere and on padding)."""

    def __init__(self, processor, max_seq_length: int, rows: Sequence[dict] | None = None):
        self.processor = processor
        self.max_seq_length = max_seq_length
        self.rows = rows
        """The rows themselves where the dataset holds only their indices (``ROW_KEY``: images stay Python objects,
        never converted to Arrow)."""

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        if self.rows is not None:
            rows = [self.rows[r[ROW_KEY]] if ROW_KEY in r else r for r in rows]
        tok = self.processor.tokenizer
        texts = [_render(self.processor, row["messages"]) for row in rows]
        images = [row_images(row, i) for i, row in enumerate(rows)]
        batch = self.processor(text=texts, images=images if any(images) else None, padding=True,
                               return_tensors="pt")
        labels = torch.full_like(batch["input_ids"], IGNORE_INDEX)
        right = tok.padding_side == "right"
        for i, row in enumerate(rows):
            ids, mask = encode_row(row, self.processor, i)
            if len(ids) > self.max_seq_length:
                raise FastkitError(f"row {i} of this batch is {len(ids)} tokens, longer than max_seq_length="
                                   f"{self.max_seq_length} (check_vision_rows names such rows before training).")
            where = slice(0, len(ids)) if right else slice(labels.shape[1] - len(ids), labels.shape[1])
            labels[i, where] = torch.where(torch.tensor(mask, dtype=torch.bool), torch.tensor(ids), IGNORE_INDEX)
        batch["labels"] = labels
        return dict(batch)


SHAPES = "shapes"
"""The name of :func:`shape_rows`' offline sample as a ``caption_rows`` source."""
_COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220), "yellow": (230, 210, 40),
            "white": (245, 245, 245), "black": (15, 15, 15)}


def shape_rows(n: int = 16, instruction: str = "Describe this image.") -> list[dict]:
    """``n`` offline image + caption rows: a coloured square on another colour, captioned with both (a set to see
    that training runs, not to learn anything)."""
    from PIL import Image, ImageDraw

    names = list(_COLOURS)
    rows = []
    for i in range(n):
        fg, bg = names[i % len(names)], names[(i // len(names) + i + 1) % len(names)]
        if fg == bg:
            bg = names[(names.index(bg) + 1) % len(names)]
        image = Image.new("RGB", (64, 64), _COLOURS[bg])
        ImageDraw.Draw(image).rectangle((16 + i % 8, 16, 44 + i % 8, 44), fill=_COLOURS[fg])
        rows.append(caption_row(image, instruction, f"A {fg} square on a {bg} background."))
    return rows


def caption_row(image, instruction: str, caption: str) -> dict:
    """One row: the user sends ``image`` and ``instruction``, the assistant answers ``caption``."""
    return {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": instruction}]},
                         {"role": "assistant", "content": caption}],
            "images": [image]}


def caption_rows(source: str, instruction: str, image_column: str = "image", text_column: str = "text",
                 limit: int | None = None) -> list[dict]:
    """Image + caption rows from a Hub dataset (or a local one ``datasets.load_dataset`` reads) with an image
    column and a text column, or :data:`SHAPES` (offline); at most ``limit`` rows."""
    if source == SHAPES:
        return shape_rows(limit or 16, instruction)
    from datasets import load_dataset

    data = load_dataset(source, split=f"train[:{limit}]" if limit else "train")
    missing = [c for c in (image_column, text_column) if c not in data.column_names]
    if missing:
        raise FastkitError(f"{source}: no column {', '.join(missing)} (it has {', '.join(data.column_names)}); "
                           "pass image_column= / text_column=.")
    return [caption_row(row[image_column], instruction, row[text_column]) for row in data]


__all__ = ["SHAPES", "VisionCollator", "caption_row", "caption_rows", "check_vision_rows", "encode_row",
           "image_parts", "is_processor", "open_image", "row_images", "shape_rows"]
