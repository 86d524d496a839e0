"""SentencePiece-style vocabularies in the GGUF (fastkit/export/gguf/spm.py), without llama.cpp: what the file says
(llama.cpp's SPM model, scores from merge ranks, token types, the space prefix) and what is refused. That llama.cpp
then tokenizes as HF does is tests/test_llamacpp_round_trip.py's SPM rows."""

from __future__ import annotations

import copy
import json

import gguf
import pytest

from fastkit import FastkitError
from fastkit.export.gguf.spm import check_spm, interleaved, spm_layout, spm_scores
from fastkit.export.gguf.writer import write_gguf
from fastkit.families.twins import twin, twin_spm_tokenizer
from tests.gguf_round_trip import texts_raw


def _spec(tokenizer) -> dict:
    return json.loads(tokenizer.backend_tokenizer.to_str())


@pytest.fixture(scope="module")
def gemma_tok():
    return twin_spm_tokenizer(space_prefix=False, corpus=tuple(texts_raw()))


@pytest.mark.parametrize("space_prefix", [False, True])
def test_spm_file_has_scores_from_merge_ranks_and_token_types(tmp_path, space_prefix):
    tok = twin_spm_tokenizer(space_prefix=space_prefix, corpus=tuple(texts_raw()))
    path = write_gguf(twin("llama", vocab_size=640), tok, tmp_path, quantization="f16")
    fields = gguf.GGUFReader(path).fields

    def values(key):
        f = fields[key]
        return [f.contents(i) for i in range(len(f.data))] if len(f.data) > 1 else f.contents()

    assert values("tokenizer.ggml.model") == "llama"
    assert values("tokenizer.ggml.add_space_prefix") is space_prefix
    assert "tokenizer.ggml.merges" not in fields and "tokenizer.ggml.pre" not in fields
    tokens, scores, types = (values(f"tokenizer.ggml.{k}") for k in ("tokens", "scores", "token_type"))
    assert len(tokens) == len(scores) == len(types) == 640
    ids = tok.get_vocab()
    kinds = gguf.TokenType
    assert types[ids["<0x41>"]] == kinds.BYTE and types[ids["<unk>"]] == kinds.UNKNOWN
    assert types[ids["<start_of_turn>"]] == kinds.CONTROL and types[ids["fine"]] == kinds.NORMAL
    assert types[639] == kinds.UNUSED  # padding rows past the vocabulary
    first = {}
    for rank, (left, right) in enumerate(_spec(tok)["model"]["merges"]):
        first.setdefault(left + right, rank)
    assert first and all(scores[ids[t]] == -rank for t, rank in first.items())  # minus the first rank making t
    assert values("tokenizer.ggml.add_bos_token") is True  # the twin's post-processor adds <bos>, as Gemma's


def test_layouts_llama_cpp_can_mirror(gemma_tok):
    spec = _spec(gemma_tok)
    assert spm_layout(spec).add_space_prefix is False
    spec["pre_tokenizer"] = {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious",
                             "invert": False}  # Gemma's tokenizer.json: after Replace, it never splits
    assert spm_layout(spec).add_space_prefix is False
    meta = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": False}
    assert spm_layout(dict(spec, normalizer=None, pre_tokenizer=meta)).add_space_prefix is True
    with pytest.raises(FastkitError, match="prepend_scheme='first'"):
        spm_layout(dict(spec, normalizer=None, pre_tokenizer=dict(meta, prepend_scheme="first")))
    with pytest.raises(FastkitError, match="normalizes text"):
        spm_layout(dict(spec, normalizer={"type": "NFKC"}))
    # split=True: HF never merges across words; llama.cpp would, into a token like "x▁" the twin has.
    with pytest.raises(FastkitError, match="tokens across words"):
        check_spm(dict(spec, normalizer=None, pre_tokenizer=dict(meta, split=True)))


def test_vocabularies_llama_cpp_would_merge_differently_are_refused(gemma_tok):
    spec = _spec(gemma_tok)
    check_spm(spec)
    short = copy.deepcopy(spec)  # a split of a token that is not a merge: llama.cpp would build it, HF not
    short["model"]["merges"] = [m for m in short["model"]["merges"] if m != ["a", "re"]]
    assert ["a", "re"] in spec["model"]["merges"]  # "are" is also "ar" + "e"
    with pytest.raises(FastkitError, match="would build from 'a' \\+ 're'"):
        spm_scores(short)
    moved = _moved(spec)  # the merges making one token apart: a score cannot order them like ranks
    assert interleaved(spec) == [] and interleaved(moved) == ["are"]  # so the file is checked in llama.cpp
    no_bytes = copy.deepcopy(spec)
    del no_bytes["model"]["vocab"]["<0x41>"]
    with pytest.raises(FastkitError, match="byte tokens"):
        spm_scores(no_bytes)
    stripping = copy.deepcopy(spec)
    stripping["added_tokens"][-1]["rstrip"] = True
    with pytest.raises(FastkitError, match="rstrip"):
        check_spm(stripping)


def _moved(spec: dict) -> dict:
    moved = copy.deepcopy(spec)
    merges = moved["model"]["merges"]
    merges.append(merges.pop(merges.index(["a", "re"])))  # "are" is also made earlier, by "ar" + "e"
    return moved


def _tokenizer_from(spec: dict, like):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), bos_token=like.bos_token,
                                  eos_token=like.eos_token, unk_token=like.unk_token, pad_token=like.pad_token)
    tok.chat_template = like.chat_template
    return tok


class _FakeLlama:
    """llama_cpp.Llama(vocab_only=True) that splits every text one id off HF's (a vocabulary llama.cpp misreads)."""

    def __init__(self, model_path, vocab_only, verbose):
        assert vocab_only

    def tokenize(self, text: bytes, add_bos: bool, special: bool) -> list[int]:
        return [0] + list(text)[:3]

    def close(self):
        pass


def test_merges_llama_cpp_may_order_differently_are_checked_in_llama_cpp(tmp_path, gemma_tok, monkeypatch):
    """Interleaved merges (real Llama-2's runs of "▁" are so) are written only when llama.cpp itself gives HF's
    ids; without llama-cpp-python they are refused. Nothing is left behind either way."""
    import sys
    import types

    tok = _tokenizer_from(_moved(_spec(gemma_tok)), gemma_tok)
    model = twin("llama", vocab_size=640)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # not installed
    with pytest.raises(FastkitError, match="llama-cpp-python is not installed"):
        write_gguf(model, tok, tmp_path / "a", quantization="f16")
    assert not list((tmp_path / "a").glob("*.gguf*"))
    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=_FakeLlama))  # it splits otherwise
    with pytest.raises(FastkitError, match="and they do: llama.cpp splits 'Hello world'"):
        write_gguf(model, tok, tmp_path / "b", quantization="f16")
    assert not list((tmp_path / "b").glob("*.gguf*"))
    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=None))  # grouped merges: not asked
    assert write_gguf(model, gemma_tok, tmp_path / "c", quantization="f16").endswith(".gguf")


def test_interleaved_merges_that_llama_cpp_orders_alike_export(tmp_path, gemma_tok):
    """The real client: the moved merge changes no split, so llama.cpp agrees and the file is written."""
    pytest.importorskip("llama_cpp")
    tok = _tokenizer_from(_moved(_spec(gemma_tok)), gemma_tok)
    path = write_gguf(twin("llama", vocab_size=640), tok, tmp_path, quantization="f16")
    assert path.endswith(".gguf")


def test_bpe_trained_with_byte_fallback_is_refused(tmp_path):
    """A BPE learned by tokenizers' trainer lists only the merges it learned, not every split: refused at save."""
    from tokenizers import Tokenizer, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    backend.normalizer = normalizers.Replace(" ", "▁")
    alphabet = [f"<0x{b:02X}>" for b in range(256)]
    backend.train_from_iterator(texts_raw() * 4, trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", *alphabet], show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<unk>")
    with pytest.raises(FastkitError, match="not one of its merges"):
        write_gguf(twin("llama", vocab_size=640), tok, tmp_path / "out", quantization="f16")
    assert not (tmp_path / "out").exists()
