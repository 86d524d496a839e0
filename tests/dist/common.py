"""Model and data shared by the multi-process workers and the single-process reference."""

import torch

from fastkit import FastModel
from fastkit.families.twins import twin

# Three documents per rank, different lengths per rank, the same token and label count on each rank
# (so DDP's mean of per-rank mean losses equals the single-process mean over both rows).
DOC_LENGTHS = {0: [9, 14, 17], 1: [20, 5, 15]}


def build_model(model_type: str) -> torch.nn.Module:
    model = twin(model_type, num_hidden_layers=2, seed=1234).train()
    FastModel.patch(model)
    return model


def _docs(rank: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(3, 259, (n,), generator=g).tolist() for n in DOC_LENGTHS[rank]]


def packed_batch(model_type: str, *ranks: int) -> dict:
    """One packed row holding the documents of ``ranks`` (TRL padding-free collator + fastkit metadata)."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from fastkit.patches.packing.patch import wrap_collator

    docs = [doc for r in ranks for doc in _docs(r)]
    collator = wrap_collator(DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True))
    return collator([{"input_ids": d} for d in docs])
