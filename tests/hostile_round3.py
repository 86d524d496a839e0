"""Round-3 rows of the hostile-input table (issue 23), one list per class; tests/test_hostile_inputs.py runs them.

Each builder returns ``(class, Case)`` pairs. Imports of what round 3 added happen inside the actions,
so the same rows can run against older code (they then fail, which is the point).
"""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import math
import shutil
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace

import torch
from datasets import Dataset, DatasetDict

from fastkit import FastkitError, FastModel

TWIN = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _ns():
    from tests.test_hostile_inputs import Case, Raises

    return Case, Raises


def _chat(q, a="a"):
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


GOOD = [_chat(f"q{i}", f"a{i}") for i in range(3)]


def _check(ctx, data, **kw):
    from fastkit.data import check_dataset

    return check_dataset(data, ctx.tok, 64, **kw)


def _load(source, **kw):
    from fastkit.data import load_chat_dataset

    return load_chat_dataset(source, **kw)


def _rows(n):
    def check(ds, ctx):
        assert len(ds) == n, len(ds)
        assert set(ds.column_names) & {"messages", "prompt", "text", "input_ids"}, ds.column_names
    return check


def _write(ctx, name, data: bytes) -> Path:
    path = ctx.tmp / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _jsonl(rows=GOOD) -> bytes:
    return ("\n".join(json.dumps(r) for r in rows) + "\n").encode()


def _parquet(ctx, name="d.parquet", rows=GOOD):
    path = ctx.tmp / name
    Dataset.from_list(rows).to_parquet(str(path))
    return path


# -- A. the data front door: whatever users bring --------------------------------------------------------
def data_sources():
    Case, Raises = _ns()
    err = FastkitError
    rows = [
        ("none_source", lambda ctx: _load(None), Raises(err, "None", ".jsonl")),
        ("int_source", lambda ctx: _load(42), Raises(err, "int", "list of dict rows")),
        ("float_source", lambda ctx: _load(1.5), Raises(err, "float")),
        ("object_source", lambda ctx: _load(object()), Raises(err, "object")),
        ("set_source", lambda ctx: _load({1, 2}), Raises(err, "set")),
        ("bytes_source", lambda ctx: _load(b"abc"), Raises(err, "bytes")),
        ("missing_jsonl", lambda ctx: _load(ctx.tmp / "no.jsonl"), Raises(err, "does not exist", "no.jsonl")),
        ("missing_csv", lambda ctx: _load(str(ctx.tmp / "no.csv")), Raises(err, "does not exist")),
        ("missing_parquet", lambda ctx: _load(str(ctx.tmp / "no.parquet")), Raises(err, "does not exist")),
        ("missing_json_gz", lambda ctx: _load(str(ctx.tmp / "no.json.gz")), Raises(err, "does not exist")),
        ("missing_folder", lambda ctx: _load(str(ctx.tmp / "nowhere" / "data")), Raises(err, "does not exist")),
        ("missing_relative", lambda ctx: _load("./not/here.jsonl"), Raises(err, "does not exist")),
        ("hub_id_offline", lambda ctx: _load("nobody/no-such-dataset"),
         Raises(err, "nobody/no-such-dataset", "Hub")),
        ("unknown_suffix_txt", lambda ctx: _load(_write(ctx, "d.txt", b"hello")), Raises(err, ".txt", ".jsonl")),
        ("unknown_suffix_xlsx", lambda ctx: _load(_write(ctx, "d.xlsx", b"PK")), Raises(err, ".xlsx")),
        ("no_suffix_file", lambda ctx: _load(_write(ctx, "data", b"x")), Raises(err, "without a suffix")),
        ("datasetdict_missing_split", lambda ctx: _load(DatasetDict({"validation": Dataset.from_list(GOOD)})),
         Raises(err, "split='train'", "validation")),
        ("datasetdict_train", lambda ctx: _load(DatasetDict({"train": Dataset.from_list(GOOD)})), _rows(3)),
        ("iterable_dataset", lambda ctx: _load(Dataset.from_list(GOOD).to_iterable_dataset()),
         Raises(err, "streaming")),
        ("dict_of_columns", lambda ctx: _load({"text": ["a", "b"]}), _rows(2)),
        ("dict_of_columns_unequal", lambda ctx: _load({"prompt": ["a", "b"], "completion": ["x"]}),
         Raises(err, "different lengths")),
        ("dict_single_row", lambda ctx: _load({"text": "one example"}), Raises(err, "'text' is not a list")),
        ("dict_empty", lambda ctx: _load({}), Raises(err, "columns")),
        ("dataframe", lambda ctx: _load(__import__("pandas").DataFrame({"text": ["a", "b", "c"]})), _rows(3)),
        ("dataframe_missing_cell", lambda ctx: _check(ctx, __import__("pandas").DataFrame(
            {"prompt": ["p", "q"], "completion": ["a", None]})), Raises(err, "completion is missing", "rows 2")),
        ("generator", lambda ctx: _load(r for r in GOOD), _rows(3)),
        ("iterator", lambda ctx: _load(iter(GOOD)), _rows(3)),
        ("tuple_rows", lambda ctx: _load(tuple(GOOD)), _rows(3)),
        ("empty_list", lambda ctx: _load([]), Raises(err, "empty")),
        ("empty_jsonl_file", lambda ctx: _load(_write(ctx, "e.jsonl", b"\n\n")), Raises(err, "empty")),
        ("jsonl_gz", lambda ctx: _load(_write(ctx, "d.jsonl.gz", gzip.compress(_jsonl()))), _rows(3)),
        ("jsonl_bz2", lambda ctx: _load(_write(ctx, "d.jsonl.bz2", bz2.compress(_jsonl()))), _rows(3)),
        ("jsonl_xz", lambda ctx: _load(_write(ctx, "d.jsonl.xz", lzma.compress(_jsonl()))), _rows(3)),
        ("json_array_gz", lambda ctx: _load(_write(ctx, "d.json.gz", gzip.compress(json.dumps(GOOD).encode()))),
         _rows(3)),
        ("corrupt_gz", lambda ctx: _load(_write(ctx, "d.jsonl.gz", b"not gzip at all")), Raises(err, "gzip")),
        ("csv_prompt_completion", lambda ctx: _load(_write(ctx, "d.csv", b"prompt,completion\nhi,there\nyo,ok\n")),
         _rows(2)),
        ("csv_gz", lambda ctx: _load(_write(ctx, "d.csv.gz", gzip.compress(b"text\nhello\nworld\n"))), _rows(2)),
        ("csv_extra_field", lambda ctx: _load(_write(ctx, "d.csv", b"text\nhello\nworld,extra\n")),
         Raises(err, "line 3", "more fields")),
        ("csv_empty", lambda ctx: _load(_write(ctx, "d.csv", b"")), Raises(err, "CSV file is empty")),
        ("csv_unknown_columns", lambda ctx: _load(_write(ctx, "d.csv", b"question,answer\nq,a\n")),
         Raises(err, "'answer'", "'question'")),
        ("parquet", lambda ctx: _load(_parquet(ctx)), _rows(3)),
        ("parquet_corrupt", lambda ctx: _load(_write(ctx, "d.parquet", b"PAR1garbage")), Raises(err, "parquet")),
        ("json_object_one_list", lambda ctx: _load(_write(ctx, "d.json", json.dumps({"data": GOOD}).encode())),
         _rows(3)),
        ("json_object_two_lists", lambda ctx: _load(_write(ctx, "d.json", json.dumps({"a": GOOD, "b": GOOD}).encode())),
         Raises(err, "exactly one list")),
        ("jsonl_latin1", lambda ctx: _load(_write(ctx, "d.jsonl", _jsonl()[:-1] + b'\n{"text": "caf\xe9"}\n')),
         Raises(err, "line 4", "not UTF-8", "0xe9")),
        ("csv_latin1", lambda ctx: _load(_write(ctx, "d.csv", b"text\nok\ncaf\xe9\n")), Raises(err, "line 3", "UTF-8")),
        ("json_latin1", lambda ctx: _load(_write(ctx, "d.json", b'[{"text": "\xff"}]')),
         Raises(err, "line 1", "UTF-8")),
        ("jsonl_utf8_bom", lambda ctx: _load(_write(ctx, "d.jsonl", b"\xef\xbb\xbf" + _jsonl())), _rows(3)),
        ("folder_of_jsonl", lambda ctx: (_write(ctx, "f/train.jsonl", _jsonl()), _load(ctx.tmp / "f"))[1], _rows(3)),
        ("folder_empty", lambda ctx: ((ctx.tmp / "f").mkdir(), _load(ctx.tmp / "f"))[1], Raises(err, "no data files")),
        ("folder_save_to_disk", lambda ctx: (Dataset.from_list(GOOD).save_to_disk(str(ctx.tmp / "s")),
                                             _load(str(ctx.tmp / "s")))[1], _rows(3)),
        ("check_dataset_path", lambda ctx: _check(ctx, str(_write(ctx, "d.jsonl", _jsonl()))), _rows(3)),
        ("check_dataset_dict_columns", lambda ctx: _check(ctx, {"text": ["hello", "world"]}), _rows(2)),
        ("check_dataset_none", lambda ctx: _check(ctx, None), Raises(err, "train_dataset is None")),
        ("check_dataset_missing_file", lambda ctx: _check(ctx, str(ctx.tmp / "x.jsonl")),
         Raises(err, "train_dataset", "does not exist")),
        ("check_dataset_generator", lambda ctx: _check(ctx, (r for r in GOOD)), _rows(3)),
        ("check_dataset_dataframe", lambda ctx: _check(ctx, __import__("pandas").DataFrame(
            {"prompt": ["a", "b"], "completion": ["c", "d"]})), _rows(2)),
        ("eval_dataset_named", lambda ctx: _check(ctx, None, where="eval_dataset"),
         Raises(err, "eval_dataset is None")),
    ]
    return [("data sources", Case(f"r3_data_{i}", a, e)) for i, a, e in rows]


# -- B. data fields: None / list / number in every field of every format ------------------------------------
BAD_VALUES = {"none": None, "number": 3, "float": 2.5, "list": ["x"], "bool": True}


def _field_row(field, value):
    if field == "text":
        return {"text": value}
    if field in ("prompt", "completion"):
        row = {"prompt": "p", "completion": "c"}
        row[field] = value
        return row
    if field in ("role", "content"):
        msg = {"role": "user", "content": "q"}
        msg[field] = value
        return {"messages": [msg, {"role": "assistant", "content": "a"}]}
    if field == "value":
        return {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": value}]}
    row = {"instruction": "i", "output": "o"}
    row[field] = value
    return row


_FIELD_NEEDLE = {"text": "text", "prompt": "prompt", "completion": "completion", "role": "messages[0].role",
                 "content": "messages[0].content", "value": "conversations[1].value", "instruction": "instruction",
                 "output": "output"}


def data_fields():
    Case, Raises = _ns()
    out = []
    for field, needle in _FIELD_NEEDLE.items():
        for kind, value in BAD_VALUES.items():
            if field == "prompt" and value is None:
                needle_here = "prompt is missing"
            elif field in ("prompt", "completion") and isinstance(value, list):
                needle_here = "both as message lists"  # a list is a message list: the other side must be one too
            elif field == "role" and value is None:
                needle_here = "messages[0].role"
            else:
                needle_here = needle
            row = _field_row(field, value)
            out.append(Case(f"r3_field_{field}_{kind}",
                            lambda ctx, row=row: _check(ctx, [dict(row), dict(row)]),
                            Raises(FastkitError, needle_here, "row 1")))
    extra = [
        ("text_empty", [{"text": "   "}], Raises(FastkitError, "text is empty")),
        ("completion_empty", [{"prompt": "p", "completion": ""}], Raises(FastkitError, "completion is empty")),
        ("prompt_str_completion_messages", [{"prompt": "p", "completion": [{"role": "assistant", "content": "a"}]}],
         Raises(FastkitError, "prompt is string but completion is list")),
        ("completion_messages_empty", [{"prompt": [{"role": "user", "content": "q"}], "completion": []}],
         Raises(FastkitError, "empty message list")),
        ("sharegpt_answer_none", [{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": None}]}],
         Raises(FastkitError, "conversations[1].value is missing or None")),
        ("sharegpt_answer_missing", [{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt"}]}],
         Raises(FastkitError, "conversations[1].value is missing")),
        ("sharegpt_tool_call_only", [{"conversations": [{"from": "human", "value": "q"},
                                                        {"from": "gpt", "tool_calls": "[{\"name\": \"f\"}]"}]}],
         Raises(FastkitError, "tool-call-only")),
        ("sharegpt_answer_empty", [{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": ""}]}],
         Raises(FastkitError, "last answer is empty")),
        ("sharegpt_last_turn_human", [{"conversations": [{"from": "human", "value": "q"}]}],
         Raises(FastkitError, "last turn is from 'human'")),
        ("sharegpt_unknown_speaker",
         [{"conversations": [{"from": "bot", "value": "q"}, {"from": "gpt", "value": "a"}]}],
         Raises(FastkitError, "conversations[0].from is 'bot'")),
        ("sharegpt_speaker_none", [{"conversations": [{"value": "q"}, {"from": "gpt", "value": "a"}]}],
         Raises(FastkitError, "conversations[0].from is None")),
        ("sharegpt_conversations_none", [{"conversations": None}], Raises(FastkitError, "conversations must be")),
        ("sharegpt_conversations_string", [{"conversations": "hi"}], Raises(FastkitError, "conversations must be")),
        ("alpaca_input_list", [{"instruction": "i", "input": ["x"], "output": "o"}],
         Raises(FastkitError, "input is a list")),
        ("alpaca_system_number", [{"instruction": "i", "system": 3, "output": "o"}],
         Raises(FastkitError, "system is int")),
        ("messages_role_empty", [{"messages": [{"role": "", "content": "q"}, {"role": "assistant", "content": "a"}]}],
         Raises(FastkitError, "messages[0].role")),
        ("messages_string", [{"messages": "hello"}], Raises(FastkitError, "non-empty list")),
        ("messages_empty_list", [{"messages": []}], Raises(FastkitError, "non-empty list")),
    ]
    out += [Case(f"r3_field_{i}", lambda ctx, d=d: _check(ctx, d), e) for i, d, e in extra]
    drops = {"text": [{"text": "ok"}, {"text": ""}, {"text": "fine"}],
             "prompt_completion": [{"prompt": "p", "completion": "c"}, {"prompt": "p", "completion": ""},
                                   {"prompt": "q", "completion": "d"}],
             "sharegpt": [{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": v}]}
                          for v in ("a", None, "b")],
             "alpaca": [{"instruction": "i", "output": v} for v in ("o", "", "p")]}
    for fmt, data in drops.items():
        out.append(Case(f"r3_field_drop_invalid_{fmt}", lambda ctx, d=data: _dropped(ctx, d), _two_rows_one_dropped))
    return [("data fields", c) for c in out]


def _dropped(ctx, data):
    import logging

    ctx.caplog.set_level(logging.WARNING, "fastkit")
    return _check(ctx, data, drop_invalid=True)


def _two_rows_one_dropped(ds, ctx):
    assert len(ds) == 2, len(ds)
    assert "dropped 1 of 3 rows that cannot be trained (rows 2)" in ctx.caplog.text, ctx.caplog.text


# -- C. saves: verified, atomic, inside the folder asked for -----------------------------------------------
@lru_cache(maxsize=1)
def _trained():
    """One trained LoRA twin shared by the save rows (saves never change it)."""
    from tests.helpers import train_lora_steps

    model, tok = FastModel.from_pretrained(TWIN, max_seq_length=64, twin=True)
    model = FastModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=False)
    return train_lora_steps(model, 2), tok


def _probe_logits(model):
    ids = torch.randint(3, 259, (1, 8), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return model(input_ids=ids).logits


@lru_cache(maxsize=1)
def _bpe_tokenizer():
    """The twin's byte-level BPE tokenizer with merges (llama.cpp, so save_gguf, needs them), SmolLM2's split."""
    from fastkit.families.twins import twin_bpe_tokenizer

    return twin_bpe_tokenizer("smollm")


def _gguf(ctx, name=None, q="f16", **kw):
    from fastkit.export import save_gguf

    model, _ = _trained()
    return save_gguf(model, _bpe_tokenizer(), ctx.tmp / "gguf", quantization=q, name=name, **kw)


def _inside(path, ctx):
    p = Path(path).resolve()
    assert p.parent == (ctx.tmp / "gguf").resolve(), p
    assert p.is_file() and p.name.endswith(".gguf"), p
    lines = (p.parent / "Modelfile").read_text().splitlines()
    assert lines[0] == f"FROM ./{p.name}", lines
    assert all(line.startswith(("FROM", "TEMPLATE", "PARAMETER", "{{", "{{-", "<|im_start|>", '"""', "# differs"))
               or not line for line in lines), lines
    assert [line for line in lines if line.startswith("FROM")] == lines[:1], lines  # the name injected no FROM
    assert not list(ctx.tmp.glob(".*partial*")), "a partial folder was left behind"


def _merged(ctx, path=None, **kw):
    from fastkit.export import save_merged

    model, tok = _trained()
    return save_merged(model, tok, path or ctx.tmp / "merged", dtype=kw.pop("dtype", torch.float32), **kw)


def _lora(ctx, path=None, **kw):
    from fastkit.export import save_lora

    model, tok = _trained()
    return save_lora(model, tok, path or ctx.tmp / "lora", **kw)


def _reload_merged(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _merged_matches(path, ctx):
    torch.testing.assert_close(_probe_logits(_reload_merged(path)), _probe_logits(_trained()[0]), rtol=0, atol=1e-4)
    assert not list(ctx.tmp.glob(".*partial*"))


def _previous_output_kept(kind):
    """Save once, save again with the writer failing halfway: the first output still loads and matches."""
    def action(ctx):
        model, _ = _trained()
        first = {"merged": _merged, "gguf": _gguf, "lora": _lora}[kind](ctx)
        before = sorted(p.name for p in Path(first if kind != "gguf" else Path(first).parent).iterdir())
        _break_writer_halfway(ctx, kind)
        try:
            {"merged": _merged, "gguf": _gguf, "lora": _lora}[kind](ctx)
        except (RuntimeError, KeyboardInterrupt):
            pass
        else:
            raise AssertionError("the broken writer did not raise")
        ctx.monkeypatch.undo()
        return first, before
    return action


class _Crash(RuntimeError):
    pass


def _break_writer_halfway(ctx, kind):
    if kind == "gguf":
        import gguf

        real, calls = gguf.GGUFWriter.write_tensor_data, []

        def half(self, *a, **k):
            calls.append(1)
            if len(calls) > 5:
                raise _Crash("disk full (simulated) after 5 tensors")
            return real(self, *a, **k)
        ctx.monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", half)
        return
    import peft.peft_model
    import safetensors.torch

    real_save = safetensors.torch.save_file

    def half(tensors, filename, *a, **k):
        real_save(dict(list(tensors.items())[: len(tensors) // 2]), filename, *a, **k)  # half the file on disk
        raise _Crash("disk full (simulated) halfway through the weights")
    ctx.monkeypatch.setattr(safetensors.torch, "save_file", half)
    ctx.monkeypatch.setattr(peft.peft_model, "safe_save_file", half)
    if kind == "merged":
        import transformers.modeling_utils as mu

        ctx.monkeypatch.setattr(mu, "safe_save_file", half, raising=False)


def _old_still_good(kind):
    def check(result, ctx):
        first, before = result
        folder = Path(first) if kind != "gguf" else Path(first).parent
        assert sorted(p.name for p in folder.iterdir()) == before, sorted(p.name for p in folder.iterdir())
        assert not list(ctx.tmp.glob(".*partial*")), "partial output left behind"
        want = _probe_logits(_trained()[0])
        if kind == "merged":
            got = _probe_logits(_reload_merged(first))
        elif kind == "gguf":
            from transformers import AutoModelForCausalLM

            got = _probe_logits(AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=Path(first).name,
                                                                     dtype=torch.float32).eval())
        else:
            from peft import PeftModel

            base, _ = FastModel.from_pretrained(TWIN, max_seq_length=64, twin=True)
            base.load_state_dict(_trained()[0].get_base_model().state_dict(), strict=False)
            got = _probe_logits(PeftModel.from_pretrained(base, str(folder)).eval())
        torch.testing.assert_close(got, want, rtol=0, atol=2e-3)
    return check


def _corrupt_written(ctx, kind):
    """The writer writes wrong numbers (a perturbed tensor): the save must refuse, the old output untouched."""
    {"merged": _merged, "gguf": _gguf, "lora": _lora}[kind](ctx)  # an earlier, good output
    if kind == "gguf":
        import fastkit.export.gguf.writer as ge

        real = ge._encode
        ctx.monkeypatch.setattr(ge, "_encode", lambda w, q: real(w * 1.5, q))
    elif kind == "merged":
        import fastkit.export.save as ex

        real_copy = ex._merged_copy

        def wrong(model):
            merged = real_copy(model)
            with torch.no_grad():
                merged.get_input_embeddings().weight.mul_(3.0)
            return merged
        ctx.monkeypatch.setattr(ex, "_merged_copy", wrong)
    else:
        from safetensors.torch import load_file, save_file

        import fastkit.patches.moe.peft_format as mlp

        def zero_b(model, folder):
            f = Path(folder) / "adapter_model.safetensors"
            t = load_file(str(f))
            save_file({k: v * 0 if "lora_B" in k else v for k, v in t.items()}, str(f))
        ctx.monkeypatch.setattr(mlp, "add_to_peft_adapter", zero_b)
    return {"merged": _merged, "gguf": _gguf, "lora": _lora}[kind](ctx)


def saves():
    Case, Raises = _ns()
    err = FastkitError
    out = []
    for i, name in enumerate(["../escape", "../../etc/evil", "/abs/path/model", "a/b/c", "x\nFROM ./evil.gguf",
                              'my "quoted" model', "with spaces and\ttabs", "..hidden", "名前-model", "ok_name-1.0"]):
        out.append(Case(f"r3_save_gguf_name_{i}", lambda ctx, n=name: _gguf(ctx, name=n), _inside))
    out += [
        Case("r3_save_gguf_name_only_dots", lambda ctx: _gguf(ctx, name="../.."), Raises(err, "name=", "letters")),
        Case("r3_save_gguf_name_empty", lambda ctx: _gguf(ctx, name="  "), Raises(err, "name must be a non-empty")),
        Case("r3_save_gguf_name_number", lambda ctx: _gguf(ctx, name=5), Raises(err, "name must be")),
        Case("r3_save_gguf_quantization_upper", lambda ctx: _gguf(ctx, q="Q8_0"), Raises(err, "quantization='Q8_0'")),
        Case("r3_save_gguf_quantization_unknown", lambda ctx: _gguf(ctx, q="q3_x"), Raises(err, "quantization='q3_x'")),
        Case("r3_save_gguf_verify_string", lambda ctx: _gguf(ctx, verify="yes"), Raises(err, "verify='yes'")),
        Case("r3_save_gguf_eos_injection", lambda ctx: _gguf_eos(ctx, 'x"\nFROM ./other.gguf'), _no_injection),
        Case("r3_save_gguf_wrong_tensor_refused", lambda ctx: _corrupt_written(ctx, "gguf"),
             Raises(err, "save_gguf", "does not match", "nothing was replaced")),
        Case("r3_save_merged_wrong_weights_refused", lambda ctx: _corrupt_written(ctx, "merged"),
             Raises(err, "save_merged", "does not match")),
        Case("r3_save_lora_wrong_adapter_refused", lambda ctx: _corrupt_written(ctx, "lora"),
             Raises(err, "save_lora", "does not match")),
        Case("r3_save_merged_interrupted_keeps_previous", _previous_output_kept("merged"), _old_still_good("merged")),
        Case("r3_save_gguf_interrupted_keeps_previous", _previous_output_kept("gguf"), _old_still_good("gguf")),
        Case("r3_save_lora_interrupted_keeps_previous", _previous_output_kept("lora"), _old_still_good("lora")),
        Case("r3_save_merged_matches_in_memory", lambda ctx: _merged(ctx), _merged_matches),
        Case("r3_save_merged_twice_replaces", lambda ctx: (_merged(ctx), _merged(ctx))[1], _merged_matches),
        Case("r3_save_merged_dtype_string", lambda ctx: _merged(ctx, dtype="fp32"), _merged_matches),
        Case("r3_save_merged_dtype_int8", lambda ctx: _merged(ctx, dtype=torch.int8), Raises(err, "dtype=torch.int8")),
        Case("r3_save_merged_dtype_unknown", lambda ctx: _merged(ctx, dtype="fp8"), Raises(err, "dtype='fp8'")),
        Case("r3_save_merged_verify_string", lambda ctx: _merged(ctx, verify=1), Raises(err, "verify=1")),
        Case("r3_save_merged_foreign_files_kept",  # round 4 (issue 31): kept, not refused and not deleted
             lambda ctx: (_write(ctx, "merged/checkpoint-1/x.bin", b"x"), _merged(ctx))[1],
             lambda out, ctx: _eq_bytes(ctx.tmp / "merged/checkpoint-1/x.bin", b"x")),
        Case("r3_save_merged_path_empty", lambda ctx: _save_to(ctx, ""), Raises(err, "path must be a folder path")),
        Case("r3_save_merged_path_none", lambda ctx: _save_to(ctx, None), Raises(err, "path must be a folder path")),
        Case("r3_save_merged_path_number", lambda ctx: _save_to(ctx, 3), Raises(err, "path must be a folder path")),
        Case("r3_save_lora_not_peft", lambda ctx: _lora_plain(ctx), Raises(err, "needs a PEFT model")),
        Case("r3_save_lora_foreign_files_kept",
             lambda ctx: (_write(ctx, "lora/notes.docx", b"x"), _lora(ctx))[1],
             lambda out, ctx: _eq_bytes(ctx.tmp / "lora/notes.docx", b"x")),
        Case("r3_save_merged_resized_vocab", lambda ctx: _resized(ctx), _resized_ok),
        Case("r3_save_merged_by_shard_interrupted_keeps_previous", _shard_interrupted, _shard_old_still_good),
    ]
    return [("saves", c) for c in out]


def _eq_bytes(file, want):
    assert Path(file).read_bytes() == want, file


def _save_to(ctx, path):
    from fastkit.export import save_merged

    model, tok = _trained()
    return save_merged(model, tok, path)


def _shard_interrupted(ctx):
    """The shard-by-shard merge (a local base checkpoint) interrupted halfway through its second save."""
    from fastkit.export import save_merged
    from fastkit.export.merge import can_merge_shards
    from fastkit.families.twins import twin
    from tests.helpers import save_twin, train_lora_steps

    src = save_twin(twin("llama", num_hidden_layers=1), ctx.tmp / "base")
    model, tok = FastModel.from_pretrained(src, max_seq_length=64)
    model = train_lora_steps(FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False), 2)
    assert can_merge_shards(model, src) is None
    first = save_merged(model, tok, ctx.tmp / "merged", dtype=torch.float32)
    want = _probe_logits(model.eval())
    _break_writer_halfway(ctx, "merged")
    train_lora_steps(model, 1)  # the second save would hold other weights
    try:
        save_merged(model, tok, ctx.tmp / "merged", dtype=torch.float32)
    except _Crash:
        pass
    else:
        raise AssertionError("the broken writer did not raise")
    ctx.monkeypatch.undo()
    return first, want


def _shard_old_still_good(result, ctx):
    first, want = result
    assert not list(ctx.tmp.glob(".*partial*"))
    torch.testing.assert_close(_probe_logits(_reload_merged(first)), want, rtol=0, atol=1e-4)  # the first save


def _lora_plain(ctx):
    from fastkit.export import save_lora
    from fastkit.families.twins import twin

    return save_lora(twin("llama", num_hidden_layers=1), ctx.tok, ctx.tmp / "l")


def _gguf_eos(ctx, eos):
    import copy

    from fastkit.export import save_gguf

    tok = copy.deepcopy(_bpe_tokenizer())
    tok.chat_template = None
    tok.add_special_tokens({"eos_token": eos})
    model, _ = _trained()
    return save_gguf(model, tok, ctx.tmp / "gguf", quantization="f16", verify=False)


def _no_injection(path, ctx):
    modelfile = Path(path).parent / "Modelfile"
    assert Path(path).is_file()
    if not modelfile.exists():  # no chat template: no TEMPLATE can be written, so no Modelfile at all (nothing to
        return                  # inject into; fastkit.export.gguf.modelfile refuses rather than let Ollama guess one)
    lines = modelfile.read_text().splitlines()
    assert lines[0] == f"FROM ./{Path(path).name}", lines
    assert [line for line in lines if line.startswith("FROM")] == lines[:1], lines  # no second FROM injected
    assert all(line.startswith(("FROM", "PARAMETER", "TEMPLATE")) for line in lines if line.strip()), lines


def _resized(ctx):
    from fastkit.export import save_merged
    from fastkit.families.twins import twin
    from tests.helpers import save_twin

    src = save_twin(twin("llama", num_hidden_layers=1), ctx.tmp / "base")
    model, tok = FastModel.from_pretrained(src, max_seq_length=64)
    model.resize_token_embeddings(model.config.vocab_size + 8)
    model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    return model, save_merged(model, tok, ctx.tmp / "merged", dtype=torch.float32)


def _resized_ok(result, ctx):
    model, path = result
    back = _reload_merged(path)
    assert back.get_input_embeddings().weight.shape[0] == model.get_input_embeddings().weight.shape[0]
    ids = torch.tensor([[3, 5, model.get_input_embeddings().weight.shape[0] - 1]])
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).logits, model.eval()(input_ids=ids).logits, rtol=0, atol=1e-4)


# -- D. run identity, resume, non-finite loss ------------------------------------------------------------
RUN_DATA = [_chat(f"question {i}", f"answer {i}") for i in range(6)]


def _trainer(out, *, data=None, lora=None, model_kw=None, stop_at=None, **kw):
    from transformers import TrainerCallback

    from fastkit.training import make_trainer

    model, tok = FastModel.from_pretrained(TWIN, max_seq_length=64, twin=True, **(model_kw or {}))
    model = FastModel.get_peft_model(model, **{"r": 4, "use_gradient_checkpointing": False, **(lora or {})})
    callbacks = []
    if stop_at:
        class Stop(TrainerCallback):
            def on_step_end(self, args, state, control, **k):
                control.should_training_stop = state.global_step >= stop_at
        callbacks.append(Stop())
    kw = {"max_steps": 3, "save_steps": 1, "dashboard": "none", "max_seq_length": 64, **kw}
    return make_trainer(model, tok, data if data is not None else RUN_DATA, output_dir=str(out),
                        callbacks=callbacks, **kw)


@lru_cache(maxsize=1)
def _stopped_run() -> Path:
    """A run of max_steps=3 stopped after step 2: checkpoint-1 and checkpoint-2, shared by the resume rows."""
    import tempfile

    from fastkit.training import fit

    out = Path(tempfile.mkdtemp(prefix="fastkit-hostile-run-")) / "out"
    fit(_trainer(out, stop_at=2), view="none")
    return out


def _copy_run(ctx) -> Path:
    out = ctx.tmp / "out"
    shutil.copytree(_stopped_run(), out)
    return out


def _resume(ctx, mutate=None, **kw):
    from fastkit.training import fit

    out = _copy_run(ctx)
    if mutate:
        mutate(out)
    trainer = _trainer(out, **kw)
    fit(trainer, view="none", resume=True)
    return trainer


def _resumed(trainer, ctx):
    assert trainer.state.fastkit_run == "resumed from checkpoint-2", getattr(trainer.state, "fastkit_run", None)
    assert trainer.state.global_step == 3, trainer.state.global_step


def _finished(ctx):
    from fastkit.training import fit

    trainer = _resume(ctx)
    fit(_trainer(ctx.tmp / "out"), view="none", resume=True)
    return trainer


def _fresh_by_default(ctx):
    from fastkit.training import fit

    out = _copy_run(ctx)
    trainer = _trainer(out, max_steps=1)
    fit(trainer, view="none")
    return trainer, out


def _fresh_ok(result, ctx):
    trainer, out = result
    assert trainer.state.fastkit_run == "new run" and trainer.state.global_step == 1
    assert sorted(p.name for p in (out / "previous-run").iterdir()) == ["checkpoint-1", "checkpoint-2"]
    assert (out / "checkpoint-1" / "fastkit_run.json").is_file()


def _rm(name):
    def mutate(out):
        target = out / "checkpoint-2" / name
        target.unlink()
    return mutate


def _non_finite(ctx, fill):
    from fastkit.training import fit

    trainer = _trainer(ctx.tmp / "nan", max_steps=2)
    with torch.no_grad():
        next(p for n, p in trainer.model.named_parameters() if "lora_B" in n).fill_(fill)
    fit(trainer, view="none")


def _guard_log(logs, fp16=False):
    from fastkit.training.identity import RunGuard

    guard = RunGuard.__new__(RunGuard)
    guard.problem = None
    control = SimpleNamespace(should_training_stop=False, should_save=True)
    guard.on_log(SimpleNamespace(fp16=fp16), SimpleNamespace(global_step=7), control, logs=logs)
    return guard, control


def _stopped_with(*needles):
    def check(result, ctx):
        guard, control = result
        assert control.should_training_stop and not control.should_save
        for n in needles:
            assert n in guard.problem, guard.problem
    return check


def _not_stopped(result, ctx):
    guard, control = result
    assert guard.problem is None and not control.should_training_stop


def runs():
    Case, Raises = _ns()
    err = FastkitError
    diff = "is from a different run"
    out = [
        Case("r3_run_resume_matching", lambda ctx: _resume(ctx), _resumed),
        Case("r3_run_resume_finished_refused", _finished, Raises(err, "finished run", "step 3 of max_steps=3")),
        Case("r3_run_fresh_by_default", _fresh_by_default, _fresh_ok),
        Case("r3_run_no_optimizer_state", lambda ctx: _resume(ctx, mutate=_rm("optimizer.pt")),
             Raises(err, "checkpoint-2", "no optimizer state")),
        Case("r3_run_no_identity_file", lambda ctx: _resume(ctx, mutate=_rm("fastkit_run.json")),
             Raises(err, "checkpoint-2", "fastkit_run.json")),
        Case("r3_run_resume_not_bool", lambda ctx: __import__("fastkit.training", fromlist=["fit"]).fit(
            _trainer(ctx.tmp / "o"), view="none", resume="yes"), Raises(err, "resume='yes'")),
        Case("r3_run_resume_from_missing_folder", lambda ctx: __import__("fastkit.training", fromlist=["fit"]).fit(
            _trainer(ctx.tmp / "o"), view="none", resume_from_checkpoint=str(ctx.tmp / "nope")),
             Raises(err, "resume_from_checkpoint", "no checkpoint")),
        Case("r3_run_nan_loss_stops", lambda ctx: _non_finite(ctx, float("nan")),
             Raises(err, "Training stopped", "loss was nan", "step 1")),
        Case("r3_run_inf_weights_stop", lambda ctx: _non_finite(ctx, float("inf")), Raises(err, "Training stopped")),
        Case("r3_run_guard_nan_loss_fp16", lambda ctx: _guard_log({"loss": math.nan}, fp16=True),
             _stopped_with("loss was nan", "step 7", "fp16", "65504")),
        Case("r3_run_guard_inf_grad_norm", lambda ctx: _guard_log({"loss": 1.0, "grad_norm": math.inf}),
             _stopped_with("gradient norm was inf")),
        Case("r3_run_guard_finite", lambda ctx: _guard_log({"loss": 1.0, "grad_norm": 0.5}), _not_stopped),
    ]
    mutations = {
        "learning_rate": dict(learning_rate=1e-3), "max_steps": dict(max_steps=4),
        "per_device_train_batch_size": dict(batch_size=2), "gradient_accumulation_steps":
            dict(gradient_accumulation_steps=2), "seed": dict(seed=1), "lr_scheduler_type":
            dict(lr_scheduler_type="cosine"), "weight_decay": dict(weight_decay=0.1),
        "max_length": dict(max_seq_length=48), "completion_only_loss": dict(completion_only_loss=False),
        "warmup_steps": dict(warmup_steps=2), "max_grad_norm": dict(max_grad_norm=0.5),
        "adapter.default.r": dict(lora=dict(r=8)), "adapter.default.lora_alpha": dict(lora=dict(lora_alpha=32)),
        "adapter.default.lora_dropout": dict(lora=dict(lora_dropout=0.1)),
        "adapter.default.target_modules": dict(lora=dict(target_modules=["q_proj", "v_proj"])),
        "training data": dict(data=RUN_DATA[:-1] + [_chat("other", "data")]),
        "model.num_hidden_layers": dict(model_kw=dict(twin_config=dict(num_hidden_layers=1))),
    }
    for key, kw in mutations.items():
        if key == "model.num_hidden_layers":
            out.append(Case("r3_run_differs_model", lambda ctx: _resume_other_model(ctx),
                            Raises(err, diff, "model.")))
            continue
        out.append(Case(f"r3_run_differs_{key.replace('.', '_').replace(' ', '_')}",
                        lambda ctx, kw=kw: _resume(ctx, **kw), Raises(err, diff, key)))
    return [("runs", c) for c in out]


def _resume_other_model(ctx):
    """The checkpoint's identity says another model (as a shared output_dir of two notebooks would)."""
    def mutate(out):
        f = out / "checkpoint-2" / "fastkit_run.json"
        ident = json.loads(f.read_text())
        ident["model"]["name_or_path"] = "Qwen/Qwen3-0.6B"
        ident["model"]["model_type"] = "qwen3"
        f.write_text(json.dumps(ident))
    return _resume(ctx, mutate=mutate)


# -- E. adapters: load_lora checks, idempotent get_peft_model ---------------------------------------------
@lru_cache(maxsize=1)
def _adapter_dir() -> Path:
    import tempfile

    from fastkit.export import save_lora

    model, tok = _trained()
    path = Path(tempfile.mkdtemp(prefix="fastkit-hostile-lora-")) / "adapter"
    save_lora(model, tok, path, verify=False)
    return path


def _adapter_copy(ctx, edit=None) -> Path:
    path = ctx.tmp / "adapter"
    shutil.copytree(_adapter_dir(), path)
    if edit:
        edit(path)
    return path


def _fresh(family="llama", **kw):
    from fastkit.families.twins import twin

    if family == "smollm":
        return FastModel.from_pretrained(TWIN, max_seq_length=64, twin=True)[0]
    return FastModel.patch(twin(family, **kw))


def _load_lora(ctx, model, edit=None, **kw):
    from fastkit.export import load_lora

    return load_lora(model, _adapter_copy(ctx, edit), **kw)


def _edit_config(**changes):
    def edit(path):
        f = path / "adapter_config.json"
        values = json.loads(f.read_text())
        values.update(changes)
        f.write_text(json.dumps(values))
    return edit


def _drop_info(path):
    (path / "fastkit_adapter.json").unlink()


def _same_logits_as_trained(model, ctx):
    torch.testing.assert_close(_probe_logits(model.eval()), _probe_logits(_trained()[0]), rtol=0, atol=1e-5)


def _onto_existing_adapter(ctx):
    base = FastModel.get_peft_model(_fresh("smollm"), r=8, use_gradient_checkpointing=False)
    base.get_base_model().load_state_dict({k: v for k, v in _trained()[0].get_base_model().state_dict().items()
                                           if "lora_" not in k}, strict=False)
    return _load_lora(ctx, base)


def _onto_plain(ctx, edit=None):
    base = _fresh("smollm")
    base.load_state_dict({k.replace("base_layer.", ""): v for k, v in _trained()[0].get_base_model().state_dict()
                          .items() if "lora_" not in k}, strict=False)
    return _load_lora(ctx, base, edit)


def _onto_plain_no_info(ctx):
    return _onto_plain(ctx, _drop_info)


def _peft_twice(ctx, **second):
    model = FastModel.get_peft_model(_fresh("smollm"), r=4, use_gradient_checkpointing=False)
    again = FastModel.get_peft_model(model, **{"r": 4, "use_gradient_checkpointing": False, **second})
    return model, again


def _same_object(result, ctx):
    model, again = result
    assert again is model
    assert type(model.base_model.model).__name__ == "LlamaForCausalLM"  # not a PEFT model nested in PEFT


def _peft_opt(**kw):
    return lambda ctx: FastModel.get_peft_model(_fresh("llama", num_hidden_layers=1), **kw)


def adapters():
    Case, Raises = _ns()
    err = FastkitError
    out = [
        Case("r3_lora_other_family", lambda ctx: _load_lora(ctx, _fresh("qwen3")),
             Raises(err, "another model", "model_type: adapter 'llama', model 'qwen3'")),
        Case("r3_lora_no_info_same_model", _onto_plain_no_info, _same_logits_as_trained),
        Case("r3_lora_fewer_layers", lambda ctx: _load_lora(ctx, _fresh("llama", num_hidden_layers=1), _drop_info),
             Raises(err, "model.layers.1", "layers 0..0")),
        Case("r3_lora_fewer_layers_info", lambda ctx: _load_lora(ctx, _fresh("llama", num_hidden_layers=1)),
             Raises(err, "num_hidden_layers: adapter 2, model 1")),
        Case("r3_lora_other_hidden_size", lambda ctx: _load_lora(ctx, _fresh("llama", hidden_size=96), _drop_info),
             Raises(err, "has shape", "size 96")),
        Case("r3_lora_rank_mismatch", lambda ctx: _load_lora(ctx, _fresh("smollm"), _edit_config(r=8)),
             Raises(err, "rank 4", "r=8")),
        Case("r3_lora_not_lora", lambda ctx: _load_lora(ctx, _fresh("smollm"), _edit_config(peft_type="IA3")),
             Raises(err, "IA3")),
        Case("r3_lora_bad_json", lambda ctx: _load_lora(ctx, _fresh("smollm"), lambda p: (
            p / "adapter_config.json").write_text("{oops")), Raises(err, "not valid JSON")),
        Case("r3_lora_no_config", lambda ctx: _load_lora(ctx, _fresh("smollm"), lambda p: (
            p / "adapter_config.json").unlink()), Raises(err, "no adapter_config.json")),
        Case("r3_lora_no_weights", lambda ctx: _load_lora(ctx, _fresh("smollm"), lambda p: (
            p / "adapter_model.safetensors").unlink()), Raises(err, "no adapter_model.safetensors")),
        Case("r3_lora_path_is_file", lambda ctx: __import__("fastkit.export", fromlist=["x"]).load_lora(
            _fresh("smollm"), _write(ctx, "a.json", b"{}")), Raises(err, "is an existing file")),
        Case("r3_lora_is_trainable_string", lambda ctx: _load_lora(ctx, _fresh("smollm"), is_trainable="no"),
             Raises(err, "is_trainable='no'")),
        Case("r3_lora_onto_plain_model", _onto_plain, _same_logits_as_trained),
        Case("r3_lora_onto_model_with_adapter", _onto_existing_adapter, _same_logits_as_trained),
        Case("r3_peft_twice_idempotent", lambda ctx: _peft_twice(ctx), _same_object),
        Case("r3_peft_twice_other_rank", lambda ctx: _peft_twice(ctx, r=8),
             Raises(err, "already has a LoRA adapter", "r=8")),
        Case("r3_peft_twice_other_targets", lambda ctx: _peft_twice(ctx, target_modules=["q_proj"]),
             Raises(err, "target_modules=['q_proj']")),
        Case("r3_peft_twice_other_alpha", lambda ctx: _peft_twice(ctx, lora_alpha=64), Raises(err, "lora_alpha=64")),
    ]
    bad = [("r", 0), ("r", -4), ("r", 2.5), ("r", "16"), ("r", True), ("lora_alpha", 0), ("lora_alpha", "16"),
           ("lora_dropout", 1.5), ("lora_dropout", -0.1), ("target_modules", []), ("target_modules", 3),
           ("target_modules", [""]), ("bias", "some"), ("use_gradient_checkpointing", "yes")]
    for name, value in bad:
        out.append(Case(f"r3_peft_option_{name}_{value!r}".replace("'", "q"), _peft_opt(**{name: value}),
                        Raises(err, name)))
    return [("adapters", c) for c in out]


# -- F. public options ----------------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def _shared_model():
    return FastModel.from_pretrained(TWIN, max_seq_length=64, twin=True)[0]


def _mt(ctx, **kw):
    from fastkit.training import make_trainer

    kw.setdefault("output_dir", str(ctx.tmp / "o"))
    return make_trainer(_shared_model(), ctx.tok, GOOD, **kw)


def _fit(ctx, **kw):
    from fastkit.training import fit

    trainer = SimpleNamespace(callback_handler=SimpleNamespace(callbacks=[]))
    return fit(trainer, **kw)


def _plan(ctx, **kw):
    from fastkit.families.twins import twin
    from fastkit.plan import plan

    return plan(twin("llama", num_hidden_layers=1).config, gpu="cpu", **{"max_seq_length": 64, **kw})


def options():
    Case, Raises = _ns()
    err = FastkitError
    trainer_bad = [("learning_rate", 0), ("learning_rate", -1e-4), ("learning_rate", "2e-4"),
                   ("learning_rate", float("nan")), ("learning_rate", True), ("batch_size", 0), ("batch_size", 1.5),
                   ("batch_size", "2"), ("gradient_accumulation_steps", 0), ("eval_steps", 0), ("save_steps", 0),
                   ("save_steps", -3), ("save_steps", "10"), ("packing", "yes"), ("packing", 1),
                   ("completion_only_loss", None), ("drop_long", "no"), ("drop_invalid", 0), ("seed", -1),
                   ("seed", "x"), ("dashboard", "fancy"), ("output_dir", ""), ("output_dir", None),
                   ("chunked_loss", "auto"), ("measure_syncs", "y")]
    out = [Case(f"r3_opt_make_trainer_{n}_{v!r}".replace("'", ""), lambda ctx, n=n, v=v: _mt(ctx, **{n: v}),
                Raises(err, n)) for n, v in trainer_bad]
    out += [
        Case("r3_opt_make_trainer_output_dir_file", lambda ctx: _mt(ctx, output_dir=str(_write(ctx, "f", b"x"))),
             Raises(err, "output_dir=", "existing file")),
        Case("r3_opt_make_trainer_eval_steps_without_eval", lambda ctx: _mt(ctx, eval_steps=5),
             Raises(err, "eval_steps", "there is no eval set", "eval_split")),
        Case("r3_opt_make_trainer_override_typo", lambda ctx: _mt(ctx, learnin_rate=1e-3),
             Raises(err, "unknown option 'learnin_rate'", "did you mean 'learning_rate'")),
        Case("r3_opt_make_trainer_override_unknown", lambda ctx: _mt(ctx, zzz_option=1),
             Raises(err, "unknown option 'zzz_option'")),
        Case("r3_opt_fit_view", lambda ctx: _fit(ctx, view="gui"), Raises(err, "view='gui'")),
        Case("r3_opt_fit_warmup_negative", lambda ctx: _fit(ctx, warmup_steps=-1), Raises(err, "warmup_steps")),
        Case("r3_opt_fit_measure_syncs", lambda ctx: _fit(ctx, measure_syncs="y"), Raises(err, "measure_syncs")),
        Case("r3_opt_fit_unknown_kwarg", lambda ctx: _fit(ctx, resume_from=True),
             Raises(err, "unknown option 'resume_from'", "resume_from_checkpoint")),
        Case("r3_opt_plan_past_context", lambda ctx: _plan(ctx, max_seq_length=10**6),
             Raises(err, "max_seq_length=1000000", "max_position_embeddings")),
        Case("r3_opt_plan_attn_typo", lambda ctx: _plan(ctx, attn="sdpa2"), Raises(err, "attn")),
        Case("r3_opt_plan_checkpointing_string", lambda ctx: _plan(ctx, checkpointing="yes"),
             Raises(err, "checkpointing")),
        Case("r3_opt_plan_offload_int", lambda ctx: _plan(ctx, offload=1), Raises(err, "offload")),
        Case("r3_opt_plan_4bit_string", lambda ctx: _plan(ctx, load_in_4bit="yes"), Raises(err, "load_in_4bit")),
        Case("r3_opt_plan_dtype_string", lambda ctx: _plan(ctx, dtype="fp16"), Raises(err, "dtype")),
        Case("r3_opt_plan_expert_lora_none", lambda ctx: _plan(ctx, expert_lora=None), Raises(err, "expert_lora")),
        Case("r3_opt_plan_non_decoder_bert", lambda ctx: __import__("fastkit.plan", fromlist=["plan"]).plan(
            {"model_type": "bert"}, gpu="cpu"), Raises(err, "'bert'", "decoder-only")),
        Case("r3_opt_plan_non_decoder_t5", lambda ctx: __import__("fastkit.plan", fromlist=["plan"]).plan(
            {"model_type": "t5"}, gpu="cpu"), Raises(err, "'t5'", "decoder-only")),
        Case("r3_opt_plan_within_context", lambda ctx: _plan(ctx), lambda r, ctx: _assert(r.components)),
    ]
    return [("options", c) for c in out]


def _assert(value):
    assert value, value


# -- G. the CLI: one line, distinct exit codes ----------------------------------------------------------------
def _cli(ctx, *argv, env=None):
    from fastkit.cli import main

    for k, v in (env or {}).items():
        ctx.monkeypatch.setenv(k, v)
    code = main(list(argv))
    return code, ctx.capsys.readouterr()


def _config_dir(ctx, **changes) -> str:
    from fastkit.families.twins import twin

    cfg = twin("llama", num_hidden_layers=1).config
    for k, v in changes.items():
        setattr(cfg, k, v)
    cfg.save_pretrained(str(ctx.tmp / "cfg"))
    return str(ctx.tmp / "cfg")


def _exit(code, *needles):
    def check(result, ctx):
        got, captured = result
        assert got == code, (got, captured.err)
        lines = [line for line in captured.err.splitlines() if line.strip()]
        assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
        for n in needles:
            assert n in captured.err, captured.err
    return check


def _crash(ctx, exc):
    def boom(*a, **k):
        raise exc
    ctx.monkeypatch.setattr("fastkit.plan.plan", boom)
    return _cli(ctx, "plan", _config_dir(ctx))


def _bench_empty(ctx):
    from benchmarks.common import write_outputs

    table = ctx.tmp / "bench_moe.md"
    table.write_text("| a | b |\n|---|---|\n| 1 | 2 |\n")
    try:
        write_outputs("moe", "## bench\n\n| case | ratio |\n|---|---|\n", out=ctx.tmp)
    finally:
        assert table.read_text().endswith("| 1 | 2 |\n"), "the committed table was overwritten"


def _plan_ok(ctx, *argv):
    code, captured = _cli(ctx, "plan", _config_dir(ctx), *argv)
    return code, captured


def _code(code):
    def check(result, ctx):
        assert result[0] == code, result
    return check


def cli():
    Case, Raises = _ns()
    out = [
        Case("r3_cli_plan_missing_model", lambda ctx: _cli(ctx, "plan", str(ctx.tmp / "nope")),
             _exit(2, "fastkit plan:")),
        Case("r3_cli_plan_unknown_gpu", lambda ctx: _cli(ctx, "plan", _config_dir(ctx), "--gpu", "t5"),
             _exit(2, "--gpu 't5'")),
        Case("r3_cli_plan_past_context", lambda ctx: _cli(ctx, "plan", _config_dir(ctx), "--max-seq-length", "999999"),
             _exit(2, "max_position_embeddings")),
        Case("r3_cli_plan_non_decoder", lambda ctx: (_write(ctx, "bert/config.json", b'{"model_type": "bert"}'),
                                                     _cli(ctx, "plan", str(ctx.tmp / "bert")))[1],
             _exit(2, "decoder-only")),
        Case("r3_cli_plan_unknown_model_type", lambda ctx: (_write(ctx, "x/config.json", b'{"model_type": "zzz"}'),
                                                            _cli(ctx, "plan", str(ctx.tmp / "x")))[1],
             _exit(2, "'zzz'")),
        Case("r3_cli_plan_bad_json", lambda ctx: (_write(ctx, "j/config.json", b"{oops"),
                                                  _cli(ctx, "plan", str(ctx.tmp / "j")))[1], _exit(2, "config")),
        Case("r3_cli_plan_fits", lambda ctx: _plan_ok(ctx, "--max-seq-length", "64", "--gpu", "16"), _code(0)),
        Case("r3_cli_plan_does_not_fit", lambda ctx: _plan_ok(ctx, "--max-seq-length", "64", "--gpu", "0.00001"),
             _code(1)),
        Case("r3_cli_internal_error_is_failed", lambda ctx: _crash(ctx, RuntimeError("kaboom\nsecond line")),
             _exit(3, "failed: RuntimeError: kaboom second line")),
        Case("r3_cli_out_of_memory_is_failed", lambda ctx: _crash(ctx, MemoryError("no memory")),
             _exit(3, "failed: MemoryError")),
        Case("r3_cli_fastkit_error_is_bad_input", lambda ctx: _crash(ctx, FastkitError("bad thing")),
             _exit(2, "fastkit plan: bad thing")),
        Case("r3_cli_interrupted", lambda ctx: _crash(ctx, KeyboardInterrupt()), _exit(130, "interrupted")),
        Case("r3_cli_debug_shows_traceback", lambda ctx: (ctx.monkeypatch.setenv("FASTKIT_DEBUG", "1"),
                                                          _crash(ctx, RuntimeError("deep")))[1],
             Raises(RuntimeError, "deep")),
        Case("r3_cli_bench_nothing_measured", _bench_empty, Raises(FastkitError, "nothing was measured")),
        Case("r3_cli_bench_error_exit_2", lambda ctx: (lambda rc: (rc, ctx.capsys.readouterr()))(
            __import__("benchmarks.common", fromlist=["run_cli"]).run_cli(
                lambda argv: (_ for _ in ()).throw(FastkitError("nothing was measured")), [])),
             _exit(2, "benchmarks: nothing was measured")),
    ]
    return [("cli", c) for c in out]


def all_rows():
    """``(class, Case)`` for every round-3 row."""
    return data_sources() + data_fields() + saves() + runs() + adapters() + options() + cli()
