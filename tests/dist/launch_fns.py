"""Functions tests/test_launch.py runs through ``fastkit.launch`` on 2 CPU processes (gloo)."""


def ranks_seen(offset):
    """(rank, world size, sum of every rank's rank + offset over an all-reduce, whether FSDP was asked)."""
    import os

    import torch
    import torch.distributed as dist

    from fastkit import ranks

    state = ranks.state()
    value = torch.tensor([float(state.process_index + offset)])
    if dist.is_initialized():  # one process: no group
        dist.all_reduce(value)
    return state.process_index, state.num_processes, value.item(), os.environ.get("ACCELERATE_USE_FSDP")


def train_twin(out):
    """FastModel twin -> LoRA -> make_trainer -> fit (2 steps, the default dashboard) -> the LoRA saved once."""
    from fastkit import FastModel, ranks
    from fastkit.data.samples import NO_ROBOTS_SAMPLE
    from fastkit.data.sources import load_sources
    from fastkit.export import save_lora
    from fastkit.training import fit, make_trainer

    model, tok = FastModel.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct", max_seq_length=128, twin=True)
    model = FastModel.get_peft_model(model)
    trainer = make_trainer(model, tok, load_sources(str(NO_ROBOTS_SAMPLE)), max_steps=2, max_seq_length=128,
                           output_dir=f"{out}/run", drop_long=True, save_steps=None)
    metrics = fit(trainer)
    ranks.agreed(save_lora, model, tok, f"{out}/lora", main_only=True)
    return metrics.status, ranks.world_size()


def refuse_on_rank1(kind):
    """Rank 1 raises (a fastkit refusal, or a plain bug); rank 0 returns."""
    import os

    from fastkit.errors import FastkitError

    if os.environ.get("RANK") == "1":
        raise (FastkitError if kind == "fastkit" else ZeroDivisionError)(f"{kind} failure on rank 1")
    return "rank 0 done"
