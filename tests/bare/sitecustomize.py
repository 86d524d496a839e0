"""Make the notebook stack look uninstalled: on PYTHONPATH, this hides IPython, ipywidgets, matplotlib, Jupyter.

``tests/test_bare_install.py`` runs fastkit's terminal entry points with this folder first on PYTHONPATH.
Python imports ``sitecustomize`` at start-up; this one swaps the path finder for one that does not see the
packages below, so ``import IPython`` raises ModuleNotFoundError and ``importlib.util.find_spec("IPython")``
is None, exactly as in a virtual environment that never installed them (README's bare install). Every name
asked for is written to ``$FASTKIT_BLOCKED_LOG`` (one per line) when that is set, so a test can see that the
blocker was live.
"""

import os
import sys
from importlib.machinery import PathFinder

HIDDEN = frozenset({"IPython", "ipywidgets", "matplotlib", "jupyter", "jupyter_client", "jupyter_core",
                    "jupyterlab", "jupyterlab_widgets", "widgetsnbextension", "ipykernel", "notebook",
                    "nbformat", "nbclient"})


class HidingPathFinder(PathFinder):
    """The standard path finder, blind to :data:`HIDDEN` (and everything under them)."""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname.split(".", 1)[0] in HIDDEN:
            log = os.environ.get("FASTKIT_BLOCKED_LOG")
            if log:
                with open(log, "a") as f:
                    f.write(fullname + "\n")
            return None
        return super().find_spec(fullname, path, target)


sys.meta_path[:] = [HidingPathFinder if finder is PathFinder else finder for finder in sys.meta_path]
