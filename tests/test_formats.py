"""Data formats users bring (ShareGPT, Alpaca, messages, prompt/completion, text) and exact loss masks
on every assistant turn of a multi-turn chat, down to the labels an SFTTrainer step sees."""

import json

import pytest
from datasets import Dataset

from fastkit import FastkitError, FastModel
from fastkit.data import check_dataset, load_chat_dataset
from fastkit.data.formats import detect_format, normalize_dataset, preview_masks, tokenize_chat
from fastkit.training import make_trainer

SYSTEM, USER, ASSISTANT = "system", "user", "assistant"
CHAT = [{"role": SYSTEM, "content": "Be brief."}, {"role": USER, "content": "hi"},
        {"role": ASSISTANT, "content": "A1"}, {"role": USER, "content": "q2"}, {"role": ASSISTANT, "content": "A2"}]
# What the ChatML template writes for CHAT, cut by hand into (text, trained) pieces: each assistant turn's
# content, its <|im_end|> and the newline the template writes after it; never a header or a user/system turn.
PIECES = [("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", 0),
          ("A1<|im_end|>\n", 1),
          ("<|im_start|>user\nq2<|im_end|>\n<|im_start|>assistant\n", 0),
          ("A2<|im_end|>\n", 1)]


def _expected(tokenizer):
    ids, mask = [], []
    for text, bit in PIECES:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]  # byte-level twin: pieces tokenize alone
        ids += piece
        mask += [bit] * len(piece)
    return ids, mask


def test_formats_are_detected_and_normalized():
    share = [{"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "q"},
                                {"from": "gpt", "value": "a"}, {"from": "human", "value": "q2"},
                                {"from": "gpt", "value": "a2"}]}]
    assert normalize_dataset(Dataset.from_list(share))[0] == {"messages": [
        {"role": "system", "content": "S"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
        {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]}
    alpaca = [{"instruction": "Translate.", "input": "chat", "output": "cat"},
              {"instruction": "Say hi.", "input": "", "output": "hi"}]
    rows = normalize_dataset(Dataset.from_list(alpaca))
    assert rows.column_names == ["messages"]
    assert rows[0]["messages"] == [{"role": "user", "content": "Translate.\n\nchat"},
                                   {"role": "assistant", "content": "cat"}]
    assert rows[1]["messages"] == [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]
    for row, fmt in (({"messages": CHAT}, "messages"), ({"prompt": "p", "completion": "c"}, "prompt_completion"),
                     ({"text": "t"}, "text")):
        ds = Dataset.from_list([row])
        assert detect_format(ds.column_names) == fmt
        assert normalize_dataset(ds)[0] == ds[0]  # already trainable: unchanged


def test_unknown_columns_and_speakers_are_refused():
    with pytest.raises(FastkitError, match=r"columns \['answer', 'question'\].*'conversations' \(ShareGPT"):
        normalize_dataset(Dataset.from_list([{"question": "q", "answer": "a"}]))
    bad = [{"conversations": [{"from": "narrator", "value": "x"}]}]
    with pytest.raises(FastkitError, match="row 1: unknown speaker from='narrator'"):
        normalize_dataset(Dataset.from_list(bad))


def test_load_chat_dataset_reads_sharegpt_jsonl(tmp_path):
    path = tmp_path / "share.jsonl"
    path.write_text(json.dumps({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}))
    assert load_chat_dataset(str(path))[0]["messages"][1] == {"role": "assistant", "content": "a"}
    assert "conversations" in load_chat_dataset(str(path), normalize=False).column_names


def test_every_assistant_turn_is_trained_exactly(tokenizer):
    ids, mask = _expected(tokenizer)
    out = tokenize_chat(CHAT, tokenizer)
    assert out["input_ids"] == ids
    assert out["completion_mask"] == mask
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    trained_ends = [i for i, t in enumerate(ids) if t == im_end and mask[i]]
    assert len(trained_ends) == 2  # both assistant turns learn to stop; user/system ends stay untrained


def test_check_dataset_tokenizes_multi_turn_and_keeps_single_turn(tokenizer):
    multi = check_dataset(Dataset.from_list([{"messages": CHAT}]), tokenizer, 256)
    assert multi.column_names == ["input_ids", "completion_mask"]
    assert (multi[0]["input_ids"], multi[0]["completion_mask"]) == _expected(tokenizer)
    single = check_dataset(Dataset.from_list([{"messages": CHAT[1:3]}]), tokenizer, 256)
    assert single.column_names == ["prompt", "completion"]
    share = [{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}]
    assert check_dataset(Dataset.from_list(share), tokenizer, 256)[0]["completion"] == [
        {"role": "assistant", "content": "a"}]


def test_preview_shows_the_trained_tokens(tokenizer):
    text = preview_masks([{"messages": CHAT}], tokenizer)
    body = "".join(f"[{t}]" if bit else t for t, bit in PIECES)
    trained = sum(_expected(tokenizer)[1])
    assert text == f"--- row 0: {trained} of {len(_expected(tokenizer)[0])} tokens trained\n{body}"
    assert preview_masks([{"prompt": "2+2=", "completion": "4"}], tokenizer).endswith("2+2=[4<|im_end|>]")
    assert preview_masks([{"text": "ab"}], tokenizer).endswith("[ab<|im_end|>]")
    html = preview_masks([{"messages": CHAT}], tokenizer, html=True)
    assert html.count("<mark") == 2 and "A2&lt;|im_end|&gt;" in html


@pytest.mark.parametrize("packing", [False, True])
def test_sft_step_trains_on_those_masks(tmp_path, packing):
    """The labels of the batch a real SFTTrainer step computes its loss on: -100 exactly off the assistant turns."""
    model, tok = FastModel.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct", max_seq_length=256, twin=True)
    model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False)
    trainer = make_trainer(model, tok, Dataset.from_list([{"messages": CHAT}]), max_steps=1, packing=packing,
                           max_seq_length=256, output_dir=str(tmp_path))
    seen = []
    compute_loss = trainer.compute_loss

    def spy(model, inputs, *args, **kwargs):
        seen.append((inputs["input_ids"].tolist(), inputs["labels"].tolist()))
        return compute_loss(model, inputs, *args, **kwargs)

    trainer.compute_loss = spy
    trainer.train()
    ids, mask = _expected(tok)
    assert seen == [([ids], [[t if bit else -100 for t, bit in zip(ids, mask)]])]


def test_template_that_rewrites_past_turns_is_refused(tokenizer):
    """Like Qwen3 (past reasoning dropped): the last assistant turn renders unlike earlier ones, so the turns
    cannot be cut out of the whole conversation exactly; unknown to TRL's training templates -> a clear error."""
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
        "{% if message['role'] == 'assistant' and loop.last %}{{ '<think></think>' }}{% endif %}"
        "{{ message['content'] + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    with pytest.raises(FastkitError, match="not prefix-preserving.*'prompt'.*'completion'"):
        tokenize_chat(CHAT, tok)
    assert sum(tokenize_chat(CHAT[:3], tok)["completion_mask"]) == len("<think></think>A1") + 2  # one turn: exact
