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
NOTEBOOKS = sorted(p for p in (ROOT / "notebooks").glob("*.ipynb")
                   if not p.stem.endswith(("_dpo", "_grpo", "_vision")))  # DPO / GRPO: tests/test_notebooks_rl.py,
# vision: tests/test_notebooks_vision.py
SECTIONS = ["## Install", "## Parameters", "## Load", "## Data", "## Answers before training", "## LoRA",
            "## Train with the dashboard", "## Memory and time", "## Answers after training",
            "## Did it work? Base and tuned side by side", "## Save"]
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


def _kernel_env(**extra: str) -> dict[str, str]:
    return dict(os.environ, **extra, FASTKIT_TWIN="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def _client(nb, workdir: Path):
    from nbclient import NotebookClient

    # iopub_timeout: how long nbclient waits for a cell's last outputs after its reply; its default 4 s dropped the
    # quickstart's final print on a starved machine (a random-order run beside CI: "Timeout waiting for IOPub output",
    # the cell's last line missing). Raise instead of dropping output silently.
    return NotebookClient(nb, kernel_name="python3", timeout=600, startup_timeout=120, store_widget_state=True,
                          iopub_timeout=120, raise_on_iopub_timeout=True,
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
    for name in ("MODEL", "DATASET", "USE_TWIN", "RESUME", "MAX_NEW_TOKENS"):
        assert re.search(rf"^{name} = ", params[0].source, re.M), name
    # the training knobs are one fastkit.TrainOptions (the fields `fastkit train` and its YAML have), LoRA's a
    # fastkit.LoraOptions; both made in the parameters cell, so a bad value fails there, before any work
    assert "options = TrainOptions(" in params[0].source and "lora = LoraOptions(" in params[0].source
    for field in ("max_seq_length=", "max_steps=", "epochs=", "batch_size=", "gradient_accumulation_steps=",
                  "learning_rate=", "eval_split=", "report_to=", "output_dir=", "save_steps="):
        assert re.search(rf"^    {field}", params[0].source, re.M), field
    assert 'os.environ.get("FASTKIT_TWIN") == "1"' in params[0].source
    install = _cell_with(nb, "pip")
    assert_install_cell_first_and_alone(nb, install)
    assert 'find_spec("fastkit") is None' in install.source and "raise ModuleNotFoundError(" in install.source
    assert "%pip install" in install.source and '"fastkit-llm' in install.source and " -q" not in install.source
    train = _cell_with(nb, "fit(trainer")
    assert "make_trainer(model, tokenizer, train_dataset, options=options)" in train.source
    assert "fit(trainer, resume=RESUME)" in train.source and "print(run_coverage(" in train.source
    assert "RESUME = False" in params[0].source  # a new run by default
    assert "get_peft_model(model, options=lora)" in _cell_with(nb, "get_peft_model(").source
    save = _cell_with(nb, "export(model, tokenizer, options.output_dir")  # the export menu, as `fastkit export`
    assert "lora=True, merged=MERGED, gguf=GGUF" in save.source and "push_to_hub=PUSH_TO_HUB" in save.source
    assert 'GGUF = ["q8_0"]' in save.source or "GGUF = []\n# No GGUF here yet" in save.source
    # thin: every code cell is short, the logic lives in fastkit (not the install cell's: it runs before fastkit is)
    assert max(len(c.source.splitlines()) for c in nb.cells
               if c.cell_type == "code" and c not in (params[0], install)) <= 20
    assert len(params[0].source.splitlines()) <= 32  # settings, one a line: no logic
    assert len(install.source.splitlines()) <= 32


def assert_install_cell_first_and_alone(nb, install) -> None:
    """Colab's "Run all" on a fresh runtime: the install cell is the first code cell, its first statement is the
    FASTKIT_URL to set, and it reads no name another cell defines (nor imports fastkit, which it installs)."""
    import ast
    import builtins

    assert next(c for c in nb.cells if c.cell_type == "code") is install
    tree = ast.parse("\n".join(line for line in install.source.splitlines() if not line.lstrip().startswith("%")))
    assert isinstance(tree.body[0], ast.Assign) and tree.body[0].targets[0].id == "FASTKIT_URL"
    nodes = list(ast.walk(tree))
    imports = [(getattr(n, "module", None) or a.name, a.asname or a.name.split(".")[0]) for n in nodes
               if isinstance(n, ast.Import | ast.ImportFrom) for a in n.names]  # (module, name bound)
    bound = {n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    bound |= {name for _, name in imports}
    read = {n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    assert read <= bound | set(dir(builtins)), read - bound - set(dir(builtins))
    assert "fastkit" not in {module.split(".")[0] for module, _ in imports}


# -- execution ---------------------------------------------------------------------------------
@pytest.mark.notebook
@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_with_twin(path, tmp_path):
    import nbformat
    import yaml

    nb = nbformat.read(path, as_version=4)
    _client(nb, tmp_path).execute(env=_kernel_env())
    errors = [o for c in nb.cells for o in _outputs(c) if o.output_type == "error"]
    assert not errors, errors

    train = _cell_with(nb, "fit(trainer")
    outs = _outputs(train)
    # the dashboard: one HTML output updated in place (display id), ending as the static summary with the
    # curves inline; no widget (it needs a widget manager) and no raw dicts from the trainer
    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    views = [o.data[WIDGET_VIEW]["model_id"] for o in outs if WIDGET_VIEW in o.get("data", {})]  # e.g. datasets' bars
    assert not [v for v in views if "fastkit-dashboard" in state.get(v, {}).get("state", {}).get("_dom_classes", [])]
    html = [o.data["text/html"] for o in outs if "text/html" in o.get("data", {})]
    assert len(html) == 1 and "fastkit-dashboard" in html[0] and "fastkit-summary" in html[0], html
    assert "finished" in html[0] and "Steps/s" in html[0] and "Tokens/s" in html[0] and "Epoch" in html[0]
    assert "data:image/png;base64," in html[0] and "examples" in html[0] and "effective batch" in html[0]
    assert not [o for o in outs if o.output_type == "stream" and "{'loss'" in o.get("text", "")]
    assert "new run" in html[0] and "Eval loss" in html[0]  # eval_split=0.1 in twin mode
    printed = "".join(o.get("text", "") for o in outs if o.output_type == "stream")
    assert "One run: 6 steps × 1 packed row of ≤256 tokens" in printed and "% of one epoch" in printed, printed
    _check_mask_preview(nb, path)
    # quiet: none of the upstream warnings fastkit filters reaches any output
    stderr = "".join(o.get("text", "") for c in nb.cells for o in _outputs(c) if o.get("name") == "stderr")
    for noise in ("gemm_4bit_forward", "is_gradient_checkpointing", "mtime may not be reliable", "RoPE scaling factor"):
        assert noise not in stderr, (noise, stderr)

    summary = _cell_with(nb, "memory_time_summary(metrics)")
    assert any("Memory and time" in o.get("data", {}).get("text/html", "") for o in _outputs(summary))
    before = "".join(o.get("text", "") for o in _outputs(_cell_with(nb, "before[prompt] = chat(")))
    after = "".join(o.get("text", "") for o in _outputs(_cell_with(nb, "after[prompt] = chat(")))
    assert before.count("Q: ") >= 1 and after.count("before: ") >= 1 and after.count("after: ") >= 1
    if path.stem == "00_quickstart":   # held-out facts and format, scored before and after
        assert "before training: " in before and "after training: " in after and "with the right fact" in after
    out_dir = tmp_path / "outputs" / path.stem
    assert (out_dir / "checkpoint-6" / "trainer_state.json").exists()  # save_steps=3 in twin mode
    saved = yaml.safe_load((out_dir / "fastkit_config.yaml").read_text())  # the options the run used
    assert saved["max_steps"] == 6 and saved["eval_split"] == 0.1 and saved["output_dir"] == f"outputs/{path.stem}"
    assert (out_dir / "lora" / "adapter_model.safetensors").exists()
    assert any((out_dir / "merged_16bit").glob("*.safetensors"))
    save = _cell_with(nb, "export(model, tokenizer, options.output_dir")
    printed = "".join(o.get("text", "") for o in _outputs(save) if o.get("name") == "stdout")
    saved = [line for line in printed.splitlines() if not line.startswith("Ollama: ")]
    assert saved and all(line.endswith(", verified)") for line in saved), printed  # every save reloaded, matched
    if 'GGUF = ["q8_0"]' in save.source:
        assert any((out_dir / "gguf").glob("*-q8_0.gguf")) and (out_dir / "gguf" / "Modelfile").is_file()
        assert "Ollama: ollama create " in printed and "/gguf/Modelfile" in printed, printed


def _check_mask_preview(nb, path: Path) -> None:
    """Twin mode trains the no_robots-shaped sample (multi-turn) in every per-model notebook: the data cell's
    preview counts, per row, the tokens fastkit computes for the raw chats (every assistant turn trained)."""
    from fastkit.data import load_chat_dataset, preview_masks
    from fastkit.families.twins import twin_bpe_tokenizer
    from fastkit.quickstart import NO_ROBOTS_SAMPLE

    shown = "".join(o.get("text", "") for o in _outputs(_cell_with(nb, "preview_masks(")))
    heads = re.findall(r"row \d+: \d+ of \d+ tokens trained", shown)
    assert len(heads) == 3, shown
    if path.stem == "00_quickstart":
        return
    expected = preview_masks(load_chat_dataset(NO_ROBOTS_SAMPLE), twin_bpe_tokenizer(), n=3)
    assert heads == re.findall(r"row \d+: \d+ of \d+ tokens trained", expected)
    assert shown.count("[") >= 4 and "[Water it at the base" in shown and "[When the top inch" in shown, shown


@pytest.mark.notebook
@pytest.mark.slow
def test_train_cell_rerun_is_a_new_run_and_resume_is_on_request(tmp_path):
    """Run the train cell twice: two new runs from step 0. Then, after a run that died past its first checkpoint,
    RESUME = True continues from that checkpoint, and the dashboard says so, with rates."""
    import nbformat
    from nbformat.v4 import new_code_cell

    nb = nbformat.read(ROOT / "notebooks" / "00_quickstart.ipynb", as_version=4)
    train = _cell_with(nb, "fit(trainer")
    at = nb.cells.index(train)
    client = _client(nb, tmp_path)

    def run(source: str) -> str:
        cell = new_code_cell(source)
        nb.cells.append(cell)  # its own index: display-id updates land in this cell's outputs
        client.execute_cell(cell, len(nb.cells) - 1)
        out = "".join(o.get("data", {}).get("text/html", "") + o.get("text", "") for o in _outputs(cell))
        return re.sub(r"base64,[A-Za-z0-9+/=]+", "base64,", out)  # the text, not the inline PNG

    with client.setup_kernel(env=_kernel_env()):
        for i, cell in enumerate(nb.cells[:at]):
            if cell.cell_type == "code":
                client.execute_cell(cell, i)
        for _ in range(2):
            out = run(train.source)
            assert "new run" in out and "resumed" not in out and "6 / 6" in out and "finished" in out, out
            run("assert metrics.resumed_from is None and metrics.loss_history[0][0] == 1, metrics.loss_history\n"
                "assert trainer.state.global_step == 6 and metrics.status == 'finished'")
        # the run died after its checkpoint at step 3: resume on request continues from there
        run("import shutil; shutil.rmtree(f'{options.output_dir}/checkpoint-6'); RESUME = True")
        out = run(train.source)
        assert "resumed from checkpoint-3" in out and "new run" not in out and "6 / 6" in out, out
        run("assert metrics.resumed_from == 3 and metrics.steps_per_s is not None, metrics\n"
            "assert [s for s, _ in metrics.loss_history] == [1, 2, 3, 4, 5, 6], metrics.loss_history")


BAD_INPUTS = [
    ('DATASET = [{"question": "What is 2+2?", "answer": "4"}]', "Rename or map your columns"),
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


def _killer_cell(at_step: int):
    """A cell that registers a callback killing the kernel (SIGKILL, as the OOM killer does) at ``at_step``."""
    from nbformat.v4 import new_code_cell

    return new_code_cell(f"""import os, signal, time
from transformers import TrainerCallback

class KillKernel(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == {at_step} - 1:
            time.sleep(2.5)   # past the dashboard's redraw intervals (text 1 s, curves 2 s): the next step redraws
        elif state.global_step >= {at_step}:
            time.sleep(1.0)   # let the kernel send that redraw, then die mid-run
            os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.notebook
@pytest.mark.slow
def test_kernel_killed_mid_run_leaves_the_dashboard_in_the_saved_notebook(tmp_path):
    import nbformat
    from nbclient.exceptions import DeadKernelError

    nb = nbformat.read(ROOT / "notebooks" / "00_quickstart.ipynb", as_version=4)
    params = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    params.source += "\noptions.max_steps = 500  # far more than the kernel lives for"
    train = _cell_with(nb, "fit(trainer")
    train.source = train.source.replace("metrics = fit(", "trainer.add_callback(KillKernel())\nmetrics = fit(")
    nb.cells.insert(nb.cells.index(train), _killer_cell(at_step=4))
    with pytest.raises(DeadKernelError):
        _client(nb, tmp_path).execute(env=_kernel_env())
    saved = tmp_path / "killed.ipynb"
    nbformat.write(nb, saved)

    outs = _outputs(_cell_with(nbformat.read(saved, as_version=4), "fit(trainer"))
    html = [o.data["text/html"] for o in outs if "text/html" in o.get("data", {})]
    assert len(html) == 1, outs
    panel = html[0]
    assert "fastkit-dashboard" in panel and "running" in panel
    step = int(re.search(r"step <b>(\d+)</b> / 500", panel).group(1))
    assert step >= 3, panel[:500]   # the numbers of the last redraw, not the empty panel of train begin
    assert "Loss" in panel and "data:image/png;base64," in panel and "fastkit-has-curves" in panel


@pytest.mark.notebook
@pytest.mark.slow
def test_widget_view_on_request_saves_widget_state(tmp_path):
    """FASTKIT_DASHBOARD=widget: the ipywidgets panel, saved in the notebook, and the static summary after it."""
    import nbformat

    nb = nbformat.read(ROOT / "notebooks" / "00_quickstart.ipynb", as_version=4)
    _client(nb, tmp_path).execute(env=_kernel_env(FASTKIT_DASHBOARD="widget"))
    outs = _outputs(_cell_with(nb, "fit(trainer"))
    state = nb.metadata["widgets"][WIDGET_STATE]["state"]
    views = [o.data[WIDGET_VIEW]["model_id"] for o in outs if WIDGET_VIEW in o.get("data", {})]
    dashboards = [v for v in views if "fastkit-dashboard" in state.get(v, {}).get("state", {}).get("_dom_classes", [])]
    assert len(dashboards) == 1, views
    assert state[dashboards[0]]["model_name"] == "VBoxModel"
    widget_out = next(o for o in outs if WIDGET_VIEW in o.get("data", {}))
    assert "VBox(" not in widget_out.data["text/plain"]   # what a front-end without the widget manager prints
    html = [o.data["text/html"] for o in outs if "text/html" in o.get("data", {})]
    assert len(html) == 1 and "fastkit-summary" in html[0] and "finished" in html[0]
    pngs = [o for o in outs if "image/png" in o.get("data", {})]
    assert len(pngs) == 1 and outs.index(pngs[0]) > outs.index(widget_out)
