"""Image URLs in a vision row's ``images`` (fastkit.data.vision.fetch_images / fetch_image): fetched once into a
cache folder before training, an error answer or a non-image answer refused naming the row and the URL. The server
is http.server on 127.0.0.1 in a thread; nothing else on the network."""

from __future__ import annotations

import http.server
import io
import threading

import pytest

from fastkit.data.vision import check_vision_rows, fetch_images, open_image
from fastkit.errors import FastkitError
from fastkit.families.vision import twin_image, vision_twin_processor
from tests.test_vision_data import _row


@pytest.fixture(scope="module")
def server():
    png = io.BytesIO()
    twin_image(1).save(png, format="PNG")
    served = {"/cat.png": (200, "image/png", png.getvalue()), "/page.png": (200, "text/html", b"<html>no</html>")}
    asked: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            asked.append(self.path)
            code, kind, body = served.get(self.path, (404, "text/plain", b"not found"))
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", asked
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(autouse=True)
def no_proxy(monkeypatch):
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)


def test_a_url_is_fetched_once_into_the_cache_folder(server, tmp_path):
    base, asked = server
    url = f"{base}/cat.png"
    rows = [_row(images=[url]), _row(images=[url]), _row()]
    before = asked.count("/cat.png")  # the server is the module's: other tests may have asked for it already
    fetched = fetch_images(rows, cache_dir=tmp_path)
    again = fetch_images(rows, cache_dir=tmp_path)
    assert asked.count("/cat.png") - before == 1  # each URL once, then the cache
    assert fetched == again and fetched[0]["images"][0] == fetched[1]["images"][0]
    assert fetched[0]["images"][0].startswith(str(tmp_path)) and rows[0]["images"] == [url]  # the rows left as given
    assert open_image(fetched[0]["images"][0], 0, 0).size == twin_image(1).size
    assert fetched[2] is rows[2]  # no URL: the row as it was


@pytest.mark.parametrize("path, why", [("/missing.png", "could not be fetched \\(HTTP 404"),
                                       ("/page.png", "answered 15 bytes that are not an image")])
def test_a_bad_url_is_refused_naming_the_row_and_the_url(server, tmp_path, path, why):
    base, _ = server
    rows = [_row(), _row(images=[f"{base}{path}"])]
    with pytest.raises(FastkitError, match=f"row 2: images\\[0\\] {base}{path} {why}"):
        fetch_images(rows, cache_dir=tmp_path)
    assert not list(tmp_path.iterdir())  # nothing cached


def test_unreachable_url_is_refused(tmp_path):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/cat.png"
    with pytest.raises(FastkitError, match=f"row 1: images\\[0\\] {url} could not be fetched"):
        fetch_images([_row(images=[url])], cache_dir=tmp_path, timeout=5)


def test_check_vision_rows_reads_urls(server, tmp_path, monkeypatch):
    base, _ = server
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path))
    monkeypatch.setattr("datasets.config.HF_DATASETS_CACHE", tmp_path)
    processor = vision_twin_processor("qwen2_5_vl")
    assert check_vision_rows([_row(images=[f"{base}/cat.png"])], processor, 256) > 0
    assert list((tmp_path / "fastkit_images").iterdir())  # the default cache: under the datasets cache
    with pytest.raises(FastkitError, match=f"row 1: images\\[0\\] {base}/missing.png could not be fetched"):
        check_vision_rows([_row(images=[f"{base}/missing.png"])], processor, 256)


def test_make_trainer_fetches_url_rows_before_training(server, tmp_path, monkeypatch):
    from fastkit import FastModel
    from fastkit.training import make_trainer

    base, _ = server
    monkeypatch.setattr("datasets.config.HF_DATASETS_CACHE", tmp_path / "cache")
    model, processor = FastModel.from_pretrained("qwen2_5_vl", twin=True, max_seq_length=256)
    trainer = make_trainer(model, processor, [_row(images=[f"{base}/cat.png"])], max_steps=1, packing=False,
                           output_dir=str(tmp_path / "out"), dashboard="none")
    image = trainer.data_collator.rows[0]["images"][0]  # the collator reads the cached file, never the URL
    assert image.startswith(str(tmp_path / "cache" / "fastkit_images"))
    with pytest.raises(FastkitError, match=f"row 1: images\\[0\\] {base}/missing.png could not be fetched"):
        make_trainer(model, processor, [_row(images=[f"{base}/missing.png"])], max_steps=1, packing=False,
                     output_dir=str(tmp_path / "out"))
