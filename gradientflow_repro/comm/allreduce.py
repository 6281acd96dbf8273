"""Baseline: one builtin allreduce per gradient tensor, after backward has finished.

This is the naive data-parallel scheme the paper starts from: many small messages (one per layer
tensor), no fusion and no overlap with computation, so every step pays the per-message latency once
per tensor and the whole transfer after the last gradient is ready.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from gradientflow_repro.comm.base import Communicator, register


@register("allreduce")
class PerTensorAllreduce(Communicator):
    def synchronize(self) -> None:
        started = time.perf_counter()
        if self.world_size > 1:
            for param in self.model.parameters():
                if not param.requires_grad:
                    continue
                if param.grad is None:  # unused this step here, maybe not elsewhere: still reduce
                    param.grad = torch.zeros_like(param)
                dist.all_reduce(param.grad)
                param.grad.div_(self.world_size)
                self.stats.bytes += param.grad.numel() * param.grad.element_size()
                self.stats.collectives += 1
        self.stats.wait_s += time.perf_counter() - started
