"""GGUF through llama.cpp never kills the process (issue 54, item 1): every load goes through
``fastkit.export.gguf.llamacpp.load`` without llama.cpp's extra CPU buffer types (they crash on virtualised Xeons:
Note: [portable llama.cpp]), and the quantizer runs in a child process whose crash is one line, exit 2."""

from __future__ import annotations

import importlib.machinery
import signal
import sys
import types

import pytest

from fastkit import cli
from fastkit.export.gguf import llamacpp
from tests.export_twin import trained_twin


def _fake_llama_cpp(monkeypatch) -> types.ModuleType:
    """llama-cpp-python where it matters: ``Llama.__init__`` starts from ``llama_cpp.llama_model_default_params()``
    (whose default has the extra buffer types on) and keeps the result as ``model_params``."""
    binding = types.ModuleType("llama_cpp.llama_cpp")
    binding.llama_model_default_params = lambda: types.SimpleNamespace(use_extra_bufts=True, vocab_only=False)

    class Llama:
        def __init__(self, model_path, *, verbose=True, vocab_only=False, **kwargs):
            self.model_params = binding.llama_model_default_params()
            self.model_params.vocab_only = vocab_only
            self.model_path, self.kwargs = model_path, kwargs

        def close(self):
            pass

    package = types.ModuleType("llama_cpp")
    package.__spec__ = importlib.machinery.ModuleSpec("llama_cpp", None)  # importlib.util.find_spec sees it installed
    package.llama_cpp, package.Llama = binding, Llama
    monkeypatch.setitem(sys.modules, "llama_cpp", package)
    return package


def test_load_turns_the_extra_buffer_types_off(monkeypatch):
    fake = _fake_llama_cpp(monkeypatch)
    defaults = fake.llama_cpp.llama_model_default_params
    llm = llamacpp.load("m.gguf", "a test", n_ctx=64)
    assert llm.model_params.use_extra_bufts is False and llm.kwargs == {"n_ctx": 64}
    assert fake.llama_cpp.llama_model_default_params is defaults  # put back after the load
    assert fake.llama_cpp.llama_model_default_params().use_extra_bufts is True


def test_fastkit_chat_on_a_gguf_loads_it_portably(tmp_path, monkeypatch, capsys):
    fake = _fake_llama_cpp(monkeypatch)
    seen = []

    class Llama(fake.Llama):
        def create_chat_completion(self, messages, **kwargs):
            seen.append(self.model_params.use_extra_bufts)
            return {"choices": [{"message": {"content": "Lima."}}]}

    fake.Llama = Llama
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert cli.main(["chat", "--model", str(tmp_path / "m.gguf"), "--prompt", "Capital of Peru?"]) == 0
    assert seen == [False] and capsys.readouterr().out.strip() == "Lima."


def test_a_real_llama_cpp_loads_without_extra_buffer_types(tmp_path):
    from fastkit.export.gguf.writer import write_gguf
    from fastkit.families.twins import twin, twin_bpe_tokenizer
    from tests.helpers import require_llama_cpp

    require_llama_cpp()
    path = write_gguf(twin("llama"), twin_bpe_tokenizer("smollm"), tmp_path, quantization="f16")
    llm = llamacpp.load(path, "a test", n_ctx=32, n_threads=1)
    try:
        assert llm.model_params.use_extra_bufts is False
        assert len(llm.tokenize(b"Hello world", add_bos=False)) > 0
    finally:
        llm.close()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return trained_twin(tmp_path_factory.mktemp("portable_twin"))


def _crashing_child(source, target, ftype, threads) -> list[str]:
    return [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"]


def test_a_quantizer_crash_is_one_line_and_exit_2(trained, monkeypatch, capsys):
    """llama.cpp dying in the K-quant step (a SIGSEGV in the child) leaves fastkit export standing: exit 2 (the
    user's llama.cpp build, which the user can replace; not fastkit's bug), one line with the way out, no file."""
    _, _, lora = trained
    _fake_llama_cpp(monkeypatch)
    monkeypatch.setattr(llamacpp, "_child_command", _crashing_child)
    rc = cli.main(["export", "--model", str(lora), "--gguf", "q4_k_m", "--name", "crash"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "quantizer crashed (SIGSEGV) in its own process" in err and "portable build" in err and "'q8_0'" in err
    assert not list(lora.parent.glob("gguf/crash-*"))


def test_a_quantizer_refusal_names_llama_cpps_last_line():
    line = llamacpp.failure_line("save_gguf(quantization='q6_k')", 1, "llama_model_quantize: failed to quantize: "
                                 "tensor 'x' has wrong shape\n\n")
    assert line.startswith("save_gguf(quantization='q6_k'): llama.cpp's quantizer failed (exit status 1): "
                           "llama_model_quantize: failed to quantize: tensor 'x' has wrong shape. Nothing was saved")
    assert f"({signal.Signals.SIGILL.name})" in llamacpp.failure_line("w", -signal.SIGILL, "")


def test_the_documented_build_is_the_one_ci_tests():
    """docs/export.md's install command (README points to it) builds llama.cpp with .ci/run's CMAKE_ARGS."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    ci = re.search(r'CMAKE_ARGS="([^"]+)"', (root / ".ci" / "run").read_text())[1].replace("\\\n", " ").split()
    doc = re.search(r'CMAKE_ARGS="([^"]+)"', (root / "docs" / "export.md").read_text(), re.S)[1]
    assert doc.replace("\\\n", " ").split() == ci and "-DGGML_NATIVE=OFF" in ci
    assert "docs/export.md#llamacpp-the-portable-build" in (root / "README.md").read_text()
