"""Small collectives of the trainer's decisions: a few numbers reduced in one message, a flag every
rank agrees on, the ranks whose tensors differ, and a barrier that names its device."""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from gradientflow_repro.comm.base import CommStats
from gradientflow_repro.comm.recursive_doubling import small_sum


def all_reduce_scalars(values: Sequence[torch.Tensor | float], device: torch.device,
                       op: str = "sum") -> list[float]:
    """Reduce a few numbers across ranks in one collective, read back once. A value may be a
    one-element tensor on the device (a count summed there without reading it back). A small
    message: recursive doubling on gloo (log2(N) latencies), NCCL's own allreduce (its trees), as
    ``recursive_doubling.small_sum`` sends it."""
    tensor = torch.stack([value.reshape(()).double() if isinstance(value, torch.Tensor)
                          else torch.full((), float(value), dtype=torch.float64, device=device)
                          for value in values])
    if op == "min":  # (recursive doubling knows sum and max)
        if dist.is_initialized():
            dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    else:
        small_sum(op=op)(tensor, CommStats())
    return tensor.tolist()


def agree_max(flags: Sequence[torch.Tensor | float], device: torch.device) -> list[float]:
    """Collective: the largest value of each flag over all ranks, in one MAX-allreduce, read back
    to the host once. Every rank gets the same answer, so every rank takes the same decision.
    Python numbers become device tensors by a fill, not a copy from the host (which would wait)."""
    return all_reduce_scalars(flags, device, op="max")


def ranks_that_differ(tensors: Iterable[torch.Tensor], device: torch.device) -> list[int]:
    """Collective: ranks whose tensors' checksum (float64 sum and sum of squares) differs from
    rank 0's. Identical tensors give identical sums; a changed element changes them. One
    collective and one read-back whatever the world size: each rank writes its checksum into its
    own row of a [world, 2] table of zeros, a SUM-allreduce fills the table (adding zeros is exact),
    and the rows are compared with rank 0's on the device."""
    checksum = torch.zeros(2, dtype=torch.float64, device=device)
    for tensor in tensors:
        values = tensor.detach().double()
        checksum[0] += values.sum()
        checksum[1] += values.square().sum()
    if not dist.is_initialized():
        return []
    table = torch.zeros(dist.get_world_size(), 2, dtype=torch.float64, device=device)
    table[dist.get_rank()] = checksum
    dist.all_reduce(table)
    return (table != table[0]).any(1).nonzero().flatten().tolist()



def barrier(device: torch.device) -> None:
    if dist.is_initialized():
        # An all_reduce rather than dist.barrier(): NCCL barriers guess the device, this does not.
        all_reduce_scalars([0.0], device)
