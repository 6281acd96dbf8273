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
"""

from __future__ import annotations

import math
from typing import Optional

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


def send_chosen_chunks_(accumulated: torch.Tensor, global_norms: torch.Tensor, density: float,
                        sum_fn: SumFn, stats: CommStats,
                        always: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 3-5 on a [chunks, chunk_size] matrix of residual + gradient, once the chunk norms are
    summed over ranks: choose, pack, sum the packed chunks over ranks, and clear the sent chunks in
    ``accumulated``, which is left holding the new residual. Returns (chosen indices, their sums)."""
    chosen = select_chunks(global_norms, density, always)
    packed = accumulated.index_select(0, chosen)
    sum_fn(packed.view(-1), stats)
    accumulated.index_fill_(0, chosen, 0.0)
    return chosen, packed


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
        self.residual: dict[int, torch.Tensor] = {}
        self.velocity: dict[int, torch.Tensor] = {}
        self._spare_residual: dict[int, torch.Tensor] = {}  # this step's update is written here
        self._spare_velocity: dict[int, torch.Tensor] = {}
        self._staged: dict[int, tuple[torch.Tensor, Optional[torch.Tensor]]] = {}
        self.last_selection: dict[int, torch.Tensor] = {}  # part index -> chunks sent (for tests)
        self._optimizer_momentum: Optional[list[float]] = None

    def layout(self, params: list[nn.Parameter]) -> list[Bucket]:
        # sparse parts are padded to whole chunks, so they are [chunks, chunk_size] matrices for free
        return (self.pack([p for p in params if p.ndim > 1], dense=False, multiple=self.chunk_size)
                + self.pack([p for p in params if p.ndim <= 1], dense=True))

    def chunks(self, bucket: Bucket) -> torch.Tensor:
        return bucket.flat.view(-1, self.chunk_size)

    def attach(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> nn.Module:
        super().attach(model, optimizer)
        for index, bucket in enumerate(self.buckets):
            state = bucket.flat if bucket.dense else self.chunks(bucket)
            if not bucket.dense:
                self.residual[index] = torch.zeros_like(state)
                self._spare_residual[index] = torch.empty_like(state)
            self.velocity[index] = torch.zeros_like(state)
            self._spare_velocity[index] = torch.empty_like(state)
        return model

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
        index = bucket.index
        if not self.sparse_now:
            super().reduce_bucket(bucket)
            return
        gradient = bucket.flat if bucket.dense else self.chunks(bucket)
        if self.grad_scale is not None:
            gradient.div_(self.grad_scale)  # in place: the pool part is overwritten below anyway
        velocity = None
        if self.uses_velocity:
            velocity = torch.add(gradient, self.velocity[index], alpha=self.momentum(),
                                 out=self._spare_velocity[index])
            gradient = velocity
        if bucket.dense:
            if self.grad_scale is not None:
                torch.mul(gradient, self.grad_scale, out=bucket.flat)
            elif gradient is not bucket.flat:
                bucket.flat.copy_(gradient)
            super().reduce_bucket(bucket)
            self._staged[index] = (None, velocity)
            return
        accumulated = torch.add(self.residual[index], gradient, out=self._spare_residual[index])
        norms = chunk_l1_norms(accumulated)
        self.norm_sum(norms, self.stats)  # every rank now ranks chunks by the same global norms
        chosen, packed = send_chosen_chunks_(accumulated, norms, self.density_now, self.sum_fn, self.stats)
        bucket.flat.zero_()
        self.chunks(bucket).index_copy_(0, chosen, packed if self.grad_scale is None else packed.mul_(self.grad_scale))
        if velocity is not None and self.momentum_masking:
            velocity.index_fill_(0, chosen, 0.0)
        self._staged[index] = (accumulated, velocity)
        self.last_selection[index] = chosen

    def end_step(self, applied: bool) -> None:
        if applied:
            for index, (residual, velocity) in self._staged.items():  # the spares become the state
                if residual is not None:
                    self.residual[index], self._spare_residual[index] = residual, self.residual[index]
                if velocity is not None:
                    self.velocity[index], self._spare_velocity[index] = velocity, self.velocity[index]
        self._staged = {}

    def state_dict(self) -> dict:
        return {"residual": {i: t.cpu() for i, t in self.residual.items()},
                "velocity": {i: t.cpu() for i, t in self.velocity.items()},
                "optimizer_momentum": self._optimizer_momentum,
                "layout": [b.flat.numel() for b in self.buckets], "chunk_size": self.chunk_size}

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        if (state["layout"], state["chunk_size"]) != ([b.flat.numel() for b in self.buckets], self.chunk_size):
            raise ValueError("csc state was saved with another pool layout (model, comm.bucket_mb or "
                             "comm.chunk_size changed); it cannot be restored")
        for index, tensor in state["residual"].items():
            self.residual[int(index)].copy_(tensor)
        for index, tensor in state["velocity"].items():
            self.velocity[int(index)].copy_(tensor)
        self._optimizer_momentum = state["optimizer_momentum"]
