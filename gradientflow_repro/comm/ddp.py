"""PyTorch DistributedDataParallel: the strategy users would otherwise pick.

DDP fuses gradients into ~25 MB buckets and allreduces each bucket as soon as backward fills it, so
its communication happens inside ``backward()`` and ``synchronize()`` has nothing left to wait for.
A pass-through communication hook counts the buckets and their bytes. Where the configuration sums
differently (the fp16 wire; our ring or two-level ring on gloo), DDP's buckets are summed through
``sum_hook``: over the backend's allreduce it returns the collective's future, so the buckets still
overlap with backward; our point-to-point algorithms finish inside the hook, which the factory
refuses on NCCL (``knobs.check_overlap``). The hooks themselves, which any DDP program can register
(``sum_hook``, ``csc_hook``), live in ``comm/hooks.py``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradientflow_repro.comm.base import Communicator, SumFn
from gradientflow_repro.comm.hooks import SumHookState, counting_allreduce_hook, sum_hook


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
            wrapped.register_comm_hook(self.stats, counting_allreduce_hook)
        else:  # DDP's buckets, summed by one of our algorithms
            state = SumHookState(self.sum_fn)
            state.stats = self.stats
            wrapped.register_comm_hook(state, sum_hook)
        return wrapped

    def synchronize(self) -> None:
        pass  # DDP already reduced every bucket inside backward()
