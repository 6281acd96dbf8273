"""PyTorch DistributedDataParallel: the strategy users would otherwise pick.

DDP fuses gradients into ~25 MB buckets and allreduces each bucket as soon as backward fills it, so
its communication happens inside ``backward()`` and ``synchronize()`` has nothing left to wait for.
A pass-through communication hook counts the buckets and their bytes. With ``comm.algorithm`` or
``comm.wire`` set, DDP's buckets are summed by this project's ring / hierarchical / fp16 wire
through ``sum_hook``, which any DDP program can register too. (No postponed annotations in
this file: DDP checks the hook's annotations at run time.)
"""

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from gradientflow_repro.comm.base import CommStats, Communicator, SumFn, ring_bytes


def _counting_allreduce_hook(stats: CommStats, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    stats.bytes += ring_bytes(buffer.numel() * buffer.element_size(), dist.get_world_size())
    stats.collectives += 1
    return default_hooks.allreduce_hook(None, bucket)


class SumHookState:
    """State of ``sum_hook``: the summing function (ring, hierarchical, fp16-wrapped ...) and its counts."""

    def __init__(self, sum_fn: SumFn) -> None:
        self.sum_fn, self.stats = sum_fn, CommStats()


def sum_hook(state: SumHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook that averages each bucket with one of this project's algorithms,
    so any DDP program can use them::

        ddp_model.register_comm_hook(SumHookState(ring_sum()), sum_hook)

    It runs synchronously inside backward (DDP's own overlap comes from its bucketing order)."""
    buffer = bucket.buffer()
    state.sum_fn(buffer, state.stats)
    buffer.div_(dist.get_world_size())
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


class DDPCommunicator(Communicator):
    def __init__(self, device: torch.device, bucket_mb: float = 25.0,
                 sum_fn: Optional[SumFn] = None) -> None:
        super().__init__(device)
        self.bucket_mb, self.sum_fn = bucket_mb, sum_fn

    def attach(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> nn.Module:
        self.model, self.optimizer = model, optimizer
        if self.world_size == 1:
            return model
        wrapped = DistributedDataParallel(
            model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
            bucket_cap_mb=self.bucket_mb)
        if self.sum_fn is None:
            wrapped.register_comm_hook(self.stats, _counting_allreduce_hook)
        else:  # DDP's buckets, summed by one of our algorithms
            state = SumHookState(self.sum_fn)
            state.stats = self.stats
            wrapped.register_comm_hook(state, sum_hook)
        return wrapped

    def synchronize(self) -> None:
        pass  # DDP already reduced every bucket inside backward()
