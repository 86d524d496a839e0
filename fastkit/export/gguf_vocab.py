"""The tokenizer half of a GGUF (llama.cpp's ``tokenizer.*`` keys) and the Ollama ``Modelfile`` beside it.

A byte-level BPE tokenizer goes in as llama.cpp's ``gpt2`` model: tokens in id order (padded with
``[PAD<i>]`` up to the embedding rows), token types (added special tokens CONTROL, other added tokens
USER_DEFINED), merges, special ids, the add-BOS/EOS flags (read off an encoding, not an attribute),
the pre-tokenizer name llama.cpp knows the split rule by, and the chat template.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

# The split regexes of the tokenizer.json files llama.cpp knows by name (Llama-3, Qwen2/3: digits one at a time).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def _pre_parts(node) -> list[dict]:
    if isinstance(node, dict):
        return [node] + [p for v in node.values() for p in _pre_parts(v)]
    return [p for v in node for p in _pre_parts(v)] if isinstance(node, list) else []


def _pre_tokenizer(spec: dict) -> str:
    """llama.cpp's ``tokenizer.ggml.pre`` for this tokenizer's split rule ("default" = GPT-2's regex)."""
    parts = _pre_parts(spec.get("pre_tokenizer"))
    splits = {p["pattern"].get("Regex") for p in parts
              if p.get("type") == "Split" and isinstance(p.get("pattern"), dict)}
    if _QWEN2_SPLIT in splits:
        return "qwen2"
    if _LLAMA3_SPLIT in splits:
        return "llama-bpe"
    if any(p.get("type") == "Digits" and p.get("individual_digits") for p in parts):
        return "smollm"
    if splits:
        logger.warning("fastkit: unknown pre-tokenizer split %r; writing tokenizer.ggml.pre='default'", splits)
    return "default"


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


def add_tokenizer_kv(writer, tokenizer, spec: dict, vocab_size: int) -> None:
    tokens, types, merges = _vocab(tokenizer, spec, vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer(spec))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if merges:
        writer.add_token_merges(merges)
    else:  # gguf-py cannot write an empty array; scores let readers derive the (empty) merges instead
        logger.warning("fastkit: tokenizer has no BPE merges; llama.cpp needs them (transformers does not)")
        writer.add_token_scores([0.0] * len(tokens))
    for attr, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                      ("pad_token_id", writer.add_pad_token_id), ("unk_token_id", writer.add_unk_token_id)):
        if (token_id := getattr(tokenizer, attr, None)) is not None:
            add(token_id)
    ids = tokenizer("a")["input_ids"]
    writer.add_add_bos_token(bool(ids) and ids[0] == tokenizer.bos_token_id)
    writer.add_add_eos_token(bool(ids) and ids[-1] == tokenizer.eos_token_id and len(ids) > 1)
    if (template := chat_template(tokenizer)) is not None:
        writer.add_chat_template(template)


# -------------------------------------------------------------------------------------- Modelfile

_CHATML_GO = ('{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}'
              '<|im_start|>assistant\n')


def modelfile(tokenizer, gguf_name: str) -> str:
    """An Ollama ``Modelfile`` for ``gguf_name`` (in the same folder). A ChatML template (SmolLM2, Qwen) is
    written as Ollama's Go template, checked by rendering; any other template is left to Ollama, which
    reads the one embedded in the GGUF."""
    lines = [f"FROM ./{gguf_name}"]
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    try:
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception:  # no template / template errors: Ollama falls back to the embedded one
        rendered = None
    if rendered == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n":
        lines.append(f'TEMPLATE """{_CHATML_GO}"""')
        lines.append('PARAMETER stop "<|im_end|>"')
    elif tokenizer.eos_token:
        lines.append(f'PARAMETER stop "{tokenizer.eos_token}"')
    return "\n".join(lines) + "\n"


__all__ = ["add_tokenizer_kv", "chat_template", "modelfile"]
