"""Every notebook, executed headless with nbclient in twin mode, holds the dashboard and its summary.

FASTKIT_TWIN=1 makes each notebook's parameters cell swap its model for a tiny random twin of the
same architecture (offline, seconds); HF_HUB_OFFLINE=1 makes any accidental download fail. The
bad-input test runs the quickstart's cells in one kernel and feeds the data cell broken datasets:
each must fail in that cell, with fastkit's message, before any training cell ran.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
SECTIONS = ["## Parameters", "## Install", "## Load", "## Data", "## LoRA", "## Train with the dashboard",
            "## Memory and time", "## Try the model", "## Save"]
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


def _kernel_env() -> dict[str, str]:
    return dict(os.environ, FASTKIT_TWIN="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def _client(nb, workdir: Path):
    from nbclient import NotebookClient

    return NotebookClient(nb, kernel_name="python3", timeout=600, startup_timeout=120, store_widget_state=True,
                          resources={"metadata": {"path": str(workdir)}})


def _outputs(cell) -> list:
    return cell.get("outputs", [])


def _cell_with(nb, text: str):
    return next(c for c in nb.cells if c.cell_type == "code" and text in c.source)


# -- structure (cheap, no kernel) --------------------------------------------------------------
def test_notebooks_are_generated_and_up_to_date():
    import runpy

    build = runpy.run_path(str(ROOT / "notebooks" / "_build.py"))
    assert build["main"](["--check"]) == 0, "run python notebooks/_build.py"
    assert [p.name for p in NOTEBOOKS] == [s.filename for s in build["SPECS"]]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_structure(path):
    import nbformat

    nb = nbformat.read(path, as_version=4)
    h2 = [line for c in nb.cells if c.cell_type == "markdown"
          for line in c.source.splitlines() if line.startswith("## ")]
    assert h2 == SECTIONS
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1
    for name in ("MODEL", "MAX_SEQ_LENGTH", "MAX_STEPS", "USE_TWIN"):
        assert re.search(rf"^{name} = ", params[0].source, re.M), name
    assert 'os.environ.get("FASTKIT_TWIN") == "1"' in params[0].source
    install = _cell_with(nb, "pip")
    assert "not USE_TWIN" in install.source and 'find_spec("fastkit") is None' in install.source
    # thin: every code cell is short, the logic lives in fastkit
    assert max(len(c.source.splitlines()) for c in nb.cells if c.cell_type == "code") <= 20


# -- execution ---------------------------------------------------------------------------------
@pytest.mark.notebook
@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_with_twin(path, tmp_path):
    import nbformat

    nb = nbformat.read(path, as_version=4)
    _client(nb, tmp_path).execute(env=_kernel_env())
    errors = [o for c in nb.cells for o in _outputs(c) if o.output_type == "error"]
    assert not errors, errors

    train = _cell_with(nb, "fit(trainer)")
    outs = _outputs(train)
    # 1. the live dashboard: a widget view whose model is a VBox with the fastkit-dashboard class, saved in the notebook
    state = nb.metadata["widgets"][WIDGET_STATE]["state"]
    views = [o.data[WIDGET_VIEW]["model_id"] for o in outs if WIDGET_VIEW in o.get("data", {})]
    dashboards = [v for v in views if "fastkit-dashboard" in state.get(v, {}).get("state", {}).get("_dom_classes", [])]
    assert len(dashboards) == 1, views
    assert state[dashboards[0]]["model_name"] == "VBoxModel"
    # 2. the static summary: an HTML table and a PNG plot, after the widget
    html = [o.data["text/html"] for o in outs if "text/html" in o.get("data", {})]
    assert len(html) == 1 and "fastkit-summary" in html[0] and "<table" in html[0]
    assert "finished" in html[0] and "Steps/s" in html[0] and "Tokens/s" in html[0]
    pngs = [o for o in outs if "image/png" in o.get("data", {})]
    assert len(pngs) == 1
    assert outs.index(pngs[0]) > [i for i, o in enumerate(outs) if WIDGET_VIEW in o.get("data", {})][-1]

    summary = _cell_with(nb, "memory_time_summary(metrics)")
    assert any("Memory and time" in o.get("data", {}).get("text/html", "") for o in _outputs(summary))
    answers = "".join(o.get("text", "") for o in _outputs(_cell_with(nb, "chat(model")))
    assert answers.count("Q: ") >= 1
    out_dir = tmp_path / "outputs" / path.stem
    assert (out_dir / "lora" / "adapter_model.safetensors").exists()
    assert any((out_dir / "merged_16bit").glob("*.safetensors"))


BAD_INPUTS = [
    ('DATASET = [{"question": "What is 2+2?", "answer": "4"}]', "fastkit needs one of"),
    ("DATASET = []", "dataset is empty"),
    ('DATASET = [{"messages": [{"role": "user", "content": "hi"}]}] * 3', "Every label is masked"),
    ('DATASET = "quickstart"; tokenizer.chat_template = None', "no chat template"),
]


@pytest.mark.notebook
@pytest.mark.slow
def test_bad_input_fails_in_the_data_cell_before_training(tmp_path):
    import nbformat
    from nbclient.exceptions import CellExecutionError
    from nbformat.v4 import new_code_cell

    nb = nbformat.read(ROOT / "notebooks" / "00_quickstart.ipynb", as_version=4)
    data = _cell_with(nb, "check_dataset(")
    data_index = nb.cells.index(data)
    client = _client(nb, tmp_path)
    with client.setup_kernel(env=_kernel_env()):
        for i, cell in enumerate(nb.cells[:data_index]):
            if cell.cell_type == "code":
                client.execute_cell(cell, i)
        for setup, message in BAD_INPUTS:
            client.execute_cell(new_code_cell(setup), data_index)
            with pytest.raises(CellExecutionError) as info:
                client.execute_cell(data, data_index)
            assert info.value.ename == "FastkitError", info.value
            assert message in str(info.value)
            assert "Traceback" not in info.value.evalue
        # nothing trained: the cells after the data cell never ran
        client.execute_cell(new_code_cell('assert "trainer" not in globals() and "metrics" not in globals()'),
                            data_index)
