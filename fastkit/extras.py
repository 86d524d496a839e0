"""The optional dependencies (pyproject.toml's extras): which extra installs each module a feature imports, and the
one check every command runs before its work starts (:func:`require`: a FastkitError naming the extra, the CLI's
exit 2). No torch here: the CLI's preflights import it.
"""

from __future__ import annotations

import importlib.util

from fastkit.errors import FastkitError

EXTRAS: dict[str, tuple[str, str]] = {
    "PIL": ("vision", "Pillow"),
    "gguf": ("gguf", "gguf"),
    "llama_cpp": ("llamacpp", "llama-cpp-python"),
    "matplotlib": ("notebook", "matplotlib"),
    "ipywidgets": ("notebook", "ipywidgets"),
    "lm_eval": ("eval", "lm-eval"),
}
"""module -> (the extra of ``fastkit-llm`` that installs it, its distribution name)."""


def installed(module: str) -> bool:
    """Whether ``module`` can be imported (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a half-imported module without a spec
        return False


def install_line(module: str) -> str:
    """``pip install 'fastkit-llm[EXTRA]'`` for ``module``."""
    return f"pip install 'fastkit-llm[{EXTRAS[module][0]}]'"


def require(module: str, what: str, instead: str = "") -> None:
    """A FastkitError when ``module`` is not installed: ``what`` needs it, the install line (``instead``: another
    way out, a sentence)."""
    if installed(module):
        return
    package = EXTRAS[module][1]
    raise FastkitError(f"{what} needs {package}, which is not installed: {install_line(module)}."
                       + (f" {instead}" if instead else ""))


__all__ = ["EXTRAS", "install_line", "installed", "require"]
