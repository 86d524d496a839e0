"""Every private or version-fragile name of transformers, TRL and PEFT that fastkit touches, in one file.

Why. fastkit patches *instances* of transformers models: it selects attention and experts functions
by key, swaps per-layer checkpoint functions, and reads PEFT's LoRA factors without running PEFT's
parametrization. The names it needs for that are private (a leading underscore), sit in deep module
paths, or are matched by class name, so any upstream release may rename them. Each one is reached
here through one small function whose docstring says what it reads or writes, on which versions
that was checked (``checked:``) and when it can go (``Can go when``: the upstream change that makes it
unnecessary), as TRL's ``_compat.py`` does. ``tests/test_hf_compat.py`` calls every function on tiny
twins, so an upstream rename fails that test under the accessor's name; it also checks that each
docstring has both lines and that no other fastkit file uses these names.

What must not change. Writes that a patch must revert take the patch's
:class:`fastkit.patching.Swapper` (``swap``) and go through ``swap.setattr``, so ``revert`` restores the
very object that was there; without ``swap`` the write is plain (benchmarks, the temporary key of one
packed forward). transformers, TRL and PEFT are imported inside the functions: ``import fastkit``
imports none of them.

checked: transformers 5.24, 5.25, trl 1.16, peft 0.21.2 (every function below, unless it says otherwise).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch

from fastkit import registry
from fastkit.patching import Swapper

CHECKED = "transformers 5.24, 5.25, trl 1.16, peft 0.21.2"
"""The versions every accessor here was checked on (``tests/test_hf_compat.py`` runs them)."""

# The attribute names, spelled once.
_ATTN = "_attn_implementation"
_EXPERTS = "_experts_implementation"
_EXPERTS_INTERNAL = "_experts_implementation_internal"
_CHECKPOINT_FUNC = "_gradient_checkpointing_func"


def _set(target: Any, attr: str, value: Any, swap: Swapper | None) -> None:
    if swap is None:
        setattr(target, attr, value)
    else:
        swap.setattr(target, attr, value)


# ----------------------------------------------------------------------------------------- models, configs


@contextlib.contextmanager
def quiet_gguf_reader() -> Iterator[None]:
    """transformers' GGUF reader without its progress bar, for the duration of the ``with``.

    ``modeling_gguf_pytorch_utils`` draws ``tqdm.auto.tqdm(reader.tensors, desc="Converting and de-quantizing GGUF
    tensors...")`` directly (not transformers' ``logging.tqdm``, so ``disable_progress_bar`` misses it); the
    module global ``tqdm`` is swapped for one with ``disable=True``, unless ``FASTKIT_SHOW_UPSTREAM_WARNINGS=1``.
    checked: transformers 5.24, 5.25. Can go when the GGUF reader uses ``transformers.utils.logging.tqdm``.
    """
    import functools as _functools

    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    bar = getattr(gguf_utils, "tqdm", None)
    if bar is None or os.environ.get("FASTKIT_SHOW_UPSTREAM_WARNINGS") == "1":
        yield
        return
    with mock.patch.object(gguf_utils, "tqdm", _functools.partial(bar, disable=True)):
        yield


def has_causal_lm_head(model_type: str) -> bool:
    """True when ``AutoModelForCausalLM`` knows ``model_type``.

    Reads ``transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (a deep path).
    checked: transformers 5.24, 5.25.
    Can go when the auto mappings are exported from a public path (``modeling_auto`` is deep).
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def has_masked_lm_head(model_type: str) -> bool:
    """True when ``AutoModelForMaskedLM`` knows ``model_type`` (an encoder, even if it also has a causal-LM
    head class, like BERT's ``BertLMHeadModel``). Reads ``MODEL_FOR_MASKED_LM_MAPPING_NAMES`` (a deep path).
    checked: transformers 5.24, 5.25.
    Can go when the auto mappings are exported from a public path (``modeling_auto`` is deep).
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    return model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES


def is_pandas_dataframe(obj: Any) -> bool:
    """A pandas ``DataFrame``, recognized without importing pandas (absent where it is not installed).
    checked: pandas 3.1. Can go when pandas is a dependency (then ``isinstance`` directly); it is optional today.
    """
    pandas = sys.modules.get("pandas")
    return pandas is not None and isinstance(obj, pandas.DataFrame)


def has_json_feature(features: Any) -> bool:
    """Whether any (nested) ``datasets`` feature is the ``Json`` type ``load_dataset("json")`` gives a column whose
    type changes from row to row (a string in one row, a number in the next): fastkit refuses such columns.
    checked: datasets 5.2 (``datasets.features.Json``; older releases refuse the file instead: False). Can go when
    ``load_dataset`` can be told to refuse a column of mixed types itself.
    """
    from datasets import features as _features

    json_type = getattr(_features, "Json", None)
    if json_type is None:
        return False
    if isinstance(features, json_type):
        return True
    if isinstance(features, dict):
        return any(has_json_feature(v) for v in features.values())
    if isinstance(features, (list, tuple)):
        return any(has_json_feature(v) for v in features)
    inner = getattr(features, "feature", None)
    return inner is not None and has_json_feature(inner)


# Families 5.24 marked ``_is_stateful`` whose 5.25 configs name no stateful cache layer (no ``layer_types``): RWKV
# and xLSTM carry recurrent state, DeepSeek-V4 compressed-attention state.
_STATEFUL_WITHOUT_LAYER_TYPES = ("rwkv", "xlstm", "deepseek_v4")


def is_stateful_model(model: torch.nn.Module) -> bool:
    """True when the model carries recurrent / SSM / conv state along the sequence.

    transformers 5.24: the class attribute ``PreTrainedModel._is_stateful`` (mamba, jamba, qwen3_next, qwen3_5,
    falcon_h1, ...). 5.25 removed it; there the decoder config's ``layer_types`` say it: a layer type whose cache
    class in ``cache_utils.DYNAMIC_LAYER_TYPE_MAPPING`` is a ``LinearAttentionCacheLayerMixin`` ("linear_attention",
    "conv", "hybrid", "hybrid_sliding") holds state, as transformers' own cache does; plus
    ``_STATEFUL_WITHOUT_LAYER_TYPES``, read off 5.24's ``_is_stateful`` list. lfm2's default config lists no
    conv layer: its ``ShortConv`` is caught as a ``Conv1d`` by the packing check. checked: transformers 5.24.0, 5.25.0,
    5.25.0 (every family 5.24 marked ``_is_stateful``). Can go when transformers exposes a public "stateful"
    flag again.
    """
    if getattr(type(model), "_is_stateful", False):
        return True
    config = getattr(model, "config", None)
    if config is None:
        return False
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if getattr(text, "model_type", None) in _STATEFUL_WITHOUT_LAYER_TYPES:
        return True
    return bool(set(getattr(text, "layer_types", None) or ()) & _stateful_layer_types())


@functools.cache
def _stateful_layer_types() -> frozenset[str]:
    from transformers import cache_utils

    mixin = getattr(cache_utils, "LinearAttentionCacheLayerMixin", None)
    mapping = getattr(cache_utils, "DYNAMIC_LAYER_TYPE_MAPPING", {})
    if mixin is None:
        return frozenset()
    return frozenset(k for k, v in mapping.items() if isinstance(v, type) and issubclass(v, mixin))


def attn_implementation(config) -> str | None:
    """The attention key transformers dispatches to: reads ``config._attn_implementation`` (a property).

    checked: transformers 5.24, 5.25.
    Can go when the config's attention key is a public attribute.
    """
    return getattr(config, _ATTN)


def set_attn_implementation(config, key: str, swap: Swapper | None = None) -> None:
    """Write ``config._attn_implementation = key`` (through ``swap`` when given, so revert restores it).

    The property stores the value on the config instance; ``Swapper`` restores it by ``setattr``.
    checked: transformers 5.24, 5.25.
    Can go when the config's attention key is a public, per-instance attribute.
    """
    _set(config, _ATTN, key, swap)


def attention_registered(key: str) -> bool:
    """True when ``key`` is in transformers' global attention registry.

    Reads ``AttentionInterface._global_mapping`` (private: the public mapping is per instance).
    checked: transformers 5.24, 5.25.
    Can go when ``AttentionInterface`` has a public membership test of its global registry.
    """
    from transformers.modeling_utils import AttentionInterface

    return key in AttentionInterface._global_mapping


def register_attention(key: str, fn: Callable, mask_like: str | None = None) -> None:
    """Register ``fn`` under ``key`` in ``AttentionInterface``; with ``mask_like``, also register the mask
    function of that existing key under ``key`` in ``AttentionMaskInterface`` (read from its private
    ``_global_mapping``). Without it ``key`` has no mask function, so ``create_*_mask`` returns None.

    Additive: a key only changes models whose config selects it. checked: transformers 5.24, 5.25.
    Can go when ``AttentionMaskInterface`` has a public lookup of an existing key's mask function.
    """
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(key, fn)
    if mask_like is not None:
        AttentionMaskInterface.register(key, AttentionMaskInterface._global_mapping[mask_like])


def attention_function(module: torch.nn.Module, key: str) -> Callable:
    """The attention function transformers would call for ``key`` in ``module``.

    ``"eager"``: the family's own ``eager_attention_forward``, a global of the module's modeling file
    (read through ``sys.modules``); any other key: ``ALL_ATTENTION_FUNCTIONS[key]``.
    checked: transformers 5.24, 5.25.
    Can go when transformers exposes a public lookup of a family's eager attention function (it is a module global
    of each modeling file).
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if key == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[key]


class _ConfigView:
    """A read-only view of a config that reports another attention key."""

    def __init__(self, config, attn: str):
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, _ATTN, attn)

    def __getattr__(self, name):
        return getattr(self._config, name)


class AttentionView:
    """``module`` as an attention function must see it when it checks ``module.config._attn_implementation``
    (transformers' flash functions do): the same module, its config reporting ``attn``.

    checked: transformers 5.24, 5.25 (flash_attention_2 / 3 read the key from ``module.config``).
    Can go when transformers' flash attention functions take the key as an argument instead of reading
    ``module.config._attn_implementation``.
    """

    def __init__(self, module: torch.nn.Module, attn: str):
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "config", _ConfigView(module.config, attn))

    def __getattr__(self, name):
        return getattr(self._module, name)


# ------------------------------------------------------------------------------------------- checkpointing


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Non-reentrant gradient checkpointing on every decoder layer.

    Calls ``model.activation_checkpointing_enable`` (transformers 5 name of ``gradient_checkpointing_enable``).
    checked: transformers 5.24, 5.25.
    Can go when fastkit calls ``activation_checkpointing_enable`` directly: every transformers the
    floor allows (>=5.24,<6) has this name; only the one spelling of ``use_reentrant=False`` keeps it here.
    """
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


def checkpointed_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers gradient checkpointing wraps, in forward order: ``GradientCheckpointingLayer``
    instances (``transformers.modeling_layers``) whose ``gradient_checkpointing`` flag is on.

    checked: transformers 5.24, 5.25.
    Can go when ``GradientCheckpointingLayer`` is exported from a public path (``modeling_layers`` is deep).
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules()
            if isinstance(m, GradientCheckpointingLayer) and getattr(m, "gradient_checkpointing", False)]


def checkpoint_function(layer: torch.nn.Module) -> Callable:
    """The function a checkpointed layer runs itself through: reads ``layer._gradient_checkpointing_func``
    (an instance attribute ``gradient_checkpointing_enable`` sets). checked: transformers 5.24, 5.25.
    Can go when transformers lets a caller set the checkpoint function per layer publicly.
    """
    return getattr(layer, _CHECKPOINT_FUNC)


def set_checkpoint_function(layer: torch.nn.Module, fn: Callable, swap: Swapper) -> None:
    """Swap ``layer._gradient_checkpointing_func`` for ``fn`` through ``swap`` (revert restores the original
    object). checked: transformers 5.24, 5.25.
    Can go when transformers lets a caller set the checkpoint function per layer publicly.
    """
    swap.setattr(layer, _CHECKPOINT_FUNC, fn)


# --------------------------------------------------------------------------------------------------- MoE


def register_experts_function(key: str, fn: Callable) -> None:
    """Register ``fn`` under ``key`` in ``transformers.integrations.moe.ExpertsInterface`` (additive,
    idempotent). checked: transformers 5.24, 5.25.
    Can go when ``ExpertsInterface`` is exported from a public path (``integrations.moe`` is deep).
    """
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(key, fn)


def is_decorated_experts(module: torch.nn.Module) -> bool:
    """True for an instance of a ``@use_experts_implementation`` class: its ``__init__`` sets ``has_gate``,
    ``has_bias``, ``is_transposed``, ``_is_expert_parallel`` (and the module has a ``config``).
    checked: transformers 5.24, 5.25.
    Can go when ``@use_experts_implementation`` marks its classes publicly (a base class or a flag).
    """
    return all(hasattr(module, a) for a in ("has_gate", "has_bias", "is_transposed", "_is_expert_parallel", "config"))


def is_expert_parallel(module: torch.nn.Module) -> bool:
    """Reads ``module._is_expert_parallel`` of a decorated experts module (expert parallelism puts sentinel
    ids in the router output). checked: transformers 5.24, 5.25.
    Can go when the expert-parallel flag is public.
    """
    return bool(module._is_expert_parallel)


def experts_implementation(config) -> str | None:
    """The experts key ``@use_experts_implementation`` dispatches to: reads ``config._experts_implementation``.
    checked: transformers 5.24, 5.25.
    Can go when the config's experts key is a public attribute.
    """
    return getattr(config, _EXPERTS, None)


def set_experts_implementation(config, key: str, swap: Swapper | None = None) -> None:
    """Select the experts function ``key`` on ``config``.

    With ``swap`` (a patch): writes ``config._experts_implementation_internal``, the plain instance attribute
    behind the property, on THIS config only; the caller visits every config. The public setter recurses
    into sub-configs, so undoing it newest-first would overwrite a sub-config's own original with its
    parent's (Note: [config swap] in fastkit.patches.moe.patch). Without ``swap`` (benchmarks): the property
    setter, which also sets the sub-configs. checked: transformers 5.24, 5.25.
    Can go when transformers has a public per-config setter that does not recurse into sub-configs (Note: [config
    swap]).
    """
    if swap is None:
        setattr(config, _EXPERTS, key)
    else:
        swap.setattr(config, _EXPERTS_INTERNAL, key)


def apply_gate(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The gated activation of a decorated experts module: ``module._apply_gate(x)`` ``(S, 2I) -> (S, I)``
    (GPT-OSS interleaved clamp-SwiGLU, the default concatenated SwiGLU). checked: transformers 5.24, 5.25.
    Can go when the experts' gated activation is public (``_apply_gate`` is private in 5.24).
    """
    return module._apply_gate(x)


def grouped_mm_disabled():
    """A context in which transformers' ``grouped_mm`` experts path takes its fallback (what a T4 gets):
    patches ``transformers.integrations.moe._can_use_grouped_mm`` to return False. checked: transformers 5.24, 5.25.
    Can go when transformers has a public switch for its grouped_mm fallback (tests and benchmarks use this one).
    """
    return mock.patch("transformers.integrations.moe._can_use_grouped_mm", return_value=False)



@contextlib.contextmanager
def on_param_loaded(callback: Callable[[torch.nn.Module, str], None]) -> Iterator[None]:
    """While ``from_pretrained`` runs inside this context, call ``callback(model, target_name)`` right after
    transformers sets each loaded parameter on the (meta-initialized) model.

    Wraps ``transformers.core_model_loading.set_param_for_module`` (the module global that
    ``convert_and_load_state_dict_in_model`` calls once per converted target, e.g. once per fused
    ``experts.gate_up_proj``), and sets ``HF_DEACTIVATE_ASYNC_LOAD=1`` so checkpoint tensors are read
    lazily, one target at a time (the loader's thread pool would otherwise read every tensor ahead).
    checked: transformers 5.24, 5.25.
    Can go when ``from_pretrained`` offers a public per-parameter load hook (none in 5.24).
    """
    import transformers.core_model_loading as cml

    original = cml.set_param_for_module

    def set_and_call(model, target_name, *args, **kwargs):
        original(model, target_name, *args, **kwargs)
        callback(model, target_name)

    with mock.patch.object(cml, "set_param_for_module", set_and_call), \
            mock.patch.dict(os.environ, {"HF_DEACTIVATE_ASYNC_LOAD": "1"}):
        yield


# -------------------------------------------------------------------------------------------------- PEFT


def peft_lora_factors(module: torch.nn.Module, name: str
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float] | None:
    """PEFT ``target_parameters`` LoRA parametrizing ``module.<name>`` right now: ``(W, lhs, rhs, scaling)``.

    ``W`` is the stored base tensor (``parametrizations[name].original``) and ``lhs @ rhs`` the update in
    the parameter's own layout. None unless exactly one PEFT ``_LoraFactorsProxy`` (matched by class
    name; PEFT registers it only for the duration of its ``ParamWrapper`` forward) parametrizes it.
    checked: peft 0.21.2.
    Can go when PEFT exposes a ``ParamWrapper``'s active factors publicly (``_LoraFactorsProxy`` is private and
    registered only during its forward).
    """
    plist = getattr(getattr(module, "parametrizations", None), name, None)
    if plist is None:
        return None
    mods = list(plist)
    if len(mods) != 1 or type(mods[0]).__name__ != "_LoraFactorsProxy":
        return None
    proxy = mods[0]
    return plist.original, proxy.lhs, proxy.rhs, proxy.scaling


def peft_target_matches(config: Any, module_name: str) -> bool:
    """Whether a LoRA ``config``'s ``target_modules`` selects the module named ``module_name``, matched as PEFT
    matches when it wraps a model (a list of names: the name's last parts; a string: a regex over the full name).
    ``check_target_module_exists`` lives in ``peft.tuners.tuners_utils``. checked: peft 0.21.2.
    Can go when PEFT exports the matcher from its top level (``peft.tuners.tuners_utils`` is deep)."""
    from peft.tuners.tuners_utils import check_target_module_exists

    return bool(check_target_module_exists(config, module_name))


def peft_param_wrappers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """``(qualified name, wrapper)`` of every PEFT ``ParamWrapper`` (``target_parameters`` LoRA) in ``model``.

    ``ParamWrapper`` lives in ``peft.tuners.lora.layer``. checked: peft 0.21.2.
    Can go when ``ParamWrapper`` is exported from PEFT's top level (``peft.tuners`` is deep).
    """
    from peft.tuners.lora.layer import ParamWrapper

    return ((n, m) for n, m in model.named_modules() if isinstance(m, ParamWrapper))


def peft_expert_factors(wrapper: torch.nn.Module, adapter: str = "default"
                        ) -> tuple[str, int, torch.Tensor, torch.Tensor] | None:
    """``(parameter_name, num_experts, A (r·E, in), B (out, r·E))`` of ``adapter`` on a ``ParamWrapper``,
    or None when it has no such adapter. PEFT's B has the expert index fastest in its columns.
    checked: peft 0.21.2.
    Can go when PEFT documents ``ParamWrapper``'s per-expert factor layout as public API.
    """
    if adapter not in wrapper.lora_A:
        return None
    return wrapper.parameter_name, wrapper.num_experts, wrapper.lora_A[adapter].weight, wrapper.lora_B[adapter].weight


def peft_lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """``{qualified name: layer}`` of every PEFT LoRA layer (``peft.tuners.lora.LoraLayer``: Linear, Embedding,
    ``ParamWrapper``...) in ``model``. checked: peft 0.21.2.
    Can go when ``LoraLayer`` is exported from PEFT's top level (``peft.tuners`` is deep).
    """
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def peft_delta(layer: torch.nn.Module, param: str) -> torch.Tensor | None:
    """The summed update ``Σ s·B·A`` of ``layer``'s active, unmerged adapters for its stored parameter ``param``,
    in that parameter's own layout (``get_delta_weight``); None when ``param`` is not the one ``layer`` adapts
    (a ``ParamWrapper`` adapts ``parameter_name``, other layers ``weight``) or nothing is active.
    checked: peft 0.21.2.
    Can go when PEFT offers a public summed update of a layer's active adapters for a named parameter.
    """
    from peft.tuners.lora.layer import ParamWrapper

    target = layer.parameter_name if isinstance(layer, ParamWrapper) else "weight"
    if param != target or layer.merged or layer.disable_adapters:
        return None
    own = set(layer.lora_A) | set(getattr(layer, "lora_embedding_A", {}))
    deltas = [layer.get_delta_weight(a) for a in layer.active_adapters if a in own]
    return torch.stack(deltas).sum(0) if len(deltas) > 1 else (deltas[0] if deltas else None)


# --------------------------------------------------------------------------------------------- Trainer


def prepare_inputs(trainer, batch: dict) -> dict:
    """A collated batch as ``training_step`` receives it (on the device): ``trainer._prepare_inputs(batch)``.

    checked: transformers 5.24, 5.25, trl 1.16 (``SFTTrainer``).
    Can go when the Trainer exposes its input preparation publicly.
    """
    return trainer._prepare_inputs(batch)


def save_checkpoint(trainer) -> str:
    """Write ``output_dir/checkpoint-<global_step>`` as ``trainer.train()`` does at a save step (the adapter, optimizer,
    scheduler, RNG states, trainer_state.json; ``save_total_limit`` applied), then run the ``on_save`` callbacks (the
    run identity fastkit's resume checks). ``trainer._save_checkpoint(model, trial=None)``; returns the folder.

    checked: transformers 5.24, 5.25 (``_save_checkpoint(self, model, trial)``).
    Can go when the Trainer exposes saving a resumable checkpoint publicly.
    """
    trainer._save_checkpoint(trainer.model, trial=None)
    trainer.control = trainer.callback_handler.on_save(trainer.args, trainer.state, trainer.control)
    return os.path.join(trainer.args.output_dir, f"checkpoint-{trainer.state.global_step}")


def trainer_loss_accumulator(trainer) -> torch.Tensor:
    """The device tensor the Trainer sums step losses into between log points: ``trainer._tr_loss``.

    Created by ``_inner_training_loop``, read (``.item()``) and zeroed in ``_maybe_log_save_evaluate``.
    checked: transformers 5.24, 5.25.
    Can go when the Trainer exposes its loss accumulator publicly (fastkit reads it for the zero-sync loss log).
    """
    return trainer._tr_loss


def steps_since_log(trainer) -> int:
    """``1 + global_step - _globalstep_last_logged``: the divisor ``_run_epoch``'s NaN/Inf loss filter uses.

    checked: transformers 5.24, 5.25.
    Can go when the Trainer exposes the steps since its last log publicly.
    """
    return 1 + trainer.state.global_step - trainer._globalstep_last_logged


def sft_metrics(trainer) -> dict:
    """TRL's per-mode metric lists, ``SFTTrainer._metrics`` (``{"train": defaultdict(list), "eval": ...}``);
    ``SFTTrainer.log`` averages each list and clears it.

    checked: trl 1.16.
    Can go when TRL exposes its per-mode metric lists publicly.
    """
    return trainer._metrics


def sft_token_total(trainer) -> int:
    """``SFTTrainer._total_train_tokens``: the running token count TRL logs as ``num_tokens``. checked: trl 1.16.
    Can go when TRL exposes its token count publicly.
    """
    return trainer._total_train_tokens


def set_sft_token_total(trainer, total: int) -> None:
    """Write ``SFTTrainer._total_train_tokens``. checked: trl 1.16.
    Can go when TRL exposes its token count publicly (resume writes it back).
    """
    trainer._total_train_tokens = total


def sft_tp_size(trainer) -> int:
    """``SFTTrainer._tp_size``: tensor-parallel ranks that see the same batch (TRL divides token counts by it).

    checked: trl 1.16.
    Can go when TRL exposes its tensor-parallel size publicly.
    """
    return trainer._tp_size


def grpo_tokenizer(trainer):
    """The tokenizer a ``trl.GRPOTrainer`` pads and decodes with: ``GRPOTrainer._tokenizer`` (the processing class,
    or its ``.tokenizer`` for a processor); fastkit's packed log-prob pass reads its ``pad_token_id``.

    checked: trl 1.16.
    Can go when TRL exposes the GRPO trainer's tokenizer publicly.
    """
    return trainer._tokenizer


# ------------------------------------------------------------------------------- stateful-layer kernels
# transformers 5.24 wraps each kernel function of a hybrid modeling module (``causal_conv1d_fn``,
# ``torch_chunk_gated_delta_rule``, ``mamba2_chunk_scan`` ...) in
# ``integrations.hub_kernels.use_kernel_func_from_hub_with_fallback(func_name, package)``: at import it resolves
# ``package``'s function (``implementation``) or keeps the torch reference (``torch_function``); every call
# filters the mixer's ``**kwargs`` down to the resolved function's parameters, and the torch reference
# *raises* when given ``cu_seqlens`` / ``seq_idx``. The mixers forward their ``**kwargs`` to these calls and
# feed the conv channel-last (``in_proj(x).transpose(1, 2)``). transformers 5.25 routes the conv through a new
# ``causal_conv1d_forward(conv1d, x, cache, layer_idx, activation, **kwargs)`` that, without a cache, calls
# ``causal_conv1d_fn(x, weight, bias, activation=, **kwargs)`` as the mixers did; mamba-2 mixers call
# ``mamba2_chunk_scan(..., **kwargs)`` from a new ``mamba2_scan_forward``; with ``kernels`` installed each global is
# a ``Func`` module (:func:`hub_function`), and a package's kernel on an input of a device it does not list
# (``_PACKAGE_SUPPORTED_DEVICES``: causal-conv1d and mamba-ssm "cuda") runs the torch reference. checked:
# transformers 5.24.0, 5.25.0 (modeling files of the ten families below, hub_kernels.py). Can go when transformers
# says which implementation it resolved (a public attribute on the wrapper) — then only the version table stays.
VARLEN_KERNELS: dict[str, tuple[tuple[str, str], ...]] = {
    "gated_delta": (("causal_conv1d_fn", "causal_conv1d"), ("torch_chunk_gated_delta_rule", "fla")),
    "short_conv": (("causal_conv1d_fn", "causal_conv1d"),),
    "mamba2": (("causal_conv1d_fn", "causal_conv1d"), ("mamba2_chunk_scan", "mamba_ssm"),
               ("mamba2_split_conv1d_scan_combined", "mamba_ssm")),
}
"""Per varlen kind (``ModelFacts.varlen``): ``(modeling-module global, package)`` of every kernel a packed
forward of that mixer calls (no cache); each must resolve to the package for the varlen path."""
VARLEN_TRANSFORMERS = ("5.24", "5.26")
"""transformers versions ``[lo, hi)`` whose hybrid mixers were read as above (kwargs forwarded, conv layout)."""
VARLEN_PACKAGES: dict[str, tuple[tuple[str, ...], str, str]] = {
    # fla-core 0.6.0 (wheel read): chunk_gated_delta_rule(cu_seqlens=, cu_seqlens_cpu=, chunk_indices=), batch 1,
    # chunk_indices = [[doc, chunk-in-doc]] for chunk_size 64, taken as given by every kernel of the fwd and bwd.
    "fla": (("fla-core", "flash-linear-attention"), "0.6.0", "0.7"),
    # causal-conv1d 1.6.1 (github 0d2252d) and 1.7.0 (sdist): seq_idx int32 (B, T), channel-last x only
    # (TORCH_CHECK in csrc/causal_conv1d.cpp), no initial_states / final states with it.
    "causal_conv1d": (("causal-conv1d",), "1.6.1", "1.8"),
    # mamba-ssm 2.3.2.post1 (github e9594ce): mamba_chunk_scan_combined / mamba_split_conv1d_scan_combined(seq_idx=),
    # int32 (B, T); no host reads in ops/triton/ssd_*.py.
    "mamba_ssm": (("mamba-ssm",), "2.3.2", "2.4"),
}
"""Per package: distribution names, and the version range ``[lo, hi)`` whose varlen arguments were read."""


def _closure(fn: Callable) -> dict:
    """The free variables ``fn`` closes over ({} for a builtin or a callable object)."""
    import inspect

    try:
        return inspect.getclosurevars(fn).nonlocals
    except TypeError:
        return {}


def hub_function(fn: Any) -> Any:
    """The plain function behind a hub-kernel global: ``fn`` itself, or the one a ``kernels`` ``Func`` wraps.

    transformers 5.25 requires ``kernels`` 0.19.1 and, with it installed, its ``use_kernel_forward_from_hub``
    turns every decorated *function* of a modeling module into an instance of a per-function ``nn.Module``
    class ``Func`` whose ``forward`` closes over the function (``func``). 5.24 took ``kernels`` only in
    [0.18.2, 0.19.0) and otherwise left the function as it was. Reads ``Func.forward``'s closure.
    checked: transformers 5.24.0, 5.25.0; kernels 0.19.1 (``_internals/layer/layer.py`` ``_create_func_module``).
    Can go when ``kernels``' ``Func`` exposes the function it wraps (a public attribute).
    """
    if isinstance(fn, torch.nn.Module) and type(fn).__name__ == "Func":
        inner = _closure(type(fn).forward).get("func")
        return inner if callable(inner) else fn
    return fn


def kernel_global(module_cls: type, name: str) -> Callable | None:
    """transformers' fallback wrapper of the kernel ``name`` in ``module_cls``'s modeling module, unwrapped from
    ``kernels``' ``Func`` (:func:`hub_function`); None when that global is missing.
    checked: transformers 5.24.0, 5.25.0. Can go when :func:`hub_function` can (``Func`` exposing its function).
    """
    fn = hub_function(getattr(sys.modules.get(module_cls.__module__), name, None))
    return fn if callable(fn) else None


def kernel_reference(module_cls: type, name: str) -> Callable | None:
    """The torch reference behind the kernel ``name`` of ``module_cls``'s modeling module (the function the
    family wrote, before ``use_kernel_func_from_hub_with_fallback`` wrapped it; its ``functools.wraps``
    ``__wrapped__``). checked: transformers 5.24.0, 5.25.0. Can go when :func:`hub_function` can.
    """
    fn = kernel_global(module_cls, name)
    ref = _closure(fn).get("torch_function") if fn is not None else None
    return ref if callable(ref) else getattr(fn, "__wrapped__", None)


def resolved_kernel(module_cls: type, name: str) -> Callable | None:
    """The package function transformers resolved for the kernel ``name`` of ``module_cls``'s modeling module.

    None when that global is missing, is not transformers' fallback wrapper, or runs the torch reference.
    Reads the wrapper's closure (``implementation``, ``torch_function``), unwrapped from ``kernels``' ``Func``
    where 5.25 put it there (:func:`hub_function`). checked: transformers 5.24.0, 5.25.0.
    Can go when transformers says which implementation it resolved (a public attribute on the wrapper), as
    :data:`VARLEN_KERNELS` notes.
    """
    fn = kernel_global(module_cls, name)
    if fn is None:
        return None
    free = _closure(fn)
    impl, ref = free.get("implementation"), free.get("torch_function")
    return impl if callable(impl) and ref is not None and impl is not ref else None


def package_version(package: str) -> str | None:
    """The installed version of a kernel package (import name), or None when it cannot be told.
    checked: fla-core 0.6.0, causal-conv1d 1.6.1 / 1.7.0, mamba-ssm 2.3.2 (VARLEN_PACKAGES). Can go when
    transformers reports which kernel package and version it resolved (as for :data:`VARLEN_KERNELS`).
    """
    from importlib import metadata

    for dist in VARLEN_PACKAGES.get(package, ((package,),))[0]:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    module = sys.modules.get(package)
    version = getattr(module, "__version__", None)
    return version if isinstance(version, str) else None


def _in_range(version: str | None, lo: str, hi: str) -> bool:
    from packaging.version import InvalidVersion, Version

    try:
        return version is not None and Version(lo) <= Version(version) < Version(hi)
    except InvalidVersion:
        return False


def varlen_unavailable(module_cls: type, kind: str) -> str | None:
    """Why a mixer of ``kind`` cannot take the varlen kernels here (None: it can, on a CUDA tensor).
    checked: transformers 5.24.0, 5.25.0 and the package ranges in :data:`VARLEN_PACKAGES`. Can go when transformers
    says which implementation it resolved (then only the version table stays).
    """
    import transformers

    if kind not in VARLEN_KERNELS:
        return "no varlen kernel for this layer in fastkit"
    lo, hi = VARLEN_TRANSFORMERS
    if not _in_range(transformers.__version__, lo, hi):
        return f"transformers {transformers.__version__} not checked (varlen read on [{lo}, {hi}))"
    for name, package in VARLEN_KERNELS[kind]:
        if resolved_kernel(module_cls, name) is None:
            return f"{name} runs transformers' torch reference: {package} is not importable"
        version = package_version(package)
        _, lo, hi = VARLEN_PACKAGES[package]
        if not _in_range(version, lo, hi):
            return f"{package} {version} outside the checked range [{lo}, {hi})"
    return None


# ---------------------------------------------------------------------------------------- class identity
# Upstream classes recognized by what they are (isinstance where the class imports, its name where the
# family's module is only imported with the model). checked: transformers 5.24, 5.25, peft 0.21.2,
# bitsandbytes 0.50.2, tokenizers 0.22. Stays while the families have no shared interface to test for.

# The class lists are the table's (``ModelFacts.looped_experts`` / ``looped_forward`` / ``no_4bit_experts``), read
# at call time; here only what each fastkit looped forward needs of the module it is handed.
_LOOPED_SHAPE: dict[str, Callable[[torch.nn.Module], bool]] = {
    "dbrx": lambda m: hasattr(getattr(m, "mlp", None), "w1"),  # (E·F, H) w1 / v1 / w2 on module.mlp
    "llama4": lambda m: hasattr(getattr(m, "experts", None), "gate_up_proj"),  # fused (E, H, 2I) under .experts
}


def class_name_in(module: Any, names: tuple[str, ...]) -> bool:
    """``module``'s class is one of ``names`` (registry rows name a family's modules, e.g. its stateful layers;
    the family's modeling module is only imported with the model, so its classes are matched by name).
    checked: transformers 5.24, 5.25 (the class names in the table's rows). Can go when the families share a public
    interface fastkit can ``isinstance`` (their modeling modules import only with the model today).
    """
    return type(module).__name__ in names


def is_bnb_linear(module: Any) -> bool:
    """A bitsandbytes ``Linear4bit`` / ``Linear8bitLt`` (False when bitsandbytes does not import).
    checked: bitsandbytes 0.50.2. Can go when bitsandbytes imports everywhere without a GPU build (the guarded
    import is the fragile part), or transformers offers a public quantized-linear test.
    """
    try:
        import bitsandbytes.nn as bnb
    except Exception:  # noqa: BLE001 - no bitsandbytes (or no GPU build): nothing can be a bnb layer
        return False
    return isinstance(module, (bnb.Linear4bit, bnb.Linear8bitLt))


def is_fused_experts_class(module: torch.nn.Module) -> bool:
    """A fused 3-D experts module by its class name (``...Experts``), decorated or not.
    checked: transformers 5.24, 5.25. Can go when every fused experts class carries ``@use_experts_implementation``
    (then :func:`is_decorated_experts` answers alone).
    """
    return type(module).__name__.endswith("Experts")


def looped_experts_kind(module: torch.nn.Module) -> str | None:
    """The ``looped_forward`` of the table row listing ``module``'s class in ``looped_experts`` (``"dbrx"``:
    ``DbrxExperts`` with ``mlp.w1``; ``"llama4"``: ``Llama4TextMoe`` over fused ``experts.gate_up_proj``), when
    the module has what that forward reads; else None. checked: transformers 5.24, 5.25 (dbrx, llama4 modeling files).
    Can go when DBRX and Llama-4 experts use ``@use_experts_implementation`` upstream (then the rows'
    ``looped_experts`` go too).
    """
    kind = registry.looped_experts().get(type(module).__name__)
    shape_ok = _LOOPED_SHAPE.get(kind or "")
    return kind if shape_ok is not None and shape_ok(module) else None


def modules_of_classes(module: torch.nn.Module, names: tuple[str, ...]) -> list[torch.nn.Module]:
    """The submodules of ``module`` whose class is one of ``names`` (a row's ``stateful`` layer classes).
    checked: transformers 5.24, 5.25 (the ``stateful`` classes of the hybrid rows). Can go when the stateful layers
    share a public base class upstream (matched by name today).
    """
    return [m for m in module.modules() if type(m).__name__ in names]


def has_no_4bit_layout(module: torch.nn.Module) -> bool:
    """Experts fastkit cannot store 4-bit: a class some table row lists in ``no_4bit_experts`` (DBRX, Llama-4,
    JetMoE today), or transformers' own ``Mxfp4`` modules. checked: transformers 5.24, 5.25.
    Can go when fastkit has a 4-bit layout for every experts class the table lists (then only the ``Mxfp4`` test
    stays, or that too when transformers' MXFP4 modules are public).
    """
    cls = type(module).__name__
    return cls in registry.no_4bit_experts() or cls.startswith("Mxfp4")


PROGRESS_CALLBACKS = frozenset({("transformers.trainer_callback", "ProgressCallback"),
                                ("transformers.trainer_callback", "PrinterCallback"),
                                ("transformers.utils.notebook", "NotebookProgressCallback")})
"""(module, class name) of transformers' progress printers (transformers 5.24)."""


def is_progress_callback(callback: Any) -> bool:
    """transformers' progress printers (``ProgressCallback``, ``PrinterCallback``, ``NotebookProgressCallback``).

    Told by the class's module and name (its own or a base's), never by importing them:
    ``transformers.utils.notebook`` imports IPython, which a terminal install does not have (issue 30).
    """
    return any((cls.__module__, cls.__name__) in PROGRESS_CALLBACKS for cls in type(callback).__mro__)


def accelerate_state_made() -> bool:
    """True once accelerate's process state (``PartialState``, shared by every ``Accelerator``) was made in this
    process: processes forked from it would inherit it.
    checked: accelerate 1.16 (``PartialState._shared_state``, the dict its ``initialized`` property reads).
    Can go when accelerate offers a module-level check for ``PartialState`` (``accelerate.state.is_initialized``
    reads ``AcceleratorState`` only).
    """
    from accelerate.state import PartialState

    return bool(PartialState._shared_state)


def fsdp_dropped_on_cpu(trainer) -> bool:
    """True when the job asked for FSDP (``accelerate launch --use_fsdp``, ``ACCELERATE_USE_FSDP=true``) and
    accelerate dropped it: on CPU processes (``DistributedType.MULTI_CPU``) ``AcceleratorState`` keeps no FSDP
    plugin and the Trainer wraps the model in DDP, silently.
    checked: accelerate 1.16 (``AcceleratorState.__init__`` takes ``fsdp_plugin`` only in its GPU-type branch).
    Can go when accelerate keeps the FSDP plugin for ``DistributedType.MULTI_CPU``.
    """
    from accelerate.utils import DistributedType, parse_flag_from_env

    state = trainer.accelerator.state
    return (parse_flag_from_env("ACCELERATE_USE_FSDP", default=False) and getattr(state, "fsdp_plugin", None) is None
            and state.distributed_type == DistributedType.MULTI_CPU)


def fsdp_on_cpu(trainer) -> None:
    """Give the Trainer's accelerator the FSDP plugin accelerate dropped on CPU (:func:`fsdp_dropped_on_cpu`), from
    the same environment (``FSDP_VERSION``, ``FSDP_AUTO_WRAP_POLICY``, ...), so ``accelerator.prepare`` shards the
    model with torch's ``fully_shard`` over the gloo group instead of wrapping it in DDP.
    checked: accelerate 1.16, transformers 5.25 (``AcceleratorState.fsdp_plugin`` / ``distributed_type``, the
    Trainer's ``is_fsdp_enabled`` read after it made its accelerator). Can go when accelerate keeps the FSDP plugin
    for ``DistributedType.MULTI_CPU``.
    """
    from accelerate import FullyShardedDataParallelPlugin
    from accelerate.utils import DistributedType

    state = trainer.accelerator.state
    state.fsdp_plugin = FullyShardedDataParallelPlugin()
    state.distributed_type = DistributedType.FSDP
    trainer.is_fsdp_enabled = True


BYTE_LEVEL = "ByteLevel"
"""tokenizers' ``"type"`` of its byte-level pre-tokenizer / decoder in ``tokenizer.json`` (tokenizers 0.22)."""


def byte_level_bpe(spec: dict) -> bool:
    """A ``tokenizer.json`` (as a dict) of a byte-level BPE tokenizer: ``model.type`` BPE, a ``ByteLevel``
    pre-tokenizer somewhere in its tree.
    checked: tokenizers 0.23 (the ``tokenizer.json`` layout). Can go when tokenizers exposes the model and
    pre-tokenizer types on the fast tokenizer publicly.
    """
    import json

    return spec.get("model", {}).get("type") == "BPE" and BYTE_LEVEL in json.dumps(spec.get("pre_tokenizer"))



def processor_class(name: str) -> type:
    """transformers' processor class ``name``; where torchvision is missing, a same-named subclass without its video
    processor: ``ProcessorMixin`` checks, saves and loads every attribute its ``__init__`` names, and without
    torchvision ``VIDEO_PROCESSOR_MAPPING`` is a placeholder whose lookup raises (``_extra_content``) even for
    ``video_processor=None``. Images need no torchvision (the ``*ImageProcessorPil`` classes); saves keep the
    upstream class name (a machine with torchvision loads them with ``AutoProcessor``).
    checked: transformers 5.24, 5.25. Can go when ``ProcessorMixin`` accepts a missing video processor without
    torchvision (or fastkit requires torchvision).
    """
    import importlib.util

    import transformers

    cls = getattr(transformers, name)
    if importlib.util.find_spec("torchvision") is not None:
        return cls

    def get_attributes(klass):
        return [a for a in cls.get_attributes() if a != "video_processor"]

    return type(cls.__name__, (cls,), {"get_attributes": classmethod(get_attributes), "__module__": cls.__module__})

__all__ = [
    "CHECKED", "AttentionView", "accelerate_state_made", "apply_gate", "attention_function", "attention_registered",
    "attn_implementation", "byte_level_bpe", "class_name_in", "fsdp_dropped_on_cpu", "fsdp_on_cpu", "grpo_tokenizer",
    "has_json_feature", "has_masked_lm_head",
    "has_no_4bit_layout", "is_bnb_linear",
    "is_fused_experts_class", "is_pandas_dataframe", "is_progress_callback", "looped_experts_kind",
    "modules_of_classes", "package_version", "quiet_gguf_reader", "resolved_kernel", "varlen_unavailable",
    "hub_function", "kernel_global", "kernel_reference",
    "checkpoint_function", "checkpointed_layers", "enable_activation_checkpointing", "experts_implementation",
    "grouped_mm_disabled", "has_causal_lm_head", "is_decorated_experts", "is_expert_parallel", "is_stateful_model",
    "on_param_loaded", "processor_class",
    "peft_delta",
    "peft_expert_factors", "peft_lora_factors", "peft_lora_layers", "peft_param_wrappers", "peft_target_matches",
    "prepare_inputs",
    "register_attention", "register_experts_function", "set_attn_implementation", "set_checkpoint_function",
    "set_experts_implementation", "set_sft_token_total", "sft_metrics", "sft_token_total", "sft_tp_size",
    "save_checkpoint", "steps_since_log", "trainer_loss_accumulator",
]
