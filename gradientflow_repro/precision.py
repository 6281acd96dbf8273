"""Mixed-precision policy: fp32 | bf16 | fp16.

Weights, optimizer state and communicated gradients stay fp32 (the paper's fp32 master weights);
autocast runs the forward pass in the low-precision type. fp16 needs loss scaling (torch.amp's
GradScaler); bf16 has fp32's range and does not. Whether a step's gradients are finite is decided
across ranks (one MAX-allreduce of a flag), so an overflow on any rank skips the step on every rank
and all ranks keep the same scale: ranks never diverge because one of them saw an inf.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch
import torch.distributed as dist

from gradientflow_repro.config import PrecisionConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    def __init__(self, cfg: PrecisionConfig, device: torch.device) -> None:
        self.dtype = DTYPES[cfg.dtype]
        self.device = device
        self.scaler = (torch.amp.GradScaler(device.type, init_scale=cfg.init_scale,
                                            growth_interval=cfg.growth_interval)
                       if self.dtype == torch.float16 else None)
        self.skipped_steps = 0

    def autocast(self) -> ContextManager:
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale, agree on finiteness across ranks, then step or skip everywhere. Returns whether
        the optimizer stepped."""
        if self.scaler:
            self.scaler.unscale_(optimizer)
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]
                 if p.grad is not None]
        overflow = torch.zeros(1, device=self.device)
        if grads:  # one fused norm over all gradients: non-finite iff some element is
            overflow = (~torch.isfinite(torch.nn.utils.get_total_norm(grads))).float().view(1)
        if dist.is_initialized():
            dist.all_reduce(overflow, op=dist.ReduceOp.MAX)
        if overflow.item() > 0:
            self.skipped_steps += 1
            if self.scaler:
                self.scaler.update(self.scaler.get_scale() * self.scaler.get_backoff_factor())
            optimizer.zero_grad(set_to_none=True)
            return False
        if self.scaler:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()
        return True

    @property
    def loss_scale(self) -> float:
        return self.scaler.get_scale() if self.scaler else 1.0

    def state_dict(self) -> dict:
        return {"scaler": self.scaler.state_dict() if self.scaler else None,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps = state.get("skipped_steps", 0)
