"""Issue 54 ("The first hour, round 2"), items 7 and 8: the retries a new user makes, and the noise they read.

- ``fastkit --version``; ``fastkit export`` without ``--model`` takes the newest adapters under ./outputs (printed),
  or says where runs save; ``fastkit chat --image`` refused in one line before a model loads; after a run, the
  chat / export commands with the real adapter path;
- offline, a Hub id that is not cached is refused in seconds, before torch and datasets are imported (no retries);
- data errors count rows from 1, as a file's lines (a .jsonl's line 2 is row 2);
- a ``messages`` row with a ShareGPT role (``human``, ``gpt``) is refused naming the role and the chat roles;
- README's ``--resume`` line names ``--extend``; no committed notebook output holds an absolute path of the machine.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from fastkit.cli import main
from fastkit.errors import FastkitError

ROOT = Path(__file__).resolve().parents[1]
ABSOLUTE = re.compile(r"(?<![\w.~-])/(root|work|home|Users|tmp|content|private)/")
"""A path of the machine that ran a notebook (a home, a checkout, a temporary folder)."""


def test_version(capsys):
    from fastkit import __version__

    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out.strip() == f"fastkit-llm {__version__}"


def _adapters(folder: Path, when: float) -> Path:
    lora = folder / "lora"
    lora.mkdir(parents=True)
    (lora / "adapter_config.json").write_text("{}")
    os.utime(lora / "adapter_config.json", (when, when))
    return lora


def test_export_without_model_takes_the_newest_adapters_under_outputs(tmp_path, monkeypatch, capsys):
    """What train / dpo saved last is what the user means; none there: one line naming where runs save."""
    from fastkit.cli.export import default_model

    monkeypatch.chdir(tmp_path)
    assert main(["export", "--gguf", "q8_0"]) == 2
    err = capsys.readouterr().err
    assert "no --model, and no LoRA adapters under ./outputs" in err and "outputs/train/lora" in err, err
    _adapters(tmp_path / "outputs" / "train", 1_000_000)
    dpo = _adapters(tmp_path / "outputs" / "dpo", 2_000_000)
    (tmp_path / "outputs" / "quickstart").mkdir()  # no adapters: not a candidate
    assert default_model() == Path("outputs/dpo/lora") and dpo.is_dir()


def test_chat_image_is_refused_before_a_model_loads(capsys, tmp_path):
    assert main(["chat", "--model", str(tmp_path), "--image", "cat.png", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "fastkit chat --image cat.png: not supported yet" in err, err
    assert "apply_chat_template" in err and "vision=True" in err, err


def test_next_steps_name_the_adapters_saved():
    from fastkit.cli.train import next_steps

    text = next_steps("runs/my run/lora")
    assert "fastkit chat --model 'runs/my run/lora'" in text
    assert "fastkit export --model 'runs/my run/lora' --gguf q8_0" in text


def test_an_uncached_hub_id_out_of_reach_is_refused_before_torch_loads(tmp_path):
    """HF_HUB_OFFLINE (or no answer from the Hub in 3 s): fastkit train / chat stop as fastkit plan does, in one
    line, with neither torch nor datasets imported (huggingface_hub retried for a minute before)."""
    probe = ("import sys\nfrom fastkit.cli import main\n"
             "code = main(['train', '--model', 'nobody-here/not-cached-1', '--data', 'sample', '--steps', '1'])\n"
             "print('code', code, sorted(m for m in ('torch', 'datasets', 'transformers') if m in sys.modules))\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), HF_HOME=str(tmp_path / "hf"))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert proc.stdout.strip().splitlines()[-1] == "code 2 []", (proc.stdout, proc.stderr[-2000:])
    assert proc.stderr.strip() == ("fastkit train: HF_HUB_OFFLINE is set and 'nobody-here/not-cached-1''s config.json "
                                   "is not in the local cache: it cannot be loaded. Connect to the Hub once to "
                                   "download it, or pass a local model folder."), proc.stderr
    print(f"refused in {time.monotonic() - start:.1f} s")


def test_the_loader_refuses_an_unreachable_hub_id_without_retrying(monkeypatch):
    """FastModel.from_pretrained (what dpo / kto / grpo / export load through) says the same, in seconds."""
    from fastkit import FastModel
    from fastkit.plan import source

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(source, "_hub_reachable", lambda: False)
    with pytest.raises(FastkitError, match=r"^the Hub cannot be reached \(no answer in 3 s\) and "
                                           r"'nobody-here/not-cached-2''s config.json is not in the local cache"):
        FastModel.from_pretrained("nobody-here/not-cached-2")


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _chat(*turns):
    return {"messages": [{"role": role, "content": text} for role, text in turns]}


SHAREGPT_OK = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
ROW_CASES = [
    (_chat(("user", "q"), ("assistant", "a")), _chat(("user", "q")), "the last turn is 'user'"),
    (SHAREGPT_OK, {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": 3}]},
     "conversations[1].value is number"),
    ({"prompt": "q", "completion": "a"}, {"prompt": "q", "completion": ""}, "completion is empty"),
]


@pytest.mark.parametrize("good, bad, why", ROW_CASES, ids=["messages", "sharegpt", "prompt_completion"])
def test_data_errors_count_rows_as_the_files_lines(tmp_path, good, bad, why):
    """The bad row on a .jsonl's line 2 is 'row 2', in every format's message."""
    from fastkit.data import load_chat_dataset

    data = _jsonl(tmp_path / "data.jsonl", [good, bad, good])
    with pytest.raises(FastkitError, match=rf"\(rows 2\); row 2: {re.escape(why)}"):
        load_chat_dataset(str(data))


@pytest.mark.parametrize("role, means", [("human", "user"), ("gpt", "assistant"), ("model", "assistant")])
def test_a_sharegpt_role_in_a_messages_row_is_refused_naming_it(tmp_path, role, means):
    """A messages row speaks the chat roles; ShareGPT's spellings (read in conversations rows) would render as
    they are (<|im_start|>human) and miss the assistant mask (gpt)."""
    from fastkit.data import load_chat_dataset

    turns = [("user", "q"), ("assistant", "a")]
    turns[0 if means == "user" else 1] = (role, turns[0 if means == "user" else 1][1])
    data = _jsonl(tmp_path / f"{role}.jsonl", [_chat(("user", "q"), ("assistant", "a")), _chat(*turns)])
    with pytest.raises(FastkitError, match=rf"row 2: messages\[\d\]\.role is '{role}', ShareGPT's spelling of "
                                           rf"'{means}': a messages row uses the chat roles \('system', 'user', "
                                           r"'assistant', 'tool'"):
        load_chat_dataset(str(data))
    sharegpt = _jsonl(tmp_path / "sharegpt.jsonl", [{"conversations": [{"from": "human", "value": "q"},
                                                                       {"from": "gpt", "value": "a"}]}])
    assert load_chat_dataset(str(sharegpt))[0]["messages"][0]["role"] == "user"  # read there, as before


def test_readme_resume_line_names_extend():
    line = next(t for t in (ROOT / "README.md").read_text().splitlines() if "--resume" in t and "fastkit train" in t)
    assert "--extend" in line, line


def _text_outputs(nb) -> list[tuple[int, str]]:
    out = []
    for i, cell in enumerate(nb.cells):
        for o in cell.get("outputs", []):
            texts = [o.get("text", "")] + [o.get("data", {}).get(m, "") for m in ("text/plain", "text/html",
                                                                                    "text/markdown")]
            out += [(i, "".join(t) if isinstance(t, list) else t) for t in texts]
    return out


@pytest.mark.parametrize("path", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.stem)
def test_committed_notebook_outputs_hold_no_absolute_path_of_the_machine(path):
    nb = nbformat.read(path, as_version=4)
    found = [(i, t[max(0, m.start() - 40):m.end() + 40]) for i, t in _text_outputs(nb) for m in ABSOLUTE.finditer(t)]
    assert not found, found[:5]


def test_the_notebook_runner_scrubs_paths():
    sys.path.insert(0, str(ROOT / "notebooks"))
    try:
        import _build
    finally:
        sys.path.remove(str(ROOT / "notebooks"))
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x")])
    nb.cells[0].outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"saved {_build.HERE}/outputs/x/lora\n"
                                                  f"weights {Path.home()}/.cache/fastkit/w\n"),
                           nbformat.v4.new_output("execute_result", data={"text/plain": f"'{_build.HERE.parent}/a'"})]
    _build.scrub_paths(nb)
    assert nb.cells[0].outputs[0].text == "saved outputs/x/lora\nweights ~/.cache/fastkit/w\n"
    assert nb.cells[0].outputs[1].data["text/plain"] == "'a'"


def test_modelfile_differences_are_one_actionable_info_line(caplog):
    """SmolLM2's template renders two system messages differently in Ollama: said once, at INFO, with what to do
    (llama.cpp reads the chat template in the file; fastkit chat the LoRA); the Modelfile notes it."""
    import logging

    from fastkit.export.gguf import modelfile as mf
    from tests import ollama_templates as ot

    mf._WARNED.clear()
    with caplog.at_level(logging.INFO, logger="fastkit.export.gguf.modelfile"):
        text = mf.modelfile(ot.tokenizer("SmolLM2-135M-Instruct"), "m.gguf")
    said = [r for r in caplog.records if "TEMPLATE" in r.getMessage()]
    assert said and all(r.levelno == logging.INFO for r in said), [(r.levelname, r.getMessage()) for r in said]
    assert "run the GGUF in llama.cpp" in said[0].getMessage() and "fastkit chat" in said[0].getMessage()
    assert "# differs from apply_chat_template:" in text


def test_a_vision_run_says_packing_off_after_the_banner_and_its_card_names_the_adapters(tmp_path, caplog, capsys):
    """Image rows from the CLI: the load banner (free memory said once on the host) lists the packing patch, the
    run's 'packing off' line comes after it and says the patch stays unused; TRL's card names the saved adapters
    (not model="None"); the run ends with the chat / export commands for them."""
    import logging

    from fastkit import FastModel
    from fastkit.families.vision import twin_image

    model, processor = FastModel.from_pretrained("qwen2_5_vl", twin=True, max_seq_length=256)
    model.save_pretrained(tmp_path / "vlm")
    processor.save_pretrained(tmp_path / "vlm")
    (tmp_path / "imgs").mkdir()
    question = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}
    rows = []
    for i in range(2):
        twin_image(i, size=(32, 32)).save(tmp_path / "imgs" / f"{i}.png")
        rows.append({"messages": [question, {"role": "assistant", "content": f"Picture {i}."}],
                     "images": [f"imgs/{i}.png"]})
    data = _jsonl(tmp_path / "rows.jsonl", rows)
    out = tmp_path / "run"
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert main(["train", "--model", str(tmp_path / "vlm"), "--data", str(data), "--steps", "1",
                     "--max-seq-length", "256", "--lora-r", "4", "--checkpointing", "off",
                     "--output-dir", str(out)]) == 0
    said = [r.getMessage() for r in caplog.records]
    banner = next(i for i, m in enumerate(said) if m.startswith("fastkit: qwen2_5_vl on CPU"))
    note = next(i for i, m in enumerate(said) if "packing off for this run" in m)
    assert note > banner and "the packing patch the load lists stays unused" in said[note], said[banner:note + 1]
    assert said[banner].count("RAM free") == 1 and "memory free" not in said[banner], said[banner]
    card = (out / "README.md").read_text()
    assert 'model="None"' not in card and f'model="{out}/lora"' in card, card
    printed = capsys.readouterr().out
    assert f"Next: fastkit chat --model {out}/lora" in printed and f"fastkit export --model {out}/lora" in printed
