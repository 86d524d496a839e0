"""fastkit: notebook-first LLM fine-tuning with three exact speed-ups patched into transformers models.

    from fastkit import FastModel
    model, tokenizer = FastModel.from_pretrained("Qwen/Qwen3-0.6B", max_seq_length=2048)
    model = FastModel.get_peft_model(model, r=16)

Importing fastkit downloads nothing and patches nothing; patches apply per model instance. It filters
the few upstream warnings fastkit has made harmless, each named with its reason (fastkit._quiet).
"""

import logging as _logging

from fastkit import _quiet  # noqa: F401  (first: filters the named upstream warnings before those modules log)
from fastkit._lazy import exports as _exports
from fastkit.errors import FastkitError, GPUOnlyError

# The notebook API, imported when first used: ``import fastkit`` (and so every ``fastkit`` command, ``--help``
# included) imports neither torch nor transformers until a name that needs them is asked for.
_LAZY = {
    "FastModel": "fastkit.loader", "LoadReport": "fastkit.loader", "enable_checkpointing": "fastkit.loader",
    "report": "fastkit.loader", "HostWeights": "fastkit.patches.host", "host_stats": "fastkit.patches.host",
    "active_patches": "fastkit.patching", "apply_patch": "fastkit.patching", "revert": "fastkit.patching",
    "SyncCounter": "fastkit.syncs", "count_syncs": "fastkit.syncs",
    "require_chat_template": "fastkit.data.chat_template",
    "TrainOptions": "fastkit.training.options", "LoraOptions": "fastkit.training.options",
    "launch": "fastkit.distributed.launcher", "ranks": "fastkit.distributed", "evaluate": "fastkit.evaluation",
    "EvalOptions": "fastkit.evaluation",
}

__version__ = "0.1.0"

_logger = _logging.getLogger("fastkit")
if not _logger.handlers:  # like transformers: a default handler on the library logger, level set_verbosity
    _handler = _logging.StreamHandler()
    _handler.setFormatter(_logging.Formatter("%(message)s"))
    _logger.addHandler(_handler)
    _logger.setLevel(_logging.INFO)
    _logger.propagate = False


def set_verbosity(level: int | str) -> None:
    """Set how much fastkit logs: 'debug', 'info' (default), 'warning', 'error'."""
    _logger.setLevel(level.upper() if isinstance(level, str) else level)


def add_chat_template(model, tokenizer, source=None, **kwargs):
    """The tokenizer's own chat template, or one cloned from ``source`` (TRL); see fastkit.data.chat_template."""
    from fastkit.data.chat_template import add_chat_template as _add

    return _add(model, tokenizer, source, **kwargs)


def fit(trainer, **kwargs):
    """Train with the live dashboard (widget in a notebook, progress line elsewhere); see fastkit.training.fit."""
    from fastkit.training import fit as _fit

    return _fit(trainer, **kwargs)


__getattr__, __dir__ = _exports(globals(), "fastkit", _LAZY)


# ---- Old module paths users import (README / docs before the round-3 / round-4 moves), served by the new modules --
_MOVED = {
    "fastkit.twins": "fastkit.families.twins",
    "fastkit.census": "fastkit.families.census",
    "fastkit.trainer": "fastkit.training.trainer",
    "fastkit.chat_template": "fastkit.data.chat_template",
    "fastkit.linear_4bit": "fastkit.patches.moe.linear_4bit",
    # round 4: the GGUF writer became the package fastkit.export.gguf (the old module's names: its __init__)
    "fastkit.export.gguf_vocab": "fastkit.export.gguf.vocab",
    "fastkit.export.gguf_spm": "fastkit.export.gguf.spm",
    "fastkit.export.gguf_hybrid": "fastkit.export.gguf.hybrid",
    "fastkit.export.gguf_moe": "fastkit.export.gguf.moe",
    "fastkit.export.gguf_more": "fastkit.export.gguf.more",
    "fastkit.export.modelfile": "fastkit.export.gguf.modelfile",
    "fastkit.export.quants": "fastkit.export.gguf.quants",
    # round 5: the several-processes code in fastkit.distributed; the test-only seams beside the offload patch
    "fastkit.ranks": "fastkit.distributed.ranks",
    "fastkit.launcher": "fastkit.distributed.launcher",
    "fastkit.testing": "fastkit.patches.offload.testing",
}
"""Old path -> the module now there; ``import`` of an old path gives that very module (tests/test_public_paths.py)."""


class _MovedFinder:
    """Finds an old path of :data:`_MOVED` and loads it as the moved module itself (imported only when asked)."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        import importlib.util

        return importlib.util.spec_from_loader(name, _MovedFinder) if name in _MOVED else None

    @staticmethod
    def create_module(spec):
        import importlib

        module = importlib.import_module(_MOVED[spec.name])
        spec.loader_state = module.__spec__  # importlib sets __spec__ to the old path's: put the module's back
        return module

    @staticmethod
    def exec_module(module):
        """The moved module ran when it was imported; only its own ``__spec__`` is restored."""
        module.__spec__ = module.__spec__.loader_state


if not any(isinstance(f, type) and f.__name__ == "_MovedFinder" for f in __import__("sys").meta_path):
    __import__("sys").meta_path.append(_MovedFinder)

__all__ = [
    "EvalOptions", "FastModel", "FastkitError", "GPUOnlyError", "HostWeights", "LoadReport", "LoraOptions",
    "SyncCounter", "TrainOptions", "active_patches",
    "add_chat_template", "apply_patch", "count_syncs", "enable_checkpointing", "evaluate", "fit", "host_stats",
    "launch", "report",
    "require_chat_template", "revert", "set_verbosity",
]
