"""chat(): streams tokens, forwards chat-template options and sampling settings, restores the model's state,
and answers the same with fastkit's patches on as without them."""

import copy

import pytest
import torch

from fastkit import FastModel, active_patches, revert
from fastkit.export import chat
from fastkit.patching import unwrap

# ChatML plus the two options chat() forwards: Qwen3's enable_thinking and GPT-OSS's reasoning_effort.
TEMPLATE = (
    "{% if reasoning_effort is defined %}{{ '<|im_start|>system\nReasoning: ' + reasoning_effort + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}"
)


@pytest.fixture(scope="module")
def model_and_tokenizer():
    model, tok = FastModel.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct", max_seq_length=128, twin=True)
    return model, tok


def _spy_generate(model, monkeypatch):
    calls = []
    generate = model.generate

    def spy(**kwargs):
        calls.append(dict(kwargs, training=model.training, use_cache_config=unwrap(model).config.use_cache))
        return generate(**kwargs)

    monkeypatch.setattr(model, "generate", spy)
    return calls


def test_template_options_and_sampling_are_forwarded(model_and_tokenizer, monkeypatch):
    model, tok = model_and_tokenizer
    tok = copy.deepcopy(tok)
    tok.chat_template = TEMPLATE
    calls = _spy_generate(model, monkeypatch)
    chat(model, tok, "hi", max_new_tokens=3, enable_thinking=False, reasoning_effort="high", stream=False)
    prompt = tok.decode(calls[0]["input_ids"][0])
    assert prompt.startswith("<|im_start|>system\nReasoning: high<|im_end|>")
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert calls[0]["do_sample"] is False and "temperature" not in calls[0] and calls[0]["max_new_tokens"] == 3
    chat(model, tok, "hi", max_new_tokens=2, temperature=0.7, top_p=0.9, stream=False,
         chat_template_kwargs={"reasoning_effort": "low"})
    assert "Reasoning: low" in tok.decode(calls[1]["input_ids"][0])
    assert (calls[1]["do_sample"], calls[1]["temperature"], calls[1]["top_p"]) == (True, 0.7, 0.9)


def test_streams_the_answer_it_returns(model_and_tokenizer, capsys):
    model, tok = model_and_tokenizer
    answer = chat(model, tok, "hi", max_new_tokens=6, stream=True)
    assert capsys.readouterr().out.strip() == answer
    chat(model, tok, "hi", max_new_tokens=6)  # outside a notebook: no streaming by default
    assert capsys.readouterr().out == ""


def test_restores_train_mode_and_use_cache(model_and_tokenizer, monkeypatch):
    model, tok = model_and_tokenizer
    config = unwrap(model).config
    model.train()
    config.use_cache = False  # what make_trainer leaves behind
    calls = _spy_generate(model, monkeypatch)
    try:
        chat(model, tok, "hi", max_new_tokens=2, stream=False)
        assert calls[0]["use_cache"] is True and calls[0]["training"] is False
        assert model.training and config.use_cache is False
    finally:
        model.eval()
        config.use_cache = True


def test_patched_model_answers_like_plain_transformers(model_and_tokenizer):
    model, tok = model_and_tokenizer
    assert "packing" in active_patches(model)
    plain = copy.deepcopy(model)
    revert(plain)
    assert not active_patches(plain)
    with torch.no_grad():
        assert chat(model, tok, "hello there", max_new_tokens=12, stream=False) == \
            chat(plain, tok, "hello there", max_new_tokens=12, stream=False)
