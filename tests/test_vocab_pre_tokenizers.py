"""Every pre-tokenizer name fastkit writes, checked on real vocabularies against llama.cpp's own tokenizer tests.

llama.cpp's repository carries, per pre-tokenizer it implements, a vocabulary-only GGUF of a real model
(``models/ggml-vocab-<name>.gguf``) and test texts with the ids the model's own Hugging Face tokenizer gives
(``.inp`` / ``.out``: tricky whitespace, digits, contractions, emoji, CJK, code). llama-cpp-python's source
package vendors them (``vendor/llama.cpp/models``); CI fetches it into ``.cache/lcpp-sdist`` (.ci/run, step 2) and
this test reads it from there (missing: skip; with CI=true, fail).

For each vocabulary whose split is one fastkit writes (fastkit's name for it: :data:`VOCABS`):

- the vocabulary rebuilt as a Hugging Face tokenizer with the split fastkit means by that name
  (``pre_tokenizer_object``, as ``restore_pre_tokenizer`` gives a tokenizer read back from a GGUF) tokenizes
  every test text to the expected ids, and fastkit reads the name back off that tokenizer (``pre_tokenizer_name``);
- fastkit's tokenizer writer (``add_tokenizer_kv``) puts it in a vocab-only GGUF that llama.cpp
  (``Llama(vocab_only=True)``) tokenizes to the same ids; llama.cpp's own file does too (the data fit this build).

Names fastkit writes with no such file here: ``dbrx``, ``tekken``, ``gpt-4o`` (their twins' round trips in
tests/test_llamacpp_round_trip.py are their proof), and ``deepseek-v3``: a real vocabulary (:data:`ROUND_TRIP`)
rebuilt with its split and written by fastkit tokenizes :data:`CORPUS` in llama.cpp to the HF tokenizer's ids.
``smollm`` has none of its own: llama.cpp splits it with the same regexes as ``starcoder``, ``refact`` and
``command-r``, whose files stand in; ``gpt-2`` also covers ``mpt``.
"""

from __future__ import annotations

import json
import os
import tarfile
from pathlib import Path

import gguf
import pytest

from fastkit.errors import FastkitError
from fastkit.export.gguf.vocab import (
    PRE_TOKENIZERS,
    add_tokenizer_kv,
    pre_tokenizer_name,
    pre_tokenizer_object,
    pre_tokenizer_spec,
)
from tests.helpers import require_llama_cpp

SDIST = "llama_cpp_python-0.3.36.tar.gz"
CACHE = Path(__file__).resolve().parents[1] / ".cache" / "lcpp-sdist"
VOCABS = {  # llama.cpp's test vocabulary -> the name fastkit writes for a tokenizer that splits as it does
    "gpt-2": "gpt-2", "mpt": "gpt-2", "llama-bpe": "llama-bpe", "qwen2": "qwen2", "qwen35": "qwen35",
    "starcoder": "smollm", "refact": "smollm", "command-r": "smollm",
    "deepseek-llm": "deepseek-llm", "deepseek-coder": "deepseek-coder",
}
SEP = "\n__ggml_vocab_test__\n"
ROUND_TRIP = {"deepseek-v3": "llama-bpe"}  # a name with no test vocabulary -> the real vocabulary its split runs over
CORPUS = (  # what a split can disagree on: digit groups, CJK and kana, emoji, contractions, code, breaks, spaces
    "Call 1234567 or +1 (555) 010-9999; pay $3.50, 12,345.678 or 1e-9 by 2024-05-06.",
    "中文分词测试，日本語のテキスト、カタカナとひらがな。한국어 문장도 있어요.",
    "Emoji 🙂🌊🦓 and 👨‍👩‍👧 with symbols €£¥ © ® ™ ∑ √ ½ ²³",
    "Don't, I'm, you're, we've, they'll, she'd; DON'T SHOUT, It'S FINE",
    "def f(x):\n    return x**2 + y[0] // 3  # comment\n\tif a <= b && c != d: pass\n",
    "lines\n\n\nwith breaks\r\nand CRLF\n  \n trailing   ",
    "multiple    spaces   between\twords and    \t mixed",
    "<div class='note'>a <= b | e ~ f</div> ~~~ !!! ??? ...",
    "naïve café résumé Ωμέγα Привет мир Ǆ ﬁ Ｆｕｌｌ ｗｉｄｔｈ！",
    "x=1;y=22;z=333;w=4444 v1.2.3 a1b2c3 abc123def",
)


@pytest.fixture(scope="module")
def vocab_dir(tmp_path_factory) -> Path:
    """The ggml-vocab files of :data:`VOCABS`, extracted from the llama-cpp-python sdist in one pass."""
    sdist = CACHE / SDIST
    if not sdist.is_file():
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"{sdist} is missing in CI: .ci/run (step 2) must fetch llama-cpp-python's sdist there")
        pytest.skip(f"{sdist} is not there (pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 "
                    f"-d {CACHE})")
    want = {f"ggml-vocab-{stem}.gguf{ext}" for stem in VOCABS for ext in ("", ".inp", ".out")}
    want |= {f"ggml-vocab-{stem}.gguf" for stem in ROUND_TRIP.values()}
    out = tmp_path_factory.mktemp("ggml-vocab")
    with tarfile.open(sdist) as tar:
        for member in tar:
            name = member.name.rsplit("/", 1)[-1]
            if name in want and "/vendor/llama.cpp/models/" in member.name:
                (out / name).write_bytes(tar.extractfile(member).read())
    missing = want - {p.name for p in out.iterdir()}
    assert not missing, f"not in {SDIST}: {sorted(missing)}"
    return out


def read_cases(inp: Path, out: Path) -> list[tuple[str, list[int]]]:
    """``(text, expected ids)`` pairs as llama.cpp's tests/test-tokenizer-0.cpp reads them."""
    raw = inp.read_bytes().decode()
    texts, pos = [], 0
    while pos < len(raw):
        nxt = raw.find(SEP, pos)
        if nxt < 0:
            texts.append(raw[pos:])
            break
        texts.append(raw[pos:nxt])
        pos = nxt + len(SEP)
    ids = [[int(t) for t in line.split()] for line in out.read_text().split("\n")[:len(texts)]]
    assert len(texts) == len(ids) > 10
    return list(zip(texts, ids, strict=True))


_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def read_kv(path: Path) -> dict[str, tuple[int, object, int | None]]:
    """The metadata of a GGUF file, ``key -> (GGUFValueType, value, array item type)`` (gguf-py's GGUFReader takes
    ~9 s per 50k-token vocabulary here; this reads the same header in a fraction of a second)."""
    import struct

    data, pos = path.read_bytes(), 0

    def take(fmt: str):
        nonlocal pos
        (value,) = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize("<" + fmt)
        return value

    def text() -> str:
        nonlocal pos
        n = take("Q")
        pos += n
        return data[pos - n:pos].decode("utf-8")

    def value(kind: int):
        return text() if kind == gguf.GGUFValueType.STRING else take(_SCALARS[kind])

    assert data[:4] == b"GGUF"
    pos = 8
    _, n_kv = take("Q"), take("Q")
    out = {}
    for _ in range(n_kv):
        key, kind = text(), take("I")
        if kind == gguf.GGUFValueType.ARRAY:
            sub, n = take("I"), take("Q")
            out[key] = (kind, [value(sub) for _ in range(n)], sub)
        else:
            out[key] = (kind, value(kind), None)
    return out


def hf_tokenizer(kv: dict, name: str):
    """A GGUF's vocabulary and merges (``kv``: :func:`read_kv`) as a Hugging Face byte-level BPE tokenizer that
    splits as fastkit's ``name`` says (control tokens special, user-defined tokens added)."""
    from tokenizers import AddedToken, Tokenizer, decoders
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    tokens, types = kv["tokenizer.ggml.tokens"][1], kv["tokenizer.ggml.token_type"][1]
    merges = [tuple(m.split(" ", 1)) for m in kv["tokenizer.ggml.merges"][1]]
    pre = next(p for p in PRE_TOKENIZERS if p.name == name)
    backend = Tokenizer(BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, ignore_merges=pre.ignore_merges))
    backend.pre_tokenizer = pre_tokenizer_object(name)
    backend.decoder = decoders.ByteLevel()
    kinds = gguf.TokenType
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types, strict=True) if k == kinds.CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types, strict=True) if k == kinds.USER_DEFINED])
    ids = {key: kv[f"tokenizer.ggml.{key}_token_id"][1] for key in ("bos", "eos")
           if f"tokenizer.ggml.{key}_token_id" in kv}
    return PreTrainedTokenizerFast(tokenizer_object=backend, **{f"{k}_token": tokens[i] for k, i in ids.items()})


def write_vocab_gguf(kv: dict, tokenizer, target: Path) -> None:
    """A source file's model metadata (``kv``: what a vocab-only load reads) with the tokenizer as fastkit writes it."""
    writer = gguf.GGUFWriter(str(target), kv["general.architecture"][1])
    for key, (kind, value, sub) in kv.items():
        if not key.startswith("tokenizer.") and key != "general.architecture":
            writer.add_key_value(key, value, gguf.GGUFValueType(kind),
                                 sub_type=None if sub is None else gguf.GGUFValueType(sub))
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    add_tokenizer_kv(writer, tokenizer, spec, len(tokenizer.get_vocab()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()


def _llama_ids(path: Path, cases) -> list[list[int]]:
    from fastkit.export.gguf import llamacpp

    llm = llamacpp.load(path, "the vocabulary", vocab_only=True)
    try:  # as test-tokenizer-0: no BOS/EOS added, special tokens not parsed
        return [llm.tokenize(text.encode(), add_bos=False, special=False) for text, _ in cases]
    finally:
        llm.close()


def _mismatches(got: list[list[int]], cases) -> list[str]:
    return [f"{text[:40]!r}: {g[:10]} vs {want[:10]}" for g, (text, want) in zip(got, cases, strict=True)
            if g != want]


@pytest.mark.parametrize("stem", list(VOCABS))
def test_fastkit_split_reproduces_llama_cpp_tokenizer_tests(vocab_dir, tmp_path, stem):
    require_llama_cpp()
    name = VOCABS[stem]
    source = vocab_dir / f"ggml-vocab-{stem}.gguf"
    cases = read_cases(source.with_name(source.name + ".inp"), source.with_name(source.name + ".out"))
    kv = read_kv(source)
    tokenizer = hf_tokenizer(kv, name)
    assert pre_tokenizer_name(json.loads(tokenizer.backend_tokenizer.to_str())) == name
    hf = [tokenizer(text, add_special_tokens=False)["input_ids"] for text, _ in cases]
    assert not _mismatches(hf, cases), (stem, name, _mismatches(hf, cases)[:3])
    assert not _mismatches(_llama_ids(source, cases), cases)  # llama.cpp's own file: the data fit this build
    written = tmp_path / f"fastkit-{stem}.gguf"
    write_vocab_gguf(kv, tokenizer, written)
    assert read_kv(written)["tokenizer.ggml.pre"][1] == name
    got = _llama_ids(written, cases)
    assert not _mismatches(got, cases), (stem, name, _mismatches(got, cases)[:3])


@pytest.mark.parametrize("name", list(ROUND_TRIP))
def test_split_without_test_vocabulary_round_trips_through_llama_cpp(vocab_dir, tmp_path, name):
    """A name llama.cpp has no test vocabulary for: a real vocabulary rebuilt with fastkit's split for it, written by
    fastkit into a vocab-only GGUF, tokenizes :data:`CORPUS` in llama.cpp to the Hugging Face tokenizer's ids."""
    require_llama_cpp()
    kv = read_kv(vocab_dir / f"ggml-vocab-{ROUND_TRIP[name]}.gguf")
    tokenizer = hf_tokenizer(kv, name)
    assert pre_tokenizer_name(json.loads(tokenizer.backend_tokenizer.to_str())) == name
    cases = [(text, tokenizer(text, add_special_tokens=False)["input_ids"]) for text in CORPUS]
    written = tmp_path / f"fastkit-{name}.gguf"
    write_vocab_gguf(kv, tokenizer, written)
    assert read_kv(written)["tokenizer.ggml.pre"][1] == name
    got = _llama_ids(written, cases)
    assert not _mismatches(got, cases), (name, _mismatches(got, cases)[:3])


def test_digit_run_split_refuses_a_vocabulary_with_multi_digit_tokens():
    """deepseek-llm's tokenizer splits single digits, llama.cpp digit runs: equal only without tokens like "12"."""
    spec = {"pre_tokenizer": pre_tokenizer_spec("deepseek-llm"), "model": {"vocab": {"1": 0, "2": 1}}}
    assert pre_tokenizer_name(spec) == "deepseek-llm"
    spec["model"]["vocab"]["12"] = 2
    with pytest.raises(FastkitError, match="several digits"):
        pre_tokenizer_name(spec)
