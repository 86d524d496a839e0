"""Several datasets in one run and column mapping (issue 33): ``DataSource`` strings and mappings,
``load_sources``' weights / row caps / seeds, mapped sources through the front-door checks, and mixed shapes
down to the trained tokens."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest

from fastkit import FastkitError
from fastkit.data import DataSource, check_dataset, load_chat_dataset, load_sources, preview_masks
from fastkit.data.samples import NO_ROBOTS_SAMPLE
from fastkit.data.sources import shares

QA = {"prompt": "question", "completion": "answer"}
HEAD = re.compile(r"row (\d+): (\d+) of (\d+) tokens trained")


def _csv(path, rows, header=("question", "answer")):
    import csv

    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    return str(path)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _chat(q, a):
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


def _tag(row) -> str:
    """Which source a mixed row came from: the tag its question starts with (``A3: ...`` -> ``A``)."""
    first = row["messages"][0]["content"] if "messages" in row else row["prompt"]
    first = first if isinstance(first, str) else first[0]["content"]
    return first.split(":")[0][0]


# -- the string and mapping forms ---------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("qa.csv", DataSource("qa.csv")),
    ("qa.csv?columns=prompt:question,completion:answer&weight=2&max_rows=500&split=train",
     DataSource("qa.csv", columns=QA, weight=2.0, max_rows=500)),
    ("HuggingFaceH4/no_robots?split=test&name=nr", DataSource("HuggingFaceH4/no_robots", split="test", name="nr")),
    (r"C:\Users\me\data\qa.csv?max-rows=10", DataSource(r"C:\Users\me\data\qa.csv", max_rows=10)),
    ("sample?weight=0.5", DataSource("sample", weight=0.5)),
])
def test_source_strings_parse_and_round_trip(text, expected):
    source = DataSource.parse(text)
    assert source == expected
    assert DataSource.parse(source.spec()) == source
    assert DataSource.from_mapping(source.to_mapping()) == source


def test_a_path_with_a_question_mark_that_exists_is_taken_whole(tmp_path):
    odd = tmp_path / "what?weight=2.jsonl"
    odd.write_text(json.dumps({"text": "hi"}) + "\n")
    assert DataSource.parse(str(odd)) == DataSource(str(odd))


@pytest.mark.parametrize("text, words", [
    ("qa.csv?wieght=2", ["'wieght=2'", "columns, weight, max_rows, split, name"]),
    ("qa.csv?weight=-1", ["weight must be a positive number", "-1"]),
    ("qa.csv?weight=two", ["weight='two' is not a number"]),
    ("qa.csv?max_rows=0", ["max_rows must be a positive whole number"]),
    ("qa.csv?columns=prompt", ["columns='prompt'", "field:column"]),
    ("qa.csv?columns=promt:question", ["'promt'", "not a field", "prompt, completion"]),
])
def test_bad_source_strings_are_refused_naming_the_key(text, words):
    with pytest.raises(FastkitError) as err:
        DataSource.parse(text)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_bad_mappings_are_refused_naming_the_key():
    with pytest.raises(FastkitError, match="unknown key 'wieght'; the keys are path, split, columns, weight"):
        DataSource.from_mapping({"path": "qa.csv", "wieght": 2})
    with pytest.raises(FastkitError, match="no path"):
        DataSource.from_mapping({"weight": 2})
    with pytest.raises(FastkitError, match="a mapping of fastkit field -> your column"):
        DataSource.from_mapping({"path": "qa.csv", "columns": ["question"]})


# -- column mapping -----------------------------------------------------------------------------------------------
def test_a_mapped_column_the_file_lacks_is_refused_naming_source_column_and_columns(tmp_path):
    qa = _csv(tmp_path / "qa.csv", [("2+2?", "4")])
    with pytest.raises(FastkitError) as err:
        load_sources({"path": qa, "columns": {"prompt": "question", "completion": "reply"}})
    text = str(err.value)
    assert f"data source {qa!r}" in text and "'reply'" in text and "'question', 'answer'" in text, text
    with pytest.raises(FastkitError, match="'reply'.*its columns: 'question', 'answer'"):
        load_chat_dataset(qa, columns={"prompt": "question", "completion": "reply"})


def test_a_mapped_source_with_a_bad_row_is_refused_naming_source_and_row(tmp_path):
    qa = _csv(tmp_path / "qa.csv", [("2+2?", "4"), ("3+3?", ""), ("1+1?", "2")])
    with pytest.raises(FastkitError) as err:
        load_sources(["sample", f"{qa}?columns=prompt:question,completion:answer"])
    text = str(err.value)
    assert text.startswith(f"data source '{qa}'") and "row 2" in text and "completion is empty" in text, text
    kept = load_sources(f"{qa}?columns=prompt:question,completion:answer", drop_invalid=True)
    assert kept["completion"] == ["4", "2"]


def test_column_mapping_trains_the_answer_only(tmp_path):
    """A question/answer CSV -> one SFT step on a twin: the trained labels are exactly each answer + EOS."""
    from fastkit import FastModel
    from fastkit.training import make_trainer

    answers = ["four", "Paris", "blue", "seven"]
    qa = _csv(tmp_path / "qa.csv", zip(["2+2?", "Capital of France?", "Sky color?", "3+4?"], answers))
    rows = load_sources(DataSource(qa, columns=QA))
    assert rows.column_names == ["prompt", "completion"] and rows["completion"] == answers
    model, tok = FastModel.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct", twin=True, max_seq_length=128)
    model = FastModel.get_peft_model(model, r=4, lora_alpha=4, use_gradient_checkpointing=False)
    trainer = make_trainer(model, tok, rows, max_steps=1, max_seq_length=128, output_dir=str(tmp_path / "run"),
                           dashboard="none")
    trained = [tok.decode([t for t, lab in zip(ids, labels) if lab != -100])
               for ids, labels in zip(trainer.train_dataset["input_ids"], trainer.train_dataset["labels"])]
    assert sorted(p for text in trained for p in text.split(tok.eos_token) if p) == sorted(answers)
    assert sum(text.count(tok.eos_token) for text in trained) == len(answers)
    assert trainer.train().training_loss > 0


def test_a_mapped_system_column_becomes_the_first_turn(tmp_path):
    qa = _csv(tmp_path / "qa.csv", [("2+2?", "4", "Be brief.")], header=("q", "a", "sys"))
    rows = load_sources(DataSource(qa, columns={"prompt": "q", "completion": "a", "system": "sys"}))
    assert rows[0] == {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
                       "completion": [{"role": "assistant", "content": "4"}]}


# -- the mix: weights, caps, seeds --------------------------------------------------------------------------------
@pytest.fixture
def abc(tmp_path):
    """Three sources of 10, 4 and 6 rows, each question tagged with its source's letter."""
    return [_jsonl(tmp_path / f"{tag}.jsonl", [_chat(f"{tag}{i}: q", f"a{i}") for i in range(n)])
            for tag, n in (("A", 10), ("B", 4), ("C", 6))]


def test_without_weights_every_row_is_used_once(abc):
    rows = load_sources(abc)
    assert Counter(_tag(r) for r in rows) == {"A": 10, "B": 4, "C": 6}
    assert len({r["messages"][0]["content"] for r in rows}) == 20
    assert [_tag(r) for r in rows] != sorted(_tag(r) for r in rows)  # several sources are shuffled together


def test_weight_2_uses_each_row_twice_and_keeps_the_other_sources_whole(abc, caplog):
    """A weight repeats its own source's rows; the other sources keep every row (no fixed total to share)."""
    a, b, c = abc
    with caplog.at_level("INFO", logger="fastkit"):
        rows = load_sources([a, {"path": b, "weight": 2}, DataSource(c, weight=1.0)], seed=7)
    assert Counter(_tag(r) for r in rows) == {"A": 10, "B": 8, "C": 6}
    b_counts = Counter(r["messages"][0]["content"] for r in rows if _tag(r) == "B")
    assert sorted(b_counts.values()) == [2, 2, 2, 2]  # each of B's 4 rows exactly twice
    assert len({r["messages"][0]["content"] for r in rows if _tag(r) in "AC"}) == 16  # all of A and C, once
    assert f"data source {b!r}: 4 rows read, 4 used, 4 repeated (8 rows in the mix, weight 2)" in caplog.text
    assert f"data source {a!r}: 10 rows read, 10 used, 0 repeated (10 rows in the mix)" in caplog.text
    assert "data mix: 24 rows from 3 sources as chats, shuffled with seed 7" in caplog.text
    assert shares([3, 3, 4], [None, None, None]) == [3, 3, 4]  # no weights: every row once
    assert shares([3, 3, 4], [1, None, 3]) == [3, 3, 12]  # a weight changes its own source only
    assert shares([16], [1.5]) == [24]  # every row once plus a seeded half again


def test_weight_half_keeps_a_seeded_half(abc, caplog):
    a, b, _ = abc
    with caplog.at_level("INFO", logger="fastkit"):
        rows = load_sources([f"{a}?weight=0.5", b], seed=7)
    assert Counter(_tag(r) for r in rows) == {"A": 5, "B": 4}
    half = sorted(r["messages"][0]["content"] for r in rows if _tag(r) == "A")
    assert len(set(half)) == 5  # a sample: no row twice
    again = sorted(r["messages"][0]["content"] for r in load_sources([f"{a}?weight=0.5", b], seed=7) if _tag(r) == "A")
    other = sorted(r["messages"][0]["content"] for r in load_sources([f"{a}?weight=0.5", b], seed=8) if _tag(r) == "A")
    assert half == again != other  # seeded: the same half for the same seed
    assert f"data source {a!r}: 10 rows read, 5 used, 0 repeated (5 rows in the mix, weight 0.5)" in caplog.text


def test_default_keeps_every_row_of_every_source(abc):
    rows = load_sources(abc, seed=3)
    assert sorted(r["messages"][0]["content"] for r in rows) == sorted(
        f"{t}{i}: q" for t, n in (("A", 10), ("B", 4), ("C", 6)) for i in range(n))


def test_max_rows_caps_each_source_with_a_seeded_sample(abc):
    a, b, _ = abc
    rows = load_sources([f"{a}?max_rows=3", b], seed=1)
    assert Counter(_tag(r) for r in rows) == {"A": 3, "B": 4}
    one = load_sources(f"{a}?max_rows=3", seed=1)["messages"]
    assert one == load_sources(f"{a}?max_rows=3", seed=1)["messages"]
    assert one != load_sources(f"{a}?max_rows=3", seed=2)["messages"]
    numbers = [int(m[0]["content"][1:].split(":")[0]) for m in one]
    assert numbers == sorted(numbers)  # in the file's order
    assert len(load_sources(f"{a}?max_rows=50")) == 10  # a cap above the rows is no cap


def test_the_same_seed_gives_the_same_data_fingerprint(abc):
    from fastkit.training.identity import data_fingerprint

    a, b, c = abc
    mix = [a, f"{b}?weight=2", f"{c}?max_rows=4"]
    first = data_fingerprint(load_sources(mix, seed=11))
    assert data_fingerprint(load_sources(mix, seed=11)) == first
    assert data_fingerprint(load_sources(mix, seed=12)) != first
    one = [data_fingerprint(load_sources(f"{a}?max_rows=4", seed=seed)) for seed in (11, 11, 12)]
    assert one[0] == one[1] != one[2]  # one source, capped: the sample is in the table the fingerprint reads


# -- shapes in one mix ------------------------------------------------------------------------------------------
def test_mixing_multi_turn_chats_with_a_qa_file_keeps_every_assistant_turn(tmp_path, tokenizer):
    qa = _csv(tmp_path / "qa.csv", [("What is 2+2?", "4"), ("Capital of Peru?", "Lima")])
    sample = load_chat_dataset(NO_ROBOTS_SAMPLE)
    rows = load_sources(["sample", f"{qa}?columns=prompt:question,completion:answer"])
    assert rows.column_names == ["messages"] and len(rows) == len(sample) + 2
    checked = check_dataset(rows, tokenizer, 512)
    counts = [m.groups() for m in HEAD.finditer(preview_masks(rows, tokenizer, n=len(rows)))]
    assert [(str(i), str(sum(r["completion_mask"])), str(len(r["input_ids"]))) for i, r in enumerate(checked)] == counts
    answers_of = {m["messages"][0]["content"] + m["messages"][1]["content"]: [
        t["content"] for t in m["messages"] if t["role"] == "assistant"] for m in sample}
    answers_of.update({"What is 2+2?4": ["4"], "Capital of Peru?Lima": ["Lima"]})
    for row, out in zip(rows, checked):
        trained = tokenizer.decode([t for t, bit in zip(out["input_ids"], out["completion_mask"]) if bit])
        answers = answers_of[row["messages"][0]["content"] + row["messages"][1]["content"]]
        assert trained == "".join(f"{a}<|im_end|>\n" for a in answers), trained
    assert sum(len(a) >= 2 for a in answers_of.values()) >= 4  # multi-turn rows were in the mix


def test_message_lists_with_extra_keys_mix_with_string_prompts(tmp_path, tokenizer):
    tools = [{"messages": [{"role": "user", "content": "Weather?", "name": "u"},
                           {"role": "assistant", "content": "Calling weather()."},
                           {"role": "tool", "content": "4 C", "name": "weather"},
                           {"role": "assistant", "content": "It is 4 C."}]}]
    pc = [{"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "hello"}]}]
    rows = load_sources([_jsonl(tmp_path / "t.jsonl", tools), _jsonl(tmp_path / "pc.jsonl", pc),
                         _jsonl(tmp_path / "s.jsonl", [{"prompt": "2+2?", "completion": "4"}])])
    assert rows.column_names == ["messages"] and len(rows) == 3
    assert sorted(len(m) for m in rows["messages"]) == [2, 2, 4]
    checked = check_dataset(rows, tokenizer, 512)
    trained = sorted(tokenizer.decode([t for t, b in zip(r["input_ids"], r["completion_mask"]) if b])
                     for r in checked)
    assert trained == ["4<|im_end|>\n", "Calling weather().<|im_end|>\nIt is 4 C.<|im_end|>\n", "hello<|im_end|>\n"]
    two = load_sources([_jsonl(tmp_path / "pc.jsonl", pc), _jsonl(tmp_path / "s.jsonl", [{"prompt": "p",
                                                                                           "completion": "c"}])])
    assert two.column_names == ["prompt", "completion"] and all(isinstance(p, list) for p in two["prompt"])


def test_text_rows_and_chats_cannot_mix_naming_both(tmp_path):
    text = _jsonl(tmp_path / "text.jsonl", [{"text": "plain"}])
    with pytest.raises(FastkitError) as err:
        load_sources(["sample", text])
    assert f"'sample' (chats) and {text!r} (plain text) cannot be mixed" in str(err.value)
    assert load_sources([text, text])["text"] == ["plain", "plain"]


def test_offline_names_resolve_in_the_data_layer():
    assert load_sources("sample")["messages"] == load_chat_dataset(NO_ROBOTS_SAMPLE)["messages"]
    from fastkit.quickstart import quickstart_dataset

    assert load_sources("quickstart")[:] == quickstart_dataset()[0][:]


def test_the_arrow_path_names_a_bad_row_and_a_bad_line(tmp_path):
    """A file datasets reads whole: a bad row is named by its index; a bad JSON line by its line number."""
    from fastkit.data.read import read_table

    good = [_chat(f"q{i}", f"a{i}") for i in range(5)]
    rows = good[:3] + [{"messages": [{"role": "user", "content": "q"}]}] + good[3:]
    path = Path(_jsonl(tmp_path / "d.jsonl", rows))
    assert read_table(path) is not None  # read by datasets, not by the Python reader
    with pytest.raises(FastkitError, match=r"rows 4\); row 4: the last turn is 'user'"):
        load_chat_dataset(str(path))
    broken = tmp_path / "broken.jsonl"
    broken.write_text(path.read_text().replace('"q1"', '"q1', 1))
    with pytest.raises(FastkitError, match="line 2 is not valid JSON"):
        load_chat_dataset(str(broken))


def _qa_file(path, prefix: str, n: int) -> str:
    import json

    path.write_text("".join(json.dumps({"prompt": f"{prefix}{i}", "completion": "x"}) + "\n" for i in range(n)))
    return str(path)


def test_interleave_mixes_draw_by_share_and_stop_as_named(tmp_path, caplog):
    import logging
    from collections import Counter

    from fastkit.data import load_sources

    small, large = _qa_file(tmp_path / "s.jsonl", "s", 10), _qa_file(tmp_path / "l.jsonl", "l", 100)
    with caplog.at_level(logging.INFO, logger="fastkit"):
        under = load_sources([small, large], mix="interleave_under", seed=0)
    counts = Counter(p[0] for p in under["prompt"])
    assert counts["s"] == 10 and counts["l"] < 30, counts  # stops when the small source runs out (shares 1:1)
    assert "drawn with probability 0.5" in caplog.text and "data mix (interleave_under)" in caplog.text
    over = load_sources([small, large], mix="interleave_over", seed=0)
    counts = Counter(over["prompt"])
    assert {f"l{i}" for i in range(100)} <= set(counts) and counts["s0"] > 1  # every row; the small one again
    weighted = load_sources([small, f"{large}?weight=3"], mix="interleave_under", seed=0)
    share = sum(p.startswith("l") for p in weighted["prompt"]) / len(weighted)
    assert 0.6 < share < 0.9, share  # weight 3 of 4
    concat = load_sources([small, large], seed=0)
    assert len(concat) == 110  # the default keeps every row once


def test_an_unknown_mix_is_refused_naming_the_choices(tmp_path):
    from fastkit.data import load_sources
    from fastkit.errors import FastkitError

    with pytest.raises(FastkitError, match="mix='interleave' is not one of .*interleave_under"):
        load_sources([_qa_file(tmp_path / "a.jsonl", "a", 3)], mix="interleave")
