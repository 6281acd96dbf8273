"""fp16 wire format: gradients travel in half precision and come back to fp32.

The paper's mixed-precision training also halves the communication volume: fp32 master gradients
are cast to fp16 for the allreduce and cast back after. Any summing algorithm can be wrapped.

Range. fp16 holds magnitudes from about 6e-8 (subnormal) to 65504. Two things keep values inside:
- Overflow of the *sum*: each message is scaled by a power of two 2^k chosen from the largest
  magnitude on any rank (one MAX-allreduce of a scalar per message, so all ranks use the same k)
  such that N times that magnitude stays below 2^15. Power-of-two scaling is exact.
- Underflow: the same scale lifts small gradients up towards fp16's top range, so a message whose
  largest entry is g_max keeps entries down to about g_max * 2^-25 (fp16's 11-bit mantissa plus its
  subnormal range) instead of flushing everything below 6e-8 to zero.
With fp16 training, ``p.grad`` holds gradients multiplied by the GradScaler's loss scale when they
are communicated. The wire scale is chosen per message after that, so the two compose: the loss
scale is undone later by ``GradScaler.unscale_`` as usual. A non-finite gradient on any rank makes
the agreed maximum non-finite; the message is then sent unscaled, the sum carries the inf/NaN to
every rank, and the trainer's agreed overflow check skips the step everywhere (never a silent
clamp). The scale is computed and applied on the device: nothing waits for the GPU.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from gradientflow_repro.comm.base import CommStats, SumFn, ring_bytes

FP16_SAFE_MAX = 2.0 ** 15


def compress(tensor: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (tensor * scale).to(torch.float16)


def decompress(wire: torch.Tensor, out: torch.Tensor, scale: torch.Tensor) -> None:
    out.copy_(wire)
    out.div_(scale)


def agreed_scale(tensor: torch.Tensor, world: int, group: Optional[dist.ProcessGroup],
                 stats: CommStats) -> torch.Tensor:
    """The power of two 2^k (a one-element tensor on the tensor's device) that puts N times the
    largest magnitude on any rank just below ``FP16_SAFE_MAX``; 1 when that magnitude is zero or
    not finite. Computed on the device in float64: reading the peak on the host would make every
    message wait for the GPU."""
    peak = tensor.detach().abs().max().float().reshape(1)
    if world > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        stats.collectives += 1
        stats.bytes += ring_bytes(peak.numel() * peak.element_size(), world)
    peak = peak.double()
    usable = torch.isfinite(peak) & (peak > 0)
    scale = torch.exp2(torch.floor(torch.log2(FP16_SAFE_MAX / (world * peak.clamp_min(1e-300)))))
    scale = torch.where(world * peak * scale > FP16_SAFE_MAX, scale / 2, scale)  # log2 rounding
    scale = scale.clamp_max(2.0 ** 127)  # the largest power of two fp32 holds (subnormal peaks)
    return torch.where(usable, scale, torch.ones_like(scale)).float()


class Fp16Wire:
    """Wraps a summing function: ``Fp16Wire(inner)(tensor, stats)`` sums ``tensor`` in place over
    ranks with fp16 on the wire."""

    def __init__(self, inner: SumFn, world: int, group: Optional[dist.ProcessGroup] = None) -> None:
        self.inner, self.world, self.group = inner, world, group

    def __call__(self, tensor: torch.Tensor, stats: CommStats) -> None:
        if tensor.dtype == torch.float16 or tensor.numel() == 0:
            self.inner(tensor, stats)
            return
        scale = agreed_scale(tensor, self.world, self.group, stats)
        wire = compress(tensor, scale)
        self.inner(wire, stats)
        decompress(wire, tensor, scale)
