"""Frozen weight matrices kept in host memory and used on the device: row gathers and row-chunk streams.

Replaces, for a frozen ``(V, H)`` matrix that would otherwise sit on the GPU (the input embedding, the
lm_head): ``weight[ids]`` by a gather on the host into a pinned buffer and one non-blocking copy of the
gathered rows (:func:`gather_rows`), and ``x @ weight.T`` by a loop over row chunks copied to the device
one after the other, double-buffered on CUDA so chunk ``i + 1`` travels while chunk ``i`` computes
(:func:`device_chunks`, :class:`StreamedLinear`). The device then holds the rows a step uses (the
embedding) or two chunks of the head instead of the whole matrix.

What must not change: the values. A gathered row and a streamed chunk are copies of the same numbers;
every product is the same matmul on a slice, so the result equals the on-device computation up to the
order of floating-point sums across chunks (none for the gather). The weight never trains here
(:class:`StreamedLinear` gives no gradient for it).

Pure torch (imports torch only). On a CPU-only machine the "device" is the CPU and the same code runs:
slices are views, copies are no-ops, nothing is pinned.
"""

from __future__ import annotations

import torch

# Note: [pinned gather buffer lifetime]
# The rows a step needs are gathered on the host into a fresh pinned buffer and copied to the device
# with non_blocking=True: the host returns before the copy ran. The buffer must not be written again
# until the copy has read it. It is never reused by this code: each call allocates its own
# (``torch.empty(..., pin_memory=True)``) and drops its reference after queueing the copy. PyTorch's
# caching host allocator records an event on the copy's stream for every pinned block a non_blocking
# copy reads, and hands that block out again only once the event completed (the same contract the
# DataLoader's pin_memory relies on), so a later gather can never overwrite rows still in flight.
# The device tensor the copy fills is allocated on the current stream, the one the copy runs on, so
# its readers (the first decoder layer) are ordered after the copy by the stream itself.

# Note: [streamed chunk stream ordering]
# device_chunks keeps two device buffers. Chunk i is copied on a side stream into buffer i % 2, after
# (a) the compute stream has finished using that buffer for chunk i - 2 (the side stream waits on the
# event ``free[i % 2]`` the compute stream records after the consumer's kernels for chunk i - 2 were
# queued) and it is recorded as ``ready[i % 2]`` on the side stream; the compute stream waits on
# ``ready`` before the consumer reads the buffer. The consumer runs between two ``next()`` calls, so
# ``free`` is recorded when the consumer asks for the next chunk: everything it queued for chunk i is
# then on the compute stream before the event. The buffers are allocated on the compute stream and
# released after the loop; every side-stream write was waited on by the compute stream, so the
# allocator's reuse (ordered on the compute stream) cannot race a copy. The pinned source is the
# weight itself (pinned once, read-only), so there is no host-side lifetime to manage.


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of ``tensor``, pinned where CUDA is available (so device copies from it can be async)."""
    host = tensor.detach().to("cpu", copy=True)
    return host.pin_memory() if torch.cuda.is_available() else host


def gather_rows(weight: torch.Tensor, ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``weight[ids]`` on ``device``, with ``weight`` ``(V, H)`` and ``ids`` (any shape) both on the host.

    See Note [pinned gather buffer lifetime]. Out-of-range ids raise here (on the host), as the
    device embedding would assert.
    """
    flat = ids.reshape(-1)  # (...) -> (N,)
    device = torch.device(device)
    if device.type == "cpu":
        return torch.index_select(weight, 0, flat).view(*ids.shape, weight.shape[1])  # (N, H) -> (..., H)
    rows = torch.empty((flat.numel(), weight.shape[1]), dtype=weight.dtype, pin_memory=True)  # (N, H) pinned
    torch.index_select(weight, 0, flat, out=rows)
    return rows.view(*ids.shape, weight.shape[1]).to(device, non_blocking=True)  # (..., H) on the device


def row_bounds(rows: int, chunk: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` covering ``range(rows)`` in chunks of ``chunk`` rows."""
    chunk = max(1, int(chunk))
    return [(start, min(start + chunk, rows)) for start in range(0, rows, chunk)]


def vocab_rows(tokens: int, vocab: int, block_bytes: int) -> int:
    """Vocabulary rows per streamed chunk so that one ``(tokens, rows)`` fp32 block takes at most ``block_bytes``."""
    return max(1, min(vocab, block_bytes // (4 * max(1, tokens))))


def device_chunks(weight: torch.Tensor, bounds: list[tuple[int, int]], device: torch.device):
    """Yield ``(start, stop, weight[start:stop] on device)`` for each ``(start, stop)`` of ``bounds``, in order.

    On the weight's own device: views. To CUDA from pinned host memory: two buffers, copies on a side
    stream one chunk ahead (Note: [streamed chunk stream ordering]). Otherwise plain copies.
    """
    device = torch.device(device)
    if weight.device == device or device.type != "cuda" or not weight.is_pinned():
        for start, stop in bounds:
            yield start, stop, weight[start:stop].to(device, non_blocking=weight.is_pinned())  # (C, H)
        return
    yield from _double_buffered(weight, bounds, device)


def _double_buffered(weight: torch.Tensor, bounds: list[tuple[int, int]], device: torch.device):
    compute = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    widest = max(stop - start for start, stop in bounds)
    slots = min(2, len(bounds))  # one chunk (generation: a single token) needs one buffer
    buffers = [torch.empty((widest, weight.shape[1]), dtype=weight.dtype, device=device) for _ in range(slots)]
    ready = [torch.cuda.Event() for _ in range(slots)]
    free = [torch.cuda.Event() for _ in range(slots)]
    for event in free:
        event.record(compute)

    def issue(i: int) -> None:
        start, stop = bounds[i]
        slot = i % slots
        with torch.cuda.stream(side):
            side.wait_event(free[slot])
            buffers[slot][: stop - start].copy_(weight[start:stop], non_blocking=True)  # (C, H) H2D
            ready[slot].record(side)

    issue(0)
    for i, (start, stop) in enumerate(bounds):
        if i + 1 < len(bounds):
            issue(i + 1)
        slot = i % slots
        compute.wait_event(ready[slot])
        yield start, stop, buffers[slot][: stop - start]
        free[slot].record(compute)  # the consumer's kernels for chunk i are queued: the buffer may refill
    compute.wait_stream(side)


def _project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, chunk: int) -> torch.Tensor:
    parts = []
    bounds = row_bounds(weight.shape[0], chunk)
    for start, stop, w in device_chunks(weight, bounds, x.device):
        out = x @ w.t()  # (N, H) @ (H, C) -> (N, C)
        parts.append(out if bias is None else out + bias[start:stop].to(x.device, non_blocking=True))
    return torch.cat(parts, dim=-1)  # (N, V)


class StreamedLinear(torch.autograd.Function):
    """``x @ weight.T (+ bias)`` with a frozen host ``weight`` streamed to ``x``'s device in row chunks.

    Backward streams the chunks again for ``grad_x = grad_out @ weight``; weight and bias get no gradient.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, chunk):
        # x (N, H) on the device, weight (V, H) / bias (V,) on the host
        ctx.save_for_backward(weight)
        ctx.chunk, ctx.x_dtype = chunk, x.dtype
        return _project(x, weight, bias, chunk)

    @staticmethod
    def backward(ctx, grad_out):
        (weight,) = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:
            bounds = row_bounds(weight.shape[0], ctx.chunk)
            grad_x = torch.zeros(grad_out.shape[0], weight.shape[1], dtype=torch.float32, device=grad_out.device)
            for start, stop, w in device_chunks(weight, bounds, grad_out.device):
                grad_x += (grad_out[:, start:stop].to(w.dtype) @ w).float()  # (N, C) @ (C, H) -> (N, H)
            grad_x = grad_x.to(ctx.x_dtype)
        return grad_x, None, None, None


def streamed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, chunk: int) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` ``(..., H)``, ``weight`` a frozen host ``(V, H)``, chunk by chunk."""
    flat = x.reshape(-1, x.shape[-1])  # (..., H) -> (N, H)
    out = StreamedLinear.apply(flat, weight, bias, chunk)  # (N, V)
    return out.view(*x.shape[:-1], weight.shape[0])  # (N, V) -> (..., V)


__all__ = ["StreamedLinear", "device_chunks", "gather_rows", "row_bounds", "streamed_linear", "to_host", "vocab_rows"]
