"""LARS's trust ratio under momentum correction: the rescaling, and its correction for noise.

Under momentum correction each rank applies LARS's step before the momentum to its *own* gradient
(``momentum.LocalStep``): ``g <- trust |w| / (|g| + wd |w|) * (g + wd w)`` (``lars_rescale_``). Dense
LARS takes |g| of the mean gradient; a rank's own |g_i| is larger by the noise of its smaller batch,
so its steps would be that much shorter than dense LARS's. ``TrustNoise`` estimates that factor
from random-sign sketches that ride with the chunk norms (no collective of its own) and divides it
out. Ours, not the paper's (``comm.trust_noise_correction``; docs/notes/2026-12-01-csc-under-lars.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Union

import torch
from torch import nn

from gradientflow_repro.comm.knobs import TRUST_SKETCH_BUCKETS
from gradientflow_repro.comm.lazy import Bucket

if TYPE_CHECKING:
    from gradientflow_repro.comm.csc.state import BucketState


def adapts(group: dict) -> bool:
    """Whether timm's ``Lars`` rescales this parameter group (it does with weight decay or
    ``always_adapt``; BatchNorm and bias groups have neither). SGD's groups never."""
    return "trust_coeff" in group and (group.get("weight_decay", 0.0) != 0 or bool(group.get("always_adapt", False)))


NOISE_KEEP = 0.9  # the noise factor's running means span about 10 steps
SKETCH_SEED = 0x5EED  # the sketch's signs: the same on every rank
SIGN_SHIFTS = 1009  # step s takes the signs from element s mod 1009 on: a new sketch each step


def sketch_into(out: torch.Tensor, gradient: torch.Tensor, signs: torch.Tensor, buffer: torch.Tensor) -> None:
    """``out[b]`` = the sum of ``signs[j] * gradient[j]`` over the elements j with j mod len(out) = b
    (``signs``: +-1, at least as long as ``gradient``; ``buffer``: as long, free to overwrite)."""
    n, k = gradient.numel(), out.numel()
    signed = buffer[:n]
    torch.mul(gradient, signs[:n], out=signed)
    whole = n - n % k
    torch.sum(signed[:whole].view(-1, k), 0, dtype=out.dtype, out=out)
    if whole < n:
        out[:n - whole].add_(signed[whole:])


def sketch_signs(elements: int, device: torch.device) -> torch.Tensor:
    """``elements`` random signs (+-1, int8: one byte per element), the same on every rank."""
    signs = torch.randint(0, 2, (elements,), generator=torch.Generator().manual_seed(SKETCH_SEED), dtype=torch.int8)
    return signs.mul_(2).sub_(1).to(device)


class TrustNoise:
    """Each rank's LARS trust ratio, corrected for the noise of its own gradient (ours, not the paper's).

    Under momentum correction each rank rescales its own gradient g_i by LARS's ratio
    ``trust |w| / (|g| + wd |w|)`` before the sum (``LocalStep``). Dense LARS takes |g| of the mean
    gradient; a rank's own |g_i| is larger by the noise of its smaller batch, by a factor c with
    c^2 = mean_i |g_i|^2 / |mean_i g_i|^2: up to sqrt(N) where noise dominates (on the digits recipe
    at 4 ranks c is 1.5-2.0 per layer), so every sparse step was that much shorter than dense LARS's,
    a shortfall that grows with the world size. The mean is known only after the sum, and a third
    collective per part is ruled out, so c is estimated from the steps before and each rank divides
    its own |g_i| by it:
    - each rank sketches each adapted layer's raw gradient: a fixed random sign per element (the
      same on every rank), element j summed into bucket j mod 64. A sketch is linear, so the sum of
      the ranks' sketches is the sketch of their sum; the squared norm of a sketch estimates the
      squared norm of what it sketches, to about sqrt(2/64) = 18% per step. Each step shifts the
      signs by one element (the same shift on every rank), so the error changes from step to step
      even where the mean gradient does not;
    - each layer's sketch and the rank's own sketched squared norm ride in the chunk norms' small
      message (``BucketState.sparsify``'s ``extra``): 65 floats per layer, no collective of its own;
    - c^2 = (running mean of the ranks' own sketched squared norms) / (running mean of the squared
      sketch of their mean), over about 10 steps (``NOISE_KEEP``): the ratio changes slowly, so
      averaging costs little and halves the sketch's error. Both sides come from the same sketch,
      so when the ranks' gradients agree c is 1 and this is dense LARS (the lockstep test). c is
      kept within [1, sqrt(N)].
    With nothing observed yet (the first sparse step) c is 1: each rank's own ratio. The running
    means are part of the pool part's ``BucketState`` (staged, committed, checkpointed); the shift,
    ``step``, is saved with the communicator's state. Memory: one byte of sign per element of the
    largest layer; the signed gradient is written into the part's spare residual, free until
    ``sparsify``."""

    def __init__(self, entries: list[list[tuple[nn.Parameter, int, int]]], groups: list[dict],
                 buckets: list[Bucket], world: int) -> None:
        self.world = world
        # per bucket: (entry index, sketch buckets) of each layer Lars adapts in the sparse section
        self.layers = [[(index, min(TRUST_SKETCH_BUCKETS, param.numel()))
                        for index, (param, offset, group) in enumerate(found)
                        if adapts(groups[group]) and offset + param.numel() <= bucket.sparse_elements]
                       for found, bucket in zip(entries, buckets)]
        self.entries = entries
        device = buckets[0].flat.device if buckets else torch.device("cpu")
        self.layer_of = [torch.tensor([layer for layer, (_, k) in enumerate(layers) for _ in range(k)],
                                      dtype=torch.long, device=device) for layers in self.layers]
        longest = max((entries[b][index][0].numel() for b, layers in enumerate(self.layers)
                       for index, _ in layers), default=0)
        self.signs = sketch_signs(longest + SIGN_SHIFTS, device)  # each layer is sketched alone: all
        # layers may use the same signs
        self.step = 0  # steps applied (the same on every rank): the signs' shift

    def layers_in(self, bucket_index: int) -> int:
        return len(self.layers[bucket_index])

    def sketch(self, bucket: Bucket, gradient: torch.Tensor, state: BucketState) -> Optional[torch.Tensor]:
        """This rank's part of the noise message for ``bucket`` (``gradient`` laid out like
        ``bucket.flat``; ``state``: the bucket's, whose spare residual is used as a buffer): each
        layer's sketched squared norm, then each layer's sketch; None for a bucket without layers."""
        layers = self.layers[bucket.index]
        if not layers:
            return None
        out = torch.zeros(len(layers) + self.layer_of[bucket.index].numel(), dtype=torch.float32,
                          device=gradient.device)
        at, signs, buffer = len(layers), self.signs[self.step % SIGN_SHIFTS:], state.scratch.view(-1)
        for index, k in layers:
            param, offset, _ = self.entries[bucket.index][index]
            sketch_into(out[at:at + k], gradient[offset:offset + param.numel()], signs, buffer)
            at += k
        self._squared_norms(bucket, out[len(layers):], into=out[:len(layers)])
        return out

    def _squared_norms(self, bucket: Bucket, sketches: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
        """Adds each layer's squared sketch norm to ``into`` (one value per layer); returns it."""
        return into.index_add_(0, self.layer_of[bucket.index], sketches.square())

    def observe(self, bucket: Bucket, state: BucketState, summed: torch.Tensor) -> None:
        """Stage the running means in ``state`` from ``summed``: the ranks' ``sketch`` summed."""
        layers = len(self.layers[bucket.index])
        mean_squared = self._squared_norms(bucket, summed[layers:],
                                           into=torch.zeros(layers, dtype=torch.float32, device=summed.device))
        state.stage_noise(torch.stack([summed[:layers] / self.world, mean_squared / self.world**2]), NOISE_KEEP)

    def factor_vector(self, state: BucketState) -> torch.Tensor:
        """c for each of a bucket's layers (in ``layers`` order, on the device), from the committed
        running means of its ``state``; 1 where nothing is observed yet."""
        own, mean = state.noise
        return torch.where(mean > 0, own / mean, 1.0).clamp_(1.0, float(self.world)).sqrt_()

    def factors(self, bucket: Bucket, state: BucketState) -> dict[int, torch.Tensor]:
        """Entry index -> c (0-d, on the device) for each of ``bucket``'s layers (``factor_vector``)."""
        return {index: c for (index, _), c in zip(self.layers[bucket.index], self.factor_vector(state).unbind())}


def trust_ratios(weight_norms: torch.Tensor, gradient_norms: torch.Tensor, trust: Union[float, torch.Tensor],
                 decay: Union[float, torch.Tensor], eps: Union[float, torch.Tensor],
                 noise: Union[float, torch.Tensor] = 1.0) -> torch.Tensor:
    """timm ``Lars``'s trust ratio, elementwise over layers (or for one): ``trust |w| / (|g| / c + wd |w|
    + eps)``, 1 where ``|w|`` or ``|g|`` is 0 (``timm.optim.lars._lars_trust_ratio``, private there;
    ``noise`` c divides ``|g|``: ``TrustNoise``). The one definition of the ratio: ``lars_rescale_``
    applies it layer by layer, ``momentum.LocalStep`` to all of a pool part's layers at once."""
    scaled = gradient_norms if isinstance(noise, float) and noise == 1.0 else gradient_norms / noise
    ratio = trust * weight_norms / (scaled + weight_norms * decay + eps)
    return torch.where(torch.minimum(weight_norms, gradient_norms) > 0, ratio, 1.0)


def lars_rescale_(gradients: list[torch.Tensor], weights: list[torch.Tensor], groups: list[dict],
                  noise: Optional[list[Union[float, torch.Tensor]]] = None,
                  decay_into: Optional[list[torch.Tensor]] = None) -> list[torch.Tensor]:
    """``g <- ratio * (g + wd w)`` in place for each gradient, with its group's ``weight_decay``,
    ``trust_coeff`` and ``eps``: timm ``Lars``'s step before its momentum, with its ratio
    (``timm.optim.lars._lars_trust_ratio``, private there): ``trust |w| / (|g| + wd |w| + eps)``,
    1 where ``|w|`` or ``|g|`` is 0. ``noise``: per gradient, the factor c that ``|g|`` is divided
    by (``TrustNoise``); 1 without. ``decay_into`` (one tensor per gradient, like it): the rescaled
    weight decay ``ratio * wd w`` is written there and the gradient becomes ``ratio * g`` only
    (``comm.weight_decay_in=local``). Returns the ratios (0-d tensors, one per gradient)."""
    weight_norms, gradient_norms = torch._foreach_norm(weights), torch._foreach_norm(gradients)
    ratios = []
    for index, (gradient, weight, w_norm, g_norm, group, c) in enumerate(
            zip(gradients, weights, weight_norms, gradient_norms, groups, noise or [1.0] * len(gradients))):
        decay = group["weight_decay"]
        ratio = trust_ratios(w_norm, g_norm, group["trust_coeff"], decay, group["eps"], c)
        if decay_into is None:
            gradient.add_(weight, alpha=decay).mul_(ratio)
        else:
            gradient.mul_(ratio)
            torch.mul(weight, ratio * decay, out=decay_into[index])
        ratios.append(ratio)
    return ratios
