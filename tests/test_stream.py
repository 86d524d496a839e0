"""Streaming (fastkit.data.stream): the same rows and tokens as a table, errors naming the row, runs with max_steps.

A stream is read a few rows at a time, checked and tokenized as the trainer draws it. What must hold: every row
trains exactly the tokens the same row trains from a ``Dataset``; a bad or over-long row anywhere in the stream is
refused naming its index (or dropped with the flag); what a stream cannot do (epochs, eval_split) is refused when
the trainer is built.
"""

from __future__ import annotations

import json
import logging

import pytest

from fastkit.data import check_dataset, load_chat_dataset, load_sources
from fastkit.data.stream import PEEK_ROWS, is_stream
from fastkit.errors import FastkitError
from fastkit.families.twins import twin_tokenizer


@pytest.fixture(scope="module")
def tok():
    return twin_tokenizer()


def _chat(i: int, turns: int) -> dict:
    messages = [{"role": "system", "content": f"You are helpful {i}."}]
    for t in range(turns):
        messages += [{"role": "user", "content": f"question {i} {t} " * (1 + i % 3)},
                     {"role": "assistant", "content": f"answer {i} {t} " * (1 + i % 5)}]
    return {"messages": messages}


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


ROWS = {
    "messages": lambda i: _chat(i, 1 + i % 3),  # single and multi-turn chats mixed
    "sharegpt": lambda i: {"conversations": [{"from": "human", "value": f"hi {i}"},
                                             {"from": "gpt", "value": f"yo {i}"},
                                             {"from": "human", "value": "more"},
                                             {"from": "gpt", "value": "ok " * (1 + i % 7)}]},
    "alpaca": lambda i: {"instruction": f"do {i}", "input": "x" * (i % 2), "output": f"done {i}"},
    "prompt_completion": lambda i: {"prompt": f"Q{i}: what?", "completion": f" A{i}."},
    "chat_prompt_completion": lambda i: {"prompt": [{"role": "user", "content": f"q{i}"}],
                                         "completion": [{"role": "assistant", "content": f"a{i}"}]},
    "text": lambda i: {"text": f"plain text number {i} " * (1 + i % 4)},
}


def _rows_of(tokenized) -> list[tuple[list[int], list[int] | None]]:
    return [(list(r["input_ids"]), list(r["completion_mask"]) if "completion_mask" in r else None)
            for r in tokenized]


@pytest.mark.parametrize("fmt", sorted(ROWS))
def test_a_stream_trains_the_tokens_a_table_trains(tmp_path, tok, fmt):
    file = _write(tmp_path / "d.jsonl", [ROWS[fmt](i) for i in range(300)])
    table = check_dataset(load_chat_dataset(file), tok, 512, tokenize=True)
    stream = check_dataset(load_chat_dataset(file, streaming=True), tok, 512, tokenize=True)
    assert is_stream(stream) and not is_stream(table)
    got, want = _rows_of(stream), _rows_of(table)
    assert len(got) == len(want) == 300
    assert got == want


def test_a_stream_is_read_a_few_rows_at_a_time(tmp_path):
    file = _write(tmp_path / "d.jsonl", [_chat(i, 2) for i in range(50)])
    stream = load_chat_dataset(file, streaming=True)
    assert is_stream(stream) and next(iter(stream))["messages"][1]["content"].startswith("question 0")


def test_a_bad_row_deep_in_the_stream_is_named_when_drawn(tmp_path, tok):
    rows = [_chat(i, 1) for i in range(PEEK_ROWS + 200)]
    bad = PEEK_ROWS + 123
    rows[bad]["messages"][-1]["content"] = None  # an answer of None: nothing to train
    file = _write(tmp_path / "d.jsonl", rows)
    stream = check_dataset(load_chat_dataset(file, streaming=True), tok, 512, tokenize=True)  # first rows clean
    with pytest.raises(FastkitError, match=rf"row {bad + 1} of the stream cannot be trained.*drop_invalid"):
        list(stream)
    kept = list(check_dataset(load_chat_dataset(file, streaming=True), tok, 512, tokenize=True, drop_invalid=True))
    assert len(kept) == len(rows) - 1


def test_a_bad_first_row_fails_before_any_model(tmp_path, tok):
    rows = [_chat(i, 1) for i in range(20)]
    rows[3]["messages"] = [{"role": "user", "content": "no answer"}]
    file = _write(tmp_path / "d.jsonl", rows)
    with pytest.raises(FastkitError, match=r"rows 4 of the stream's first .* cannot be trained"):
        load_chat_dataset(file, streaming=True)
    with pytest.raises(FastkitError, match=r"row 4 of the stream cannot be trained"):
        check_dataset(load_chat_dataset(file, streaming=True, normalize=False), tok, 512, tokenize=True)


def test_an_over_long_row_is_named_or_dropped(tmp_path, tok):
    rows = [_chat(i, 1) for i in range(PEEK_ROWS + 50)]
    long_row = PEEK_ROWS + 7
    rows[long_row]["messages"][-1]["content"] = "word " * 600
    file = _write(tmp_path / "d.jsonl", rows)
    stream = check_dataset(load_chat_dataset(file, streaming=True), tok, 256, tokenize=True)
    with pytest.raises(FastkitError, match=rf"row {long_row + 1} of the stream is \d+ tokens, longer than "
                                           r"max_seq_length=256.*drop_long"):
        list(stream)
    kept = check_dataset(load_chat_dataset(file, streaming=True), tok, 256, tokenize=True, drop_long=True)
    assert len(list(kept)) == len(rows) - 1


def test_unknown_columns_and_empty_streams_are_refused(tmp_path, tok):
    with pytest.raises(FastkitError, match="columns"):
        load_chat_dataset(_write(tmp_path / "a.jsonl", [{"question": "q", "answer": "a"}]), streaming=True)
    (tmp_path / "e.jsonl").write_text("", encoding="utf-8")
    with pytest.raises(FastkitError, match="no rows|empty"):
        load_chat_dataset(str(tmp_path / "e.jsonl"), streaming=True)


def test_columns_map_onto_a_stream(tmp_path, tok):
    file = _write(tmp_path / "qa.jsonl", [{"question": f"q{i}", "answer": f"a{i}"} for i in range(10)])
    stream = load_chat_dataset(file, streaming=True, columns={"prompt": "question", "completion": "answer"})
    assert next(iter(stream)) == {"prompt": "q0", "completion": "a0"}


def test_sources_stream_interleaved_by_weight(tmp_path, caplog):
    a = _write(tmp_path / "a.jsonl", [{"prompt": f"a{i}", "completion": "x"} for i in range(200)])
    b = _write(tmp_path / "b.jsonl", [{"prompt": f"b{i}", "completion": "y"} for i in range(200)])
    with caplog.at_level(logging.INFO, logger="fastkit"):
        mixed = load_sources([a, f"{b}?weight=3&max_rows=50"], streaming=True, seed=0)
    first = [r["prompt"] for r in mixed.take(40)]
    from_b = sum(p.startswith("b") for p in first)
    assert 20 <= from_b <= 39, first  # weight 3 of 4: about three rows in four come from b
    assert all(int(p[1:]) < 50 for p in first if p.startswith("b"))  # max_rows: b's first 50 rows
    assert "streamed, weight 3 of 4" in caplog.text
    chats = _write(tmp_path / "c.jsonl", [_chat(i, 1) for i in range(5)])
    with pytest.raises(FastkitError, match="cannot be streamed together"):
        load_sources([a, chats], streaming=True)


def _twin_model():
    from fastkit import FastModel
    from fastkit.families.twins import twin

    model = twin("llama", seed=0)
    FastModel.patch(model, max_seq_length=512)
    return model


def test_a_stream_trains_with_max_steps_and_refuses_what_needs_a_length(tmp_path, tok):
    from fastkit.training import make_trainer, run_coverage

    file = _write(tmp_path / "d.jsonl", [_chat(i, 1 + i % 3) for i in range(400)])
    model = _twin_model()
    common = dict(max_seq_length=512, output_dir=str(tmp_path / "out"), dashboard="none")
    with pytest.raises(FastkitError, match="epochs=1 needs the data's length.*max_steps"):
        make_trainer(model, tok, load_chat_dataset(file, streaming=True), epochs=1, **common)
    with pytest.raises(FastkitError, match="eval_split .* stream"):
        make_trainer(model, tok, load_chat_dataset(file, streaming=True), max_steps=2, eval_split=0.1, **common)
    trainer = make_trainer(model, tok, file, streaming=True, max_steps=2, **common)  # a path, streamed
    assert is_stream(trainer.train_dataset)
    assert "rows drawn from a stream" in run_coverage(trainer)
    packed = next(iter(trainer.train_dataset))
    assert sum(packed["seq_lengths"]) == len(packed["input_ids"]) <= 512  # documents kept whole, their lengths
    result = trainer.train()
    assert result.global_step == 2 and result.training_loss == result.training_loss  # finite, not NaN


def test_the_command_line_streams(tmp_path, caplog):
    from fastkit import cli

    file = _write(tmp_path / "d.jsonl", [_chat(i, 1 + i % 3) for i in range(300)])
    with caplog.at_level(logging.INFO, logger="fastkit"):
        rc = cli.main(["train", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct", "--twin", "--data", file,
                       "--streaming", "--steps", "2", "--max-seq-length", "256", "--lora-r", "4",
                       "--output-dir", str(tmp_path / "run")])
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert rc == 0, text
    assert "rows drawn from a stream" in text and "training finished at step 2/2" in text
    assert (tmp_path / "run" / "lora" / "adapter_model.safetensors").is_file()


def test_the_command_line_refuses_a_streams_limits_before_the_model_loads(tmp_path, capsys, monkeypatch):
    from fastkit import FastModel, cli

    def no_load(*args, **kwargs):
        raise AssertionError("the model loaded before the refusal")

    monkeypatch.setattr(FastModel, "from_pretrained", staticmethod(no_load))
    file = _write(tmp_path / "d.jsonl", [_chat(i, 1) for i in range(20)])
    common = ["train", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct", "--twin", "--data", file, "--streaming",
              "--output-dir", str(tmp_path / "run")]
    assert cli.main([*common, "--epochs", "1"]) != 0
    err = capsys.readouterr().err
    assert "--epochs 1 needs the data's length" in err and "give --steps instead" in err, err
    assert cli.main([*common, "--eval-split", "0.1"]) != 0
    err = capsys.readouterr().err
    assert "--eval-split holds rows out" in err and "a stream (--streaming)" in err, err
