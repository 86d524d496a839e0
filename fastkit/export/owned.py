"""A save owns only what it wrote: the output folder's manifest, and the commit that honours it.

Every save (``save_lora``, ``save_merged``, ``save_gguf``) leaves :data:`MANIFEST` in its output folder:
the relative name, sha256 and writer of each file fastkit wrote there. A later save into the same
folder (:func:`commit`)

- replaces a file only when the manifest lists it and its bytes are still the ones fastkit wrote;
- removes the files an earlier save *of the same kind* wrote that this one does not (a merged model
  saved with 2 shards, then with 1) -- never another kind's (``save_gguf`` then ``save_merged`` into
  one folder keeps both), and never an earlier GGUF (one file per quantization, each kept);
- keeps every other file byte-identical, and refuses, naming them, where it would overwrite a file it
  did not write (a user's notes, a model's own weights, a file edited since fastkit wrote it);
- keeps the user's ``README.md`` instead of the save's model card (:data:`OPTIONAL`).

Into a folder that does not exist yet the staged folder is renamed whole (atomic). Into an existing
folder each file is swapped in with ``os.replace`` after the old version was moved aside; an exception
(Ctrl-C included) moves everything back, so the folder is as it was.

What must not change: no file that is not in the manifest with its current hash is ever deleted or
overwritten; the manifest is written last, atomically.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from fastkit.errors import FastkitError

logger = logging.getLogger(__name__)

MANIFEST = "fastkit_manifest.json"
"""The file, in each output folder, listing what fastkit wrote there."""
FORMAT = "fastkit-manifest/1"
OPTIONAL = frozenset({"README.md"})
"""Files a save may leave out when the folder already holds the user's own (the save's model card)."""


def sha256(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def files_in(folder: Path) -> list[str]:
    """Relative POSIX names of every file under ``folder`` (the manifest excluded), sorted."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                  if p.is_file() and p != folder / MANIFEST)


def read_manifest(folder: Path) -> dict[str, dict]:
    """``{name: {"sha256": ..., "by": ...}}`` of ``folder``'s manifest; {} when there is none."""
    file = folder / MANIFEST
    if not file.exists():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
        if data["format"] != FORMAT or not isinstance(data["files"], dict):
            raise ValueError("not fastkit's format")
        entries = {str(k): dict(v) for k, v in data["files"].items()}
        if not all(_inside(name) for name in entries):
            raise ValueError("a name outside the folder")
        return entries
    except (ValueError, KeyError, TypeError, OSError) as exc:  # UnicodeDecodeError is a ValueError
        raise FastkitError(f"{str(file)!r} is not a manifest fastkit wrote ({type(exc).__name__}); fastkit "
                           f"keeps its list of the files it saved there. Move or delete that file, or save into "
                           "another folder.") from exc


def _inside(name: str) -> bool:
    """A relative name that stays inside its folder (no absolute path, no ``..``, no empty part)."""
    parts = name.replace("\\", "/").split("/")
    return bool(name) and not os.path.isabs(name) and all(p not in ("", ".", "..") for p in parts)


def write_manifest(folder: Path, entries: dict[str, dict]) -> None:
    """Write ``folder``'s manifest atomically (a temporary file renamed over it)."""
    tmp = folder / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps({"format": FORMAT, "files": dict(sorted(entries.items()))}, indent=1) + "\n",
                   encoding="utf-8")
    os.replace(tmp, folder / MANIFEST)


def entries_for(folder: Path, by: str) -> dict[str, dict]:
    return {name: {"sha256": sha256(folder / name), "by": by} for name in files_in(folder)}


def is_ours(target: Path, name: str, own: dict[str, dict]) -> bool:
    """True when ``target/name`` is a file the manifest lists with the bytes it has now."""
    file = target / name
    entry = own.get(name)
    return entry is not None and file.is_file() and not file.is_symlink() and sha256(file) == entry.get("sha256")


def record_own(target: Path, name: str, by: str) -> None:
    """List ``target/name`` (just rewritten by fastkit, e.g. the export menu's Modelfile) in the manifest with its
    bytes now, so the next save still knows it as fastkit's own."""
    own = read_manifest(target) if target.is_dir() else {}
    write_manifest(target, {**own, name: {"sha256": sha256(target / name), "by": by}})


def remove_own(target: Path, name: str) -> bool:
    """Delete ``target/name`` when it is fastkit's own (listed with its bytes in the manifest), and its entry;
    a user's file of that name stays. Returns whether it was removed."""
    own = read_manifest(target) if target.is_dir() else {}
    if not is_ours(target, name, own):
        return False
    (target / name).unlink()
    write_manifest(target, {n: e for n, e in own.items() if n != name})
    return True

def _blocked(target: Path, name: str) -> bool:
    """A folder of the same name, or a file where a parent folder of ``name`` must go."""
    if (target / name).is_dir():
        return True
    parent = target
    for part in Path(name).parts[:-1]:
        parent = parent / part
        if parent.exists() and not parent.is_dir():
            return True
    return False


def plan(staged: Path, target: Path, what: str, own: dict[str, dict],
         prune: bool = True) -> tuple[list[str], list[str]]:
    """``(replaced, stale)`` names in ``target``; drops optional files the user has; refuses foreign ones."""
    foreign, replaced = [], []
    for name in files_in(staged):
        if _blocked(target, name):
            foreign.append(name + "/" if (target / name).is_dir() else name)
        elif not os.path.lexists(target / name):
            continue
        elif is_ours(target, name, own):
            replaced.append(name)
        elif name in OPTIONAL:
            (staged / name).unlink()  # the user's README.md stays; the save's model card is left out
            logger.info("fastkit: %s: %s in %s is yours (not in %s); kept, the model card is not written",
                        what, name, target, MANIFEST)
        else:
            foreign.append(name)
    if foreign:
        raise FastkitError(f"{what}(path={str(target)!r}) would overwrite {len(foreign)} file(s) fastkit did not "
                           f"write (or that changed since): {foreign[:5]}{' ...' if len(foreign) > 5 else ''}. "
                           f"Nothing was changed. Move them away, or save into a new folder (fastkit replaces "
                           f"only the files its {MANIFEST} lists).")
    new = set(files_in(staged))
    stale = [n for n, e in own.items() if prune and e.get("by") == what and n not in new and is_ours(target, n, own)]
    return replaced, stale


def commit(staged: Path, target: Path, what: str, backup: Path, prune: bool = True) -> None:
    """Swap the files of ``staged`` into ``target`` (see the module docstring); ``backup`` is an empty folder.

    ``prune=False`` keeps an earlier save's files of the same kind (``save_gguf``: one .gguf per quantization)."""
    own = read_manifest(target) if target.is_dir() else {}
    if not target.exists():
        write_manifest(staged, entries_for(staged, what))
        os.replace(staged, target)  # a new folder: one rename
        return
    replaced, stale = plan(staged, target, what, own, prune)
    new_entries = entries_for(staged, what)
    moved_aside, moved_in = [], []
    try:
        for name in replaced + stale:
            _move(target / name, backup / name)
            moved_aside.append(name)
        for name in new_entries:
            _move(staged / name, target / name)
            moved_in.append(name)
        kept = {n: e for n, e in own.items() if n not in stale and n not in new_entries
                and os.path.lexists(target / n)}
        write_manifest(target, {**kept, **new_entries})
    except BaseException:
        for name in reversed(moved_in):
            os.remove(target / name)
        for name in reversed(moved_aside):
            _move(backup / name, target / name)
        raise
    _prune_empty(target, stale)
    if stale:
        logger.info("fastkit: %s: removed %d file(s) of its earlier save no longer written: %s", what, len(stale),
                    stale[:5])


def _move(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    os.replace(src, dst)


def _prune_empty(target: Path, names: list[str]) -> None:
    """Remove sub-folders emptied by removing stale files (only those; never the target itself)."""
    for name in names:
        parent = (target / name).parent
        while parent != target and parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()
            parent = parent.parent


__all__ = ["MANIFEST", "commit", "files_in", "read_manifest", "sha256", "write_manifest"]
