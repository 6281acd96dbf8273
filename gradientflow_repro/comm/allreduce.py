"""Per-tensor allreduce after backward: the naive baseline, with any summing algorithm.

This is the data-parallel scheme the paper starts from: one message per gradient tensor (AlexNet:
16 tensors, ResNet-50: 161), no fusion and no overlap with computation, so every step pays the
per-message latency once per tensor and the whole transfer after the last gradient is ready.
With ``algorithm=builtin`` it is the ``allreduce`` strategy; with ``ring`` or ``hierarchical`` it
isolates what the algorithm alone brings.
"""

from __future__ import annotations

import time

import torch

from gradientflow_repro.comm.base import Communicator, SumFn, in_memory_order, trainable


class PerTensorAllreduce(Communicator):
    def __init__(self, device: torch.device, sum_fn: SumFn) -> None:
        super().__init__(device)
        self.sum_fn = sum_fn

    def synchronize(self) -> None:
        started = time.perf_counter()
        if self.world_size > 1:
            for param in trainable(self.model):
                if param.grad is None:  # unused this step here, maybe not elsewhere: still reduce
                    param.grad = torch.zeros_like(param)
                # the summing algorithms take one contiguous dimension: a channels_last gradient is
                # summed in its memory order, as a view; any other layout through a copy
                flat = in_memory_order(param.grad)
                message = flat if flat is not None else param.grad.contiguous().view(-1)
                self.sum_fn(message, self.stats)
                if flat is None:
                    param.grad.copy_(message.view_as(param.grad))
                param.grad.div_(self.world_size)
        self.stats.wait_s += time.perf_counter() - started
