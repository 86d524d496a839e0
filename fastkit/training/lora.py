"""LoRA wrapping, beside the :class:`fastkit.LoraOptions` it reads: ``FastModel.get_peft_model`` and its checks.

``get_peft_model`` wraps a model with PEFT LoRA (QLoRA on a 4-bit model), picks ``"all-linear"``'s targets from the
family's row (routers and the lm_head out; a vision-language model's language model), adds fastkit's per-expert-group
LoRA where PEFT adapts no experts, and turns on checkpointing and host weights as the load-time plan says. A second
call on a wrapped model returns it as it is when its adapter is the one asked for (a re-run notebook cell), else names
the difference. ``check_target_modules`` refuses a ``target_modules`` that matches nothing before any weight loads.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from fastkit import _hf, checks, registry
from fastkit.errors import FastkitError
from fastkit.patches.host.patch import HostWeights, enable_host_weights
from fastkit.patches.moe import peft_wrapper
from fastkit.patches.moe.lora import add_expert_lora, peft_adapts_experts
from fastkit.patches.moe.nf4 import has_4bit_experts
from fastkit.patches.offload.checkpointing import enable_checkpointing
from fastkit.patching import report, unwrap

logger = logging.getLogger("fastkit")

ASKED_TARGETS = "fastkit_target_modules"  # on the LoraConfig: target_modules as asked (PEFT resolves 'all-linear')


def get_peft_model(
    model: torch.nn.Module,
    r: int = 16,
    lora_alpha: int = 16,
    lora_dropout: float = 0.0,
    target_modules: str | list[str] = "all-linear",
    bias: str = "none",
    use_gradient_checkpointing: bool | str = "auto",
    random_state: int = 3407,
    offload_config=None,
    target_experts: bool = False,
    host_weights: HostWeights | str = "auto",
    options=None,
    finetune_vision_layers: bool = False,
    **lora_kwargs: Any,
):
    """Wrap ``model`` with PEFT LoRA (QLoRA when it is 4-bit).

    ``options``: a :class:`fastkit.LoraOptions` (rank, alpha, dropout, targets, rsLoRA, experts,
    checkpointing: what ``fastkit train`` and the notebooks fill); it replaces those arguments, and a keyword
    given beside it (not at its default) changes that option, as ``make_trainer``'s keywords change its
    options (logged).

    ``use_gradient_checkpointing``: ``True`` (plain, non-reentrant), ``"offload"`` (fastkit's
    double-buffered checkpoint reload, see :mod:`fastkit.patches.offload.patch`; tune it with
    ``offload_config=fastkit.patches.offload.OffloadConfig(...)``), ``False``, or ``"auto"`` (the
    default): ``"offload"`` where the load-time memory plan fits only with it, else ``True``.

    ``target_experts=True`` also adapts MoE experts with fastkit's per-expert-group LoRA
    (:mod:`fastkit.patches.moe.lora`, no ``W + B·A`` per expert per forward). Where PEFT already adapts
    the experts itself (``"all-linear"`` on qwen3_moe, mixtral, olmoe, deepseek_v3), fastkit runs
    PEFT's adapter per expert group instead of adding a second one.

    ``host_weights``: a :class:`fastkit.HostWeights` saying which frozen weights stay in host memory (the
    input embedding, the lm_head streamed in vocabulary chunks: :mod:`fastkit.patches.host`), or
    ``"auto"`` (the default): those the load-time memory plan needs to fit, else none.

    Vision-language models: ``"all-linear"`` adapts the language model only (the vision tower and projector get
    no LoRA); ``finetune_vision_layers=True`` (Unsloth's name) adds them, as does a ``target_modules`` naming
    them.
    """
    from peft import LoraConfig
    from peft import get_peft_model as peft_wrap

    if options is not None:  # keywords given beside options change those options, as make_trainer's do
        given = dict(r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, target_modules=target_modules,
                     use_gradient_checkpointing=use_gradient_checkpointing, target_experts=target_experts)
        kwargs = {**_lora_options(options), **_changed_from_defaults(given, lora_kwargs)}
        vision_layers = kwargs.pop("finetune_vision_layers", False) or finetune_vision_layers
        return get_peft_model(model, **kwargs, bias=bias, random_state=random_state, offload_config=offload_config,
                              host_weights=host_weights, finetune_vision_layers=vision_layers)
    checks.check_lora_options(r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, target_modules=target_modules,
                       bias=bias, use_gradient_checkpointing=use_gradient_checkpointing)
    if hasattr(model, "peft_config"):  # a re-run notebook cell: the same adapter back, never a nested one
        return _same_adapter(model, r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                             target_modules=target_modules, bias=bias)
    torch.manual_seed(random_state)
    if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False):
        model = prepare_kbit_training(model)
    check_target_modules(model, target_modules)
    lora = LoraConfig(r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, bias=bias, task_type="CAUSAL_LM",
                      target_modules=_table_targets(model, target_modules, finetune_vision_layers),
                      **lora_kwargs)
    peft_model = peft_wrap(model, lora)
    object.__setattr__(peft_model.peft_config[peft_model.active_adapter], ASKED_TARGETS, target_modules)
    peft_wrapper.install(peft_model)  # parameter LoRA (MoE experts) without PEFT's per-call parametrization
    # 4-bit experts (patches/moe/nf4.py) have no parameter for PEFT's target_parameters: "all-linear"
    # then adapts them with fastkit's per-group factors instead, as PEFT would have on 16-bit experts.
    four_bit = target_modules == "all-linear" and has_4bit_experts(peft_model)
    if (target_experts or four_bit) and not peft_adapts_experts(peft_model):
        add_expert_lora(peft_model, r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout)
    if use_gradient_checkpointing == "auto":
        rep = report(model)
        use_gradient_checkpointing = rep.checkpointing if rep is not None else True
    enable_checkpointing(peft_model, use_gradient_checkpointing, offload_config)
    if host_weights == "auto":
        rep = report(model)
        host_weights = rep.host_weights if rep is not None else HostWeights()
    if not isinstance(host_weights, HostWeights) or host_weights.any:  # a wrong type is refused there
        enable_host_weights(peft_model, host_weights)  # after PEFT: only frozen weights go to the host
    return peft_model


def _vision_targets(model: torch.nn.Module, facts: registry.ModelFacts, vision_layers: bool) -> list[str]:
    """``"all-linear"`` on a vision-language model: the linear layers of its language model (and, with
    ``finetune_vision_layers=True``, of its vision tower and projector), by full module name; the routers and the
    lm_head stay out."""
    base = unwrap(model)
    roots = [facts.vision.language_model] + ([facts.vision.tower, facts.vision.projector] if vision_layers else [])
    routers = _router_linears(model)
    output = base.get_output_embeddings()
    names = []
    for root in dict.fromkeys(roots):
        names += [f"{root}.{n}" for n, m in base.get_submodule(root).named_modules()
                  if isinstance(m, torch.nn.Linear) and m is not output and f"{root}.{n}" not in routers]
    logger.info("fastkit: LoRA 'all-linear' on a vision-language model: %s", "language model and vision tower"
                if vision_layers else "language model only (finetune_vision_layers=True adds the vision tower)")
    return sorted(dict.fromkeys(names))


def _table_targets(model: torch.nn.Module, target_modules, vision_layers: bool = False):
    """``"all-linear"`` as the family's table row says (``ModelFacts.default_lora_targets``; a vision-language
    model: its language model, :func:`_vision_targets`), else every linear layer but the routers
    (:func:`_router_linears`), else as given."""
    if target_modules != "all-linear":
        return target_modules
    facts = registry.facts_for(getattr(unwrap(model).config, "model_type", ""))
    from fastkit.families.patch import is_vision_model

    if is_vision_model(model, facts):
        return _vision_targets(model, facts, vision_layers)
    if vision_layers:
        raise FastkitError("finetune_vision_layers=True: this model has no vision tower (a text model, or a "
                           "vision-language family loaded as text); drop the flag.")
    if facts is not None and facts.default_lora_targets:
        return list(facts.default_lora_targets)
    routers = _router_linears(model)
    if not routers:
        return target_modules
    # PEFT's "all-linear" less the routers: the other linear layers by their last name (lm_head stays out, as there)
    output = unwrap(model).get_output_embeddings()
    router_leaves = {n.rsplit(".", 1)[-1] for n in routers}
    names = {n.rsplit(".", 1)[-1] for n, m in unwrap(model).named_modules()
             if isinstance(m, torch.nn.Linear) and m is not output}
    logger.info("fastkit: LoRA 'all-linear' leaves the router(s) %s out (their forward returns the routing, not a "
                "tensor LoRA can add to)", ", ".join(sorted(router_leaves)))
    return sorted(names - router_leaves)


def check_target_modules(model: torch.nn.Module, target_modules) -> None:
    """``target_modules`` (names or a regex, as PEFT matches them) names a module of ``model``, else a FastkitError
    naming the linear layers there are (instead of PEFT's error after the load). ``model`` may be on the meta
    device (``fastkit train`` checks before any weight loads: :func:`meta_model`)."""
    if target_modules == "all-linear":
        return
    from peft import LoraConfig

    config = LoraConfig(target_modules=target_modules)
    names = [n for n, _ in unwrap(model).named_modules() if n]
    if any(_hf.peft_target_matches(config, n) for n in names):
        return
    output = unwrap(model).get_output_embeddings()
    linears = sorted({n.rsplit(".", 1)[-1] for n, m in unwrap(model).named_modules()
                      if isinstance(m, torch.nn.Linear) and m is not output})
    regex = (" (a string is a regex over the full module name, e.g. 'model.layers.0.self_attn.q_proj'; give a list "
             "for names)") if isinstance(target_modules, str) else ""
    raise FastkitError(f"target_modules={target_modules!r} matches no module of this "
                       f"{getattr(unwrap(model).config, 'model_type', '')} model{regex}; its linear layers are "
                       f"{', '.join(linears) or 'none'} (or give 'all-linear').")


def _router_linears(model: torch.nn.Module) -> set[str]:
    """Names of MoE routers that subclass ``nn.Linear`` (Llama-4's ``Llama4Router``, Phi-3.5-MoE's
    ``PhimoeTopKRouter``): their forward returns ``(scores, indices)``, so PEFT's ``"all-linear"``, which wraps every
    ``nn.Linear``, would break the first forward ("'tuple' object has no attribute 'dtype'"). A subclass from a
    transformers model file is a model's own layer; quantized linears (bitsandbytes) come from elsewhere and stay."""
    return {n for n, m in unwrap(model).named_modules()
            if isinstance(m, torch.nn.Linear) and type(m) is not torch.nn.Linear
            and type(m).__module__.startswith("transformers.models.")}


def _same_adapter(model: torch.nn.Module, **asked: Any) -> torch.nn.Module:
    """``model`` as is when its adapter is the one asked for; else a FastkitError naming the differences."""
    if not hasattr(model, "active_adapter"):  # the base model inside a PeftModel (PEFT marks it with peft_config)
        raise FastkitError("get_peft_model: this model already carries a LoRA adapter: it is the base inside the "
                           "PEFT model an earlier get_peft_model call returned. Use that returned model (assign it: "
                           "model = FastModel.get_peft_model(model, ...)), or re-load (FastModel.from_pretrained).")
    _one_lora_adapter(model)
    have = model.peft_config[model.active_adapter]
    diff = []
    for key, value in asked.items():
        current = getattr(have, key, None)
        if key == "target_modules":
            current = getattr(have, ASKED_TARGETS, current)  # what get_peft_model was given ('all-linear')
            same = value == current or (not isinstance(value, str) and not isinstance(current, str)
                                        and set(value) == set(current or ()))
        else:
            same = value == current
        if not same:
            diff.append(f"{key}={value!r} (the model has {current!r})")
    if diff:
        raise FastkitError(f"get_peft_model: the model already has a LoRA adapter, with other options: "
                           f"{', '.join(diff)}. Re-load the model (FastModel.from_pretrained) for a new adapter.")
    logger.info("fastkit: the model already has this LoRA adapter; returned as it is (re-run cell)")
    return model


def _one_lora_adapter(model: torch.nn.Module) -> None:
    """The one case a second get_peft_model may return its model as is: a PeftModel with one LoRA adapter. PEFT's
    tuner layer (``peft_model.base_model``), several adapters or another PEFT method would nest: refused."""
    from peft import PeftModel

    configs = dict(model.peft_config)
    types = sorted({str(getattr(getattr(c, "peft_type", None), "value", None)) for c in configs.values()})
    if not isinstance(model, PeftModel):
        what = f"PEFT's {type(model).__name__} (the base_model of a PeftModel), not the PeftModel"
    elif len(configs) > 1:
        what = f"a PEFT model with {len(configs)} adapters ({', '.join(map(str, configs))})"
    elif types != ["LORA"]:
        what = f"a PEFT model with a {', '.join(types)} adapter, not LoRA"
    else:
        return
    raise FastkitError(f"get_peft_model: the model is already {what}; a second get_peft_model would nest adapters. "
                       "Use the model as it is, or merge_and_unload() (or unload()) it first and call "
                       "get_peft_model on the model that returns.")


def prepare_kbit_training(model: torch.nn.Module) -> torch.nn.Module:
    """Freeze a 4/8-bit model for LoRA, and upcast nothing.

    PEFT's ``prepare_model_for_kbit_training`` casts every 16-bit parameter to fp32: on Qwen3-14B the
    untied embeddings and lm_head alone (1.56B parameters) grow from 3.1 to 6.2 GB, which is what
    kept it off a T4. Here embeddings, lm_head and norms keep the dtype they loaded in; the adapters
    PEFT adds are fp32, and the trainer's autocast runs the 16-bit matmuls.
    """
    for param in model.parameters():
        param.requires_grad_(False)
    return model


def _changed_from_defaults(given: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """get_peft_model's LoRA keywords that differ from their defaults (plus any other LoRA keyword): the ones a
    caller gave beside ``options=``. The one precedence rule (make_trainer's too): a keyword changes the option;
    a keyword left at its default leaves the option as it is. Each change is logged."""
    import inspect

    defaults = {k: v.default for k, v in inspect.signature(get_peft_model).parameters.items()}
    changed = {k: v for k, v in given.items() if v != defaults[k]} | dict(extra)
    if changed:
        logger.info("fastkit: get_peft_model: %s given beside options= change those options",
                    ", ".join(f"{k}={v!r}" for k, v in changed.items()))
    return changed


def _lora_options(options) -> dict[str, Any]:
    """get_peft_model's arguments from a :class:`fastkit.LoraOptions`."""
    from fastkit.training.options import LoraOptions

    if not isinstance(options, LoraOptions):
        raise FastkitError(f"get_peft_model(options=...) takes a fastkit.LoraOptions, got {type(options).__name__}.")
    return options.peft_kwargs()


__all__ = ["ASKED_TARGETS", "check_target_modules", "get_peft_model", "prepare_kbit_training"]
