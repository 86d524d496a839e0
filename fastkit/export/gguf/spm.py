"""SentencePiece-style vocabularies (Gemma, Llama-2, Mistral v0.1, Phi-3) as llama.cpp's ``llama`` (SPM) tokenizer.

What it replaces: nothing upstream; before it, save_gguf refused these tokenizers. It writes, from the HF
``tokenizer.json`` alone (no ``sentencepiece`` package, no ``tokenizer.model``): ``tokenizer.ggml.model = "llama"``,
the tokens in id order, a score per token, token types (``<0xNN>`` byte tokens BYTE, the unknown token UNKNOWN,
added special tokens CONTROL, other added tokens USER_DEFINED), and ``add_space_prefix``.

Why the scores are merge ranks. HF's BPE merges the adjacent pair of lowest *rank* in ``merges``; llama.cpp's SPM
tokenizer (``llm_tokenizer_spm_session`` in llama-vocab.cpp) merges any adjacent pair whose concatenation is a
token, highest *score* of that token first, leftmost on a tie. llama.cpp's own converter for a tokenizer.json
without tokenizer.model (``LlamaHfVocab``) writes -1000 for every token, so every merge ties and the leftmost
pair wins. Here a token's score is minus the rank of the first merge that makes it. The two tokenizers then
agree when (checked here, refused otherwise, before anything is written):

- every merge makes a token, and no merge involves a byte token;
- the merges making one token are consecutive in ``merges`` (so ranks and scores order pairs alike), or else
  llama.cpp itself tokenizes every token's text and a probe corpus as HF does (:func:`check_ids_in_llama_cpp`,
  run on the written file before it replaces anything; refused without llama-cpp-python). transformers' own
  conversion of a SentencePiece model breaks score ties by piece length, so real vocabularies interleave
  (Llama-2's runs of "▁"): on the real Llama-2 vocabulary (llama.cpp's ggml-vocab-llama-spm test file turned
  into a tokenizer.json by transformers' converter) the file fastkit writes gave llama.cpp's expected ids for
  47/47 of llama.cpp's own test texts and HF's ids for 35,628/35,628 corpus and fuzz texts;
- every way llama.cpp could build a token, i.e. a split of it into two parts that are tokens or single
  characters, is one of the merges (HF would not make it otherwise);
- all 256 byte tokens exist (llama.cpp's byte fallback looks them up and fails on a missing one);
- no added token strips the whitespace beside it (llama.cpp does that only for models it knows by name);
- the text reaches the BPE as llama.cpp prepares it: spaces replaced by "▁", a "▁" prepended at the start and
  after every special token, or never (``add_space_prefix``), and no split into words, or a split that no
  token crosses (no token with a "▁" after its first character).

tokenizer.json files converted from SentencePiece by transformers list every split of every token as a merge,
ordered by the token, so they meet the first three by construction. Residual: where two different merges make
the same token at overlapping places, HF takes the lower rank and llama.cpp the leftmost; the round trip's chat
corpus is the evidence that this does not show (tests/test_llamacpp_round_trip.py).

What must not change: llama.cpp's token ids equal the HF tokenizer's on that corpus for every SPM twin.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from fastkit.errors import FastkitError

SPACE = "\u2581"
"""SentencePiece's visible space, "▁"."""
BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]
"""Byte-fallback tokens, as tokenizers and llama.cpp (``byte_to_token``) spell them."""
_WAY_OUT = ("Export with save_merged and convert with llama.cpp's convert_hf_to_gguf.py (it reads tokenizer.model "
            "when the checkpoint has one).")


@dataclass(frozen=True)
class SpmLayout:
    """How the text reaches the BPE model, in llama.cpp's terms."""

    add_space_prefix: bool
    """A "▁" is put before the text and after every special token (``tokenizer.ggml.add_space_prefix``)."""
    split_words: bool
    """HF splits the text into words at "▁" before BPE (Metaspace ``split``); llama.cpp never does."""


def is_spm_style(spec: dict) -> bool:
    """A tokenizer.json of a SentencePiece-style BPE: byte fallback, and "▁" standing for the space."""
    model = spec.get("model", {})
    text = json.dumps([spec.get("normalizer"), spec.get("pre_tokenizer")], ensure_ascii=False)
    return model.get("type") == "BPE" and bool(model.get("byte_fallback")) and SPACE in text


def _refuse(why: str) -> FastkitError:
    return FastkitError(f"save_gguf: this SentencePiece-style tokenizer {why}; llama.cpp's SPM tokenizer would not "
                        f"give the token ids it was trained with. {_WAY_OUT}")


def _is(node, kind: str) -> bool:
    return isinstance(node, dict) and node.get("type") == kind


def _replaces_space(node) -> bool:
    return _is(node, "Replace") and node.get("pattern") == {"String": " "} and node.get("content") == SPACE


def _layout_from_normalizer(norm, pre) -> SpmLayout:
    steps = norm.get("normalizers", []) if _is(norm, "Sequence") else [norm]
    prefix = len(steps) == 2 and _is(steps[0], "Prepend") and steps[0].get("prepend") == SPACE
    if not (_replaces_space(steps[-1]) and (len(steps) == 1 or prefix)):
        raise _refuse(f"normalizes text as {json.dumps(norm, ensure_ascii=False)[:200]} (llama.cpp only replaces "
                      "spaces with '▁' and maybe prepends one)")
    # After the normalizer no space is left, so a Split on " " never splits (Gemma's tokenizer.json has one).
    if pre is not None and not (_is(pre, "Split") and pre.get("pattern") == {"String": " "}):
        raise _refuse(f"pre-tokenizes with {json.dumps(pre, ensure_ascii=False)[:200]}")
    return SpmLayout(add_space_prefix=prefix, split_words=False)


def _layout_from_metaspace(pre) -> SpmLayout:
    if not (_is(pre, "Metaspace") and pre.get("replacement") == SPACE):
        raise _refuse(f"pre-tokenizes with {json.dumps(pre, ensure_ascii=False)[:200]}")
    scheme = pre.get("prepend_scheme", "always" if pre.get("add_prefix_space", True) else "never")
    if scheme not in ("always", "never"):  # "first": only at the very start, llama.cpp also after special tokens
        raise _refuse(f"prepends '▁' with prepend_scheme={scheme!r} (llama.cpp prepends at the start and after "
                      "every special token, or never)")
    return SpmLayout(add_space_prefix=scheme == "always", split_words=bool(pre.get("split", True)))


def spm_layout(spec: dict) -> SpmLayout:
    """The :class:`SpmLayout` of a SentencePiece-style tokenizer.json; FastkitError for one llama.cpp cannot mirror."""
    norm, pre = spec.get("normalizer"), spec.get("pre_tokenizer")
    if norm is not None:
        return _layout_from_normalizer(norm, pre)
    return _layout_from_metaspace(pre)


def _pair(merge) -> tuple[str, str]:
    if isinstance(merge, str):
        left, _, right = merge.partition(" ")
        return left, right
    return merge[0], merge[1]


def spm_scores(spec: dict) -> dict[str, float]:
    """Each token's score for llama.cpp (minus the rank of the first merge making it; 0 for the rest), after
    checking that llama.cpp's score-ordered merging reproduces HF's rank-ordered one (the module docstring)."""
    model = spec["model"]
    vocab: dict[str, int] = model["vocab"]
    merges = [_pair(m) for m in model.get("merges", [])]
    if not merges:
        raise _refuse("has no merges")
    if missing := [b for b in BYTE_TOKENS if b not in vocab]:
        raise _refuse(f"lacks byte tokens {missing[:4]} (llama.cpp's byte fallback needs all 256)")
    bytes_ = set(BYTE_TOKENS)
    first: dict[str, int] = {}
    for rank, (left, right) in enumerate(merges):
        made = left + right
        if made not in vocab or left not in vocab or right not in vocab or left in bytes_ or right in bytes_:
            raise _refuse(f"has merge {left!r} + {right!r} (rank {rank}) that makes no token or joins byte tokens")
        first.setdefault(made, rank)
    _check_every_split_is_a_merge(vocab, set(merges), _added_ids(spec))
    return {token: -float(first[token]) if token in first else 0.0 for token in vocab}


def interleaved(spec: dict) -> list[str]:
    """Tokens made by merges that are not consecutive in ``merges`` (other tokens' merges between them): there
    llama.cpp's score order and HF's rank order can differ, so :func:`check_ids_in_llama_cpp` must pass."""
    out, seen, previous = [], set(), None
    for left, right in (_pair(m) for m in spec["model"].get("merges", [])):
        made = left + right
        if made != previous and made in seen:
            out.append(made)
        seen.add(made)
        previous = made
    return out


PROBE_TEXTS = (
    "Hello world", " Hello World!", "Hello, world! How's it going?", "   three spaces", "\t tab\n\n newline",
    "x = [1, 2, 3]  # a list\nprint(f\"{x!r}\")", "It's 3.14159 -- or $12,345.67 (approx.)", "naïve café Zürich 𝄞 ≈ Ω",
    "Привет, мир", "你好，世界", "🦙.cpp", "                ", "a" * 40, "<=>|~`^", "  leading and trailing  ",
)
"""Texts beyond every token's own text that :func:`check_ids_in_llama_cpp` tokenizes both ways."""


def check_ids_in_llama_cpp(path, tokenizer, spec: dict) -> None:
    """When :func:`interleaved` is not empty: llama.cpp (``vocab_only``) must give HF's ids for every token's text
    and :data:`PROBE_TEXTS`; FastkitError otherwise, or when llama-cpp-python is not installed."""
    tokens = interleaved(spec)
    if not tokens:
        return
    why = (f"makes {tokens[0]!r} (and {len(tokens) - 1} more) by merges that other merges separate, where "
           "llama.cpp's score order may differ from HF's rank order")
    from fastkit.export.gguf import llamacpp

    try:
        llamacpp.require("the check")
    except FastkitError:
        raise _refuse(f"{why}; fastkit checks such a file in llama.cpp itself, and llama-cpp-python is not "
                      f"installed ({llamacpp.INSTALL})") from None
    added = _added_ids(spec)
    words = [t.replace(SPACE, " ") for t, i in spec["model"]["vocab"].items()
             if i not in added and len(t) > 1 and t not in BYTE_TOKENS]
    texts = [*PROBE_TEXTS, *words]
    wanted = tokenizer(texts, add_special_tokens=False)["input_ids"]  # one batched call (256k tokens: Gemma)
    llm = llamacpp.load(path, "save_gguf's tokenizer check", vocab_only=True)
    try:
        for text, want in zip(texts, wanted):
            got = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
            if got != want:
                raise _refuse(f"{why}, and they do: llama.cpp splits {text[:40]!r} as {got[:8]}, HF as {want[:8]}")
    finally:
        llm.close()


def _added_ids(spec: dict) -> set[int]:
    return {a["id"] for a in spec.get("added_tokens", [])}


def _check_every_split_is_a_merge(vocab: dict[str, int], merges: set[tuple[str, str]], added: set[int]) -> None:
    """llama.cpp joins two adjacent symbols (tokens, or single characters, known or not) whenever the result is a
    token; HF only along its merges. Every such join must be a merge."""
    for token, token_id in vocab.items():
        if token_id in added or len(token) < 2:
            continue
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            joinable = (len(left) == 1 or left in vocab) and (len(right) == 1 or right in vocab)
            if joinable and (left, right) not in merges:
                raise _refuse(f"has token {token!r}, which llama.cpp would build from {left!r} + {right!r}, but "
                              "that is not one of its merges")


def check_spm(spec: dict) -> tuple[SpmLayout, dict[str, float]]:
    """Everything :func:`spm_layout` and :func:`spm_scores` refuse, and the word split no token may cross; returns
    the layout and the scores."""
    layout = spm_layout(spec)
    stripping = [a["content"] for a in spec.get("added_tokens", []) if a.get("lstrip") or a.get("rstrip")]
    if stripping:  # llama.cpp strips around special tokens only for models it recognises by name (Phi-3's)
        raise _refuse(f"strips whitespace around added tokens {stripping[:3]} (lstrip / rstrip), which llama.cpp "
                      "does not do for this file")
    scores = spm_scores(spec)
    if layout.split_words:
        added = _added_ids(spec)
        crossing = [t for t, i in spec["model"]["vocab"].items() if i not in added and SPACE in t[1:]]
        if crossing:
            raise _refuse(f"splits words at '▁' (Metaspace split=true) but has tokens across words, e.g. "
                          f"{crossing[:3]} (llama.cpp does not split)")
    return layout, scores


def add_spm_tokenizer_kv(writer, tokenizer, spec: dict, vocab_size: int) -> None:
    """``tokenizer.ggml.*`` of llama.cpp's ``llama`` (SPM) model; special ids, flags and template are the caller's."""
    import gguf

    layout, scores = check_spm(spec)
    kinds = gguf.TokenType
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    bytes_ = set(BYTE_TOKENS)
    unk = getattr(tokenizer, "unk_token_id", None)
    n = max(vocab_size, max(by_id) + 1)
    tokens, kind, score = [], [], []
    for i in range(n):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            kind.append(kinds.UNUSED)
        elif i == unk:
            kind.append(kinds.UNKNOWN)
        elif i in added:
            kind.append(kinds.CONTROL if added[i].special else kinds.USER_DEFINED)
        elif token in bytes_:
            kind.append(kinds.BYTE)
        else:
            kind.append(kinds.NORMAL)
        if token is not None:
            tokens.append(token)
        score.append(scores.get(token, 0.0) if token is not None else -1e9)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(score)
    writer.add_token_types([int(k) for k in kind])
    writer.add_add_space_prefix(layout.add_space_prefix)


__all__ = ["BYTE_TOKENS", "SPACE", "SpmLayout", "add_spm_tokenizer_kv", "check_spm", "is_spm_style", "spm_layout",
           "spm_scores"]
