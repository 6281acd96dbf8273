"""Ring allreduce, built from point-to-point send/recv.

The N ranks form a ring; the tensor is cut into N chunks (sizes differ by at most one element, so
any length works). Reduce-scatter: in step s (s = 0 .. N-2) rank r sends chunk (r - s) mod N to its
right neighbour and adds the chunk (r - s - 1) mod N arriving from its left one; after N-1 steps
rank r holds the complete sum of chunk (r + 1) mod N. All-gather: N-1 more steps pass the finished
chunks around the ring. Each rank sends 2(N-1)/N of the tensor whatever N is: the bandwidth-optimal
volume, and the reason the paper (like Baidu and Horovod before it) builds on the ring.

Each chunk travels in segments (``segment_bytes``); a segment is forwarded to the next rank as soon
as it has been reduced, so reduction, receiving and sending overlap across steps (as in NCCL).
Low-precision tensors travel in their own type; each addition is done in fp32 and rounded once, as
NCCL does.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from gradientflow_repro.comm.base import CommStats, SumFn

DEFAULT_SEGMENT_BYTES = 4 << 20


def _peer(group: Optional[dist.ProcessGroup], rank_in_group: int) -> int:
    return rank_in_group if group is None else dist.get_global_rank(group, rank_in_group)


def _segments(start: int, end: int, step: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + step, end)) for lo in range(start, end, step)]


_INBOXES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _inbox(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A receive buffer kept between calls: a fresh large allocation costs page faults every time."""
    buffer = _INBOXES.get((dtype, device))
    if buffer is None or buffer.numel() < numel:
        buffer = _INBOXES[(dtype, device)] = torch.empty(numel, dtype=dtype, device=device)
    return buffer[:numel]


def ring_allreduce_(tensor: torch.Tensor, group: Optional[dist.ProcessGroup] = None,
                    segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> int:
    """Sum ``tensor`` over ``group`` in place. Returns the bytes this rank sent.

    Both phases are one pipeline of 2(N-1) steps: in step k rank r receives chunk (r - k - 1) mod N
    (added to its own in the first N-1 steps, copied in the rest) and sends chunk (r - k) mod N,
    which is exactly what it received in step k - 1. So every segment is forwarded as soon as it
    has been reduced, without waiting for the rest of its chunk: no barrier between steps."""
    world = dist.get_world_size(group)
    if world == 1 or tensor.numel() == 0:
        return 0
    if not tensor.is_contiguous():
        raise ValueError("ring_allreduce_ needs a contiguous tensor")
    rank = dist.get_rank(group)
    flat = tensor.view(-1)
    bounds = [flat.numel() * i // world for i in range(world + 1)]
    segment = max(1, segment_bytes // flat.element_size())
    right, left = _peer(group, (rank + 1) % world), _peer(group, (rank - 1) % world)
    largest = bounds[1] - bounds[0] + 1
    inboxes = _inbox(2 * largest, flat.dtype, flat.device).view(2, largest)
    steps, reducing_steps = 2 * (world - 1), world - 1

    def spans(chunk: int) -> list[tuple[int, int]]:
        return _segments(bounds[chunk], bounds[chunk + 1], segment)

    def post_receives(step: int) -> list[tuple[int, int, torch.Tensor, dist.Work]]:
        chunk = (rank - step - 1) % world
        posted = []
        for lo, hi in spans(chunk):
            # reduce steps land in an inbox (double-buffered by step); gather steps land in place
            target = (inboxes[step % 2][lo - bounds[chunk]:hi - bounds[chunk]] if step < reducing_steps
                      else flat[lo:hi])
            posted.append((lo, hi, target, dist.irecv(target, src=left, group=group, tag=step)))
        return posted

    sends = [dist.isend(flat[lo:hi], dst=right, group=group, tag=0) for lo, hi in spans(rank)]
    sent = (bounds[rank + 1] - bounds[rank]) * flat.element_size()
    receives = post_receives(0)
    for step in range(steps):
        upcoming = post_receives(step + 1) if step + 1 < steps else []
        for lo, hi, arrived, request in receives:
            request.wait()
            if step < reducing_steps:
                if flat.dtype == torch.float32:
                    flat[lo:hi].add_(arrived)
                else:
                    flat[lo:hi].copy_(flat[lo:hi].float() + arrived.float())
            if step + 1 < steps:  # forward this segment at once: it is step + 1's send
                sends.append(dist.isend(flat[lo:hi], dst=right, group=group, tag=step + 1))
                sent += (hi - lo) * flat.element_size()
        receives = upcoming
    for request in sends:
        request.wait()
    return sent


def ring_sum(group: Optional[dist.ProcessGroup] = None,
             segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> SumFn:
    """``ring_allreduce_`` as a summing function that records its bytes."""
    def sum_(tensor: torch.Tensor, stats: CommStats) -> None:
        if dist.get_world_size(group) > 1:
            stats.bytes += ring_allreduce_(tensor, group, segment_bytes)
            stats.collectives += 1
    return sum_
