"""PowerSGD as a sparsifier (``comm.sparsity=powersgd``): PyTorch's own hook, after a dense warm-up.

PowerSGD (Vogels et al. 2019) sends each matrix-shaped gradient (n x m) of a DDP bucket as two
rank-r factors, P = M Q and Q = M^T P, each allreduced, with error feedback and a warm-started Q;
vectors go whole. The algorithm is torch's (``torch.distributed.algorithms.ddp_comm_hooks.
powerSGD_hook``), run by ``ddp.PowerSGDCommunicator``, which keeps it dense for the plan's warm-up
(CSC's, ``comm.csc_warmup_epochs``: the learning rate's by default) and checkpoints its state.

This module is PowerSGD as the registry sees it: its one key of its own (``powersgd_rank``, torch's
``matrix_approximation_rank``), its builder, its pricing rule (``low_rank``: two factors per
matrix, two allreduces per bucket) and the fusion it needs (DDP's buckets, ``comm.fusion=ddp``).
Torch-free: the config check reads it; the communicator loads in ``build``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gradientflow_repro.checks import positive, setting
from gradientflow_repro.comm.registry import Sparsifier

if TYPE_CHECKING:
    import torch

    from gradientflow_repro.comm.base import Communicator, SumFn
    from gradientflow_repro.comm.plan import Plan


@dataclass(frozen=True)
class PowerSGDKeys:
    """PowerSGD's own ``comm.*`` key."""

    powersgd_rank: int = setting(4, positive)  # rank of the low-rank factors (torch's matrix_approximation_rank)


def build(plan: Plan, device: torch.device, sum_fn: SumFn) -> Communicator:
    """DDP with torch's PowerSGD hook. The hook does its own allreduces (the backend's): ``sum_fn``
    is not used; the plan has checked that ``comm.fusion`` is ddp."""
    from gradientflow_repro.comm.ddp import PowerSGDCommunicator

    return PowerSGDCommunicator(device, plan.ddp_bucket_mb, rank=plan.keys.powersgd_rank,
                                warmup_epochs=plan.warmup_epochs)


SPARSIFIER = Sparsifier("powersgd", keys=PowerSGDKeys, builder=build, pricing="low_rank", fusion="ddp",
                        priced_as=lambda keys: {"rank": keys.powersgd_rank},
                        dense_steps=2,  # torch's hook compresses from its iteration 2 on, never before
                        describe=lambda keys: f"PowerSGD rank {keys.powersgd_rank}")
