"""A real browser: JupyterLab on 127.0.0.1, driven by Playwright with Debian Chromium, runs the quickstart.

The test runs ``notebooks/00_quickstart.ipynb`` in twin mode (FASTKIT_TWIN=1, offline), waits for the
live dashboard widget to draw its curves, screenshots it to ``assets/dashboard_jupyterlab.png`` and,
after training, the static summary to ``assets/dashboard_summary.png``. It fails when the widget did
not render: JupyterLab's "Error rendering"/"Error displaying widget" or the raw ``VBox(...)`` text
that a front-end without the widget manager shows instead.

Needs ``/usr/bin/chromium`` (Debian: ``apt-get install -y chromium``) and ``pip install playwright``
(never ``playwright install``: the system Chromium is used). Skips only when one of those is absent.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-background-networking", "--disable-gpu", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
BROWSER_STEPS = 5000
"""Steps asked for in the browser run: more than it needs, the test stops training with Jupyter's
interrupt once the live dashboard is captured (which also exercises the clean-stop path)."""
LIVE_STEPS = 20
"""Steps to wait for before the live screenshot, so the curves have some shape."""


def _require_browser():
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing (Debian: apt-get install -y chromium)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("the playwright Python package is missing (pip install playwright; not `playwright install`)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prepare_notebook(workdir: Path) -> str:
    """A copy of the quickstart whose parameters cell asks for more steps (like papermill's injection)."""
    import nbformat

    nb = nbformat.read(ROOT / "notebooks" / "00_quickstart.ipynb", as_version=4)
    params = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    params.source += f"\nMAX_STEPS = {BROWSER_STEPS}  # browser test: time to watch the live dashboard"
    nbformat.write(nb, workdir / "quickstart.ipynb")
    return "quickstart.ipynb"


def _lab_env(tmp: Path) -> dict[str, str]:
    settings = tmp / "lab-settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false",
                                                                           "checkForUpdates": False}))
    env = dict(os.environ, FASTKIT_TWIN="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", JUPYTERLAB_SETTINGS_DIR=str(tmp / "lab-settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp / "lab-workspaces"), JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return env


def _start_lab(workdir: Path, env: dict[str, str], port: int, log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.port={port}", "--ServerApp.port_retries=0", "--IdentityProvider.token=",
           "--ServerApp.password=", f"--ServerApp.root_dir={workdir}", "--LabApp.news_url=None",
           "--LabServerApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"jupyter lab exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    proc.terminate()
    raise RuntimeError("jupyter lab did not answer within 120 s")


def _menu(page, menu: str, item: str) -> None:
    page.locator(".lm-MenuBar-item", has_text=menu).first.click()
    page.locator(f".lm-Menu-item:has(.lm-Menu-itemLabel:text-is('{item}'))").first.click()


def _page_text_problems(page) -> list[str]:
    text = page.locator(".jp-Notebook").inner_text()
    bad = ["Error rendering", "Error displaying widget", "VBox(children", "HBox(children", "Loading widget..."]
    return [b for b in bad if b in text]


def test_quickstart_dashboard_in_jupyterlab(tmp_path):
    _require_browser()
    from playwright.sync_api import sync_playwright

    workdir = tmp_path / "work"
    workdir.mkdir()
    name = _prepare_notebook(workdir)
    port = _free_port()
    log_path = tmp_path / "lab.log"
    with open(log_path, "w") as log:
        lab = _start_lab(workdir, _lab_env(tmp_path), port, log)
        try:
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
                try:
                    _drive(browser, port, name)
                finally:
                    browser.close()
        finally:
            lab.terminate()
            try:
                lab.wait(timeout=20)
            except subprocess.TimeoutExpired:
                lab.kill()


def _drive(browser, port: int, name: str) -> None:
    assets = ROOT / "assets"
    assets.mkdir(exist_ok=True)
    page = browser.new_page(viewport={"width": 1280, "height": 1000}, device_scale_factor=1)
    page.goto(f"http://127.0.0.1:{port}/lab/tree/{name}", wait_until="domcontentloaded", timeout=120_000)
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
    page.locator("#jp-main-statusbar").get_by_text("Idle").first.wait_for(timeout=120_000)  # kernel ready
    _menu(page, "Run", "Run All Cells")

    # Live: the widget is on the page, has drawn its curves, and the rates are past warm-up.
    dash = page.locator(".fastkit-dashboard")
    dash.wait_for(state="visible", timeout=240_000)
    page.wait_for_function(
        "(n) => { const d = document.querySelector('.fastkit-dashboard');"
        " if (!d) return false; const img = d.querySelector('img.fastkit-has-curves');"
        " const step = /step (\\d+) \\//.exec(d.innerText);"
        " return img && img.naturalWidth > 0 && /steps\\/s/.test(d.innerText) && step && +step[1] >= n; }",
        arg=LIVE_STEPS, timeout=240_000)
    page.wait_for_timeout(1500)  # one more plot refresh (the widget redraws the curves every second)
    assert not _page_text_problems(page), _page_text_problems(page)
    text = dash.inner_text()
    for label in ("fastkit training", "step", "Loss", "Learning rate", "Grad norm", "Tokens/s"):
        assert label in text, f"{label!r} missing from the live dashboard: {text!r}"
    assert "running" in text, "training ended before the live dashboard was captured"
    dash.scroll_into_view_if_needed()
    dash.screenshot(path=str(assets / "dashboard_jupyterlab.png"))

    # Jupyter's stop button: training stops cleanly, the static summary (HTML table + PNG) appears,
    # and the cells after training (memory summary, chat, save) still run with the model.
    _menu(page, "Kernel", "Interrupt Kernel")
    summary = page.locator(".fastkit-summary")
    summary.wait_for(state="visible", timeout=120_000)
    assert "interrupted" in summary.inner_text()
    page.wait_for_function("() => /interrupted/.test(document.querySelector('.fastkit-dashboard').innerText)",
                           timeout=60_000)
    page.get_by_text("merged 16-bit:").first.wait_for(timeout=240_000)  # the last cell ran
    assert page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']",
                        has_text="Traceback").count() == 0
    assert not _page_text_problems(page), _page_text_problems(page)
    _screenshot_summary(page, summary, assets / "dashboard_summary.png")
    assert (assets / "dashboard_jupyterlab.png").stat().st_size > 10_000


def _screenshot_summary(page, summary, path: Path) -> None:
    """The summary table and the PNG plot under it (two outputs of the cell) in one picture."""
    plot = summary.locator("xpath=following::img[1]")
    plot.wait_for(state="attached", timeout=30_000)
    summary.evaluate("e => e.scrollIntoView({block: 'start'})")
    page.wait_for_timeout(300)
    a, b = summary.bounding_box(), plot.bounding_box()
    x0, y0 = min(a["x"], b["x"]) - 4, min(a["y"], b["y"]) - 4
    x1, y1 = max(a["x"] + a["width"], b["x"] + b["width"]) + 4, max(a["y"] + a["height"], b["y"] + b["height"]) + 4
    page.screenshot(path=str(path), clip={"x": x0, "y": y0, "width": x1 - x0, "height": y1 - y0})


def test_install_hint_when_browser_missing(monkeypatch):
    """The skip reason names the install command (only when chromium or playwright is absent)."""
    monkeypatch.setattr(os.path, "exists", lambda p: False if p == CHROMIUM else os.path.isfile(p))
    with pytest.raises(pytest.skip.Exception, match="apt-get install -y chromium"):
        _require_browser()
