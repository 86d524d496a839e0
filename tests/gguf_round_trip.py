"""The real-client GGUF round trip: a fastkit export loaded by llama.cpp (llama-cpp-python) and compared with
the transformers model and tokenizer it came from.

Shared by tests/test_llamacpp_round_trip.py (which asserts on every row) and by
``python -m tests.gguf_round_trip`` (which runs the same rows and rewrites the table in docs/export.md).

Per row (family x quantization): the file loads; llama.cpp's token ids equal the HF tokenizer's on a chat
corpus (punctuation, quotes, contractions, code, numbers, emoji, CJK, runs of spaces and newlines, and the
chat-template special tokens); the chat prompt llama-cpp-python renders from the embedded template equals
``apply_chat_template`` (system-less, system, multi-turn); greedy continuations are the same tokens and
text; and the max |Δ| of the first generated token's logits.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

CHATS = [
    [{"role": "user", "content": "What's 12 + 30? Answer with the number only."}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": 'Quote: "It\'s fine," she said -- isn\'t it? I\'ve \'RE \'M \'D We\'Ve a\'lL'}],
    [{"role": "user", "content": "def f(x):\n    return x ** 2  # square\n\nprint(f(3.14))"},
     {"role": "assistant", "content": "```python\nf(3.14) == 9.8596\n```"},
     {"role": "user", "content": "And $1,234.56 (approx.) <= 3.5%? a|b ~c && d >= e; [x] {y} @z #t ^u"}],
    [{"role": "user", "content": "Numbers: 3 33 333 3333 33333 1e-5 0x1F 2023-12-01 12:30"},
     {"role": "assistant", "content": "Emoji 🚀 (ok) 😶‍🌫️ ✅ 🦙🦙; ünïcödé café; 我想在apple工作1314天～"},
     {"role": "user", "content": "Spaces:  two   three\t\ttabs\n\n\nnewlines ------======= ......!!!!!!??????"}],
]
"""The chat corpus (also the text the twins are trained on)."""
TEMPLATE_CHATS = {
    "system-less": [{"role": "user", "content": "Name a colour."}],
    "system": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
    "multi-turn": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Name a colour."}],
}
GREEDY_PROMPT = [{"role": "user", "content": "What's 12 + 30? Answer with the number only."}]
NEW_TOKENS = 12
TABLE_BEGIN, TABLE_END = "<!-- round-trip table: begin -->", "<!-- round-trip table: end -->"


@dataclass
class Row:
    """One family x quantization through llama.cpp."""

    family: str
    """What was exported (model type, tokenizer's pre-tokenizer)."""
    quantization: str
    """The GGUF's quantization."""
    loads: bool = False
    """llama.cpp loaded the file."""
    pre: str = ""
    """``tokenizer.ggml.pre`` as llama.cpp read it."""
    tokens: tuple[int, int] = (0, 0)
    """Texts whose llama.cpp token ids equal the HF tokenizer's, of all texts tried."""
    template: tuple[int, int] = (0, 0)
    """Chats whose rendered prompt equals ``apply_chat_template``, of all chats tried."""
    greedy: bool = False
    """llama.cpp's next token equals transformers' greedy token at every position of transformers' greedy
    continuation where transformers' own top-1 / top-2 margin is above ``2 x bound`` (:func:`greedy_agrees`); False
    until checked. Without a bound (k-quants: reported, not asserted): at every position."""
    greedy_positions: list[tuple[float, bool, float]] = field(default_factory=list)
    """Per token of transformers' greedy continuation of :data:`GREEDY_PROMPT` (teacher-forced, both models fed
    the same tokens): (transformers' top-1 minus top-2 logit, llama.cpp's argmax is that token, max |Δlogit|)."""
    greedy_compared: tuple[int, int] = (0, 0)
    """Positions compared (margin above 2 x bound) of all positions."""
    logits_delta: float = float("nan")
    """max |Δ| of the first generated token's logits (llama.cpp vs transformers, fp32)."""
    logits_scale: float = float("nan")
    """max |logit| there (for scale)."""
    perplexity: float = float("nan")
    """llama.cpp's perplexity on the rendered training chats over exp(transformers' loss) on the same tokens."""
    notes: list[str] = field(default_factory=list)
    """Mismatches, for the test's message."""

    def cells(self) -> list[str]:
        def frac(pair):
            return f"{pair[0]}/{pair[1]}"

        logits = f"{self.logits_delta:.3g} (of {self.logits_scale:.3g})"
        return [self.family, self.quantization, "yes" if self.loads else "NO", self.pre or "none (SPM)",
                frac(self.tokens), frac(self.template), self.greedy_cell(), logits,
                f"{self.perplexity:.5f}"]


    def greedy_cell(self) -> str:
        compared, total = self.greedy_compared
        skipped = f" ({total - compared} near-tie{'s' * (total - compared != 1)} skipped)" if compared < total else ""
        return ("yes" if self.greedy else "no") + skipped


TOLERANCE = {"f16": 5e-3, "q8_0": 8e-2}
"""max |Δlogit| llama.cpp may differ from transformers by, per quantization, as a fraction of max(1, max |logit|):
see tests/test_llamacpp_round_trip.py's docstring for why each holds."""
Q8_0_TOLERANCE = {"qwen3_next (gpt-2)": 1.5e-1}
"""Twins whose first-token logits move more under q8_0 rounding
than the others', measured. qwen3_next (transformers 5.25, this twin trained 30 steps at lr 1e-2, max |logit| 0.72):
fastkit's q8_0 0.088; llama.cpp's own quantizer on fastkit's f16 file 0.012, with every Q8_0 tensor byte-identical to
fastkit's quantizer run on the f16-rounded weights (gguf.quants, llama.cpp's algorithm): the one difference is f32 vs
f16 input, i.e. rounding at the 1e-3 level moves this gated-delta twin's logits by up to 12%. f16 reproduces at 1e-3,
greedy text and perplexity (0.998) hold, and 5.24 on the same environment misses the bound too (greedy differs), so
neither the export nor 5.25's modeling is the cause (issue 47)."""
def bound(row: Row) -> float | None:
    """The logit bound of ``row``'s quantization, scaled by its logits (None for the k-quants: not asserted)."""
    if row.quantization == "q8_0":
        tolerance = Q8_0_TOLERANCE.get(row.family, TOLERANCE["q8_0"])
    else:
        tolerance = TOLERANCE.get(row.quantization)
    return None if tolerance is None else tolerance * max(1.0, row.logits_scale)


def greedy_agrees(row: Row, limit: float | None) -> None:
    """Set ``row.greedy`` / ``greedy_compared`` from ``row.greedy_positions`` and ``limit`` (the logit bound).

    Where transformers' own top two logits are more than ``2 x limit`` apart, a file within ``limit`` of
    transformers at that position cannot take the other token, so a different token there is an error in the file.
    Where they are closer (a near-tie), either token is the model's and the position is skipped, named in the
    notes. Positions are teacher-forced (both models continue from transformers' tokens), so one near-tie does not
    hide the positions after it."""
    margin = 0.0 if limit is None else 2 * limit
    compared = [(i, agree) for i, (gap, agree, _) in enumerate(row.greedy_positions) if gap > margin]
    deltas = ", ".join(f"{d:.3g}" for *_, d in row.greedy_positions)
    row.notes.append(f"greedy path: max |Δlogit| per position {deltas}")
    row.greedy_compared = (len(compared), len(row.greedy_positions))
    row.greedy = all(agree for _, agree in compared)
    skipped = [f"{i} (margin {gap:.3g})" for i, (gap, _, _) in enumerate(row.greedy_positions) if gap <= margin]
    if skipped:
        row.notes.append(f"greedy: near-ties skipped at token {', '.join(skipped)} (<= 2 x bound {margin / 2:.3g})")
    wrong = [i for i, agree in compared if not agree]
    if wrong:
        row.notes.append(f"greedy: llama.cpp took another token at {wrong} where transformers' margin is above "
                         f"{margin:.3g}")


def texts(tokenizer, chats=CHATS) -> list[str]:
    """The corpus as rendered chats (special tokens included) and as raw message contents."""
    rendered = [tokenizer.apply_chat_template(c, tokenize=False) for c in chats]
    return rendered + [m["content"] for c in chats for m in c]


def hf_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def load(path: str):
    from fastkit.export.gguf import llamacpp  # as fastkit chat loads it (Note: [portable llama.cpp])

    return llamacpp.load(path, "the round trip", n_ctx=512, logits_all=True, n_threads=2, seed=0)


def _logits_llama(llm, ids: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[:len(ids)], dtype=np.float64)  # (T, V)


@torch.no_grad()
def _logits_hf(model, ids: list[int]) -> np.ndarray:
    return model(input_ids=torch.tensor([ids], device=model.device)).logits[0].double().cpu().numpy()  # (T, V)


def _nll(chats: list[list[int]], logits_of) -> float:
    """Mean negative log-likelihood of every next token of every chat (the training loss on them)."""
    total, count = 0.0, 0
    for ids in chats:
        logits = logits_of(ids)[:-1]  # (T-1, V): predicts ids[1:]
        logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
        total += float((logz - logits[np.arange(len(ids) - 1), ids[1:]]).sum())
        count += len(ids) - 1
    return total / count


@torch.no_grad()
def _greedy_hf(model, ids: list[int], eos: int) -> tuple[list[int], np.ndarray]:
    x = torch.tensor([ids], device=model.device)
    first = model(input_ids=x).logits[0, -1].float().cpu().numpy()
    out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS,
                         do_sample=False, eos_token_id=eos, pad_token_id=eos)
    return out[0, len(ids):].tolist(), first


def _greedy_positions(row: Row, llm, model, prompt: list[int], want: list[int]) -> None:
    """Both models fed ``prompt + want`` (transformers' greedy continuation): per generated position, transformers'
    top-1 minus top-2 logit, whether llama.cpp's argmax is transformers' token, and max |Δlogit|."""
    ids = prompt + want
    hf = _logits_hf(model, ids)[len(prompt) - 1:len(ids) - 1]  # (N, V): row i predicts want[i]
    ours = _logits_llama(llm, ids)[len(prompt) - 1:len(ids) - 1]  # (N, V)
    top = np.sort(hf, axis=-1)[:, -2:]  # (N, 2): top-2, then top-1
    row.greedy_positions = [(float(t[1] - t[0]), int(o.argmax()) == w, float(np.abs(o - h).max()))
                            for t, o, h, w in zip(top, ours, hf, want)]


def check(path: str, model, tokenizer, family: str, quantization: str, extra_texts=(), probe=()) -> Row:
    """Load ``path`` in llama.cpp and compare it with ``model`` / ``tokenizer`` (see the module docstring);
    ``probe``: rows of token ids the perplexity is also compared on (:func:`routing_probe`)."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    row = Row(family, quantization)
    llm = load(path)
    try:
        row.loads = True
        row.pre = llm.metadata.get("tokenizer.ggml.pre", "")
        corpus = texts(tokenizer) + list(extra_texts)
        same = 0
        for text in corpus:
            got, want = llm.tokenize(text.encode(), add_bos=False, special=True), hf_ids(tokenizer, text)
            same += got == want
            if got != want and len(row.notes) < 3:
                row.notes.append(f"tokens differ on {text[:60]!r}: llama.cpp {got[:12]} vs HF {want[:12]}")
        row.tokens = (same, len(corpus))
        formatter = Jinja2ChatFormatter(template=llm.metadata["tokenizer.chat_template"],
                                        eos_token=tokenizer.eos_token or "", bos_token=tokenizer.bos_token or "")
        same = 0
        for name, chat in TEMPLATE_CHATS.items():
            got = formatter(messages=chat).prompt
            want = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            same += got == want
            if got != want:
                row.notes.append(f"template differs ({name}): {got!r} vs {want!r}")
        row.template = (same, len(TEMPLATE_CHATS))
        prompt = hf_ids(tokenizer, tokenizer.apply_chat_template(GREEDY_PROMPT, tokenize=False,
                                                                 add_generation_prompt=True))
        want, want_first = _greedy_hf(model, prompt, tokenizer.eos_token_id)
        _greedy_positions(row, llm, model, prompt, want)
        row.logits_delta = row.greedy_positions[0][2]  # the first generated token's
        row.logits_scale = float(np.abs(want_first).max())
        greedy_agrees(row, bound(row))
        chats = [hf_ids(tokenizer, tokenizer.apply_chat_template(c, tokenize=False)) for c in CHATS] + list(probe)
        row.perplexity = math.exp(_nll(chats, lambda ids: _logits_llama(llm, ids)) -
                                  _nll(chats, lambda ids: _logits_hf(model, ids)))
    finally:
        llm.close()
    return row


# ----------------------------------------------------------------------------------- the models


def train_on_chats(model, tokenizer, steps: int = 40, lr: float = 3e-3, seed: int = 0):
    """A few AdamW steps on the chat corpus (LoRA if the model has it, else every parameter), so greedy
    continuations are confident enough to compare; returns ``model.eval()``."""
    torch.manual_seed(seed)
    rows = [hf_ids(tokenizer, t)[:128] for t in texts(tokenizer)[: len(CHATS)]]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    model.train()
    for step in range(steps):
        ids = torch.tensor([rows[step % len(rows)]])
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


_ATTN = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
_MLA = dict(num_hidden_layers=3, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=8,
            v_head_dim=32)


def _yarn(mscale: float) -> dict:
    return {"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0, "original_max_position_embeddings": 16,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": mscale, "mscale_all_dim": mscale}


_QWEN3_5 = {"num_hidden_layers": 4, "layer_types": ["linear_attention", "full_attention"] * 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
                                "mrope_section": [2, 1, 1], "mrope_interleaved": True}}
"""Qwen3.5 twins: M-RoPE sections that fit the twin's 8 rotary dims (the real [11, 11, 10] fits 64)."""
_GEMMA = dict(_ATTN, intermediate_size=128, query_pre_attn_scalar=16, sliding_window=8)
TWINS = {  # family label -> (model_type, twin overrides, pre-tokenizer of the family's real tokenizer)
    "llama (smollm)": ("llama", {}, "smollm"),
    "llama-3 (llama-bpe, rope llama3)": ("llama", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}, "llama-bpe"),
    "mistral (tekken)": ("mistral", {"sliding_window": None}, "tekken"),
    # SentencePiece-style vocabularies (byte fallback, "▁" for spaces), written as llama.cpp's SPM model: Gemma's
    # (no space prefix) on a gemma3 twin, Llama-2's (a "▁" before the text and after every special token) on llama.
    "gemma3_text (spm, as Gemma)": ("gemma3_text", dict(_GEMMA, vocab_size=640), "spm"),
    "llama (spm, as Llama-2)": ("llama", {"vocab_size": 640}, "spm-prefix"),
    "qwen2 (qwen2)": ("qwen2", {}, "qwen2"),
    "qwen3 (qwen2)": ("qwen3", {}, "qwen2"),
    "qwen3_moe (qwen2)": ("qwen3_moe", {}, "qwen2"),
    "qwen2_moe (qwen2)": ("qwen2_moe", {}, "qwen2"),
    "mixtral (llama-bpe)": ("mixtral", {"sliding_window": None}, "llama-bpe"),
    # Granite: embedding / residual / attention multipliers and a logit divisor, all away from 1 so each one bites.
    "granite (gpt-2)": ("granite", {"embedding_multiplier": 4.0, "residual_multiplier": 0.5,
                                    "attention_multiplier": 0.1, "logits_scaling": 2.0}, "gpt-2"),
    # Gemma 2 / 3: norms x·(1+w), post-attention / post-ffw norms, an 8-token window (the prompts are longer) on one
    # of the two layers, Gemma 2's soft-caps low enough to bite, Gemma 3's q/k norms and per-layer-type rope (linear
    # x8 on the full layer, thetas apart from llama.cpp's defaults). Their real tokenizers are SentencePiece-style
    # (the "spm" rows above); these twins carry a byte-level BPE.
    "gemma2 (gpt-2)": ("gemma2", dict(_GEMMA, attn_logit_softcapping=0.5, final_logit_softcapping=1.0), "gpt-2"),
    "gemma3_text (gpt-2)": ("gemma3_text", dict(_GEMMA, layer_types=["full_attention", "sliding_attention"],
                                                rope_parameters={
                                                    "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                       "rope_theta": 1e4},
                                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e2}}),
                            "gpt-2"),
    # Phi-3 / Phi-4: fused qkv_proj and gate_up_proj, untied head, partial rotary (Phi-4-mini's is 0.75); Phi-4's
    # tokenizer is cl100k ("dbrx" split), Phi-3's SentencePiece-style one strips whitespace
    # around its added tokens (refused: llama.cpp does that only by general.name).
    "phi3 (dbrx, as Phi-4)": ("phi3", dict(_ATTN, intermediate_size=128, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}), "dbrx"),
    # GPT-OSS: attention sinks, q/k/v/o and expert biases, interleaved gate/up experts, clamped SwiGLU, alternating
    # 16-token windows, YaRN rope (x32 over 4096), untied head; o200k's split.
    "gpt_oss (gpt-4o)": ("gpt_oss", {"initializer_range": 0.1}, "gpt-4o"),
    # MoE families (gguf-moe). Their real tokenizers' pre-tokenizers (olmo, deepseek-llm / deepseek-v3, glm4) are not
    # among those fastkit writes yet: the twins carry GPT-2's split. Routers drawn wide (ROUTER_STD) so every token
    # has a clear top-k and tokens spread over the experts (expert_spread: a wrong expert split cannot pass).
    # OLMoE: q/k RMSNorm over all heads (MHA only), softmax top-k not renormalized.
    "olmoe (gpt-2)": ("olmoe", {"num_key_value_heads": 4}, "gpt-2"),
    # GraniteMoE: granite's multipliers away from 1, renormalized top-k, experts under block_sparse_moe.
    "granitemoe (gpt-2)": ("granitemoe", {"embedding_multiplier": 4.0, "residual_multiplier": 0.5,
                                          "attention_multiplier": 0.1, "logits_scaling": 2.0,
                                          "intermediate_size": 32}, "gpt-2"),
    # GraniteMoeShared: the same with a shared expert whose fused input_linear is split into gate / up.
    "granitemoeshared (gpt-2)": ("granitemoeshared", {"embedding_multiplier": 4.0, "residual_multiplier": 0.5,
                                                      "attention_multiplier": 0.1, "logits_scaling": 2.0,
                                                      "intermediate_size": 32, "shared_intermediate_size": 64},
                                 "gpt-2"),
    # DeepSeek-V2: MLA (q_a/q_b, kv_a_proj_with_mqa, kv_b split into attn_k_b / attn_v_b, widths that q8_0 blocks),
    # a dense first layer, 2 shared experts, routed weights x2; V2-Lite's plain q_proj in its own row.
    "deepseek_v2 (gpt-2)": ("deepseek_v2", dict(_MLA, first_k_dense_replace=1, routed_scaling_factor=2.0), "gpt-2"),
    "deepseek_v2 (q_proj, yarn, as V2-Lite)": ("deepseek_v2", dict(_MLA, q_lora_rank=None, first_k_dense_replace=1,
                                                                   rope_parameters=_yarn(0.707)), "gpt-2"),
    # DeepSeek's YaRN as their real configs have it (factor 40; mscale = mscale_all_dim: 0.707 V2-Lite, 1.0 V3) over a
    # 16-token original context, so the chats run past it.
    # DeepSeek-V3: sigmoid router with a selection bias (exp_probs_b), 2 groups of 4 experts with one group used,
    # top-k renormalized then x2.5, a dense first layer, a shared expert.
    "deepseek_v3 (gpt-2)": ("deepseek_v3", dict(_MLA), "gpt-2"),
    "deepseek_v3 (yarn, as V3)": ("deepseek_v3", dict(_MLA, rope_parameters=_yarn(1.0)), "gpt-2"),
    # GLM-4.7-Flash: V3's MLA and router on llama.cpp's deepseek2, its dense layers from mlp_layer_types.
    "glm4_moe_lite (gpt-2)": ("glm4_moe_lite", dict(_MLA, n_group=2, topk_group=1), "gpt-2"),
    # Solar Open: llama.cpp's glm4moe with experts in every layer, q/k/v biases, V3's router (groups here).
    "solar_open (gpt-2)": ("solar_open", {"attention_bias": True, "n_group": 2, "topk_group": 1,
                                          "routed_scaling_factor": 2.0}, "gpt-2"),
    # MiniMax-M2: sigmoid router with a selection bias, top-k renormalized, q/k norms over all heads, partial rotary.
    "minimax_m2 (gpt-2)": ("minimax_m2", {"intermediate_size": 32, "rope_parameters": {
        "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "gpt-2"),
    # GLM-4.5: V3's router (here with groups, x2), partial rotary 0.5, q/k norms and q/k/v biases, post-attention norm.
    "glm4_moe (gpt-2)": ("glm4_moe", {"num_hidden_layers": 3, "use_qk_norm": True, "attention_bias": True,
                                      "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.0}, "gpt-2"),
    # ERNIE-4.5 MoE: a dense first layer, then 8 experts top-2 with a softmax router, its selection bias (drawn) and 2
    # shared experts; interleaved rope with head_dim 32 (initializer_range 0.1, as ernie4_5, so the rope order shows).
    "ernie4_5_moe (gpt-2)": ("ernie4_5_moe", {"num_hidden_layers": 3, "moe_k": 2, "head_dim": 32,
                                              "initializer_range": 0.1}, "gpt-2"),
    # dense families (gguf-dense). SmolLM3: 4 layers, so layer 3 is one llama.cpp runs without rope; Llama-3's split.
    # initializer_range 0.1 (as gpt_oss): at 0.02 the attention logits are too flat for rope to matter (roping layer 3
    # too moved the logits by 1e-3 only); here it changes the greedy text.
    "smollm3 (llama-bpe)": ("smollm3", {"num_hidden_layers": 4, "initializer_range": 0.1}, "llama-bpe"),
    # OLMo 2 / 3 (cl100k-based, "dbrx" split): no pre-norms, post-attention / post-ffw norms, q/k RMSNorm over all
    # heads, untied head; OLMo 3: an 8-token window on the first layer, YaRN (x8 over 64) on the full layer only
    # (initializer_range 0.1: without the YaRN keys the logits then move by 0.57, at 0.02 by 0.005).
    "olmo2 (dbrx)": ("olmo2", {}, "dbrx"),
    "olmo3 (dbrx, yarn on full layers)": ("olmo3", {
        "initializer_range": 0.1, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "full_attention": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0,
                               "original_max_position_embeddings": 64},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}, "dbrx"),
    # StarCoder2: LayerNorm with biases, every linear with a bias, gelu MLP without a gate; its tokenizer's split is
    # llama.cpp's "starcoder", the same regexes as "smollm".
    "starcoder2 (smollm)": ("starcoder2", {"bos_token_id": 1, "eos_token_id": 2}, "smollm"),
    # GLM-4: fused gate_up_proj, q/k/v biases, post-attention / post-MLP norms, rope on half of each head, interleaved.
    "glm4 (dbrx)": ("glm4", {}, "dbrx"),
    # Command R7B: attention and MLP in parallel on one bias-free LayerNorm, rope only in the windowed layer (8
    # tokens), a logit scale away from 1, tied head, interleaved rope; Cohere's split is llama.cpp's "command-r"
    # (the same regexes as "smollm").
    "cohere2 (smollm)": ("cohere2", {"logit_scale": 0.5, "initializer_range": 0.05}, "smollm"),
    # EXAONE 4.0 (below 64 layers: no windows, rope everywhere): no pre-norms, post-norms, per-head q/k RMSNorm,
    # Llama-3 rope scaling as rope_freqs.
    "exaone4 (gpt-2, rope llama3)": ("exaone4", {"sliding_window": None, "layer_types": ["full_attention"] * 2,
                                                 "rope_parameters": {
                                                     "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 64}}, "gpt-2"),
    # EXAONE 4.0 32B's depth: llama.cpp's exaone4 has windows, and no rope on the full layers, at 64 layers only;
    # alternating layers (not llama.cpp's default every-4th pattern, so the written pattern is what counts).
    "exaone4 (gpt-2, 64 layers, windows)": ("exaone4", {"num_hidden_layers": 64, "sliding_window": 8,
                                                        "layer_types": ["sliding_attention", "full_attention"] * 32,
                                                        "initializer_range": 0.1}, "gpt-2"),
    # ERNIE 4.5: interleaved rope, head_dim 32 over a 64-wide model (ERNIE-4.5-0.3B: 128 over 1024 / 16 heads).
    # ERNIE 4.5 at initializer_range 0.1 and Cohere 2 at 0.05: at 0.02, q/k rows in the wrong rope order still passed
    # (Cohere 2 at 0.1: its q8_0 greedy text had near-ties).
    "ernie4_5 (gpt-2)": ("ernie4_5", {"head_dim": 32, "initializer_range": 0.1}, "gpt-2"),
    # more dense families (gguf-more). Real tokenizers whose split fastkit does not name yet (exaone, seed-coder,
    # hunyuan-dense, afmoe...) are carried as GPT-2's split on these twins.
    # Ministral: llama.cpp's llama graph, which has no window: the twin's window is the whole context.
    "ministral (tekken)": ("ministral", {"sliding_window": 4096}, "tekken"),  # = the context: no window
    # EXAONE 3.x / InternLM3: transformers builds them as LlamaForCausalLM: llama.cpp's llama graph.
    "exaone (gpt-2)": ("exaone", {}, "gpt-2"),
    "internlm3 (gpt-2)": ("internlm3", {}, "gpt-2"),
    # Helium: llama's layout with rope on interleaved pairs, llama.cpp's own order (nothing permuted).
    "helium (gpt-2)": ("helium", {}, "gpt-2"),
    # Gemma: x·sqrt(H) embeddings, norms x·(1+w), GELU(tanh), tied head.
    "gemma (gpt-2)": ("gemma", {}, "gpt-2"),
    # Arcee (AFM): ReLU² MLP without a gate.
    "arcee (gpt-2)": ("arcee", {}, "gpt-2"),
    # Seed-OSS: q/k/v biases, post-attention norm as llama.cpp's attn_post_norm.
    "seed_oss (gpt-2)": ("seed_oss", {}, "gpt-2"),
    # Hunyuan dense: q/k RMSNorm applied after rope.
    "hunyuan_v1_dense (gpt-2)": ("hunyuan_v1_dense", {}, "gpt-2"),
    # Ministral 3: llama.cpp's mistral3: YaRN (x4 over a 16-token original context, so the chats run past it) and the
    # Llama-4 query temperature (beta 0.1 per log step of 16 positions).
    "ministral3 (tekken)": ("ministral3", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}},
                            "tekken"),
    # Apertus: xIELU MLP (its per-layer alpha_p / alpha_n / beta / eps as metadata arrays), q/k RMSNorm, Llama-3 rope
    # scaling over a 64-token original context.
    "apertus (gpt-2)": ("apertus", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}, "gpt-2"),
    # GPT-NeoX (Pythia): per-head fused query_key_value, LayerNorms with bias, partial rotary 0.25, parallel residual
    # (and the sequential one in its own row); exact-erf GELU, which llama.cpp computes with its tanh form.
    "gpt_neox (gpt-2)": ("gpt_neox", {}, "gpt-2"),
    "gpt_neox (gpt-2, sequential residual)": ("gpt_neox", {"use_parallel_residual": False}, "gpt-2"),
    # GPT-2: Conv1D weights stored (in, out), learned positions, LayerNorms with bias, tied head.
    "gpt2 (gpt-2)": ("gpt2", {}, "gpt-2"),
    # GPT-BigCode (StarCoder / SantaCoder): one shared key / value head (multi_query), fused [q | k | v], learned
    # positions.
    "gpt_bigcode (gpt-2)": ("gpt_bigcode", {}, "gpt-2"),
    # Phi-2: parallel attention + MLP off one LayerNorm (with bias), biases everywhere (lm_head too), partial rotary.
    "phi (gpt-2)": ("phi", {}, "gpt-2"),
    # OLMo: LayerNorms without weights, q/k/v clamped (clip_qkv low enough to bite).
    "olmo (gpt-2)": ("olmo", {"clip_qkv": 0.5}, "gpt-2"),
    # Cohere (Command-R): parallel block, LayerNorm without bias, interleaved rope, logits x logit_scale, tied head.
    "cohere (gpt-2)": ("cohere", {"logit_scale": 4.0}, "gpt-2"),
    # Hybrid families (gguf-hybrid): recurrent layers beside attention. Their real tokenizers' pre-tokenizers (lfm2,
    # qwen35) are not all among those fastkit writes: these twins carry GPT-2's split. Every chat is longer than the
    # recurrent layers' reach, so a state carried wrong (conv taps reversed, a layer's kind) shows in the logits.
    # LFM2: conv / attention / conv / attention (layers of 0 KV heads are llama.cpp's conv layers), conv kernel 3, q/k
    # norms, the MLP's auto-adjusted width (2/3 of intermediate_size, rounded up to 256).
    "lfm2 (gpt-2)": ("lfm2", {"num_hidden_layers": 4, "layer_types": ["conv", "full_attention", "conv",
                                                                      "full_attention"]}, "gpt-2"),
    # Qwen3-Next: gated DeltaNet / gated attention alternating (not llama.cpp's default of every 4th layer attention), 2
    # key heads for 4 value heads, norms x·(1+w) drawn away from 0, partial rotary 0.25, 4 experts top-2 renormalized,
    # a shared expert with its sigmoid gate.
    "qwen3_next (gpt-2)": ("qwen3_next", {"num_hidden_layers": 4, "layer_types": [
        "linear_attention", "full_attention", "linear_attention", "full_attention"]}, "gpt-2"),
    # Qwen3.5 (dense / MoE): the same DeltaNet with split projections, value heads tiled in the file (2 key heads for 4
    # value heads, so the order matters), interleaved M-RoPE sections (plain rope on text positions).
    "qwen3_5_text (gpt-2)": ("qwen3_5_text", _QWEN3_5, "gpt-2"),
    "qwen3_5_moe_text (gpt-2)": ("qwen3_5_moe_text", _QWEN3_5, "gpt-2"),
    # Falcon-H1: attention and a Mamba2 mixer in parallel, every multiplier away from 1 (each folded into a weight),
    # conv bias, 2 groups of B / C; initialised at std 0.1 so the Mamba2 branch weighs in the output (at 0.02 dropping
    # its zxBCdt multipliers moved the logits by 5e-4 only).
    "falcon_h1 (gpt-2)": ("falcon_h1", {"embedding_multiplier": 2.0, "lm_head_multiplier": 0.5,
                                        "attention_in_multiplier": 0.7, "attention_out_multiplier": 1.3,
                                        "key_multiplier": 0.6, "ssm_in_multiplier": 1.4, "ssm_out_multiplier": 0.8,
                                        "mlp_multipliers": [1.5, 0.6], "ssm_multipliers": [0.5, 1.2, 0.8, 1.6, 0.7],
                                        "mamba_n_groups": 2, "initializer_range": 0.1}, "gpt-2"),
    # LFM2-MoE: a dense first layer, then experts with a sigmoid router and its selection bias (drawn); initialised at
    # std 0.1 so the experts weigh in the output (at 0.02 a routed scale of 1.5 llama.cpp ignores stayed in the bound).
    "lfm2_moe (gpt-2)": ("lfm2_moe", {"num_hidden_layers": 4, "num_dense_layers": 1, "initializer_range": 0.1,
                                      "layer_types": ["conv", "full_attention", "conv", "full_attention"]}, "gpt-2"),
    # GraniteMoeHybrid (Granite 4.0-H): Mamba2 / attention layers without rope (its real setting: order comes from the
    # Mamba2 state alone), granite's multipliers away from 1, experts + shared expert, 2 groups of B / C.
    "granitemoehybrid (gpt-2)": ("granitemoehybrid", {
        "num_hidden_layers": 4, "layer_types": ["mamba", "attention", "mamba", "attention"], "mamba_n_groups": 2,
        "embedding_multiplier": 4.0, "residual_multiplier": 0.5, "attention_multiplier": 0.1, "logits_scaling": 2.0,
        "initializer_range": 0.1}, "gpt-2"),
    # Nemotron-H: one mixer per layer, Mamba2 (M), attention without rope (*) and the ReLU² MLP without gate (-), in
    # its pattern's order, 2 groups of B / C; initialised at std 0.1 (as falcon_h1) so the Mamba2 branch weighs in.
    "nemotron_h (gpt-2)": ("nemotron_h", {
        "layers_block_type": ["linear_attention", "mlp", "full_attention", "linear_attention", "mlp"], "n_groups": 2,
        "initializer_range": 0.1}, "gpt-2"),
}
ROUTER_STD = {label: 1.0 for label in TWINS if TWINS[label][0] in ("olmoe", "granitemoe", "granitemoeshared",
                                                                    "deepseek_v2", "deepseek_v3", "glm4_moe_lite",
                                                                    "glm4_moe", "solar_open", "minimax_m2",
                                                                    "ernie4_5_moe")}
"""Twins whose router weights are drawn at this std (their init, 0.02, leaves near-ties that q8_0 rounding flips)."""
ROUTER_STD.update({label: 1.0 for label in ("qwen3_next (gpt-2)", "qwen3_5_moe_text (gpt-2)",
                                             "granitemoehybrid (gpt-2)", "lfm2_moe (gpt-2)")})  # gguf-hybrid
ROUTER_STD["deepseek_v3 (yarn, as V3)"] = 0.25
"""Its group-limited sigmoid routing saturates at a wider draw: at 0.5 its second MoE layer reached 3 experts (4 chats
and random-token rows alike) on one thread and 5 on two. At 0.25, with the random-token rows, 7-8 of 8 in each layer
under three 1e-6 perturbations of the LoRA before training (a stand-in for another CPU's rounding); 0.75: 7-8."""


TRAIN_STEPS = {"gemma3_text (gpt-2)": 60, "gemma3_text (spm, as Gemma)": 60, "exaone4 (gpt-2, 64 layers, windows)": 15,
               "ministral3 (tekken)": 60, "lfm2_moe (gpt-2)": 60}
"""Twins trained longer than 30 steps: at 30, gemma3's greedy text had near-ties (q8_0 differed at token 12; with the
SentencePiece vocabulary, at token 2; ministral3's q8_0 at token 9, logits 0.0099 apart; lfm2_moe's q8_0 at token 8).
Shorter: the 64-layer exaone4 twin (15 steps keep its row at seconds). One dict: a second assignment once dropped
ministral3's entry in a merge and its q8_0 row went red on the near-tie (tests/test_llamacpp_round_trip.py)."""


def twin_model(label: str, steps: int | None = None):
    """A fastkit twin of ``label`` with LoRA (experts too) trained on the chat corpus, and its BPE tokenizer."""
    steps = TRAIN_STEPS.get(label, 30) if steps is None else steps
    from transformers import AutoModelForCausalLM, Qwen2Config

    from fastkit import FastModel
    from fastkit.families.twins import twin, twin_bpe_tokenizer, twin_spm_tokenizer

    model_type, overrides, pre = TWINS[label]
    if pre.startswith("spm"):
        tokenizer = twin_spm_tokenizer(space_prefix=pre == "spm-prefix", corpus=tuple(texts_raw()))
    else:
        tokenizer = twin_bpe_tokenizer(pre, corpus=tuple(texts_raw()))
    if model_type == "qwen2":  # no twin family: from its config, q/k/v biases included
        torch.manual_seed(0)
        config = Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                             num_hidden_layers=2, vocab_size=320, max_position_embeddings=4096, bos_token_id=1,
                             eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
        base = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    else:
        base = twin(model_type, **overrides)
    _draw_zeros(base)
    if label in ROUTER_STD:
        _draw_routers(base, ROUTER_STD[label])
    model = FastModel.get_peft_model(base, r=8, lora_alpha=16, use_gradient_checkpointing=False)
    return train_on_chats(model, tokenizer, steps=steps, lr=1e-2), tokenizer


@torch.no_grad()
def _draw_zeros(model, std: float = 0.5) -> None:
    """Parameters that start at zero (biases) and attention sinks (which start near it) drawn at random, so that a
    file dropping, misplacing or zeroing them cannot pass (LoRA leaves them at their initial value)."""
    gen = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if not p.any() or name.endswith(".sinks"):  # ERNIE 4.5's selection bias too (a frozen parameter, at 0.5)
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    for name, b in model.named_buffers():  # DeepSeek-V3 / GLM-4.5's selection bias (exp_probs_b) starts at zero
        if name.endswith(("e_score_correction_bias", "expert_bias")):  # LFM2-MoE's too
            b.copy_(torch.randn(b.shape, generator=gen) * 0.1)


_ROUTER = re.compile(r".*\.(mlp\.gate|block_sparse_moe\.router|feed_forward\.gate)\.weight")


@torch.no_grad()
def _draw_routers(model, std: float) -> None:
    """Router weights drawn at ``std``: clear top-k choices that spread tokens over the experts."""
    gen = torch.Generator().manual_seed(2)
    for name, p in model.named_parameters():
        if _ROUTER.fullmatch(name):
            p.copy_(torch.randn(p.shape, generator=gen) * std)


ROUTING_PROBE = (8, 48)
"""Rows x tokens of random token ids that MoE twins are also compared on (:func:`routing_probe`)."""


def routing_probe(tokenizer, seed: int = 3) -> list[list[int]]:
    """Rows of random token ids: hidden states far apart, so a router with clear choices sends them to most experts
    whatever a few training steps did to it. Over the 4 training chats alone, which experts a layer reaches is an
    accident of training (deepseek_v3's yarn twin: [6, 3] on 1 thread, [7, 5] on 2: issue 58)."""
    gen = torch.Generator().manual_seed(seed)
    rows, length = ROUTING_PROBE
    return torch.randint(0, len(tokenizer), (rows, length), generator=gen).tolist()


@torch.no_grad()
def expert_spread(model, tokenizer, probe: list[list[int]] = ()) -> list[int]:
    """How many distinct experts each MoE layer picks over the chat corpus and ``probe``'s rows (the experts
    modules' ``top_k_index``)."""
    seen: dict[str, set] = {}
    hooks = [m.register_forward_pre_hook(lambda mod, args, name=name: seen.setdefault(name, set()).update(
        args[1].flatten().tolist())) for name, m in model.named_modules() if type(m).__name__.endswith("Experts")
        and hasattr(m, "gate_up_proj")]
    try:
        for ids in [hf_ids(tokenizer, text) for text in texts(tokenizer)[: len(CHATS)]] + list(probe):
            model(input_ids=torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return [len(v) for v in seen.values()]


def expected_pre(label: str) -> str:
    """``tokenizer.ggml.pre`` a twin's file should carry (none for a SentencePiece-style vocabulary)."""
    pre = TWINS[label][2]
    return "" if pre.startswith("spm") else pre


SPM_EXTRA = ("Byte fallback: Hello Ω ≈ ç 𝄞 naïve Zürich", " leading space", "trailing space ", "  ",
             "<start_of_turn>user\n Hi<end_of_turn>\n<start_of_turn>model\n")
"""Texts for SentencePiece-style twins beyond the corpus: characters the vocabulary lacks (byte fallback), spaces at
the ends, text right after special tokens."""


def spm_fuzz(tokenizer, n: int = 400, seed: int = 0) -> list[str]:
    """Texts that make the merge order matter: every multi-character token's text, ``n`` runs of 2-6 of them, and
    ``n`` random spans of the corpus (a SentencePiece-style twin's merges compete over the whole text, unsplit)."""
    import random

    rng = random.Random(seed)
    words = sorted(t.replace("\u2581", " ") for t in tokenizer.get_vocab() if len(t) > 1 and not t.startswith("<"))
    src = "".join(texts_raw())
    return (words + ["".join(rng.choice(words) for _ in range(rng.randint(2, 6))) for _ in range(n)]
            + [src[i:i + rng.randint(1, 40)] for i in (rng.randrange(len(src)) for _ in range(n))])


def extra_texts(label: str, tokenizer) -> tuple[str, ...]:
    """Texts beyond the corpus a twin's token check runs on (SentencePiece-style twins: :data:`SPM_EXTRA` and
    :func:`spm_fuzz`)."""
    return (*SPM_EXTRA, *spm_fuzz(tokenizer)) if TWINS[label][2].startswith("spm") else ()


def texts_raw() -> list[str]:
    return [m["content"] for c in CHATS for m in c]


# ------------------------------------------------------------------------------------- the table


def table(rows: list[Row]) -> str:
    head = ["family (pre-tokenizer)", "quant", "loads", "tokenizer.ggml.pre", "tokens equal", "template equal",
            "greedy equal", "first-token logits: max abs Δ (of max abs logit)", "perplexity ratio"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r.cells()) + " |" for r in rows]
    return "\n".join(lines)


def write_table(rows: list[Row], doc: Path) -> None:
    """Replace the table between the markers in ``doc`` (docs/export.md)."""
    text = doc.read_text()
    block = f"{TABLE_BEGIN}\n{table(rows)}\n{TABLE_END}"
    doc.write_text(re.sub(re.escape(TABLE_BEGIN) + r".*?" + re.escape(TABLE_END), lambda _: block, text, flags=re.S))


def dump(rows: list[Row], path: str | os.PathLike) -> None:
    Path(path).write_text(json.dumps([r.__dict__ for r in rows], indent=1))


def smollm2_model(steps: int = 4):
    """The real SmolLM2-135M-Instruct (offline, from the quickstart package) with LoRA trained ``steps`` steps on
    the quickstart chats, and its tokenizer."""
    from fastkit import FastModel
    from fastkit.quickstart import smollm2_135m_instruct
    from fastkit.quickstart.data import quickstart_records

    model, tokenizer = FastModel.from_pretrained(smollm2_135m_instruct(), max_seq_length=256, dtype=torch.float32)
    model = FastModel.get_peft_model(model, r=8, lora_alpha=16, use_gradient_checkpointing=False)
    torch.manual_seed(0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    chats = [r["messages"] for r in quickstart_records()]
    model.train()
    for step in range(steps):
        ids = torch.tensor([hf_ids(tokenizer, tokenizer.apply_chat_template(chats[step], tokenize=False))])
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval(), tokenizer


def quickstart_texts(tokenizer) -> list[str]:
    """The 106 quickstart training chats, rendered as they were trained on."""
    from fastkit.quickstart.data import quickstart_records

    return [tokenizer.apply_chat_template(r["messages"], tokenize=False) for r in quickstart_records()]


def all_rows(tmp: Path) -> list[Row]:
    """Every family twin in f16 / q8_0, the 4-bit-expert MoE, then SmolLM2 in f16, q8_0 and llama.cpp's k-quants."""
    from fastkit.export.gguf.writer import LLAMA_CPP_QUANTS, quantize_with_llama_cpp, write_gguf

    rows = []
    for label in TWINS:
        model, tokenizer = twin_model(label)
        for quantization in ("f16", "q8_0"):
            path = write_gguf(model, tokenizer, tmp / label.split()[0] / quantization, quantization=quantization)
            rows.append(check(path, model, tokenizer, label, quantization, extra_texts(label, tokenizer)))
    quantized, reference, tokenizer = moe_4bit_model()
    for quantization in ("f16", "q8_0"):
        path = write_gguf(quantized, tokenizer, tmp / "moe4" / quantization, quantization=quantization)
        rows.append(check(path, reference, tokenizer, "qwen3_moe, NF4 experts (qwen2)", quantization))
    model, tokenizer = smollm2_model()
    extra = quickstart_texts(tokenizer)
    label = "SmolLM2-135M-Instruct (smollm), LoRA"
    for quantization in ("f16", "q8_0"):
        path = write_gguf(model, tokenizer, tmp / "smollm2", quantization=quantization)
        rows.append(check(path, model, tokenizer, label, quantization, extra))
    for quantization in LLAMA_CPP_QUANTS:
        out = tmp / "smollm2" / f"k-{quantization}.gguf"
        quantize_with_llama_cpp(tmp / "smollm2" / "SmolLM2-135M-Instruct-f16.gguf", out, quantization)
        rows.append(check(str(out), model, tokenizer, label, quantization, extra))
        out.unlink()
    return rows


def moe_4bit_model():
    """A qwen3_moe twin with fastkit's NF4 experts, and the 16-bit model computing the same function (its
    expert weights set to the dequantized NF4 values): the reference the GGUF must reproduce."""
    import copy

    from fastkit.families.twins import twin, twin_bpe_tokenizer
    from fastkit.patches.moe.nf4 import NF4Experts, quantize_experts

    tokenizer = twin_bpe_tokenizer("qwen2", corpus=tuple(texts_raw()))
    reference = train_on_chats(twin("qwen3_moe"), tokenizer, steps=30, lr=1e-2)
    quantized = copy.deepcopy(reference)
    quantize_experts(quantized)
    with torch.no_grad():
        for name, q in quantized.named_modules():
            if isinstance(q, NF4Experts):
                reference.get_parameter(name).copy_(q.dequantize())
    return quantized, reference, tokenizer


if __name__ == "__main__":  # python -m tests.gguf_round_trip: rerun every row and rewrite docs/export.md's table
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        result = all_rows(Path(tmp))
    for r in result:
        print(r.cells(), r.notes)
    write_table(result, Path(__file__).resolve().parents[1] / "docs" / "export.md")
