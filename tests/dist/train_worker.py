"""One rank of tests/test_distributed.py's multi-process runs of fastkit's own training path (gloo, CPU).

``--mode fit``: FastModel twin -> get_peft_model -> make_trainer -> fit for two steps; each rank writes the status
fit returned to ``OUT/status-<rank>.txt`` and the main process saves the LoRA (as ``fastkit train`` does).
``--fail-rank N``: rank N raises at the end of step 1 (the others are in the next step's collectives).
``--mode agree``: :func:`fastkit.distributed.ranks.agreed` with a function that fails on ``--fail-rank``; each rank writes
what it raised to ``OUT/agree-<rank>.txt``.
Every mode: at exit, after fastkit's own exit handler, each rank writes whether a process group was still alive to
``OUT/groups-at-exit-<rank>.txt`` (a live gloo group can abort the interpreter's finalization).
"""

import argparse
import atexit
import os
from pathlib import Path

from transformers import TrainerCallback

from fastkit.distributed import ranks


class FailAt(TrainerCallback):
    """Raise on one rank at the end of step 1."""

    def __init__(self, rank: int):
        self.rank = rank

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1 and ranks.state().process_index == self.rank:
            raise RuntimeError(f"planted failure on rank {self.rank}")


def fit_mode(out: Path, fail_rank: int | None) -> None:
    from fastkit import FastModel
    from fastkit.data.samples import NO_ROBOTS_SAMPLE
    from fastkit.data.sources import load_sources
    from fastkit.export import save_lora
    from fastkit.training import fit, make_trainer

    model, tok = FastModel.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct", max_seq_length=128, twin=True)
    model = FastModel.get_peft_model(model)
    rows = load_sources(str(NO_ROBOTS_SAMPLE))
    callbacks = [FailAt(fail_rank)] if fail_rank is not None else []
    trainer = make_trainer(model, tok, rows, max_steps=2, max_seq_length=128, output_dir=str(out / "run"),
                           drop_long=True, save_steps=None, callbacks=callbacks)
    metrics = fit(trainer, view="none")
    (out / f"status-{ranks.state().process_index}.txt").write_text(metrics.status)
    ranks.agreed(save_lora, model, tok, str(out / "lora"), main_only=True)


def agree_mode(out: Path, fail_rank: int) -> None:
    def step():
        if ranks.state().process_index == fail_rank:
            raise FileNotFoundError(f"no such file on rank {fail_rank}")
        return "ok"

    try:
        ranks.agreed(step)
        seen = "no error"
    except ranks.OtherRankFailed as exc:
        seen = f"OtherRankFailed rank={exc.rank} kind={exc.kind} bad_input={exc.bad_input}: {exc.message}"
    except FileNotFoundError as exc:
        seen = f"own FileNotFoundError: {exc}"
    (out / f"agree-{ranks.state().process_index}.txt").write_text(seen)


def record_groups_at_exit(out: Path) -> None:
    """Registered before fastkit's handler, so it runs after it (atexit is last in, first out)."""
    import torch.distributed as dist

    rank = os.environ.get("RANK", "0")
    (out / f"groups-at-exit-{rank}.txt").write_text("alive" if dist.is_initialized() else "destroyed")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["fit", "agree"], default="fit")
    parser.add_argument("--out", required=True)
    parser.add_argument("--fail-rank", type=int, default=None)
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atexit.register(record_groups_at_exit, out)
    if args.mode == "fit":
        fit_mode(out, args.fail_rank)
    else:
        agree_mode(out, args.fail_rank)


if __name__ == "__main__":
    main()
