"""One rank of tests/test_distributed.py's FSDP2 / DDP / one-process comparison (gloo, CPU): make_trainer + fit
on a twin for 3 steps, the same global batch in every layout; writes the loss of every step and the LoRA weights
before training (main process) to ``--out``, and the main process saves the trained LoRA once (``save_lora``,
verified).

The optimizer is plain SGD (``--optim``): its update is linear in the gradient, so the rounding-level difference
between two summation orders (one process summing the batch, two processes summing halves and averaging) stays
rounding-level in the weights. AdamW's first steps are ~lr x sign(g): a gradient element near zero that flips sign
under the other order moves its weight by ~2 x lr (a numerical edge, seen on other CPUs: issue 58)."""

import argparse
import os
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=1, help="rows per process per step")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--optim", default="sgd", help="SGD: an update linear in the gradient (module docstring)")
    parser.add_argument("--lr", type=float, default=0.5)
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from fastkit import FastModel
    from fastkit.distributed import ranks
    from fastkit.data.samples import NO_ROBOTS_SAMPLE
    from fastkit.data.sources import load_sources
    from fastkit.export import save_lora
    from fastkit.training import fit, make_trainer

    torch.manual_seed(0)
    model, tok = FastModel.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct", max_seq_length=128, twin=True)
    model = FastModel.get_peft_model(model, lora_dropout=0.0)
    initial = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    rows = load_sources(str(NO_ROBOTS_SAMPLE))
    out = Path(args.out)
    trainer = make_trainer(model, tok, rows, max_steps=args.steps, max_seq_length=128, output_dir=str(out / "run"),
                           drop_long=True, save_steps=None, per_device_train_batch_size=args.batch, logging_steps=1,
                           learning_rate=args.lr, warmup_steps=0, optim=args.optim,
                           lr_scheduler_type="constant", dashboard="none")
    fit(trainer, view="none")
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    from fastkit.export.sharded import is_sharded, save_sharded_lora

    sharded = is_sharded(trainer.model)
    if sharded:
        save_sharded_lora(trainer.model, tok, str(out / "lora"))
    else:
        ranks.agreed(save_lora, trainer.model, tok, str(out / "lora"), main_only=True)
    if ranks.is_main():
        torch.save({"losses": losses, "sharded": sharded, "fsdp": trainer.is_fsdp_enabled,
                    "world": ranks.world_size(), "initial": initial}, out / "result.pt")


if __name__ == "__main__":
    main()
