"""Verified, atomic saves: the one mechanism behind ``save_lora``, ``save_merged`` and ``save_gguf``.

Every save (1) writes into a temporary sibling of its output (a hidden ``.<name>.partial-*`` folder
next to it), (2) reloads what was written with the reader its users have (transformers, PEFT, the
GGUF reader) and compares the logits on a probe batch with the in-memory model, and only then (3)
moves the files it wrote into the output folder (:mod:`fastkit.export.owned`: only files fastkit wrote
there before are replaced; every other file is kept byte-identical, and a save that would overwrite
one is refused, naming it). A crash, a Ctrl-C or a failed check at any point leaves the previous
output exactly as it was (and the partial folder removed). Output names are sanitized so nothing is
written outside the folder asked for, and nothing is saved into the folder the model was loaded from.

Tolerances (:data:`TOLERANCE`) are relative: ``max|Δlogit| <= tol * max|logit|``, the arithmetic noise of the
dtype compared (save_lora, save_merged; save_gguf compares the file's model on the exact weights, and each
tensor within its quantization's rounding: :mod:`fastkit.export.gguf.save`); the wrong exports this guards
against are off by 0.3-20x the scale.

What must not change: a save never reports success unless the reloaded output matched; the old
output is never touched before that; the in-memory model comes back in the train/eval mode it had.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from fastkit.errors import FastkitError

logger = logging.getLogger(__name__)

TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 4e-2}
"""Allowed ``max|Δlogit| / max|logit|`` between the reloaded output and the in-memory model, per saved dtype (a
GGUF's, per quantization: ``fastkit.export.gguf.quants.QUANTS``)."""

PARTIAL_PREFIX = ".fk-partial-"
"""Prefix of the temporary sibling a save writes into (short: a 255-byte folder name still fits beside it)."""


def safe_name(name: str, what: str = "name") -> str:
    """``name`` as a plain file stem: no folders, no ``..``, no newlines or quotes (Modelfile injection); letters
    of any script stay (a model folder named ``模型`` gives ``模型-q8_0.gguf``)."""
    if not isinstance(name, str) or not name.strip():
        raise FastkitError(f"{what} must be a non-empty string, got {name!r}.")
    clean = re.sub(r"[^\w.+-]+", "-", name.strip()).strip(".-")  # letters and digits of any script kept
    if not clean:
        raise FastkitError(f"{what}={name!r} has no letters or digits to name a file with; pass e.g. name='my-model'.")
    if clean != name:
        logger.info("fastkit: %s %r written as %r (folders, spaces and quotes removed)", what, name, clean)
    return clean


def output_folder(path: Path, what: str) -> Path:
    """The absolute output folder (``"."`` and ``~`` resolved); refuses a root or a name the file system cannot hold."""
    target = Path(os.path.abspath(path))
    if target.parent == target:
        raise FastkitError(f"{what}(path={str(path)!r}) is the root of a file system; pass a folder inside it.")
    if len(os.fsencode(target.name)) > 255:
        raise FastkitError(f"{what}: the folder name is {len(os.fsencode(target.name))} bytes; file systems allow "
                           "255. Pass a shorter name.")
    return target


def check_not_source(model: torch.nn.Module | None, path: Path, what: str) -> None:
    """Refuse to save into the folder ``model`` was loaded from (its weights would be overwritten or mixed)."""
    if model is None:
        return
    from fastkit.patching import unwrap

    source = source_folder(unwrap(model))
    if source is not None and os.path.exists(path) and os.path.samefile(source, path):
        raise FastkitError(f"{what}(path={str(path)!r}) is the folder this model was loaded from; a save there "
                           "would overwrite or mix with its weights. Save into another folder.")


def source_folder(base: torch.nn.Module) -> str | None:
    """The local folder the model's weights were read from (``config.name_or_path``), or None (Hub id, twin)."""
    name = str(getattr(getattr(base, "config", None), "name_or_path", "") or "")
    name = os.path.expanduser(name)
    if name and os.path.isfile(name):
        name = os.path.dirname(os.path.abspath(name))
    return name if name and os.path.isdir(name) else None


@contextmanager
def scratch_sibling(path: Path) -> Iterator[Path]:
    """An empty temporary folder beside ``path`` (same file system, so ``os.replace`` is a rename); removed after."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=PARTIAL_PREFIX, dir=path.parent))
    except PermissionError:  # "." in a folder whose parent is read-only: stage inside the folder itself
        if not path.is_dir():
            raise
        tmp = Path(tempfile.mkdtemp(prefix=PARTIAL_PREFIX, dir=path))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def short_write(exc: BaseException) -> bool:
    """numpy's ``tofile`` on a full disk: ``OSError("8192 requested and 5184 written")`` without an errno (the
    ENOSPC of the write that came up short is lost): a write that stopped early is a full disk (or a quota)."""
    import re

    return (isinstance(exc, OSError) and exc.errno is None
            and re.fullmatch(r"\d+ requested and \d+ written", str(exc).strip()) is not None)


def disk_full(exc: BaseException, file: Path, needed: int | None = None) -> FastkitError | None:
    """The FastkitError for a save that ran out of disk space (ENOSPC, or a quota's EDQUOT) writing ``file``, or None
    for any other error. The caller has removed the partial file; ``needed``: the bytes the file takes, if known."""
    import errno

    full = isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))
    if not (full or short_write(exc)):
        return None
    try:
        free = f"{shutil.disk_usage(file.parent if file.parent.exists() else Path.cwd()).free:,} bytes free now"
    except OSError:
        free = "free space unknown"
    size = f"it needs {needed:,} bytes" if needed else "its size is not known beforehand"
    why = exc.strerror if full and exc.strerror else f"a short write: {exc}" if not full else str(exc)
    name = file.name.removesuffix(".partial")
    return FastkitError(f"The disk is full: writing {name} stopped ({why}); {size}, {free} on "
                        f"{file.parent}'s disk. The partial file was removed; free space (or save elsewhere) and "
                        "save again.")


@contextmanager
def staged_folder(path: Path, what: str, model: torch.nn.Module | None = None, prune: bool = True) -> Iterator[Path]:
    """Yield an empty temporary folder; on success its files go into ``path`` as :func:`fastkit.export.owned.commit`
    says: only the files this save wrote (and an earlier save's, per the folder's manifest) are replaced."""
    from fastkit.export.owned import commit, read_manifest

    path = output_folder(path, what)
    check_not_source(model, path, what)
    if path.is_dir():
        read_manifest(path)  # an unreadable manifest is refused before any work
    with scratch_sibling(path) as tmp:
        out = tmp / "out"
        out.mkdir()
        yield out
        backup = tmp / "old"
        backup.mkdir()
        commit(out, path, what, backup, prune)


# -- verification --------------------------------------------------------------------------------------
def probe_ids(vocab_size: int, seed: int = 0) -> torch.Tensor:
    """A fixed probe batch, (2, 16) token ids spread over the whole vocabulary (resized rows included)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (2, 16), generator=g)  # (B, T)
    ids[0, -1] = vocab_size - 1  # the last row: a resized vocabulary saved with the old count shows here
    return ids


@torch.no_grad()
def logits_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """fp32 CPU logits of ``model`` on ``ids``, in eval mode (its mode restored)."""
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        return model(input_ids=ids.to(device), use_cache=False).logits.float().cpu()
    finally:
        model.train(was_training)


def compare_logits(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> float:
    """Raise unless ``got`` matches ``want`` within ``tol`` of the logit scale; returns the relative error."""
    if got.shape != want.shape:
        raise FastkitError(f"{what}: the output read back gives logits of shape {tuple(got.shape)}, the model in "
                           f"memory {tuple(want.shape)} (vocabulary size differs); nothing was replaced.")
    if not torch.isfinite(got).all():
        raise FastkitError(f"{what}: the output read back gives non-finite logits; nothing was replaced.")
    scale = want.abs().max().item() or 1.0
    err = (got - want).abs().max().item() / scale
    if not err <= tol:
        raise FastkitError(f"{what}: the output read back does not match the model in memory (max |Δlogit| "
                           f"{err:.3g} of the logit scale, allowed {tol:.3g}); it would load as a different model, "
                           "so nothing was replaced. This is a fastkit bug for this model: save_lora keeps the "
                           "adapters exactly.")
    return err


def host_ram_allows(n_bytes: int) -> bool:
    """True when reloading ``n_bytes`` of weights for the check fits in half of the free host RAM."""
    try:
        import psutil

        return n_bytes <= psutil.virtual_memory().available // 2
    except ImportError:  # no psutil: assume it fits
        return True


def should_verify(model: torch.nn.Module, dtype: torch.dtype | None, verify: bool | None, what: str) -> bool:
    """``verify=None`` (auto): check unless reloading the output would not fit in host RAM (logged)."""
    if verify is not None:
        if not isinstance(verify, bool):
            raise FastkitError(f"{what}(verify={verify!r}): give True, False or None (auto).")
        return verify
    size = torch.tensor([], dtype=dtype or torch.float16).element_size()
    n_bytes = sum(p.numel() for p in model.parameters()) * size
    if host_ram_allows(n_bytes):
        return True
    logger.warning("fastkit: %s not verified by reloading (%.1f GB of weights, not enough free host RAM); pass "
                   "verify=True to force it.", what, n_bytes / 1e9)
    return False


def verify_reload(model: torch.nn.Module, load: Callable[[], torch.nn.Module], tol: float, what: str,
                  reference: torch.Tensor | None = None) -> float:
    """Reload with ``load()`` and compare its probe logits with ``model``'s (or ``reference``); the error."""
    from fastkit.patching import unwrap

    ids = probe_ids(unwrap(model).get_input_embeddings().weight.shape[0])
    want = logits_of(model, ids) if reference is None else reference
    try:
        got = logits_of(load(), ids)
    except FastkitError:
        raise
    except Exception as exc:  # noqa: BLE001 -- whatever the reader says, the save is refused with it
        raise FastkitError(f"{what}: the output does not load back and run ({type(exc).__name__}: "
                           f"{str(exc)[:200]}); nothing was replaced.") from exc
    err = compare_logits(got, want, tol, what)
    logger.info("fastkit: %s verified: reloaded, max |Δlogit| %.2g of the logit scale", what, err)
    return err


__all__ = ["TOLERANCE", "check_not_source", "compare_logits", "logits_of", "output_folder", "probe_ids",
           "safe_name", "scratch_sibling", "should_verify", "source_folder", "staged_folder", "verify_reload"]
