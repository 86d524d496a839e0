"""The export menu's K-quants (llama.cpp's own quantizer) load and run in llama.cpp, from the API and from
``fastkit export``; ``fastkit chat`` runs a GGUF in llama.cpp with the template embedded in the file.

With CI=true a missing llama_cpp fails these tests (CI installs it: .ci/run, extra ``llamacpp``); elsewhere
they skip, as tests/test_llamacpp_round_trip.py does.
"""

from __future__ import annotations

import gguf
import pytest

from fastkit import cli
from fastkit.export import chat, export
from fastkit.export.gguf.writer import LLAMA_CPP_QUANTS, QUANTS
from tests import gguf_round_trip as rt
from tests.export_twin import trained_twin
from tests.helpers import require_llama_cpp


@pytest.fixture(scope="module")
def llama_cpp():
    return require_llama_cpp()


@pytest.fixture(scope="module")
def trained(tmp_path_factory, llama_cpp):
    return trained_twin(tmp_path_factory.mktemp("kquant_twin"))


@pytest.mark.slow
def test_menu_k_quants_load_and_run_in_llama_cpp(trained, tmp_path):
    model, tok, _ = trained
    quants = ["q4_k_m", "q5_k_m", "q6_k"]
    result = export(model, tok, tmp_path, lora=False, gguf=quants, name="kq")
    assert [a.quantization for a in result.artifacts] == quants and all(a.verified for a in result.artifacts)
    for q in quants:
        path = str(tmp_path / "gguf" / f"kq-{q}.gguf")
        file_type = int(gguf.GGUFReader(path).fields["general.file_type"].parts[-1][0])
        assert file_type == LLAMA_CPP_QUANTS[q], (q, file_type)  # llama.cpp's quantizer wrote it
        row = rt.check(path, model, tok, "llama", q)
        assert row.loads and row.tokens[0] == row.tokens[1] and row.template[0] == row.template[1], row.notes
        assert row.logits_delta <= QUANTS[q].tolerance * row.logits_scale, (q, row.logits_delta, row.logits_scale)
    assert (tmp_path / "gguf" / "Modelfile").read_text().startswith("FROM ./kq-q4_k_m.gguf\n")


@pytest.mark.slow
def test_cli_export_k_quant_then_chat_with_it(trained, capsys, monkeypatch, llama_cpp):
    model, tok, lora = trained
    seen = []  # the messages llama.cpp was asked to answer (the twin's greedy answer hardly depends on them)

    class Llama(llama_cpp.Llama):
        def create_chat_completion(self, messages, **kw):
            seen.append(messages)
            return super().create_chat_completion(messages=messages, **kw)

    monkeypatch.setattr(llama_cpp, "Llama", Llama)
    rc = cli.main(["export", "--model", str(lora), "--gguf", "f16", "q4_k_m", "--name", "chat-me"])
    out = capsys.readouterr().out
    assert rc == 0 and out.count(", verified)") == 2, out
    f16 = lora.parent / "gguf" / "chat-me-f16.gguf"
    want = chat(model, tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
                max_new_tokens=8, stream=False)
    rc = cli.main(["chat", "--model", str(f16), "--prompt", "Hello there", "--max-new-tokens", "8",
                   "--system", "Be brief."])
    assert seen == [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]]
    assert rc == 0 and capsys.readouterr().out.splitlines()[-1] == want  # llama.cpp, greedy, the embedded template
