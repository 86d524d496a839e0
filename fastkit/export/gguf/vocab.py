"""The tokenizer half of a GGUF (llama.cpp's ``tokenizer.*`` keys) and the Ollama ``Modelfile`` beside it.

A byte-level BPE tokenizer goes in as llama.cpp's ``gpt2`` model: tokens in id order (padded with
``[PAD<i>]`` up to the embedding rows), token types (added special tokens CONTROL, other added tokens
USER_DEFINED), merges, special ids, the add-BOS/EOS flags (read off an encoding, not an attribute),
the pre-tokenizer name llama.cpp knows the split rule by, and the chat template.

The pre-tokenizer name (``tokenizer.ggml.pre``) is what decides how llama.cpp splits text before BPE;
transformers' GGUF reader ignores it, so only llama.cpp shows a wrong one. llama.cpp's converter
identifies it by hashing the tokenization of a fixed string against the models it has seen, which
names only vocabularies it has met. Here it is read off the tokenizer's own definition instead:
the ``pre_tokenizer`` of its tokenizer.json is reduced to the list of regex splits it applies (a
``Split``, a ``Digits`` rule, the GPT-2 regex inside ``ByteLevel(use_regex=True)``), and that list
is looked up in :data:`PRE_TOKENIZERS` (the splits llama.cpp's ``llama-vocab.cpp`` implements for
each name, in the original tokenizer.json spelling it quotes). Anything not in the table is refused
with the splits it found: a wrong name tokenizes differently from training without any error. Several llama.cpp
names share one split (``olmo`` is GPT-2's, ``exaone`` smollm's, ``glm4`` / ``lfm2`` / ``falcon-h1`` llama-bpe's);
the table holds one name per split, which llama.cpp tokenizes identically.

What must not change: for every name in the table, llama.cpp's token ids equal the HF tokenizer's on
the chat corpus of tests/test_llamacpp_round_trip.py (punctuation, quotes, code, numbers, emoji).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from fastkit import _hf
from fastkit.errors import FastkitError
from fastkit.export.gguf.spm import add_spm_tokenizer_kv, check_spm, is_spm_style

logger = logging.getLogger(__name__)

# The split regexes as tokenizer.json spells them (llama.cpp's llama-vocab.cpp quotes these originals).
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
"""The regex ``ByteLevel(use_regex=True)`` applies (GPT-2's)."""
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CONTRACTIONS +
               r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CONTRACTIONS +
               r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
DIGITS = r"\p{N}"
"""``Digits(individual_digits=True)``: every digit its own piece."""
DIGIT_RUNS = r"\p{N}+"
"""``Digits(individual_digits=False)``: a run of digits one piece."""
# DeepSeek's splits hold CR and LF themselves (tokenizer.json spells them with JSON's "\r\n" escapes, the regex
# sees the characters) and CJK / letter ranges as raw code points (written here as Python escapes).
_LINE_BREAK = "[\r\n]"
_DEEPSEEK_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK_LETTERS = (
    "A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481"
    "\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf"
    "\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d"
    "\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-"
    "\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113"
    "\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149"
    "\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b"
    "\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a"
    "\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-"
    "\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)
DEEPSEEK_LLM_SPLITS = (_LINE_BREAK, r"\s?[" + _DEEPSEEK_LETTERS + "]+",
                       r"\s?[!-/:-~" + "\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
                       r"\s+$", _DEEPSEEK_CJK, DIGITS)
r"""DeepSeek LLM 7B / 67B and DeepSeek-V2 (one 102400-token vocabulary): line breaks, Latin-Greek-Cyrillic-... letters,
ASCII and full-width punctuation, trailing spaces, CJK / Hangul runs, single digits. llama.cpp splits digit runs
(``\p{N}+``) instead: the same tokens for a vocabulary with no token of two digits (this one has none)."""
DEEPSEEK_CODER_SPLITS = (_LINE_BREAK, r"\s?\p{L}+", r"\s?\p{P}+", _DEEPSEEK_CJK, DIGITS)
DEEPSEEK_V3_SPLITS = (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
                      r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^""" + "\r\n"
                      + r"\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                      r"| ?[\p{P}\p{S}]+" + "[\r\n]*" + r"|\s*" + "[\r\n]+" + r"|\s+(?!\S)|\s+")
"""DeepSeek-V3 / R1: digit groups of three, CJK and kana runs, then one regex whose classes hold CR and LF
themselves."""


@dataclass(frozen=True)
class PreTokenizer:
    """One ``tokenizer.ggml.pre`` name and the split rule llama.cpp implements for it."""

    name: str
    """The value written to ``tokenizer.ggml.pre``."""
    splits: tuple[str, ...]
    """The regexes applied in order, each inside the pieces of the one before (tokenizer.json spelling)."""
    ignore_merges: bool = False
    """llama.cpp looks a whole piece up in the vocabulary before merging (tokenizer.json ``ignore_merges``)."""
    digit_runs: bool = False
    """llama.cpp keeps a run of digits one piece where the tokenizer splits single digits: the same tokens only for a
    vocabulary without a token of two digits (a retrained one with such tokens is refused)."""


PRE_TOKENIZERS = (
    PreTokenizer("gpt-2", (GPT2_SPLIT,)),
    PreTokenizer("smollm", (DIGITS, GPT2_SPLIT)),  # SmolLM / SmolLM2 (llama.cpp: same split as starcoder)
    PreTokenizer("llama-bpe", (LLAMA3_SPLIT,), ignore_merges=True),  # Llama-3.x
    PreTokenizer("dbrx", (LLAMA3_SPLIT,)),  # cl100k's split, merges always applied (DBRX, Phi-4)
    PreTokenizer("qwen2", (QWEN2_SPLIT,)),  # Qwen2 / Qwen2.5 / Qwen3
    PreTokenizer("qwen35", (QWEN35_SPLIT,)),  # Qwen3.5
    PreTokenizer("tekken", (TEKKEN_SPLIT,), ignore_merges=True),  # Mistral Nemo / Small 3
    PreTokenizer("gpt-4o", (GPT4O_SPLIT,)),  # o200k (gpt-oss)
    PreTokenizer("deepseek-llm", DEEPSEEK_LLM_SPLITS, digit_runs=True),  # DeepSeek LLM 7B / 67B, DeepSeek-V2
    PreTokenizer("deepseek-coder", DEEPSEEK_CODER_SPLITS),  # DeepSeek Coder 1.3B / 6.7B / 33B (v1)
    PreTokenizer("deepseek-v3", DEEPSEEK_V3_SPLITS),  # DeepSeek-V3 / V3.1 / R1 (deepseek_v3)
)
"""The pre-tokenizers save_gguf writes, looked up by their splits (and the merges rule)."""

# The inverse: a tokenizer.json pre_tokenizer for a name (for tokenizers rebuilt from a GGUF, whose
# reader in transformers drops tokenizer.ggml.pre and falls back to GPT-2's split).
_BYTE_LEVEL = {"type": _hf.BYTE_LEVEL, "add_prefix_space": False, "trim_offsets": True}


def _known(name: str) -> PreTokenizer:
    pre = next((p for p in PRE_TOKENIZERS if p.name == name), None)
    if pre is None:
        names = ", ".join(p.name for p in PRE_TOKENIZERS)
        raise FastkitError(f"pre-tokenizer {name!r} is not one fastkit knows ({names})")
    return pre


def _split_node(regex: str) -> dict:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


def pre_tokenizer_spec(name: str) -> dict:
    """The tokenizer.json ``pre_tokenizer`` llama.cpp's pre-tokenizer ``name`` stands for."""
    pre = _known(name)
    steps = []
    for regex in pre.splits:
        if regex in (DIGITS, DIGIT_RUNS):
            steps.append({"type": "Digits", "individual_digits": regex == DIGITS})
        elif regex == GPT2_SPLIT:
            steps.append(dict(_BYTE_LEVEL, use_regex=True))
        else:
            steps.append(_split_node(regex))
    if steps[-1]["type"] != _hf.BYTE_LEVEL:
        steps.append(dict(_BYTE_LEVEL, use_regex=False))
    return {"type": "Sequence", "pretokenizers": steps}


def pre_tokenizer_object(name: str):
    """:func:`pre_tokenizer_spec` as a ``tokenizers`` pre-tokenizer (to set on ``tokenizer.backend_tokenizer``)."""
    from tokenizers import Regex
    from tokenizers import pre_tokenizers as pt

    steps = []
    for step in pre_tokenizer_spec(name)["pretokenizers"]:
        if step["type"] == "Digits":
            steps.append(pt.Digits(individual_digits=step["individual_digits"]))
        elif step["type"] == "Split":
            steps.append(pt.Split(Regex(step["pattern"]["Regex"]), behavior="isolated", invert=False))
        else:
            steps.append(pt.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=step["use_regex"]))
    return pt.Sequence(steps)


def restore_pre_tokenizer(tokenizer, name: str) -> None:
    """Give a tokenizer rebuilt from a GGUF the split its ``tokenizer.ggml.pre`` names. transformers' GGUF reader
    ignores that key and always splits like GPT-2, so e.g. SmolLM2's digit rule is lost on the way in."""
    pre = _known(name)
    backend = tokenizer.backend_tokenizer
    backend.pre_tokenizer = pre_tokenizer_object(name)
    backend.model.ignore_merges = pre.ignore_merges


def gguf_pre_tokenizer(path: str) -> tuple[str, str]:
    """``(tokenizer.ggml.model, tokenizer.ggml.pre)`` of the GGUF at ``path`` (``""`` for a missing key); reads the
    header only."""
    from gguf import GGUFReader

    fields = GGUFReader(path, "r").fields

    def text(key: str) -> str:
        field = fields.get(key)
        return str(field.contents()) if field is not None else ""

    return text("tokenizer.ggml.model"), text("tokenizer.ggml.pre")


def restore_from_gguf(tokenizer, path: str) -> str | None:
    """Give a tokenizer transformers rebuilt from the GGUF at ``path`` the split the file names
    (:func:`restore_pre_tokenizer`); returns the name restored, or None (not a BPE vocabulary, or a name fastkit
    does not know: then it is logged, as the split may differ from the one the vocabulary was trained with)."""
    model, pre = gguf_pre_tokenizer(path)
    if model != "gpt2" or getattr(tokenizer, "backend_tokenizer", None) is None:
        return None
    if pre not in {p.name for p in PRE_TOKENIZERS}:
        logger.warning("fastkit: %s names pre-tokenizer %r, which fastkit does not know; the tokenizer splits text "
                       "like GPT-2 (transformers' GGUF reader ignores the name), maybe not as in training.", path, pre)
        return None
    restore_pre_tokenizer(tokenizer, pre)
    return pre


def _pre_steps(node) -> list[dict]:
    """A pre_tokenizer node flattened into its leaf steps, in order."""
    if not node:
        return []
    if node.get("type") == "Sequence":
        return [s for child in node.get("pretokenizers", []) for s in _pre_steps(child)]
    return [node]


def _splits(spec: dict) -> tuple[str, ...]:
    """The regex splits a tokenizer.json ``pre_tokenizer`` applies, in order; FastkitError for a step llama.cpp
    has no counterpart for."""
    out = []
    for step in _pre_steps(spec.get("pre_tokenizer")):
        kind = step.get("type")
        if kind == _hf.BYTE_LEVEL:
            if step.get("use_regex", True):
                out.append(GPT2_SPLIT)
            if step.get("add_prefix_space"):
                raise FastkitError("save_gguf: the tokenizer's ByteLevel pre-tokenizer adds a prefix space, which "
                                   "llama.cpp's BPE tokenizers never do; tokens would differ from training.")
        elif kind == "Digits":
            out.append(DIGITS if step.get("individual_digits") else DIGIT_RUNS)
        elif kind == "Split" and isinstance(step.get("pattern"), dict) and "Regex" in step["pattern"] \
                and step.get("behavior", "Isolated") == "Isolated" and not step.get("invert"):
            out.append(step["pattern"]["Regex"])
        else:
            raise FastkitError(f"save_gguf: the tokenizer's pre-tokenizer step {json.dumps(step)[:200]} has no "
                               "llama.cpp counterpart fastkit knows; tokens in llama.cpp would differ from training.")
    return tuple(out)


def _has_multi_digit_token(spec: dict) -> bool:
    """Whether the BPE vocabulary of tokenizer.json ``spec`` holds a token of two or more digits."""
    vocab = spec.get("model", {}).get("vocab", {})
    return any(len(token) > 1 and token.isdigit() for token in vocab)


def pre_tokenizer_name(spec: dict) -> str:
    """llama.cpp's ``tokenizer.ggml.pre`` for the tokenizer.json ``spec`` (FastkitError when none matches)."""
    splits = _splits(spec)
    ignore = bool(spec.get("model", {}).get("ignore_merges", False))
    for pre in PRE_TOKENIZERS:
        if pre.splits == splits and pre.ignore_merges == ignore:
            if pre.digit_runs and _has_multi_digit_token(spec):
                raise FastkitError(f"save_gguf: the tokenizer splits like llama.cpp's {pre.name!r} but its vocabulary "
                                   "has tokens of several digits, which llama.cpp's digit-run split would produce "
                                   "where training split single digits; tokens would differ from training.")
            return pre.name
    known = "; ".join(f"{p.name}: {list(p.splits)}" for p in PRE_TOKENIZERS)
    raise FastkitError(f"save_gguf: no llama.cpp pre-tokenizer splits text as this tokenizer does (its splits: "
                       f"{list(splits)}, ignore_merges={ignore}); llama.cpp would tokenize differently from training. "
                       f"Known: {known}. Export with save_merged and convert with llama.cpp's convert_hf_to_gguf.py "
                       "if llama.cpp knows this tokenizer.")


def _vocab(tokenizer, spec: dict, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """``(tokens, token types, merges)`` in id order, padded to the model's embedding rows."""
    import gguf

    kinds = gguf.TokenType
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    n = max(vocab_size, max(by_id) + 1)
    tokens, types = [], []
    for i in range(n):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(kinds.UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            types.append(kinds.CONTROL if added[i].special else kinds.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(kinds.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec.get("model", {}).get("merges", [])]
    return tokens, [int(t) for t in types], merges


def chat_template(tokenizer) -> str | None:
    """The tokenizer's chat template as one string (the ``default`` one of a named set)."""
    template = getattr(tokenizer, "chat_template", None)
    return template.get("default") if isinstance(template, dict) else template


def check_tokenizer(spec: dict) -> str:
    """Refuse what llama.cpp cannot load or would tokenize differently; returns the pre-tokenizer name ("" for a
    SentencePiece-style vocabulary, written as llama.cpp's SPM model by :mod:`fastkit.export.gguf.spm`)."""
    if is_spm_style(spec):
        check_spm(spec)
        return ""
    if not _hf.byte_level_bpe(spec):
        raise FastkitError("save_gguf: the tokenizer must be a fast byte-level BPE tokenizer (GPT-2 / Llama-3 / "
                           "Qwen / SmolLM / Phi-4 / gpt-oss style) or a SentencePiece-style BPE with byte fallback "
                           "(Gemma, Llama-2); pass the model's own AutoTokenizer, or export with save_merged and "
                           "llama.cpp's convert_hf_to_gguf.py.")
    if not spec.get("model", {}).get("merges"):
        raise FastkitError("save_gguf: the tokenizer is BPE without merges; llama.cpp refuses to load such a file "
                           "('cannot find tokenizer merges in model file'). Pass the tokenizer the model was "
                           "trained with (its tokenizer.json lists the merges).")
    return pre_tokenizer_name(spec)


def add_tokenizer_kv(writer, tokenizer, spec: dict, vocab_size: int) -> None:
    if is_spm_style(spec):
        add_spm_tokenizer_kv(writer, tokenizer, spec, vocab_size)
    else:
        pre = check_tokenizer(spec)
        tokens, types, merges = _vocab(tokenizer, spec, vocab_size)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
    for attr, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                      ("pad_token_id", writer.add_pad_token_id), ("unk_token_id", writer.add_unk_token_id)):
        if (token_id := getattr(tokenizer, attr, None)) is not None:
            add(token_id)
    ids = tokenizer("a")["input_ids"]
    writer.add_add_bos_token(bool(ids) and ids[0] == tokenizer.bos_token_id)  # = modelfile.adds_bos
    writer.add_add_eos_token(bool(ids) and ids[-1] == tokenizer.eos_token_id and len(ids) > 1)
    if (template := chat_template(tokenizer)) is not None:
        writer.add_chat_template(template)


__all__ = ["PRE_TOKENIZERS", "PreTokenizer", "add_tokenizer_kv", "chat_template", "check_tokenizer",
           "gguf_pre_tokenizer", "pre_tokenizer_name", "pre_tokenizer_object", "pre_tokenizer_spec",
           "restore_from_gguf", "restore_pre_tokenizer"]
