"""Image + text chat rows for vision-language models: checked before the model loads, collated with the loss on
assistant turns only.

A row is ``{"messages": [...], "images": [...]}``: messages as for text, where a message's ``content`` may be a
list of parts (``{"type": "text", "text": ...}``, ``{"type": "image"}``), and ``images`` the images those parts
stand for, in order (local paths, http(s) URLs: :func:`fetch_images`, or PIL images). :func:`check_vision_rows`
names the first bad row: a missing or unreadable image, a URL that could not be fetched, a count of image parts
that is not the count of images, a row whose image tokens (what the processor expands each image into) push it
past ``max_seq_length``. :class:`VisionCollator` renders each row with
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
    """``image`` (a path, an http(s) URL: :func:`fetch_image`, or a PIL image) as an RGB PIL image; a FastkitError
    naming the row and the image."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if not isinstance(image, (str, os.PathLike)):
        raise FastkitError(f"row {row}: images[{index}] is a {type(image).__name__}; give a local path, an http(s) "
                           "URL or a PIL image.")
    if is_url(image):
        image = fetch_image(str(image), row, index)
    path = os.path.expanduser(str(image))
    if not os.path.isfile(path):
        raise FastkitError(f"row {row}: images[{index}] {path!r} does not exist.")
    try:
        with Image.open(path) as img:
            return img.convert("RGB")
    except (OSError, UnidentifiedImageError) as exc:
        raise FastkitError(f"row {row}: images[{index}] {path!r} is not a readable image ({exc}).") from exc


URL_TIMEOUT = 30.0
"""Seconds :func:`fetch_image` waits for an image URL to answer."""
MAX_IMAGE_BYTES = 64 * 2**20
"""The largest answer :func:`fetch_image` reads (larger is refused: not an image a model takes)."""


def is_url(image: Any) -> bool:
    return isinstance(image, str) and image.startswith(("http://", "https://"))


def image_cache_dir(cache_dir: str | os.PathLike | None = None) -> str:
    """Where fetched images are kept: ``cache_dir``, or ``fastkit_images`` under the datasets cache."""
    if cache_dir is None:
        from datasets import config

        cache_dir = os.path.join(str(config.HF_DATASETS_CACHE), "fastkit_images")
    return os.path.expanduser(str(cache_dir))


def fetch_image(url: str, row: int, index: int, cache_dir: str | os.PathLike | None = None,
                timeout: float = URL_TIMEOUT) -> str:
    """The local path of the image at ``url``: fetched once into :func:`image_cache_dir` (named by the URL's hash),
    then read from there. An unreachable URL, an error answer or an answer that is not an image raises a
    FastkitError naming the row and the URL."""
    import hashlib

    folder = image_cache_dir(cache_dir)
    path = os.path.join(folder, hashlib.sha256(url.encode()).hexdigest()[:32])
    if os.path.isfile(path):
        return path
    body = _download(url, row, index, timeout)
    _check_image_bytes(body, url, row, index)
    os.makedirs(folder, exist_ok=True)
    partial = f"{path}.{os.getpid()}.partial"
    with open(partial, "wb") as f:
        f.write(body)
    os.replace(partial, path)  # whole or absent: a stopped fetch leaves no half image behind
    logger.info("fastkit: fetched %s (%d bytes) into %s", url, len(body), folder)
    return path


def _download(url: str, row: int, index: int, timeout: float) -> bytes:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            body = answer.read(MAX_IMAGE_BYTES + 1)
    except urllib.error.HTTPError as exc:
        raise FastkitError(f"row {row}: images[{index}] {url} could not be fetched (HTTP {exc.code} "
                           f"{exc.reason}).") from exc
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise FastkitError(f"row {row}: images[{index}] {url} could not be fetched ({reason}; timeout "
                           f"{timeout:g} s).") from exc
    if len(body) > MAX_IMAGE_BYTES:
        raise FastkitError(f"row {row}: images[{index}] {url} answered more than {MAX_IMAGE_BYTES >> 20} MiB; "
                           "not an image to train on.")
    return body


def _check_image_bytes(body: bytes, url: str, row: int, index: int) -> None:
    import io

    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(body)) as img:
            img.verify()
    except (OSError, UnidentifiedImageError, SyntaxError) as exc:
        raise FastkitError(f"row {row}: images[{index}] {url} answered {len(body)} bytes that are not an image "
                           f"({exc}).") from exc


def fetch_images(rows: Sequence[dict], cache_dir: str | os.PathLike | None = None,
                 timeout: float = URL_TIMEOUT) -> list[dict]:
    """``rows`` with every http(s) URL in their ``images`` replaced by the local path of the image fetched there
    (:func:`fetch_image`: each URL once, kept in ``cache_dir`` or the datasets cache). Call it before the model
    loads; ``make_trainer`` calls it too, so training reads no URL."""
    out, fetched = [], 0
    for r, row in enumerate(rows):
        images = row.get("images") if isinstance(row, dict) else None
        if isinstance(images, (list, tuple)) and any(is_url(i) for i in images):
            row = {**row, "images": [fetch_image(i, r, k, cache_dir, timeout) if is_url(i) else i
                                     for k, i in enumerate(images)]}
            fetched += 1
        out.append(row)
    if fetched:
        logger.info("fastkit: image URLs of %d rows fetched into %s", fetched, image_cache_dir(cache_dir))
    return out


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


def row_digest(row: dict) -> str:
    """A hash of one row's content: its messages and its images (a file's bytes, a PIL image's pixels), so a resumed
    run's data fingerprint (fastkit.training.identity) tells other rows from these."""
    import hashlib
    import json

    h = hashlib.blake2b(json.dumps(row.get("messages"), sort_keys=True, default=str).encode(), digest_size=12)
    for image in row.get("images") or []:
        if isinstance(image, (str, os.PathLike)) and os.path.isfile(os.path.expanduser(str(image))):
            with open(os.path.expanduser(str(image)), "rb") as f:
                h.update(f.read())
        elif hasattr(image, "tobytes"):
            h.update(image.tobytes())
        else:
            h.update(str(image).encode())
    return h.hexdigest()


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


__all__ = ["MAX_IMAGE_BYTES", "SHAPES", "URL_TIMEOUT", "VisionCollator", "caption_row", "caption_rows",
           "check_vision_rows", "encode_row", "fetch_image", "fetch_images", "image_cache_dir", "image_parts",
           "is_processor", "is_url", "open_image", "row_digest", "row_images", "shape_rows"]
