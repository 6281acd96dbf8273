"""Ring allreduce, built from point-to-point send/recv.

The N ranks form a ring; the tensor is cut into N chunks (sizes differ by at most one element, so
any length works). Reduce-scatter: in step s (s = 0 .. N-2) rank r sends chunk (r - s) mod N to its
right neighbour and adds the chunk (r - s - 1) mod N arriving from its left one; after N-1 steps
rank r holds the complete sum of chunk (r + 1) mod N. All-gather: N-1 more steps pass the finished
chunks around the ring. Each rank sends 2(N-1)/N of the tensor whatever N is: the bandwidth-optimal
volume, and the reason the paper (like Baidu and Horovod before it) builds on the ring.

Each chunk travels in segments (``segment_bytes``), all posted at once, and a received segment is
added while later ones are still arriving, so reduction overlaps transfer on large messages.
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
    """Sum ``tensor`` over ``group`` in place. Returns the bytes this rank sent."""
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
    inbox = _inbox(bounds[1] - bounds[0] + 1, flat.dtype, flat.device)
    sent = 0
    for phase in ("reduce_scatter", "all_gather"):
        for step in range(world - 1):
            shift = 0 if phase == "reduce_scatter" else 1
            out_chunk, in_chunk = (rank - step + shift) % world, (rank - step - 1 + shift) % world
            out_lo, out_hi = bounds[out_chunk], bounds[out_chunk + 1]
            in_lo, in_hi = bounds[in_chunk], bounds[in_chunk + 1]
            # all-gather receives finished chunks straight into place; reduce-scatter needs an inbox
            target = (lambda lo, hi: inbox[lo - in_lo:hi - in_lo]) if phase == "reduce_scatter" \
                else (lambda lo, hi: flat[lo:hi])
            receives = [(lo, hi, dist.irecv(target(lo, hi), src=left, group=group))
                        for lo, hi in _segments(in_lo, in_hi, segment)]
            sends = [dist.isend(flat[lo:hi], dst=right, group=group)
                     for lo, hi in _segments(out_lo, out_hi, segment)]
            for lo, hi, request in receives:
                request.wait()
                if phase == "all_gather":
                    continue
                arrived = inbox[lo - in_lo:hi - in_lo]
                if flat.dtype == torch.float32:
                    flat[lo:hi].add_(arrived)
                else:
                    flat[lo:hi].copy_(flat[lo:hi].float() + arrived.float())
            for request in sends:
                request.wait()
            sent += (out_hi - out_lo) * flat.element_size()
    return sent


def ring_sum(group: Optional[dist.ProcessGroup] = None,
             segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> SumFn:
    """``ring_allreduce_`` as a summing function that records its bytes."""
    def sum_(tensor: torch.Tensor, stats: CommStats) -> None:
        if dist.get_world_size(group) > 1:
            stats.bytes += ring_allreduce_(tensor, group, segment_bytes)
            stats.collectives += 1
    return sum_
