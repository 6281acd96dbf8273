"""Allreduce of small messages by recursive doubling, built from point-to-point send/recv.

With N a power of two: in step k (k = 0 .. log2(N)-1) rank r exchanges its whole current buffer
with rank r XOR 2^k and both reduce the two buffers into their own. After step k every block of
2^(k+1) consecutive ranks holds the reduction of that block, so after log2(N) steps every rank
holds the full result. Each step carries the whole message, so a rank sends log2(N) times the
tensor, against the ring's 2(N-1)/N: recursive doubling loses on bandwidth. But it pays only
log2(N) latencies where the ring pays 2(N-1) (N-1 reduce-scatter and N-1 all-gather steps, each
waiting for a message that must arrive before it can be forwarded). For small messages the
latency is the whole cost, so there it wins (3 steps instead of 14 at N = 8); the ring wins once
the message is large enough for bandwidth to dominate. ``SMALL_MESSAGE_BYTES`` is where that
happens on our machine; ``SizedSum`` picks between the two by message size.

N not a power of two, the MPICH way: with p the largest power of two <= N and rem = N - p, the
first 2*rem ranks pair up (0,1), (2,3), ...; the even rank of each pair sends its data to the odd
one and sits out. The odd ranks and the ranks from 2*rem up, p in all, do recursive doubling among
themselves (renumbered 0 .. p-1), then each odd rank hands the result back to its even partner.
That costs two extra latencies and one extra message, instead of a protocol for odd counts.

Every rank ends with bitwise the same result: partners compute the same expression from the same
two buffers, the lower rank's data first (IEEE addition of two numbers is commutative anyway; the
fixed order also fixes which NaN survives a max), so after step k the ranks of a block hold
identical data, and the ranks that sat out copy the final result. Low-precision tensors travel in
their own type, and each addition is done in fp32 and rounded once, as in the ring (``ring.py``).

Each exchange is one ``batch_isend_irecv`` group holding both the send and the receive, issued by
both partners alike; the hand-over of the fold and of the unfold are groups of one op. Under NCCL,
point-to-point ops of a communicator run in issue order on one stream and a send may not finish
before its receiver runs the matching receive: a blocking send issued ahead of the receive would
deadlock there. (Under NCCL ``small_sum`` uses NCCL's own allreduce by default, which switches to
trees for small messages by itself, as every message does by default there: ``knobs.summing``; with
``comm.implementation=ours`` our algorithms' small messages come here on NCCL too, for comparison,
and the groups keep them correct there.)
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
import torch.distributed as dist

from gradientflow_repro.comm.base import CommStats, SumFn, ring_bytes, scratch
from gradientflow_repro.comm.knobs import SMALL_MESSAGE_BYTES  # the measured switch-over (torch-free there)
from gradientflow_repro.comm.ring import global_rank

OPS = ("sum", "max")
# ``combine(out, first, second)``: writes the reduction of two messages into ``out`` (which may be
# either of them), the same expression on both partners (``compression.self_scaled_combine``)
Combine = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


def _reduce_into(flat: torch.Tensor, first: torch.Tensor, second: torch.Tensor, op: Union[str, Combine]) -> None:
    """``flat = first (op) second``, in this argument order on both partners: the same expression,
    so the same bits. Sums of fp16/bf16 are done in fp32 and rounded once (PyTorch's kernels)."""
    if callable(op):
        op(flat, first, second)
    elif op == "max":
        torch.maximum(first, second, out=flat)
    else:
        torch.add(first, second, out=flat)


def recursive_doubling_allreduce_(tensor: torch.Tensor, group: Optional[dist.ProcessGroup] = None,
                                  op: Union[str, Combine] = "sum") -> int:
    """Reduce ``tensor`` over ``group`` (None: the world) in place with ``op`` ("sum", "max", or a
    ``Combine`` of two whole messages, such as the fp16 wire's self-scaled sum). Returns the bytes
    this rank sent: log2(p) times the tensor for the p ranks that double, plus one tensor more for
    those that fold (see the module docstring)."""
    if not callable(op) and op not in OPS:
        raise ValueError(f"recursive_doubling_allreduce_: op must be one of {OPS}, not {op!r}")
    if not tensor.is_contiguous():
        raise ValueError("recursive_doubling_allreduce_ needs a contiguous tensor")
    world = dist.get_world_size(group)
    if world == 1 or tensor.numel() == 0:
        return 0
    rank = dist.get_rank(group)
    flat = tensor.view(-1)
    nbytes = flat.numel() * flat.element_size()
    inbox = scratch("recursive-doubling inbox", flat.numel(), flat.dtype, flat.device)
    p = 1 << (world.bit_length() - 1)
    rem = world - p

    def exchange(partner: int, send: bool, receive: bool, tag: int) -> None:
        """One group: send ``flat`` to and/or receive into ``inbox`` from group rank ``partner``.
        Every work is waited exactly once (a second wait on a gloo send/recv waits for another
        message), and both before ``flat`` changes: the send reads it until it is done."""
        ops = []
        if send:
            ops.append(dist.P2POp(dist.isend, flat, global_rank(group, partner), group, tag=tag))
        if receive:
            ops.append(dist.P2POp(dist.irecv, inbox, global_rank(group, partner), group, tag=tag))
        for work in dist.batch_isend_irecv(ops):
            if work is not None:
                work.wait()

    sent = 0
    if rank < 2 * rem and rank % 2 == 0:  # folded: hand the data to the odd partner, wait for the result
        exchange(rank + 1, send=True, receive=False, tag=0)
        exchange(rank + 1, send=False, receive=True, tag=1)
        flat.copy_(inbox)
        return nbytes
    if rank < 2 * rem:  # odd of a pair: take in the even partner's data (the lower rank's, so first)
        exchange(rank - 1, send=False, receive=True, tag=0)
        _reduce_into(flat, inbox, flat, op)
    new_rank = rank // 2 if rank < 2 * rem else rank - rem
    mask, step = 1, 0
    while mask < p:
        new_partner = new_rank ^ mask
        partner = 2 * new_partner + 1 if new_partner < rem else new_partner + rem
        exchange(partner, send=True, receive=True, tag=2 + step)
        sent += nbytes
        if partner < rank:
            _reduce_into(flat, inbox, flat, op)
        else:
            _reduce_into(flat, flat, inbox, op)
        mask, step = mask << 1, step + 1
    if rank < 2 * rem:  # hand the result back to the even partner
        exchange(rank - 1, send=True, receive=False, tag=1)
        sent += nbytes
    return sent


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def small_sum(group: Optional[dist.ProcessGroup] = None, op: str = "sum", ours: bool = False,
              at_world_1: bool = False) -> SumFn:
    """An allreduce for small messages as a summing function that records its bytes: NCCL's own
    allreduce on an NCCL group (it picks trees for small messages itself; bytes counted as the
    ring's, like every builtin collective) unless ``ours`` (``comm.implementation=ours``: our
    recursive doubling over NCCL's point-to-point, for comparison), recursive doubling on any other
    backend (gloo) for CPU tensors. Gloo's point-to-point messages cannot carry CUDA tensors (its
    allreduce stages them through the host itself), so a CUDA tensor on a group other than NCCL's
    takes the builtin too. ``at_world_1``: one rank sends too, by the backend's allreduce (the GPU
    check: ``base.BuiltinSum``); otherwise it sends nothing."""
    if op not in OPS:
        raise ValueError(f"small_sum: op must be one of {OPS}, not {op!r}")

    def sum_(tensor: torch.Tensor, stats: CommStats) -> None:
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        if world == 1 and not (at_world_1 and dist.is_initialized()):
            return
        nccl = dist.get_backend(group) == "nccl"
        if (nccl and not ours) or (tensor.is_cuda and not nccl) or world == 1:
            dist.all_reduce(tensor, op=_REDUCE_OPS[op], group=group)
            stats.bytes += ring_bytes(tensor.numel() * tensor.element_size(), world)
        else:
            stats.bytes += recursive_doubling_allreduce_(tensor, group, op)
        stats.collectives += 1
    return sum_


class SizedSum:
    """A summing function that sends messages of at most ``threshold_bytes`` by ``small_sum(group,
    ours=ours)`` and larger ones by ``large`` (e.g. ``ring_sum(group)``): each message by the algorithm
    that is faster at its size. ``large`` stays visible (which algorithm carries the big messages)."""

    def __init__(self, large: SumFn, group: Optional[dist.ProcessGroup] = None,
                 threshold_bytes: int = SMALL_MESSAGE_BYTES, ours: bool = False) -> None:
        self.large, self.small = large, small_sum(group, ours=ours)
        self.threshold_bytes, self.group = threshold_bytes, group

    def is_small(self, nbytes: int) -> bool:
        """Whether a message of ``nbytes`` goes by ``small_sum``."""
        return nbytes <= self.threshold_bytes

    def __call__(self, tensor: torch.Tensor, stats: CommStats) -> None:
        fn = self.small if self.is_small(tensor.numel() * tensor.element_size()) else self.large
        fn(tensor, stats)


