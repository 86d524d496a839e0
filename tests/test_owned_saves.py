"""fastkit/export/owned.py on plain files (issue 31): a save replaces only what its manifest lists, unchanged.

No model here: ``commit`` is driven with staged folders of a few files, so each rule is checked on its
own; the save functions built on it are covered by tests/hostile_round4.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fastkit import FastkitError
from fastkit.export import owned


def _stage(root: Path, files: dict[str, bytes]) -> tuple[Path, Path]:
    """A staged output and an empty backup folder, as ``staged_folder`` makes them."""
    tmp = root / f".fk-partial-{len(list(root.glob('.fk-partial-*')))}"
    out, backup = tmp / "out", tmp / "old"
    for name, data in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data)
    backup.mkdir(parents=True)
    return out, backup


def _save(root: Path, target: Path, files: dict[str, bytes], what: str = "save_lora", **kw) -> None:
    out, backup = _stage(root, files)
    owned.commit(out, target, what, backup, **kw)


def _listed(target: Path) -> dict:
    return json.loads((target / owned.MANIFEST).read_text())["files"]


def test_new_folder_gets_the_files_and_a_manifest(tmp_path):
    target = tmp_path / "out"
    _save(tmp_path, target, {"a.json": b"1", "sub/b.bin": b"2"})
    assert (target / "a.json").read_bytes() == b"1" and (target / "sub/b.bin").read_bytes() == b"2"
    assert set(_listed(target)) == {"a.json", "sub/b.bin"}
    assert _listed(target)["a.json"]["by"] == "save_lora"


def test_second_save_replaces_its_files_and_keeps_the_users(tmp_path):
    target = tmp_path / "out"
    _save(tmp_path, target, {"a.json": b"1"})
    (target / "notes.txt").write_bytes(b"mine")
    _save(tmp_path, target, {"a.json": b"2"})
    assert (target / "a.json").read_bytes() == b"2"
    assert (target / "notes.txt").read_bytes() == b"mine" and "notes.txt" not in _listed(target)


def test_a_users_file_of_the_same_name_is_refused_and_untouched(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "a.json").write_bytes(b"the user's")
    with pytest.raises(FastkitError, match="would overwrite 1 file") as exc:
        _save(tmp_path, target, {"a.json": b"new", "b.json": b"new"})
    assert "a.json" in str(exc.value) and "Nothing was changed" in str(exc.value)
    assert (target / "a.json").read_bytes() == b"the user's" and not (target / "b.json").exists()


def test_a_file_edited_since_the_save_is_the_users(tmp_path):
    target = tmp_path / "out"
    _save(tmp_path, target, {"a.json": b"1"})
    (target / "a.json").write_bytes(b"edited")
    with pytest.raises(FastkitError, match="a.json"):
        _save(tmp_path, target, {"a.json": b"2"})
    assert (target / "a.json").read_bytes() == b"edited"


def test_the_users_readme_stays_and_the_model_card_is_left_out(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "README.md").write_bytes(b"# mine")
    _save(tmp_path, target, {"README.md": b"# PEFT card", "a.json": b"1"})
    assert (target / "README.md").read_bytes() == b"# mine" and "README.md" not in _listed(target)


def test_stale_files_of_the_same_kind_go_other_kinds_stay(tmp_path):
    target = tmp_path / "out"
    _save(tmp_path, target, {"model-1.bin": b"1", "model-2.bin": b"2"}, "save_merged")
    _save(tmp_path, target, {"x.gguf": b"g"}, "save_gguf")
    _save(tmp_path, target, {"model-1.bin": b"one"}, "save_merged")
    assert not (target / "model-2.bin").exists() and (target / "x.gguf").read_bytes() == b"g"
    assert set(_listed(target)) == {"model-1.bin", "x.gguf"}


def test_prune_false_keeps_the_earlier_files(tmp_path):
    target = tmp_path / "out"
    _save(tmp_path, target, {"m-f16.gguf": b"1", "Modelfile": b"FROM ./m-f16.gguf"}, "save_gguf", prune=False)
    _save(tmp_path, target, {"m-q8_0.gguf": b"2", "Modelfile": b"FROM ./m-q8_0.gguf"}, "save_gguf", prune=False)
    assert (target / "m-f16.gguf").exists() and (target / "Modelfile").read_bytes() == b"FROM ./m-q8_0.gguf"


def test_an_interruption_while_swapping_puts_everything_back(tmp_path, monkeypatch):
    target = tmp_path / "out"
    _save(tmp_path, target, {"a.json": b"1", "b.json": b"1", "c.json": b"1"})
    (target / "notes.txt").write_bytes(b"mine")
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    real, calls = owned._move, []

    def move(src, dst):
        calls.append(dst)
        if len(calls) == 5:  # three moved aside, one new file in, then Ctrl-C
            raise KeyboardInterrupt
        real(src, dst)

    monkeypatch.setattr(owned, "_move", move)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, target, {"a.json": b"2", "b.json": b"2", "c.json": b"2", "d.json": b"2"})
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before


def test_a_manifest_naming_a_file_outside_is_refused(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    target = tmp_path / "out"
    target.mkdir()
    entry = {"sha256": owned.sha256(victim), "by": "save_lora"}
    for name in ("../victim.txt", str(victim), "sub/../../victim.txt"):
        (target / owned.MANIFEST).write_text(json.dumps({"format": owned.FORMAT, "files": {name: entry}}))
        with pytest.raises(FastkitError, match="not a manifest fastkit wrote"):
            _save(tmp_path, target, {"a.json": b"1"})
        assert victim.read_bytes() == b"precious"


@pytest.mark.parametrize("content", [b"{oops", b"[]", b'{"format": "x", "files": {}}', b'{"format": 1}'])
def test_a_manifest_fastkit_did_not_write_is_refused(tmp_path, content):
    target = tmp_path / "out"
    target.mkdir()
    (target / owned.MANIFEST).write_bytes(content)
    with pytest.raises(FastkitError, match=owned.MANIFEST):
        _save(tmp_path, target, {"a.json": b"1"})
    assert (target / owned.MANIFEST).read_bytes() == content and not (target / "a.json").exists()


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="no symlinks here")
def test_a_link_in_place_of_a_listed_file_is_not_followed(tmp_path):
    target = tmp_path / "out"
    _save(tmp_path, target, {"a.json": b"1"})
    precious = tmp_path / "precious.txt"
    precious.write_bytes(b"1")  # the bytes fastkit wrote, behind a link the user made
    (target / "a.json").unlink()
    os.symlink(precious, target / "a.json")
    with pytest.raises(FastkitError, match="a.json"):
        _save(tmp_path, target, {"a.json": b"2"})
    assert precious.read_bytes() == b"1" and (target / "a.json").is_symlink()
