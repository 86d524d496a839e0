"""Where a plan's model comes from, and the checks its config passes before anything is counted.

:func:`planned_config` gives a shipped Hub id's :class:`~fastkit.plan.configs.ShippedConfig` (its shape counted
already: no torch, no transformers), else :func:`read_config`'s transformers config, from a config object, a model,
a local folder or ``config.json``, the local Hub cache, or the Hub (the config only, never the weights).
:func:`write_shapes` counts the shipped shapes anew (``fastkit/plan/shapes.json``).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict
from typing import Any

from fastkit.errors import FastkitError
from fastkit.plan.configs import KNOWN_CONFIGS, SHAPES, ShippedConfig, known_config, lora_dim_counts, shipped_config

logger = logging.getLogger(__name__)


def read_config(model_or_config: Any):
    """A transformers config from a config object, a model, a local folder / config.json, or a Hub id."""
    if isinstance(model_or_config, dict):
        return config_from_dict(dict(model_or_config))
    if not isinstance(model_or_config, (str, os.PathLike)):  # a config or a model: torch and transformers are in
        import torch
        from transformers import PretrainedConfig

        if isinstance(model_or_config, PretrainedConfig):
            return model_or_config
        if isinstance(model_or_config, torch.nn.Module) and hasattr(model_or_config, "config"):
            return model_or_config.config
    name = os.path.expanduser(str(model_or_config))
    path = os.path.join(name, "config.json") if os.path.isdir(name) else name
    if not os.path.exists(path):
        shipped = known_config(str(model_or_config))
        if shipped is not None:  # fastkit ships this model's config: never the Hub
            return config_from_dict(shipped)
        path = _hub_config(name)
    try:
        with open(path, encoding="utf-8") as f:
            return config_from_dict(json.load(f))
    except (OSError, ValueError) as exc:
        raise FastkitError(f"Could not read a model config from {path!r}: {exc}") from exc


def planned_config(model_or_config: Any):
    """What :func:`plan` counts: a shipped model's :class:`~fastkit.plan.configs.ShippedConfig` (its shape counted
    already: no torch, no transformers), else :func:`read_config`'s transformers config. A local folder or file of
    the same name wins, as in :func:`read_config`."""
    if isinstance(model_or_config, str) and not os.path.exists(os.path.expanduser(model_or_config)):
        shipped = shipped_config(model_or_config)
        if shipped is not None:
            return shipped
    return read_config(model_or_config)


def config_from_dict(values: dict):
    from transformers import CONFIG_MAPPING

    if not isinstance(values, dict):
        raise FastkitError(f"config.json holds a {type(values).__name__}, not the mapping of a model config "
                           "({\"model_type\": ..., ...}); point at the model's own config.json.")
    values = dict(values)

    model_type = values.pop("model_type", None)
    if "torch_dtype" in values:  # checkpoints saved before transformers 5 spell it so (as from_pretrained maps it)
        values.setdefault("dtype", values.pop("torch_dtype"))
    if model_type not in CONFIG_MAPPING:
        raise FastkitError(f"config model_type {model_type!r} is not one transformers knows; pass a config "
                           "with a known model_type (e.g. 'qwen3', 'llama').")
    try:
        return CONFIG_MAPPING[model_type](**values)
    except (TypeError, ValueError) as exc:  # transformers' own field checks (e.g. strict dataclass validation)
        raise FastkitError(f"config.json ({model_type}) cannot be built: {' '.join(str(exc).split())[:300]}") from exc


HUB_PROBE_S = 3.0
"""Seconds the planner waits for the Hub's TCP port before it says the Hub cannot be reached."""


def _hub_reachable() -> bool:
    """One TCP connect to the Hub endpoint (``HF_ENDPOINT``), ``HUB_PROBE_S`` at most: no retry loop."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                 timeout=HUB_PROBE_S).close()
    except OSError:
        return False
    return True


def cached_config(name: str, revision: str | None = None) -> str | None:
    """The local Hub cache's ``config.json`` of Hub id ``name``, or None when it holds none."""
    from huggingface_hub import hf_hub_download

    try:
        return hf_hub_download(name, "config.json", revision=revision, local_files_only=True)
    except Exception:  # noqa: BLE001 -- not cached (or not a Hub id): the caller decides
        return None


def hub_unanswered() -> str | None:
    """Why the Hub will not answer, in a few words (``HF_HUB_OFFLINE`` set, or no TCP answer in
    :data:`HUB_PROBE_S`), or None when it may: a caller fails in seconds instead of in huggingface_hub's retries."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return "HF_HUB_OFFLINE is set"
    return None if _hub_reachable() else f"the Hub cannot be reached (no answer in {HUB_PROBE_S:g} s)"


def check_hub_answers(name_or_path: Any, revision: str | None = None) -> None:
    """A Hub id whose config is not cached, with the Hub out of reach (:func:`hub_unanswered`): refused in seconds
    (transformers retries for half a minute per file before saying the same). A local path or anything not
    shaped like a Hub id passes: the loader says what it is."""
    name = str(name_or_path)
    if os.path.exists(os.path.expanduser(name)) or name.count("/") != 1 or name.startswith((".", "~", "/")):
        return
    if cached_config(name, revision) is not None:
        return
    why = hub_unanswered()
    if why is not None:
        raise FastkitError(f"{why} and {name!r}'s config.json is not in the local cache: it cannot be loaded. "
                           "Connect to the Hub once to download it, or pass a local model folder.")


def _hub_config(name: str) -> str:
    """``name``'s config.json: the local Hub cache first, then the Hub; one line when neither can answer."""
    from fastkit.plan.configs import KNOWN_CONFIGS

    if os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") != 1:
        raise FastkitError(f"{name!r} is neither a local model folder / config.json nor a Hub id "
                           "like 'Qwen/Qwen3-14B'.")
    from huggingface_hub import hf_hub_download

    cached = cached_config(name)
    if cached is not None:
        return cached
    why = hub_unanswered()
    if why is not None:
        raise FastkitError(f"{why} and {name!r}'s config.json is not in the local cache. Pass a local folder or "
                           f"config.json, or one of the models fastkit ships configs for: {', '.join(KNOWN_CONFIGS)}.")
    try:
        return hf_hub_download(name, "config.json", etag_timeout=HUB_PROBE_S)  # the config only, never the weights
    except Exception as exc:
        raise FastkitError(f"Could not read {name!r}'s config.json from the Hub: {' '.join(str(exc).split())[:300]}") \
            from exc


def check_config(config) -> None:
    """Refuse a config no model can be built from, naming the field (before the meta-device count)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for field_name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
        value = getattr(text, field_name, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise FastkitError(f"config.{field_name} must be a positive int, got {value!r}: no model can be built.")
    heads, kv = getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None)
    if kv is not None and (isinstance(kv, bool) or not isinstance(kv, int) or kv <= 0):
        raise FastkitError(f"config.num_key_value_heads must be a positive int, got {kv!r}.")
    if isinstance(heads, int) and isinstance(kv, int) and heads % kv:
        raise FastkitError(f"config.num_key_value_heads={kv} does not divide num_attention_heads={heads}: "
                           "grouped-query attention shares each key/value head among a whole number of query heads.")
    _check_experts(text)


_EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def _check_experts(text) -> None:
    top_k = getattr(text, "num_experts_per_tok", None)
    for field_name in _EXPERT_FIELDS:
        experts = getattr(text, field_name, None)
        if isinstance(experts, int) and not isinstance(experts, bool) and experts > 0 and isinstance(top_k, int) \
                and top_k > experts:
            raise FastkitError(f"config.num_experts_per_tok={top_k} is larger than config.{field_name}={experts}: the "
                               "router cannot pick more experts than there are.")
    if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k < 0:
        raise FastkitError(f"config.num_experts_per_tok must be >= 0, got {top_k}.")


def _check_decoder(config) -> None:
    """The planner models decoder-only causal LMs."""
    if isinstance(config, ShippedConfig):  # every shipped model is one (tests/test_plan_shipped.py)
        return
    from fastkit import _hf, registry

    row = registry.facts_for(config.model_type)
    if row is not None and row.vision is not None:  # a vision-language row: its language model is the decoder
        return
    # BERT-style encoders have a causal-LM head class too (BertLMHeadModel); they are masked LMs first
    if not _hf.has_causal_lm_head(config.model_type) or _hf.has_masked_lm_head(config.model_type) \
            or getattr(config, "is_encoder_decoder", False):
        raise FastkitError(f"model_type {config.model_type!r} is not a decoder-only causal LM; the planner (and "
                           "fastkit) trains causal LMs (llama, qwen3, gemma3, ...).")


def count_shapes() -> dict[str, dict]:
    """Every :data:`~fastkit.plan.configs.KNOWN_CONFIGS` entry counted on the meta device now, in
    ``shapes.json``'s form."""
    from fastkit.plan.terms import shape_of

    out = {}
    for name in KNOWN_CONFIGS:
        fields = asdict(shape_of(read_config(known_config(name))))
        fields["lora_dims"] = lora_dim_counts(fields["lora_dims"])
        out[name] = fields
    return out


def write_shapes() -> None:
    """``shapes.json`` anew, after :data:`~fastkit.plan.configs.KNOWN_CONFIGS` changed (or transformers' modules did):
    ``python -c "from fastkit.plan.source import write_shapes; write_shapes()"``."""
    lines = [f"{json.dumps(name)}: {json.dumps(fields)}" for name, fields in count_shapes().items()]
    SHAPES.write_text("{\n" + ",\n".join(lines) + "\n}\n", encoding="utf-8")  # one model a line
    logger.info("wrote %s (%d shapes)", SHAPES, len(lines))


__all__ = ["HUB_PROBE_S", "cached_config", "check_config", "check_hub_answers", "count_shapes", "hub_unanswered",
           "planned_config", "read_config", "write_shapes"]
