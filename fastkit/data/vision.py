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
from pathlib import Path
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


def _require_pillow() -> None:
    """Images are read with Pillow (the ``vision`` extra): a FastkitError naming it when it is not installed."""
    from fastkit.extras import require

    require("PIL", "Image + text rows", "Or train on text rows.")


def open_image(image: Any, row: int, index: int):
    """``image`` (a path, an http(s) URL: :func:`fetch_image`, or a PIL image) as an RGB PIL image; a FastkitError
    naming the row and the image."""
    _require_pillow()
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, dict) and (image.get("bytes") or image.get("path")):  # datasets' Image feature, stored
        return _open_stored(image, row, index)
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


def _open_stored(image: dict, row: int, index: int):
    """An image as ``datasets`` stores one in Parquet: ``{"bytes": ..., "path": ...}`` (the bytes win)."""
    import io

    _require_pillow()
    from PIL import Image, UnidentifiedImageError

    if not image.get("bytes"):
        return open_image(image["path"], row, index)
    try:
        with Image.open(io.BytesIO(image["bytes"])) as img:
            return img.convert("RGB")
    except (OSError, UnidentifiedImageError) as exc:
        raise FastkitError(f"row {row}: images[{index}] holds {len(image['bytes'])} bytes that are not a readable "
                           f"image ({exc}).") from exc


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

    _require_pillow()
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


def check_vision_rows(rows, processor, max_seq_length: int, where: str | None = None) -> int:
    """Check every row before the model loads (images readable, one per image part, each row within
    ``max_seq_length`` with its image tokens); the first bad row raises a FastkitError naming it (and ``where``,
    e.g. ``eval_dataset``). Returns the longest row's tokens."""
    kept = rows_within(rows, processor, max_seq_length, where=where)
    return max((n for _, n in kept), default=0)


def rows_within(rows, processor, max_seq_length: int, *, where: str | None = None,
                drop_long: bool = False) -> list[tuple[dict, int]]:
    """``(row, tokens)`` of every row, checked as :func:`check_vision_rows` says; ``drop_long``: a row past
    ``max_seq_length`` is dropped (counted in the log) instead of refused."""
    image_token = getattr(processor, "image_token", None)
    image_id = processor.tokenizer.convert_tokens_to_ids(image_token) if image_token else None
    kept, dropped = [], 0
    for index, row in enumerate(rows):
        with named(where):
            ids, _ = encode_row(row, processor, index)
            if len(ids) > max_seq_length and not drop_long:
                n_image = sum(1 for t in ids if t == image_id) if image_id is not None else 0
                raise FastkitError(f"row {index}: {len(ids)} tokens ({n_image} of them image tokens, "
                                   f"{len(row_images(row, index))} image(s)) is longer than max_seq_length="
                                   f"{max_seq_length}; raise max_seq_length, use smaller images, or drop the row.")
        if len(ids) > max_seq_length:
            dropped += 1
            continue
        kept.append((row, len(ids)))
    label = f"{where}: " if where else ""
    if dropped:
        logger.warning("fastkit: %s%d of %d image + text rows are longer than max_seq_length=%d and were dropped",
                       label, dropped, dropped + len(kept), max_seq_length)
    if dropped and not kept:
        raise FastkitError(f"{label}every row is longer than max_seq_length={max_seq_length}; raise it or use "
                           "smaller images.")
    logger.info("fastkit: %s%d image + text rows checked; the longest is %d tokens", label, len(kept),
                max((n for _, n in kept), default=0))
    return kept


class named:
    """A context where a FastkitError's message starts with ``where: `` (``eval_dataset: row 3: ...``)."""

    def __init__(self, where: str | None):
        self.where = where

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> bool:
        if self.where and isinstance(exc, FastkitError) and not str(exc).startswith(f"{self.where}:"):
            raise FastkitError(f"{self.where}: {exc}") from exc
        return False


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


# -- image rows from a file (fastkit train --data rows.jsonl, make_trainer(model, processor, "rows.jsonl")) ----------
def is_image_row(row: Any) -> bool:
    """A row with images: a non-empty ``images`` column, or ``{"type": "image"}`` parts in its messages."""
    if not isinstance(row, dict):
        return False
    messages = row.get("messages")
    return bool(row.get("images")) or isinstance(messages, list) and image_parts(
        [m for m in messages if isinstance(m, dict)]) > 0


def image_file(source: Any) -> Path | None:
    """The local JSON / JSONL / Parquet file ``source`` names (a path, or one data source without options), else
    None (a Hub id, a folder, rows in memory: read as they are)."""
    from fastkit.data.read import DATA_SUFFIXES, _data_suffix
    from fastkit.data.sources import DataSource, as_sources

    if not isinstance(source, (str, os.PathLike, DataSource, dict, list, tuple)):
        return None
    try:
        listed = as_sources(source)
    except FastkitError:
        return None
    if len(listed) != 1 or not isinstance(listed[0].path, str):
        return None
    path = Path(os.path.expanduser(listed[0].path))
    return path if path.is_file() and _data_suffix(path)[0] in DATA_SUFFIXES else None


def read_image_rows(source: Any, where: str = "data") -> list[dict] | None:
    """The rows of ``source`` when it is a local ``.jsonl`` / ``.json`` / ``.parquet`` file of image + text rows
    (:func:`is_image_row`), with each relative image path made relative to the file's folder (a folder of images
    beside ``rows.jsonl`` works from any working directory); None when it is not such a file (text rows, a Hub id:
    the text reader's). Several sources, or options on one (``?weight=``, ``columns``), are refused for image
    rows."""
    from fastkit.data.read import read_rows
    from fastkit.data.sources import as_sources

    path = image_file(source)
    if path is None:
        _refuse_image_mix(source, where)
        return None
    if not looks_like_images(path):
        return None
    rows = read_rows(path)
    if not any(is_image_row(r) for r in rows):
        return None
    listed = as_sources(source)[0]
    if listed.columns or listed.weight is not None or listed.max_rows is not None or listed.split != "train":
        raise FastkitError(f"{where} {listed.label}: image + text rows are read as they are; columns, weight, "
                           "max_rows and split apply to text data only. Drop them (or edit the file).")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise FastkitError(f"{where} {path}: row {i} is a {type(row).__name__}, not an object "
                               "({\"messages\": [...], \"images\": [...]}).")
    return [beside(row, path.parent) for row in rows]


PEEK_ROWS = 100
"""How many leading rows of a .jsonl file :func:`looks_like_images` reads (a text file is not parsed twice)."""


def looks_like_images(path: Path) -> bool:
    """A cheap look before the whole file is read: a Parquet file with an ``images`` column, a .jsonl file with an
    image row among its first :data:`PEEK_ROWS`, a .json file naming ``"images"`` in its first MiB."""
    import importlib
    import json
    import re

    from fastkit.data.read import _data_suffix

    suffix, compression = _data_suffix(path)
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return "images" in pq.read_schema(path).names
        except Exception:  # noqa: BLE001 -- not readable: the text reader names the problem
            return False
    if suffix not in (".jsonl", ".json"):
        return False
    opener = importlib.import_module(compression).open if compression else open
    try:
        with opener(path, "rt", encoding="utf-8-sig", errors="replace") as f:
            if suffix == ".json":
                return re.search(r'"images"\s*:', f.read(1 << 20)) is not None
            lines = (line for _, line in zip(range(PEEK_ROWS), f) if line.strip())
            return any(is_image_row(json.loads(line)) for line in lines)
    except (OSError, EOFError, ValueError):  # a bad line or file: the text reader names it
        return False


def _refuse_image_mix(source: Any, where: str) -> None:
    """Several sources where one is a file of image rows: mixing is for text data."""
    from fastkit.data.sources import as_sources

    if not isinstance(source, (list, tuple)) or len(source) < 2:
        return
    for item in as_sources(source):
        path = image_file(item.path) if isinstance(item.path, str) else None
        if path is not None and read_image_rows(item.path, where) is not None:
            raise FastkitError(f"{where}: {item.label} holds image + text rows, and image rows come from one "
                               "source; give that file alone (join the files into one to train on both).")


def beside(row: dict, folder: Path) -> dict:
    """``row`` with each relative image path taken from ``folder`` (URLs, absolute paths and ``~`` paths kept)."""
    images = row.get("images")
    if not isinstance(images, (list, tuple)):
        return row

    def placed(image: Any) -> Any:
        if not isinstance(image, str) or is_url(image) or image.startswith("~") or os.path.isabs(image):
            return image
        return str(folder / image)

    return {**row, "images": [placed(i) for i in images]}


def check_image_files(rows: Sequence[dict], where: str = "data") -> None:
    """Every row's images opened and counted against its image parts (no processor needed: before the model
    loads); the first bad row raises naming ``where``, the row and the image."""
    with named(where):
        for index, row in enumerate(rows):
            row_images(row, index)
    logger.info("fastkit: %s: the images of %d rows are readable", where, len(rows))


SHAPES = "shapes"
"""The name of :func:`shape_rows`' offline sample as a ``caption_rows`` source."""
_COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220), "yellow": (230, 210, 40),
            "white": (245, 245, 245), "black": (15, 15, 15)}


def shape_rows(n: int = 16, instruction: str = "Describe this image.") -> list[dict]:
    """``n`` offline image + caption rows: a coloured square on another colour, captioned with both (a set to see
    that training runs, not to learn anything)."""
    _require_pillow()
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


__all__ = ["MAX_IMAGE_BYTES", "SHAPES", "URL_TIMEOUT", "VisionCollator", "beside", "caption_row", "caption_rows",
           "check_image_files", "check_vision_rows", "encode_row", "fetch_image", "fetch_images", "image_cache_dir",
           "image_file", "image_parts", "is_image_row", "is_processor", "is_url", "named", "open_image",
           "read_image_rows", "row_digest", "row_images", "rows_within", "shape_rows"]
