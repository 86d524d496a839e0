"""A real browser: JupyterLab on 127.0.0.1, driven by Playwright with Debian Chromium, runs the quickstart.

The test runs ``notebooks/00_quickstart.ipynb`` in twin mode (FASTKIT_TWIN=1, offline) twice:

- ``html``: the default dashboard (HTML updated in place through a display handle) in a kernel where
  ipywidgets cannot be imported (a shadowing package on PYTHONPATH raises ImportError): the live
  panel goes to ``assets/dashboard_html.png``, the panel with its warning after a real loss spike (the
  LoRA weights jolted by a callback) to ``assets/dashboard_warning.png``, the static summary after a stop
  to ``assets/dashboard_summary.png``; at a Colab-like 1024 px width.
- ``widget``: ``FASTKIT_DASHBOARD=widget``, the ipywidgets panel, to ``assets/dashboard_jupyterlab.png``.

Each waits for the live dashboard to draw its curves, and fails when it did not render: JupyterLab's
"Error rendering"/"Error displaying widget" or the raw ``VBox(...)`` text that a front-end without
the widget manager shows instead.

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
JOLT_FLAG = "jolt-now"
"""html mode: once the live screenshot is taken the test creates this file in the notebook's folder; at the
next step end a callback scales the output layer up (what a diverging update does), so the next losses spike
for real and the dashboard's warning shows (``dashboard_warning.png``)."""
JOLT = f"""import os
import torch
from transformers import TrainerCallback

class Jolt(TrainerCallback):  # browser test: a real loss spike once {JOLT_FLAG!r} exists
    done = False

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if not self.done and os.path.exists({JOLT_FLAG!r}):
            self.done = True
            with torch.no_grad():  # the output layer scaled up, as a diverging update would
                model.get_output_embeddings().weight.mul_(30)
"""
COLAB_WIDTH = 1024
"""Viewport width for the html mode: about what Colab's output area gets on a laptop screen."""


def _missing(reason: str) -> None:
    """Skip locally; in CI (``CI=true``: .ci/run installs both) a missing browser is a failure, not a skip."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true but {reason}: the browser tests would not run")
    pytest.skip(reason)


def _require_browser():
    if not os.path.exists(CHROMIUM):
        _missing(f"{CHROMIUM} is missing (Debian: apt-get install -y chromium)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        _missing("the playwright Python package is missing (pip install playwright; not `playwright install`)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


IPYWIDGETS_CHECK = """
try:
    import ipywidgets  # noqa: F401
    print("ipywidgets: importable")
except ImportError:
    print("ipywidgets: not importable")"""


def _prepare_notebook(workdir: Path, jolt: bool = False) -> str:
    """A copy of the quickstart whose parameters cell asks for more steps (like papermill's injection);
    ``jolt``: the train cell adds the :data:`JOLT` callback (a real loss spike)."""
    import nbformat

    nb = nbformat.read(ROOT / "notebooks" / "00_quickstart.ipynb", as_version=4)
    params = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    params.source += f"\noptions.max_steps = {BROWSER_STEPS}  # browser test: time to watch the live dashboard"
    params.source += IPYWIDGETS_CHECK
    if jolt:
        train = next(c for c in nb.cells if c.cell_type == "code" and "fit(trainer" in c.source)
        jolted = train.source.replace("metrics = fit(", "trainer.add_callback(Jolt())\nmetrics = fit(")
        train.source = JOLT + "\n" + jolted
        # The jolt leaves a diverged model, whose GGUF rounding moves its logits far more than a trained model's
        # (q8_0: 0.27 of the scale once; f16: 0.0116). save_gguf bounds each tensor by its quantization's rounding and
        # checks the file's model on the exact weights, so the notebook's own q8_0 export saves here too.
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


def _hide_ipywidgets(env: dict[str, str], tmp: Path) -> None:
    """Make ``import ipywidgets`` fail in the kernel, as where it is not installed."""
    shim = tmp / "no-ipywidgets" / "ipywidgets"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text('raise ImportError("ipywidgets is hidden for this test")\n')
    env["PYTHONPATH"] = os.pathsep.join([str(shim.parent), env["PYTHONPATH"]])


@pytest.mark.parametrize("mode", ["html", "widget"])
def test_quickstart_dashboard_in_jupyterlab(tmp_path, mode):
    _require_browser()
    from playwright.sync_api import sync_playwright

    workdir = tmp_path / "work"
    workdir.mkdir()
    name = _prepare_notebook(workdir, jolt=mode == "html")
    port = _free_port()
    env = _lab_env(tmp_path)
    if mode == "widget":
        env["FASTKIT_DASHBOARD"] = "widget"
    else:
        _hide_ipywidgets(env, tmp_path)
    log_path = tmp_path / "lab.log"
    with open(log_path, "w") as log:
        lab = _start_lab(workdir, env, port, log)
        try:
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
                try:
                    _drive(browser, port, name, mode, workdir)
                except Exception as exc:  # what the notebook showed, so a CI failure says why
                    raise AssertionError(f"{exc}\n{_failure_report(browser, log_path, tmp_path)}") from exc
                finally:
                    browser.close()
        finally:
            lab.terminate()
            try:
                lab.wait(timeout=20)
            except subprocess.TimeoutExpired:
                lab.kill()


def _drive(browser, port: int, name: str, mode: str, workdir: Path) -> None:
    assets = ROOT / "assets"
    assets.mkdir(exist_ok=True)
    width = COLAB_WIDTH if mode == "html" else 1280
    page = browser.new_page(viewport={"width": width, "height": 1000}, device_scale_factor=1)
    page.goto(f"http://127.0.0.1:{port}/lab/tree/{name}", wait_until="domcontentloaded", timeout=120_000)
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
    page.locator("#jp-main-statusbar").get_by_text("Idle").first.wait_for(timeout=120_000)  # kernel ready
    _menu(page, "Run", "Run All Cells")

    # Live: the dashboard is on the page, has drawn its curves, and the rates are past warm-up.
    dash = page.locator(".fastkit-dashboard")
    dash.wait_for(state="visible", timeout=240_000)
    page.wait_for_function(
        "(n) => { const d = document.querySelector('.fastkit-dashboard');"
        " if (!d) return false; const img = d.querySelector('img.fastkit-has-curves');"
        " const step = /step (\\d+) \\//.exec(d.innerText);"
        " return img && img.naturalWidth > 0 && /steps\\/s/.test(d.innerText) && step && +step[1] >= n; }",
        arg=LIVE_STEPS, timeout=240_000)
    page.wait_for_timeout(2500)  # one more plot refresh (the curves are redrawn every second or two)
    assert not _page_text_problems(page), _page_text_problems(page)
    text = dash.inner_text()
    for label in ("fastkit training", "step", "Loss", "Learning rate", "Grad norm", "Tokens/s"):
        assert label in text, f"{label!r} missing from the live dashboard: {text!r}"
    assert "running" in text, "training ended before the live dashboard was captured"
    if mode == "html":
        assert page.locator(".jp-OutputArea-output", has_text="ipywidgets: not importable").count() == 1
        assert page.locator(".jp-OutputArea-output[data-mime-type='text/html'] .fastkit-dashboard").count() == 1
        assert "effective batch" in text and "examples" in text and "Epoch" in text
    live_png = assets / ("dashboard_html.png" if mode == "html" else "dashboard_jupyterlab.png")
    if mode == "html":   # the output is replaced every second: capture the page where the panel is
        _clip_screenshot(page, dash, live_png)
        assert "fastkit-alerts" not in dash.inner_html()  # no warning before the jolt
        (workdir / JOLT_FLAG).touch()        # the jolt: the loss spikes for real and the panel shows the warning box
        page.wait_for_function("() => { const d = document.querySelector('.fastkit-dashboard');"
                               " return d && d.querySelector('.fastkit-alerts') && /Loss spike/.test(d.innerText); }",
                               timeout=240_000)
        page.wait_for_timeout(2500)  # a redraw or two after the spike: the curves show it
        _clip_screenshot(page, dash, assets / "dashboard_warning.png")
        assert "Loss spike" in dash.inner_text() and "new run" in dash.inner_text()
    else:
        dash.scroll_into_view_if_needed()
        dash.screenshot(path=str(live_png))

    # Jupyter's stop button: training stops cleanly, the static summary (HTML table + PNG) appears,
    # and the cells after training (memory summary, chat, save) still run with the model.
    _menu(page, "Kernel", "Interrupt Kernel")
    summary = page.locator(".fastkit-summary")
    summary.wait_for(state="visible", timeout=120_000)
    assert "interrupted" in summary.inner_text()
    page.wait_for_function("() => /interrupted/.test(document.querySelector('.fastkit-dashboard').innerText)",
                           timeout=60_000)
    _wait_last_cell(page, "merged 16-bit:")
    assert page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']",
                        has_text="Traceback").count() == 0
    assert not _page_text_problems(page), _page_text_problems(page)
    if mode == "html":   # the panel itself became the summary, its plot inline
        assert page.locator(".fastkit-dashboard.fastkit-summary img").count() == 1
        assert "Loss spike" in summary.inner_text()  # the warning stays in the summary
        summary.scroll_into_view_if_needed()
        summary.screenshot(path=str(assets / "dashboard_summary.png"))
    else:
        _screenshot_summary(page, summary, assets / "dashboard_widget_summary.png")
    assert live_png.stat().st_size > 10_000


def _wait_last_cell(page, marker: str, timeout_s: float = 240) -> None:
    """Wait for ``marker`` in an output (the last cell ran), failing at once when a cell showed an error
    instead: Jupyter skips the cells after a failed one, so waiting longer would only hide why."""
    page.wait_for_function(
        "(m) => { const outs = Array.from(document.querySelectorAll('.jp-OutputArea-output'));"  # textContent: also
        " return outs.some(e => e.textContent.includes(m)) || outs.some(e => e.dataset.mimeType"  # off-screen cells
        " === 'application/vnd.jupyter.stderr' && e.textContent.includes('Traceback')); }",
        arg=marker, timeout=timeout_s * 1000)
    if not page.get_by_text(marker).count():
        raise AssertionError(f"a cell failed before the one that prints {marker!r}")


def _failure_report(browser, log_path: Path, tmp: Path) -> str:
    """The notebook's text as the page shows it (its last outputs) and the tail of JupyterLab's log."""
    parts = []
    for context in browser.contexts:
        for page in context.pages:
            try:
                text = page.locator(".jp-Notebook").inner_text(timeout=10_000)
                page.screenshot(path=str(tmp / "failure.png"), full_page=True)
            except Exception as exc:  # the page itself may be what failed
                text = f"(could not read the page: {exc})"
            parts.append("notebook as shown (last 6,000 characters):\n" + text[-6000:])
    log = log_path.read_text(errors="replace") if log_path.exists() else ""
    parts.append("jupyter lab log (last 3,000 characters):\n" + log[-3000:])
    return "\n".join(parts)


def _clip_screenshot(page, element, path: Path) -> None:
    """A page screenshot clipped to ``element``, which the live redraw may replace at any moment.

    The redraw can swap the element between measuring it and taking the picture (the old box is then
    empty or off the page: playwright says "Clipped area is either empty or outside the resulting image"),
    so each try measures again and only a box that lies on the viewport is used."""
    from playwright.sync_api import Error as PlaywrightError

    view = page.viewport_size
    last = None
    for _ in range(20):
        element.evaluate("e => e.scrollIntoView({block: 'start'})")
        page.wait_for_timeout(300)
        box = element.bounding_box()
        if not _on_viewport(box, view):
            last = f"box {box} not on the {view} viewport"
            continue
        try:
            page.screenshot(path=str(path), clip={k: box[k] for k in ("x", "y", "width", "height")})
            return
        except PlaywrightError as exc:  # replaced between measuring and capturing: measure again
            last = str(exc).splitlines()[0]
    raise AssertionError(f"the live dashboard never stayed on the page long enough to be captured: {last}")


def _on_viewport(box, view) -> bool:
    """Whether ``box`` (a bounding box, or None) has an area and overlaps the viewport."""
    if box is None or box["width"] < 1 or box["height"] < 1:
        return False
    return box["x"] < view["width"] and box["y"] < view["height"] and box["x"] + box["width"] > 0 \
        and box["y"] + box["height"] > 0


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
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="apt-get install -y chromium"):
        _require_browser()


def test_a_missing_browser_fails_in_ci(monkeypatch):
    """CI=true: a Chromium install that failed makes the browser tests fail instead of skipping silently."""
    monkeypatch.setattr(os.path, "exists", lambda p: False if p == CHROMIUM else os.path.isfile(p))
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true but .*apt-get install -y chromium"):
        _require_browser()


def test_clip_screenshot_measures_again_when_the_redraw_swaps_the_panel(tmp_path):
    """The live panel replaced between measuring and capturing (CI saw "Clipped area is either empty or
    outside the resulting image"): the capture measures again instead of failing the run."""
    pytest.importorskip("playwright")
    from playwright.sync_api import Error as PlaywrightError

    boxes = iter([None, {"x": 0, "y": 0, "width": 0, "height": 0},            # mid-redraw: no box, empty box
                  {"x": 0, "y": 1400, "width": 800, "height": 300},         # below the viewport
                  {"x": 0, "y": 10, "width": 800, "height": 300},           # swapped before the capture
                  {"x": 0, "y": 10, "width": 800, "height": 300}])
    shots = []

    class Element:
        def evaluate(self, script):
            pass

        def bounding_box(self):
            return next(boxes)

    class Page:
        viewport_size = {"width": 1024, "height": 1000}

        def wait_for_timeout(self, ms):
            pass

        def screenshot(self, path, clip):
            shots.append(clip)
            if len(shots) == 1:
                raise PlaywrightError("Page.screenshot: Clipped area is either empty or outside the resulting image")
            Path(path).write_bytes(b"png")

    _clip_screenshot(Page(), Element(), tmp_path / "shot.png")
    assert (tmp_path / "shot.png").read_bytes() == b"png" and len(shots) == 2
    assert shots[-1] == {"x": 0, "y": 10, "width": 800, "height": 300}
