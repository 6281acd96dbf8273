"""Precise BatchNorm statistics for evaluation: recomputed with the weights being evaluated.

BatchNorm's running statistics are an exponential average of the batches' statistics, each taken
with the weights of its own step. With few steps per epoch a high momentum is needed so they do not
lag the weights by several steps, and then they are the statistics of one or two batches: one large
update just before an evaluation leaves them describing other weights, and top-1 can drop by tens of
points for that evaluation alone while training is fine (seen on the digits recipe: 3 of 33 runs).
Precise BN (as in Wu and Johnson, "Rethinking 'Batch' in BatchNorm", 2021, and fvcore's
``update_bn_stats``) recomputes them before an evaluation as the plain average over a few training
batches, forwarded with the current weights.

How, here: the last ``precise_bn_batches`` training batches of each epoch are kept (the inputs only,
as the step received them); before the evaluation, ``torch.optim.swa_utils.update_bn`` resets the
statistics and forwards those batches in training mode without gradients; the evaluation then
averages the recomputed statistics over the ranks as usual (``state.LocalBuffers.averaged``), and
afterwards every rank's own running statistics are back, so training never sees the recomputation:
the trajectory is the same with or without it (the random generators that dropout draws from are
forked), only the evaluation reads differ. The kept batches
are part of each rank's checkpoint, so an evaluation after a resume reads what it would have read.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Iterator

import torch
from torch import nn
from torch.optim.swa_utils import update_bn

from gradientflow_repro.state import OWN, LocalBuffers


class PreciseBatchNorm:
    """Keeps the last ``batches`` training inputs of each epoch and recomputes BatchNorm's statistics
    from them for an evaluation. ``batches=0``: off (the running statistics are evaluated as they
    are). A per-rank part of the train state: on another number of ranks new rank r keeps old rank
    r's batches, and a rank without an old counterpart starts with none (its next evaluation then
    uses the running statistics if no batch was kept since)."""

    rank_rule = OWN

    def __init__(self, batches: int) -> None:
        self.batches = batches
        self.kept: list[torch.Tensor] = []

    def remember(self, images: torch.Tensor, step: int, steps_per_epoch: int) -> None:
        """Called with every training step's inputs (``step`` counted from the run's start)."""
        if not self.batches:
            return
        position, first = step % steps_per_epoch, max(0, steps_per_epoch - self.batches)
        if position == first:
            self.kept = []  # this epoch's window starts
        if position >= first:
            self.kept.append(images.detach().clone())

    @contextlib.contextmanager
    def recomputed(self, model: nn.Module, buffers: LocalBuffers,
                   autocast: Callable[[], ContextManager]) -> Iterator[None]:
        """Within: the statistics recomputed from the kept batches (none kept: unchanged); after it,
        this rank's running statistics as they were. The kept batches are used once."""
        if not self.kept:
            yield
            return
        running = buffers.state_dict()
        device = self.kept[0].device
        # dropout draws from the generators in training mode: fork them, so the training steps after
        # the evaluation draw what they would have drawn without it
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            with autocast():
                update_bn(self.kept, model)  # resets, averages over the batches, restores momentum and mode
        self.kept = []
        try:
            yield
        finally:
            buffers.load_state_dict(running)

    def state_dict(self) -> list[torch.Tensor]:
        return list(self.kept)

    def load_state_dict(self, kept: list[torch.Tensor]) -> None:
        self.kept = list(kept)

    def reseed(self, seed: int) -> None:
        self.kept = []

    def absent_from_checkpoint(self) -> None:
        """A checkpoint written without precise BN (before it existed, or with it off): none kept."""
        self.kept = []
