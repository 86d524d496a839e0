"""Round-4 rows of the hostile-input table (issue 31), one builder per surface; tests/test_hostile_round4.py runs them.

Think like a user who keeps notes in the output folder, interrupts runs and renames files. Each builder
returns ``(surface, Case)`` pairs; a data-loss row checks that the user's files are byte-identical
after the save or rotation (and that the save itself happened, or was refused naming the file).
Imports of what round 4 added happen inside the actions, so the rows can run against older code.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from functools import lru_cache
from pathlib import Path

import torch
from datasets import Dataset

from fastkit import FastkitError, FastModel
from tests.hostile_round3 import TWIN, _bpe_tokenizer, _chat, _resume, _stopped_run, _trained, _trainer

MANIFEST = "fastkit_manifest.json"


def _ns():
    from tests.test_hostile_inputs import Case, Raises

    return Case, Raises


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _hashes(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (relative name -> sha256), links and all."""
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


# -- A. saves: the user's files are never deleted or overwritten ---------------------------------------------
KINDS = ("lora", "merged", "gguf")


def _save(kind: str, path, model=None, tok=None, **kw):
    from fastkit.export import save_gguf, save_lora, save_merged

    if model is None:
        model, tok = _trained()
    kw.setdefault("verify", False)
    if kind == "lora":
        return save_lora(model, tok, path, **kw)
    if kind == "merged":
        return save_merged(model, tok, path, dtype=kw.pop("dtype", torch.float32), **kw)
    return save_gguf(model, _bpe_tokenizer(), path, quantization=kw.pop("q", "f16"), name=kw.pop("name", "m"), **kw)


WRITES = {"lora": "adapter_model.safetensors", "merged": "model.safetensors", "gguf": "m-f16.gguf"}
"""One file each save kind writes (the row checks it arrived)."""

USER_FILES = {"notes.txt": b"my notes\n", "eval_results.json": b'{"acc": 0.9}\n', "README.md": b"# my model\n",
              "results.csv": b"a,b\n1,2\n", "plot.png": bytes(range(256)), "sub/notes.md": b"deep\n",
              ".gitignore": b"*.bin\n", "old-model.gguf": b"GGUF not really", "hparams.yaml": b"lr: 1\n",
              "checkpoint-1/optimizer.pt": b"an optimizer"}
"""Files a user keeps in an output folder (none of them a name a save writes)."""


def _kept_after(kind: str, files: dict[str, bytes], saves: int = 1):
    def action(ctx):
        out = ctx.tmp / kind
        for name, data in files.items():
            _write(out / name, data)
        for _ in range(saves):
            _save(kind, out)
        return out

    def check(out, ctx):
        for name, data in files.items():
            assert (out / name).read_bytes() == data, f"{name} changed or deleted"
        assert (out / WRITES[kind]).is_file(), sorted(os.listdir(out))
        listed = json.loads((out / MANIFEST).read_text())["files"]
        assert WRITES[kind] in listed and not set(files) & set(listed), sorted(listed)
        assert not list(ctx.tmp.glob(".fk-partial-*")), "a partial folder was left behind"
    return action, check


COLLISIONS = {"lora": ("adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "tokenizer_config.json",
                       "fastkit_adapter.json"),
              "merged": ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"),
              "gguf": ("Modelfile", "m-f16.gguf")}
"""A user's file with the name of a file the save writes: the save is refused, naming it."""


def _collision(kind: str, name: str):
    def action(ctx):
        out = ctx.tmp / kind
        _write(out / name, b"the user's own " + name.encode())
        _write(out / "notes.txt", b"notes")
        before = _hashes(out)
        try:
            _save(kind, out)
        except FastkitError as exc:
            return exc, before, _hashes(out)
        raise AssertionError("the save overwrote a file it did not write")

    def check(result, ctx):
        exc, before, after = result
        assert "would overwrite" in str(exc) and name in str(exc), exc
        assert before == after, "the refused save changed the folder"
    return action, check


EDITED = {"lora": "tokenizer_config.json", "merged": "config.json", "gguf": "Modelfile"}


def _edited_since(kind: str):
    """A file fastkit wrote, edited by the user since: it is theirs now, so the next save is refused."""
    def action(ctx):
        out = ctx.tmp / kind
        _save(kind, out)
        with open(out / EDITED[kind], "ab") as f:
            f.write(b"\n# my edit\n")
        before = _hashes(out)
        try:
            _save(kind, out)
        except FastkitError as exc:
            return exc, before, _hashes(out)
        raise AssertionError("the user's edit was overwritten")

    def check(result, ctx):
        exc, before, after = result
        assert EDITED[kind] in str(exc) and "changed since" in str(exc), exc
        assert before == after
    return action, check


def _two_kinds(first: str, second: str, **kw):
    """Two saves of different kinds into one folder: both outputs stay, each listed by its writer."""
    def action(ctx):
        out = ctx.tmp / "both"
        _save(first, out)
        _save(second, out, **kw)
        return out

    def check(out, ctx):
        listed = json.loads((out / MANIFEST).read_text())["files"]
        for kind in (first, second):
            assert (out / WRITES[kind]).is_file() and WRITES[kind] in listed, (kind, sorted(os.listdir(out)))
    return action, check


def _two_quantizations(ctx):
    out = ctx.tmp / "gguf"
    _save("gguf", out, q="f16")
    _save("gguf", out, q="q8_0")
    return out


def _both_quantizations(out, ctx):
    assert (out / "m-f16.gguf").is_file() and (out / "m-q8_0.gguf").is_file(), sorted(os.listdir(out))
    assert (out / "Modelfile").read_text().splitlines()[0] == "FROM ./m-q8_0.gguf"


def _stale_removed(ctx):
    """A merged save replaced by one that writes fewer files: the earlier save's extra file goes (it is fastkit's)."""
    from fastkit.export import owned

    out = ctx.tmp / "merged"
    _save("merged", out)
    _write(out / "model.extra.safetensors", b"x")
    entries = owned.read_manifest(out)
    entries["model.extra.safetensors"] = {"sha256": owned.sha256(out / "model.extra.safetensors"), "by": "save_merged"}
    owned.write_manifest(out, entries)
    _write(out / "notes.txt", b"mine")
    _save("merged", out)
    return out


def _stale_ok(out, ctx):
    assert not (out / "model.extra.safetensors").exists()
    assert (out / "notes.txt").read_bytes() == b"mine" and (out / "model.safetensors").is_file()
    assert "model.extra.safetensors" not in json.loads((out / MANIFEST).read_text())["files"]


@lru_cache(maxsize=1)
def _local_model():
    """A model loaded from a local folder (its source), with LoRA: saves into that folder must be refused."""
    import tempfile

    from fastkit.families.twins import twin
    from tests.helpers import save_twin, train_lora_steps

    src = Path(tempfile.mkdtemp(prefix="fastkit-hostile-src-")) / "base"
    save_twin(twin("llama", num_hidden_layers=1), src)
    model, tok = FastModel.from_pretrained(str(src), max_seq_length=64)
    model = train_lora_steps(FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False), 1)
    return src, model, tok


def _into_source(kind: str, spell=lambda src, ctx: src):
    def action(ctx):
        src, model, tok = _local_model()
        before = {k: v for k, v in _hashes(src).items() if "/" not in k}
        try:
            _save(kind, spell(src, ctx), model=model, tok=tok)
        except FastkitError as exc:
            return exc, before, {k: v for k, v in _hashes(src).items() if "/" not in k}
        raise AssertionError("saved into the folder the model was loaded from")

    def check(result, ctx):
        exc, before, after = result
        assert "loaded from" in str(exc), exc
        assert before == after, "the source folder changed"
    return action, check


def _relative_source(src, ctx):
    ctx.monkeypatch.chdir(src.parent)
    return "./" + src.name + "/"


def _inside_source(ctx):
    src, model, tok = _local_model()
    before = {k: v for k, v in _hashes(src).items() if "/" not in k}
    out = _save("lora", src / f"lora-{ctx.tmp.name}", model=model, tok=tok)
    assert {k: v for k, v in _hashes(src).items() if "/" not in k} == before
    return Path(out)


def _non_ascii_source(kind: str):
    """A model loaded from a folder with a non-ASCII name, saved into another (the GGUF named after it)."""
    def action(ctx):
        from fastkit.families.twins import twin
        from tests.helpers import save_twin

        src = save_twin(twin("llama", num_hidden_layers=1), ctx.tmp / "模型 model")
        model, tok = FastModel.from_pretrained(src, max_seq_length=64)
        model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False)
        kw = {"name": None} if kind == "gguf" else {}
        return Path(_save(kind, ctx.tmp / "导出", model=model, tok=tok, **kw))

    def check(written, ctx):
        folder = written.parent if written.suffix == ".gguf" else written
        assert folder == ctx.tmp / "导出" and (folder / MANIFEST).is_file(), written
        if kind == "gguf":
            assert written.name == "模型-model-f16.gguf", written.name
            assert (folder / "Modelfile").read_text(encoding="utf-8").startswith(f"FROM ./{written.name}")
    return action, check


def _bad_manifest(kind: str, content: bytes | None, needle: str = MANIFEST):
    def action(ctx):
        out = ctx.tmp / kind
        if content is None:
            (out / MANIFEST).mkdir(parents=True)
        else:
            _write(out / MANIFEST, content)
        _write(out / "notes.txt", b"mine")
        before = _hashes(out)
        try:
            _save(kind, out)
        except FastkitError as exc:
            return exc, before, _hashes(out)
        raise AssertionError("a save trusted a manifest fastkit did not write")

    def check(result, ctx):
        exc, before, after = result
        assert needle in str(exc), exc
        assert before == after
    return action, check


def _manifest_points_outside(ctx):
    """A manifest naming ``../victim.txt`` (hand-made or copied): nothing outside the folder is ever touched."""
    victim = _write(ctx.tmp / "victim.txt", b"precious")
    out = ctx.tmp / "merged"
    out.mkdir()
    entry = {"sha256": hashlib.sha256(b"precious").hexdigest(), "by": "save_merged"}
    _write(out / MANIFEST, json.dumps({"format": "fastkit-manifest/1", "files": {"../victim.txt": entry}}).encode())
    try:
        _save("merged", out)
    except FastkitError as exc:
        assert victim.read_bytes() == b"precious"
        return exc
    raise AssertionError("a manifest naming a file outside the folder was followed")


def _manifest_wrong_hash(ctx):
    """A manifest listing the user's file with another hash: the file is not fastkit's, so it is not replaced."""
    out = ctx.tmp / "lora"
    _write(out / "tokenizer.json", b"the user's")
    entry = {"sha256": "0" * 64, "by": "save_lora"}
    _write(out / MANIFEST, json.dumps({"format": "fastkit-manifest/1", "files": {"tokenizer.json": entry}}).encode())
    try:
        _save("lora", out)
    except FastkitError as exc:
        assert (out / "tokenizer.json").read_bytes() == b"the user's"
        return exc
    raise AssertionError("overwrote a file whose bytes are not the ones fastkit wrote")


def _named(kind: str, name: str, cwd: bool = False):
    def action(ctx):
        if cwd:
            ctx.monkeypatch.chdir(ctx.tmp)
        _write(ctx.tmp / "keep.txt", b"beside")
        target = name if cwd else str(ctx.tmp / name) + ("/" if name.endswith("/") else "")
        return Path(_save(kind, target)), name

    def check(result, ctx):
        written, name = result
        folder = written if written.is_dir() else written.parent
        assert folder.resolve() == (ctx.tmp / name).resolve(), (folder, name)
        assert (folder / WRITES[kind]).is_file() and (folder / MANIFEST).is_file()
        assert (ctx.tmp / "keep.txt").read_bytes() == b"beside"
        assert not list(ctx.tmp.glob(".fk-partial-*")) and not list(ctx.tmp.parent.glob(".fk-partial-*"))
    return action, check


def _dot_target(kind: str):
    """``"."`` as the output folder: the working folder, its other files kept."""
    def action(ctx):
        work = ctx.tmp / "work"
        _write(work / "train.py", b"print('my script')\n")
        _write(work / "data.jsonl", b"{}\n")
        ctx.monkeypatch.chdir(work)
        _save(kind, ".")
        return work

    def check(work, ctx):
        assert (work / "train.py").read_bytes() == b"print('my script')\n" and (work / "data.jsonl").read_bytes()
        assert (work / WRITES[kind]).is_file()
    return action, check


def _adapter_named(name: str):
    def action(ctx):
        from peft import LoraConfig

        from fastkit.export import save_lora

        model, tok = FastModel.from_pretrained(TWIN, max_seq_length=64, twin=True)
        model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False)
        model.add_adapter(name, LoraConfig(r=2, target_modules=["q_proj"]))
        ctx.monkeypatch.chdir(ctx.tmp)
        before = sorted(p.name for p in ctx.tmp.iterdir())
        try:
            save_lora(model, tok, ctx.tmp / "out" / "lora", verify=False)
        except FastkitError as exc:
            assert sorted(p.name for p in ctx.tmp.iterdir()) == before, "something was written"
            return exc
        raise AssertionError(f"adapter name {name!r} was saved")
    return action


def _interrupted(kind: str, at_move: int):
    """Ctrl-C while a second save swaps its files in: the folder is as it was, the user's files too."""
    def action(ctx):
        from fastkit.export import owned

        out = ctx.tmp / kind
        _save(kind, out)
        _write(out / "notes.txt", b"mine")
        before = _hashes(out)
        real, calls = owned._move, []

        def move(src, dst):
            calls.append(dst)
            if len(calls) == at_move:
                raise KeyboardInterrupt
            real(src, dst)

        ctx.monkeypatch.setattr(owned, "_move", move)
        try:
            _save(kind, out)
        except KeyboardInterrupt:
            return before, _hashes(out)
        raise AssertionError("the interruption did not happen")

    def check(result, ctx):
        before, after = result
        assert before == after, sorted(set(before.items()) ^ set(after.items()))[:4]
        assert not list(ctx.tmp.glob(".fk-partial-*"))
    return action, check


def _manifest_write_fails(ctx):
    """The manifest cannot be written at the end: every file swapped in goes back."""
    from fastkit.export import owned

    out = ctx.tmp / "lora"
    _save("lora", out)
    _write(out / "notes.txt", b"mine")
    before = _hashes(out)
    real = owned.write_manifest

    def fail(folder, entries):
        if Path(folder) == out:
            raise OSError("disk full")
        real(folder, entries)

    ctx.monkeypatch.setattr(owned, "write_manifest", fail)
    _, other, other_tok = _local_model()  # other weights: files that differ, so a missing roll-back shows
    try:
        _save("lora", out, model=other, tok=other_tok)
    except OSError:
        return before, _hashes(out)
    raise AssertionError("no failure")


def _same(result, ctx):
    before, after = result
    assert before == after


def saves():
    Case, Raises = _ns()
    err = FastkitError
    out = []
    for kind in KINDS:
        for name, data in USER_FILES.items():
            action, check = _kept_after(kind, {name: data})
            out.append(Case(f"r4_save_{kind}_keeps_{name.replace('/', '_').strip('.')}", action, check))
        action, check = _kept_after(kind, USER_FILES, saves=2)
        out.append(Case(f"r4_save_{kind}_twice_keeps_every_user_file", action, check))
        for name in COLLISIONS[kind]:
            action, check = _collision(kind, name)
            out.append(Case(f"r4_save_{kind}_refuses_to_overwrite_{name}", action, check))
        action, check = _edited_since(kind)
        out.append(Case(f"r4_save_{kind}_refuses_a_file_edited_since", action, check))
        for spell_id, spell in (("path", lambda src, ctx: src), ("str_slash", lambda src, ctx: str(src) + "/"),
                                ("relative", _relative_source)):
            if spell_id != "path" and kind != "lora":
                continue
            action, check = _into_source(kind, spell)
            out.append(Case(f"r4_save_{kind}_into_loaded_folder_{spell_id}_refused", action, check))
        for bad_id, content in (("garbage", b"{not json"), ("list", b"[]"), ("folder", None)):
            action, check = _bad_manifest(kind, content)
            out.append(Case(f"r4_save_{kind}_manifest_{bad_id}_refused", action, check))
        for name in ("x" * 250, "模型", "modèle-é", "мой адаптер", "🙂 model", "out/"):
            action, check = _named(kind, name)
            short = {"x" * 250: "250_chars", "out/": "trailing_slash"}.get(name, name.encode().hex()[:12])
            out.append(Case(f"r4_save_{kind}_folder_name_{short}", action, check))
        action, check = _non_ascii_source(kind)
        out.append(Case(f"r4_save_{kind}_from_non_ascii_model_folder", action, check))
        action, check = _dot_target(kind)
        out.append(Case(f"r4_save_{kind}_dot_target_keeps_the_working_folder", action, check))
        action, check = _interrupted(kind, 2)
        out.append(Case(f"r4_save_{kind}_interrupted_while_swapping_keeps_folder", action, check))
    action, check = _bad_manifest("lora", json.dumps({"format": "other/9", "files": {}}).encode())
    out.append(Case("r4_save_manifest_other_format_refused", action, check))
    out += [
        Case("r4_save_gguf_then_merged_keeps_both", *_two_kinds("gguf", "merged")),
        Case("r4_save_merged_then_gguf_keeps_both", *_two_kinds("merged", "gguf")),
        Case("r4_save_lora_then_gguf_keeps_both", *_two_kinds("lora", "gguf")),
        Case("r4_save_gguf_two_quantizations_kept", _two_quantizations, _both_quantizations),
        Case("r4_save_merged_stale_own_file_removed_user_kept", _stale_removed, _stale_ok),
        Case("r4_save_lora_into_a_subfolder_of_the_source_works", _inside_source,
             lambda out, ctx: (out / "adapter_model.safetensors").is_file() or (_ for _ in ()).throw(AssertionError)),
        Case("r4_save_manifest_naming_outside_file_refused", _manifest_points_outside,
             lambda exc, ctx: MANIFEST in str(exc) or (_ for _ in ()).throw(AssertionError(exc))),
        Case("r4_save_manifest_wrong_hash_is_not_ours", _manifest_wrong_hash,
             lambda exc, ctx: "tokenizer.json" in str(exc) or (_ for _ in ()).throw(AssertionError(exc))),
        Case("r4_save_manifest_write_fails_rolls_back", _manifest_write_fails, _same),
        Case("r4_save_lora_interrupted_at_first_move", *_interrupted("lora", 1)),
        Case("r4_save_lora_folder_name_255_bytes", *_named("lora", "y" * 255)),
        Case("r4_save_lora_folder_name_256_bytes_refused", lambda ctx: _save("lora", ctx.tmp / ("z" * 256)),
             Raises(err, "over 255 bytes")),
        Case("r4_save_lora_dot_relative_name", *_named("lora", "my lora", cwd=True)),
    ]
    # ("..", "../up": PEFT's module dict refuses a "." in an adapter name itself)
    for name, why in (("/tmp/evil-abs", "not a plain folder name"), ("sub\\dir", "not a plain folder name"),
                      ("a/b", "not a plain folder name"), ("/abs2/deeper", "not a plain folder name"),
                      (" padded", "not a plain folder name")):
        out.append(Case(f"r4_save_lora_adapter_name_{name.encode().hex()[:10]}_refused", _adapter_named(name),
                        lambda exc, ctx, why=why: why in str(exc) or (_ for _ in ()).throw(AssertionError(exc))))
    return [("saves", c) for c in out]


# -- B. rotation of an earlier run's checkpoints -----------------------------------------------------------
def _ckpt(folder: Path, step: int, extra: dict[str, bytes] | None = None) -> Path:
    c = folder / f"checkpoint-{step}"
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json", "adapter_model.safetensors",
                 "adapter_config.json", "fastkit_run.json", "README.md"):
        _write(c / name, f"{name} of step {step}".encode())
    for name, data in (extra or {}).items():
        _write(c / name, data)
    return c


def _rotate(setup):
    def action(ctx):
        from fastkit.training.identity import set_aside_old_checkpoints

        out = ctx.tmp / "out"
        out.mkdir()
        setup(out)
        set_aside_old_checkpoints(out)
        return out
    return action


def _file_is(rel: str, data: bytes):
    def check(out, ctx):
        assert (out / rel).read_bytes() == data, rel
    return check


def _all(*checks):
    def check(out, ctx):
        for c in checks:
            c(out, ctx)
    return check


def _absent(rel: str):
    def check(out, ctx):
        assert not os.path.lexists(out / rel), rel
    return check


def _rotation_refused(setup, needle):
    def action(ctx):
        from fastkit.training.identity import set_aside_old_checkpoints

        out = ctx.tmp / "out"
        out.mkdir()
        setup(out)
        before = _hashes(out)
        try:
            set_aside_old_checkpoints(out)
        except FastkitError as exc:
            assert needle in str(exc), exc
            assert _hashes(out) == before
            return exc
        raise AssertionError("rotation went ahead")
    return action


def _real_rotation_twice(ctx):
    """Two new runs in one output_dir, the user's notes in previous-run between them: the notes stay."""
    from fastkit.training import fit

    out = ctx.tmp / "out"
    shutil.copytree(_stopped_run(), out)
    fit(_trainer(out, max_steps=1), view="none")
    _write(out / "previous-run" / "my-notes.txt", b"what I saw")
    fit(_trainer(out, max_steps=1), view="none")
    return out


def rotation():
    Case, _ = _ns()
    pure = lambda out: (_ckpt(out, 1), _ckpt(out, 2))  # noqa: E731
    out = [
        Case("r4_rotate_user_file_in_output_dir_kept",
             _rotate(lambda o: (pure(o), _write(o / "notes.txt", b"n"))),
             _all(_file_is("notes.txt", b"n"), _file_is("previous-run/checkpoint-1/optimizer.pt",
                                                        b"optimizer.pt of step 1"))),
        Case("r4_rotate_user_file_in_previous_run_kept",
             _rotate(lambda o: (pure(o), _write(o / "previous-run" / "notes.txt", b"n"))),
             _all(_file_is("previous-run/notes.txt", b"n"), _file_is("previous-run/checkpoint-2/scheduler.pt",
                                                                     b"scheduler.pt of step 2"))),
        Case("r4_rotate_user_folder_in_previous_run_kept",
             _rotate(lambda o: (pure(o), _write(o / "previous-run" / "analysis" / "plot.png", b"p"))),
             _file_is("previous-run/analysis/plot.png", b"p")),
        Case("r4_rotate_pure_old_checkpoint_replaced",
             _rotate(lambda o: (_ckpt(o / "previous-run", 7), pure(o))),
             _all(_absent("previous-run/checkpoint-7"), _file_is("previous-run/checkpoint-1/optimizer.pt",
                                                                 b"optimizer.pt of step 1"))),
        Case("r4_rotate_old_checkpoint_with_user_file_kept",
             _rotate(lambda o: (_ckpt(o / "previous-run", 7, {"my-eval.txt": b"e"}), pure(o))),
             _file_is("previous-run/checkpoint-7/my-eval.txt", b"e")),
        Case("r4_rotate_colliding_user_checkpoint_kept_new_renamed",
             _rotate(lambda o: (_ckpt(o / "previous-run", 1, {"my-eval.txt": b"e"}), pure(o))),
             _all(_file_is("previous-run/checkpoint-1/my-eval.txt", b"e"),
                  _file_is("previous-run/checkpoint-1-1/optimizer.pt", b"optimizer.pt of step 1"))),
        Case("r4_rotate_old_checkpoint_with_subfolder_kept",
             _rotate(lambda o: (_ckpt(o / "previous-run", 7, {"other/adapter_model.safetensors": b"s"}), pure(o))),
             _file_is("previous-run/checkpoint-7/other/adapter_model.safetensors", b"s")),
        Case("r4_rotate_checkpoint_holding_user_file_moves_with_it",
             _rotate(lambda o: _ckpt(o, 3, {"keep-me.md": b"k"})),
             _file_is("previous-run/checkpoint-3/keep-me.md", b"k")),
        Case("r4_rotate_non_numbered_checkpoint_folder_untouched",
             _rotate(lambda o: (pure(o), _write(o / "checkpoint-final" / "x.txt", b"x"))),
             _file_is("checkpoint-final/x.txt", b"x")),
        Case("r4_rotate_nothing_to_move_leaves_previous_run",
             _rotate(lambda o: _ckpt(o / "previous-run", 4)),
             _file_is("previous-run/checkpoint-4/optimizer.pt", b"optimizer.pt of step 4")),
        Case("r4_rotate_previous_run_is_a_file_refused",
             _rotation_refused(lambda o: (pure(o), _write(o / "previous-run", b"my file")), "previous-run"),
             lambda exc, ctx: None),
        Case("r4_rotate_real_runs_keep_notes_in_previous_run", _real_rotation_twice,
             _all(_file_is("previous-run/my-notes.txt", b"what I saw"))),
    ]
    if hasattr(os, "symlink"):
        def linked(o):
            pure(o)
            target = o.parent / "elsewhere"
            _write(target / "precious.txt", b"p")
            os.symlink(target, o / "previous-run")
        out.append(Case("r4_rotate_previous_run_symlink_refused", _rotation_refused(linked, "link"),
                        lambda exc, ctx: None))
    return [("rotation", c) for c in out]


# -- C. resume: a checkpoint is complete or refused, naming the piece -------------------------------------
def _rm(name):
    def mutate(out):
        (out / "checkpoint-2" / name).unlink()
    return mutate


def _put(name, data: bytes):
    def mutate(out):
        (out / "checkpoint-2" / name).write_bytes(data)
    return mutate


def _truncate(name):
    def mutate(out):
        f = out / "checkpoint-2" / name
        f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2])
    return mutate


def _resume_earlier(ctx):
    """The newest checkpoint is broken (deleted by the user): the earlier one resumes."""
    def mutate(out):
        shutil.rmtree(out / "checkpoint-2")
    trainer = _resume(ctx, mutate=mutate)
    assert trainer.state.fastkit_run == "resumed from checkpoint-1", trainer.state.fastkit_run
    return trainer


def resume():
    Case, Raises = _ns()
    err = FastkitError
    out = [
        Case(f"r4_resume_without_{name.split('.')[0]}", lambda ctx, n=name: _resume(ctx, mutate=_rm(n)),
             Raises(err, "checkpoint-2", name))
        for name in ("scheduler.pt", "rng_state.pth", "trainer_state.json", "adapter_model.safetensors",
                     "adapter_config.json")
    ]
    out += [
        Case("r4_resume_run_file_truncated", lambda ctx: _resume(ctx, mutate=_truncate("fastkit_run.json")),
             Raises(err, "fastkit_run.json", "not valid JSON")),
        Case("r4_resume_run_file_empty", lambda ctx: _resume(ctx, mutate=_put("fastkit_run.json", b"")),
             Raises(err, "fastkit_run.json", "not valid JSON")),
        Case("r4_resume_run_file_a_list", lambda ctx: _resume(ctx, mutate=_put("fastkit_run.json", b"[1, 2]")),
             Raises(err, "fastkit_run.json", "not an object")),
        Case("r4_resume_run_file_not_utf8", lambda ctx: _resume(ctx, mutate=_put("fastkit_run.json", b"\xff\xfe{")),
             Raises(err, "fastkit_run.json")),
        Case("r4_resume_trainer_state_truncated", lambda ctx: _resume(ctx, mutate=_truncate("trainer_state.json")),
             Raises(err, "trainer_state.json", "not valid JSON")),
        Case("r4_resume_rng_state_renamed_to_a_rank", lambda ctx: _resume(ctx, mutate=lambda o: os.replace(
            o / "checkpoint-2" / "rng_state.pth", o / "checkpoint-2" / "rng_state_3.pth")),
             Raises(err, "rng_state.pth")),
        Case("r4_resume_two_pieces_missing_named_together", lambda ctx: _resume(
            ctx, mutate=lambda o: (_rm("scheduler.pt")(o), _rm("rng_state.pth")(o))),
             Raises(err, "scheduler.pt", "rng_state.pth")),
        Case("r4_resume_earlier_checkpoint_after_deleting_newest", _resume_earlier,
             lambda trainer, ctx: None),
    ]
    return [("resume", c) for c in out]


# -- D. data: splits picked exactly, lengths as TRL tokenizes -------------------------------------------------
def _rows_file(folder: Path, name: str, tag: str, n: int = 2) -> None:
    rows = [_chat(f"{tag} question {i}", f"{tag} answer {i}") for i in range(n)]
    _write(folder / name, ("\n".join(json.dumps(r) for r in rows) + "\n").encode())


def _folder(files: dict[str, str]):
    def make(ctx):
        folder = ctx.tmp / "data"
        for name, tag in files.items():
            _rows_file(folder, name, tag)
        return folder
    return make


def _load_split(files, split="train"):
    def action(ctx):
        from fastkit.data import load_chat_dataset

        return load_chat_dataset(str(_folder(files)(ctx)), split=split)
    return action


def _only(tag, n):
    def check(ds, ctx):
        texts = [m["content"] for row in ds["messages"] for m in row]
        assert len(ds) == n and all(t.startswith(tag) for t in texts), (len(ds), texts[:4])
    return check


def _text_of(tok, n_tokens: int) -> str:
    """A text that ``tok`` turns into exactly ``n_tokens`` ids (as TRL calls it, special tokens included)."""
    base = len(tok("")["input_ids"])
    text = "a" * max(n_tokens - base, 0)
    while len(tok(text)["input_ids"]) > n_tokens:
        text = text[:-1]
    while len(tok(text)["input_ids"]) < n_tokens:
        text += "b"
    assert len(tok(text)["input_ids"]) == n_tokens
    return text


def _length_rows(kind: str, n: int, eos_in_text: bool = False):
    def action(ctx):
        from fastkit.data import check_dataset

        eos = ctx.tok.eos_token
        if kind == "text":
            text = _text_of(ctx.tok, n)
            row = {"text": text + eos if eos_in_text else text}
        else:
            prompt = _text_of(ctx.tok, 8)
            completion = "c" * max(n - len(ctx.tok(prompt)["input_ids"]), 1)
            while len(ctx.tok(prompt + completion)["input_ids"]) > n:
                completion = completion[:-1]
            while len(ctx.tok(prompt + completion)["input_ids"]) < n:
                completion += "c"
            row = {"prompt": prompt, "completion": completion + eos if eos_in_text else completion}
        return check_dataset([row], ctx.tok, 32)
    return action


def _one_row(ds, ctx):
    assert len(ds) == 1


def _drop_exact(ctx):
    from fastkit.data import check_dataset

    rows = [{"text": _text_of(ctx.tok, 32)}, {"text": _text_of(ctx.tok, 10)}]
    return check_dataset(rows, ctx.tok, 32, drop_long=True)


def _trl_counts_match(ctx):
    """fastkit's count equals TRL's own tokenization of the same rows (the EOS included)."""
    from trl import SFTConfig, SFTTrainer

    from fastkit.data.prepare import _token_counts

    rows = [{"text": "hello world"}, {"prompt": "say hi: ", "completion": "hi there"}]
    got = [_token_counts(r, ctx.tok)[0] for r in rows]
    model = FastModel.from_pretrained(TWIN, max_seq_length=64, twin=True)[0]
    want = []
    for r in rows:
        args = SFTConfig(output_dir=str(ctx.tmp / "o"), use_cpu=True, bf16=False, max_length=64, packing=False,
                         report_to=[])
        t = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list([r]), processing_class=ctx.tok)
        want.append(len(t.train_dataset[0]["input_ids"]))
    return got, want


def data():
    Case, Raises = _ns()
    err = FastkitError
    out = [
        Case("r4_split_train_file_only", _load_split({"train.jsonl": "train", "test.jsonl": "test"}),
             _only("train", 2)),
        Case("r4_split_test_file_only", _load_split({"train.jsonl": "train", "test.jsonl": "test"}, "test"),
             _only("test", 2)),
        Case("r4_split_validation_missing_refused",
             _load_split({"train.jsonl": "train", "test.jsonl": "test"}, "validation"),
             Raises(err, "split='validation'", "train.jsonl", "test.jsonl")),
        Case("r4_split_validation_missing_single_file_refused", _load_split({"data.jsonl": "d"}, "validation"),
             Raises(err, "split='validation'", "data.jsonl")),
        Case("r4_split_no_named_file_is_all_train", _load_split({"a.jsonl": "a", "b.jsonl": "a"}), _only("a", 4)),
        Case("r4_split_unnamed_beside_test_refused", _load_split({"chats.jsonl": "c", "test.jsonl": "t"}),
             Raises(err, "split='train'", "chats.jsonl", "test.jsonl")),
        Case("r4_split_val_file_for_validation", _load_split({"train.jsonl": "tr", "val.jsonl": "va"}, "validation"),
             _only("va", 2)),
        Case("r4_split_dev_file_for_validation", _load_split({"train.jsonl": "tr", "dev.jsonl": "dv"}, "validation"),
             _only("dv", 2)),
        Case("r4_split_valid_alias", _load_split({"train.jsonl": "tr", "valid.jsonl": "vd"}, "valid"),
             _only("vd", 2)),
        Case("r4_split_sharded_train_files", _load_split({"train-00000-of-00002.jsonl": "t",
                                                           "train-00001-of-00002.jsonl": "t",
                                                           "test-00000-of-00001.jsonl": "x"}), _only("t", 4)),
        Case("r4_split_prefixed_name", _load_split({"my_train.jsonl": "t", "my_test.jsonl": "x"}), _only("t", 2)),
        Case("r4_split_dotted_name", _load_split({"data.train.jsonl": "t", "data.test.jsonl": "x"}), _only("t", 2)),
        Case("r4_split_trainee_is_not_train", _load_split({"trainee.jsonl": "e", "test.jsonl": "x"}),
             Raises(err, "trainee.jsonl")),
        Case("r4_split_uppercase_file", _load_split({"TRAIN.JSONL": "t", "TEST.JSONL": "x"}), _only("t", 2)),
        Case("r4_split_training_word", _load_split({"training.jsonl": "t", "testing.jsonl": "x"}), _only("t", 2)),
        Case("r4_split_eval_file_is_test", _load_split({"train.jsonl": "t", "eval.jsonl": "e"}, "test"),
             _only("e", 2)),
        Case("r4_split_custom_name", _load_split({"train.jsonl": "t", "extra.jsonl": "x"}, "extra"), _only("x", 2)),
        Case("r4_split_none_refused", _load_split({"train.jsonl": "t", "test.jsonl": "x"}, None),
             Raises(err, "split must be")),
        Case("r4_split_empty_refused", _load_split({"train.jsonl": "t", "test.jsonl": "x"}, " "),
             Raises(err, "split must be")),
        Case("r4_split_number_refused", _load_split({"train.jsonl": "t", "test.jsonl": "x"}, 3),
             Raises(err, "split must be")),
        Case("r4_split_test_only_folder_train_refused", _load_split({"test.jsonl": "x"}),
             Raises(err, "split='train'", "test.jsonl")),
        Case("r4_split_datasetdict_missing_validation",
             lambda ctx: __import__("fastkit.data", fromlist=["x"]).load_chat_dataset(
                 __import__("datasets").DatasetDict({"train": Dataset.from_list([_chat("q")])}), split="validation"),
             Raises(err, "split='validation'")),
        Case("r4_length_text_exactly_max_refused", _length_rows("text", 32), Raises(err, "max_seq_length=32", "33")),
        Case("r4_length_text_max_minus_one_ok", _length_rows("text", 31), _one_row),
        Case("r4_length_text_ending_in_eos_exact_ok", _length_rows("text", 31, eos_in_text=True), _one_row),
        Case("r4_length_prompt_completion_exactly_max_refused", _length_rows("pc", 32),
             Raises(err, "max_seq_length=32")),
        Case("r4_length_prompt_completion_max_minus_one_ok", _length_rows("pc", 31), _one_row),
        Case("r4_length_drop_long_drops_the_exact_row", _drop_exact, _one_row),
        Case("r4_length_counts_equal_trl_tokenization", _trl_counts_match,
             lambda r, ctx: r[0] == r[1] or (_ for _ in ()).throw(AssertionError(r))),
    ]
    return [("data", c) for c in out]


# -- E. adapters and models ------------------------------------------------------------------------------
def _moe_model():
    from fastkit.families.twins import twin

    return FastModel.patch(twin("qwen3_moe", num_hidden_layers=1))


def _expert_lora(**kw):
    def action(ctx):
        from fastkit.patches.moe.lora import add_expert_lora

        return add_expert_lora(_moe_model(), **kw)
    return action


def _peft_twice_on_base(ctx):
    model, _ = FastModel.from_pretrained(TWIN, max_seq_length=64, twin=True)
    FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False)
    return FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False)


def _frozen_fit(ctx):
    from fastkit.export import load_lora
    from fastkit.training import fit, make_trainer
    from tests.hostile_round3 import RUN_DATA, _adapter_dir

    model, tok = FastModel.from_pretrained(TWIN, max_seq_length=64, twin=True)
    model = load_lora(model, _adapter_dir(), is_trainable=False)
    trainer = make_trainer(model, tok, RUN_DATA, max_steps=1, dashboard="none", output_dir=str(ctx.tmp / "o"),
                           max_seq_length=64)
    fit(trainer, view="none")


def _hybrid_default(family):
    def action(ctx):
        from fastkit.families.twins import twin

        model = FastModel.patch(twin(family))
        peft = FastModel.get_peft_model(model, r=2, use_gradient_checkpointing=False)
        return peft, FastModel.get_peft_model(peft, r=2, use_gradient_checkpointing=False)

    def check(result, ctx):
        peft, again = result
        targets = set(peft.peft_config["default"].target_modules)
        assert targets and "out_proj" not in targets and "q_proj" in targets, targets
        assert again is peft  # the re-run cell: "all-linear" asked again, the same adapter back
        assert any("lora_A" in n for n, _ in peft.named_parameters())
    return action, check


def _llama_all_linear(ctx):
    from fastkit.families.twins import twin

    peft = FastModel.get_peft_model(FastModel.patch(twin("llama")), r=2, use_gradient_checkpointing=False)
    return set(peft.peft_config["default"].target_modules)


def _nf4_lora():
    from fastkit.families.twins import twin
    from fastkit.patches.moe.lora import add_expert_lora
    from fastkit.patches.moe.nf4 import quantize_experts

    model = FastModel.patch(twin("qwen3_moe", num_hidden_layers=1))
    torch.manual_seed(0)
    add_expert_lora(model, r=4, lora_alpha=8)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # B starts at zero: give the update values, so a merge that drops it shows
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    quantize_experts(model)
    return model


def _merge_nf4_directly(ctx):
    from fastkit.patches.moe.lora import merge_expert_lora

    return merge_expert_lora(_nf4_lora())


def _save_merged_nf4(ctx):
    from fastkit.export import save_merged
    from fastkit.families.twins import twin_tokenizer

    model = _nf4_lora()
    ids = torch.randint(3, 200, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model.eval()(input_ids=ids).logits
    path = save_merged(model, twin_tokenizer(), ctx.tmp / "merged", dtype=torch.float32, verify=True)
    return path, ids, want


def _nf4_merged_ok(result, ctx):
    from transformers import AutoModelForCausalLM

    path, ids, want = result
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def adapters():
    Case, Raises = _ns()
    err = FastkitError
    bad = {"r_string": (dict(r="8"), "r must be a positive int"), "r_float": (dict(r=2.5), "r must be a positive int"),
           "r_zero": (dict(r=0), "r must be a positive int"), "r_negative": (dict(r=-4), "r must be"),
           "r_bool": (dict(r=True), "r must be"), "alpha_string": (dict(lora_alpha="16"), "lora_alpha"),
           "alpha_zero": (dict(lora_alpha=0), "lora_alpha"), "alpha_nan": (dict(lora_alpha=float("nan")), "lora_alpha"),
           "dropout_none": (dict(lora_dropout=None), "lora_dropout"),
           "dropout_string": (dict(lora_dropout="0.1"), "lora_dropout"),
           "dropout_one": (dict(lora_dropout=1.0), "lora_dropout"), "dropout_negative": (dict(lora_dropout=-0.1),
                                                                                         "lora_dropout"),
           "rslora_string": (dict(use_rslora="yes"), "use_rslora"), "dtype_string": (dict(dtype="fp16"), "dtype"),
           "dtype_int": (dict(dtype=torch.int8), "dtype")}
    out = [Case(f"r4_expert_lora_{key}", _expert_lora(**kw), Raises(err, needle)) for key, (kw, needle) in bad.items()]
    out += [
        Case("r4_expert_lora_valid_attaches", _expert_lora(r=4, lora_alpha=8),
             lambda names, ctx: len(names) >= 1 or (_ for _ in ()).throw(AssertionError(names))),
        Case("r4_get_peft_model_twice_on_the_base_refused", _peft_twice_on_base,
             Raises(err, "already carries a LoRA adapter", "returned")),
        Case("r4_fit_on_frozen_adapter_refused", _frozen_fit, Raises(err, "no parameter", "is_trainable=True")),
        Case("r4_hybrid_falcon_h1_default_targets", *_hybrid_default("falcon_h1")),
        Case("r4_hybrid_nemotron_h_default_targets", *_hybrid_default("nemotron_h")),
        Case("r4_llama_default_targets_still_all_linear", _llama_all_linear,
             lambda t, ctx: {"q_proj", "down_proj"} <= {n.rsplit(".", 1)[-1] for n in t}
             or (_ for _ in ()).throw(AssertionError(t))),
        Case("r4_merge_expert_lora_on_4bit_refused", _merge_nf4_directly, Raises(err, "stored 4-bit", "save_merged")),
        Case("r4_save_merged_4bit_experts_dequantizes_and_merges", _save_merged_nf4, _nf4_merged_ok),
    ]
    return [("adapters", c) for c in out]


# -- F. docs -----------------------------------------------------------------------------------------------
def _first_line_runs(doc: str):
    def action(ctx):
        from tests.test_docs_code import ROOT, code_blocks

        first = code_blocks(ROOT / doc)[0][1].splitlines()[0]
        exec(compile(first, doc, "exec"), {})
        return first
    return action


def docs():
    Case, _ = _ns()
    out = [Case(f"r4_docs_{doc.replace('/', '_').replace('.md', '')}_first_line_imports", _first_line_runs(doc),
                lambda first, ctx: None) for doc in ("docs/export.md", "README.md", "docs/packing.md")]
    return [("docs", c) for c in out]


def all_rows():
    """``(surface, Case)`` for every round-4 row."""
    return saves() + rotation() + resume() + data() + adapters() + docs()
