"""Dataset checks refuse bad data before training; the quickstart data teaches a visible format."""

import json

import pytest
from datasets import Dataset

from fastkit import FastkitError
from fastkit.data import check_dataset, load_chat_dataset, to_prompt_completion
from fastkit.quickstart import quickstart_dataset


def _chat(q, a):
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


def test_quickstart_dataset_is_deterministic_and_heldout_is_new():
    train, heldout = quickstart_dataset()
    again, _ = quickstart_dataset()
    assert train[:] == again[:]
    assert len(train) > 100
    prompts = {row["messages"][0]["content"] for row in train}
    assert not prompts & set(heldout)
    for row in train:
        json.loads(row["messages"][1]["content"])  # every answer is one line of JSON


def test_messages_become_prompt_completion(tokenizer):
    ds = check_dataset(Dataset.from_list([_chat("q", "a")]), tokenizer, 64)
    assert ds.column_names == ["prompt", "completion"]
    assert ds[0]["completion"] == [{"role": "assistant", "content": "a"}]


def test_missing_columns(tokenizer):
    with pytest.raises(FastkitError, match="columns.*'messages'"):
        check_dataset(Dataset.from_list([{"question": "q", "answer": "a"}]), tokenizer, 64)


def test_empty(tokenizer):
    with pytest.raises(FastkitError, match="empty"):
        check_dataset(Dataset.from_list([]), tokenizer, 64)


def test_every_label_masked(tokenizer):
    rows = [{"messages": [{"role": "user", "content": "q"}]}, {"messages": [{"role": "user", "content": "r"}]}]
    with pytest.raises(FastkitError, match="Every label is masked"):
        check_dataset(Dataset.from_list(rows), tokenizer, 64)


def test_longer_than_max_seq_length(tokenizer):
    with pytest.raises(FastkitError, match="longer than max_seq_length=16"):
        check_dataset(Dataset.from_list([_chat("a long question " * 3, "x")]), tokenizer, 16)


def test_load_chat_dataset_sources(tmp_path):
    rows = [_chat("q", "a")]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    assert load_chat_dataset(rows)[0] == rows[0]
    assert load_chat_dataset(str(path))[0] == rows[0]
    with pytest.raises(FastkitError, match="does not exist"):
        load_chat_dataset(str(tmp_path / "nope.jsonl"))
    assert to_prompt_completion(Dataset.from_list([{"text": "t"}])).column_names == ["text"]


def test_check_dataset_drop_long_drops_rows_instead_of_refusing(tokenizer, caplog):
    import logging

    rows = [_chat("short", "ok"), _chat("a long question " * 3, "x"), _chat("hi", "yo")]
    with caplog.at_level(logging.INFO, logger="fastkit"):
        ds = check_dataset(Dataset.from_list(rows), tokenizer, 40, drop_long=True)
    assert len(ds) == 2 and "dropped 1 of 3 rows" in caplog.text
    with pytest.raises(FastkitError, match="Every row is longer"):
        check_dataset(Dataset.from_list(rows[1:2]), tokenizer, 16, drop_long=True)
