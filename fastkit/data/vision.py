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
    """``image`` (a path, an http(s) URL: :func:`fetch_image`, a PIL image or ``datasets``' ``{"bytes", "path"}``)
    as an RGB PIL image (:func:`as_rgb`: 16-bit scaled, transparency on white, EXIF orientation applied), checked
    against the limits processors enforce (:func:`check_image_size`); a FastkitError naming the row and the
    image."""
    _require_pillow()
    from PIL import Image

    label = f"row {row + 1}: images[{index}]"
    if isinstance(image, Image.Image):
        check_image_size(image, label)
        return as_rgb(image, label)
    if isinstance(image, dict) and (image.get("bytes") or image.get("path")):  # datasets' Image feature, stored
        return _open_stored(image, row, index)
    if isinstance(image, str) and not image.strip():
        raise FastkitError(f"{label} is an empty string; give a local path, an http(s) URL or a PIL image.")
    if not isinstance(image, (str, os.PathLike)):
        kind = "null" if image is None else f"a {type(image).__name__}"
        raise FastkitError(f"{label} is {kind}; give a local path, an http(s) URL or a PIL image.")
    if is_url(image):
        image = fetch_image(str(image), row, index)
    if str(image).startswith("file://"):
        raise FastkitError(f"{label} {str(image)!r} is a file: URL; give the file's path (relative to the data "
                           "file's folder, or absolute).")
    path = os.path.expanduser(str(image))
    check_image_path(path, label)
    url = _FETCHED.get(path)
    label = f"{label} {url} (fetched into {path!r})" if url else f"{label} {path!r}"
    return _decode(lambda: Image.open(path), label, f"{label} is not a readable image")


def check_image_path(path: str, label: str) -> None:
    """A FastkitError unless ``path`` is a regular file: missing, a folder, a device or a pipe named as such."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        raise FastkitError(f"{label} {path!r} does not exist.") from None
    except OSError as exc:
        raise FastkitError(f"{label} {path!r} cannot be read ({exc.strerror or exc}).") from exc
    if stat.S_ISREG(mode):
        return
    kinds = [(stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket")]
    kind = next((what for test, what in kinds if test(mode)), "not a regular file")
    raise FastkitError(f"{label} {path!r} is {kind}, not an image file; name the image file itself.")


def _open_stored(image: dict, row: int, index: int):
    """An image as ``datasets`` stores one in Parquet: ``{"bytes": ..., "path": ...}`` (the bytes win)."""
    import io

    _require_pillow()
    from PIL import Image

    if not image.get("bytes"):
        return open_image(image["path"], row, index)
    body = image["bytes"]
    label = f"row {row + 1}: images[{index}]"
    if not isinstance(body, (bytes, bytearray)):
        raise FastkitError(f"{label}: its 'bytes' is a {type(body).__name__}; give the image file's bytes.")
    return _decode(lambda: Image.open(io.BytesIO(body)), label,
                   f"{label} holds {len(body)} bytes that are not a readable image")


MAX_ASPECT_RATIO = 200
"""The longer side over the shorter one at which an image is refused (Qwen's image processors refuse 200 and more;
no model is trained on such strips)."""


def check_image_size(img, label: str) -> None:
    """The limits a processor or PIL would enforce mid-run, checked as bad input: more pixels than PIL's
    ``Image.MAX_IMAGE_PIXELS`` (a decompression bomb), an empty image, an aspect ratio of :data:`MAX_ASPECT_RATIO`
    or more."""
    from PIL import Image

    width, height = img.size
    if width < 1 or height < 1:
        raise FastkitError(f"{label} is {width}x{height} pixels: an empty image.")
    limit = Image.MAX_IMAGE_PIXELS
    if limit and width * height > limit:
        raise FastkitError(f"{label} is {width}x{height} = {width * height:,} pixels, more than PIL's limit of "
                           f"{limit:,} (PIL.Image.MAX_IMAGE_PIXELS, its decompression-bomb guard); resize it.")
    ratio = max(width, height) / min(width, height)
    if ratio >= MAX_ASPECT_RATIO:
        raise FastkitError(f"{label} is {width}x{height} pixels, an aspect ratio of {ratio:.0f}:1; "
                           f"image processors refuse {MAX_ASPECT_RATIO}:1 and more. Crop or pad it.")


def _decode(opener, label: str, unreadable: str):
    """The image ``opener()`` gives, size-checked before its pixels are decoded, then decoded whole (a truncated
    file refused here, not mid-run) and made RGB."""
    import warnings

    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # refused by check_image_size
            with opener() as img:
                check_image_size(img, label)
                img.load()
                return as_rgb(img, label)
    except FastkitError:
        raise
    except Image.DecompressionBombError as exc:
        raise FastkitError(f"{label} is refused by PIL's decompression-bomb guard ({exc}); resize it "
                           "(PIL.Image.MAX_IMAGE_PIXELS).") from exc
    except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as exc:
        raise FastkitError(f"{unreadable} ({exc}).") from exc


def as_rgb(img, label: str = "image"):
    """``img`` as the RGB image a model sees: EXIF orientation applied (a phone photo upright); 16-bit greyscale
    (modes ``I;16*``, ``I``) scaled to 8 bits (values / 257); transparency (RGBA, LA, PA, a palette's or a colour
    key) laid on white, as transformers' ``convert_to_rgb``; CMYK, 1-bit, palette, YCbCr converted by PIL. An
    animated or multi-frame image (GIF, APNG, WebP, TIFF pages; an MPO photo's first frame is the photo) and 32-bit
    float pixels (mode ``F``, no fixed range) are refused."""
    from PIL import Image, ImageOps

    frames = getattr(img, "n_frames", 1)
    if frames > 1 and img.format != "MPO":
        raise FastkitError(f"{label} is an animated or multi-frame image ({frames} frames); fastkit trains on still "
                           "images: save the frame you mean as a PNG or JPEG.")
    if img.mode == "F":
        raise FastkitError(f"{label} has 32-bit float pixels (mode F), which have no fixed range; save it as an 8- "
                           "or 16-bit image.")
    img = ImageOps.exif_transpose(img) or img
    if img.mode.startswith("I"):  # 16-bit greyscale: PIL's convert would clip every value above 255 to white
        import numpy as np

        values = np.asarray(img, dtype=np.float64).clip(0, 65535) / 257
        img = Image.fromarray(values.round().astype(np.uint8))
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in img.info:
        rgba = img.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return img.convert("RGB")


URL_TIMEOUT = 30.0
"""Seconds :func:`fetch_image` waits for an image URL to answer."""
MAX_IMAGE_BYTES = 64 * 2**20
"""The largest answer :func:`fetch_image` reads (larger is refused: not an image a model takes)."""


_FETCHED: dict[str, str] = {}
"""The URL each cached file was fetched from (:func:`open_image` names the URL, not the cache file)."""


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
    _FETCHED[path] = url  # a later refusal of the file names the URL
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
        raise FastkitError(f"row {row + 1}: images[{index}] {url} could not be fetched (HTTP {exc.code} "
                           f"{exc.reason}).") from exc
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise FastkitError(f"row {row + 1}: images[{index}] {url} could not be fetched ({reason}; timeout "
                           f"{timeout:g} s).") from exc
    if len(body) > MAX_IMAGE_BYTES:
        raise FastkitError(f"row {row + 1}: images[{index}] {url} answered more than {MAX_IMAGE_BYTES >> 20} MiB; "
                           "not an image to train on.")
    return body


def _check_image_bytes(body: bytes, url: str, row: int, index: int) -> None:
    import io
    import warnings

    _require_pillow()
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # refused by check_image_size
            with Image.open(io.BytesIO(body)) as img:
                check_image_size(img, f"row {row + 1}: images[{index}] {url}")
                img.load()  # decoded whole: a truncated download is refused here and never cached
    except FastkitError:
        raise
    except Image.DecompressionBombError as exc:
        raise FastkitError(f"row {row + 1}: images[{index}] {url} is refused by PIL's decompression-bomb guard "
                           f"({exc}); resize it (PIL.Image.MAX_IMAGE_PIXELS).") from exc
    except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as exc:
        raise FastkitError(f"row {row + 1}: images[{index}] {url} answered {len(body)} bytes that are not an image "
                           f"({exc}).") from exc


def fetch_images(rows: Sequence[dict], cache_dir: str | os.PathLike | None = None,
                 timeout: float = URL_TIMEOUT) -> list[dict]:
    """``rows`` with every http(s) URL in their ``images`` replaced by the local path of the image fetched there
    (:func:`fetch_image`: each URL once, kept in ``cache_dir`` or the datasets cache). Call it before the model
    loads; ``make_trainer`` calls it too, so training reads no URL."""
    out, fetched = [], 0
    for r, row in enumerate(rows):
        images = image_list(row)
        if any(is_url(_stored_path(i)) for i in images):
            row = {**row, "images": [_fetched(i, r, k, cache_dir, timeout) for k, i in enumerate(images)]}
            fetched += 1
        out.append(row)
    if fetched:
        logger.info("fastkit: image URLs of %d rows fetched into %s", fetched, image_cache_dir(cache_dir))
    return out


def image_list(row: Any) -> list:
    """A row's ``images`` as a list: one image given alone (a path, a URL, a stored ``{"bytes", "path"}``) is a list
    of one; none is ``[]``."""
    images = row.get("images") if isinstance(row, dict) else None
    if images is None or (isinstance(images, (str, dict, list, tuple)) and not images):
        return []
    return list(images) if isinstance(images, (list, tuple)) else [images]


FOREIGN_PARTS = ("image_url", "input_image", "image")
"""Part types and keys of other chat formats (OpenAI's ``image_url``, an image inside its part) that fastkit's rows
do not use: refused naming the part, never rendered as text."""


def check_messages(messages: list, index: int) -> None:
    """As for text chats (:func:`fastkit.data.rules.message_problem`), with parts: each message an object with a
    role and a string or a list of parts, a part text (a string) or ``{"type": "image"}`` (its image in the row's
    ``images``); an assistant turn with text to train on, and the chat ending with one."""
    for m, message in enumerate(messages):
        where = f"row {index + 1}: messages[{m}]"
        if not isinstance(message, dict):
            raise FastkitError(f"{where} is a {type(message).__name__}, not an object ({{'role': ..., "
                               "'content': ...}).")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise FastkitError(f"{where}.role is {role!r}, not a role name such as 'user' or 'assistant'.")
        if not isinstance(content, (str, list)):
            kind = "missing (None)" if content is None else f"a {type(content).__name__}"
            raise FastkitError(f"{where}.content is {kind}; give a string or a list of parts ({{'type': 'text', "
                               "'text': ...}, {'type': 'image'}).")
        texts = [content] if isinstance(content, str) else [_part_text(part, f"{where}.content[{k}]")
                                                             for k, part in enumerate(content)]
        _check_texts(texts, where)
        if role == "assistant" and not any(t.strip() for t in texts) and not message.get("tool_calls"):
            raise FastkitError(f"{where} is an assistant turn with no text: it would train only the end-of-turn "
                               "token (an image is input, never a label); write the answer or drop the turn.")
    if messages[-1].get("role") != "assistant":
        raise FastkitError(f"row {index + 1}: the last turn is {messages[-1].get('role')!r}, not 'assistant' (nothing "
                           "to train on after it); end the chat with the answer.")


def _part_text(part: Any, where: str) -> str:
    """A part's text (``""`` for an image part); a FastkitError for a part fastkit's image rows do not hold."""
    if not isinstance(part, dict):
        raise FastkitError(f"{where} is a {type(part).__name__}; a part is {{'type': 'text', 'text': ...}} or "
                           "{'type': 'image'}.")
    kind = part.get("type")
    inline = [key for key in FOREIGN_PARTS if part.get(key) is not None]
    if kind in ("image_url", "input_image") or inline:
        raise FastkitError(f"{where} is {{'type': {kind!r}{', ' + repr(inline[0]) + ': ...' if inline else ''}}}: "
                           "fastkit's image rows use {'type': 'image'} parts and put the images, in order, in the "
                           "row's 'images' list.")
    if kind == "image":
        return ""
    if kind != "text":
        raise FastkitError(f"{where} is a {kind!r} part; image rows hold 'text' and 'image' parts only.")
    if not isinstance(part.get("text"), str):
        raise FastkitError(f"{where}.text is {part.get('text')!r}, not a string.")
    return part["text"]


def _check_texts(texts: list[str], where: str) -> None:
    from fastkit.data.rules import lone_surrogate

    for text in texts:
        if lone_surrogate(text):
            raise FastkitError(f"{where} holds a lone surrogate character ({lone_surrogate(text)}), which no "
                               "tokenizer can encode (a badly decoded emoji); fix the text.")


def _stored_path(image: Any) -> Any:
    """The URL or path an image names: itself, or a stored ``{"bytes": None, "path": ...}``'s path."""
    return image.get("path") if isinstance(image, dict) and not image.get("bytes") else image


def _fetched(image: Any, row: int, index: int, cache_dir, timeout: float) -> Any:
    if is_url(image):
        return fetch_image(image, row, index, cache_dir, timeout)
    if is_url(_stored_path(image)):
        return {**image, "path": fetch_image(image["path"], row, index, cache_dir, timeout)}
    return image


def row_images(row: dict, index: int) -> list:
    """The row's images opened, after checking their count against its image parts."""
    messages, images = row.get("messages"), image_list(row)
    if not isinstance(messages, list) or not messages:
        raise FastkitError(f"row {index + 1}: no 'messages' list (a vision row is "
                           "{'messages': [...], 'images': [...]}).")
    if row.get("image") is not None:
        beside_too = " beside its 'images'" if "images" in row else ""
        raise FastkitError(f"row {index + 1}: an 'image' field{beside_too}: a row names its images in 'images' (a "
                           "list, one per {'type': 'image'} part, in order); rename the field.")
    check_messages(messages, index)
    parts = image_parts(messages)
    if parts > len(images):
        raise FastkitError(f"row {index + 1}: {parts} image parts ({{'type': 'image'}}) but {len(images)} "
                           "image(s) in its 'images' column; give one image per image part.")
    if parts < len(images):
        raise FastkitError(f"row {index + 1}: {len(images)} images but only {parts} image part(s) in its messages; "
                           "each image needs a {'type': 'image'} part where it belongs in the chat.")
    return [open_image(img, index, i) for i, img in enumerate(images)]


def _render(processor, messages: list[dict], generation_prompt: bool = False) -> str:
    return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _ids(processor, text: str, images: list, index: int = 0) -> list[int]:
    try:
        out = processor(text=[text], images=[images] if images else None, return_tensors=None)
    except ValueError as exc:  # the processor's own limits (sizes, placeholder counts): bad input, named
        raise FastkitError(f"row {index + 1}: the processor refused it ({exc}).") from exc
    ids = out["input_ids"][0]
    return ids.tolist() if hasattr(ids, "tolist") else list(ids)


_PROCESSOR_TOKENS = ("image_token", "boi_token", "eoi_token", "start_image_token", "end_image_token",
                     "fake_image_token", "global_image_tag", "vision_start_token", "vision_end_token", "video_token")


def placeholders(processor=None, model_type: str | None = None) -> tuple[str, ...]:
    """The strings that stand for an image in a family's text (``<|image_pad|>``, ``<|vision_start|>``,
    ``<image>``, ``<start_of_image>`` ...): the registry row's of ``model_type`` or of the processor's image token,
    and the processor's own. A row's text holding one is refused (:func:`check_placeholders`)."""
    import re

    from fastkit import registry

    mine = getattr(processor, "image_token", None)
    found = {getattr(owner, name, None) for owner in (processor, getattr(processor, "tokenizer", None))
             for name in _PROCESSOR_TOKENS} if processor is not None else set()
    for name, row in registry.MODEL_TABLE.items():
        if row.vision is not None and (name == model_type or mine in (row.vision.image_token, row.vision.image_part)):
            found |= {row.vision.image_token, *re.findall(r"<[^<>\s]+>", row.vision.image_part)}
    return tuple(sorted(t for t in found if isinstance(t, str) and t))


def check_placeholders(messages: list, strings: Sequence[str], index: int) -> None:
    """A FastkitError when a text holds an image placeholder literally: the processor would take it for an image
    (or miscount them); images are ``{"type": "image"}`` parts."""
    for m, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        texts = [content] if isinstance(content, str) else [
            p.get("text") for p in content if isinstance(p, dict)] if isinstance(content, list) else []
        for text in texts:
            hit = next((t for t in strings if isinstance(text, str) and t in text), None)
            if hit is not None:
                raise FastkitError(f"row {index + 1}: messages[{m}] ({message.get('role')}) holds {hit!r} in its text, "
                                   "the model's image placeholder; an image is a {'type': 'image'} part with its "
                                   "file in 'images'. Remove or reword the literal token.")


def image_positions(processor, text: str, ids: list[int]) -> list[bool]:
    """Which of ``ids`` (``text`` as the processor tokenized it with its images) an image stands for: every token
    its expansion wrote (the image tokens, the tiles' and the image's markers, Gemma's blank lines around it),
    found against the text tokenized without images, and every image placeholder token."""
    from difflib import SequenceMatcher

    tok = processor.tokenizer
    marks = {tok.convert_tokens_to_ids(t) for t in placeholders(processor)} - {tok.unk_token_id, None}
    out = [t in marks for t in ids]
    plain = tok(text)["input_ids"]
    for op, _, _, j1, j2 in SequenceMatcher(None, plain, ids, autojunk=False).get_opcodes():
        if op in ("insert", "replace"):
            out[j1:j2] = [True] * (j2 - j1)
    return out


def encode_row(row: dict, processor, index: int = 0) -> tuple[list[int], list[int]]:
    """``(input_ids, mask)`` of one row: every token as the processor makes it (images expanded), mask 1 on the
    assistant turns except the tokens an image stands for (an image in any turn is input, never a label)."""
    messages, images = row["messages"], row_images(row, index)
    check_placeholders(messages, placeholders(processor), index)
    text = _render(processor, messages)
    ids = _ids(processor, text, images, index)
    mask = [0] * len(ids)
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        seen = images[:image_parts(messages[:i])]
        start = len(_ids(processor, _render(processor, messages[:i], True), seen, index))
        through = _ids(processor, _render(processor, messages[:i + 1]), images[:image_parts(messages[:i + 1])],
                       index)
        if ids[:len(through)] != through:
            raise FastkitError(f"row {index + 1}: the chat template does not render turn {i} as a prefix of the whole "
                               "chat; its assistant span cannot be masked exactly.")
        mask[start:len(through)] = [1] * (len(through) - start)
    if images:
        mask = [0 if image else m for m, image in zip(mask, image_positions(processor, text, ids))]
    if not any(mask):
        raise FastkitError(f"row {index + 1}: no assistant turn to train on.")
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
                raise FastkitError(f"row {index + 1}: {len(ids)} tokens ({n_image} of them image tokens, "
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
                raise FastkitError(f"row {i + 1} of this batch is {len(ids)} tokens, longer than max_seq_length="
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
    for image in image_list(row):
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
    if image_list(row) or row.get("image") is not None and isinstance(messages, list):
        return True  # an 'image' field on a chat: refused by row_images, naming it
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list) and isinstance(part, dict)
        and (part.get("type") in ("image", "image_url", "input_image") or part.get("image_url") is not None)
        for m in messages for part in (m.get("content") if isinstance(m, dict) else None) or [])


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
            raise FastkitError(f"{where} {path}: row {i + 1} is a {type(row).__name__}, not an object "
                               "({\"messages\": [...], \"images\": [...]}).")
    return [beside(row, path.parent) for row in rows]


IMAGE_HINT = r'"images?"\s*:|"type"\s*:\s*"(?:image|image_url|input_image)"'
"""What a line (or a .json file) of image rows holds somewhere: an ``images`` / ``image`` key or an image part."""


def looks_like_images(path: Path) -> bool:
    """Whether the file holds image rows, from its whole column or text: a Parquet file with an ``images`` (or
    ``image``) column, a .jsonl file with an image row on any line (lines without :data:`IMAGE_HINT` are not
    parsed), a .json file with the hint anywhere."""
    import importlib
    import json
    import re

    from fastkit.data.read import _data_suffix

    suffix, compression = _data_suffix(path)
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return bool({"images", "image"} & set(pq.read_schema(path).names))
        except Exception:  # noqa: BLE001 -- not readable: the text reader names the problem
            return False
    if suffix not in (".jsonl", ".json"):
        return False
    hint = re.compile(IMAGE_HINT)
    opener = importlib.import_module(compression).open if compression else open
    try:
        with opener(path, "rt", encoding="utf-8-sig", errors="replace") as f:
            if suffix == ".json":
                return hint.search(f.read()) is not None
            return any(is_image_row(_json_or_none(json, line)) for line in f if hint.search(line))
    except (OSError, EOFError, ValueError):  # a bad file: the text reader names it
        return False


def _json_or_none(json, line: str) -> Any:
    try:
        return json.loads(line)
    except ValueError:  # a bad line: the text reader names it
        return None


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
    """``row`` with each relative image path taken from ``folder``, in every form a path takes: ``images`` as a
    list or one string, a stored ``{"bytes", "path"}`` alone or in the list (URLs, absolute paths and ``~`` paths
    kept). ``images`` becomes a list."""
    if "images" not in row or not image_list(row):
        return row

    def placed(image: Any) -> Any:
        if isinstance(image, dict) and isinstance(image.get("path"), str):
            return {**image, "path": placed(image["path"])}
        if not isinstance(image, str) or not image.strip() or is_url(image) or image.startswith(("~", "file://")) \
                or os.path.isabs(image):
            return image
        return str(folder / image)

    return {**row, "images": [placed(i) for i in image_list(row)]}


def check_image_files(rows: Sequence[dict], where: str = "data", model_type: str | None = None) -> None:
    """Every row's images opened and counted against its image parts, and (``model_type``: the family's
    :func:`placeholders`) no image placeholder in its text: no processor needed, before the model loads; the first
    bad row raises naming ``where``, the row and the image."""
    strings = placeholders(model_type=model_type) if model_type else ()
    with named(where):
        for index, row in enumerate(rows):
            row_images(row, index)
            check_placeholders(row["messages"], strings, index)
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


__all__ = ["MAX_ASPECT_RATIO", "MAX_IMAGE_BYTES", "SHAPES", "URL_TIMEOUT", "VisionCollator", "as_rgb", "beside",
           "caption_row", "caption_rows", "check_image_files", "check_image_path", "check_image_size",
           "check_messages", "check_placeholders", "check_vision_rows", "encode_row", "fetch_image", "fetch_images",
           "image_cache_dir", "image_file", "image_list", "image_parts", "image_positions", "is_image_row",
           "is_processor", "is_url", "named", "open_image", "placeholders", "read_image_rows", "row_digest",
           "row_images", "rows_within", "shape_rows"]
