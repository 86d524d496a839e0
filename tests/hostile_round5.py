"""Round-5 rows of the hostile-input table (issue 44), one builder per class; tests/test_hostile_round5.py runs them.

The classes and the rule each follows:

- duplicates: a key given twice (a YAML mapping, a source's ``?key=``, a column mapping) is refused naming both;
  keywords given beside ``options=`` change those options (``make_trainer`` and ``get_peft_model`` alike);
- unbounded input: a YAML alias is refused (``*name`` expands without bound), in files and flag values alike;
- wrong names: a path that is not a regular file is named as such; a split asked of a single file is refused;
  a source whose column names the string form cannot hold says so; ``--eval-split 3`` is a row count;
- rows that train on nothing or cannot be encoded: an empty assistant turn, a lone surrogate character;
- limits from the model in hand: pre-tokenized ids past the embedding, a preference run's length;
- a library's raw error where fastkit calls it: no tokenizer for a save, a chat prompt of the wrong shape or a
  streamer without ``put``, a config.json that is not a mapping, a truncated adapter file; a broken
  adapter_config.json (one reader, ``fastkit.checks.read_adapter_config``: the file and the JSON error's line and
  column, for load_lora, ``fastkit export`` and resume alike); a full disk during a GGUF write (the partial file
  removed, the bytes it needs named); ``fastkit train`` input known from a local config.json (a field of the wrong
  type, ``--target-modules`` matching no module) is exit 2 before any weight loads (a meta-device model);
- tool calls: an assistant turn that is a tool call with empty content, under a chat template that does not render
  ``tool_calls``, trains only its end-of-turn token: warned (logger ``fastkit``), once per dataset, with the count and
  the first row; the rows are kept. A template that renders the call: no warning;
- model state: ``get_peft_model`` returns its model as is only for one LoRA adapter with the options asked; PEFT's
  tuner layer, several adapters or another PEFT method would nest, and are refused (use the model, or
  merge_and_unload() first); 4-bit MoE experts need the ``moe`` patch (``patches=`` without it refused at load);
  ``save_merged`` of a 4-bit MoE model without LoRA dequantizes the copy's experts (a deepcopy's revert edits the
  copy, never the model in memory).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch

from fastkit import FastkitError, FastModel
from tests.hostile_round3 import TWIN, _trained


def _ns():
    from tests.test_hostile_inputs import Case, Raises

    return Case, Raises


def _rows_file(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _chat(q: str = "q", a: str = "a") -> dict:
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


# -- duplicates and unbounded input: one rule, refuse ------------------------------------------------------
def duplicates():
    from fastkit.cli.config import ConfigFileError, read_file, sft_value
    from fastkit.data import DataSource

    Case, Raises = _ns()

    def config(text: str):
        def action(ctx):
            file = ctx.tmp / "run.yaml"
            file.write_text(text, encoding="utf-8")
            return read_file(str(file))

        return action

    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{n}: &{n} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
        for p, n in zip("abcdefgh", "bcdefghi"))

    def peft_precedence(ctx):
        from fastkit.training.options import LoraOptions

        model, _ = FastModel.from_pretrained(TWIN, max_seq_length=64, twin=True)
        with ctx.caplog.at_level(logging.INFO, logger="fastkit"):
            peft = FastModel.get_peft_model(model, r=8, options=LoraOptions(lora_r=4, checkpointing="off"))
        return peft

    def rank_8(peft, ctx):
        assert peft.peft_config["default"].r == 8, peft.peft_config["default"].r
        assert "r=8 given beside options= change those options" in ctx.caplog.text, ctx.caplog.text

    return [
        Case("r5_yaml_key_twice_refused", config("lora_r: 4\nsteps: 2\nlora_r: 8\n"),
             Raises(ConfigFileError, "'lora_r' is given twice (lines 1 and 3)", "give it once")),
        Case("r5_yaml_key_twice_under_sft_refused", config("sft:\n  max_grad_norm: 1\n  max_grad_norm: 2\n"),
             Raises(ConfigFileError, "'max_grad_norm' is given twice")),
        Case("r5_yaml_alias_refused", config("lr: &x 0.001\nlearning_rate: *x\n"),
             Raises(ConfigFileError, "line 2 uses the YAML alias *x", "write the value out")),
        Case("r5_yaml_alias_bomb_refused_at_once", config(bomb), Raises(ConfigFileError, "YAML alias")),
        Case("r5_sft_flag_alias_refused", lambda ctx: sft_value("model_init_kwargs", "{a: &x 1, b: *x}"),
             Raises(FastkitError, "YAML alias *x")),
        Case("r5_sft_flag_broken_mapping_names_the_flag", lambda ctx: sft_value("model_init_kwargs", "{a: 1"),
             Raises(FastkitError, "model_init_kwargs=", "is not valid JSON / YAML")),
        Case("r5_source_key_twice_refused", lambda ctx: DataSource.parse("qa.csv?weight=2&weight=5"),
             Raises(FastkitError, "weight is given twice; give it once")),
        Case("r5_source_max_rows_twice_refused", lambda ctx: DataSource.parse("qa.csv?max-rows=2&max_rows=5"),
             Raises(FastkitError, "max_rows is given twice")),
        Case("r5_source_field_mapped_twice_refused",
             lambda ctx: DataSource.parse("qa.csv?columns=prompt:q,prompt:question"),
             Raises(FastkitError, "columns maps 'prompt' twice")),
        Case("r5_one_column_as_two_fields_refused",
             lambda ctx: DataSource("qa.csv", columns={"prompt": "q", "completion": "q"}),
             Raises(FastkitError, "maps column 'q' to both 'prompt' and 'completion'")),
        Case("r5_get_peft_model_keyword_beside_options_wins", peft_precedence, rank_8),
    ]


# -- names and paths ------------------------------------------------------------------------------------------
def names():
    from fastkit.data import DataSource, as_dataset, load_chat_dataset

    Case, Raises = _ns()

    def dev_zero_link(ctx):
        link = ctx.tmp / "data.jsonl"
        os.symlink("/dev/zero", link)
        return as_dataset(str(link))

    def eval_split_count(ctx):
        import dataclasses

        from fastkit.cli.config import _field_type
        from fastkit.training.options import TrainOptions

        field = next(f for f in dataclasses.fields(TrainOptions) if f.name == "eval_split")
        return _field_type("eval_split", field)("3")  # what argparse calls with --eval-split 3

    def is_three(value, ctx):
        assert value == 3 and isinstance(value, int), value

    def single_file_split(ctx):
        return load_chat_dataset(_rows_file(ctx.tmp / "d.jsonl", [_chat()]), split="test")

    return [
        Case("r5_dev_zero_is_not_a_regular_file", lambda ctx: as_dataset("/dev/zero"),
             Raises(FastkitError, "'/dev/zero' is not a regular file")),
        Case("r5_link_to_dev_zero_is_not_a_regular_file", dev_zero_link,
             Raises(FastkitError, "is not a regular file (a device, pipe or socket, or a link to one)")),
        Case("r5_split_of_a_single_file_refused", single_file_split,
             Raises(FastkitError, "split='test' was asked of the single file", "drop split=")),
        Case("r5_spec_of_unwritable_column_refused",
             lambda ctx: DataSource("qa.csv", columns={"prompt": "question,long"}).spec(),
             Raises(FastkitError, "'question,long' holds one of , & : = ?", "mapping form")),
        Case("r5_eval_split_3_is_a_row_count", eval_split_count, is_three),
    ]


# -- rows that train on nothing, or cannot be encoded ------------------------------------------------------------
def rows():
    from fastkit.data import load_chat_dataset

    Case, Raises = _ns()

    def empty_middle_turn(ctx):
        row = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""},
                            {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]}
        return load_chat_dataset([_chat(), row])

    def surrogate(ctx):
        return load_chat_dataset([_chat(), _chat("emoji \ud83d broken")])

    def surrogate_text(ctx):
        return load_chat_dataset([{"text": "fine"}, {"text": "bad \udc80"}])

    return [
        Case("r5_empty_assistant_turn_mid_chat_refused", empty_middle_turn,
             Raises(FastkitError, "row 2", "messages[1] is an empty assistant turn", "drop_invalid=True")),
        Case("r5_lone_surrogate_in_a_message_refused", surrogate,
             Raises(FastkitError, "row 2", "lone surrogate character ('\\ud83d')", "fix the text")),
        Case("r5_lone_surrogate_in_text_refused", surrogate_text,
             Raises(FastkitError, "row 2", "lone surrogate")),
    ]


# -- limits from the model in hand -------------------------------------------------------------------------------
def limits():
    Case, Raises = _ns()

    def ids_past_vocab(ctx):
        from datasets import Dataset

        from fastkit.training import make_trainer

        model, tok = FastModel.from_pretrained(TWIN, max_seq_length=64, twin=True)
        model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False)
        rows = Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 10 ** 7, 5]]})
        return make_trainer(model, tok, rows, max_steps=1, output_dir=str(ctx.tmp / "out"), dashboard="none")

    def dpo_limit_from_load(ctx):
        from fastkit.training import make_dpo_trainer

        model, tok = FastModel.from_pretrained(TWIN, max_seq_length=64, twin=True)
        model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False)
        long = " ".join(["word"] * 200)
        pairs = [{"prompt": "q", "chosen": long, "rejected": "no"}, {"prompt": "q2", "chosen": "a", "rejected": "b"}]
        return make_dpo_trainer(model, tok, pairs, max_steps=1, output_dir=str(ctx.tmp / "out"), dashboard="none")

    def trainer_past_context(ctx):
        from fastkit.training import make_trainer

        model, tok = FastModel.from_pretrained(TWIN, max_seq_length=64, twin=True)
        model = FastModel.get_peft_model(model, r=4, use_gradient_checkpointing=False)
        return make_trainer(model, tok, [_chat()], max_steps=1, max_seq_length=10 ** 6, packing=False,
                            output_dir=str(ctx.tmp / "out"), dashboard="none")

    return [
        Case("r5_twin_past_the_real_models_context_refused",
             lambda ctx: FastModel.from_pretrained(TWIN, max_seq_length=100_000, twin=True),
             Raises(FastkitError, "max_seq_length=100000 is longer than the model's context",
                    "max_position_embeddings=8192")),
        Case("r5_make_trainer_past_the_context_refused_without_packing", trainer_past_context,
             Raises(FastkitError, "max_seq_length=1000000 is longer than the model's context")),
        Case("r5_token_id_past_the_embedding_refused", ids_past_vocab,
             Raises(FastkitError, "token id 10000000 is outside the model's vocabulary")),
        Case("r5_dpo_length_is_the_loaded_max_seq_length", dpo_limit_from_load,
             Raises(FastkitError, "above max_seq_length=64")),
    ]


# -- raw library errors, caught where fastkit calls the library ----------------------------------------------------
def raw_errors():
    from fastkit.export import chat, load_lora, save_lora, save_merged

    Case, Raises = _ns()

    def chat_with(prompt, **kw):
        def action(ctx):
            model, tok = FastModel.from_pretrained(TWIN, max_seq_length=64, twin=True)
            return chat(model, tok, prompt, max_new_tokens=2, stream=False, **kw)

        return action

    def truncated_adapter(ctx):
        model, tok = _trained()
        folder = Path(save_lora(model, tok, ctx.tmp / "lora", verify=False))
        file = folder / "adapter_model.safetensors"
        file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
        base, _ = FastModel.from_pretrained(TWIN, max_seq_length=64, twin=True)
        return load_lora(base, folder)

    def garbage_adapter(ctx):
        model, tok = _trained()
        folder = Path(save_lora(model, tok, ctx.tmp / "lora", verify=False))
        (folder / "adapter_model.safetensors").write_bytes(b"not a safetensors file at all")
        base, _ = FastModel.from_pretrained(TWIN, max_seq_length=64, twin=True)
        return load_lora(base, folder)

    def config_list(twin: bool):
        def action(ctx):
            folder = ctx.tmp / "model"
            folder.mkdir()
            (folder / "config.json").write_text("[1, 2, 3]", encoding="utf-8")
            return FastModel.from_pretrained(str(folder), max_seq_length=64, twin=twin)

        return action

    return [
        Case("r5_save_lora_without_tokenizer", lambda ctx: save_lora(*_trained()[:1], None, ctx.tmp / "l"),
             Raises(FastkitError, "save_lora needs the tokenizer", "got NoneType")),
        Case("r5_save_merged_without_tokenizer", lambda ctx: save_merged(_trained()[0], None, ctx.tmp / "m"),
             Raises(FastkitError, "save_merged needs the tokenizer")),
        Case("r5_chat_prompt_none", chat_with(None), Raises(FastkitError, "takes the user's text (a string)")),
        Case("r5_chat_one_message_dict", chat_with({"role": "user", "content": "hi"}),
             Raises(FastkitError, "got one message dict", "give a list of them")),
        Case("r5_chat_message_without_content", chat_with([{"role": "user"}]),
             Raises(FastkitError, "message 0 is", "a 'content' string")),
        Case("r5_chat_streamer_without_put", chat_with("hi", streamer=object()),
             Raises(FastkitError, "takes a transformers streamer (with put() and end()")),
        Case("r5_chat_lone_surrogate", chat_with("hi \ud83d"), Raises(FastkitError, "lone surrogate")),
        Case("r5_load_lora_truncated_file", truncated_adapter,
             Raises(FastkitError, "adapter_model.safetensors cannot be read", "truncated or not a safetensors")),
        Case("r5_load_lora_garbage_file", garbage_adapter,
             Raises(FastkitError, "truncated or not a safetensors file")),
        Case("r5_config_json_a_list", config_list(False), Raises(FastkitError, "config.json holds a list")),
        Case("r5_config_json_a_list_twin", config_list(True), Raises(FastkitError, "holds a list")),
    ]


# -- tool calls a chat template drops -----------------------------------------------------------------------------
_CALL = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]


def _tool_rows() -> list[dict]:
    call = {"messages": [{"role": "user", "content": "weather?"},
                         {"role": "assistant", "content": "", "tool_calls": _CALL},
                         {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "It is sunny."}]}
    return [_chat(), call, _chat("q2", "a2"), call]


def tool_calls():
    from fastkit.data import check_dataset

    Case, _ = _ns()

    def checked(template: str | None):
        def action(ctx):
            import copy

            import trl

            tok = copy.deepcopy(ctx.tok)
            if template:
                tok.chat_template = (Path(trl.__file__).parent / "chat_templates" / template).read_text()
            with ctx.caplog.at_level(logging.WARNING, logger="fastkit"):
                return check_dataset(_tool_rows(), tok, 256)

        return action

    def warned_once(ds, ctx):
        said = [r.getMessage() for r in ctx.caplog.records if "tool call" in r.getMessage()]
        assert len(said) == 1, said
        assert "2 of 4 rows have an assistant tool call with empty content that the chat template does not render " \
               "(first: row 2)" in said[0] and "end-of-turn token" in said[0], said
        assert len(ds) == 4, len(ds)  # kept

    def not_warned(ds, ctx):
        assert "tool call" not in ctx.caplog.text, ctx.caplog.text
        assert len(ds) == 4, len(ds)

    return [
        Case("r5_tool_call_the_template_drops_warned_once", checked(None), warned_once),
        Case("r5_tool_call_the_template_renders_not_warned", checked("qwen3.jinja"), not_warned),
    ]


# -- model state: adapters on adapters, 4-bit MoE experts --------------------------------------------------------
def _saved_moe(ctx) -> str:
    from fastkit.families.twins import twin
    from tests.helpers import save_twin

    return save_twin(twin("qwen3_moe"), ctx.tmp / "moe")


def model_state():
    from peft import IA3Config, LoraConfig, get_peft_model

    Case, Raises = _ns()

    def twin_model():
        return FastModel.from_pretrained(TWIN, max_seq_length=64, twin=True)[0]

    def on_tuner(ctx):
        peft = FastModel.get_peft_model(twin_model(), r=4, use_gradient_checkpointing=False)
        return FastModel.get_peft_model(peft.base_model, r=4, use_gradient_checkpointing=False)

    def on_two_adapters(ctx):
        peft = FastModel.get_peft_model(twin_model(), r=4, use_gradient_checkpointing=False)
        peft.add_adapter("second", LoraConfig(r=4, target_modules=["q_proj"]))
        return FastModel.get_peft_model(peft, r=4, use_gradient_checkpointing=False)

    def on_ia3(ctx):
        peft = get_peft_model(twin_model(), IA3Config(target_modules=["q_proj", "down_proj"],
                                                      feedforward_modules=["down_proj"]))
        return FastModel.get_peft_model(peft, r=4, use_gradient_checkpointing=False)

    def moe_4bit(patches):
        return lambda ctx: FastModel.from_pretrained(_saved_moe(ctx), load_in_4bit=True, patches=patches,
                                                     max_seq_length=64)

    def merged_4bit_moe(ctx):
        from fastkit.export import save_merged

        model, tok = FastModel.from_pretrained(_saved_moe(ctx), load_in_4bit=True, max_seq_length=64)
        return model, save_merged(model, tok, ctx.tmp / "merged", dtype=torch.float32)

    def merged_and_still_4bit(result, ctx):
        from safetensors import safe_open

        from fastkit.patches.moe.nf4 import has_4bit_experts

        model, folder = result
        assert has_4bit_experts(model), "save_merged dequantized the model in memory"
        with safe_open(str(Path(folder) / "model.safetensors"), framework="pt") as f:
            experts = [k for k in f.keys() if "experts" in k]
            assert experts and all(len(f.get_slice(k).get_shape()) == 2 for k in experts), experts  # per expert

    nest = ("would nest adapters", "Use the model as it is", "merge_and_unload()")
    return [
        Case("r5_get_peft_model_on_peft_tuner_refused", on_tuner,
             Raises(FastkitError, "PEFT's LoraModel (the base_model of a PeftModel)", *nest)),
        Case("r5_get_peft_model_on_two_adapters_refused", on_two_adapters,
             Raises(FastkitError, "a PEFT model with 2 adapters (default, second)", *nest)),
        Case("r5_get_peft_model_on_ia3_refused", on_ia3, Raises(FastkitError, "a IA3 adapter, not LoRA", *nest)),
        Case("r5_4bit_moe_patches_none_refused_at_load", moe_4bit(None),
             Raises(FastkitError, "load_in_4bit=True with patches=None", "only fastkit's 'moe' patch runs them")),
        Case("r5_4bit_moe_patches_without_moe_refused_at_load", moe_4bit(["packing"]),
             Raises(FastkitError, "patches=['packing']", "add 'moe' to the list")),
        Case("r5_save_merged_4bit_moe_without_lora", merged_4bit_moe, merged_and_still_4bit),
    ]


# -- files and flags: broken adapter configs, a full disk, fastkit train's model checks -------------------------
def _broken_adapter(ctx) -> Path:
    from fastkit.export import save_lora

    model, tok = _trained()
    folder = Path(save_lora(model, tok, ctx.tmp / "lora", verify=False))
    (folder / "adapter_config.json").write_text('{"r": 4,\n  "lora_alpha": }', encoding="utf-8")
    return folder


def _train_cli(ctx, model: str, *flags: str):
    from fastkit import loader
    from fastkit.cli import main

    def no_load(*a, **k):
        raise AssertionError("weights loaded before the check")

    ctx.monkeypatch.setattr(loader, "_load", no_load)
    data = _rows_file(ctx.tmp / "d.jsonl", [_chat(f"q{i}", f"a{i}") for i in range(4)])
    code = main(["train", "--model", model, "--data", data, "--steps", "1", "--output-dir", str(ctx.tmp / "out"),
                 *flags])
    return code, ctx.capsys.readouterr().err


def _exits_2(*needles):
    def check(result, ctx):
        code, err = result
        assert code == 2, (code, err)
        for needle in needles:
            assert needle in err, f"{needle!r} not in: {err}"
    return check


def files_and_flags():
    from fastkit.cli.config import flag_layer
    from fastkit.export import load_lora, save_gguf

    Case, Raises = _ns()

    def llama(ctx, **fields) -> str:
        from fastkit.families.twins import twin
        from tests.helpers import save_twin

        folder = save_twin(twin("llama", num_hidden_layers=1), ctx.tmp / "llama")
        values = json.loads((Path(folder) / "config.json").read_text())
        (Path(folder) / "config.json").write_text(json.dumps({**values, **fields}))
        return folder

    def broken_load_lora(ctx):
        folder = _broken_adapter(ctx)
        return load_lora(FastModel.from_pretrained(TWIN, max_seq_length=64, twin=True)[0], folder)

    def broken_export(ctx):
        from fastkit.cli import main

        folder = _broken_adapter(ctx)
        return main(["export", "--model", str(folder), "--merged", "--out-dir", str(ctx.tmp / "e")]), \
            ctx.capsys.readouterr().err

    def broken_resume(ctx):
        from tests.hostile_round3 import _resume

        return _resume(ctx, mutate=lambda out: (out / "checkpoint-2" / "adapter_config.json").write_text("{r: 4}"))

    def gguf_disk_full(ctx):
        import errno

        import gguf

        def full(*a, **k):
            raise OSError(errno.ENOSPC, "No space left on device")

        ctx.monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", full)
        model, tok = _trained()
        try:
            return save_gguf(model, tok, ctx.tmp / "gguf", quantization="f16", verify=False)
        finally:
            left = [p.name for p in ctx.tmp.rglob("*") if "gguf" in p.name or "partial" in p.name]
            assert left == [], f"left behind: {left}"

    def single_flag_values(ctx):
        return [flag_layer({"target_modules": [v]})[0]["target_modules"] for v in ("q_proj", ".*q_proj", "all-linear")]

    def names_list_regex_text(got, ctx):
        assert got == [["q_proj"], ".*q_proj", "all-linear"], got

    json_error = ("adapter_config.json is not valid JSON (Expecting value at line 2, column 17, char 25)",)
    return [
        Case("r5_cli_target_modules_matching_nothing_exit_2_before_the_load",
             lambda ctx: _train_cli(ctx, llama(ctx), "--target-modules", "nope_proj", "other"),
             _exits_2("--target-modules ['nope_proj', 'other'] matches no module of this llama model",
                      "its linear layers are down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj")),
        Case("r5_get_peft_model_target_modules_matching_nothing",
             lambda ctx: FastModel.get_peft_model(FastModel.from_pretrained(TWIN, max_seq_length=64, twin=True)[0],
                                                  target_modules=["nope"], use_gradient_checkpointing=False),
             Raises(FastkitError, "target_modules=['nope'] matches no module", "q_proj")),
        Case("r5_cli_one_target_module_is_a_name", single_flag_values, names_list_regex_text),
        Case("r5_cli_config_field_a_string_exit_2_before_the_load",
             lambda ctx: _train_cli(ctx, llama(ctx, hidden_size="64", num_hidden_layers="two")),
             _exits_2("llama/config.json: field 'hidden_size' has the wrong type", "expected int, got str")),
        Case("r5_load_lora_broken_adapter_config", broken_load_lora, Raises(FastkitError, "load_lora: ", *json_error)),
        Case("r5_export_broken_adapter_config_exit_2", broken_export, _exits_2("--model ", *json_error)),
        Case("r5_resume_broken_adapter_config", broken_resume,
             Raises(FastkitError, "resume=True: ", "checkpoint-2/adapter_config.json is not valid JSON",
                    "line 1, column 2")),
        Case("r5_save_gguf_disk_full", gguf_disk_full,
             Raises(FastkitError, "The disk is full: writing", "No space left on device", "it needs ",
                    "The partial file was removed")),
    ]


def all_rows():
    """``(class, Case)`` for every round-5 row."""
    return ([("duplicates", c) for c in duplicates()] + [("names", c) for c in names()]
            + [("rows", c) for c in rows()] + [("limits", c) for c in limits()]
            + [("raw errors", c) for c in raw_errors()] + [("tool calls", c) for c in tool_calls()]
            + [("model state", c) for c in model_state()] + [("files and flags", c) for c in files_and_flags()])
