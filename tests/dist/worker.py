"""One rank of the multi-process tests (launched by tests/test_distributed.py through torchrun).

Each rank trains the same fastkit-patched twin on its own packed row (TRL's padding-free collator,
then fastkit's wrap_collator) for one step under DDP or FSDP2 (gloo, CPU), and rank 0 saves the
full gradients so the test can compare them with one process seeing both rows.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

from tests.dist.common import build_model, packed_batch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama")
    parser.add_argument("--mode", choices=["ddp", "fsdp2"], default="ddp")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build_model(args.model)
    if args.mode == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        wrapped = fully_shard(model)
    batch = packed_batch(args.model, rank)
    loss = wrapped(**batch).loss
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    losses = [torch.zeros(()) for _ in range(dist.get_world_size())]
    dist.all_gather(losses, loss.detach().reshape(()))
    if rank == 0:
        torch.save({"grads": grads, "losses": torch.stack(losses),
                    "active": sorted(getattr(model, "_fastkit_patches", {}))}, args.out)
    dist.barrier()
    dist.destroy_process_group()
    # Note: [gloo teardown] FSDP2 can keep gloo work objects (holding tensors) alive past
    # destroy_process_group; destroying them during interpreter finalization aborts the process
    # ("terminate called without an active exception", SIGABRT; seen once in four full runs; the
    # mechanism is described in pytorch/pytorch#179291, not merged). The result is on disk and both
    # ranks passed the barrier, so the worker leaves without running finalizers.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
