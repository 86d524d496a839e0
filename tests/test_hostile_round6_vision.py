"""The round-6 hostile matrix for image + text rows (issue 53): tests/hostile_round6_vision.py's rows run through
``fastkit train``'s preflight (no model), then what needs a processor (the twins', no model): placeholders masked in
every turn of every vision family, the processor's own refusals named as bad input; URLs (a local http.server); and
a few rows end to end through ``fastkit train`` (exit 2 before the model loads)."""

from __future__ import annotations

from collections import Counter

import pytest
from PIL import Image

from fastkit import FastModel, cli, registry
from fastkit.data.vision import VisionCollator, check_vision_rows, encode_row, fetch_images, open_image
from fastkit.errors import FastkitError
from fastkit.families.vision import twin_image, vision_twin_processor
from tests.hostile_round6_vision import Row, all_rows, chat, png, preflight, write

ROWS = all_rows()
CASES = [row for _, row in ROWS]
VISION_FAMILIES = [name for name, row in registry.MODEL_TABLE.items() if row.vision is not None]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_round6_vision(case: Row, tmp_path, monkeypatch):
    data = case.build(tmp_path)
    (tmp_path / "cwd").mkdir(exist_ok=True)
    png(tmp_path / "cwd", "a.png")  # a decoy where the working directory would read a relative path from
    monkeypatch.chdir(tmp_path / "cwd")
    if "bomb" in case.id:
        monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    if callable(case.expect):
        case.expect(preflight(data, case.model_type), tmp_path)
        return
    with pytest.raises(FastkitError) as exc:
        preflight(data, case.model_type)
    for needle in case.expect:
        assert needle in str(exc.value), f"{needle!r} not in: {exc.value}"


def test_round6_vision_rows_by_class():
    counts = Counter(cls for cls, _ in ROWS)
    assert len({c.id for c in CASES}) == len(CASES), "duplicate row ids"
    assert set(counts) == {"paths", "not files", "spellings", "modes", "limits", "files",
                           "messages"}, counts
    assert len(CASES) >= 90, len(CASES)


# -- with a processor (the twins': no model loads) ----------------------------------------------------------------
@pytest.fixture(scope="module")
def processors():
    return {name: vision_twin_processor(name) for name in VISION_FAMILIES}


def _trained(processor, row) -> str:
    ids, mask = encode_row(row, processor)
    return processor.tokenizer.decode([t for t, m in zip(ids, mask) if m])


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_an_image_in_an_assistant_turn_is_never_a_label(processors, family):
    processor = processors[family]
    row = {"messages": [{"role": "user", "content": "Draw a cat."},
                        {"role": "assistant", "content": [{"type": "text", "text": "Here:"}, {"type": "image"},
                                                          {"type": "text", "text": " done."}]}],
           "images": [twin_image(1)]}
    trained = _trained(processor, row)
    assert trained.startswith("Here:") and "done." in trained, trained
    for token in (processor.image_token, "<|vision_start|>", "<start_of_image>", "<end_of_image>",
                  "<fake_token_around_image>", "<global-img>", "<image_soft_token>"):
        assert token not in trained, (family, trained)
    plain = {**row, "messages": [row["messages"][0], {"role": "assistant", "content": "Here: done."}], "images": []}
    assert _trained(processor, plain).replace(" ", "") == trained.replace(" ", "").replace("\n\n", ""), trained
    batch = VisionCollator(processor, 512)([row])  # the collator's labels: the same mask
    labels = batch["labels"][0]
    assert processor.tokenizer.decode(labels[labels != -100]) == trained


@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_a_literal_placeholder_is_refused_with_the_processor_in_hand(processors, family):
    processor = processors[family]
    literal = processor.image_token
    row = chat([twin_image(1)], answer=f"it is {literal}")
    with pytest.raises(FastkitError, match=rf"row 1: messages\[1\] \(assistant\) holds '{literal}'"):
        check_vision_rows([row], processor, 512)


def test_the_processors_own_refusal_is_bad_input_naming_the_row(processors, monkeypatch):
    """Where a processor limit is not checked up front (here: the aspect-ratio check lifted), its ValueError is still
    named as the row's, a FastkitError (exit 2), not a raw error (exit 3)."""
    monkeypatch.setattr("fastkit.data.vision.MAX_ASPECT_RATIO", 10**6)
    row = chat([Image.new("RGB", (2, 500))])
    with pytest.raises(FastkitError, match="row 1: the processor refused it .*aspect ratio"):
        check_vision_rows([row], processors["qwen2_5_vl"], 512)


def test_in_memory_images_follow_the_same_pixel_rules():
    import numpy as np

    grey = Image.fromarray(np.full((8, 8), 65535, dtype=np.uint16))
    assert open_image(grey, 0, 0).getpixel((0, 0)) == (255, 255, 255)
    assert open_image(Image.new("RGBA", (8, 8), (0, 0, 0, 0)), 0, 0).getpixel((0, 0)) == (255, 255, 255)
    with pytest.raises(FastkitError, match="row 4: images\\[1\\] is 400x2 pixels"):
        open_image(Image.new("RGB", (400, 2)), 3, 1)


# -- URLs ---------------------------------------------------------------------------------------------------------
@pytest.fixture
def server():
    import http.server
    import io
    import threading

    jpeg = io.BytesIO()
    twin_image(2, size=(64, 64)).save(jpeg, format="JPEG")
    png_bytes = io.BytesIO()
    twin_image(1).save(png_bytes, format="PNG")
    cut = jpeg.getvalue()[:len(jpeg.getvalue()) // 2]  # its header reads (PIL's verify() passes); its pixels do not
    served = {"/cut.jpg": cut, "/cat.png": png_bytes.getvalue(),
              "/wide.png": _encoded(Image.new("RGB", (400, 2)))}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            body = served.get(self.path)
            self.send_response(200 if body else 404)
            self.send_header("Content-Type", "image/jpeg")
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def _encoded(image) -> bytes:
    import io

    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(autouse=True)
def no_proxy(monkeypatch):
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)


def test_a_truncated_download_is_refused_naming_the_url_and_not_cached(server, tmp_path):
    url = f"{server}/cut.jpg"
    with pytest.raises(FastkitError, match=f"row 1: images\\[0\\] {url} answered \\d+ bytes that are not an image"):
        fetch_images([chat([url])], cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())


def test_a_broken_cached_file_is_refused_naming_its_url(server, tmp_path):
    url = f"{server}/cat.png"
    fetched = fetch_images([chat([url])], cache_dir=tmp_path)
    cached = fetched[0]["images"][0]
    with open(cached, "r+b") as f:  # damaged after the fetch (a full disk, an older fastkit's cache)
        f.truncate(100)
    with pytest.raises(FastkitError, match=f"row 1: images\\[0\\] {url} \\(fetched into '{cached}'\\) is not a "
                                           "readable image"):
        open_image(cached, 0, 0)


def test_a_url_too_wide_is_refused_naming_it(server, tmp_path):
    url = f"{server}/wide.png"
    with pytest.raises(FastkitError, match=f"row 1: images\\[0\\] {url} is 400x2 pixels"):
        fetch_images([chat([url])], cache_dir=tmp_path)


@pytest.mark.parametrize("form", ["string", "struct"])
def test_a_url_in_every_form_is_fetched_before_training(server, tmp_path, form):
    url = f"{server}/cat.png"
    image = url if form == "string" else {"bytes": None, "path": url}
    fetched = fetch_images([chat(image)], cache_dir=tmp_path)[0]["images"][0]
    path = fetched if form == "string" else fetched["path"]
    assert path.startswith(str(tmp_path)) and open_image(fetched, 0, 0).size == twin_image(1).size


# -- end to end: fastkit train, exit 2 before the model loads -------------------------------------------------------
@pytest.fixture(scope="module")
def vlm_folder(tmp_path_factory):
    from tests.helpers import saved_vlm_twin

    return saved_vlm_twin(tmp_path_factory)


def _dev_null(folder):
    return write(folder, [chat(["/dev/null"])])


def _placeholder(folder):
    png(folder / "data", "a.png")
    return write(folder, [chat(["a.png"], answer="<|image_pad|>")])


def _late_missing(folder):
    text = [{"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "yo"}]}
            for i in range(120)]
    return write(folder, text + [chat(["gone.png"])])


@pytest.mark.parametrize("build, message", [
    (_dev_null, "--data: row 1: images[0] '/dev/null' is a character device, not an image file"),
    (_placeholder, "--data: row 1: messages[1] (assistant) holds '<|image_pad|>'"),
    (_late_missing, "--data: row 121: images[0]"),
], ids=["device", "placeholder", "row-120"])
def test_fastkit_train_refuses_before_the_model_loads(vlm_folder, tmp_path, capsys, monkeypatch, build, message):
    def refuse(*args, **kwargs):
        raise AssertionError("the model loaded before the data was refused")

    data = build(tmp_path)
    monkeypatch.setattr(FastModel, "from_pretrained", refuse)
    code = cli.main(["train", "--model", vlm_folder, "--data", str(data), "--steps", "1", "--output-dir",
                     str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and message in err, (code, err)
