"""Scaled-down random twins of real architectures, and a tokenizer built in-process.

A twin keeps what makes a family itself (GQA ratio, q/k-norm, sliding-window layers, attention
sinks, interleaved expert weights, shared experts, tied embeddings) and shrinks every size, so
tests and notebook CI run the real transformers modeling code in seconds, offline. Nothing here
downloads anything.

    model = twin("qwen3_moe", num_hidden_layers=4)    # random weights, fp32, CPU
    tok = twin_tokenizer()                            # byte-level, ChatML chat template
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, PretrainedConfig, PreTrainedTokenizerFast

from fastkit import registry

# ChatML, the template SmolLM2-Instruct and Qwen ship; generation prompt "<|im_start|>assistant\n".
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TWIN_VOCAB_SIZE = 320  # 256 byte symbols + 3 specials, rounded up for aligned embeddings

# The twin sizes of a family live in its table row (``ModelFacts.twin``); a row without them (and a type
# with no row: the census, the loader's self-check) gets its config class's defaults, shrunk (``tiny_config``).
TWIN_FAMILIES = tuple(t for t, f in registry.MODEL_TABLE.items() if f.twin)
"""Families whose row carries hand-picked twin sizes (the traits tests rely on)."""
HYBRID_FAMILIES = tuple(t for t, f in registry.MODEL_TABLE.items() if f.stateful)
"""Twins of the families whose stateful layers fastkit restarts per packed document (rows with ``stateful``)."""

# Size fields a config may carry under any of its names -> the twin's value. A twin of a type with no
# row-specific overrides (``ModelFacts.twin``) is its config class's defaults with these shrunk.
_SHRINK: dict[str, int] = dict(
    vocab_size=TWIN_VOCAB_SIZE, vocab_size_per_layer_input=TWIN_VOCAB_SIZE,
    hidden_size=64, n_embd=64, d_model=64, embedding_size=64, attention_hidden_size=64, backbone_hidden_size=64,
    num_hidden_layers=2, n_layer=2, num_layers=2, n_layers=2, decoder_layers=2, encoder_layers=2,
    num_attention_heads=4, n_head=4, num_heads=4, n_heads=4, decoder_attention_heads=4, encoder_attention_heads=4,
    swa_num_attention_heads=4, num_key_value_heads=2, num_kv_heads=2, kv_n_heads=2,
    head_dim=16, attention_head_dim=16, kv_channels=16, dim_head=16, swa_head_dim=16, qk_head_dim=16,
    intermediate_size=128, ffn_dim=128, n_inner=128, ffn_hidden_size=128, decoder_ffn_dim=128, encoder_ffn_dim=128,
    dim_ff=128, dff=128,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, shared_intermediate_size=32,
    shared_experts_intermediate_size=32, expert_intermediate_size=32,
    num_experts=8, num_local_experts=8, n_routed_experts=8, moe_num_experts=8, num_experts_per_tok=2, moe_top_k=2,
    q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, o_lora_rank=16,
    index_head_dim=16, index_n_heads=2, index_topk=8,
    max_position_embeddings=4096, n_positions=4096, n_ctx=4096, max_seq_len=4096,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    mamba_d_state=16, mamba_n_heads=4, mamba_d_head=16, mamba_chunk_size=16, mamba_dt_rank=8, mamba_d_ssm=64,
    sliding_window=8, sliding_window_size=8, attention_window_size=8,  # shorter than a census document
    emb_dim=64, hidden_size_global=64, encoder_hash_byte_group_vocab=TWIN_VOCAB_SIZE, expert_ffn_hidden_size=32,
    zero_expert_num=2, linear_head_dim=16, local_attention_window_len=8,
    attention_chunk_size=8,
    rotary_dim=8, query_pre_attn_scalar=16, hidden_size_per_layer_input=16, laurel_rank=8,
)
_NONE_OK = ("head_dim", "num_key_value_heads", "num_experts_per_tok")  # a None default is sized too
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


def _shrunk(d: dict[str, Any], layers: int, mixed: bool = True) -> dict[str, Any]:
    """Overrides that shrink one config dict ``d`` (``config.to_dict()``) to a twin of ``layers`` layers."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        sized = isinstance(v, int) and not isinstance(v, bool)
        if k in _SHRINK and (sized or (v is None and k in _NONE_OK)):
            out[k] = _SHRINK[k]
        elif (k.endswith("_token_id") or k.endswith("_token_index")) and sized and v >= TWIN_VOCAB_SIZE:
            out[k] = TWIN_VOCAB_SIZE - 1 - len(out) % 16  # special ids inside the twin's vocabulary
        elif k.endswith("_config") and isinstance(v, dict) and k not in ("text_config", "quantization_config"):
            out[k] = {**v, **_shrunk(v, layers)}  # nested parts (DBRX attn_config / ffn_config)
    out = {k: v for k, v in out.items() if k not in _LAYER_KEYS or k in d}
    for key in _LAYER_KEYS:
        if key in out:
            out[key] = layers
    _shrink_layer_lists(d, out, layers, mixed)
    if "kv_lora_rank" in d:  # MLA: one k/v head per query head, rope part of the q/k head
        out.update(num_key_value_heads=out.get("num_attention_heads", 4), head_dim=_SHRINK["qk_rope_head_dim"])
    if d.get("n_group") not in (None, 1):
        out.update(n_group=2, topk_group=1)  # grouped routing over the twin's 8 experts
    return out


def _shrink_layer_lists(d: dict[str, Any], out: dict[str, Any], layers: int, mixed: bool) -> None:
    """Per-layer lists of ``d`` (``layer_types`` ...) cut to the twin's layers, into ``out``."""
    depth = next((d[k] for k in _LAYER_KEYS if isinstance(d.get(k), int)), None)
    per_layer = [k for k, v in d.items() if isinstance(v, list) and depth and len(v) == depth and k not in out]
    if per_layer and not mixed:
        for k in per_layer:
            out[k] = d[k][:layers]
    elif per_layer:  # per-layer lists (layer_types...): keep one layer of every kind, so the twin has each trait
        kinds = [str(x) for x in (d["layer_types"] if "layer_types" in per_layer else d[per_layer[0]])]
        firsts = sorted({kind: i for i, kind in reversed(list(enumerate(kinds)))}.values())  # 1st of each kind
        keep = sorted(firsts + [i for i in range(depth) if i not in firsts][:max(0, layers - len(firsts))])
        for key in _LAYER_KEYS:
            if key in out:
                out[key] = len(keep)
        for k in per_layer:
            out[k] = [d[k][i] for i in keep]


def tiny_config(model_type: str, num_hidden_layers: int = 2, **overrides: Any) -> PretrainedConfig:
    """A tiny config of ANY ``model_type``: its config class's defaults with every size shrunk.

    A composite config (``text_config``) has its text part shrunk the same way. ``overrides`` win.
    Raises whatever the config class raises when its defaults cannot be shrunk this way.
    """
    cls = CONFIG_MAPPING[model_type]
    defaults = cls().to_dict()
    try:
        return cls(**_tiny_kwargs(defaults, num_hidden_layers, True, overrides))
    except Exception:  # a layout whose layer lists must stay a prefix (dory's input/recurrent/output blocks)
        return cls(**_tiny_kwargs(defaults, num_hidden_layers, False, overrides))


def _tiny_kwargs(defaults: dict[str, Any], layers: int, mixed: bool, overrides: dict[str, Any]) -> dict[str, Any]:
    kwargs = _shrunk(defaults, layers, mixed)
    text = defaults.get("text_config")
    if isinstance(text, dict):
        kwargs["text_config"] = {**text, **_shrunk(text, layers, mixed)}
    kwargs.update(overrides)
    return kwargs

# Models the notebooks use -> the family of their twin, plus traits worth keeping.
HUB_TWINS: dict[str, tuple[str, dict[str, Any]]] = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": ("llama", {}),
    "Qwen/Qwen3-0.6B": ("qwen3", {}),
    "meta-llama/Llama-3.2-1B-Instruct": ("llama", {}),
    "Qwen/Qwen3-14B": ("qwen3", {"tie_word_embeddings": False}),
    "unsloth/Qwen3-14B-bnb-4bit": ("qwen3", {"tie_word_embeddings": False}),  # pre-quantized NF4 of the above
    "openai/gpt-oss-20b": ("gpt_oss", {}),
    "Qwen/Qwen3-30B-A3B": ("qwen3_moe", {}),
    "google/gemma-3-4b-it": ("gemma3_text", {}),  # composite checkpoint: fastkit trains its text model
    "microsoft/Phi-3-mini-4k-instruct": ("phi3", {}),
    # vision-language (fastkit.families.vision builds these twins and their processors)
    "Qwen/Qwen2.5-VL-3B-Instruct": ("qwen2_5_vl", {}),  # the other vision rows: twin=True on their model_type
}


def twin_family(name: str) -> tuple[str, dict[str, Any]]:
    """``(model_type, overrides)`` of the twin standing in for a Hub model (or a model_type itself)."""
    if name in HUB_TWINS:
        return HUB_TWINS[name]
    if name in registry.MODEL_TABLE:
        return name, {}
    raise ValueError(f"No twin for {name!r}; known models: {', '.join(HUB_TWINS)}; or any model_type in "
                     "fastkit's table (fastkit.registry.MODEL_TABLE, docs/coverage.md)")


def twin_config(model_type: str, num_hidden_layers: int = 2, **overrides: Any) -> PretrainedConfig:
    """The config of a tiny twin of ``model_type``: its row's twin sizes, else its defaults shrunk."""
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"No twin for model_type {model_type!r}: transformers has no config class for it")
    facts = registry.facts_for(model_type)
    if facts is None or not facts.twin:
        return tiny_config(model_type, num_hidden_layers, **overrides)
    # deep: the row's nested values (rope_parameters, layer_types) must not become the model's, or a change to one
    # twin's config would change every twin built after it (as in families/vision.py)
    kwargs = dict(copy.deepcopy(dict(facts.twin)), num_hidden_layers=num_hidden_layers,
                  vocab_size=TWIN_VOCAB_SIZE, max_position_embeddings=32768,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    kwargs.update(overrides)
    pattern = facts.twin_layer_pattern
    if pattern and kwargs.get("layer_types") is None:  # every layer kind in a twin of any depth
        kwargs["layer_types"] = [pattern[i % len(pattern)] for i in range(kwargs["num_hidden_layers"])]
    return CONFIG_MAPPING[model_type](**kwargs)


def twin_of(config: PretrainedConfig, num_hidden_layers: int = 2) -> PretrainedConfig:
    """A tiny twin config of a real ``config`` (the loader's self-check): same class and traits, sizes shrunk."""
    values = {k: v for k, v in config.to_dict().items() if not k.startswith("_")}  # no loader bookkeeping
    values.update(_shrunk(values, num_hidden_layers))
    text = values.get("text_config")
    if isinstance(text, dict):
        values["text_config"] = {**text, **_shrunk(text, num_hidden_layers)}
    for key in ("model_type", "transformers_version", "architectures", "quantization_config"):
        values.pop(key, None)
    return type(config)(**values)


TWIN_PREFIX = "fastkit-twin:"
"""A twin's ``config._name_or_path`` is this plus what it stands in for (``fastkit-twin:Qwen/Qwen3-0.6B``): its
saves (a LoRA folder's ``base_model_name_or_path``) then say how to build the very same twin again (twins are
deterministic), so ``fastkit export`` / ``fastkit chat`` on a ``--twin`` run's adapters rebuild it offline."""


def twin_source(name_or_path: str | None) -> str | None:
    """What a twin's ``name_or_path`` stands in for (``fastkit-twin:X`` -> ``X``); None for any other name."""
    if isinstance(name_or_path, str) and name_or_path.startswith(TWIN_PREFIX):
        return name_or_path[len(TWIN_PREFIX):]
    return None


def twin(model_type: str, num_hidden_layers: int = 2, seed: int = 0, dtype: torch.dtype = torch.float32,
         attn_implementation: str | None = None, **overrides: Any) -> torch.nn.Module:
    """A randomly initialised tiny causal LM of ``model_type`` (deterministic for a ``seed``)."""
    config = twin_config(model_type, num_hidden_layers=num_hidden_layers, **overrides)
    if attn_implementation is None:
        facts = registry.facts_for(model_type)
        attn_implementation = facts.default_attn if facts is not None else "sdpa"  # gpt_oss sinks: eager
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    return model.eval()


def _chatml_tokenizer(backend) -> PreTrainedTokenizerFast:
    """A transformers tokenizer around a ``tokenizers`` backend, with ChatML specials and chat template."""
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    tok.chat_template = CHATML_TEMPLATE
    tok.model_max_length = 32768
    return tok


def twin_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (every string round-trips) with ChatML specials and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return _chatml_tokenizer(backend)


# A small corpus the BPE twin tokenizer learns its merges from (prose, quotes, code, numbers).
TWIN_BPE_CORPUS = (
    "The quick brown fox jumps over the lazy dog. It's 12:30, isn't it? \"Yes,\" she said.",
    "def add(a, b):\n    return a + b  # sum of 2 numbers\n\nprint(add(3, 4))",
    "Total: $1,234.56 (approx.) -- that's 3.5% more than in 2023!",
    "<div class='note'>a <= b && c >= d | e ~ f</div>",
    "the theme of the thesis: there, then, these, those, other, another, mother, brother",
)


def twin_bpe_tokenizer(pre: str = "gpt-2", corpus: tuple[str, ...] = TWIN_BPE_CORPUS) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer WITH merges (what llama.cpp needs; :func:`twin_tokenizer` has none) that
    splits text like llama.cpp's pre-tokenizer ``pre`` ("gpt-2", "smollm", "llama-bpe", "qwen2", ...),
    ChatML specials at ids 0-2, trained on ``corpus`` up to ``TWIN_VOCAB_SIZE`` entries."""
    from tokenizers import Tokenizer, decoders, models, trainers
    from tokenizers import pre_tokenizers as pt

    from fastkit.export.gguf.vocab import PRE_TOKENIZERS, pre_tokenizer_object

    facts = next(p for p in PRE_TOKENIZERS if p.name == pre)
    backend = Tokenizer(models.BPE(ignore_merges=facts.ignore_merges))
    backend.pre_tokenizer = pre_tokenizer_object(pre)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TWIN_VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pt.ByteLevel.alphabet())
    backend.train_from_iterator(list(corpus) * 4, trainer)
    return _chatml_tokenizer(backend)


GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\n\n' %}"
    "{% set messages = messages[1:] %}{% else %}{% set first = '' %}{% endif %}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + ((first if loop.first else '') + message['content']) | trim"
    " + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
"""Gemma's chat format (the system prompt folded into the first user turn)."""
SPM_SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
"""Gemma's special tokens, at Gemma's ids 0-3 (the turn markers follow)."""


def _sentencepiece_merges(vocab: dict[str, int], order: dict[str, int]) -> list[tuple[str, str]]:
    """Merges as transformers derives them from a SentencePiece model: every split of every token into two tokens,
    ordered by the token made (its ``order``, the score order), then by the parts' ids."""
    merges = []
    for token in vocab:
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in vocab and right in vocab:
                merges.append((order[token], vocab[left], vocab[right], left, right))
    return [(left, right) for *_, left, right in sorted(merges)]


def twin_spm_tokenizer(space_prefix: bool = False, corpus: tuple[str, ...] = TWIN_BPE_CORPUS,
                       pieces: int = 360) -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer as Gemma's (``space_prefix=False``) or Llama-2's (``True``) tokenizer.json
    spell one: BPE with byte fallback over ``<0x00>``..``<0xFF>``, spaces replaced by "▁" (and one prepended to
    each text segment for Llama-2), no pre-tokenizer split, merges listing every split of every token (as
    transformers converts a SentencePiece model), in the order the pieces were learned. The pieces (characters
    and merged tokens, ``pieces`` of them) are learned from ``corpus``; Gemma's special tokens and chat format;
    ids: specials, bytes, then the pieces in string order (not the merge order, unlike SentencePiece's)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers

    space = "\u2581"
    steps = [normalizers.Prepend(space)] if space_prefix else []
    normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", space)]) if steps \
        else normalizers.Replace(" ", space)
    learner = Tokenizer(models.BPE())
    learner.normalizer = normalizer
    learner.train_from_iterator(list(corpus) * 4, trainers.BpeTrainer(vocab_size=pieces, show_progress=False))
    learned = learner.get_vocab()  # piece -> the order it was learned in (characters, then merges)
    vocab: dict[str, int] = {}
    for token in [*SPM_SPECIAL_TOKENS, *(f"<0x{b:02X}>" for b in range(256)), *sorted(learned)]:
        vocab.setdefault(token, len(vocab))
    # Ids in string order, merges in learned order: a score read off the id cannot pass for the merge rank.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=_sentencepiece_merges(vocab, learned), byte_fallback=True,
                                   unk_token="<unk>", fuse_unk=True))
    backend.normalizer = normalizer
    backend.decoder = decoders.Sequence([decoders.Replace(space, " "), decoders.ByteFallback(), decoders.Fuse()]
                                        + ([decoders.Strip(" ", 1, 0)] if space_prefix else []))
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                           special_tokens=[("<bos>", vocab["<bos>"])])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                  bos_token="<bos>", unk_token="<unk>",
                                  additional_special_tokens=["<start_of_turn>", "<end_of_turn>"])
    tok.chat_template = GEMMA_TEMPLATE
    tok.model_max_length = 32768
    return tok
