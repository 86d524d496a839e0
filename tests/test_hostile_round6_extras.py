"""Every optional dependency a command needs is checked before its work starts (issue 54, item 2): with the module
made unimportable (``sys.modules[name] = None``, as when it is not installed) the command exits 2 with one line naming
the extra to install (``pip install 'fastkit-llm[vision]'``), before any model loads."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from fastkit import FastkitError, FastModel, cli
from fastkit.extras import EXTRAS, install_line
from fastkit.families.vision import twin_image

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_load(monkeypatch):
    """The model must not load: the refusal is the preflight's."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model loaded before the missing dependency was named")

    monkeypatch.setattr(FastModel, "from_pretrained", refuse)
    import fastkit.cli.export as cli_export

    monkeypatch.setattr(cli_export, "load_saved", refuse)


def _missing(monkeypatch, module: str) -> None:
    """``module`` as not installed, for fastkit's code: transformers, imported earlier with it installed, decided
    then that it may import it; its modules fastkit's commands use are imported first (without Pillow, transformers
    imports them without it)."""
    import fastkit.training.run  # noqa: F401  (transformers' Trainer modules)

    monkeypatch.setitem(sys.modules, module, None)


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def _image_rows(folder: Path) -> str:
    (folder / "imgs").mkdir()
    lines = []
    for i in range(3):
        twin_image(i, size=(16, 16)).save(folder / "imgs" / f"{i}.png")
        row = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]},
                            {"role": "assistant", "content": f"Picture {i}."}], "images": [f"imgs/{i}.png"]}
        lines.append(json.dumps(row) + "\n")
    (folder / "rows.jsonl").write_text("".join(lines))
    return str(folder / "rows.jsonl")


def test_train_on_image_rows_without_pillow(tmp_path, monkeypatch, capsys, no_load):
    data = _image_rows(tmp_path)
    _missing(monkeypatch, "PIL")
    rc = cli.main(["train", "--model", "qwen2_5_vl", "--twin", "--data", data, "--steps", "1",
                   "--output-dir", str(tmp_path / "run")])
    err = _one_line(capsys)
    assert rc == 2 and "(image + text rows) needs Pillow, which is not installed: pip install " \
                       "'fastkit-llm[vision]'" in err, err


def test_reading_images_in_python_without_pillow_names_the_extra(monkeypatch):
    from fastkit.data.vision import open_image

    _missing(monkeypatch, "PIL")
    with pytest.raises(FastkitError, match=re.escape("needs Pillow, which is not installed: pip install "
                                                     "'fastkit-llm[vision]'")):
        open_image("x.png", 0, 0)


@pytest.mark.parametrize("command", [
    ["train", "--model", "llama", "--twin", "--data", "sample", "--gguf", "q8_0"],
    ["export", "--model", "outputs/train/lora", "--gguf", "q8_0"],
])
def test_gguf_without_gguf_py(command, tmp_path, monkeypatch, capsys, no_load):
    _missing(monkeypatch, "gguf")
    monkeypatch.chdir(tmp_path)
    assert cli.main(command) == 2
    err = _one_line(capsys)
    assert "needs gguf, which is not installed: pip install 'fastkit-llm[gguf]'" in err, err


def test_the_quickstart_reads_its_gguf_with_gguf_py(tmp_path, monkeypatch, capsys):
    from fastkit.quickstart import weights

    monkeypatch.setattr(weights, "cache_dir", lambda: tmp_path / "cache")  # nothing converted yet
    monkeypatch.setattr(weights, "smollm2_gguf_path", lambda: tmp_path / weights.SMOLLM2_GGUF)
    _missing(monkeypatch, "gguf")
    assert cli.main(["quickstart", "--output-dir", str(tmp_path / "qs")]) == 2
    err = _one_line(capsys)
    assert "needs gguf, which is not installed: pip install 'fastkit-llm[gguf]'. Or run fastkit quickstart " \
           "--twin." in err, err


@pytest.mark.parametrize("view, module", [("html", "matplotlib"), ("widget", "matplotlib"),
                                          ("widget", "ipywidgets")])
def test_a_notebook_dashboard_names_the_notebook_extra(view, module, monkeypatch):
    from fastkit.dashboard import dashboard_callback

    _missing(monkeypatch, module)
    with pytest.raises(FastkitError, match=re.escape(f"needs {module}, which is not installed: pip install "
                                                     "'fastkit-llm[notebook]'")):
        dashboard_callback(view)
    assert dashboard_callback("terminal") is not None  # the CLI's view needs neither


def test_every_extra_named_is_one_of_pyprojects():
    """Each module's extra exists in pyproject.toml and installs that module's distribution."""
    text = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1].split("\n[")[0]
    for module, (extra, package) in EXTRAS.items():
        found = re.search(rf"^{extra} = \[(.*?)\]", text, re.M | re.S)
        assert found, (module, extra)
        listed = [re.split(r"[<>=\[; ]", spec.strip().strip('"'))[0].lower() for spec in found[1].split(",")]
        assert package.lower() in listed, (module, extra, listed)
        assert install_line(module) == f"pip install 'fastkit-llm[{extra}]'"


def test_loading_a_vision_language_model_without_pillow(monkeypatch):
    """Every command that loads one (train, export, chat, the notebooks): named before any weight is read."""
    _missing(monkeypatch, "PIL")
    with pytest.raises(FastkitError, match=re.escape("qwen2_5_vl, a vision-language model (its processor reads "
                                                     "images) needs Pillow, which is not installed: pip install "
                                                     "'fastkit-llm[vision]'")):
        FastModel.from_pretrained("qwen2_5_vl", twin=True, max_seq_length=64)
