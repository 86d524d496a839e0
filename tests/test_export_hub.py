"""``export(..., push_to_hub=REPO)`` and ``fastkit export --push-to-hub``: the REAL huggingface_hub client against a
recording Hub on 127.0.0.1 (tests/fake_hub.py). Checked: which repositories were created and how (private by
default), which files went up (exactly the verified files of this call, byte for byte, plus a model card naming
the base model, the data and the options), that nothing goes up when a save of the call fails its check, and
that a missing or refused token stops the export before anything is saved."""

from __future__ import annotations

import pytest

from fastkit import FastkitError, cli
from fastkit.export import export
from tests import fake_hub
from tests.export_twin import trained_twin


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return trained_twin(tmp_path_factory.mktemp("hub_twin"))


@pytest.fixture
def hub(monkeypatch, tmp_path):
    import huggingface_hub.constants as constants

    server_hub, server = fake_hub.start()
    monkeypatch.setenv("HF_ENDPOINT", server_hub.url)
    monkeypatch.setattr(constants, "ENDPOINT", server_hub.url)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the suite runs offline; this endpoint is local
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token-file"))
    monkeypatch.setenv("HF_TOKEN", server_hub.good_token)
    yield server_hub
    server.shutdown()


def _calls(hub) -> list[tuple[str, str, str]]:
    """(method, path, token) of the requests to the API (huggingface_hub also fetches its agent-harness registry,
    at most once a day, without a token: not part of the upload)."""
    return [(m, p, t) for (m, p), t in zip(hub.requests, hub.tokens) if p != "/api/agent-harnesses"]


def _uploads(hub) -> list[str]:
    return [p for m, p, _ in _calls(hub) if "/commit/" in p or "/repos/create" in p or "/preupload/" in p]


def test_each_verified_folder_goes_to_its_private_repo(trained, hub, tmp_path):
    model, tok, _ = trained
    out = tmp_path / "out"
    (out / "gguf").mkdir(parents=True)
    (out / "gguf" / "stale-q4_0.gguf").write_bytes(b"an earlier export, not verified by this call")
    result = export(model, tok, out, lora=True, gguf=["q8_0", "f16"], name="my-model", push_to_hub="my-model",
                    data="HuggingFaceH4/no_robots")
    assert set(hub.created) == {"tester/my-model", "tester/my-model-GGUF"}  # namespace from whoami
    assert all(p["visibility"] == "private" for p in hub.created.values()), hub.created
    lora = out / "lora"
    sent = hub.files["tester/my-model"]
    assert set(sent) == {p.name for p in lora.iterdir()}, sent.keys()  # the whole verified folder, card included
    for name, data in sent.items():
        assert (lora / name).read_bytes() == data, name
    ggufs = hub.files["tester/my-model-GGUF"]
    assert set(ggufs) == {"my-model-q8_0.gguf", "my-model-f16.gguf", "Modelfile", "README.md"}  # not the stale one
    assert ggufs["my-model-q8_0.gguf"] == (out / "gguf" / "my-model-q8_0.gguf").read_bytes()
    assert ggufs["Modelfile"].startswith(b"FROM ./my-model-q8_0.gguf")
    card = sent["README.md"].decode()
    assert "datasets:\n- HuggingFaceH4/no_robots" in card and str(model.config.name_or_path) in card
    assert "| r | `4` |" in card and "| lora_alpha | `8` |" in card and "AutoPeftModelForCausalLM" in card
    assert "ollama run hf.co/tester/my-model-GGUF:Q8_0" in ggufs["README.md"].decode()
    assert result.get("lora").hub_url == f"{hub.url}/tester/my-model"
    assert result.get("gguf", "f16").hub_url == f"{hub.url}/tester/my-model-GGUF"
    assert {t for _, _, t in _calls(hub)} == {hub.good_token}  # every API call with the user's token


def test_public_when_asked_and_a_dict_of_repos(trained, hub, tmp_path):
    model, tok, _ = trained
    export(model, tok, tmp_path / "out", lora=False, merged=True, push_to_hub={"merged": "org/merged-model"},
           private=False)
    assert hub.created["org/merged-model"]["visibility"] == "public"
    assert "model.safetensors" in hub.files["org/merged-model"] and "config.json" in hub.files["org/merged-model"]


def test_nothing_is_uploaded_when_a_save_fails_its_check(trained, hub, tmp_path, monkeypatch):
    model, tok, _ = trained
    from dataclasses import replace

    from fastkit.export.gguf.writer import QUANTS

    monkeypatch.setitem(QUANTS, "q8_0", replace(QUANTS["q8_0"], weight_tolerance=0.0))  # no tensor can match: refused
    with pytest.raises(FastkitError, match="does not match the model in memory"):
        export(model, tok, tmp_path / "out", lora=True, gguf=["q8_0"], push_to_hub="tester/my-model")
    assert (tmp_path / "out" / "lora" / "adapter_model.safetensors").is_file()  # saved, verified, kept locally
    assert _uploads(hub) == []  # but nothing went up: the call's GGUF did not verify
    assert [(m, p) for m, p, _ in _calls(hub)] == [("GET", "/api/whoami-v2")]  # the token check, then nothing


@pytest.mark.parametrize("token", [None, "hf_refused"])
def test_no_or_refused_token_stops_before_any_save(trained, hub, tmp_path, monkeypatch, token):
    model, tok, _ = trained
    if token is None:
        monkeypatch.delenv("HF_TOKEN")
    else:
        monkeypatch.setenv("HF_TOKEN", token)
    with pytest.raises(FastkitError, match="huggingface-cli login") as err:
        export(model, tok, tmp_path / "out", lora=True, push_to_hub="tester/my-model")
    assert "Nothing was saved" in str(err.value)
    assert not (tmp_path / "out").exists() and _uploads(hub) == []


def test_an_unverified_save_is_never_uploaded(trained, hub, tmp_path):
    model, tok, _ = trained
    with pytest.raises(FastkitError, match="only verified saves are uploaded"):
        export(model, tok, tmp_path / "out", lora=True, gguf=["q8_0"], verify=False, push_to_hub="tester/my-model")
    assert not (tmp_path / "out").exists() and _uploads(hub) == []


def test_offline_mode_is_refused_before_any_save(trained, hub, tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    model, tok, _ = trained
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(FastkitError, match=r"huggingface_hub is in offline mode \(HF_HUB_OFFLINE=1\); unset it"):
        export(model, tok, tmp_path / "out", lora=True, push_to_hub="tester/my-model")
    assert not (tmp_path / "out").exists() and _calls(hub) == []


def test_cli_export_pushes_the_verified_folders(trained, hub, tmp_path, capsys):
    _, _, lora = trained
    rc = cli.main(["export", "--model", str(lora), "--out-dir", str(tmp_path / "cli"), "--gguf", "q8_0",
                   "--name", "cli-model", "--push-to-hub", "tester/cli-model", "--data", "quickstart"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert set(hub.created) == {"tester/cli-model-GGUF"}  # only what this command exported
    assert f"on the Hub: {hub.url}/tester/cli-model-GGUF" in out and "ollama create cli-model -f " in out
    rc = cli.main(["export", "--model", str(lora), "--out-dir", str(tmp_path / "cli"), "--lora",
                   "--push-to-hub", "tester/cli-model"])
    assert rc == 0 and set(hub.created) == {"tester/cli-model-GGUF", "tester/cli-model"}
    again = tmp_path / "cli" / "lora"  # the adapter saved again (verified) beside the GGUFs, then uploaded
    sent = hub.files["tester/cli-model"]
    assert set(sent) == {p.name for p in again.iterdir()} and "adapter_model.safetensors" in sent
    assert all(sent[name] == (again / name).read_bytes() for name in sent)
    assert set(hub.files["tester/cli-model-GGUF"]) == {"cli-model-q8_0.gguf", "Modelfile", "README.md"}


TRAIN = ["train", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct", "--twin", "--data", "quickstart", "--steps", "2",
         "--max-seq-length", "128", "--lora-r", "4", "--checkpointing", "off", "--save-steps", "2"]


@pytest.mark.slow
def test_cli_train_exports_the_list_and_pushes_with_the_run_in_the_card(hub, tmp_path, capsys):
    out = tmp_path / "run"
    rc = cli.main([*TRAIN, "--output-dir", str(out), "--gguf", "q8_0", "f16", "--name", "tiny",
                   "--push-to-hub", "tester/tiny"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert printed.count(", verified)") == 3 and "ollama create tiny -f " in printed, printed
    assert set(hub.created) == {"tester/tiny", "tester/tiny-GGUF"}
    assert set(hub.files["tester/tiny-GGUF"]) == {"tiny-q8_0.gguf", "tiny-f16.gguf", "Modelfile", "README.md"}
    card = hub.files["tester/tiny"]["README.md"].decode()
    assert "- dataset: fastkit's quickstart data" in card and "fingerprint of the token ids trained on: `" in card, card
    assert "| max_steps | `2` |" in card and "| learning_rate | `0.0002` |" in card, card
    assert "base_model:" not in card and "tiny random twin of `HuggingFaceTB/" in card  # a random twin is not SmolLM2


def test_cli_train_without_a_token_stops_before_loading(hub, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("HF_TOKEN")
    rc = cli.main([*TRAIN, "--output-dir", str(tmp_path / "run"), "--push-to-hub", "tester/tiny"])
    assert rc == 2 and "huggingface-cli login" in capsys.readouterr().err
    assert not (tmp_path / "run").exists() and _uploads(hub) == []


def test_each_saved_folder_has_a_model_card_not_peft_template(trained, tmp_path):
    """save_lora / save_merged write a ``huggingface_hub.ModelCard`` (metadata from ModelCardData), not PEFT's
    "[More Information Needed]" template; the card is a file of the save (in its manifest)."""
    import json

    from huggingface_hub import ModelCard

    from fastkit.export import save_lora, save_merged

    model, tok, _ = trained
    for kind, save, library in (("lora", save_lora, "peft"), ("merged", save_merged, "transformers")):
        folder = tmp_path / kind
        save(model, tok, folder)
        text = (folder / "README.md").read_text()
        card = ModelCard.load(folder / "README.md")
        assert "[More Information Needed]" not in text, text[:400]
        assert card.data.library_name == library and {"fastkit", kind} <= set(card.data.tags), card.data
        listed = "- `config.json`" in text or "- `adapter_config.json`" in text
        assert f'from_pretrained("{folder}")' in text and listed, text
        assert "README.md" in json.loads((folder / "fastkit_manifest.json").read_text())["files"]
    assert "| r | `4` |" in (tmp_path / "lora" / "README.md").read_text()
