"""Coarse-grained sparse communication (CSC) over the lazy-allreduce pool.

Element-wise top-k sparsification (Deep Gradient Compression) needs an allgather of indices and
values whose volume grows with the number of workers. GradientFlow sparsifies coarsely instead:
1. each pool part of weight gradients is cut into chunks of ``chunk_size`` elements;
2. each rank adds its new gradient to its residual (error feedback) and computes the L1 norm of
   every chunk;
3. the vector of chunk norms (one float per chunk: tiny) is allreduced, so every rank ranks the
   chunks by the same global importance and picks the same top ``density`` fraction (ties broken
   by chunk index, so the choice is deterministic);
4. the chosen chunks are packed contiguously and allreduced densely by the chosen algorithm
   (ring, fp16 wire ...): no indices travel, and the volume is ``density`` times the dense one;
5. the chunks not chosen stay in the per-rank residual and are added to the next step, so no
   gradient is ever dropped, only delayed.
Momentum correction (DGC, Lin et al. 2018): while sparsifying, momentum is accumulated *before*
sparsification, in a local velocity u <- m u + g whose sum v <- v + u is what gets chunked and sent;
sent chunks of v (and, with momentum factor masking, of u) are cleared. The optimizer's own momentum
is then set to 0 so momentum is not applied twice; it is restored during dense phases. One-
dimensional tensors (BatchNorm, bias) are small and sensitive: they are always sent densely (with
the same velocity while momentum correction is on). Training starts dense for ``warmup_epochs``
(dense warm-up); optionally the density then falls over ``density_ramp_epochs`` epochs instead of at
once, exponentially as in DGC's sparsity warm-up (the k-th of R epochs sends density^(k/(R+1)):
0.56, 0.32, 0.18 for density 0.1 and R = 3). With ``density`` 1 nothing is sparsified and this is
exactly lazy allreduce.

State per rank (residual v and velocity u per part) is saved in that rank's checkpoint. Updates to
it are staged and committed by ``end_step``: a step skipped on every rank (fp16 overflow) leaves the
state as it was. Each state tensor has a spare of the same size that the step's update is written
into and that ``end_step`` swaps in, so no step allocates: a fresh allocation of this size page-
faults every time on the CPU, which made CSC's own work cost up to five times more. Residuals are
kept in unscaled units (the fp16 loss scale is divided out on the way in and multiplied back on the
way out), so a changing loss scale never corrupts them.

One object, ``BucketState``, holds a bucket's state and does steps 2-5 on it; ``CSCCommunicator``
keeps one per pool part, and the DDP communication hook ``csc_hook`` (``comm/hooks.py``) one per DDP
bucket. The hook cannot wait for the host to learn whether a step will be applied, so it commits on
the device: after an overflow the residual is kept and the bucket arrives as inf everywhere.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
from torch import nn

from gradientflow_repro.comm.base import CommStats, GradScale, SumFn, builtin_sum
from gradientflow_repro.comm.lazy import Bucket, LazyAllreduce


def chunk_l1_norms(chunks: torch.Tensor) -> torch.Tensor:
    """L1 norm of every row of a [chunks, chunk_size] matrix."""
    return torch.linalg.vector_norm(chunks, ord=1, dim=1, dtype=torch.float32)


def select_chunks(global_norms: torch.Tensor, density: float,
                  always: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Indices (ascending) of the ``ceil(density * n)`` largest norms; ties go to the lower index.
    Chunks listed in ``always`` are chosen on top of those."""
    count = min(global_norms.numel(), max(1, math.ceil(density * global_norms.numel())))
    if always is not None and always.numel():
        global_norms = global_norms.index_fill(0, always, math.inf)
        count = min(global_norms.numel(), count + always.numel())
    order = torch.sort(global_norms, descending=True, stable=True).indices[:count]
    return order.sort().values


class Sent(NamedTuple):
    """What ``BucketState.sparsify`` sent."""

    chosen: torch.Tensor  # indices of the chunks sent, ascending, on the state's device
    summed: torch.Tensor  # [len(chosen), chunk_size]: those chunks summed over ranks
    finite: Optional[torch.Tensor]  # with guard_overflow: a 0-d bool on the device, False when
    # some rank's chunk norms were not finite (its gradient overflowed)


class BucketState:
    """One bucket's CSC state on one rank: the residual (error feedback) and, under momentum
    correction, the velocity, each with a spare of the same size that the step's update is written
    into. ``sparsify`` (steps 2-5) and ``add_momentum`` only *stage* their updates; ``commit`` makes
    them the state (the spares are swapped in: no allocation per step) and ``discard`` drops them,
    so a step skipped on every rank leaves the state as it was. ``commit(when=flag)`` decides on the
    device instead, for callers that cannot wait for the host to know whether a step is applied (a
    DDP hook). Used by ``CSCCommunicator`` (one per pool part) and ``csc_hook`` (one per DDP
    bucket)."""

    def __init__(self, residual: Optional[torch.Tensor] = None,
                 velocity: Optional[torch.Tensor] = None) -> None:
        self.residual = residual  # [chunks, chunk_size], fp32; None for a part always sent densely
        self.velocity = velocity  # momentum correction's u; None without it
        self._spare_residual = None if residual is None else torch.empty_like(residual)
        self._spare_velocity = None if velocity is None else torch.empty_like(velocity)
        self._staged_residual: Optional[torch.Tensor] = None  # a spare holding this step's update
        self._staged_velocity: Optional[torch.Tensor] = None
        self.last_selection: Optional[torch.Tensor] = None  # chunks sent by the last sparsify (tests)

    @classmethod
    def zeros(cls, shape: tuple[int, ...], device: torch.device, residual: bool = True,
              velocity: bool = False) -> "BucketState":
        """A fresh state: ``residual`` for a bucket that is sparsified, ``velocity`` for momentum
        correction (a bucket always sent densely has a velocity but no residual)."""
        def zeros() -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.float32, device=device)
        return cls(zeros() if residual else None, zeros() if velocity else None)

    def to(self, device: torch.device) -> None:
        """Move the state to ``device`` (a hook's state restored on the CPU, then used on a GPU)."""
        if self.residual is not None and self.residual.device != device:
            self.residual = self.residual.to(device)
            self._spare_residual = torch.empty_like(self.residual)
        if self.velocity is not None and self.velocity.device != device:
            self.velocity = self.velocity.to(device)
            self._spare_velocity = torch.empty_like(self.velocity)

    # ------------------------------------------------------------------ one step
    def add_momentum(self, gradient: torch.Tensor, momentum: float) -> torch.Tensor:
        """Stage u <- m u + g (momentum correction) and return it: what is then sent or sparsified."""
        assert self.velocity is not None, "this bucket keeps no velocity"
        self._staged_velocity = torch.add(gradient, self.velocity, alpha=momentum, out=self._spare_velocity)
        return self._staged_velocity

    def sparsify(self, gradient: torch.Tensor, density: float, sum_fn: SumFn, norm_sum: SumFn,
                 stats: CommStats, always: Optional[torch.Tensor] = None, mask_velocity: bool = False,
                 guard_overflow: bool = False) -> Sent:
        """Steps 2-5 of CSC. ``gradient``: a [chunks, chunk_size] matrix like the residual, or a flat
        tensor of at most chunks * chunk_size elements (a DDP bucket: the rest counts as zeros).
        Residual + gradient is chunked; the chunk norms are summed over ranks by ``norm_sum`` (so
        every rank ranks the chunks alike); the top ``density`` of them plus those in ``always`` are
        packed and summed over ranks by ``sum_fn``; the sent chunks are cleared in the new residual,
        which is staged. With ``mask_velocity``, the sent chunks of the staged velocity are cleared
        too (DGC's momentum factor masking).

        A non-finite gradient on any rank makes the summed norms non-finite on every rank. Without
        ``guard_overflow`` its chunk has the largest norm, so it is sent and reaches every rank (the
        caller then skips the step and discards). With it, the norms are made finite before choosing
        and ``Sent.finite`` says, on the device, whether they were: for ``commit(when=...)``."""
        assert self.residual is not None, "this bucket is always sent densely"
        accumulated = self._spare_residual  # the next residual is built in the spare: no allocation
        if gradient.shape == accumulated.shape:
            torch.add(self.residual, gradient, out=accumulated)
        else:
            accumulated.copy_(self.residual)
            accumulated.view(-1)[:gradient.numel()].add_(gradient.view(-1))
        norms = chunk_l1_norms(accumulated)
        norm_sum(norms, stats)  # every rank now ranks chunks by the same global norms
        finite = None
        if guard_overflow:  # decided on the device: reading it on the host would wait for the GPU
            finite = torch.isfinite(norms.sum())
            norms = torch.nan_to_num(norms)
        chosen = select_chunks(norms, density, always)
        packed = accumulated.index_select(0, chosen)
        sum_fn(packed.view(-1), stats)
        accumulated.index_fill_(0, chosen, 0.0)
        if mask_velocity and self._staged_velocity is not None:
            self._staged_velocity.index_fill_(0, chosen, 0.0)
        self._staged_residual, self.last_selection = accumulated, chosen
        return Sent(chosen, packed, finite)

    def commit(self, when: Optional[torch.Tensor] = None) -> None:
        """Make the staged updates the state. ``when`` (a 0-d bool tensor): only if it is true,
        chosen on the device; the update is then copied into the state rather than swapped in,
        and the spare is free again (``scratch``)."""
        for name in ("residual", "velocity"):
            staged = getattr(self, f"_staged_{name}")
            if staged is None:
                continue
            current = getattr(self, name)
            if when is None:  # the spare becomes the state, the old state the next spare
                setattr(self, name, staged)
                setattr(self, f"_spare_{name}", current)
            else:
                torch.where(when, staged, current, out=current)
        self.discard()

    def discard(self) -> None:
        """Forget the staged updates (a step skipped on every rank)."""
        self._staged_residual = self._staged_velocity = None

    @property
    def scratch(self) -> torch.Tensor:
        """The residual's spare, a [chunks, chunk_size] buffer free to use between a commit or
        discard and the next ``sparsify``."""
        assert self._staged_residual is None, "the spare holds a staged residual"
        return self._spare_residual

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """``residual`` and ``velocity`` (those this bucket keeps), on the CPU."""
        return {name: tensor.cpu() for name, tensor in (("residual", self.residual),
                                                        ("velocity", self.velocity)) if tensor is not None}

    def load_state_dict(self, state: dict) -> None:
        """Copy saved tensors into the state; a tensor this state lacks is adopted (a copy)."""
        for name in ("residual", "velocity"):
            saved = state.get(name)
            if saved is None:
                continue
            current = getattr(self, name)
            if current is None:
                setattr(self, name, saved.clone())
                setattr(self, f"_spare_{name}", torch.empty_like(saved))
            elif current.shape != saved.shape:
                raise ValueError(f"csc: saved {name} has shape {tuple(saved.shape)}, "
                                 f"not {tuple(current.shape)}")
            else:
                current.copy_(saved)
        self.discard()


class CSCCommunicator(LazyAllreduce):
    def __init__(self, device: torch.device, sum_fn: SumFn, bucket_bytes: int, overlap: bool,
                 chunk_size: int, density: float, warmup_epochs: float,
                 momentum_correction: bool = True, momentum_masking: bool = True,
                 density_ramp_epochs: int = 0) -> None:
        super().__init__(device, sum_fn, bucket_bytes, overlap)
        if not 0 < density <= 1:
            raise ValueError(f"config key 'comm.density' = {density}: must be in (0, 1]")
        if density_ramp_epochs < 0:
            raise ValueError(f"config key 'comm.density_ramp_epochs' = {density_ramp_epochs}: must be >= 0")
        self.chunk_size, self.density, self.warmup_epochs = chunk_size, density, warmup_epochs
        self.density_ramp_epochs = density_ramp_epochs
        self.density_now = 1.0
        self.momentum_correction, self.momentum_masking = momentum_correction, momentum_masking
        self.norm_sum = builtin_sum()
        self.sparse_now = False
        self.grad_scale: GradScale = None
        self.parts: list[BucketState] = []  # one per pool part, in layout order
        self._optimizer_momentum: Optional[list[float]] = None

    def layout(self, params: list[nn.Parameter]) -> list[Bucket]:
        # sparse parts are padded to whole chunks, so they are [chunks, chunk_size] matrices for free
        return (self.pack([p for p in params if p.ndim > 1], dense=False, multiple=self.chunk_size)
                + self.pack([p for p in params if p.ndim <= 1], dense=True))

    def chunks(self, bucket: Bucket) -> torch.Tensor:
        return bucket.flat.view(-1, self.chunk_size)

    def attach(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> nn.Module:
        super().attach(model, optimizer)
        # dense parts (1-D tensors) keep no residual but share momentum correction's velocity
        self.parts = [BucketState.zeros(tuple((bucket.flat if bucket.dense else self.chunks(bucket)).shape),
                                        bucket.flat.device, residual=not bucket.dense, velocity=True)
                      for bucket in self.buckets]
        return model

    # per-part state by part index, as tests, gpu_check and checkpoints see it
    @property
    def residual(self) -> dict[int, torch.Tensor]:
        return {i: part.residual for i, part in enumerate(self.parts) if part.residual is not None}

    @property
    def velocity(self) -> dict[int, torch.Tensor]:
        return {i: part.velocity for i, part in enumerate(self.parts) if part.velocity is not None}

    @property
    def last_selection(self) -> dict[int, torch.Tensor]:
        """Part index -> the chunks it last sent (for tests)."""
        return {i: part.last_selection for i, part in enumerate(self.parts) if part.last_selection is not None}

    @property
    def uses_velocity(self) -> bool:
        return self.momentum_correction and self.sparse_now

    def density_at(self, epoch: float) -> float:
        """The fraction of chunks sent in ``epoch``: 1 during the dense warm-up, then the ramp."""
        if epoch < self.warmup_epochs:
            return 1.0
        ramp_epoch = math.floor(epoch - self.warmup_epochs) + 1
        if ramp_epoch <= self.density_ramp_epochs:
            return self.density ** (ramp_epoch / (self.density_ramp_epochs + 1))
        return self.density

    def begin_step(self, epoch: float, grad_scale: GradScale = None) -> None:
        # a tensor stays a tensor: comparing it with 1 on the host would wait for the GPU
        self.grad_scale = None if isinstance(grad_scale, (int, float)) and grad_scale == 1 else grad_scale
        self.density_now = self.density_at(epoch)
        self.sparse_now = self.density_now < 1
        self._hand_momentum_to_optimizer(not self.uses_velocity)

    def _hand_momentum_to_optimizer(self, optimizer_owns: bool) -> None:
        if self.optimizer is None or not self.momentum_correction:
            return
        groups = self.optimizer.param_groups
        if not optimizer_owns and self._optimizer_momentum is None:
            self._optimizer_momentum = [group.get("momentum", 0.0) for group in groups]
            for group in groups:
                group["momentum"] = 0.0
        elif optimizer_owns and self._optimizer_momentum is not None:
            for group, momentum in zip(groups, self._optimizer_momentum):
                group["momentum"] = momentum
            self._optimizer_momentum = None

    def momentum(self) -> float:
        if self._optimizer_momentum is not None:
            return self._optimizer_momentum[0]
        return self.optimizer.param_groups[0].get("momentum", 0.0) if self.optimizer else 0.0

    def reduce_bucket(self, bucket: Bucket) -> None:
        if not self.sparse_now:
            super().reduce_bucket(bucket)
            return
        part = self.parts[bucket.index]
        gradient = bucket.flat if bucket.dense else self.chunks(bucket)
        if self.grad_scale is not None:
            gradient.div_(self.grad_scale)  # in place: the pool part is overwritten below anyway
        if self.uses_velocity:
            gradient = part.add_momentum(gradient, self.momentum())
        if bucket.dense:
            if self.grad_scale is not None:
                torch.mul(gradient, self.grad_scale, out=bucket.flat)
            elif gradient is not bucket.flat:
                bucket.flat.copy_(gradient)
            super().reduce_bucket(bucket)
            return
        # no overflow guard: a non-finite chunk has the largest norm, so it is sent and reaches
        # every rank, which then skip the step; end_step(False) discards what it staged
        sent = part.sparsify(gradient, self.density_now, self.sum_fn, self.norm_sum, self.stats,
                             mask_velocity=self.momentum_masking)
        bucket.flat.zero_()
        self.chunks(bucket).index_copy_(0, sent.chosen,
                                        sent.summed if self.grad_scale is None else sent.summed.mul_(self.grad_scale))

    def end_step(self, applied: bool) -> None:
        for part in self.parts:
            if applied:
                part.commit()
            else:
                part.discard()

    def state_dict(self) -> dict:
        parts = [part.state_dict() for part in self.parts]
        return {"residual": {i: s["residual"] for i, s in enumerate(parts) if "residual" in s},
                "velocity": {i: s["velocity"] for i, s in enumerate(parts) if "velocity" in s},
                "optimizer_momentum": self._optimizer_momentum,
                "layout": [b.flat.numel() for b in self.buckets], "chunk_size": self.chunk_size}

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        if (state["layout"], state["chunk_size"]) != ([b.flat.numel() for b in self.buckets], self.chunk_size):
            raise ValueError("csc state was saved with another pool layout (model, comm.bucket_mb or "
                             "comm.chunk_size changed); it cannot be restored")
        for key in ("residual", "velocity"):
            for index, tensor in state[key].items():
                self.parts[int(index)].load_state_dict({key: tensor})
        self._optimizer_momentum = state["optimizer_momentum"]
