"""GRPO's generation (transformers' ``generate``, TRL's default) on an MoE twin: fastkit's patches add no host
sync to a decode step. Syncs are counted by fastkit.SyncCounter (dispatch mode + profiler) over ``generate`` of
4 and of 12 new tokens; per decode step = the difference / 8. ``python -m tests.test_grpo_decode`` prints them."""

import copy

import torch

from fastkit import FastModel, SyncCounter, active_patches
from fastkit.families.twins import twin


def _syncs(model, new_tokens: int, by_op: bool = False):
    torch.manual_seed(0)
    ids = torch.randint(3, 250, (4, 12))  # 4 prompts, left-padded as TRL pads them
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    mask[1, :2] = 0
    with torch.no_grad(), SyncCounter(profile=True) as sc:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=True, top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=1, use_cache=True)
    return dict(sc.by_op) if by_op else sc.total


def per_decode_step(model, by_op: bool = False):
    """Syncs one more generated token costs (by op with ``by_op``: the dispatch mode's, then the profiler's)."""
    _syncs(model, 4)  # first call: one-time checks
    if not by_op:
        return (_syncs(model, 12) - _syncs(model, 4)) / 8
    long, short = _syncs(model, 12, True), _syncs(model, 4, True)
    return {op: (n - short.get(op, 0)) / 8 for op, n in long.items() if n != short.get(op, 0)}


def _models():
    plain = twin("qwen3_moe", num_hidden_layers=2)
    patched = copy.deepcopy(plain)
    FastModel.patch(patched)
    assert {"packing", "moe"} <= set(active_patches(patched))
    return plain, patched


def test_fastkit_adds_no_sync_to_a_decode_step():
    plain, patched = _models()
    fast, base = per_decode_step(patched), per_decode_step(plain)
    assert fast <= base, (fast, base)
    # and the prefill of a generate call costs at most one sync more (packing detection on a padded prompt)
    assert _syncs(patched, 4) <= _syncs(plain, 4) + 2


if __name__ == "__main__":
    plain, patched = _models()
    eager = twin("qwen3_moe", num_hidden_layers=2)
    eager.set_experts_implementation("eager")
    for name, model in (("transformers, grouped_mm experts (default)", plain),
                        ("transformers, eager experts", eager), ("fastkit (packing + moe)", patched)):
        print(f"{name:<44} per decode step {per_decode_step(model, by_op=True)}   "
              f"generate(4 new tokens) {_syncs(model, 4, by_op=True)}")
