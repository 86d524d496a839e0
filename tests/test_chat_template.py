"""add_chat_template: a base tokenizer gets an instruct sibling's template through TRL's clone_chat_template."""

from __future__ import annotations

import pytest

from fastkit import FastkitError, add_chat_template
from fastkit.families.twins import twin, twin_tokenizer


def test_keeps_the_tokenizers_own_template():
    model, tok = twin("llama", num_hidden_layers=1), twin_tokenizer()
    before = tok.chat_template
    same_model, same_tok = add_chat_template(model, tok, "/nonexistent")  # never read: the template is there
    assert same_tok.chat_template == before and same_model is model


def test_clones_a_template_from_a_local_source(tmp_path):
    source = twin_tokenizer()
    source.save_pretrained(tmp_path / "instruct")
    model, base = twin("llama", num_hidden_layers=1), twin_tokenizer()
    base.chat_template = None
    with pytest.raises(FastkitError, match="add_chat_template"):
        add_chat_template(model, base)  # no template, no source: the message says what to call
    model, tok = add_chat_template(model, base, str(tmp_path / "instruct"))
    assert tok.chat_template == source.chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "<|im_start|>user" in text
    assert model.get_input_embeddings().weight.shape[0] >= len(tok)  # embeddings cover the vocabulary


def test_unreadable_source_is_a_clear_error(tmp_path):
    model, base = twin("llama", num_hidden_layers=1), twin_tokenizer()
    base.chat_template = None
    with pytest.raises(FastkitError, match="could not read a tokenizer"):
        add_chat_template(model, base, str(tmp_path / "missing"))
