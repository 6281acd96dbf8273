"""Ring allreduce, built from point-to-point send/recv.

The N ranks form a ring; the tensor is cut into N chunks (sizes differ by at most one element, so
any length works). Reduce-scatter: in step s (s = 0 .. N-2) rank r sends chunk (r - s) mod N to its
right neighbour and adds the chunk (r - s - 1) mod N arriving from its left one; after N-1 steps
rank r holds the complete sum of chunk (r + 1) mod N. All-gather: N-1 more steps pass the finished
chunks around the ring. Each rank sends 2(N-1)/N of the tensor whatever N is: the bandwidth-optimal
volume, and the reason the paper (like Baidu and Horovod before it) builds on the ring.

Each chunk travels in segments (``segment_bytes``); a segment is forwarded to the next rank as soon
as it has been reduced, so reduction, receiving and sending overlap across steps (as in NCCL).
A ring of two ranks is an exchange with one peer: both directions of every step share one
connection (gloo: one TCP socket per pair of ranks). With segments larger than the connection keeps
in flight, gloo carried the two directions largely one after the other, so a two-rank ring with
4 MiB segments ran at about half the link's rate, where segments of 512 KiB or less matched gloo's
own allreduce (behind a shaped link; the timings and commands:
docs/notes/2026-11-30-ring-segment-sizes.md). So a two-rank ring cuts its
segments to at most ``EXCHANGE_SEGMENT_BYTES``; with three or more ranks each direction has its own
peer, and 4 MiB segments ran at the link's rate.

Low-precision tensors travel in their own type; each addition is done in fp32 and rounded once, as
NCCL does (PyTorch's kernels for fp16 and bf16 compute in fp32, on the CPU as on CUDA:
``add_`` gives bitwise what ``(a.float() + b.float()).half()`` gives, without three temporaries).

Each step's send and receive of a segment are issued together, as one ``batch_isend_irecv`` group.
That is what makes the ring safe under NCCL: there, point-to-point ops of a communicator run one
after another on one CUDA stream in the order issued, and a send may not finish before its
receiver runs the matching receive. A ring that queued the next step's receive before its own
forwarding send would wait, on every rank at once, for a send stuck behind that receive: a cycle
around the ring at any size. A group runs its send and receive together, and every rank issues the
groups in the same (step, segment) order, so each group meets its partners. (gloo has no groups and
runs the two ops one by one, which is the same thing there.)

Where it runs. This ring is the implementation on gloo (CPU tensors), where it is measured and
matches or beats gloo's own allreduce. On NCCL it runs only when asked for by name
(``comm.implementation=ours``, for comparison): there each step is a separate launch issued from
Python and serialised on the communicator's one stream (2(N-1) per message: 1,022 at 512 ranks),
and the hop between nodes leaves from one GPU through one NIC. By default on NCCL
``comm.algorithm=ring`` means NCCL's own allreduce instead (one kernel per message, channels over
every NIC, ring or tree as NCCL's tuner picks: NCCL_ALGO is never set for one strategy,
``knobs.Summing``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from gradientflow_repro.comm.base import CommStats, SumFn, scratch

DEFAULT_SEGMENT_BYTES = 4 << 20
EXCHANGE_SEGMENT_BYTES = 512 << 10  # at most this per segment in a ring of two ranks (see above)


def global_rank(group: Optional[dist.ProcessGroup], rank_in_group: int) -> int:
    """The global rank of ``group``'s rank ``rank_in_group`` (point-to-point ops take global ranks)."""
    return rank_in_group if group is None else dist.get_global_rank(group, rank_in_group)


def _pieces(start: int, end: int, count: int) -> list[tuple[int, int]]:
    """``[start, end)`` cut into ``count`` near-equal consecutive pieces (some empty if it is short)."""
    return [(start + (end - start) * i // count, start + (end - start) * (i + 1) // count)
            for i in range(count)]


def ring_allreduce_(tensor: torch.Tensor, group: Optional[dist.ProcessGroup] = None,
                    segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> int:
    """Sum ``tensor`` over ``group`` in place. Returns the bytes this rank sent.

    Both phases are one pipeline of 2(N-1) steps: in step k rank r receives chunk (r - k - 1) mod N
    (added to its own in the first N-1 steps, copied in the rest) and sends chunk (r - k) mod N,
    which is exactly what it received in step k - 1. Every chunk is cut into the same number of
    segments, so segment j of the chunk received in step k - 1 is segment j of the chunk sent in
    step k: it is forwarded, together with step k's receive of segment j, as soon as it has been
    reduced, without waiting for the rest of its chunk."""
    world = dist.get_world_size(group)
    if world == 1 or tensor.numel() == 0:
        return 0
    if not tensor.is_contiguous():
        raise ValueError("ring_allreduce_ needs a contiguous tensor")
    rank = dist.get_rank(group)
    if world == 2:  # one peer on both sides: both directions share one connection
        segment_bytes = min(segment_bytes, EXCHANGE_SEGMENT_BYTES)
    flat = tensor.view(-1)
    bounds = [flat.numel() * i // world for i in range(world + 1)]
    largest = max(hi - lo for lo, hi in zip(bounds, bounds[1:]))
    segments = -(-largest // max(1, segment_bytes // flat.element_size()))
    right, left = global_rank(group, (rank + 1) % world), global_rank(group, (rank - 1) % world)
    inboxes = scratch("ring inbox", 2 * largest, flat.dtype, flat.device).view(2, largest)
    steps, reducing_steps = 2 * (world - 1), world - 1

    def pieces(chunk: int) -> list[tuple[int, int]]:
        return _pieces(bounds[chunk], bounds[chunk + 1], segments)

    def issue(step: int, segment: int) -> tuple[list[dist.Work], int]:
        """Step ``step``'s send and receive of segment ``segment``, as one group. Returns the works
        and the bytes sent. Empty pieces are left out: their partner leaves them out too."""
        send_lo, send_hi = pieces((rank - step) % world)[segment]
        chunk = (rank - step - 1) % world
        recv_lo, recv_hi = pieces(chunk)[segment]
        # reduce steps land in an inbox (double-buffered by step); gather steps land in place
        target = (inboxes[step % 2][recv_lo - bounds[chunk]:recv_hi - bounds[chunk]]
                  if step < reducing_steps else flat[recv_lo:recv_hi])
        ops = []
        if send_hi > send_lo:
            ops.append(dist.P2POp(dist.isend, flat[send_lo:send_hi], right, group, tag=step))
        if recv_hi > recv_lo:
            ops.append(dist.P2POp(dist.irecv, target, left, group, tag=step))
        works = dist.batch_isend_irecv(ops) if ops else []
        return [work for work in works if work is not None], (send_hi - send_lo) * flat.element_size()

    sent, previous = 0, [None] * segments
    for step in range(steps):
        for segment in range(segments):
            if step > 0:  # segment j of the last step's receive: finish it, then forward it
                works = previous[segment]
                for work in works:
                    work.wait()
                if step - 1 < reducing_steps:
                    chunk = (rank - step) % world
                    lo, hi = pieces(chunk)[segment]
                    arrived = inboxes[(step - 1) % 2][lo - bounds[chunk]:hi - bounds[chunk]]
                    flat[lo:hi].add_(arrived)  # fp16/bf16: computed in fp32, rounded once
            previous[segment], nbytes = issue(step, segment)
            sent += nbytes
    for works in previous:  # the last step (all-gather: in place). Each work is waited once: a
        for work in works:  # second wait on a gloo send/recv waits for another message
            work.wait()
    return sent


def ring_sum(group: Optional[dist.ProcessGroup] = None,
             segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> SumFn:
    """``ring_allreduce_`` as a summing function that records its bytes."""
    def sum_(tensor: torch.Tensor, stats: CommStats) -> None:
        if dist.get_world_size(group) > 1:
            stats.bytes += ring_allreduce_(tensor, group, segment_bytes)
            stats.collectives += 1
    return sum_
