"""fastkit._hf against the installed transformers / TRL / PEFT, and the layout rules that keep it the only such file.

- every accessor in ``fastkit._hf`` runs on a tiny twin here (one test id per accessor), so an upstream
  rename fails ``test_accessor[<name>]``;
- no other fastkit file uses those private or version-fragile names in code (docstrings and comments
  may name what a patch replaces);
- the pure-torch files import only the standard library, torch, numpy, fastkit.errors and each other.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
import types
from pathlib import Path

import pytest
import torch

from fastkit import _hf, registry
from fastkit.families.twins import twin, twin_tokenizer
from fastkit.patching import Swapper
from fastkit.registry import facts_for

ROOT = Path(__file__).resolve().parents[1] / "fastkit"
# The compat layers (paths under fastkit/; "_hf/": every file of the package): the only files that may reach
# private names.
COMPAT = ("_hf/", "_torch.py", "_stdlib.py")
TABLE = "registry/"  # the one table of family facts: its rows name upstream classes (experts, stateful layers)

# Deep module paths only the compat layer may import from.
FRAGILE_MODULES = (
    "transformers.integrations.moe", "transformers.models.auto.modeling_auto", "transformers.modeling_layers",
    "transformers.masking_utils", "peft.tuners",
)
PURE_TORCH = ("patches/packing/attention.py", "patches/offload/pipeline.py", "patches/offload/streams.py",
              "patches/moe/routing.py", "patches/loss/chunked.py")
PURE_ALLOWED = ("torch", "numpy", "fastkit.errors", "fastkit._torch", "fastkit.units",
                "fastkit.patches.sizes",  # standard library only: the byte budgets the planner counts too
                "flash_attn",  # optional flash-attn 2 kernels (a torch extension), imported where they run
                *(f"fastkit.{p.removesuffix('.py').replace('/', '.')}" for p in PURE_TORCH))
# A string that spells a class name: CamelCase with two or more words (DbrxExperts, Linear8bitLt, ...).
_CLASS_NAME = re.compile(r"^[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]+)+[A-Za-z0-9]*$")
# Class-name strings that are file-format vocabulary, not Python classes: tokenizer.json's component types.
_FORMAT_NAMES = ("ByteLevel",)
# The registry is the one table of family facts: class names there are data (a family's stateful layers),
# read through _hf.class_name_in. Every other rule still applies to it.
_CLASS_NAMES_ARE_DATA = ("registry/",)  # paths under fastkit/: every file of the package
_OP_NAMESPACES = ("aten", "ops")  # torch.ops.aten._to_copy: an operator's schema name, not a private attribute

LAYERS = 2


def _ids(t=12):
    return torch.randint(3, 259, (1, t), generator=torch.Generator().manual_seed(0))


def _experts(model):
    return [m for _, m in model.named_modules() if _hf.is_decorated_experts(m)]


def _peft_moe(r=4, alpha=8):
    """A qwen3_moe twin with PEFT ``target_parameters`` LoRA on its experts (ParamWrapper)."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=["q_proj"],
                     target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    return get_peft_model(twin("qwen3_moe", num_hidden_layers=LAYERS), cfg)


# --------------------------------------------------------------------------------------------- accessors


def check_is_stateful_model():
    for model_type in ("qwen3_5_text", "jamba", "falcon_h1", "bamba", "zamba2", "kimi_linear"):
        assert _hf.is_stateful_model(twin(model_type)), model_type
    for model_type in ("llama", "qwen3", "gemma3_text", "gpt_oss"):
        assert not _hf.is_stateful_model(twin(model_type)), model_type


def _mixer_class(model_type: str) -> type:
    names = facts_for(model_type).stateful
    return next(type(m) for m in twin(model_type).modules() if type(m).__name__ in names)


def check_resolved_kernel():
    import inspect

    from tests.test_packing_varlen import install

    for model_type in ("qwen3_5_text", "lfm2", "bamba"):  # one family per varlen kind
        cls = _mixer_class(model_type)
        for name, _ in _hf.VARLEN_KERNELS[facts_for(model_type).varlen]:
            wrapper = _hf.kernel_global(cls, name)  # transformers' fallback wrapper, by that name
            assert {"implementation", "torch_function"} <= set(inspect.getclosurevars(wrapper).nonlocals), name
            assert _hf.resolved_kernel(cls, name) is None  # no package here: the torch reference
        with pytest.MonkeyPatch.context() as mp:
            install(mp, model_type)
            assert all(_hf.resolved_kernel(cls, n).__self__ is not None for n, _ in _hf.VARLEN_KERNELS[
                facts_for(model_type).varlen])  # the fakes' bound methods, resolved by transformers' decorator


def check_hub_function():
    import transformers.models.lfm2.modeling_lfm2 as lfm2

    raw = lfm2.causal_conv1d_fn  # 5.25 with kernels installed: a kernels ``Func`` module; 5.24: the function
    fn = _hf.hub_function(raw)
    assert isinstance(fn, types.FunctionType) and fn.__name__ == "causal_conv1d_fn", type(raw)
    assert _hf.hub_function(len) is len and _hf.hub_function(torch.nn.Linear(1, 1)).__class__ is torch.nn.Linear


def check_kernel_global():
    cls = _mixer_class("lfm2")
    assert isinstance(_hf.kernel_global(cls, "causal_conv1d_fn"), types.FunctionType)
    assert _hf.kernel_global(cls, "no_such_kernel") is None


def check_kernel_reference():
    import inspect

    cls = _mixer_class("qwen3_5_text")
    ref = _hf.kernel_reference(cls, "torch_chunk_gated_delta_rule")
    assert ref is not _hf.kernel_global(cls, "torch_chunk_gated_delta_rule")  # the function the family wrote
    assert "cu_seqlens" not in inspect.signature(ref).parameters and ref.__module__ == cls.__module__
    assert _hf.kernel_reference(cls, "no_such_kernel") is None


def check_quiet_gguf_reader():
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    before = gguf_utils.tqdm
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("FASTKIT_SHOW_UPSTREAM_WARNINGS", raising=False)
        with _hf.quiet_gguf_reader():
            assert gguf_utils.tqdm([1, 2]).disable  # the reader's bar, drawn with disable=True
        assert gguf_utils.tqdm is before


def check_package_version():
    assert _hf.package_version("fla") is None  # not installed here
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "fla", types.SimpleNamespace(__version__="0.6.0"))
        assert _hf.package_version("fla") == "0.6.0"


def check_varlen_unavailable():
    assert "torch reference" in _hf.varlen_unavailable(_mixer_class("lfm2"), "short_conv")
    assert "no varlen kernel" in _hf.varlen_unavailable(_mixer_class("lfm2"), "mamba1")


def check_has_causal_lm_head():
    assert _hf.has_causal_lm_head("qwen3") and _hf.has_causal_lm_head("gpt_oss")
    assert not _hf.has_causal_lm_head("vit")


def check_attn_implementation():
    assert _hf.attn_implementation(twin("qwen3").config) == "sdpa"
    assert _hf.attn_implementation(twin("gpt_oss").config) == "eager"


def check_set_attn_implementation():
    model = twin("qwen3")
    swap = Swapper("compat")
    _hf.set_attn_implementation(model.config, "eager", swap)
    assert _hf.attn_implementation(model.config) == "eager"
    assert all(layer.self_attn.config is model.config for layer in model.model.layers)  # what the layers read
    swap.undo()
    assert _hf.attn_implementation(model.config) == "sdpa"
    _hf.set_attn_implementation(model.config, "eager")
    assert _hf.attn_implementation(model.config) == "eager"


def check_attention_registered():
    assert _hf.attention_registered("sdpa") and _hf.attention_registered("flash_attention_2")
    assert not _hf.attention_registered("eager")  # each family brings its own eager function
    assert not _hf.attention_registered("fastkit_compat_never_registered")


def check_register_attention():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    model = twin("qwen3").eval()
    ids = _ids().repeat(2, 1)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding: only a real mask function keeps the second row equal
    ref = model(ids, attention_mask=mask).logits
    sdpa = _hf.attention_function(model.model.layers[0].self_attn, "sdpa")
    calls = []

    def spy(module, *args, **kwargs):
        calls.append(module.layer_idx)
        return sdpa(module, *args, **kwargs)

    _hf.register_attention("fastkit_compat_sdpa", spy, mask_like="sdpa")
    assert _hf.attention_registered("fastkit_compat_sdpa")
    assert ALL_MASK_ATTENTION_FUNCTIONS["fastkit_compat_sdpa"] is ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
    _hf.set_attn_implementation(model.config, "fastkit_compat_sdpa")
    torch.testing.assert_close(model(ids, attention_mask=mask).logits, ref, rtol=0, atol=0)
    assert calls == list(range(LAYERS))


def check_attention_function():
    import transformers.models.qwen3.modeling_qwen3 as modeling

    attn = twin("qwen3").model.layers[0].self_attn
    assert _hf.attention_function(attn, "eager") is modeling.eager_attention_forward
    assert callable(_hf.attention_function(attn, "sdpa"))


def check_AttentionView():
    model = twin("qwen3")
    attn = model.model.layers[0].self_attn
    view = _hf.AttentionView(attn, "flash_attention_2")
    assert _hf.attn_implementation(view.config) == "flash_attention_2"
    assert _hf.attn_implementation(model.config) == "sdpa"  # the real config is untouched
    assert view.config.num_attention_heads == model.config.num_attention_heads
    assert view.layer_idx == 0 and view.is_causal and next(view.modules()) is attn


def check_enable_activation_checkpointing():
    model = twin("qwen3", num_hidden_layers=LAYERS).train()
    _hf.enable_activation_checkpointing(model)
    assert len(_hf.checkpointed_layers(model)) == LAYERS


def check_checkpointed_layers():
    model = twin("qwen3", num_hidden_layers=LAYERS).train()
    assert _hf.checkpointed_layers(model) == []
    _hf.enable_activation_checkpointing(model)
    assert _hf.checkpointed_layers(model) == list(model.model.layers)


def check_checkpoint_function():
    from torch.utils.checkpoint import checkpoint

    model = twin("qwen3", num_hidden_layers=LAYERS).train()
    _hf.enable_activation_checkpointing(model)
    fn = _hf.checkpoint_function(model.model.layers[0])
    assert isinstance(fn, functools.partial) and fn.func is checkpoint and fn.keywords["use_reentrant"] is False


def check_set_checkpoint_function():
    model = twin("qwen3", num_hidden_layers=LAYERS).train()
    _hf.enable_activation_checkpointing(model)
    layers = _hf.checkpointed_layers(model)
    originals = [_hf.checkpoint_function(layer) for layer in layers]
    calls = []
    swap = Swapper("compat")
    for i, (layer, fn) in enumerate(zip(layers, originals)):
        _hf.set_checkpoint_function(layer, lambda *a, fn=fn, i=i, **k: calls.append(i) or fn(*a, **k), swap)
    model(_ids(), labels=_ids()).loss.backward()
    assert calls == list(range(LAYERS))  # transformers runs each layer through the swapped function
    swap.undo()
    assert all(_hf.checkpoint_function(layer) is fn for layer, fn in zip(layers, originals))


def check_register_experts_function():
    from fastkit.patches.moe.patch import fastkit_experts_forward

    model = twin("qwen3_moe", num_hidden_layers=LAYERS).eval()
    ref = model(_ids()).logits
    calls = []

    def spy(self, *args):
        calls.append(self)
        return fastkit_experts_forward(self, *args)

    _hf.register_experts_function("fastkit_compat_experts", spy)
    _hf.set_experts_implementation(model.config, "fastkit_compat_experts")
    torch.testing.assert_close(model(_ids()).logits, ref, atol=1e-5, rtol=1e-4)
    assert calls == _experts(model)


def check_is_decorated_experts():
    model = twin("gpt_oss", num_hidden_layers=LAYERS)
    assert len(_experts(model)) == LAYERS and type(_experts(model)[0]).__name__ == "GptOssExperts"
    assert not _hf.is_decorated_experts(model.model.layers[0].mlp.router)
    assert not _hf.is_decorated_experts(torch.nn.Linear(2, 2))


def check_is_expert_parallel():
    assert not _hf.is_expert_parallel(_experts(twin("qwen3_moe"))[0])


def check_experts_implementation():
    model = twin("qwen3_moe")
    assert _hf.experts_implementation(model.config) == "grouped_mm"
    assert _hf.experts_implementation(_experts(model)[0].config) == "grouped_mm"


def check_set_experts_implementation():
    model = twin("qwen3_moe")
    swap = Swapper("compat")
    _hf.set_experts_implementation(model.config, "eager", swap)
    assert _hf.experts_implementation(model.config) == "eager"
    swap.undo()
    assert _hf.experts_implementation(model.config) == "grouped_mm"
    _hf.set_experts_implementation(model.config, "eager")
    assert _hf.experts_implementation(model.config) == "eager"


def check_apply_gate():
    for family in ("qwen3_moe", "gpt_oss"):  # concatenated SwiGLU, interleaved clamp-SwiGLU
        experts = _experts(twin(family))[0]
        width = experts.gate_up_proj.shape[-1 if experts.is_transposed else -2]  # 2I
        assert _hf.apply_gate(experts, torch.randn(5, width)).shape == (5, width // 2)


def check_grouped_mm_disabled():
    import transformers.integrations.moe as upstream

    real = vars(upstream)["_can_use_grouped_mm"]
    with _hf.grouped_mm_disabled():
        assert vars(upstream)["_can_use_grouped_mm"] is not real
        assert vars(upstream)["_can_use_grouped_mm"]() is False
    assert vars(upstream)["_can_use_grouped_mm"] is real


def check_peft_lora_factors():
    model = _peft_moe(r=4, alpha=8)
    experts = _experts(model.get_base_model())
    seen = []

    def hook(module, args):
        seen.append(_hf.peft_lora_factors(module, "gate_up_proj"))

    handles = [e.register_forward_pre_hook(hook) for e in experts]
    with torch.no_grad():
        model(_ids())
    for h in handles:
        h.remove()
    assert len(seen) == LAYERS and all(s is not None for s in seen)
    for (w, lhs, rhs, scaling), e in zip(seen, experts):
        assert w.shape == e.gate_up_proj.shape and w.dim() == 3  # the stored base weight, not W + B·A
        assert (lhs @ rhs).shape == w.shape and scaling == 2.0
    assert _hf.peft_lora_factors(experts[0], "gate_up_proj") is None  # PEFT registers it only inside its forward


def check_peft_param_wrappers():
    model = _peft_moe()
    wrappers = list(_hf.peft_param_wrappers(model))
    experts = set(_experts(model.get_base_model()))
    assert len(wrappers) == 2 * LAYERS and all(w.get_base_layer() in experts for _, w in wrappers)
    assert list(_hf.peft_param_wrappers(twin("qwen3_moe"))) == []


def check_output_capture_for_compiled_region():
    from transformers.utils import output_capturing

    var = output_capturing._active_collector
    token = var.set({"router_logits": []})  # what a model's forward sets when the aux loss asks for router logits
    try:
        with _hf.output_capture_for_compiled_region():
            assert var.compiling and var.get() == {"router_logits": []}  # readable without the ContextVar
        assert not var.compiling and var.global_var is None  # put back
    finally:
        var.reset(token)
    token = var.set({})  # a collector asking for nothing reads as None (one graph for forward and recompute)
    try:
        with _hf.output_capture_for_compiled_region():
            assert var.get() is None
    finally:
        var.reset(token)


def check_peft_wrapper_chain():
    model = _peft_moe()
    experts = _experts(model.get_base_model())
    outer = [w for _, w in _hf.peft_param_wrappers(model) if w.parameter_name == "down_proj"]
    chain, module = _hf.peft_wrapper_chain(outer[0])
    assert [w.parameter_name for w in chain] == ["down_proj", "gate_up_proj"] and module is experts[0]
    assert _hf.peft_wrapper_chain(experts[0]) == ([], experts[0])


def check_peft_runs_plain():
    model = _peft_moe()
    wrapper = next(w for _, w in _hf.peft_param_wrappers(model))
    assert _hf.peft_runs_plain(wrapper)
    with model.disable_adapter():
        assert not _hf.peft_runs_plain(wrapper)
    wrapper.merge()
    assert not _hf.peft_runs_plain(wrapper)


def check_peft_param_update():
    from peft import LoraConfig

    model = _peft_moe(r=4, alpha=8)
    for _, wrapper in _hf.peft_param_wrappers(model):
        torch.nn.init.normal_(wrapper.lora_B["default"].weight)
        w = getattr(wrapper.get_base_layer(), wrapper.parameter_name)  # (E, ·, ·)
        kind, (lhs, rhs, scaling) = _hf.peft_param_update(wrapper, w)  # one adapter: folded factors
        assert kind == "factors" and scaling == 2.0
        torch.testing.assert_close(scaling * lhs @ rhs, wrapper.get_delta_weight("default"))
    model.add_adapter("second", LoraConfig(r=2, target_modules=["q_proj"],
                                           target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    model.base_model.set_adapter(["default", "second"])  # two adapters: PEFT sums the deltas
    wrapper = next(w for _, w in _hf.peft_param_wrappers(model) if "second" in w.lora_A)
    w = getattr(wrapper.get_base_layer(), wrapper.parameter_name)
    kind, updated = _hf.peft_param_update(wrapper, w)
    assert kind == "weight"
    torch.testing.assert_close(updated, w + wrapper.get_delta_weight("default") + wrapper.get_delta_weight("second"))
    wrapper.set_adapter([])
    assert _hf.peft_param_update(wrapper, w) is None  # no active adapter


def check_peft_expert_factors():
    model = _peft_moe(r=4)
    for _, wrapper in _hf.peft_param_wrappers(model):
        name, e, a, b = _hf.peft_expert_factors(wrapper, "default")
        w = getattr(wrapper.get_base_layer(), name)  # (E, out, in)
        assert name in ("gate_up_proj", "down_proj") and e == 8
        assert a.shape == (4 * e, w.shape[-1]) and b.shape == (w.shape[-2], 4 * e)
        assert _hf.peft_expert_factors(wrapper, "no_such_adapter") is None


def check_peft_lora_layers():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(twin("qwen3"), LoraConfig(r=2, target_modules=["q_proj"]))
    layers = _hf.peft_lora_layers(model)
    assert sorted(layers) == [f"base_model.model.model.layers.{i}.self_attn.q_proj" for i in range(LAYERS)]
    assert len(_hf.peft_lora_layers(_peft_moe())) == 3 * LAYERS  # q_proj + two ParamWrappers per layer


def check_peft_delta():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(twin("qwen3"), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    layer = next(iter(_hf.peft_lora_layers(model).values()))
    torch.nn.init.normal_(layer.lora_B["default"].weight)
    want = 2.0 * layer.lora_B["default"].weight @ layer.lora_A["default"].weight  # s·B·A (out, in)
    torch.testing.assert_close(_hf.peft_delta(layer, "weight"), want)
    assert _hf.peft_delta(layer, "bias") is None
    with model.disable_adapter():
        assert _hf.peft_delta(layer, "weight") is None
    for _, wrapper in _hf.peft_param_wrappers(_peft_moe(r=4)):  # experts: the parameter's own layout
        w = getattr(wrapper.get_base_layer(), wrapper.parameter_name)
        assert _hf.peft_delta(wrapper, wrapper.parameter_name).shape == w.shape


def check_prepare_inputs():
    import tempfile

    from transformers import Trainer, TrainingArguments

    model = twin("qwen3")
    with tempfile.TemporaryDirectory() as out_dir:
        args = TrainingArguments(output_dir=out_dir, use_cpu=True, report_to=[], per_device_train_batch_size=1)
        trainer = Trainer(model=model, args=args)
        out = _hf.prepare_inputs(trainer, {"input_ids": _ids(), "labels": _ids()})
    assert torch.equal(out["input_ids"], _ids()) and out["input_ids"].device == model.device


def _sft_trainer(out_dir):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=out_dir, use_cpu=True, bf16=False, report_to=[], max_steps=2, logging_steps=1,
                     per_device_train_batch_size=1, max_length=32, save_strategy="no", disable_tqdm=True)
    return SFTTrainer(model=twin("qwen3"), args=args, train_dataset=Dataset.from_dict({"text": ["abc def"] * 4}),
                      processing_class=twin_tokenizer())


def check_trainer_loss_accumulator():
    import tempfile

    with tempfile.TemporaryDirectory() as out_dir:
        from transformers import TrainerCallback

        trainer, seen = _sft_trainer(out_dir), []

        class Spy(TrainerCallback):
            def on_step_end(self, *args, **kwargs):
                seen.append(_hf.trainer_loss_accumulator(trainer).clone())

        trainer.add_callback(Spy())
        trainer.train()
    assert len(seen) == 2 and seen[0].ndim == 0 and seen[0] > 0  # the un-logged sum, zeroed by each log


def check_save_checkpoint():
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as out_dir:
        trainer = _sft_trainer(out_dir)
        trainer.train()
        saved, seen = [], []
        from transformers import TrainerCallback

        class Spy(TrainerCallback):
            def on_save(self, *args, **kwargs):
                seen.append(True)

        trainer.add_callback(Spy())
        saved.append(_hf.save_checkpoint(trainer))
        assert saved[0] == os.path.join(out_dir, "checkpoint-2") and seen == [True]  # the on_save callbacks ran
        assert {"trainer_state.json", "optimizer.pt", "scheduler.pt"} <= set(os.listdir(saved[0]))


def check_steps_since_log():
    import tempfile

    with tempfile.TemporaryDirectory() as out_dir:
        trainer = _sft_trainer(out_dir)
        trainer.train()
        assert _hf.steps_since_log(trainer) == 1  # logged at the last step


def check_sft_metrics():
    import tempfile

    with tempfile.TemporaryDirectory() as out_dir:
        trainer = _sft_trainer(out_dir)
        assert set(_hf.sft_metrics(trainer)) == {"train", "eval"}
        _hf.sft_metrics(trainer)["train"]["entropy"].append(1.0)
        trainer.model.train()
        trainer.log({"loss": 0.0})
    assert trainer.state.log_history[-1]["entropy"] == 1.0 and not _hf.sft_metrics(trainer)["train"]


def check_sft_token_total():
    import tempfile

    with tempfile.TemporaryDirectory() as out_dir:
        trainer = _sft_trainer(out_dir)
        assert _hf.sft_token_total(trainer) == 0
        trainer.train()
        assert _hf.sft_token_total(trainer) == trainer.state.log_history[-2]["num_tokens"] > 0


def check_set_sft_token_total():
    import tempfile

    with tempfile.TemporaryDirectory() as out_dir:
        trainer = _sft_trainer(out_dir)
        _hf.set_sft_token_total(trainer, 5)
        trainer.train()
        assert trainer.state.log_history[0]["num_tokens"] > 5 and _hf.sft_token_total(trainer) > 5


def check_sft_tp_size():
    import tempfile

    with tempfile.TemporaryDirectory() as out_dir:
        assert _hf.sft_tp_size(_sft_trainer(out_dir)) == 1


def check_grpo_tokenizer():
    import tempfile

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    tok = twin_tokenizer()
    with tempfile.TemporaryDirectory() as out_dir:
        args = GRPOConfig(output_dir=out_dir, use_cpu=True, report_to=[], per_device_train_batch_size=2,
                          num_generations=2, max_completion_length=4, max_steps=1, activation_checkpointing=False)
        trainer = GRPOTrainer(model=twin("llama"), reward_funcs=lambda completions, **_: [0.0] * len(completions),
                              args=args, train_dataset=Dataset.from_list([{"prompt": "hi"}] * 2),
                              processing_class=tok)
        assert _hf.grpo_tokenizer(trainer) is tok


def check_on_param_loaded():
    import os
    import tempfile

    from transformers import AutoModelForCausalLM

    seen = []
    with tempfile.TemporaryDirectory() as path:
        twin("qwen3_moe").save_pretrained(path, safe_serialization=True)
        with _hf.on_param_loaded(lambda model, name: seen.append((name, model.get_submodule(name.rpartition(".")[0])
                                                                     .get_parameter(name.rpartition(".")[2]).shape))):
            assert os.environ["HF_DEACTIVATE_ASYNC_LOAD"] == "1"
            model = AutoModelForCausalLM.from_pretrained(path)
    names = [n for n, _ in seen]
    assert set(names) == {n for n, _ in model.named_parameters()}  # every parameter, by its target name
    experts = model.model.layers[0].mlp.experts
    assert dict(seen)["model.layers.0.mlp.experts.gate_up_proj"] == experts.gate_up_proj.shape  # fused, (E, 2I, H)


def check_is_bnb_linear():
    import bitsandbytes.nn as bnb

    assert _hf.is_bnb_linear(bnb.Linear4bit(8, 8)) and _hf.is_bnb_linear(bnb.Linear8bitLt(8, 8))
    assert not _hf.is_bnb_linear(torch.nn.Linear(8, 8)) and not _hf.is_bnb_linear(None)


def check_is_fused_experts_class():
    assert all(_hf.is_fused_experts_class(m) for m in _experts(twin("qwen3_moe")))
    assert not _hf.is_fused_experts_class(torch.nn.Linear(2, 2))


def _looped(model_type):
    from transformers import AutoModelForCausalLM

    from tests.test_moe_looped import CONFIGS

    return AutoModelForCausalLM.from_config(CONFIGS[model_type]())


def check_looped_experts_kind():
    for model_type, kind in (("dbrx", "dbrx"), ("llama4_text", "llama4")):
        assert {_hf.looped_experts_kind(m) for m in _looped(model_type).modules()} - {None} == {kind}
    assert {_hf.looped_experts_kind(m) for m in twin("qwen3_moe").modules()} == {None}


def check_modules_of_classes():
    found = _hf.modules_of_classes(twin("qwen3_5_text"), ("Qwen3_5GatedDeltaNet",))
    assert found and all(type(m).__name__ == "Qwen3_5GatedDeltaNet" for m in found)
    assert _hf.modules_of_classes(twin("qwen3"), ("Qwen3_5GatedDeltaNet",)) == []


def check_has_no_4bit_layout():
    assert any(_hf.has_no_4bit_layout(m) for m in _looped("dbrx").modules())
    assert not any(_hf.has_no_4bit_layout(m) for m in twin("qwen3_moe").modules())


def check_is_progress_callback():
    from transformers.trainer_callback import PrinterCallback, ProgressCallback, TrainerCallback
    from transformers.utils.notebook import NotebookProgressCallback

    assert all(_hf.is_progress_callback(c()) for c in (ProgressCallback, PrinterCallback, NotebookProgressCallback))
    assert not _hf.is_progress_callback(TrainerCallback())

    class OwnProgress(ProgressCallback):  # a subclass is still a progress printer (told by its bases)
        pass

    assert _hf.is_progress_callback(OwnProgress())


def check_byte_level_bpe():
    import json

    from fastkit.families.twins import twin_tokenizer

    spec = json.loads(twin_tokenizer().backend_tokenizer.to_str())
    assert _hf.byte_level_bpe(spec) == (spec["model"]["type"] == "BPE")
    assert not _hf.byte_level_bpe({"model": {"type": "Unigram"}, "pre_tokenizer": None})


def check_class_name_in():
    model = twin("qwen3_moe")
    assert sum(_hf.class_name_in(m, ("Qwen3MoeDecoderLayer",)) for m in model.modules()) == 2
    assert not any(_hf.class_name_in(m, ("NoSuchClass",)) for m in model.modules())


def check_has_masked_lm_head():
    assert _hf.has_masked_lm_head("bert") and not _hf.has_masked_lm_head("llama")


def check_is_pandas_dataframe():
    try:
        import pandas as pd
    except ImportError:  # no pandas here (the GPU machine): nothing is a DataFrame
        assert not _hf.is_pandas_dataframe({"a": [1]})
        return
    assert _hf.is_pandas_dataframe(pd.DataFrame({"a": [1]})) and not _hf.is_pandas_dataframe({"a": [1]})


def check_has_json_feature():
    from datasets import Dataset, Features, List, Value

    assert not _hf.has_json_feature(Features({"messages": List({"role": Value("string")}), "text": Value("string")}))
    import datasets.features as features

    if hasattr(features, "Json"):  # a column mixing a string and a number (datasets 5.2's Json type)
        mixed = Dataset.from_dict({"x": ["a"]}).features
        assert _hf.has_json_feature(Features({"outer": List(features.Json())})) and not _hf.has_json_feature(mixed)


def check_processor_class():
    from fastkit.families.vision import vision_twin_processor

    cls = _hf.processor_class("Qwen2_5_VLProcessor")
    assert cls.__name__ == "Qwen2_5_VLProcessor" and "image_processor" in cls.get_attributes()
    assert vision_twin_processor(next(t for t, f in registry.MODEL_TABLE.items()
                                      if f.vision is not None and f.vision.processor == "Qwen2_5_VLProcessor"))


def check_peft_target_matches():
    from peft import LoraConfig

    names = LoraConfig(target_modules=["q_proj"])
    assert _hf.peft_target_matches(names, "model.layers.0.self_attn.q_proj")
    assert not _hf.peft_target_matches(names, "model.layers.0.self_attn.k_proj")
    regex = LoraConfig(target_modules=r".*\.0\.self_attn\.q_proj")
    assert _hf.peft_target_matches(regex, "model.layers.0.self_attn.q_proj")
    assert not _hf.peft_target_matches(regex, "model.layers.1.self_attn.q_proj")


def check_accelerate_state_made():
    from accelerate.state import PartialState

    assert _hf.accelerate_state_made() == (PartialState._shared_state != {})
    PartialState()
    assert _hf.accelerate_state_made()


def _fake_trainer(kind):
    from types import SimpleNamespace

    state = SimpleNamespace(distributed_type=kind, fsdp_plugin=None)
    return SimpleNamespace(accelerator=SimpleNamespace(state=state), is_fsdp_enabled=False)


def check_fsdp_dropped_on_cpu():
    from accelerate.utils import DistributedType

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ACCELERATE_USE_FSDP", "true")
        assert _hf.fsdp_dropped_on_cpu(_fake_trainer(DistributedType.MULTI_CPU))
        assert not _hf.fsdp_dropped_on_cpu(_fake_trainer(DistributedType.MULTI_GPU))
        mp.setenv("ACCELERATE_USE_FSDP", "false")
        assert not _hf.fsdp_dropped_on_cpu(_fake_trainer(DistributedType.MULTI_CPU))


def check_fsdp_on_cpu():
    from accelerate import FullyShardedDataParallelPlugin
    from accelerate.utils import DistributedType

    trainer = _fake_trainer(DistributedType.MULTI_CPU)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FSDP_VERSION", "2")
        _hf.fsdp_on_cpu(trainer)
    assert isinstance(trainer.accelerator.state.fsdp_plugin, FullyShardedDataParallelPlugin)
    assert trainer.accelerator.state.fsdp_plugin.fsdp_version == 2
    assert trainer.accelerator.state.distributed_type == DistributedType.FSDP and trainer.is_fsdp_enabled


CHECKS = {name.removeprefix("check_"): fn for name, fn in dict(globals()).items() if name.startswith("check_")}
ACCESSORS = sorted(n for n in _hf.__all__ if n != "CHECKED")


def _in_hf(module: str | None) -> bool:
    """Defined in fastkit._hf or one of its submodules (its rooms: ``fastkit._hf.models``, ...)."""
    return module == _hf.__name__ or (module or "").startswith(_hf.__name__ + ".")


def test_every_accessor_is_exported_and_checked():
    defined = {n for n, v in vars(_hf).items()
               if not n.startswith("_") and callable(v) and _in_hf(getattr(v, "__module__", None))}
    assert defined == set(ACCESSORS), "fastkit._hf.__all__ must list every accessor"
    assert set(CHECKS) == set(ACCESSORS), f"accessors without a check here: {set(ACCESSORS) - set(CHECKS)}"


# TEMPORARY: is_progress_callback is being rewritten in parallel (the front-door helper's branch); the lead
# empties this at merge, once its docstring has both lines.
_DOCS_PENDING = ("is_progress_callback",)


@pytest.mark.parametrize("name", [n for n in ACCESSORS if n not in _DOCS_PENDING])
def test_accessor_says_what_it_was_checked_on_and_when_it_can_go(name):
    """Every accessor's docstring names the versions it was checked on and the condition that retires it."""
    doc = getattr(_hf, name).__doc__ or ""
    assert re.search(r"checked: \S+ \d", doc), f"_hf.{name}: no 'checked: <package> <version>' line"
    assert re.search(r"Can go when\s", doc), f"_hf.{name}: no 'Can go when <condition or upstream issue>' line"


@pytest.mark.parametrize("name", ACCESSORS)
def test_accessor(name):
    """Fails under the accessor's name when transformers / PEFT / TRL renamed what it reaches."""
    CHECKS[name]()


# ------------------------------------------------------------------------------------------------ layout


def _docstring_nodes(tree: ast.AST) -> set[int]:
    """ids of string-expression statements (module / class / function / attribute docstrings)."""
    return {id(node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(getattr(node.value, "value", None), str)}


def _rel(path: Path) -> str:
    """``path`` under fastkit/ (``registry/gguf.py``), what COMPAT and _CLASS_NAMES_ARE_DATA name."""
    return path.relative_to(ROOT).as_posix()


def _fastkit_files():
    return sorted(p for p in ROOT.rglob("*.py") if "__pycache__" not in p.parts)


def _own_names(sources) -> tuple[set[str], set[str]]:
    """fastkit's own private names (functions, classes, module globals, attributes it assigns) and class names."""
    private, classes = set(), set()
    for source in sources:
        for n in ast.walk(ast.parse(source)):
            if isinstance(n, ast.ClassDef):
                classes.add(n.name)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                private.add(n.name)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                private.add(n.attr)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                private.add(n.id)
    return {x for x in private if x.startswith("_")}, classes


OWN_PRIVATE, OWN_CLASSES = _own_names(p.read_text() for p in _fastkit_files())
OWN_CLASSES = tuple(OWN_CLASSES)


def _is_type_name(node) -> bool:
    """``type(x).__name__`` or ``x.__class__.__name__``."""
    return isinstance(node, ast.Attribute) and node.attr == "__name__" and (
        (isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "") == "type")
        or (isinstance(node.value, ast.Attribute) and node.value.attr == "__class__"))


def _dotted(node) -> str:
    return f"{_dotted(node.value)}.{node.attr}" if isinstance(node, ast.Attribute) else getattr(node, "id", "?")


def _fastkit_bindings(tree) -> set[str]:
    """Names a file binds to fastkit modules or objects (``from fastkit import _hf``, ``... as kernels``)."""
    names = {"self", "cls"}
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("fastkit"):
            names |= {a.asname or a.name for a in n.names}
        elif isinstance(n, ast.Import):
            names |= {a.asname or a.name.split(".")[0] for a in n.names if a.name.startswith("fastkit")}
    return names


def _all_strings(tree) -> set[int]:
    """ids of the string constants in ``__all__ = [...]`` (fastkit's own exported names)."""
    return {id(c) for n in ast.walk(tree) if isinstance(n, ast.Assign)
            and any(getattr(t, "id", "") == "__all__" for t in n.targets) for c in ast.walk(n.value)}


def private_uses(source: str, class_names_are_data: bool = False) -> list[str]:
    """Rule-based: what only a compat layer may do, found in code (docstrings and comments are prose).

    - an underscore attribute (not a dunder) on an object that is not fastkit's: not ``self`` / ``cls``, not a
      name bound to a fastkit import, not a private name fastkit itself defines;
    - ``type(x).__name__`` (or ``x.__class__.__name__``) in a comparison or a ``startswith`` / ``endswith``;
    - a string that spells a class name that is not fastkit's own (``"DbrxExperts"``);
    - imports from transformers' / PEFT's deep modules, and ``sys.modules`` (a modeling module's globals).
    """
    tree = ast.parse(source)
    skip = _docstring_nodes(tree) | _all_strings(tree)
    bound = _fastkit_bindings(tree)
    found = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.endswith("__")
                and node.attr not in OWN_PRIVATE and getattr(node.value, "id", None) not in bound
                and _dotted(node.value).split(".")[-1] not in _OP_NAMESPACES):
            found.append(f"{line}: {_dotted(node.value)}.{node.attr} (private attribute of an upstream object)")
        elif isinstance(node, ast.Compare) and any(_is_type_name(x) for x in (node.left, *node.comparators)):
            found.append(f"{line}: type(x).__name__ compared (test the class, in the compat layer)")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("startswith", "endswith") and _is_type_name(node.func.value)):
            found.append(f"{line}: type(x).__name__.{node.func.attr}(...)")
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
              and not class_names_are_data and _CLASS_NAME.match(node.value)
              and node.value not in OWN_CLASSES + _FORMAT_NAMES):
            found.append(f"{line}: class name {node.value!r} in a string")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(FRAGILE_MODULES):
            found.append(f"{line}: from {node.module} import ...")
        elif isinstance(node, ast.Import):
            found += [f"{line}: import {a.name}" for a in node.names if a.name.startswith(FRAGILE_MODULES)]
        elif isinstance(node, ast.Attribute) and node.attr == "modules" and getattr(node.value, "id", "") == "sys":
            found.append(f"{line}: sys.modules (a modeling module's globals)")
    return found


def non_pure_imports(source: str) -> list[str]:
    """Imports of anything but the standard library, torch, numpy, fastkit.errors and the pure-torch files."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module == "fastkit" and not node.level:
            names = [f"fastkit.{a.name}" for a in node.names]  # from fastkit import _torch: the module it names
        elif isinstance(node, ast.ImportFrom):
            names = [("." * node.level) + (node.module or "")]
        else:
            continue
        for name in names:
            root = name.split(".")[0]
            allowed = name.startswith(".") is False and (
                root in sys.stdlib_module_names or any(name == a or name.startswith(a + ".") for a in PURE_ALLOWED))
            if not allowed:
                bad.append(f"{node.lineno}: {name}")
    return bad


@pytest.mark.parametrize("snippet", [
    "model.config._attn_implementation = 'x'",
    "w = m._parameters.get(name)",
    "n = torch._C._storage_Use_Count(s._cdata)",
    "from transformers.integrations.moe import ExpertsInterface",
    "import transformers.modeling_layers",
    "sys.modules[type(m).__module__].eager_attention_forward",
    "if type(m).__name__ == 'DbrxExperts': pass",
    "ok = type(m).__name__.endswith('Experts')",
    "if cls in ('Linear4bit', 'Linear8bitLt'): pass",
    "x = model._hf_planted_private_name",  # a private name no list has ever heard of
])
def test_private_name_scan_flags(snippet):
    assert private_uses(snippet), snippet
    assert not private_uses(f'def f():\n    """Replaces {snippet!r}."""\n    # {snippet}\n')  # prose is allowed


def test_private_name_scan_allows_fastkit_own_names():
    ok = ("from fastkit import _hf\n_hf.attn_implementation(c)\nself._state = 1\n"
          "torch.ops.aten._local_scalar_dense.default\n__all__ = ['FastModel', 'SomeUpstreamName']\n"
          "raise ValueError(f'{type(m).__name__} is not supported')\n")
    assert not private_uses(ok)


def test_no_private_upstream_names_outside_the_compat_layers():
    found = {str(p.relative_to(ROOT.parent)): private_uses(p.read_text(), _rel(p).startswith(_CLASS_NAMES_ARE_DATA))
             for p in _fastkit_files() if not _rel(p).startswith(COMPAT)}
    found = {k: v for k, v in found.items() if v}
    assert not found, f"use (or add) an accessor in fastkit/_hf/ or fastkit/_torch.py instead: {found}"


def test_pure_torch_import_scan_flags():
    for bad in ("import transformers", "from fastkit.patching import Swapper", "from peft import LoraConfig",
                "from . import moe", "def f():\n    from fastkit import _hf"):
        assert non_pure_imports(bad), bad
    assert not non_pure_imports("import math\nimport torch.nn.functional as F\nfrom fastkit.errors import FastkitError")


@pytest.mark.parametrize("path", PURE_TORCH)
def test_pure_torch_files_import_no_glue(path):
    assert not non_pure_imports((ROOT / path).read_text()), f"{path} must stay pure torch"


def test_the_scan_flags_a_private_name_planted_in_a_fastkit_file(tmp_path):
    """A new private upstream name in a real fastkit file is caught although no list names it."""
    source = (ROOT / "patches" / "moe" / "patch.py").read_text()
    assert not private_uses(source)
    planted = source + "\n\ndef _planted(model):\n    return model.config._some_new_private_flag\n"
    assert private_uses(planted) == [f"{planted.count(chr(10))}: model.config._some_new_private_flag "
                                     "(private attribute of an upstream object)"]


def test_stdlib_argparse_flags():
    """fastkit._stdlib.argparse_flags: argparse's private names still where it reads them."""
    import argparse

    from fastkit._stdlib import argparse_flags

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    train = sub.add_parser("train")
    group = train.add_argument_group("g")
    group.add_argument("--lr", "--learning-rate", dest="learning_rate")
    train.add_argument("--tag", action="append")
    found = argparse_flags(parser)
    assert found["train"][0] is train
    assert found["train"][1] == {"--lr": "learning_rate", "--learning-rate": "learning_rate"}  # no help, no append
