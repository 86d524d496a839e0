"""Hostile inputs (issue 15): each is a clear FastkitError naming the field, or a correct result.

One table, one parametrized test: add a row to add a case. A row is ``Case(id, action, expect)``:
``action(ctx)`` performs the hostile action; ``expect`` is ``Raises(type, substring...)`` or a
callable that checks the action's result (and raises AssertionError when it is wrong).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from datasets import Dataset

from fastkit import FastkitError, FastModel, active_patches
from fastkit.data import check_dataset, load_chat_dataset
from fastkit.families.twins import twin
from fastkit.patches.offload.testing import OffloadTestConfig
from fastkit.patches.packing.patch import LENGTHS_KWARG, PackedCollator, batch_lengths
from tests.helpers import save_twin

TWIN = "HuggingFaceTB/SmolLM2-135M-Instruct"


@dataclass
class Ctx:
    """What a case may use: a fresh folder, monkeypatch, caplog, a tokenizer."""

    tmp: Path
    monkeypatch: Any
    caplog: Any
    tok: Any
    capsys: Any = None


@dataclass
class Raises:
    """The action raises ``error`` and its message contains every one of ``needles``."""

    error: type
    needles: tuple[str, ...]

    def __init__(self, error: type, *needles: str):
        self.error, self.needles = error, needles


@dataclass
class Case:
    id: str
    action: Callable[[Ctx], Any]
    expect: Raises | Callable[[Any, Ctx], None]


# -- small builders ---------------------------------------------------------------------------------------
def _chat(q: str, a: Any = "a", **extra) -> dict:
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}], **extra}


def _twin_model(**kwargs):
    return FastModel.from_pretrained(TWIN, max_seq_length=128, twin=True, **kwargs)


def _saved_llama(ctx: Ctx) -> Path:
    return Path(save_twin(twin("llama", num_hidden_layers=1), ctx.tmp / "llama"))


def _unknown():
    """nemotron: not in fastkit's table, and refused by the self-check (its decoder layer drops **kwargs, so
    packed metadata never reaches attention): loaded unpatched, packed batches must be refused."""
    from transformers import AutoModelForCausalLM

    from fastkit.families.twins import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("nemotron"), attn_implementation="sdpa")
    return FastModel.patch(model)


def _make_trainer(ctx: Ctx, data=None, model=None, **kwargs):
    from fastkit.training import make_trainer

    model = model if model is not None else _twin_model()[0]
    data = data if data is not None else [_chat(f"q{i}", f"a{i}") for i in range(4)]
    return make_trainer(model, ctx.tok, data, output_dir=str(ctx.tmp / "out"), **kwargs)


def _packed_llama():
    model = twin("llama", num_hidden_layers=1)
    return FastModel.patch(model, patches=["packing"])


def _save_merged(ctx: Ctx, model=None, path=None):
    from fastkit.export import save_merged

    if model is None:
        model = FastModel.get_peft_model(_twin_model()[0], r=4, use_gradient_checkpointing=False)
    return save_merged(model, ctx.tok, path if path is not None else ctx.tmp / "merged", dtype=torch.float32)


def _offload_peft():

    cfg = OffloadTestConfig(force_cpu_stream=True, min_tokens=1, min_bytes=0)
    model = FastModel.get_peft_model(_twin_model()[0], r=4, use_gradient_checkpointing="offload", offload_config=cfg)
    assert "offload" in active_patches(model.get_base_model())
    return model


def _file(ctx: Ctx, name: str, text: str) -> Path:
    path = ctx.tmp / name
    path.write_text(text)
    return path


def _truncated(ctx: Ctx) -> Path:
    path = _saved_llama(ctx)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    return path


def _collate(batch: dict):
    return PackedCollator(lambda features: dict(batch))([])


def _cli(*argv: str):
    from fastkit.cli import main

    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    return exc.value.code


# -- result checks ------------------------------------------------------------------------------------------
def _saved_weights(path, ctx):
    assert any(Path(path).glob("*.safetensors")), f"no weights in {path}"


def _model_dtype(dtype):
    def check(result, ctx):
        assert result[0].dtype == dtype, result[0].dtype
    return check


def _packed_logits_match_list_lengths(result, ctx):
    got, want = result
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _no_cache(out, ctx):
    assert out.past_key_values is None, "a packed forward returned a KV cache that holds every document"


def _dropped_and_counted(ds, ctx):
    assert len(ds) == 2, len(ds)
    assert "dropped 1 of 3 rows that cannot be trained (rows 2)" in ctx.caplog.text


def _is_trainer(trainer, ctx):
    from trl import SFTTrainer

    assert len(trainer.train_dataset) > 0 and isinstance(trainer, SFTTrainer)


def _rows_equal(n):
    def check(ds, ctx):
        assert len(ds) == n and "messages" in ds.column_names
    return check


def _exit_2(code, ctx):
    assert code == 2


_LONG = "a long question " * 20

CASES = [
    # -- silently wrong before issue 15 ------------------------------------------------------------------
    Case("save_merged_into_existing_file",
         lambda ctx: _save_merged(ctx, path=_file(ctx, "weights.bin", "x")), Raises(FastkitError, "path=", "file")),
    Case("save_that_writes_nothing_raises",
         lambda ctx: (ctx.monkeypatch.setattr("transformers.PreTrainedModel.save_pretrained", lambda *a, **k: None),
                      _save_merged(ctx)), Raises(FastkitError, "save_merged", "did not happen")),
    Case("check_dataset_long_row_after_first_256",
         lambda ctx: check_dataset(Dataset.from_list([_chat("q")] * 300 + [_chat(_LONG)]), ctx.tok, 64),
         Raises(FastkitError, "max_seq_length=64", "row 301")),
    Case("every_row_counted_once_in_batches_equals_row_by_row", lambda ctx: _batched_vs_row_counts(ctx),
         lambda got, ctx: _eq(got[0], got[1])),
    Case("messages_and_text_checks_the_trained_column",
         lambda ctx: check_dataset(Dataset.from_list([_chat(_LONG, text="short")]), ctx.tok, 64),
         Raises(FastkitError, "max_seq_length=64")),
    Case("cu_seq_lens_disagree_with_position_ids",
         lambda ctx: batch_lengths({"input_ids": torch.zeros(1, 16, dtype=torch.long), "max_length_q": 7,
                                    "cu_seq_lens_q": torch.tensor([0, 5, 12, 16], dtype=torch.int32),
                                    "position_ids": torch.arange(16)[None]}),
         Raises(FastkitError, "cu_seq_lens_q", "position_ids")),
    Case("row_lengths_disagree_with_position_ids",
         lambda ctx: _collate({"input_ids": torch.zeros(1, 16, dtype=torch.long), LENGTHS_KWARG: [[8, 8]],
                               "position_ids": torch.cat([torch.arange(4), torch.arange(12)])[None]}),
         Raises(FastkitError, LENGTHS_KWARG, "position_ids")),
    Case("max_length_q_disagrees_with_cu_seq_lens",
         lambda ctx: batch_lengths({"input_ids": torch.zeros(1, 16, dtype=torch.long), "max_length_q": 9,
                                    "cu_seq_lens_q": torch.tensor([0, 5, 12, 16], dtype=torch.int32)}),
         Raises(FastkitError, "max_length_q", "cu_seq_lens_q")),
    Case("max_length_q_disagrees_with_row_lengths_in_forward",
         lambda ctx: _packed_llama()(input_ids=torch.randint(3, 300, (1, 12)), max_length_q=3,
                                     **{LENGTHS_KWARG: [[5, 7]]}),
         Raises(FastkitError, "max_length_q", LENGTHS_KWARG)),
    Case("packed_forward_with_use_cache_returns_no_cache",
         lambda ctx: _packed_llama()(input_ids=torch.randint(3, 300, (1, 12)), use_cache=True,
                                     **{LENGTHS_KWARG: [[5, 7]]}), _no_cache),
    Case("last_turn_not_assistant",
         lambda ctx: check_dataset([_chat("q"), {"messages": [{"role": "user", "content": "q"}]}], ctx.tok, 64),
         Raises(FastkitError, "messages", "rows 2", "last turn is 'user'", "drop_invalid=True")),
    Case("last_turn_not_assistant_dropped_and_counted",
         lambda ctx: (ctx.caplog.set_level(logging.WARNING, "fastkit"),
                      check_dataset([_chat("q"), {"messages": [{"role": "user", "content": "q"}]}, _chat("r")],
                                    ctx.tok, 64, drop_invalid=True))[1], _dropped_and_counted),
    Case("assistant_content_none",
         lambda ctx: check_dataset([_chat("q"), _chat("q", None)], ctx.tok, 64),
         Raises(FastkitError, "messages", "rows 2", "assistant answer is None")),
    Case("make_trainer_max_steps_zero", lambda ctx: _make_trainer(ctx, max_steps=0), Raises(FastkitError, "max_steps")),
    Case("make_trainer_max_seq_length_true",
         lambda ctx: _make_trainer(ctx, max_seq_length=True),
         Raises(FastkitError, "max_seq_length must be a positive int", "True")),
    Case("from_pretrained_max_seq_length_true",
         lambda ctx: FastModel.from_pretrained(TWIN, max_seq_length=True, twin=True),
         Raises(FastkitError, "max_seq_length must be a positive int")),
    Case("twin_honours_dtype", lambda ctx: _twin_model(dtype=torch.bfloat16), _model_dtype(torch.bfloat16)),
    Case("twin_refuses_load_in_4bit", lambda ctx: _twin_model(load_in_4bit=True),
         Raises(FastkitError, "load_in_4bit", "twin")),
    Case("unknown_family_packed_batch_raises",
         lambda ctx: _unknown()(input_ids=torch.randint(3, 300, (1, 8)), max_length_q=4,
                             cu_seq_lens_q=torch.tensor([0, 4, 8], dtype=torch.int32)),
         Raises(FastkitError, "cu_seq_lens_q", "nemotron", "packing=False")),
    Case("unknown_family_packed_batch_raises_under_peft",
         lambda ctx: FastModel.get_peft_model(_unknown(), r=4, use_gradient_checkpointing=False)(
             input_ids=torch.randint(3, 300, (1, 8)), **{LENGTHS_KWARG: [[4, 4]]}),
         Raises(FastkitError, LENGTHS_KWARG, "nemotron")),
    Case("unknown_family_position_ids_packed_batch_raises",
         lambda ctx: _unknown().train()(input_ids=torch.randint(3, 300, (1, 8)),
                                     position_ids=torch.cat([torch.arange(4), torch.arange(4)])[None]),
         Raises(FastkitError, "position_ids", "nemotron", "packing=False")),
    Case("unknown_family_left_padded_batch_is_not_mistaken_for_packing",
         lambda ctx: _unknown().train()(input_ids=torch.randint(3, 300, (1, 6)),
                                     attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1]]),
                                     position_ids=torch.tensor([[1, 1, 0, 1, 2, 3]])),
         lambda out, ctx: _eq(tuple(out.logits.shape), (1, 6, 320))),
    Case("unknown_family_make_trainer_packing_refused",
         lambda ctx: _make_trainer(ctx, model=_unknown(), max_steps=1),
         Raises(FastkitError, "packing=True", "nemotron")),
    Case("packing_patched_after_an_unpatched_load_still_packs",
         lambda ctx: _packed_after_plain(), lambda out, ctx: _eq(tuple(out.logits.shape), (1, 12, 320))),
    Case("use_safetensors_false_refused",
         lambda ctx: FastModel.from_pretrained(str(_saved_llama(ctx)), use_safetensors=False),
         Raises(FastkitError, "use_safetensors=False")),
    # -- unclear before issue 15 ----------------------------------------------------------------------------
    Case("dtype_fp16_string", lambda ctx: _twin_model(dtype="fp16"), _model_dtype(torch.float16)),
    Case("dtype_bf16_string_real_load",
         lambda ctx: FastModel.from_pretrained(str(_saved_llama(ctx)), dtype="bf16"), _model_dtype(torch.bfloat16)),
    Case("dtype_unknown_string", lambda ctx: _twin_model(dtype="fp8"), Raises(FastkitError, "dtype='fp8'", "fp16")),
    Case("patches_single_name_string",
         lambda ctx: active_patches(_twin_model(patches="packing")[0]), lambda got, ctx: _eq(got, ["packing"])),
    Case("patches_unknown_string", lambda ctx: _twin_model(patches="pack"),
         Raises(FastkitError, "Unknown patch 'pack'")),
    Case("row_lengths_as_numpy_ints",
         lambda ctx: _numpy_vs_list_lengths(), _packed_logits_match_list_lengths),
    Case("save_merged_with_activation_offload", lambda ctx: _save_merged(ctx, model=_offload_peft()), _saved_weights),
    Case("make_trainer_plain_list", lambda ctx: _make_trainer(ctx, max_steps=1), _is_trainer),
    Case("messages_none", lambda ctx: check_dataset([_chat("q"), {"messages": None}], ctx.tok, 64),
         Raises(FastkitError, "messages is missing", "rows 2")),
    Case("messages_missing_in_a_row", lambda ctx: check_dataset([_chat("q"), {"text": "x"}], ctx.tok, 64),
         Raises(FastkitError, "messages is missing", "rows 2")),
    Case("content_not_a_string", lambda ctx: check_dataset([_chat("q", 42)], ctx.tok, 64),
         Raises(FastkitError, "row 1", "messages[1].content", "int")),
    Case("content_parts", lambda ctx: check_dataset([_chat([{"type": "text", "text": "q"}])], ctx.tok, 64),
         Raises(FastkitError, "messages[0].content", "content parts")),
    Case("content_parts_in_a_dataset",
         lambda ctx: check_dataset(Dataset.from_list([_chat([{"type": "text", "text": "q"}],
                                                            [{"type": "text", "text": "a"}])]), ctx.tok, 64),
         Raises(FastkitError, "messages[0].content", "content parts")),
    Case("malformed_jsonl_line",
         lambda ctx: load_chat_dataset(_file(ctx, "d.jsonl", json.dumps(_chat("q")) + "\n{not json\n")),
         Raises(FastkitError, "line 2", "d.jsonl")),
    Case("uppercase_jsonl_extension",
         lambda ctx: load_chat_dataset(_file(ctx, "d.JSONL", "\n".join(json.dumps(_chat(q)) for q in "ab"))),
         _rows_equal(2)),
    Case("mixed_column_types", lambda ctx: load_chat_dataset([{"text": "a"}, {"text": 3}]),
         Raises(FastkitError, "column 'text'", "rows 2")),
    Case("non_dict_rows", lambda ctx: load_chat_dataset([_chat("q"), "just a string"]),
         Raises(FastkitError, "row 2", "not a dict")),
    Case("cli_steps_negative", lambda ctx: _cli("quickstart", "--steps", "-1"), _exit_2),
    Case("make_trainer_max_steps_negative", lambda ctx: _make_trainer(ctx, max_steps=-1),
         Raises(FastkitError, "max_steps", "-1")),
    Case("truncated_safetensors", lambda ctx: FastModel.from_pretrained(str(_truncated(ctx))),
         Raises(FastkitError, "model.safetensors", "truncated")),
]


from tests.hostile_round3 import all_rows  # noqa: E402  (issue 23: export, runs, adapters, data, options, CLI)

ROUND3 = all_rows()
CASES += [case for _, case in ROUND3]
CLASSES = {case.id: cls for cls, case in ROUND3}


def _eq(got, want):
    assert got == want, got


def _batched_vs_row_counts(ctx):
    from fastkit.data.prepare import _token_counts, to_chat_training_form, token_counts

    rows = [_chat("q " * (i % 7), "a " * (i % 5 + 1)) for i in range(40)] + [
        {"messages": [{"role": "system", "content": "s"}, *_chat("q")["messages"]]}]
    ds = to_chat_training_form(Dataset.from_list(rows), ctx.tok)
    return token_counts(ds, ctx.tok, _token_counts, chunk=16), [_token_counts(row, ctx.tok) for row in ds]


def _packed_after_plain():
    model = FastModel.patch(twin("llama", num_hidden_layers=1), patches=None)
    FastModel.patch(model, patches=["packing"])
    return model(input_ids=torch.randint(3, 300, (1, 12)), **{LENGTHS_KWARG: [[5, 7]]})


def _numpy_vs_list_lengths():
    model = _packed_llama()
    ids = torch.randint(3, 300, (1, 12))
    with torch.no_grad():
        got = model(input_ids=ids, **{LENGTHS_KWARG: [np.array([5, 7])]}).logits
        flat = model(input_ids=ids, **{LENGTHS_KWARG: [np.int64(5), np.int64(7)]}).logits
        want = model(input_ids=ids, **{LENGTHS_KWARG: [[5, 7]]}).logits
    torch.testing.assert_close(flat, want, rtol=0, atol=0)
    return got, want


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_input(case: Case, tmp_path, monkeypatch, caplog, capsys, tokenizer):
    run_case(case, Ctx(tmp_path, monkeypatch, caplog, tokenizer, capsys))


def run_case(case: Case, ctx: Ctx) -> None:
    """One row of a hostile table: the action raises with every needle in its message, or passes its check."""
    if isinstance(case.expect, Raises):
        with pytest.raises(case.expect.error) as exc:
            case.action(ctx)
        for needle in case.expect.needles:
            assert needle in str(exc.value), f"{needle!r} not in: {exc.value}"
    else:
        case.expect(case.action(ctx), ctx)


def test_case_ids_are_unique():
    assert len({c.id for c in CASES}) == len(CASES)


def test_every_round3_class_has_rows():
    counts = {cls: sum(1 for c in CLASSES.values() if c == cls) for cls in set(CLASSES.values())}
    assert set(counts) == {"data sources", "data fields", "saves", "runs", "adapters", "options", "cli"}, counts
    assert len(CASES) >= 250, len(CASES)
