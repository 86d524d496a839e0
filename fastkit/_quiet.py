"""The upstream warnings fastkit has made harmless, each named with its reason, filtered in one place.

Every entry matches one message from one upstream module (its logger or its ``warnings.warn`` call),
by a fixed text, never by level or category alone: anything else upstream says still shows. The
filters go in when fastkit is imported (before bitsandbytes / transformers modules log); datasets' progress
bars (tokenizing, TRL's labels and packing passes) are turned off where fastkit runs those passes
(:func:`quiet_progress_bars`), so fastkit's progress line is the only one; set
``FASTKIT_SHOW_UPSTREAM_WARNINGS=1`` to see them all again. Remove an entry when the upstream version that
emits it is no longer supported.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from dataclasses import dataclass


@dataclass(frozen=True)
class KnownWarning:
    """One upstream message that fastkit has made harmless."""

    source: str
    """The logger name (``logging``) or module (``warnings.warn``) that emits it."""
    text: str
    """A fixed piece of the message (matched as a substring for log records, as a prefix regex for warnings)."""
    reason: str
    """Why it is harmless under fastkit: what fastkit does instead, or why it does not apply."""
    category: type[Warning] | None = None
    """For ``warnings.warn`` messages: the warning class; None for a log record."""


KNOWN: tuple[KnownWarning, ...] = (
    KnownWarning(
        "bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward from kernels-community",
        "bitsandbytes 0.50 tries the optional `kernels` package for a faster CPU 4-bit GEMM at import and falls back "
        "to its own implementation; fastkit never runs 4-bit weights on a CPU (4-bit loads need CUDA), so nothing "
        "uses the missing kernel."),
    KnownWarning(
        "kernels._internals.hf_hub", "Skipping publisher trust check for",
        "transformers 5.25 requires the `kernels` package; bitsandbytes 0.50 asks it, at import, for a Hub kernel "
        "(kernels-community/quantization-bitsandbytes), and with HF_HUB_OFFLINE=1 kernels says it cannot check the "
        "publisher. Nothing is downloaded or run from it: the kernel is optional, and fastkit loads no Hub kernels."),
    KnownWarning(
        "transformers.modeling_utils", "`is_gradient_checkpointing` is deprecated",
        "PEFT 0.21 (peft_model.py, mixed_model.py) reads the deprecated transformers alias; the value is the same "
        "as is_activation_checkpointing, and fastkit sets up checkpointing itself (enable_checkpointing).",
        FutureWarning),
    KnownWarning(
        "transformers.trainer_utils", "mtime may not be reliable on this filesystem",
        "The Trainer sorts checkpoints by mtime and falls back to their step number when two were written in the "
        "same second (short runs, fast steps); the step number is the order fastkit wants anyway."),
    KnownWarning(
        "transformers.modeling_rope_utils", "The explicitly set RoPE scaling factor",
        "Only for fastkit's tiny twins: a twin shrinks max_position_embeddings, so the YaRN factor no longer "
        "equals max_position_embeddings / original_max_position_embeddings; transformers uses the explicit factor, "
        "the real checkpoint's. Real GPT-OSS configs agree (131072 / 4096 = 32)."),
    KnownWarning(
        "accelerate.accelerator", "The used dataset had no length",
        "accelerate 1.x logs it (as [RANK 0] ...) from gather_for_metrics at the end of an eval loop over a packed "
        "dataset without a length, e.g. on resume; the Trainer drops nothing there, and fastkit's eval loss is the "
        "Trainer's own mean."),
    KnownWarning(
        "gguf.gguf_writer", "This GGUF file is for",
        "gguf-py states the byte order of every file it writes (always little endian for fastkit); fastkit's own "
        "line names the file written."),
    KnownWarning(
        "gguf.gguf_writer", "Writing the following files:",
        "gguf-py lists the temporary .gguf.partial-... paths it writes beside the target; fastkit verifies and "
        "renames the file and logs the final path."),
    KnownWarning(
        "gguf.gguf_writer", ": n_tensors = ",
        "gguf-py's per-file line under 'Writing the following files:' (a temporary path and its byte count)."),
)
"""Everything fastkit filters. Nothing else is silenced."""
PROGRESS_BARS = "HF_DATASETS_DISABLE_PROGRESS_BARS"
"""datasets' switch for its per-``map`` progress bars (tokenizing, TRL's "Building labels", "Packing train
dataset"): off under fastkit, whose progress line / dashboard is the one progress display."""


class _DropKnown(logging.Filter):
    """Drops the log records of one logger whose message contains one of ``texts``."""

    def __init__(self, texts: tuple[str, ...]):
        super().__init__()
        self.texts = texts

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is not ours to hide
            return True
        return not any(t in message for t in self.texts)


_installed: dict[str, _DropKnown] = {}


def install() -> None:
    """Filter the :data:`KNOWN` messages (idempotent); a no-op under ``FASTKIT_SHOW_UPSTREAM_WARNINGS=1``."""
    if os.environ.get("FASTKIT_SHOW_UPSTREAM_WARNINGS") == "1":
        return
    by_logger: dict[str, list[str]] = {}
    for known in KNOWN:
        if known.category is not None:
            warnings.filterwarnings("ignore", message=_regex(known.text), category=known.category,
                                    module=_regex(known.source) + "$")
        else:
            by_logger.setdefault(known.source, []).append(known.text)
    for name, texts in by_logger.items():
        if name not in _installed:
            _installed[name] = _DropKnown(tuple(texts))
            logging.getLogger(name).addFilter(_installed[name])  # the module's own logger: nothing else touched


def quiet_progress_bars() -> None:
    """datasets' progress bars off (:data:`PROGRESS_BARS`), and transformers' (weights loading: the reloads that
    verify each save), called where fastkit runs datasets' passes
    (``check_dataset``, ``make_trainer``, the CLI); a no-op under ``FASTKIT_SHOW_UPSTREAM_WARNINGS=1`` or when the
    user set ``HF_DATASETS_DISABLE_PROGRESS_BARS`` themselves. The environment is left as it is (child processes
    and kernels see the user's own settings)."""
    if os.environ.get("FASTKIT_SHOW_UPSTREAM_WARNINGS") == "1" or PROGRESS_BARS in os.environ:
        return
    import datasets
    from transformers.utils import logging as hf_logging

    datasets.disable_progress_bars()
    hf_logging.disable_progress_bar()  # the verifying reloads of saves ("Loading weights", GGUF de-quantizing)


@contextlib.contextmanager
def datasets_reader_quiet():
    """While ``datasets`` reads a data file for fastkit: its progress bars off (:func:`quiet_progress_bars`) and
    its log quiet (a file it cannot read is logged there as an error, then read again by fastkit's Python
    reader, whose message names the line); the ``datasets`` logger's level is put back after."""
    quiet_progress_bars()
    if os.environ.get("FASTKIT_SHOW_UPSTREAM_WARNINGS") == "1":
        yield
        return
    log = logging.getLogger("datasets")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def uninstall() -> None:
    """Undo :func:`install` for the log filters (tests; ``warnings`` filters stay, as ``warnings`` has no undo)."""
    for name, flt in _installed.items():
        logging.getLogger(name).removeFilter(flt)
    _installed.clear()


def _regex(text: str) -> str:
    import re

    return re.escape(text)


install()  # on import, so `from fastkit import _quiet` first in fastkit/__init__.py is enough

__all__ = ["KNOWN", "PROGRESS_BARS", "KnownWarning", "datasets_reader_quiet", "install", "quiet_progress_bars",
           "uninstall"]
