"""transformers' models and configs: the auto mappings, the GGUF reader's progress bar, stateful models, the
attention key and its registries, activation checkpointing. Part of :mod:`fastkit._hf` (its docstring says the rules);
checked: :data:`fastkit._hf.CHECKED` unless an accessor says otherwise.
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

from fastkit.patching import Swapper

# The attribute names, spelled once.
_ATTN = "_attn_implementation"
_CHECKPOINT_FUNC = "_gradient_checkpointing_func"


def _set(target: Any, attr: str, value: Any, swap: Swapper | None) -> None:
    if swap is None:
        setattr(target, attr, value)
    else:
        swap.setattr(target, attr, value)


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


@contextlib.contextmanager
def output_capture_for_compiled_region() -> Iterator[None]:
    """transformers' output-capturing hooks (router logits, attentions, hidden states: on the attention and router
    modules) read ``output_capturing._active_collector``, a ``CompileableContextVar``: a ContextVar dynamo cannot
    trace, unless the collector was set while compiling (a whole-model compile sets it in the model's forward). A
    region compiled alone (a decoder layer) is called from an eager forward that set the ContextVar: every hooked call
    inside it broke the graph (32 graphs in 4 steps of a qwen3_moe twin). For the duration of such a call, the
    collector the eager caller set is published as the variable's compile-time global, as transformers does under a
    whole-model compile, and put back after; a no-op where transformers has no such variable.
    checked: transformers 5.25.
    Can go when transformers' output capture reads no ContextVar inside a compiled region.
    """
    from transformers.utils import output_capturing

    var = getattr(output_capturing, "_active_collector", None)
    if var is None or not hasattr(var, "context_var") or var.compiling:
        yield
        return
    saved = var.global_var, var.compiling
    # An empty collector asks for nothing, as None does: one value, one graph (the recompute in backward sees None)
    var.global_var, var.compiling = var.context_var.get() or None, True
    try:
        yield
    finally:
        var.global_var, var.compiling = saved
