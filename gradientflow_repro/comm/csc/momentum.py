"""Momentum correction and momentum factor masking (Deep Gradient Compression, Lin et al. 2018).

Sparsifying the gradient and then applying momentum to what arrives loses the momentum of the
chunks held back. So while CSC sends sparsely:
1. each rank accumulates momentum *before* sparsification, in a local velocity u <- m u + g
   (``BucketState.add_momentum``), and its sum v <- v + u (the residual) is what gets chunked and
   sent; the dense tail sends its u;
2. sent chunks of v are cleared and, with momentum factor masking (``comm.momentum_masking``), so
   are those of u (``BucketState.sparsify``'s ``mask_after``), so the stale momentum of a chunk
   just sent does not push it on (DGC's remedy for the staleness of delayed updates). DGC sent an
   element every 600 to 1,000 steps, where masking erases ~1% of the momentum's gain; a chunk sent
   every k steps keeps only 1 - m(1 - m^k) / ((1 - m) k) of it (0.41 at k = 10, m = 0.9).
   ``comm.masking_min_wait`` masks only the chunks that waited longer than it (0: every sent chunk,
   DGC's rule); what masking erased is in every progress record (``SendLog``);
3. the optimizer's own momentum is set to 0 so momentum is not applied twice (``TAKEN``,
   ``take_settings``); it is given back during dense phases (``give_back``), when its momentum
   restarts from the mean gradient (the velocities are per rank);
4. at the switch to sparse each rank's velocity starts from the optimizer's momentum buffer
   (``velocity_from_optimizer``), so the dense warm-up's momentum carries on instead of restarting
   from zero.

Under LARS (``LocalStep``). LARS rescales each layer's gradient, with weight decay, to
``trust * |w| / (|g| + wd |w|)`` *before* it enters the momentum, so a consistent gradient direction
builds up steps of up to 1/(1 - m) = 10 times that size. DGC's correction moves the momentum before
the sum over ranks; had LARS stayed in the optimizer it would rescale the accumulated velocity to
one step's size, and the momentum's gain would be lost: sparse training ran at a fraction of its
learning rate and took several times the epochs of dense training on the digits recipe
(docs/notes/2026-12-01-csc-under-lars.md). So what the optimizer does to a gradient before its momentum
moves with the momentum: each rank adds the weight decay to its own gradient and, for the layers
Lars adapts, rescales it by the trust ratio (``trust.trust_ratios``), before ``u <- m u + g``; the
optimizer's groups run as plain SGD (momentum, weight decay and adaptation handed to CSC). Where the
weight decay goes is a choice (``comm.weight_decay_in``): into the velocity that is sparsified and
sent ("velocity", as PaddlePaddle's DGC kernel does), or into a velocity of its own on each rank,
d <- m d + wd w (rescaled by the same trust ratio under Lars), added to the summed update every step
and never sent ("local": DGC's reference optimizer, ``dgc/optim/sgd.py`` in the authors' code, keeps
the decay's momentum in the optimizer and adds the communicated gradient without momentum). The
weights are the same on every rank, so under SGD "local" applies the decay densely and without
delay; under Lars each rank would rescale it by its own trust ratio, so it is refused there on more
than one rank (``CSCCommunicator.attach``). When
every chunk is sent and the ranks' gradients agree, either way is dense LARS step for step (the
lockstep test); with different gradients each rank's ratio comes from its own, noisier |g|, which
``trust.TrustNoise`` corrects. Optimizers that adapt in other ways (apex's
LARC rescales every update, velocity included), Nesterov momentum and dampening are refused rather
than run wrongly.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from gradientflow_repro.comm.csc.state import BucketState
from gradientflow_repro.comm.csc.trust import TrustNoise, adapts, trust_ratios
from gradientflow_repro.comm.lazy import Bucket, shaped_like
from gradientflow_repro.optim import is_lars

# What CSC takes from each optimizer group for a sparse phase, and the value the group keeps
TAKEN: tuple[tuple[str, Any], ...] = (("momentum", 0.0), ("weight_decay", 0.0), ("always_adapt", False))


def take_settings(groups: list[dict], taken: list[dict]) -> None:
    """Move momentum, weight decay and Lars's adaptation (``TAKEN``) from each optimizer group into
    its entry of ``taken``, leaving the group the plain value. Per setting and idempotent, so a
    state saved by an older version (momentum only) completes itself."""
    for group, own in zip(groups, taken):
        for key, plain in TAKEN:
            if key in group and key not in own:
                own[key], group[key] = group[key], plain


def give_back(groups: list[dict], taken: list[dict]) -> None:
    """Return the settings ``take_settings`` took to their optimizer groups."""
    for group, own in zip(groups, taken):
        group.update(own)


def merged_settings(groups: list[dict], taken: Optional[list[dict]]) -> list[dict]:
    """Each optimizer group's own settings, those CSC has taken over (``taken``) included."""
    taken = taken or [{} for _ in groups]
    return [{**group, **own} for group, own in zip(groups, taken)]


def velocity_from_optimizer(optimizer: torch.optim.Optimizer, buckets: list[Bucket],
                            parts: list[BucketState]) -> None:
    """Start each velocity from the optimizer's momentum buffers (the dense phase's velocity of
    the mean gradient): the ranks' velocities then sum to the world size times it, which the
    mean over ranks turns back into it, so the switch to sparse loses no momentum."""
    for bucket, part in zip(buckets, parts):
        if part.velocity is None:
            continue
        for param, offset in zip(bucket.params, bucket.offsets):
            buffer = optimizer.state.get(param, {}).get("momentum_buffer")
            if buffer is not None:
                shaped_like(part.velocity, offset, param).copy_(buffer)


class _Plan(NamedTuple):
    """One pool part's local step for one set of optimizer settings, as tensors on the device."""

    adapted: list[int]  # entries Lars adapts
    decayed: list[tuple[float, list[int]]]  # (weight decay, entries) for each weight decay in use
    trust: torch.Tensor  # per adapted entry
    decay: torch.Tensor
    eps: torch.Tensor
    adapted_index: torch.Tensor  # ``adapted`` as a tensor on the device
    adapted_segments: torch.Tensor  # each adapted entry's segment (``LocalStep._segments``)
    noise_at: torch.Tensor  # for each layer ``TrustNoise`` corrects, its position among the adapted


class LocalStep:
    """What the optimizer does to a gradient before its momentum, done instead by momentum
    correction to each rank's own gradient (this module's docstring): ``g <- g + wd w`` and, in the groups
    Lars adapts, ``g <- ratio * (g + wd w)`` (``trust.trust_ratios``), with the ratio corrected for the
    noise of the rank's own gradient (``TrustNoise``, unless ``noise_correction`` is off). Knows,
    for every pool part, each parameter's optimizer group and where its gradient lies.

    A part's layers are done together, in a number of operations that does not grow with them
    (what a GPU pays per kernel launch): one fused norm over the weights and one over the gradients
    (``torch._foreach_norm``), the ratios as vectors, one fused ``g += wd w`` per weight decay value
    (``torch._foreach_add_``), and one multiplication of the whole part by its ratios, spread over
    the elements by ``repeat_interleave`` (1 on the elements of layers Lars does not adapt and on
    the padding). Only the noise sketch (``TrustNoise.sketch``, under ``comm.trust_noise_correction``)
    still works layer by layer."""

    def __init__(self, optimizer: torch.optim.Optimizer, buckets: list[Bucket], world: int = 1,
                 noise_correction: bool = True) -> None:
        if not (is_lars(optimizer) or isinstance(optimizer, torch.optim.SGD)):
            raise ValueError(f"csc: momentum correction with {type(optimizer).__name__}: only SGD and timm's "
                             "Lars are supported (an optimizer that rescales every update would rescale CSC's "
                             "accumulated velocity); use optim.name=lars or comm.momentum_correction=false")
        for group in optimizer.param_groups:
            if group.get("nesterov") or group.get("dampening", 0) or group.get("trust_clip"):
                raise ValueError("csc: momentum correction keeps plain momentum (u <- m u + g): it does not "
                                 "support Nesterov momentum, dampening or Lars(trust_clip=True)")
        group_of = {param: index for index, group in enumerate(optimizer.param_groups)
                    for param in group["params"]}
        self.entries = [[(param, offset, group_of[param]) for param, offset in zip(bucket.params, bucket.offsets)
                         if param in group_of] for bucket in buckets]
        self._positions = [[position for position, param in enumerate(bucket.params) if param in group_of]
                           for bucket in buckets]  # each entry's position in its bucket
        self.noise = (TrustNoise(self.entries, optimizer.param_groups, buckets, world)
                      if noise_correction and world > 1 else None)
        # per bucket, this step's trust ratio of each entry (1 where Lars does not adapt): what
        # ``comm.rank_by=raw`` divides the chunk norms by
        self.ratios: dict[int, torch.Tensor] = {}
        self._weights = [[param.detach() for param, _, _ in entries] for entries in self.entries]  # views: the
        # optimizer updates the weights in place
        self._segments = [self._cut(entries, bucket) for entries, bucket in zip(self.entries, buckets)]
        self._plans: dict[tuple, _Plan] = {}

    @staticmethod
    def _cut(entries: list[tuple[torch.nn.Parameter, int, int]], bucket: Bucket) -> tuple[torch.Tensor, list[int]]:
        """The part cut into segments, each entry one and each gap between them one (padding,
        parameters outside the optimizer): their lengths (a tensor on the device) and each entry's
        segment."""
        lengths, of_entry, at = [], [0] * len(entries), 0
        for index in sorted(range(len(entries)), key=lambda i: entries[i][1]):
            param, offset, _ = entries[index]
            if offset > at:
                lengths.append(offset - at)
            of_entry[index], at = len(lengths), offset + param.numel()
            lengths.append(param.numel())
        if at < bucket.flat.numel():
            lengths.append(bucket.flat.numel() - at)
        return torch.tensor(lengths, dtype=torch.long, device=bucket.flat.device), of_entry

    def _plan(self, bucket_index: int, settings: list[dict], device: torch.device) -> _Plan:
        """The part's plan for these settings, made once per distinct settings (a new learning rate
        changes none of them; a changed weight decay makes a new plan)."""
        entries = self.entries[bucket_index]
        used = [settings[group] for _, _, group in entries]
        key = (bucket_index, *((bool(adapts(own)), own.get("weight_decay", 0.0), own.get("trust_coeff"),
                                own.get("eps")) for own in used))
        plan = self._plans.get(key)
        if plan is None:
            adapted = [index for index, own in enumerate(used) if adapts(own)]
            decays: dict[float, list[int]] = {}
            for index, own in enumerate(used):
                if own.get("weight_decay", 0.0):
                    decays.setdefault(float(own["weight_decay"]), []).append(index)

            def vector(values: list[float]) -> torch.Tensor:
                return torch.tensor(values, dtype=torch.float32, device=device)
            noise_layers = [index for index, _ in self.noise.layers[bucket_index]] if self.noise else []
            plan = self._plans[key] = _Plan(
                adapted, sorted(decays.items()), vector([used[i]["trust_coeff"] for i in adapted]),
                vector([used[i]["weight_decay"] for i in adapted]), vector([used[i]["eps"] for i in adapted]),
                torch.tensor(adapted, dtype=torch.long, device=device),
                torch.tensor([self._segments[bucket_index][1][i] for i in adapted], dtype=torch.long, device=device),
                torch.tensor([adapted.index(i) for i in noise_layers], dtype=torch.long, device=device))
        return plan

    def noise_layers(self, bucket_index: int) -> int:
        """How many layers of the bucket have their trust ratio corrected for noise."""
        return self.noise.layers_in(bucket_index) if self.noise is not None else 0

    def apply_(self, bucket: Bucket, gradient: torch.Tensor, settings: list[dict],
               state: Optional[BucketState] = None, decay: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """Apply, in place, the optimizer's pre-momentum step to ``bucket``'s gradients in ``gradient``
        (laid out like ``bucket.flat``); ``settings``: each optimizer group's own settings (those
        CSC has taken over included). With ``state`` (the bucket's, holding a noise estimate), the
        trust ratios are corrected by its estimate, and the noise sketch of the gradients as they
        came (``TrustNoise.sketch``) is returned, to ride with the chunk norms; else None. ``decay``
        (laid out like ``gradient``): the weight decay term (rescaled where Lars adapts) is written
        there instead of added to the gradient, and zeros where a parameter has none
        (``comm.weight_decay_in=local``)."""
        noise = self.noise if state is not None and state.noise is not None else None
        sketch = noise.sketch(bucket, gradient, state) if noise is not None else None
        entries = self.entries[bucket.index]
        plan = self._plan(bucket.index, settings, gradient.device)
        weights = self._weights[bucket.index]
        views = ([bucket.views[position] for position in self._positions[bucket.index]] if gradient is bucket.flat
                 else [shaped_like(gradient, offset, param) for param, offset, _ in entries])
        ratios = None
        if plan.adapted:  # the norms of the gradients as they came, before the weight decay joins them
            c: Any = 1.0
            if noise is not None and plan.noise_at.numel():
                c = torch.ones(len(plan.adapted), device=gradient.device).index_copy_(
                    0, plan.noise_at, noise.factor_vector(state))
            ratios = trust_ratios(torch.stack(torch._foreach_norm([weights[i] for i in plan.adapted])),
                                  torch.stack(torch._foreach_norm([views[i] for i in plan.adapted])),
                                  plan.trust, plan.decay, plan.eps, c)
        if decay is not None:
            decay.zero_()
        targets = views if decay is None else [shaped_like(decay, offset, param) for param, offset, _ in entries]
        for weight_decay, indices in plan.decayed:
            torch._foreach_add_([targets[i] for i in indices], [weights[i] for i in indices], alpha=weight_decay)
        every = torch.ones(len(entries), dtype=torch.float32, device=gradient.device)
        if ratios is not None:
            lengths, _ = self._segments[bucket.index]
            per_segment = torch.ones(lengths.numel(), dtype=torch.float32, device=gradient.device)
            per_element = torch.repeat_interleave(per_segment.index_copy_(0, plan.adapted_segments, ratios),
                                                  lengths, output_size=gradient.numel())
            gradient.mul_(per_element)
            if decay is not None:
                decay.mul_(per_element)
            every.index_copy_(0, plan.adapted_index, ratios)
        self.ratios[bucket.index] = every
        return sketch
