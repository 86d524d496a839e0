"""The export menu: ``fastkit.export.export`` run as a notebook's export cell runs it, ``fastkit export`` from the
command line, and ``fastkit chat`` on the adapter a run saved (a LoRA twin whose base checkpoint is on disk).
Every file is verified (each save reloads it and compares logits); bad options fail before the first save."""

from __future__ import annotations

import io
import runpy
import sys
from pathlib import Path

import gguf
import pytest
import torch

from fastkit import FastkitError, cli
from fastkit.export import chat, export
from fastkit.export.menu import QUANTIZATIONS
from tests.export_twin import trained_twin

BUILD = runpy.run_path(str(Path(__file__).resolve().parents[1] / "notebooks" / "_build.py"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return trained_twin(tmp_path_factory.mktemp("menu_twin"))


def _gguf_type(path: str) -> int:
    return int(gguf.GGUFReader(path).fields["general.file_type"].parts[-1][0])


def test_notebook_export_cell(trained, tmp_path, capsys):
    """The quickstart notebook's export cell as written, with the GGUF list a user would edit it to."""
    model, tok, _ = trained
    spec = next(s for s in BUILD["SPECS"] if s.filename.startswith("00_"))
    source = BUILD["_save"](spec)[1].source
    assert 'GGUF = ["q8_0"]' in source
    source = source.replace('GGUF = ["q8_0"]', 'GGUF = ["q8_0", "f16"]')
    source = source.replace("GGUF_NAME = None", 'GGUF_NAME = "my-model"')
    from fastkit import TrainOptions

    scope = {"model": model, "tokenizer": tok, "options": TrainOptions(output_dir=str(tmp_path / "nb")),
             "DATASET": "quickstart", "trainer": None}
    exec(compile(source, "export-cell", "exec"), scope)
    result, printed = scope["result"], capsys.readouterr().out
    assert [(a.kind, a.quantization) for a in result.artifacts] == [("lora", None), ("merged", None), ("gguf", "q8_0"),
                                                                    ("gguf", "f16")]
    assert all(a.verified for a in result.artifacts) and printed.count(", verified)") == 4, printed
    for file in result.files:
        assert Path(file).is_file(), file
    gguf_dir = tmp_path / "nb" / "gguf"
    assert _gguf_type(str(gguf_dir / "my-model-q8_0.gguf")) == gguf.LlamaFileType.MOSTLY_Q8_0
    assert _gguf_type(str(gguf_dir / "my-model-f16.gguf")) == gguf.LlamaFileType.MOSTLY_F16
    assert (gguf_dir / "Modelfile").read_text().startswith("FROM ./my-model-q8_0.gguf\n")  # the list's first
    assert result.ollama == f"ollama create my-model -f {gguf_dir / 'Modelfile'}"
    assert f"Ollama: {result.ollama}" in printed
    # the cell run again (a re-run notebook cell): the rewritten Modelfile is still fastkit's own (its manifest
    # entry follows the rewrite), so the second export replaces it instead of refusing it as the user's file
    exec(compile(source, "export-cell", "exec"), scope)
    assert all(a.verified for a in scope["result"].artifacts)
    assert (gguf_dir / "Modelfile").read_text().startswith("FROM ./my-model-q8_0.gguf\n")


def test_cli_export_from_the_adapter_folder(trained, capsys):
    """``fastkit export --model OUTPUT/lora``: the base it names, the adapter on it; outputs beside it."""
    model, _, lora = trained
    rc = cli.main(["export", "--model", str(lora), "--merged", "--gguf", "q8_0", "f16", "--name", "my-model"])
    out = capsys.readouterr().out
    assert rc == 0, out
    run = lora.parent
    assert out.count(", verified)") == 3 and f"ollama create my-model -f {run / 'gguf' / 'Modelfile'}" in out, out
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(str(run / "merged_16bit"), dtype=torch.float32).eval()
    ids = torch.randint(3, 259, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        with model.disable_adapter():
            base = model(input_ids=ids).logits
        got = merged(input_ids=ids).logits
    assert (want - base).abs().max() > 1e-3  # the adapter changes the logits ...
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # ... and the merged folder carries it
    assert (run / "gguf" / "my-model-q8_0.gguf").is_file() and (run / "gguf" / "my-model-f16.gguf").is_file()


def test_train_and_export_take_the_one_quantization_list(capsys):
    for command in (["train", "--model", "m", "--data", "d"], ["export", "--model", "m"]):
        with pytest.raises(SystemExit):
            cli.main([*command, "--gguf", "q8_0", "q3_k"])
        err = capsys.readouterr().err
        assert "invalid choice: 'q3_k'" in err and all(q in err for q in QUANTIZATIONS), err


def test_bad_options_fail_before_any_save(trained, tmp_path, monkeypatch):
    model, tok, _ = trained
    out = tmp_path / "out"
    with pytest.raises(FastkitError, match="'q3_k' is not a quantization"):
        export(model, tok, out, gguf=["q8_0", "q3_k"])
    missing = r"pip install 'fastkit-llm\[llamacpp\]'.*Nothing was saved"
    with monkeypatch.context() as m, pytest.raises(FastkitError, match=missing):
        m.setattr("importlib.util.find_spec", lambda name, *a: None if name == "llama_cpp" else object())
        export(model, tok, out, gguf=["q8_0", "q4_k_m"])
    with pytest.raises(FastkitError, match="has no letters or digits"):
        export(model, tok, out, gguf=["q8_0"], name="../..")
    with pytest.raises(FastkitError, match="nothing to save"):
        export(model, tok, out, lora=False)
    assert not out.exists()


def test_export_flags_in_snake_case_too(monkeypatch):
    """`fastkit export` takes TRL-style snake spellings like `fastkit train` (--push_to_hub, --out_dir, ...)."""
    import fastkit.cli.export as cli_export

    seen = {}
    monkeypatch.setattr(cli_export, "run", lambda args: seen.update(vars(args)) or 0)
    argv = ["export", "--model", "m", "--push_to_hub", "me/x", "--out_dir", "o", "--max_seq_length", "64"]
    assert cli.main(argv) == 0
    assert (seen["push_to_hub"], seen["out_dir"], seen["max_seq_length"]) == ("me/x", "o", 64)


def test_cli_export_checks_options_before_loading(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "llama_cpp" else object())
    rc = cli.main(["export", "--model", str(tmp_path / "missing"), "--gguf", "q5_k_m"])
    assert rc == 2 and "llama-cpp-python, which is not installed" in capsys.readouterr().err


def test_chat_one_shot_uses_the_adapter_and_its_template(trained, capsys):
    model, tok, lora = trained
    want = chat(model, tok, "Hello there", max_new_tokens=8, stream=False)
    with model.disable_adapter():
        base = chat(model, tok, "Hello there", max_new_tokens=8, stream=False)
    assert want and want != base  # the adapter shows in the answer
    rc = cli.main(["chat", "--model", str(lora), "--prompt", "Hello there", "--max-new-tokens", "8"])
    assert rc == 0 and capsys.readouterr().out.splitlines()[-1] == want


def test_chat_on_a_merged_folder(trained, tmp_path, capsys):
    from fastkit.export import save_merged

    model, tok, _ = trained
    merged = save_merged(model, tok, tmp_path / "merged_16bit")
    want = chat(model, tok, "Hello there", max_new_tokens=8, stream=False)
    rc = cli.main(["chat", "--model", merged, "--prompt", "Hello there", "--max-new-tokens", "8"])
    assert rc == 0 and capsys.readouterr().out.splitlines()[-1] == want


def test_chat_interactive_keeps_the_conversation(trained, capsys, monkeypatch):
    import fastkit.export

    model, tok, lora = trained
    seen = []  # what the terminal chat asked the model, turn by turn

    def spy(model, tokenizer, messages, **kw):
        seen.append([dict(m) for m in messages])
        return chat(model, tokenizer, messages, **kw)

    monkeypatch.setattr(fastkit.export, "chat", spy)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello there\nAnd then?\n/reset\nAnd then?\n/exit\n"))
    rc = cli.main(["chat", "--model", str(lora), "--max-new-tokens", "8", "--system", "Be brief."])
    out = capsys.readouterr().out
    answers = [line.split("model> ", 1)[1] for line in out.splitlines() if "model> " in line]
    system = {"role": "system", "content": "Be brief."}
    first = chat(model, tok, [system, {"role": "user", "content": "Hello there"}], max_new_tokens=8, stream=False)
    turn2 = [system, {"role": "user", "content": "Hello there"}, {"role": "assistant", "content": first},
             {"role": "user", "content": "And then?"}]
    assert seen == [turn2[:2], turn2, [system, turn2[-1]]]  # the conversation so far; /reset keeps the system
    want = [first, chat(model, tok, turn2, max_new_tokens=8, stream=False),
            chat(model, tok, [system, turn2[-1]], max_new_tokens=8, stream=False)]
    assert rc == 0 and answers == want and "(conversation reset)" in out, out


def test_chat_refuses_a_gguf_without_llama_cpp(tmp_path, monkeypatch, capsys):
    file = tmp_path / "m-q8_0.gguf"
    file.write_bytes(b"GGUF")
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as if not installed
    rc = cli.main(["chat", "--model", str(file), "--prompt", "hi"])
    assert rc == 2 and "pip install 'fastkit-llm[llamacpp]'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["export", "chat"])
def test_help(capsys, command):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    text = capsys.readouterr().out
    assert "--model" in text and "``" not in text and ":func:" not in text, text
    if command == "export":
        assert "--push-to-hub" in text and "--gguf Q [Q ...]" in text and "--name" in text
