"""GGUF export for llama.cpp, Ollama and LM Studio: :func:`write_gguf`, the writer behind
:func:`fastkit.export.save_gguf` (which verifies the file and swaps it in atomically).

What it writes. ``<path>/<name>-<quantization>.gguf`` with LoRA merged in (PEFT adapters, PEFT
``target_parameters`` expert adapters and fastkit's own expert factors), tensors named and laid out
as llama.cpp's ``convert_hf_to_gguf.py`` lays them out (names from ``gguf.get_tensor_name_map``;
q/k rows permuted for llama-style rope; fused expert ``gate_up_proj`` split into ``ffn_gate_exps`` /
``ffn_up_exps``; norms, biases and the router in f32; Llama-3 rope scaling as ``rope_freqs``), the
tokenizer (byte-level BPE, :mod:`fastkit.export.gguf.vocab`; SentencePiece-style as llama.cpp's SPM model,
:mod:`fastkit.export.gguf.spm`) and the chat template in the metadata; and an
Ollama ``Modelfile`` beside it (``ollama create my-model -f <path>/Modelfile``).

Memory. Tensors are merged, converted and written one at a time (the GGUF header is planned from
shapes first): the peak is the model plus one tensor in fp32, never a second copy of the model. A
4/8-bit (QLoRA) model is the exception: its packed codes are not weights, so, as ``save_merged`` does,
the adapters are merged into the base reloaded in fp16 on the CPU.

Families: llama, mistral, mixtral, granite, qwen2, qwen3, qwen3_moe, qwen2_moe (its shared expert and shared-expert
gate too), gemma2, gemma3_text, phi3, gpt_oss; dense: smollm3, olmo2, olmo3, starcoder2, glm4, cohere2, exaone4,
ernie4_5 (LayerNorm graphs, no-rope layers, post-norms, parallel blocks), and gemma, phi (phi2), olmo, cohere
(command-r), arcee, seed_oss, hunyuan_v1_dense, apertus, gpt_neox, gpt2, gpt_bigcode (starcoder), ministral3, and
ministral / exaone / internlm3 / helium (llama) (:mod:`fastkit.export.gguf.more`); and the MoE / MLA families of
:mod:`fastkit.export.gguf.moe` (olmoe, granitemoe(shared), deepseek_v2, deepseek_v3, glm4_moe_lite, glm4_moe,
solar_open, minimax_m2, ernie4_5_moe); the hybrid families of :mod:`fastkit.export.gguf.hybrid` (lfm2, lfm2_moe,
qwen3_next, qwen3_5_text, qwen3_5_moe_text, falcon_h1, granitemoehybrid); how each differs from llama.cpp's graph for
its architecture (norm +1, soft-caps, window patterns, per-layer-type rope, expert layouts, router renormalization,
shared experts, biases the graph has or lacks, recurrent layers...) is its row's :class:`fastkit.registry.GGUFRules`,
read at call time. Quantization names: :data:`QUANTS`.
Not supported (a FastkitError says so before writing): families without ``gguf_arch``, qwen2_moe with dense
layers or renormalized top-k (llama.cpp's qwen2moe has neither), rope types the family's graph does not
compute, a sliding window shorter than the context where llama.cpp's graph has none, whatever else a family's
graph hard-codes differently (activation, soft-caps, query scale, tied head, SwiGLU clamp, expert groups scored
otherwise, MLA with biases), and tokenizers llama.cpp would split or merge differently or cannot load
(:mod:`fastkit.export.gguf.vocab`, :mod:`fastkit.export.gguf.spm`).

4-bit experts (fastkit's NF4 / MXFP4 expert modules, whose codes are buffers) are dequantized into the
file, one tensor at a time; a MoE file missing any layer's experts is refused. ``q4_k_m`` / ``q5_k_m`` /
``q6_k`` come from llama.cpp's own quantizer (llama-cpp-python) run on an f16 file written first.

What must not change. transformers' GGUF loader (``from_pretrained(dir, gguf_file=...)``) reads the
file back to the merged model's logits (tests/test_gguf_export.py): f16/bf16 within rounding, q8_0 /
q4_0 within the tolerances measured there; and the real llama.cpp reproduces tokens, chat prompt,
greedy text and first-token logits (tests/test_llamacpp_round_trip.py, table in docs/export.md).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fastkit import _hf, registry
from fastkit.errors import FastkitError
from fastkit.export.gguf import hybrid as gguf_hybrid
from fastkit.export.gguf import moe as gguf_moe
from fastkit.export.gguf import more as gguf_more
from fastkit.export.gguf.modelfile import modelfile
from fastkit.export.gguf.quants import LLAMA_CPP_QUANTS, QUANTIZATIONS, QUANTS, WRITTEN, QuantSpec  # noqa: F401 (re-exported)
from fastkit.export.gguf.spm import check_ids_in_llama_cpp, is_spm_style
from fastkit.export.gguf.vocab import add_tokenizer_kv, check_tokenizer
from fastkit.export.merge import merged_from_disk
from fastkit.patching import unwrap

logger = logging.getLogger(__name__)




_F32_PARTS = ("ffn_gate_inp", *gguf_hybrid.CONV_KERNELS)  # routers, conv kernels: f32, as llama.cpp keeps them
_SKIP = re.compile(r"\.(lora_[A-Za-z_]+|fastkit_lora|original_module)(\.|$)")


def _qtype(quantization: str):
    import gguf

    return gguf.GGMLQuantizationType[QUANTS[quantization].ggml_type]


# ------------------------------------------------------------------------------------------ checks


def check_before_writing(model: torch.nn.Module, tokenizer, path: Path, quantization: str) -> tuple[object, str]:
    """Every bad input raises here, before a byte is written."""
    if quantization not in QUANTIZATIONS:
        raise FastkitError(f"save_gguf(quantization={quantization!r}) is not supported; use one of "
                           f"{', '.join(QUANTIZATIONS)} (Ollama's default: 'q4_k_m').")
    if quantization in LLAMA_CPP_QUANTS:
        _llama_cpp(quantization)
    config = unwrap(model).config
    model_type = getattr(config, "model_type", None)
    archs = registry.gguf_archs()
    if model_type not in archs and model_type not in registry.gguf_text_archs():  # a VLM's language model
        facts = registry.facts_for(model_type)
        why = f" ({facts.gguf_refusal})" if facts is not None and facts.gguf_refusal else ""
        raise FastkitError(f"save_gguf: model_type {model_type!r} has no GGUF mapping here{why} (supported: "
                           f"{', '.join(archs)}); export with save_merged and convert with llama.cpp's "
                           "convert_hf_to_gguf.py.")
    rules = registry.gguf_row(model_type).gguf
    _check_rope(config, model_type, rules)
    _check_moe(config, model_type, rules)
    gguf_moe.check_family(config, model_type, rules)
    gguf_hybrid.check(config, model_type, rules)
    _check_graph(config, model_type, rules)
    _check_window(config, model_type, rules)
    _check_dense(config, model_type, rules)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    spec = json.loads(backend.to_str()) if backend is not None else {}
    check_tokenizer(spec)  # byte-level: merges, a pre-tokenizer llama.cpp splits alike; SentencePiece: gguf_spm
    if path.exists() and not path.is_dir():
        raise FastkitError(f"save_gguf(path={str(path)!r}) is a file; pass a folder to write the .gguf into.")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise FastkitError(f"save_gguf(path={str(path)!r}): {str(existing)!r} is a file; pass a folder.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise FastkitError(f"save_gguf(path={str(path)!r}): {str(existing)!r} is not writable; pick another folder.")
    return config, spec


def _check_moe(config, model_type: str, rules: registry.GGUFRules) -> None:
    """Router and expert rules llama.cpp's MoE graph for the family hard-codes (the row's GGUFRules)."""
    arch = _arch(model_type)
    renorm = getattr(config, "norm_topk_prob", rules.router_renorm == "always")
    if rules.router_renorm not in ("either", "config") and bool(renorm) != (rules.router_renorm == "always"):
        raise FastkitError(f"save_gguf: llama.cpp's {arch} {rules.router_renorm} renormalizes the top-k router "
                           f"weights, but config.norm_topk_prob is {renorm}; this model cannot be expressed in GGUF "
                           "as is.")
    if rules.swiglu is not None:
        got = (getattr(config, "swiglu_alpha", rules.swiglu[0]), getattr(config, "swiglu_limit", rules.swiglu[1]))
        if tuple(got) != rules.swiglu:
            raise FastkitError(f"save_gguf: {model_type} with swiglu_alpha={got[0]}, swiglu_limit={got[1]}: "
                               f"llama.cpp's {arch} graph hard-codes {rules.swiglu[0]} and {rules.swiglu[1]}; this "
                               "model cannot be expressed in GGUF as is.")
    if rules.experts_every_layer and (getattr(config, "mlp_only_layers", None) or
                                      getattr(config, "decoder_sparse_step", 1) != 1):
        raise FastkitError(f"save_gguf: {model_type} with dense layers (mlp_only_layers / decoder_sparse_step) has "
                           "no GGUF layout here; export with save_merged and llama.cpp's convert_hf_to_gguf.py.")


def check_weights(model: torch.nn.Module, reloaded: torch.nn.Module, quantization: str, exact: bool = False) -> float:
    """Every tensor transformers' GGUF reader gives back, against the merged model's, within the quantization's
    rounding (:attr:`QuantSpec.weight_tolerance`); returns the worst ``max|Δw| / max|w|``. ``exact``: then each
    tensor of ``reloaded`` is replaced by the model's own (one merge per tensor serves both), and a tensor of
    ``reloaded`` the model has none for (it would keep its rounded value) is refused.

    Why tensors and not the file's logits against the model's: what rounding does to logits depends on the model,
    not the file. A qwen3_moe twin at q8_0 flips 1 of 32 probe tokens' top-k expert choice in layer 0 (0.09 of the
    logit scale in any q8_0 file of it, llama.cpp's own included); a twin diverged by a loss spike moves 0.012 of
    its scale at f16 with every tensor within 2^-11. The model around the tensors is checked on exact weights
    (``fastkit.export.gguf.save._verify_read_back``)."""
    got = dict(reloaded.named_parameters())
    worst, missing = 0.0, []
    for name, w in read_back_view(model):
        if name not in got:
            missing.append(name)
            continue
        if tuple(got[name].shape) != tuple(w.shape):
            raise FastkitError(f"save_gguf: {name} reads back as {tuple(got[name].shape)}, not {tuple(w.shape)}; "
                               "nothing was replaced. This is a fastkit bug for this model.")
        err = ((got[name].detach().float() - w).abs().max() / w.abs().max().clamp_min(1e-12)).item()
        worst = max(worst, err)
        if err > QUANTS[quantization].weight_tolerance:
            raise FastkitError(f"save_gguf: the output read back does not match the model in memory: {name} reads "
                               f"back {err:.3g} of its scale away from the model's (allowed "
                               f"{QUANTS[quantization].weight_tolerance}, the rounding of {quantization}); nothing was "
                               "replaced. This is a fastkit bug for this model.")
        if exact:
            with torch.no_grad():
                got.pop(name).copy_(w)
    if missing:
        raise FastkitError(f"save_gguf: {missing[:3]} ({len(missing)} tensors) are not in the file read back; nothing "
                           "was replaced. This is a fastkit bug for this model.")
    if exact and got:
        raise FastkitError(f"save_gguf: the file read back has tensors the model has not ({sorted(got)[:3]}, "
                           f"{len(got)} in all); nothing was replaced. This is a fastkit bug for this model.")
    return worst


def read_back_view(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, merged fp32 tensor)`` per parameter, as transformers' GGUF reader gives it back: its llama graph
    un-permutes q/k rows (undoing :func:`_permute`), so a family whose rope already rotates interleaved pairs (Helium:
    written as it is, ``permute_qk`` False) comes back in Llama's rotate-half order. One tensor at a time."""
    config = unwrap(model).config
    rules = registry.gguf_row(config.model_type).gguf
    unpermuted = _arch(config.model_type) in registry.gguf.READER_UNPERMUTES_QK and not rules.permute_qk
    for name, load, _ in merged_parameters(model):
        w = load()
        if unpermuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            # (H·D, in) -> (H, D/2, 2, in) -> (H, 2, D/2, in) -> (H·D, in): the inverse of _permute
            w = w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        yield name, w


def _arch(model_type: str) -> str:
    """llama.cpp's architecture for ``model_type``, read off its table row now."""
    return registry.gguf_row(model_type).gguf_arch


def _rope(config, rules: registry.GGUFRules) -> tuple[dict, dict | None]:
    """``(rope parameters of the full-attention layers, those of the sliding layers or None)``."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if rules.rope_by_layer_type and isinstance(rope.get("full_attention"), dict):
        return dict(rope["full_attention"]), dict(rope.get("sliding_attention") or {})
    return rope, None


def _check_rope(config, model_type: str, rules: registry.GGUFRules) -> None:
    """Rope llama.cpp computes the same way: the family's ``rope_types`` (plain, Llama-3's as ``rope_freqs``, linear,
    yarn); per-layer-type parameters only where the family's graph has them."""
    full, sliding = _rope(config, rules)
    kind, allowed = full.get("rope_type", "default"), rules.rope_types
    nested = any(isinstance(v, dict) for v in full.values())
    if nested or kind not in allowed or (sliding is not None and sliding.get("rope_type", "default") != "default"):
        raise FastkitError(f"save_gguf: config.rope_parameters {json.dumps(config.rope_parameters)[:160]} is not "
                           f"written by save_gguf for {model_type} (it writes rope types {', '.join(allowed)}); "
                           "export with save_merged and llama.cpp's convert_hf_to_gguf.py.")
    for key, value in rules.rope_fixed:  # what llama.cpp's YaRN takes as given (GGUFRules.rope_fixed)
        if full.get(key, value) != value:
            raise FastkitError(f"save_gguf: {model_type} with rope_parameters[{key!r}]={full[key]!r}: llama.cpp's "
                               f"{_arch(model_type)} graph computes only {key}={value!r}; this model cannot be "
                               "expressed in GGUF as is.")


def _check_graph(config, model_type: str, rules: registry.GGUFRules) -> None:
    """What llama.cpp's graph for the family hard-codes: activation, soft-capping, query scale, tied output."""
    arch = _arch(model_type)
    act = (getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
           or getattr(config, "activation_function", None))  # GPT-2's name for it
    if act != rules.activation:
        raise FastkitError(f"save_gguf: {model_type} with activation {act!r}: llama.cpp's {arch} graph applies "
                           f"{rules.activation!r}; this model cannot be expressed in GGUF as is.")
    for key, rule in (("attn_logit_softcapping", rules.attn_softcap), ("final_logit_softcapping", rules.final_softcap)):
        cap = getattr(config, key, None)
        if rule == "none" and cap:
            raise FastkitError(f"save_gguf: config.{key}={cap}, but llama.cpp's {arch} graph has no such soft-capping;"
                               " this model cannot be expressed in GGUF as is.")
        if rule == "required" and not cap:
            raise FastkitError(f"save_gguf: config.{key} is {cap!r}, but llama.cpp's {arch} graph always soft-caps "
                               "there; this model cannot be expressed in GGUF as is.")
    if rules.query_scale_wide_at:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        used = config.hidden_size // config.num_attention_heads if config.num_hidden_layers == \
            rules.query_scale_wide_at else head_dim
        if getattr(config, "query_pre_attn_scalar", None) != used:
            raise FastkitError(f"save_gguf: config.query_pre_attn_scalar={config.query_pre_attn_scalar}, but "
                               f"llama.cpp's {arch} graph scales queries by 1/sqrt({used}) for this shape; the GGUF "
                               "would attend differently from the trained model.")
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if rules.output == "tied" and not tied:
        raise FastkitError(f"save_gguf: {model_type} with an untied lm_head: llama.cpp's {arch} graph computes the "
                           "logits with the token embeddings; this model cannot be expressed in GGUF as is.")
    if rules.output == "untied" and tied:
        raise FastkitError(f"save_gguf: {model_type} with tie_word_embeddings=True: llama.cpp's {arch} graph needs "
                           "its own output tensor; this model cannot be expressed in GGUF as is.")


def _check_window(config, model_type: str, rules: registry.GGUFRules) -> None:
    """llama.cpp's llama / qwen2 / qwen3(moe) graphs attend over the whole context: a sliding window that
    actually applies would be silently dropped, so the exported model would attend further than the trained
    one did (differently on prompts longer than the window)."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return
    if rules.windows:  # written with its per-layer pattern
        if not getattr(config, "layer_types", None):
            raise FastkitError(f"save_gguf: {model_type} with sliding_window={window} but no config.layer_types; "
                               "which layers are windowed is unknown, nothing was written.")
        return
    applies = getattr(config, "use_sliding_window", None) is not False  # qwen2/3: off unless use_sliding_window
    layer_types = getattr(config, "layer_types", None) or ()
    if applies or "sliding_attention" in layer_types:
        if window >= config.max_position_embeddings:
            return  # a window as long as the context is no window
        raise FastkitError(f"save_gguf: {model_type} with a {window}-token sliding window (context "
                           f"{config.max_position_embeddings}): llama.cpp's {_arch(model_type)} graph has no "
                           "sliding window, so the GGUF would attend over the whole context. If full attention is "
                           "what you want, set model.config.sliding_window = None before saving.")


def _check_dense(config, model_type: str, rules: registry.GGUFRules) -> None:
    """What a family's graph hard-codes beyond the common checks (its row's ``fixed`` values,
    ``no_rope_every``, ``swa_rope_global``, ``windows_at_depth``): refused naming the key, before any work."""
    arch = _arch(model_type)
    for key, value in rules.fixed:
        got = getattr(config, key, value)
        if got != value:
            raise FastkitError(f"save_gguf: {model_type} with config.{key}={got!r}: llama.cpp's {arch} graph "
                               f"hard-codes {key}={value!r}; this model cannot be expressed in GGUF as is.")
    if rules.no_rope_every:
        step, layers = rules.no_rope_every, config.num_hidden_layers
        want = [int((i + 1) % step != 0) for i in range(layers)]
        got = list(getattr(config, "no_rope_layers", None) or want)
        if got != want:
            raise FastkitError(f"save_gguf: {model_type} with config.no_rope_layers={got}: llama.cpp's {arch} graph "
                               f"skips rope on every {step}th layer exactly ({want}); this model cannot be expressed "
                               "in GGUF as is.")
    full, sliding = _rope(config, rules)
    if rules.swa_rope_global and sliding is not None and sliding.get("rope_theta") != full.get("rope_theta"):
        raise FastkitError(f"save_gguf: {model_type} with sliding layers' rope_theta {sliding.get('rope_theta')} and "
                           f"full layers' {full.get('rope_theta')}: llama.cpp's {arch} graph ropes every layer with "
                           "one base; this model cannot be expressed in GGUF as is.")
    if rules.windows_at_depth:
        windowed = getattr(config, "sliding_window", None) is not None
        if windowed != (config.num_hidden_layers == rules.windows_at_depth):
            raise FastkitError(f"save_gguf: {model_type} with config.sliding_window={config.sliding_window} and "
                               f"{config.num_hidden_layers} layers: llama.cpp's {arch} graph has sliding windows (and "
                               f"no rope on the full-attention layers) exactly at {rules.windows_at_depth} layers; "
                               "this model cannot be expressed in GGUF as is.")


def _llama_cpp(quantization: str):
    """llama-cpp-python's bindings, for llama.cpp's own quantizer; FastkitError when they are not installed."""
    try:
        import llama_cpp
    except ImportError as e:
        raise FastkitError(f"save_gguf(quantization={quantization!r}) uses llama.cpp's own quantizer (k-quants), "
                           "from llama-cpp-python: pip install 'fastkit-llm[llamacpp]' (it builds llama.cpp, "
                           "~20-30 min on 2 CPU cores). Without it: 'q8_0' or 'q4_0', written by fastkit itself."
                           ) from e
    return llama_cpp


def quantize_with_llama_cpp(source: Path, target: Path, quantization: str, threads: int | None = None) -> None:
    """llama.cpp's ``llama_model_quantize`` from ``source`` (an f16/bf16 GGUF) to ``target`` as ``quantization``, in a
    child process (a crash there is one FastkitError line: :mod:`fastkit.export.gguf.llamacpp`). Tensors whose rows
    are not a whole number of k-quant blocks (256) get llama.cpp's own fallback type."""
    from fastkit.export.gguf import llamacpp

    _llama_cpp(quantization)
    llamacpp.quantize(Path(source), Path(target), LLAMA_CPP_QUANTS[quantization],
                      threads or max(1, (os.cpu_count() or 1)), f"save_gguf(quantization={quantization!r})")


# ------------------------------------------------------------------------------- merged tensors


def _quantized(model: torch.nn.Module) -> bool:
    """bitsandbytes / fastkit 4-bit storage, whose raw tensors are packed codes, not weights."""
    base = unwrap(model)
    return bool(getattr(base, "is_loaded_in_4bit", False) or getattr(base, "is_loaded_in_8bit", False)
                or any(p.dtype in (torch.uint8, torch.int8) for p in base.parameters()))


def _clean(name: str) -> str:
    """A parameter's transformers name, PEFT wrappers removed (``base_layer``, ``modules_to_save.<a>``)."""
    name = re.sub(r"\.modules_to_save\.[^.]+\.", ".", name)
    return name.replace(".base_layer", "")


def merged_parameters(model: torch.nn.Module) -> list[tuple[str, Callable[[], torch.Tensor], torch.Size]]:
    """``(transformers name, load, shape)`` per parameter of ``model`` with its LoRA merged in.

    ``load()`` builds ONE merged fp32 CPU tensor when called (base + every active adapter's ``s·B·A``:
    PEFT layers, PEFT ``target_parameters`` experts, fastkit expert factors); nothing is merged ahead.
    """
    from fastkit.patches.moe.patch import LORA_ATTR

    base = unwrap(model)
    layers = _hf.peft_lora_layers(base)
    out = []
    for raw, p in base.named_parameters():
        if _SKIP.search(raw):
            continue
        parts = raw.split(".")
        owners = [layers[".".join(parts[:i])] for i, s in enumerate(parts) if s == "base_layer"
                  and ".".join(parts[:i]) in layers]
        module = base.get_submodule(".".join(parts[:-1]))
        expert = getattr(module, LORA_ATTR, None)

        def load(p=p, leaf=parts[-1], owners=owners, module=module, expert=expert) -> torch.Tensor:
            with torch.no_grad():
                w = p.detach().float()
                for layer in owners:
                    d = _hf.peft_delta(layer, leaf)
                    if d is not None:
                        w = w + d.to(w.device, torch.float32)
                if expert is not None and leaf in getattr(expert, "targets", ()):
                    d = expert.delta(leaf).float()  # (E, out, in)
                    w = w + (d.transpose(-2, -1) if module.is_transposed else d)
                return w.cpu()

        out.append((_clean(raw), load, p.shape))
    return out + _dequantized_experts(base)


def _dequantized_experts(base: torch.nn.Module) -> list[tuple[str, Callable[[], torch.Tensor], torch.Size]]:
    """fastkit's 4-bit experts (NF4 / MXFP4 modules standing where the ``(E, a, b)`` parameters were; their codes
    are buffers, not parameters): dequantized into the stored layout, expert LoRA added, one tensor at a time."""
    from fastkit.patches.moe.nf4 import NF4Experts
    from fastkit.patches.moe.patch import LORA_ATTR

    out = []
    for raw, q in base.named_modules():
        if not isinstance(q, NF4Experts):
            continue
        stem, _, leaf = raw.rpartition(".")
        module = base.get_submodule(stem)
        expert = getattr(module, LORA_ATTR, None)

        def load(q=q, leaf=leaf, module=module, expert=expert) -> torch.Tensor:
            with torch.no_grad():
                w = q.dequantize().float()  # (E, a, b), the layout of the parameter it replaced
                if expert is not None and leaf in getattr(expert, "targets", ()):
                    d = expert.delta(leaf).float()  # (E, out, in)
                    w = w + (d.transpose(-2, -1) if module.is_transposed else d)
                return w.cpu()

        out.append((_clean(raw), load, torch.Size(q.stored_shape)))
    return out


# ------------------------------------------------------------------------------------ tensor plan


@dataclass
class _Entry:
    """One GGUF tensor, planned before the header is written and built only when its bytes are."""

    name: str
    """llama.cpp's tensor name (``blk.3.attn_q.weight``)."""
    load: Callable[[], torch.Tensor]
    """Builds the merged fp32 CPU tensor in llama.cpp's layout."""
    shape: tuple[int, ...]
    """Its shape, torch order (GGUF stores the dims reversed; the writer handles that)."""
    qtype: object
    """``gguf.GGMLQuantizationType`` it is stored as."""


def _flat(w: torch.Tensor) -> torch.Tensor:
    return w.reshape(-1)  # (1, H) -> (H,)


def _shifted(shift: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(w: torch.Tensor) -> torch.Tensor:
        return w + shift
    return fn


def _permute(n_head: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """llama.cpp's q/k row order for rope on interleaved pairs; transformers' GGUF loader undoes it."""
    def fn(w: torch.Tensor) -> torch.Tensor:
        # (H·D, in) -> (H, 2, D/2, in) -> (H, D/2, 2, in) -> (H·D, in)
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    return fn


def _plan(model: torch.nn.Module, config, arch: str, quantization: str) -> list[_Entry]:
    import gguf

    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
    qt = _qtype(quantization)
    rules = registry.gguf_row(config.model_type).gguf
    entries, unmapped = [], []
    tensors = [t for t in merged_parameters(model) if not gguf_more.is_layer_array(_clean(t[0]), rules)]  # metadata
    for hf_name, load, shape in tensors + gguf_moe.buffer_tensors(model, rules):
        hf_name = gguf_moe.renamed(_clean(hf_name), rules)  # buffers come with their PEFT-wrapped names
        stem, _, suffix = hf_name.rpartition(".")
        pieces: list[tuple[str, Callable]] = []
        if m := re.fullmatch(r".*\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?", hf_name):
            pieces = _expert_pieces(f"blk.{m[1]}", m[2], bool(m[3]), shape, rules.experts)
        elif split := (gguf_moe.split_pieces(hf_name, config, rules)  # MLA's kv_b_proj, fused halves
                       or gguf_hybrid.pieces(hf_name, config, rules)):  # gated DeltaNet tensors
            pieces = split
        elif (gname := names.get_name(stem if suffix in ("weight", "bias") else hf_name)) is None:
            unmapped.append(hf_name)
            continue
        else:
            full = f"{gname}.{suffix}" if suffix in ("weight", "bias") else f"{gname}.weight"
            fn = None
            if rules.norm_shift and hf_name.endswith("norm.weight"):  # Gemma: x·(1 + w) -> llama.cpp's x·w
                fn = _shifted(rules.norm_shift)
            elif rules.permute_qk and gname.endswith(("attn_q", "attn_k")):
                heads = config.num_attention_heads if gname.endswith("attn_q") else config.num_key_value_heads
                fn = _permute(heads)
            elif more := (gguf_more.transform(gname, rules, config)  # GPT-NeoX's per-head fused qkv
                          or gguf_hybrid.transform(full)):  # recurrent layers' conv kernels squeezed
                fn = more
            elif gname.endswith(("ffn_gate_inp_shexp", "exp_probs_b")):  # (1, H) -> llama.cpp's (H,) shared-expert
                # gate; ERNIE 4.5's selection bias (1, E) -> (E,)
                fn = _flat
            pieces = [(full, fn)]
        for gguf_name, fn in pieces:
            fn = gguf_hybrid.scaled(gguf_name, fn, config, rules)  # multipliers folded in (Falcon-H1)
            out_shape = tuple(fn(torch.empty(shape, device="meta")).shape if fn else shape)
            if gguf_name == "output.weight" and getattr(config, "tie_word_embeddings", False):
                continue
            entries.append(_Entry(gguf_name, (lambda ld=load, f=fn: f(ld()) if f else ld()), out_shape,
                                  _tensor_qtype(gguf_name, out_shape, quantization, qt)))
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if rope.get("rope_type") == "llama3":  # llama.cpp reads Llama-3's frequency scaling from this tensor
        factors = llama3_rope_factors(config)
        entries.append(_Entry("rope_freqs.weight", lambda f=factors: f, tuple(factors.shape),
                              gguf.GGMLQuantizationType.F32))
    if unmapped:
        raise FastkitError(f"save_gguf: no llama.cpp name for {unmapped[:4]} ({len(unmapped)} tensors) in "
                           f"architecture {arch!r}; this checkpoint layout is not supported.")
    _check_experts(entries, config)
    return entries


def _expert_pieces(block: str, kind: str, bias: bool, shape, layout: str) -> list[tuple[str, Callable | None]]:
    """llama.cpp's ``ffn_{gate,up,down}_exps`` (weights ``(E, out, in)``, biases ``(E, out)``) from a fused experts
    parameter in the family's ``layout`` (:attr:`fastkit.registry.GGUFRules.experts`)."""
    suffix = "bias" if bias else "weight"
    if layout == "halves":  # (E, 2I, H): gate rows first, then up; down_proj (E, H, I) as is
        if kind == "down_proj":
            return [(f"{block}.ffn_down_exps.{suffix}", None)]
        half = shape[1] // 2
        return [(f"{block}.ffn_gate_exps.{suffix}", lambda w, h=half: w[:, :h]),
                (f"{block}.ffn_up_exps.{suffix}", lambda w, h=half: w[:, h:])]
    if kind == "down_proj":  # (E, I, H) -> (E, H, I); its bias (E, H) as is
        return [(f"{block}.ffn_down_exps.{suffix}", None if bias else (lambda w: w.transpose(1, 2).contiguous()))]
    if bias:  # (E, 2I), gate / up alternating -> (E, I) each
        return [(f"{block}.ffn_gate_exps.bias", lambda w: w[:, ::2].contiguous()),
                (f"{block}.ffn_up_exps.bias", lambda w: w[:, 1::2].contiguous())]
    # (E, H, 2I), gate / up alternating on the last dim -> (E, I, H) each
    return [(f"{block}.ffn_gate_exps.weight", lambda w: w[..., ::2].transpose(1, 2).contiguous()),
            (f"{block}.ffn_up_exps.weight", lambda w: w[..., 1::2].transpose(1, 2).contiguous())]


def _check_experts(entries: list[_Entry], config) -> None:
    """A MoE file must carry every layer's experts: llama.cpp would refuse it, or (one missing kind) run garbage."""
    if not num_experts(config):
        return
    names = {e.name for e in entries}
    first = gguf_moe.dense_lead(config, registry.gguf_row(config.model_type).gguf)  # dense-MLP layers first
    missing = [f"blk.{i}.ffn_{kind}_exps.weight" for i in range(first, config.num_hidden_layers)
               for kind in ("gate", "up", "down") if f"blk.{i}.ffn_{kind}_exps.weight" not in names]
    if missing:
        raise FastkitError(f"save_gguf: expert tensors {missing[:3]} ({len(missing)} in all) were not found in the "
                           "model (a storage fastkit cannot dequantize?); nothing was written.")


def llama3_rope_factors(config) -> torch.Tensor:
    """Llama-3 rope scaling as per-frequency divisors ``(head_dim/2,)``: ``inv_freq_scaled = inv_freq / factors``
    (1 for short wavelengths, ``factor`` for long ones, smoothly in between)."""
    rope = config.rope_parameters
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))  # (dim/2,)
    old, low, high = rope["original_max_position_embeddings"], rope["low_freq_factor"], rope["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old / wavelen - low) / (high - low)
    mid = 1.0 / ((1 - smooth) / rope["factor"] + smooth)
    factors = torch.where(wavelen < old / high, torch.ones_like(wavelen),
                          torch.where(wavelen > old / low, torch.full_like(wavelen, rope["factor"]), mid))
    return factors.float()


def _tensor_qtype(name: str, shape: tuple[int, ...], quantization: str, qt):
    import gguf

    if (len(shape) == 1 or not name.endswith(".weight") or name.endswith("_norm.weight")  # grouped ssm_norm (2-D)
            or any(part in name for part in _F32_PARTS)):
        return gguf.GGMLQuantizationType.F32
    if quantization == "q4_0" and name in ("token_embd.weight", "output.weight"):
        qt = _qtype("q8_0")  # like llama.cpp's Q4_0 mixes: embeddings and output keep 8 bits
    block = gguf.GGML_QUANT_SIZES[qt][0]
    if shape[-1] % block:
        return gguf.GGMLQuantizationType.F16  # rows not a whole number of blocks (as llama.cpp falls back)
    return qt


def _encode(w: torch.Tensor, qtype) -> np.ndarray:
    import gguf

    t = gguf.GGMLQuantizationType
    if qtype == t.F32:
        return w.contiguous().numpy()
    if qtype == t.F16:
        return w.to(torch.float16).contiguous().numpy()
    if qtype == t.BF16:  # round-to-nearest-even, as torch and llama.cpp do
        return w.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint8)
    return gguf.quants.quantize(w.contiguous().numpy(), qtype)


def _add_info(writer, e: _Entry) -> None:
    import gguf

    t = gguf.GGMLQuantizationType
    if e.qtype in (t.F32, t.F16):
        dtype = np.float32 if e.qtype == t.F32 else np.float16
        writer.add_tensor_info(e.name, e.shape, np.dtype(dtype), int(np.prod(e.shape)) * np.dtype(dtype).itemsize)
    else:
        byte_shape = gguf.quants.quant_shape_to_byte_shape(e.shape, e.qtype)
        writer.add_tensor_info(e.name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=e.qtype)


# -------------------------------------------------------------------------------------- metadata


def _add_model_kv(writer, config, model_type: str, name: str, quantization: str) -> None:
    import gguf

    rules = registry.gguf_row(model_type).gguf
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope, sliding_rope = _rope(config, rules)
    partial = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None)) or 1.0
    kv_heads, key_length, value_length, rope_dim = gguf_moe.head_lengths(config, rules, head_dim,
                                                                         int(head_dim * partial))  # MLA: the latent's
    writer.add_name(_general_name(name))
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    if ffn := gguf_hybrid.ffn_length(config, rules):  # None where every layer is MoE (Solar Open)
        writer.add_feed_forward_length(ffn)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(gguf_hybrid.kv_heads(config, rules, kv_heads))  # per layer: 0 on recurrent ones
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))))
    _add_norm_eps(writer, config, rules)
    writer.add_key_length(key_length)
    writer.add_value_length(value_length)
    writer.add_rope_dimension_count(rope_dim)
    if rules.rope_sections:  # qwen2vl's mrope: (t, h, w, 0) pairs of rotated dims per axis
        writer.add_rope_dimension_sections([int(x) for x in (list(rope["mrope_section"]) + [0] * 4)[:4]])
    writer.add_vocab_size(config.vocab_size)
    if rope.get("rope_type") == "linear":  # llama.cpp: the full layers' scale; the windowed ones keep 1
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    if rope.get("rope_type") == "yarn":
        _add_yarn_kv(writer, rope)
    for method, key in rules.rope_optional:  # Ministral 3's YaRN log multiplier and query temperature
        if rope.get(key) is not None:
            getattr(writer, method)(float(rope[key]))
    _add_window_kv(writer, config, rules, sliding_rope)
    if getattr(config, "attn_logit_softcapping", None) and rules.attn_softcap != "none":
        writer.add_attn_logit_softcapping(float(config.attn_logit_softcapping))
    if getattr(config, "final_logit_softcapping", None) and rules.final_softcap != "none":
        writer.add_final_logit_softcapping(float(config.final_logit_softcapping))
    for method, attr in rules.config_scales:  # Granite's multipliers, as llama.cpp's graph reads them
        getattr(writer, method)(float(getattr(config, attr)))
    for method, attr in rules.config_optional:  # OLMo's clip_qkv, where set
        if getattr(config, attr, None) is not None:
            getattr(writer, method)(float(getattr(config, attr)))
    if num_experts(config):
        writer.add_expert_count(num_experts(config))
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(getattr(config, "moe_intermediate_size", None) or
                                              config.intermediate_size)
    if rules.shared_expert:
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    gguf_moe.add_kv(writer, config, rules)
    gguf_more.add_kv(writer, config, rules)
    gguf_hybrid.add_kv(writer, config, _arch(model_type), rules)
    writer.add_file_type(gguf.LlamaFileType[QUANTS[quantization].file_type])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _add_norm_eps(writer, config, rules: registry.GGUFRules) -> None:
    """RMSNorm's epsilon, or a LayerNorm graph's (:attr:`fastkit.registry.GGUFRules.layer_norm_eps`)."""
    eps = rules.layer_norm_eps
    if eps == "":
        writer.add_layer_norm_rms_eps(getattr(config, rules.eps_attr))  # LFM2: norm_eps
    else:
        writer.add_layer_norm_eps(float(getattr(config, eps) if isinstance(eps, str) else eps))


def num_experts(config) -> int | None:
    """The number of routed experts of a MoE config (None for a dense one, Nemotron-H's included: its config carries
    expert counts by default, so one whose layers are all kinds of :attr:`fastkit.registry.GGUFRules.layer_kinds`)."""
    facts = registry.gguf_row(getattr(config, "model_type", None))
    if facts is not None and facts.gguf.layer_kinds:
        attr, kinds = facts.gguf.layer_kinds
        if set(getattr(config, attr, None) or ()) <= set(kinds):
            return None
    return getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)


def _add_yarn_kv(writer, rope: dict) -> None:
    """YaRN as llama.cpp reads it (as its converter writes it): factor, original context, and the optional betas /
    factors where the config sets them."""
    import gguf

    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(float(rope["factor"]))
    writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    for key, add in (("extrapolation_factor", writer.add_rope_scaling_yarn_ext_factor),
                     ("attention_factor", writer.add_rope_scaling_yarn_attn_factor),
                     ("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
                     ("beta_slow", writer.add_rope_scaling_yarn_beta_slow)):
        if rope.get(key) is not None:
            add(float(rope[key]))


_NAME_QUIRKS = re.compile(r"phi-?3", re.I)
"""llama.cpp keys token rules on ``general.name``: one containing "phi-3" / "phi3" gets Phi-3's SentencePiece rules
(whitespace stripped after every special token, and a load failure without a ``</s>`` token)."""


def _general_name(name: str) -> str:
    """``name`` as ``general.name``, out of reach of llama.cpp's name-keyed token rules (:data:`_NAME_QUIRKS`)."""
    safe = _NAME_QUIRKS.sub(lambda m: m[0][:3] + "_" + m[0][-1], name)
    if safe != name:
        logger.info("fastkit: general.name %r written as %r (llama.cpp applies Phi-3's SentencePiece token rules to "
                    "names containing 'phi3'; this vocabulary is byte-level BPE)", name, safe)
    return safe


def _add_window_kv(writer, config, rules: registry.GGUFRules, sliding_rope: dict | None) -> None:
    """The sliding window and which layers have it (llama.cpp's per-layer pattern, from ``config.layer_types``),
    and the windowed layers' rope base, for a family whose llama.cpp graph has windows."""
    window = getattr(config, "sliding_window", None)
    pattern = [t == "sliding_attention" for t in (getattr(config, "layer_types", None) or ())]
    if not (rules.windows and pattern):
        return
    if not (window and any(pattern)):  # no window at all: said outright (llama.cpp's gemma2 defaults to one)
        window, pattern = 0, [False] * len(pattern)
    writer.add_sliding_window(int(window))
    writer.add_sliding_window_pattern(pattern)  # (L,) bool: True = windowed layer
    if sliding_rope is not None:
        writer.add_rope_freq_base_swa(float(sliding_rope.get("rope_theta", 10000.0)))


# ------------------------------------------------------------------------------------------- entry


def _write(entries: list[_Entry], tokenizer, spec: dict, config, quantization: str, name: str, out: Path,
           arrays: list[tuple[str, list[float]]] = ()) -> int:
    """The planned ``entries`` as a GGUF at ``out`` in one of the WRITTEN quantizations; returns the tensor
    count (``out`` is removed if anything fails)."""
    import gguf

    writer = gguf.GGUFWriter(str(out), _arch(config.model_type))
    try:
        _add_model_kv(writer, config, config.model_type, name, quantization)
        for method, values in arrays:  # per-layer scalars (GGUFRules.layer_arrays)
            getattr(writer, method)(values)
        add_tokenizer_kv(writer, tokenizer, spec, config.vocab_size)
        for e in entries:
            _add_info(writer, e)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for e in entries:  # one merged tensor alive at a time
            writer.write_tensor_data(_encode(e.load(), e.qtype))
        writer.close()
    except BaseException as exc:
        import contextlib

        from fastkit.export.verified import disk_full

        needed = sum(t.nbytes for shard in writer.tensors for t in shard.values()) or None  # tensor data, if planned
        with contextlib.suppress(OSError):  # closing flushes: a full disk fails again
            writer.close()
        out.unlink(missing_ok=True)
        full = disk_full(exc, out, needed)
        if full is not None:
            raise full from exc
        raise
    return len(entries)


@torch.no_grad()
def write_gguf(model: torch.nn.Module, tokenizer, path: str | Path, quantization: str = "q8_0",
               name: str | None = None) -> str:
    """Write ``model`` (LoRA merged in) as ``<path>/<name>-<quantization>.gguf`` plus an Ollama ``Modelfile``.

    ``quantization``: ``"f16"``, ``"bf16"``, ``"q8_0"`` (8-bit, ~half of f16) or ``"q4_0"`` (4-bit), written
    by fastkit; ``"q4_k_m"`` / ``"q5_k_m"`` / ``"q6_k"`` (Ollama's usual ones) by llama.cpp's own quantizer
    from an f16 (bf16 for a bf16 model) file, which needs llama-cpp-python (``fastkit-llm[llamacpp]``).
    ``name`` defaults to the model's folder / Hub name. Returns the .gguf path. The in-memory model is
    not changed; tensors are merged and written one at a time.
    """
    path = Path(path)
    config, spec = check_before_writing(model, tokenizer, path, quantization)
    model_type = config.model_type
    from fastkit.export.verified import safe_name  # a file stem: nothing written outside path, no Modelfile injection

    name = safe_name(name if name is not None else (
        Path(str(getattr(config, "name_or_path", "") or "")).name or f"{model_type}-finetune"), "name")
    if _quantized(model):  # 4/8-bit storage: merge into the 16-bit base reloaded on the CPU (as save_merged)
        logger.info("fastkit: %s is 4/8-bit; merging LoRA into its fp16 base reloaded on the CPU", model_type)
        model = merged_from_disk(model, config.name_or_path, torch.float16)
    wide = "bf16" if any(p.dtype == torch.bfloat16 for p in unwrap(model).parameters()) else "f16"
    written = quantization if quantization in WRITTEN else wide  # llama.cpp's quantizer reads a 16-bit GGUF
    entries = _plan(model, config, _arch(model_type), written)  # raises on unmapped tensors, before writing
    arrays = gguf_more.layer_arrays(model, registry.gguf_row(model_type).gguf)
    path.mkdir(parents=True, exist_ok=True)
    target = path / f"{name}-{quantization}.gguf"
    tmp = target.with_name(target.name + ".partial")
    if quantization in WRITTEN:
        count = _write(entries, tokenizer, spec, config, quantization, name, tmp, arrays)
    else:
        source = target.with_name(f"{target.name}.{wide}.partial")
        count = _write(entries, tokenizer, spec, config, wide, name, source, arrays)
        try:
            quantize_with_llama_cpp(source, tmp, quantization)
        finally:
            source.unlink(missing_ok=True)
    if is_spm_style(spec):  # merges llama.cpp may order differently are checked in llama.cpp, before any replace
        try:
            check_ids_in_llama_cpp(tmp, tokenizer, spec)
        except FastkitError:
            tmp.unlink(missing_ok=True)
            raise
    tmp.replace(target)
    text = modelfile(tokenizer, target.name)  # None (and a warning) where no TEMPLATE renders the chat template
    if text is not None:
        (path / "Modelfile").write_text(text)
    logger.info("fastkit: wrote %s (%d tensors, %s, %.1f MB)%s", target.name, count, quantization,
                target.stat().st_size / 1e6, " and an Ollama Modelfile" if text is not None else "")
    return str(target)


__all__ = ["LLAMA_CPP_QUANTS", "QUANTIZATIONS", "QUANTS", "WRITTEN", "QuantSpec", "check_weights",
           "llama3_rope_factors", "merged_parameters", "num_experts", "quantize_with_llama_cpp", "write_gguf"]
