"""The sync counter counts known cases exactly, on CPU."""

import pytest
import torch

from fastkit.syncs import SyncCounter, count_syncs

T = torch.tensor([1, 0, 2])
M = T > 0
X = torch.randn(3, 4)

CASES = {
    "item": (lambda: T[0].item(), {"_local_scalar_dense": 1}),
    "bool": (lambda: bool(T[0]), {"_local_scalar_dense": 1}),
    "int": (lambda: int(T[0]), {"_local_scalar_dense": 1}),
    "if any": (lambda: 1 if T.any() else 0, {"_local_scalar_dense": 1}),
    "tolist": (lambda: T.tolist(), {"tolist": 1}),
    "numpy": (lambda: T.numpy(), {"numpy": 1}),
    "nonzero": (lambda: T.nonzero(), {"nonzero": 1}),
    "where(cond)": (lambda: torch.where(M), {"nonzero": 1}),
    "bool index": (lambda: X[M], {"index": 1}),
    "bool index put": (lambda: X.clone().__setitem__(M, 0.0), {"index_put_": 1}),
    "unique": (lambda: torch.unique(T), {"_unique2": 1}),
    "bincount": (lambda: torch.bincount(T), {"bincount": 1}),
    "repeat_interleave": (lambda: torch.repeat_interleave(X, T, dim=0), {"repeat_interleave": 1}),
    "equal": (lambda: torch.equal(X, X), {"equal": 1}),
    "allclose": (lambda: torch.allclose(X, X), {"allclose": 1}),
}
NO_SYNC = {
    "int index": lambda: X[T],
    "sort": lambda: torch.sort(T, stable=True),
    "argsort": lambda: torch.argsort(T, stable=True),
    "cumsum": lambda: T.cumsum(0),
    "histc": lambda: torch.histc(T.float(), bins=3, min=0, max=2),
    "repeat_interleave sized": lambda: torch.repeat_interleave(X, T, dim=0, output_size=3),
    "scatter_add": lambda: torch.zeros(3).scatter_add(0, T, torch.ones(3)),
    "matmul+backward": lambda: (X.clone().requires_grad_() @ X.T).sum().backward(),
}


@pytest.mark.parametrize("name", CASES)
def test_counts_known_syncs_exactly(name):
    fn, expected = CASES[name]
    with SyncCounter() as sc:
        fn()
    assert dict(sc.by_op) == expected
    assert sc.total == 1


@pytest.mark.parametrize("name", NO_SYNC)
def test_sync_free_ops_count_zero(name):
    with SyncCounter() as sc:
        NO_SYNC[name]()
    assert sc.total == 0, dict(sc.by_op)


def test_counts_accumulate_and_hooks_are_removed():
    original = torch.Tensor.tolist
    with count_syncs(record_stacks=True) as sc:
        for _ in range(3):
            T.tolist()
            T.nonzero()
    assert sc.by_op == {"tolist": 3, "nonzero": 3}
    assert len(sc.events) == 6 and "test_syncs.py" in sc.events[0][1]
    assert torch.Tensor.tolist is original
    with SyncCounter() as sc2:
        pass
    assert sc2.total == 0


@pytest.mark.parametrize("name", CASES)
def test_profile_mode_adds_nothing_the_dispatch_mode_already_counted(name):
    fn, expected = CASES[name]
    with SyncCounter(profile=True) as sc:
        fn()
    assert dict(sc.by_op) == expected


def test_profile_mode_sees_reads_inside_backend_kernels():
    """segment_reduce's safe mode reads its lengths on the host inside the C++ kernel: 2 reads per call."""
    grad, lengths = torch.randn(10, 4), torch.tensor([3, 0, 7])
    with SyncCounter() as plain, SyncCounter(profile=True) as profiled:
        torch.segment_reduce(grad, "sum", lengths=lengths, axis=0)
    assert plain.total == 0  # invisible to the dispatch mode
    assert dict(profiled.by_op) == {"profiler:_local_scalar_dense": 2}
    with SyncCounter(profile=True) as unsafe:
        torch.segment_reduce(grad, "sum", lengths=lengths, axis=0, unsafe=True)
    assert unsafe.total == 0


def test_blocking_copies_across_the_host_line_count_async_ones_do_not():
    """'meta' stands in for a GPU: torch synchronizes the stream after any blocking copy to or from it."""
    host, dev = torch.ones(3), torch.empty(3, device="meta")
    with SyncCounter() as sc:
        host.to("meta")
        dev.copy_(host)
    assert dict(sc.by_op) == {"_to_copy": 1, "copy_": 1}
    with SyncCounter() as sc:
        host.to("meta", non_blocking=True)
        dev.copy_(host, non_blocking=True)
        host.to(torch.float64)
    assert sc.total == 0
