"""Package exports imported on first use (PEP 562), so that importing a package costs only what is used.

``import fastkit`` and the command line's ``--help`` / ``--print-config`` then import neither torch nor
transformers; ``from fastkit import FastModel`` imports the loader then. Used by the package ``__init__`` files.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable


def exports(namespace: dict, package: str, where: dict[str, str]) -> tuple[Callable, Callable]:
    """``(__getattr__, __dir__)`` for a package whose names ``where`` maps to their module (``"run"`` means
    ``<package>.run``; a dotted name is absolute). A name is imported when first asked for, then kept as a plain
    attribute of the package."""

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = where[name] if "." in where[name] else f"{package}.{where[name]}"
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(where))

    return __getattr__, __dir__
