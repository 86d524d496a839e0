"""The planner's DPO and GRPO terms (fastkit/plan/rl.py): each term against a hand computation on a small config,
the phases (generation, reference, training) that do not overlap, the largest G / completion length, the CLI."""

from __future__ import annotations

import pytest

from fastkit.errors import FastkitError
from fastkit.plan import plan
from fastkit.plan.planner import OFF_PEAK

# a small llama: 2 layers, hidden 64, 4 query heads / 2 kv heads of 16, MLP 128, vocabulary 1000, untied
TINY = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=128, vocab_size=1000, max_position_embeddings=4096,
            tie_word_embeddings=False)
LAYERS, H, Q, KV, INTER, V = 2, 64, 64, 32, 128, 1000
SIZE = 2  # gpu="24": a discrete 24 GiB card, bf16
PARAMS = 2 * V * H + LAYERS * (H * Q + 2 * H * KV + Q * H + 3 * H * INTER + 2 * H) + H


def _term(p, start: str) -> int:
    """The component whose name starts with ``start`` (at the peak or not)."""
    found = [v for k, v in p.components.items() if k.removeprefix(OFF_PEAK).startswith(start)]
    assert len(found) == 1, (start, list(p.components))
    return found[0]


def _at_peak(p, start: str) -> bool:
    return any(k.startswith(start) for k in p.components)


def _forward_layer(tokens: int) -> int:  # one layer's no-grad forward temporaries, by hand
    return tokens * (2 * H + 2 * Q + 2 * KV + 3 * INTER) * SIZE


def _tile(tokens: int) -> int:  # one tile of TRL's fused LM head (4096 tokens x 32768 vocabulary, dtype + 8 bytes)
    return min(tokens, 4096) * min(V, 32768) * (SIZE + 8)


def test_grpo_terms_by_hand():
    b, g, c, p_len = 2, 4, 48, 80
    p = plan(TINY, gpu=24, kind="grpo", batch_size=b, num_generations=g, max_completion_length=c,
             max_seq_length=p_len + c)
    rows, row = b * g, p_len + c
    assert _term(p, "generation: KV cache") == LAYERS * 2 * KV * row * rows * SIZE
    assert _term(p, "generation: logits of one decode step") == rows * V * (SIZE + 3 * 4)
    assert _term(p, "generation: prompt prefill") == _forward_layer(rows * p_len) + rows * p_len * p_len
    assert _term(p, "reference pass (adapter disabled") == _forward_layer(rows * row) + _tile(rows * row)
    assert _term(p, "reference log-probs of the generation batch") == rows * c * 4
    # the policy's log-prob pass: SFT's terms on batch x G rows of prompt + completion
    assert _term(p, "checkpointed layer inputs") == LAYERS * H * SIZE * rows * row
    sft = plan(TINY, gpu=24, batch_size=rows, max_seq_length=row)
    assert _term(p, "one layer's recompute") == _term(sft, "one layer's recompute")
    assert _term(p, "logits + loss (trl)") == _term(sft, "logits + loss (trl)")
    # beta=0: no reference pass, no reference log-probs
    none = plan(TINY, gpu=24, kind="grpo", batch_size=b, num_generations=g, max_completion_length=c,
                max_seq_length=p_len + c, beta=0)
    assert not any("reference" in k for k in none.components)


def test_grpo_generation_batch_is_a_whole_optimizer_step_and_its_phase_can_be_the_peak():
    small = plan(TINY, gpu=24, kind="grpo", num_generations=4, max_completion_length=48, max_seq_length=128)
    big = plan(TINY, gpu=24, kind="grpo", num_generations=4, max_completion_length=48, max_seq_length=128,
               gradient_accumulation_steps=16)
    assert _term(big, "generation: KV cache") == 16 * _term(small, "generation: KV cache")
    assert not _at_peak(small, "generation: KV cache") and _at_peak(big, "generation: KV cache")
    # at the peak: the generation phase alone (no training activations are alive while generating)
    assert not _at_peak(big, "checkpointed layer inputs") and not _at_peak(big, "logits + loss")
    gen = sum(v for k, v in big.components.items() if k.startswith("generation:"))
    base = _term(big, "weights: linear") + _term(big, "weights: embeddings") + _term(big, "weights: norms") + \
        _term(big, "LoRA r=16") + _term(big, "optimizer state") + _term(big, "reference log-probs")
    slack = _term(big, "allocator slack")
    assert big.total == base + gen + _term(big, "CUDA context") + slack


def test_dpo_terms_by_hand():
    pairs, seq = 2, 128
    p = plan(TINY, gpu=24, kind="dpo", batch_size=pairs, max_seq_length=seq)
    tokens = 2 * pairs * seq  # chosen + rejected of every pair, packed into one row
    assert _term(p, "checkpointed layer inputs") == LAYERS * H * SIZE * tokens
    assert _term(p, "reference pass (adapter disabled") == _forward_layer(tokens) + _tile(tokens)
    assert not any(k.startswith("weights: reference") for k in p.components)  # LoRA: no copy
    # the reference pass runs after the policy's forward: on top of the kept activations, against the backward
    assert _at_peak(p, "checkpointed layer inputs")
    full = plan(TINY, gpu=24, kind="dpo", batch_size=pairs, max_seq_length=seq, r=None)
    assert _term(full, "weights: reference model (a frozen full copy") == PARAMS * SIZE
    assert _term(full, "reference pass (frozen copy") == _term(p, "reference pass (adapter disabled")
    sft = plan(TINY, gpu=24, batch_size=pairs, max_seq_length=seq)
    assert _term(sft, "checkpointed layer inputs") * 2 == _term(p, "checkpointed layer inputs")
    assert not any("reference" in k for k in sft.components)


def test_qwen3_0_6b_grpo_g8_x_512_on_a_t4():
    p = plan("Qwen/Qwen3-0.6B", gpu="t4", kind="grpo", num_generations=8, max_completion_length=512,
             max_seq_length=1024)
    # Qwen3-0.6B: 28 layers, 8 kv heads x 128, fp16 on a T4; 8 rows of 512 + 512 tokens
    assert _term(p, "generation: KV cache") == 28 * 2 * 8 * 128 * 1024 * 8 * 2
    assert p.fits, p.table()
    g, c = p.largest["num_generations"], p.largest["max_completion_length"]
    assert g >= 8 and c >= 512
    for key, n in (("num_generations", g), ("max_completion_length", c)):  # the bisection's edge is the budget's
        at = plan("Qwen/Qwen3-0.6B", gpu="t4", kind="grpo", max_prompt_length=512, **{
            "num_generations": 8, "max_completion_length": 512, "max_seq_length": 40960, key: n})
        above = plan("Qwen/Qwen3-0.6B", gpu="t4", kind="grpo", max_prompt_length=512, **{
            "num_generations": 8, "max_completion_length": 512, "max_seq_length": 40960, key: n + 1})
        assert at.fits and not above.fits, key
    assert "completions per prompt" in p.table()


def test_bad_rl_inputs_are_refused_by_name():
    with pytest.raises(FastkitError, match="kind"):
        plan(TINY, gpu=24, kind="ppo")
    with pytest.raises(FastkitError, match="at least 2"):
        plan(TINY, gpu=24, kind="grpo", num_generations=1)
    with pytest.raises(FastkitError, match="no room for the prompt"):
        plan(TINY, gpu=24, kind="grpo", max_completion_length=512, max_seq_length=512)
    with pytest.raises(FastkitError, match="beta"):
        plan(TINY, gpu=24, kind="grpo", beta=-1.0)
    with pytest.raises(FastkitError, match="max_seq_length='max'"):
        plan(TINY, gpu=24, kind="grpo", max_seq_length="max")


def test_cli_plans_grpo_and_dpo(tmp_path, capsys):
    from fastkit.cli import main

    assert main(["plan", "Qwen/Qwen3-0.6B", "--kind", "grpo", "--num-generations", "8", "--max-completion-length",
                 "512", "--max-seq-length", "1024"]) == 0
    out = capsys.readouterr().out
    assert "generation: KV cache" in out and "completions per prompt" in out and "fits on t4" in out
    assert main(["plan", "Qwen/Qwen3-0.6B", "--kind", "dpo", "--max-seq-length", "1024"]) == 0
    assert "reference pass (adapter disabled" in capsys.readouterr().out


def test_docs_plan_md_grpo_table_is_what_plan_says():
    """docs/plan.md's GRPO table, row by row, recomputed."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "plan.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| (\S+) \| (\S+) \| (4-bit|16-bit) \| (\d+) x (\d+) \((\d+)\) \| ([\d.]+) \| ([a-z ]+) \| "
                      r"([\d,]+) \| ([\d,]+) \|$", text, re.M)
    assert len(rows) == 5
    for model, gpu, weights, g, c, seq, peak, verdict, most_g, longest_c in rows:
        p = plan(model, gpu=gpu, kind="grpo", num_generations=int(g), max_completion_length=int(c),
                 max_seq_length=int(seq), load_in_4bit=weights == "4-bit")
        assert f"{p.total / 2**30:.2f}" == peak and ("fits" if p.fits else "does not fit") == verdict, model
        assert (p.largest["num_generations"], p.largest["max_completion_length"]) == (
            int(most_g.replace(",", "")), int(longest_c.replace(",", ""))), model
