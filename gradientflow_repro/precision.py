"""Mixed-precision policy: fp32 | bf16 | fp16.

Weights, optimizer state and communicated gradients stay fp32 (the paper's fp32 master weights);
autocast runs the forward pass in the low-precision type. fp16 needs loss scaling (torch.amp's
GradScaler); bf16 has fp32's range and does not. Whether a step's gradients are finite is decided
across ranks (one MAX-allreduce of a flag), so an overflow on any rank skips the step on every rank
and all ranks keep the same scale: ranks never diverge because one of them saw an inf.

On a GPU the step reads one value back to the host: that agreed flag (the trainer folds its other
per-step agreement, the stop signal, into the same collective). The loss scale stays on the device
(``loss_scale_tensor``) and the optimizer is stepped directly once the step is known to be finite,
since ``GradScaler.step`` would read its own inf flag back a second time.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, ContextManager, Optional

import torch

from gradientflow_repro.distributed import agree_max

if TYPE_CHECKING:  # only the type: ``config`` imports Hydra, and this module must import without it
    from gradientflow_repro.config import PrecisionConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes bf16 at least as fast as fp32. A CPU does only with AVX-512 BF16
    or AMX: elsewhere oneDNN emulates it, and bf16 autocast is many times slower than fp32, not
    faster (measured on an AVX2-only CPU, see
    docs/notes/2026-12-04-measurements-moved-from-docstrings-library.md). GPUs are taken to have it."""
    if device.type != "cpu":
        return True
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN's probe: cannot tell, assume it does
        return True


class Precision:
    def __init__(self, cfg: PrecisionConfig, device: torch.device) -> None:
        self.dtype = DTYPES[cfg.dtype]
        self.device = device
        self.scaler = (torch.amp.GradScaler(device.type, init_scale=cfg.init_scale,
                                            growth_interval=cfg.growth_interval)
                       if self.dtype == torch.float16 else None)
        self.skipped_steps = 0
        # bf16 autocast on a CPU that emulates it: asked for, so done, but the trainer says what it costs
        self.emulated_bf16 = self.dtype == torch.bfloat16 and not native_bf16(device)

    def autocast(self) -> ContextManager:
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale, agree on finiteness across ranks, then step or skip everywhere. Returns whether
        the optimizer stepped."""
        overflow, = agree_max([self.nonfinite(optimizer)], self.device)
        return self.apply(optimizer, overflow > 0)

    def nonfinite(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """Unscale the gradients; 1.0 (on the device) if any of this rank's is inf or NaN, else 0.
        Under loss scaling that is what ``unscale_`` found while it unscaled (its inf flags): the
        gradients are not read a second time."""
        if self.scaler:
            self.scaler.unscale_(optimizer)
            flags = self._inf_flags(optimizer)
            if flags:  # one device per rank: one flag
                found = next(iter(flags.values())) if len(flags) == 1 else sum(flags.values())
                return (found > 0).float()
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]
                 if p.grad is not None]
        if not grads:
            return torch.zeros((), device=self.device)
        # one fused norm over all gradients: non-finite iff some element is
        return (~torch.isfinite(torch.nn.utils.get_total_norm(grads))).float()

    def apply(self, optimizer: torch.optim.Optimizer, overflow: bool) -> bool:
        """Step, or skip when any rank overflowed (``overflow`` is agreed); update the loss scale."""
        if overflow:
            self.skipped_steps += 1
            if self.scaler:
                self._back_off(optimizer)
            optimizer.zero_grad(set_to_none=True)
            return False
        optimizer.step()  # finite on every rank, so on this one too: nothing for GradScaler to skip
        if self.scaler:
            self.scaler.update()  # from the inf flags unscale_ left on the device
        return True

    def _back_off(self, optimizer: torch.optim.Optimizer) -> None:
        """Another rank's inf counts as this rank's: GradScaler does exactly what it does after an
        overflow of its own (halve the scale, restart the count towards growing it), on the device.
        Its per-optimizer inf flags are not public; where they are not as expected, the scale is
        set directly (the growth count then goes on, and reading the scale waits for the device)."""
        flags = self._inf_flags(optimizer)
        if flags:
            for flag in flags.values():
                flag.fill_(1.0)
            self.scaler.update()
        else:
            self.scaler.update(self.scaler.get_scale() * self.scaler.get_backoff_factor())

    def _inf_flags(self, optimizer: torch.optim.Optimizer) -> dict:
        """GradScaler's inf flags for ``optimizer`` from its last ``unscale_`` (device -> a tensor on
        it, 1.0 where an inf or NaN was found); empty where its private state is not as expected
        (the callers then do without: a norm of the gradients, a direct scale update)."""
        states = getattr(self.scaler, "_per_optimizer_states", {}).get(id(optimizer), {})
        flags = states.get("found_inf_per_device", {})
        return flags if isinstance(flags, dict) else {}

    @property
    def loss_scale(self) -> float:
        """The loss scale as a number (reads it from the device: for logging, not every step)."""
        return self.scaler.get_scale() if self.scaler else 1.0

    def loss_scale_tensor(self) -> Optional[torch.Tensor]:
        """The loss scale as GradScaler keeps it, on the device (None without loss scaling)."""
        if not self.scaler:
            return None
        scale = self.scaler._get_scale_async()
        if scale is None:  # GradScaler makes it at its first scale(): make it now
            self.scaler.scale(torch.zeros((), device=self.device))
            scale = self.scaler._get_scale_async()
        return scale

    def state_dict(self) -> dict:
        return {"scaler": self.scaler.state_dict() if self.scaler else None,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps = state.get("skipped_steps", 0)
