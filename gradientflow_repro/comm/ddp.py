"""PyTorch DistributedDataParallel: the strategy users would otherwise pick.

DDP fuses gradients into ~25 MB buckets and allreduces each bucket as soon as backward fills it, so
its communication happens inside ``backward()`` and ``synchronize()`` has nothing left to wait for.
A pass-through communication hook counts the buckets and their bytes. (No postponed annotations in
this file: DDP checks the hook's annotations at run time.)
"""

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from gradientflow_repro.comm.base import CommStats, Communicator, ring_bytes


def _counting_allreduce_hook(stats: CommStats, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    stats.bytes += ring_bytes(buffer.numel() * buffer.element_size(), dist.get_world_size())
    stats.collectives += 1
    return default_hooks.allreduce_hook(None, bucket)


class DDPCommunicator(Communicator):
    def __init__(self, device: torch.device, bucket_mb: float = 25.0) -> None:
        super().__init__(device)
        self.bucket_mb = bucket_mb

    def attach(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> nn.Module:
        self.model, self.optimizer = model, optimizer
        if self.world_size == 1:
            return model
        wrapped = DistributedDataParallel(
            model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
            bucket_cap_mb=self.bucket_mb)
        wrapped.register_comm_hook(self.stats, _counting_allreduce_hook)
        return wrapped

    def synchronize(self) -> None:
        pass  # DDP already reduced every bucket inside backward()
