"""fp16 wire format: gradients travel in half precision and come back to fp32.

The paper's mixed-precision training also halves the communication volume: fp32 master gradients
are cast to fp16 for the allreduce and cast back after. Any summing algorithm can be wrapped: on
NCCL by default NCCL's own allreduce (``knobs.summing``), on gloo our ring and recursive doubling.
Over the backend's allreduce ``start`` returns a future (DDP hooks that overlap with backward).

Range. fp16 holds magnitudes from about 6e-8 (subnormal) to 65504. What keeps values inside:
- Overflow of the *sum*: each message is scaled by a power of two 2^k chosen from the largest
  magnitude on any rank (one MAX-allreduce of a scalar per message, a small collective: recursive
  doubling or NCCL's tree; so all ranks use the same k) such that N times that magnitude stays below
  2^15. Power-of-two scaling is exact. A caller that already knows a bound on the sum (CSC sums each
  rank's peak together with its chunk norms: the sum of the peaks bounds every partial sum) passes
  it to ``sum_bounded`` and saves that collective.
- A small message of our own recursive doubling (``SizedSum``'s small side; CPU tensors, any
  backend but NCCL) needs no agreement at all: it carries its own scale (``self_scaled_sum_``).
  Each rank sends its data scaled by the power of two of its own peak, followed by that power's
  exponent as one more fp16 value; partners decode both messages, add in fp32 (rounded once) and
  encode the sum with its own peak's scale for the next step. So the message never overflows,
  small values are lifted as below, and every rank still ends with the same bits (partners compute
  the same expression). Why not agree on a scale first, as for large messages: that is a
  collective of its own, and ranks that meet twice per message wait for each other twice; per
  message the agreement cost several times what a one-value allreduce costs alone (measured on the
  ranks of `make reproduce`: docs/notes/2026-12-04-measurements-moved-from-docstrings-library.md).
  Under NCCL small messages go by NCCL's own allreduce, which cannot rescale between its steps:
  there the scale is agreed first.
- Underflow: the same scale lifts small gradients up towards fp16's top range, so a message whose
  largest entry is g_max keeps entries down to about g_max * 2^-25 (fp16's 11-bit mantissa plus its
  subnormal range) instead of flushing everything below 6e-8 to zero.
With fp16 training, ``p.grad`` holds gradients multiplied by the GradScaler's loss scale when they
are communicated. The wire scale is chosen per message after that, so the two compose: the loss
scale is undone later by ``GradScaler.unscale_`` as usual. A non-finite gradient on any rank makes
the agreed maximum non-finite (or, self-scaled, that rank's message and every sum after it); the
message is then sent unscaled, the sum carries the inf/NaN to every rank, and the trainer's agreed
overflow check skips the step everywhere (never a silent clamp). The agreed scale is computed and
applied on the device: nothing waits for the GPU (the self-scaled messages are CPU tensors).

Local work, per element sent: the peak, scaling and casting, casting back and unscaling, each one
pass without a temporary, into and out of a wire buffer kept between calls (self-scaled: at every
step of the recursive doubling, a decode, an add and an encode). On a CPU a fresh fp32 temporary
and half-size buffer per message page-fault on every call, which made this work several times as
long as its arithmetic: hence the buffers kept between calls (measured with the calls
``scaling/profile.py`` times: docs/notes/2026-12-04-measurements-moved-from-docstrings-library.md).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from gradientflow_repro.comm.base import CommStats, SumFn, scratch
from gradientflow_repro.comm.recursive_doubling import SizedSum, recursive_doubling_allreduce_, small_sum

FP16_SAFE_MAX = 2.0 ** 15


def peak_magnitude(tensor: torch.Tensor) -> torch.Tensor:
    """The largest magnitude in ``tensor`` as a one-element fp32 tensor on its device (non-finite
    if any entry is), in one pass without an |x| temporary."""
    low, high = torch.aminmax(tensor.detach())
    return torch.maximum(high, low.neg()).float().reshape(1)


def compress(tensor: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``tensor`` times ``scale`` in fp16 (computed in fp32, rounded once), in one pass into this
    thread's wire buffer."""
    wire = scratch("fp16 wire", tensor.numel(), torch.float16, tensor.device).view(tensor.shape)
    return torch.mul(tensor, scale, out=wire)


def decompress(wire: torch.Tensor, out: torch.Tensor, scale: torch.Tensor) -> None:
    torch.div(wire, scale, out=out)


def scale_for(bound: torch.Tensor) -> torch.Tensor:
    """The largest power of two 2^k (a one-element fp32 tensor on ``bound``'s device) that keeps
    ``bound`` times it at most ``FP16_SAFE_MAX``; 1 when the bound is zero or not finite. Computed on
    the device in float64: reading the bound on the host would make every message wait for the GPU."""
    bound = bound.double().reshape(1)
    usable = torch.isfinite(bound) & (bound > 0)
    scale = torch.exp2(torch.floor(torch.log2(FP16_SAFE_MAX / bound.clamp_min(1e-300))))
    scale = torch.where(bound * scale > FP16_SAFE_MAX, scale / 2, scale)  # log2 rounding
    scale = scale.clamp_max(2.0 ** 127)  # the largest power of two fp32 holds (subnormal peaks)
    return torch.where(usable, scale, torch.ones_like(scale)).float()


def agreed_scale(tensor: torch.Tensor, world: int, max_fn: SumFn, stats: CommStats) -> torch.Tensor:
    """The power of two that puts N times the largest magnitude on any rank (agreed by ``max_fn``, a
    MAX-allreduce) just below ``FP16_SAFE_MAX``: see ``scale_for``."""
    peak = peak_magnitude(tensor)
    max_fn(peak, stats)
    return scale_for(world * peak.double())


def exponent_for(peak: float) -> int:
    """``scale_for`` on the host: the k of the largest 2^k that keeps ``peak`` times it at most
    ``FP16_SAFE_MAX`` = 2^15, at most 126 (so 2^-k, which undoes it, is a normal fp32 number and
    survives flush-to-zero); 0 when ``peak`` is zero or not finite (the message then carries its
    inf or NaN as it is). Exact, from the binary exponent (``frexp``: peak = m 2^e, m in [0.5, 1)),
    so every rank computes the same k whatever its libm."""
    if not math.isfinite(peak) or peak <= 0:
        return 0
    mantissa, exponent = math.frexp(peak)
    return min((16 if mantissa == 0.5 else 15) - exponent, 126)


def encode_self_scaled(values: torch.Tensor, message: torch.Tensor) -> None:
    """``message`` (fp16, one element longer than ``values``) = ``values`` times the power of two
    2^k that puts their own peak just below ``FP16_SAFE_MAX``, then k: a message that carries its
    own scale, so no rank needs to agree on one first. For CPU tensors only: the peak is read on
    the host (free there), since most small messages (a bias, a norm layer's weights) cost mostly
    the calls around their arithmetic, and host arithmetic on one number is the cheapest."""
    n = values.numel()
    low, high = (bound.item() for bound in torch.aminmax(values.reshape(-1)))
    k = exponent_for(max(high, -low) if math.isfinite(low) and math.isfinite(high) else math.inf)
    torch.mul(values.reshape(-1), 2.0 ** k, out=message[:n])
    message[n] = k  # an integer of magnitude below 2048 (fp64 peaks included): exact in fp16


def decode_self_scaled(message: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` (fp32) = the values ``message`` carries; exact (a power of two undone)."""
    n = message.numel() - 1
    values = out.view(-1)
    values.copy_(message[:n])
    values.mul_(2.0 ** -int(message[n].item()))


def self_scaled_combine(out: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> None:
    """Recursive doubling's reduction of two self-scaled messages into ``out`` (either of them):
    both decoded and added in fp32 (undoing a power of two is exact, so the sum is rounded once),
    then encoded with the scale of the sum's own peak. Partners compute the same expression from
    the same two messages, so they hold the same bits."""
    acc = scratch("self-scaled sum", out.numel() - 1, torch.float32, out.device)
    decode_self_scaled(first, acc)
    acc.add_(second[:-1], alpha=2.0 ** -int(second[-1].item()))
    encode_self_scaled(acc, out)


def self_scaled_sum_(tensor: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> int:
    """Sum ``tensor`` over ``group`` in place by recursive doubling, fp16 on the wire, each message
    with its own scale (``encode_self_scaled``): one collective where a shared scale takes two.
    Every rank ends with the same bits. Returns the bytes this rank sent."""
    message = scratch("self-scaled message", tensor.numel() + 1, torch.float16, tensor.device)
    encode_self_scaled(tensor, message)
    sent = recursive_doubling_allreduce_(message, group, op=self_scaled_combine)
    decode_self_scaled(message, tensor)
    return sent


class Fp16Wire:
    """Wraps a summing function: ``Fp16Wire(inner)(tensor, stats)`` sums ``tensor`` in place over
    ranks with fp16 on the wire."""

    def __init__(self, inner: SumFn, world: int, group: Optional[dist.ProcessGroup] = None,
                 at_world_1: bool = False) -> None:
        self.inner, self.world = inner, world
        # the shared scale: a one-value MAX-allreduce (sent by one rank too under ``at_world_1``: base.BuiltinSum)
        self.max_fn = small_sum(group, op="max", at_world_1=at_world_1)

    def __call__(self, tensor: torch.Tensor, stats: CommStats) -> None:
        if tensor.dtype == torch.float16 or tensor.numel() == 0:
            self.inner(tensor, stats)
        elif self._self_scaled(tensor):
            stats.bytes += self_scaled_sum_(tensor, self.inner.group)  # the sum's own ranks
            stats.collectives += 1
        else:
            self._send(tensor, agreed_scale(tensor, self.world, self.max_fn, stats), stats)

    def _self_scaled(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` goes by our recursive doubling with its scale in the message: a small
        CPU message of a size-switching sum on a backend other than NCCL (whose own allreduce
        carries small messages there, and cannot rescale between steps; a GPU tensor would make the
        host wait for the device to read each step's peak)."""
        return (isinstance(self.inner, SizedSum) and self.inner.is_small(2 * tensor.numel())
                and tensor.device.type == "cpu" and tensor.is_contiguous() and self.world > 1
                and dist.is_initialized() and dist.get_backend(self.inner.group) != "nccl")

    def sum_bounded(self, tensor: torch.Tensor, bound: torch.Tensor, stats: CommStats) -> None:
        """Sum ``tensor`` given ``bound``, a one-element tensor already agreed by every rank that no
        partial or final sum exceeds in magnitude (non-finite: send unscaled, the sum carries it)."""
        self._send(tensor, scale_for(bound), stats)

    def _send(self, tensor: torch.Tensor, scale: torch.Tensor, stats: CommStats) -> None:
        wire = compress(tensor, scale)
        self.inner(wire, stats)
        decompress(wire, tensor, scale)

    @property
    def asynchronous(self) -> bool:
        """Whether ``start`` can return before the sum is done: the inner sum is the backend's
        allreduce (``base.BuiltinSum``), not one of our point-to-point loops."""
        return bool(getattr(self.inner, "asynchronous", False))

    def start(self, tensor: torch.Tensor, stats: CommStats) -> "torch.futures.Future[torch.Tensor]":
        """Sum ``tensor`` in place as ``__call__`` does, but return once the fp16 message is issued:
        a future of ``tensor``, its decompression chained on the allreduce's future (as PyTorch's
        ``fp16_compress_hook``), for DDP hooks that overlap with backward. The shared scale's
        one-value MAX-allreduce is issued first and not waited for on the host under NCCL (its
        result stays on the device, read by the scaling kernels on the same stream); on gloo it is
        a small blocking call. The message gets a buffer of its own: several may be in flight."""
        if not self.asynchronous:
            raise TypeError("Fp16Wire.start needs the backend's allreduce inside (base.BuiltinSum)")
        if tensor.dtype == torch.float16 or tensor.numel() == 0:
            return self.inner.start(tensor, stats)
        scale = agreed_scale(tensor, self.world, self.max_fn, stats)
        wire = torch.empty(tensor.shape, dtype=torch.float16, device=tensor.device)
        torch.mul(tensor, scale, out=wire)  # as ``compress``: computed in fp32, rounded once

        def back(future: "torch.futures.Future[torch.Tensor]") -> torch.Tensor:
            decompress(future.value(), tensor, scale)
            return tensor
        return self.inner.start(wire, stats).then(back)
