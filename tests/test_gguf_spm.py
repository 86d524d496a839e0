"""SentencePiece-style vocabularies in the GGUF (fastkit/export/gguf_spm.py), without llama.cpp: what the file says
(llama.cpp's SPM model, scores from merge ranks, token types, the space prefix) and what is refused. That llama.cpp
then tokenizes as HF does is tests/test_llamacpp_round_trip.py's SPM rows."""

from __future__ import annotations

import copy
import json

import gguf
import pytest

from fastkit import FastkitError
from fastkit.export.gguf import save_gguf
from fastkit.export.gguf_spm import check_spm, spm_layout, spm_scores
from fastkit.twins import twin, twin_spm_tokenizer
from tests.gguf_round_trip import texts_raw


def _spec(tokenizer) -> dict:
    return json.loads(tokenizer.backend_tokenizer.to_str())


@pytest.fixture(scope="module")
def gemma_tok():
    return twin_spm_tokenizer(space_prefix=False, corpus=tuple(texts_raw()))


@pytest.mark.parametrize("space_prefix", [False, True])
def test_spm_file_has_scores_from_merge_ranks_and_token_types(tmp_path, space_prefix):
    tok = twin_spm_tokenizer(space_prefix=space_prefix, corpus=tuple(texts_raw()))
    path = save_gguf(twin("llama", vocab_size=640), tok, tmp_path, quantization="f16")
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
    moved = copy.deepcopy(spec)  # the merges making one token apart: a score cannot order them like ranks
    merges = moved["model"]["merges"]
    i = merges.index(["a", "re"])
    merges.append(merges.pop(i))
    with pytest.raises(FastkitError, match="with other merges between"):
        spm_scores(moved)
    no_bytes = copy.deepcopy(spec)
    del no_bytes["model"]["vocab"]["<0x41>"]
    with pytest.raises(FastkitError, match="byte tokens"):
        spm_scores(no_bytes)
    stripping = copy.deepcopy(spec)
    stripping["added_tokens"][-1]["rstrip"] = True
    with pytest.raises(FastkitError, match="rstrip"):
        check_spm(stripping)


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
        save_gguf(twin("llama", vocab_size=640), tok, tmp_path / "out", quantization="f16")
    assert not (tmp_path / "out").exists()
