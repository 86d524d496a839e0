"""Round-6 hostile rows for image + text data (issue 53); tests/test_hostile_round6_vision.py runs them.

Each row builds a data file (or rows) in a fresh folder and runs what ``fastkit train`` runs before the model loads
(:func:`preflight`: ``read_image_rows`` + ``check_image_files`` with the family's placeholders), from another
working directory. The expectation is either a refusal (a FastkitError whose message holds every needle: the row,
the field, the path and what is wrong) or a check of the rows read (where each path was read from, the pixels a
model sees). The rules (docs/vision.md, "Rules for image rows"):

- paths: every form a path takes (``images`` as a list or one string, a stored ``{"bytes", "path"}`` alone or in
  the list) is relative to the data file's folder; never the working directory; ``~`` and absolute paths as given;
- a path that is not a regular file says what it is (a folder, a character device, a named pipe) and is never
  opened; an empty string, null, a number or a ``file://`` URL is named as such;
- pixels: 16-bit greyscale scaled to 8 bits, transparency laid on white, EXIF orientation applied, CMYK / 1-bit /
  palette converted; animated or multi-frame images and float pixels refused;
- limits checked before any decoding: PIL's decompression-bomb pixel count, an aspect ratio of 200:1 or more;
- one spelling: ``images``; an ``image`` field, an inline image in a part or OpenAI's ``image_url`` part refused;
- the family's image placeholders (``<|image_pad|>``, ``<image>`` ...) in any turn's text refused;
- a file is an image file from its whole column (Parquet schema) or any line (JSONL), not its first rows.
"""

from __future__ import annotations

import gzip
import io
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from fastkit.data.vision import check_image_files, open_image, read_image_rows
from fastkit.families.vision import twin_image

ASK = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}


@dataclass
class Row:
    id: str
    build: Callable[[Path], Path]
    """Writes the data (and its images) under the folder; returns the data file."""
    expect: tuple[str, ...] | Callable[[list[dict], Path], None]
    """Needles of the refusal, or a check of the rows preflight read."""
    model_type: str = "qwen2_5_vl"


def chat(images: Any = None, parts: int = 1, answer: str = "A cat.", **extra) -> dict:
    content = [{"type": "image"}] * parts + [{"type": "text", "text": "What is this?"}]
    row = {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": answer}], **extra}
    return row if images is None else {**row, "images": images}


def png(folder: Path, name: str = "a.png", image=None) -> Path:
    (folder / name).parent.mkdir(parents=True, exist_ok=True)
    (image or twin_image(1, size=(32, 32))).save(folder / name)
    return folder / name


def write(folder: Path, rows: list[dict], fmt: str = "jsonl") -> Path:
    path = folder / "data" / f"rows.{fmt}"
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    else:  # one type per column: every content a list of parts
        rows = [_parts(r) for r in rows]
        keys = list(dict.fromkeys(k for r in rows for k in r))  # every row's keys (from_pylist takes the first's)
        pq.write_table(pa.Table.from_pydict({k: [r.get(k) for r in rows] for k in keys}), path)
    return path


def _parts(row: dict) -> dict:
    text = lambda c: [{"type": "text", "text": c}] if isinstance(c, str) else c  # noqa: E731
    return {**row, "messages": [{**m, "content": text(m["content"])} for m in row["messages"]]}


def preflight(data: Path, model_type: str = "qwen2_5_vl") -> list[dict] | None:
    """What ``fastkit train`` runs on ``--data`` before the model loads."""
    rows = read_image_rows(str(data), "--data")
    if rows is not None:
        check_image_files(rows, "--data", model_type)
    return rows


def one_image(folder: Path, image_name: str, fmt: str = "jsonl", form: Callable[[str], Any] = lambda p: [p],
              image=None) -> Path:
    """rows.{fmt} in folder/data naming folder/data/``image_name`` in the ``form`` given."""
    png(folder / "data", image_name, image)
    return write(folder, [chat(form(image_name))], fmt)


def read_from(expected: Callable[[Path], Path]) -> Callable[[list[dict], Path], None]:
    """The row's first image is read from ``expected(folder)`` (whatever form it was given in)."""
    def check(rows: list[dict], folder: Path) -> None:
        image = rows[0]["images"][0]
        path = image["path"] if isinstance(image, dict) else image
        assert Path(path) == expected(folder), (path, expected(folder))
        assert open_image(image, 0, 0).size == (32, 32)
    return check


def pixels(expected: tuple[int, int, int], size: tuple[int, int] | None = None) -> Callable[[list[dict], Path], None]:
    """The model sees ``expected`` at the image's top-left pixel (and ``size``)."""
    def check(rows: list[dict], folder: Path) -> None:
        seen = open_image(rows[0]["images"][0], 0, 0)
        assert seen.mode == "RGB" and seen.getpixel((0, 0)) == expected, (seen.mode, seen.getpixel((0, 0)))
        if size is not None:
            assert seen.size == size, seen.size
    return check


def image_rows(count: int) -> Callable[[list[dict], Path], None]:
    def check(rows: list[dict] | None, folder: Path) -> None:
        assert rows is not None and len(rows) == count, rows
    return check


# -- where a path is read from ---------------------------------------------------------------------------------
def _path_rows() -> list[Row]:
    beside = read_from(lambda f: f / "data" / "a.png")
    struct = lambda p: {"bytes": None, "path": p}  # noqa: E731 -- datasets' stored Image
    forms = (("list", lambda p: [p]), ("string", lambda p: p), ("struct-list", lambda p: [struct(p)]))
    rows = [Row(f"path-{fmt}-{name}", lambda f, fmt=fmt, form=form: one_image(f, "a.png", fmt, form), beside)
            for fmt in ("jsonl", "json", "parquet") for name, form in forms]
    rows += [
        Row("path-parquet-struct-alone", lambda f: one_image(f, "a.png", "parquet", struct), beside),
        Row("path-json-struct-alone", lambda f: one_image(f, "a.png", "json", struct), beside),
        Row("path-subfolder", lambda f: one_image(f, "imgs/a.png"), read_from(lambda f: f / "data" / "imgs" / "a.png")),
        Row("path-from-another-folder", _sibling, read_from(lambda f: f / "data" / ".." / "other" / "a.png")),
        Row("path-only-in-working-dir", _only_in_cwd, ("--data: row 1: images[0]", "data/a.png' does not exist")),
        Row("path-absolute", lambda f: write(f, [chat([str(png(f, "abs.png"))])]), read_from(lambda f: f / "abs.png")),
        Row("path-gz-jsonl", _gz, read_from(lambda f: f / "data" / "a.png")),
        Row("path-unicode-spaces", lambda f: one_image(f, "my cat é.png"),
            read_from(lambda f: f / "data" / "my cat é.png")),
        Row("path-symlink", _symlink, read_from(lambda f: f / "data" / "link.png")),
        Row("path-broken-symlink", _broken_symlink, ("row 1: images[0]", "link.png' does not exist")),
        Row("path-trailing-space", lambda f: _named(f, "a.png "), ("row 1: images[0]", "a.png ' does not exist")),
        Row("path-file-url", lambda f: _named(f, "file:///tmp/a.png"), ("'file:///tmp/a.png' is a file: URL",)),
    ]
    return rows


def _named(folder: Path, name: Any, fmt: str = "jsonl") -> Path:
    png(folder / "data", "a.png")
    return write(folder, [chat([name])], fmt)


def _sibling(folder: Path) -> Path:
    png(folder / "other", "a.png")
    return write(folder, [chat(["../other/a.png"])])


def _only_in_cwd(folder: Path) -> Path:
    png(folder / "cwd", "a.png")  # the test's working directory: never read from
    return write(folder, [chat(["a.png"])])


def _gz(folder: Path) -> Path:
    png(folder / "data", "a.png")
    path = folder / "data" / "rows.jsonl.gz"
    path.write_bytes(gzip.compress((json.dumps(chat(["a.png"])) + "\n").encode()))
    return path


def _symlink(folder: Path) -> Path:
    target = png(folder / "data", "a.png")
    (folder / "data" / "link.png").symlink_to(target)
    return write(folder, [chat(["link.png"])])


def _broken_symlink(folder: Path) -> Path:
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "link.png").symlink_to(folder / "gone.png")
    return write(folder, [chat(["link.png"])])


# -- paths that are not image files, values that are not paths -------------------------------------------------
def _fifo(folder: Path) -> Path:
    (folder / "data").mkdir(parents=True)
    os.mkfifo(folder / "data" / "pipe.png")
    return write(folder, [chat(["pipe.png"])])


def _not_files() -> list[Row]:
    def folder_image(f: Path) -> Path:
        (f / "data" / "imgs").mkdir(parents=True)
        return write(f, [chat(["imgs"])])

    return [
        Row("missing-file", lambda f: _named(f, "nope.png"), ("row 1: images[0]", "nope.png' does not exist")),
        Row("missing-in-struct", lambda f: _named(f, {"bytes": None, "path": "nope.png"}, "parquet"),
            ("row 1: images[0]", "data/nope.png' does not exist")),
        Row("a-folder", folder_image, ("row 1: images[0]", "imgs' is a folder, not an image file")),
        Row("dev-null", lambda f: _named(f, "/dev/null"), ("'/dev/null' is a character device, not an image file",)),
        Row("dev-zero", lambda f: _named(f, "/dev/zero"), ("'/dev/zero' is a character device, not an image file",)),
        Row("named-pipe", _fifo, ("pipe.png' is a named pipe, not an image file",)),
        Row("empty-string", lambda f: _named(f, ""), ("row 1: images[0] is an empty string",)),
        Row("blank-string", lambda f: _named(f, "   "), ("row 1: images[0] is an empty string",)),
        Row("null-image", lambda f: _named(f, None), ("row 1: images[0] is null",)),
        Row("number-image", lambda f: _named(f, 7), ("row 1: images[0] is a int",)),
        Row("list-in-list", lambda f: _named(f, ["a.png"]), ("row 1: images[0] is a list",)),
        Row("bytes-wrong-type", lambda f: write(f, [chat([{"bytes": "iVBOR", "path": None}])]),
            ("row 1: images[0]: its 'bytes' is a str",)),
        Row("bytes-not-an-image", lambda f: write(f, [chat([{"bytes": b"nope", "path": None}])], "parquet"),
            ("row 1: images[0] holds 4 bytes that are not a readable image",)),
        Row("bytes-png", _png_bytes, pixels(twin_image(1, size=(32, 32)).getpixel((0, 0)))),
        Row("empty-file", lambda f: _raw(f, b""), ("a.png' is not a readable image",)),
        Row("text-file", lambda f: _raw(f, b"hello, not a picture\n"), ("a.png' is not a readable image",)),
        Row("truncated-png", lambda f: _raw(f, _encoded("PNG")[:200]), ("a.png' is not a readable image",)),
        Row("truncated-jpeg", lambda f: _raw(f, _encoded("JPEG")[:400]), ("a.png' is not a readable image",)),
    ]


def _encoded(fmt: str, image=None) -> bytes:
    out = io.BytesIO()
    (image or twin_image(2, size=(64, 64))).save(out, format=fmt)
    return out.getvalue()


def _raw(folder: Path, body: bytes) -> Path:
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "a.png").write_bytes(body)
    return write(folder, [chat(["a.png"])])


def _png_bytes(folder: Path) -> Path:
    return write(folder, [chat([{"bytes": _encoded("PNG", twin_image(1, size=(32, 32))), "path": None}])], "parquet")


# -- counts and spellings ---------------------------------------------------------------------------------------
def _spellings() -> list[Row]:
    def parquet_image_column(f: Path) -> Path:
        png(f / "data", "a.png")
        return write(f, [{**chat(), "image": "a.png"}], "parquet")

    return [
        Row("no-images-field", lambda f: write(f, [chat()]), ("row 1: 1 image parts", "but 0 image(s)")),
        Row("images-empty-list", lambda f: write(f, [chat([])]), ("row 1: 1 image parts", "but 0 image(s)")),
        Row("images-empty-string", lambda f: write(f, [chat("")]), ("row 1: 1 image parts", "but 0 image(s)")),
        Row("more-images-than-parts", lambda f: _named(f, "a.png") and write(f, [chat(["a.png", "a.png"])]),
            ("row 1: 2 images but only 1 image part(s)",)),
        Row("image-field", lambda f: write(f, [{**chat(), "image": "a.png"}]),
            ("row 1: an 'image' field: a row names its images in 'images'",)),
        Row("image-and-images", lambda f: _named(f, "a.png") and write(f, [{**chat(["a.png"]), "image": "a.png"}]),
            ("row 1: an 'image' field beside its 'images'",)),
        Row("image-field-no-parts", lambda f: write(f, [{**chat(parts=0), "image": "a.png"}]),
            ("row 1: an 'image' field",)),
        Row("parquet-image-column", parquet_image_column, ("row 1: an 'image' field",)),
        Row("image-url-part", lambda f: write(f, [{"messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]},
            {"role": "assistant", "content": "A cat."}]}]),
            ("row 1: messages[0].content[0] is {'type': 'image_url'", "'images' list")),
        Row("inline-image-in-part", lambda f: write(f, [{"messages": [
            {"role": "user", "content": [{"type": "image", "image": "a.png"}]},
            {"role": "assistant", "content": "A cat."}]}]),
            ("row 1: messages[0].content[0] is {'type': 'image', 'image': ...}",)),
        Row("message-not-object", lambda f: write(f, [{"messages": [ASK, "A cat."], "images": ["a.png"]}]),
            ("row 1: messages[1] is a str",)),
        Row("part-not-object", lambda f: write(f, [{"messages": [{"role": "user", "content": [{"type": "image"}, 5]},
                                                                 {"role": "assistant", "content": "x"}],
                                                    "images": ["a.png"]}]),
            ("row 1: messages[0].content[1] is a int",)),
        Row("messages-not-list", lambda f: write(f, [{"messages": "hi", "images": ["a.png"]}]),
            ("row 1: no 'messages' list",)),
    ]


# -- what a model sees: modes, bit depths, frames, orientation ---------------------------------------------------
def _modes() -> list[Row]:
    grey16 = Image.fromarray(np.full((32, 32), 32896, dtype=np.uint16))  # mid-grey at 16 bits
    grey32 = Image.fromarray(np.full((32, 32), 65535, dtype=np.int32))
    palette = Image.new("P", (32, 32), 1)
    palette.putpalette([255, 0, 0, 0, 0, 0] + [0] * 762)
    palette.info["transparency"] = 1  # index 1 (black) transparent
    cmyk = Image.new("CMYK", (32, 32), (0, 255, 255, 0))  # red
    return [
        Row("grey-16-bit-png", lambda f: one_image(f, "a.png", image=grey16), pixels((128, 128, 128))),
        Row("grey-32-bit-int", lambda f: one_image(f, "a.tif", image=grey32), pixels((255, 255, 255))),
        Row("rgba-transparent", lambda f: one_image(f, "a.png", image=Image.new("RGBA", (32, 32), (0, 0, 0, 0))),
            pixels((255, 255, 255))),
        Row("la-transparent", lambda f: one_image(f, "a.png", image=Image.new("LA", (32, 32), (0, 0))),
            pixels((255, 255, 255))),
        Row("palette-transparent", lambda f: one_image(f, "a.png", image=palette), pixels((255, 255, 255))),
        Row("rgba-opaque", lambda f: one_image(f, "a.png", image=Image.new("RGBA", (32, 32), (10, 20, 30, 255))),
            pixels((10, 20, 30))),
        Row("cmyk-jpeg", lambda f: one_image(f, "a.jpg", image=cmyk), _reddish),
        Row("one-bit", lambda f: one_image(f, "a.png", image=Image.new("1", (32, 32), 1)), pixels((255, 255, 255))),
        Row("float-pixels", lambda f: one_image(f, "a.tif", image=Image.new("F", (32, 32), 0.5)),
            ("row 1: images[0] '", "a.tif' has 32-bit float pixels (mode F)")),
        Row("animated-gif", _animated, ("row 1: images[0] '", "a.gif' is an animated or multi-frame image (2 frames)")),
        Row("still-gif", lambda f: one_image(f, "a.gif", image=Image.new("P", (32, 32), 0)), pixels((0, 0, 0))),
        Row("exif-rotated-jpeg", _rotated, pixels((0, 0, 0), size=(20, 40))),
    ]


def _reddish(rows: list[dict], folder: Path) -> None:
    r, g, b = open_image(rows[0]["images"][0], 0, 0).getpixel((5, 5))
    assert r > 200 and g < 60 and b < 60, (r, g, b)


def _animated(folder: Path) -> Path:
    (folder / "data").mkdir(parents=True)
    frames = [Image.new("RGB", (32, 32), colour) for colour in ((255, 0, 0), (0, 0, 255))]
    frames[0].save(folder / "data" / "a.gif", save_all=True, append_images=frames[1:], duration=50)
    return write(folder, [chat(["a.gif"])])


def _rotated(folder: Path) -> Path:
    """A 40x20 JPEG whose EXIF says 'rotate 90': seen upright, 20x40."""
    (folder / "data").mkdir(parents=True)
    image = Image.new("RGB", (40, 20), (0, 0, 0))
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 CW
    image.save(folder / "data" / "a.jpg", exif=exif)
    return write(folder, [chat(["a.jpg"])])


# -- limits the processor or PIL would enforce mid-run ------------------------------------------------------------
def _limits() -> list[Row]:
    return [
        Row("aspect-200", lambda f: one_image(f, "a.png", image=Image.new("RGB", (400, 2))),
            ("row 1: images[0] '", "a.png' is 400x2 pixels, an aspect ratio of 200:1", "refuse 200:1 and more")),
        Row("aspect-199", lambda f: one_image(f, "a.png", image=Image.new("RGB", (398, 2))), image_rows(1)),
        Row("tall-aspect", lambda f: one_image(f, "a.png", image=Image.new("RGB", (1, 500))),
            ("is 1x500 pixels, an aspect ratio of 500:1",)),
        Row("bomb-over-limit", lambda f: one_image(f, "a.png", image=Image.new("L", (40, 40))),
            ("row 1: images[0] '", "a.png' is 40x40 = 1,600 pixels, more than PIL's limit of 1,000",)),
        Row("bomb-twice-limit", lambda f: one_image(f, "a.png", image=Image.new("L", (100, 100))),
            ("row 1: images[0] '", "a.png' is refused by PIL's decompression-bomb guard", "MAX_IMAGE_PIXELS")),
        Row("placeholder-user", lambda f: _said(f, "user", "look: <|image_pad|>"),
            ("row 1: messages[0] (user) holds '<|image_pad|>'", "image placeholder")),
        Row("placeholder-assistant", lambda f: _said(f, "assistant", "<|vision_start|>"),
            ("row 1: messages[1] (assistant) holds '<|vision_start|>'",)),
        Row("placeholder-system-string", lambda f: _said(f, "system", "<|image_pad|> rules"),
            ("row 1: messages[0] (system) holds '<|image_pad|>'",)),
        Row("placeholder-idefics3", lambda f: _said(f, "user", "an <image> tag"),
            ("row 1: messages[0] (user) holds '<image>'",), model_type="idefics3"),
        Row("placeholder-gemma3", lambda f: _said(f, "assistant", "<start_of_image>"),
            ("row 1: messages[1] (assistant) holds '<start_of_image>'",), model_type="gemma3"),
        Row("other-familys-placeholder", lambda f: _said(f, "user", "an <image> tag"), image_rows(1)),
        Row("image-in-assistant-turn", _assistant_image, image_rows(1)),
    ]


def _said(folder: Path, role: str, text: str) -> Path:
    png(folder / "data", "a.png")
    row = chat(["a.png"])
    if role == "system":
        row["messages"].insert(0, {"role": "system", "content": text})
    elif role == "user":
        row["messages"][0]["content"][1]["text"] = text
    else:
        row["messages"][1]["content"] = [{"type": "text", "text": text}]
    return write(folder, [row])


def _assistant_image(folder: Path) -> Path:
    png(folder / "data", "a.png")
    row = {"messages": [{"role": "user", "content": "Draw a cat."},
                        {"role": "assistant", "content": [{"type": "text", "text": "Here:"}, {"type": "image"}]}],
           "images": ["a.png"]}
    return write(folder, [row])


# -- which files are image files -------------------------------------------------------------------------------
def _files() -> list[Row]:
    def late(f: Path, fmt: str) -> Path:
        png(f / "data", "a.png")
        text = [{"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "yo"}]}
                for i in range(150)]
        return write(f, text + [chat(["a.png"])], fmt)

    def late_json(f: Path) -> Path:
        png(f / "data", "a.png")
        long = [{"messages": [{"role": "user", "content": "x" * 20000}, {"role": "assistant", "content": "y"}]}
                for _ in range(60)]  # over a MiB before the first image row
        return write(f, long + [chat(["a.png"])], "json")

    def bom(f: Path) -> Path:
        path = one_image(f, "a.png")
        path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
        return path

    def latin1(f: Path) -> Path:
        png(f / "data", "café.png")
        path = write(f, [chat(["a.png"])])
        path.write_bytes(json.dumps(chat(["café.png"]), ensure_ascii=False).encode("latin-1") + b"\n")
        return path

    return [
        Row("image-row-after-row-150", lambda f: late(f, "jsonl"), image_rows(151)),
        Row("image-row-after-row-150-parquet", lambda f: late(f, "parquet"), image_rows(151)),
        Row("image-row-after-a-mib-json", late_json, image_rows(61)),
        Row("utf8-bom", bom, image_rows(1)),
        Row("latin1-encoded", latin1, ("rows.jsonl", "UTF-8")),
    ]


# -- the chat around the images ---------------------------------------------------------------------------------
def _answer(folder: Path, answer: Any, *more: dict) -> Path:
    png(folder / "data", "a.png")
    return write(folder, [{"messages": [ASK, {"role": "assistant", "content": answer}, *more], "images": ["a.png"]}])


def _messages() -> list[Row]:
    return [
        Row("msg-answer-number", lambda f: _answer(f, 5), ("row 1: messages[1].content is a int",)),
        Row("msg-answer-null", lambda f: _answer(f, None), ("row 1: messages[1].content is missing (None)",)),
        Row("msg-answer-empty", lambda f: _answer(f, "  "), ("row 1: messages[1] is an assistant turn with no text",)),
        Row("msg-answer-image-only", lambda f: _answer(f, [{"type": "image"}]) and write(
            f, [{"messages": [{"role": "user", "content": "Draw."},
                              {"role": "assistant", "content": [{"type": "image"}]}], "images": ["a.png"]}]),
            ("row 1: messages[1] is an assistant turn with no text", "never a label")),
        Row("msg-text-null", lambda f: _answer(f, [{"type": "text", "text": None}]),
            ("row 1: messages[1].content[0].text is None, not a string",)),
        Row("msg-text-number", lambda f: _answer(f, [{"type": "text", "text": 5}]),
            ("row 1: messages[1].content[0].text is 5, not a string",)),
        Row("msg-video-part", lambda f: _answer(f, [{"type": "video"}]),
            ("row 1: messages[1].content[0] is a 'video' part",)),
        Row("msg-no-role", lambda f: _answer(f, "A cat.") and write(
            f, [{"messages": [ASK, {"content": "A cat."}], "images": ["a.png"]}]),
            ("row 1: messages[1].role is None",)),
        Row("msg-ends-with-user", lambda f: _answer(f, "A cat.", {"role": "user", "content": "And?"}),
            ("row 1: the last turn is 'user', not 'assistant'",)),
        Row("msg-lone-surrogate", lambda f: _answer(f, "A cat \ud83d."),
            ("row 1: messages[1] holds a lone surrogate character ('\\ud83d')",)),
        Row("msg-two-turns-ok", lambda f: _answer(f, "A cat.", {"role": "user", "content": "Colour?"},
                                                  {"role": "assistant", "content": "Grey."}), image_rows(1)),
    ]


def all_rows() -> list[tuple[str, Row]]:
    return ([("paths", r) for r in _path_rows()] + [("not files", r) for r in _not_files()]
            + [("spellings", r) for r in _spellings()] + [("modes", r) for r in _modes()]
            + [("limits", r) for r in _limits()] + [("files", r) for r in _files()]
            + [("messages", r) for r in _messages()])


__all__ = ["ASK", "Row", "all_rows", "chat", "png", "preflight", "write"]
