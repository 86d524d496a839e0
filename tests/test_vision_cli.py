"""``fastkit train`` on image + text rows: a vision-language twin saved to a folder (model + processor), a folder of
PNGs and rows.jsonl naming them by relative path. It trains the language model's LoRA (the vision tower's only with
--finetune-vision-layers), evaluates an --eval-split, and refuses bad image data before the model loads (exit 2,
the row and the path named)."""

from __future__ import annotations

import json
import math

import pytest
from safetensors import safe_open

from fastkit import FastModel, cli, registry
from fastkit.families.vision import twin_image

QUESTION = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}]}


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """A Qwen2.5-VL twin saved as a checkpoint folder (weights, config, processor), loaded back like any model."""
    from tests.helpers import saved_vlm_twin

    return saved_vlm_twin(tmp_path_factory)


def _rows(folder, n: int = 3, images=None) -> str:
    """``folder/rows.jsonl`` of ``n`` image rows whose images (``folder/imgs/i.png``) are named relative to it."""
    (folder / "imgs").mkdir(exist_ok=True)
    lines = []
    for i in range(n):
        twin_image(i, size=(32, 32)).save(folder / "imgs" / f"{i}.png")
        row = {"messages": [QUESTION, {"role": "assistant", "content": f"Picture {i}."}],
               "images": [images[i] if images else f"imgs/{i}.png"]}
        lines.append(json.dumps(row) + "\n")
    (folder / "rows.jsonl").write_text("".join(lines))
    return str(folder / "rows.jsonl")


def _train(vlm, data, out, *flags) -> int:
    return cli.main(["train", "--model", vlm, "--data", data, "--steps", "2", "--max-seq-length", "256",
                     "--lora-r", "4", "--checkpointing", "off", "--output-dir", str(out), *flags])


def _adapted(out) -> set[str]:
    with safe_open(str(out / "lora" / "adapter_model.safetensors"), "pt") as f:
        return set(f.keys())


@pytest.fixture
def no_load(monkeypatch):
    """The model must not load: a refusal is the preflight's."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model loaded before the data was refused")

    monkeypatch.setattr(FastModel, "from_pretrained", refuse)


def test_train_on_image_rows_with_an_eval_split(vlm, tmp_path, monkeypatch):
    data = _rows(tmp_path)
    monkeypatch.chdir(tmp_path / "imgs")  # another working directory: the paths are the file's folder's
    out = tmp_path / "run"
    assert _train(vlm, data, out, "--eval-split", "1", "--eval-steps", "1") == 0
    facts = registry.MODEL_TABLE["qwen2_5_vl"].vision
    keys = _adapted(out)
    assert keys and all(f"{facts.language_model}." in k for k in keys), keys  # no vision-tower LoRA by default
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    evals = [e["eval_loss"] for e in state["log_history"] if "eval_loss" in e]
    assert len(evals) == 2 and all(math.isfinite(v) for v in evals), state["log_history"]
    import yaml

    saved = yaml.safe_load((out / "fastkit_config.yaml").read_text())
    assert saved["packing"] is False and saved["finetune_vision_layers"] is False and saved["eval_split"] == 1


def test_finetune_vision_layers_adapts_the_vision_tower(vlm, tmp_path):
    out = tmp_path / "run"
    assert _train(vlm, _rows(tmp_path, 2), out, "--steps", "1", "--finetune-vision-layers") == 0
    facts = registry.MODEL_TABLE["qwen2_5_vl"].vision
    keys = _adapted(out)
    assert any(f"{facts.tower}." in k for k in keys) and any(f"{facts.language_model}." in k for k in keys), keys


def test_the_option_round_trips_through_print_config(tmp_path, capsys):
    assert cli.main(["train", "--model", "m", "--data", "d", "--finetune-vision-layers", "--print-config"]) == 0
    text = capsys.readouterr().out
    assert "finetune_vision_layers: true" in text
    (tmp_path / "run.yaml").write_text(text)
    assert cli.main(["train", "--config", str(tmp_path / "run.yaml"), "--print-config"]) == 0
    assert capsys.readouterr().out == text


@pytest.mark.parametrize("problem", ["missing", "unreadable"])
def test_a_bad_image_is_refused_before_the_model_loads(vlm, tmp_path, capsys, no_load, problem):
    data = _rows(tmp_path, 3)
    if problem == "missing":
        (tmp_path / "imgs" / "2.png").unlink()
    else:
        (tmp_path / "imgs" / "2.png").write_bytes(b"not a png")
    assert _train(vlm, data, tmp_path / "run") == 2
    err = capsys.readouterr().err
    why = "does not exist" if problem == "missing" else "is not a readable image"
    assert f"--data: row 3: images[0] '{tmp_path / 'imgs' / '2.png'}' {why}" in err, err


@pytest.mark.parametrize("flags, message", [
    ((), "holds image + text rows, but --model HuggingFaceTB/SmolLM2-135M-Instruct is a text model (llama)"),
    (("--packing",), "--packing: image + text rows train as padded rows"),
    (("--streaming",), "--streaming: image + text rows are read whole"),
    (("--eval-split", "3"), "--eval-split must be a fraction in (0, 1) or a row count in [1, 2]"),
])
def test_options_that_do_not_apply_are_refused_up_front(vlm, tmp_path, capsys, no_load, flags, message):
    model = "HuggingFaceTB/SmolLM2-135M-Instruct" if not flags else vlm
    argv = ["--twin"] if not flags else []
    assert _train(model, _rows(tmp_path), tmp_path / "run", *argv, *flags) == 2
    assert message in capsys.readouterr().err


def test_text_rows_on_a_vision_language_model_train_as_chats(vlm, tmp_path):
    rows = [{"prompt": f"Say hi {i}", "completion": f"Hi {i}."} for i in range(3)]
    (tmp_path / "text.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _train(vlm, str(tmp_path / "text.jsonl"), tmp_path / "run", "--steps", "1") == 0
    (tmp_path / "plain.jsonl").write_text("".join(json.dumps({"text": f"plain {i}"}) + "\n" for i in range(3)))
    assert _train(vlm, str(tmp_path / "plain.jsonl"), tmp_path / "run2") == 2
