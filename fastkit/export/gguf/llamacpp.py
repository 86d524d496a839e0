"""llama.cpp through llama-cpp-python: the one way fastkit loads a GGUF there (:func:`load`), and llama.cpp's own
quantizer run in a child process (:func:`quantize`).

Note: [portable llama.cpp]. A llama.cpp built for the machine it runs on (pip's default build) puts weights in the
CPU's "extra" buffer types: AMX tiles on Xeons that report AMX, repacked Q4_0 / IQ4 blocks elsewhere. On virtualised
Xeons that path crashes the process in the first decode (SIGSEGV in ``ggml_backend_amx_mul_mat``,
ggml-org/llama.cpp#20824; the q4_0 repack: #16479). Loaded without them (``llama_model_params.use_extra_bufts =
False``) llama.cpp runs its plain CPU kernels and answers the same, token for token, on every x86 CPU. llama-cpp-python
0.3.36's ``Llama(...)`` has no argument for that field (unknown keyword arguments are dropped); its constructor starts
from ``llama_cpp.llama_cpp.llama_model_default_params()``, so :func:`load` serves it defaults with the field off
while it constructs, and checks that the loaded model's parameters say so.

The quantizer (``llama_model_quantize``, the K-quants) runs in a child process: :func:`quantize` is called by
``save_gguf`` / ``export`` in the process (often a notebook's kernel) that holds the model just trained, and a crash
in llama.cpp there would lose it. A child that dies becomes one :class:`~fastkit.errors.FastkitError` line naming
the way out (the portable build, or q8_0 / q4_0, which fastkit writes itself): the CLI's exit 2. Not exit 3: a crash
in the user's llama.cpp build is neither fastkit's bug nor something fastkit can retry, while the user can fix it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from fastkit.errors import FastkitError
from fastkit.extras import install_line

logger = logging.getLogger(__name__)

INSTALL = install_line("llama_cpp")
PORTABLE = "docs/export.md, \"llama.cpp: the portable build\""
"""Where the portable llama-cpp-python build (the one CI tests) is spelled out."""

_DEFAULTS_LOCK = threading.Lock()


def require(what: str):
    """The ``llama_cpp`` module; a FastkitError naming ``what`` needs it and the install line when it is missing."""
    try:
        import llama_cpp
    except ImportError:
        raise FastkitError(f"{what} runs in llama.cpp, from llama-cpp-python, which is not installed: {INSTALL} "
                           f"({PORTABLE}).") from None
    return llama_cpp


def load(path, what: str, **kwargs):
    """``llama_cpp.Llama(model_path=path, verbose=False, **kwargs)`` without llama.cpp's extra CPU buffer types
    (Note: [portable llama.cpp]); ``what`` names the caller in the error when llama-cpp-python is missing."""
    llama_cpp = require(what)
    with _portable_defaults(getattr(llama_cpp, "llama_cpp", None)):
        llm = llama_cpp.Llama(model_path=str(path), verbose=False, **kwargs)
    params = getattr(llm, "model_params", None)
    if getattr(params, "use_extra_bufts", False):  # a llama-cpp-python that no longer builds on the defaults
        llm.close()
        raise RuntimeError("llama-cpp-python loaded the model with extra CPU buffer types (use_extra_bufts=True), "
                           "which crash on some CPUs: fastkit.export.gguf.llamacpp.load needs updating for it.")
    return llm


@contextlib.contextmanager
def _portable_defaults(binding):
    """While constructing a ``Llama``: ``binding.llama_model_default_params()`` with ``use_extra_bufts = False``."""
    original = getattr(binding, "llama_model_default_params", None)
    if original is None:  # a stand-in module (tests) without the C bindings
        yield
        return

    def portable():
        params = original()
        params.use_extra_bufts = False
        return params

    with _DEFAULTS_LOCK:
        binding.llama_model_default_params = portable
        try:
            yield
        finally:
            binding.llama_model_default_params = original


def quantize(source: Path, target: Path, ftype: int, threads: int, what: str) -> None:
    """llama.cpp's ``llama_model_quantize(source -> target, ftype)`` in a child process; its crash or failure as one
    FastkitError line (``what`` names the call: ``save_gguf(quantization='q4_k_m')``)."""
    require(what)
    done = subprocess.run(_child_command(source, target, ftype, threads), capture_output=True, text=True,
                          env=_child_env(), check=False)
    if done.returncode == 0 and target.exists():
        return
    target.unlink(missing_ok=True)
    raise FastkitError(failure_line(what, done.returncode, done.stderr))


def failure_line(what: str, returncode: int, stderr: str) -> str:
    """What a quantizer child that ended with ``returncode`` says: a crash (a signal) or llama.cpp's refusal."""
    way_out = (f"Nothing was saved; the model in memory is untouched. Reinstall llama-cpp-python as the portable "
               f"build ({PORTABLE}), or use 'q8_0' or 'q4_0' (written by fastkit itself, no llama.cpp).")
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"{what}: llama.cpp's quantizer crashed ({name}) in its own process. {way_out}"
    last = next((ln.strip() for ln in reversed(stderr.splitlines()) if ln.strip()), "")
    said = f": {last[:200]}" if last else ""
    return f"{what}: llama.cpp's quantizer failed (exit status {returncode}){said}. {way_out}"


def _child_command(source: Path, target: Path, ftype: int, threads: int) -> list[str]:
    return [sys.executable, "-m", __name__, str(source), str(target), str(ftype), str(threads)]


def _child_env() -> dict[str, str]:
    """This process's environment, with the folder this fastkit is imported from first on the child's path."""
    root = str(Path(__file__).resolve().parents[3])
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}


def _quantize_here(source: str, target: str, ftype: int, threads: int) -> int:
    """The child's work: llama.cpp's quantizer; its return code (0: written)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads
    return int(llama_cpp.llama_model_quantize(source.encode(), target.encode(), params))


if __name__ == "__main__":  # the quantizer child: SOURCE TARGET FTYPE THREADS
    source_, target_, ftype_, threads_ = sys.argv[1:5]
    sys.exit(1 if _quantize_here(source_, target_, int(ftype_), int(threads_)) else 0)


__all__ = ["INSTALL", "failure_line", "load", "quantize", "require"]
