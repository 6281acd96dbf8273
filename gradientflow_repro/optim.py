"""LARS for large batches, with the schedule large-batch training needs.

The optimizer is timm's ``Lars``. BatchNorm and bias parameters (every parameter with fewer than two
dimensions) go in a group with no weight decay, which timm's Lars also leaves without trust-ratio
adaptation (You et al. 2017; the MLPerf reference does the same). The peak learning rate scales
linearly with the global batch (``base_lr * global_batch / base_batch_size``); it ramps up linearly
per iteration over the warm-up, then decays polynomially (power 2 by default) to ``end_lr``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:  # only for hints: the GPU check imports this module where Hydra is not installed
    from gradientflow_repro.config import OptimConfig


def lars_class() -> type[torch.optim.Optimizer]:
    """timm's ``Lars`` (``from timm.optim import Lars``), imported on first use: importing timm runs
    its package ``__init__``, which imports its model zoo and through it torchvision, seconds per
    process that only a run whose optimizer is Lars needs (the communication tests, the GPU check's
    other items and ``optim.name=apex_larc`` runs never pay them). A missing timm is named, so the
    GPU check skips what needs it."""
    try:
        from timm.optim import Lars
    except ModuleNotFoundError as error:
        if (error.name or "").partition(".")[0] != "timm":
            raise
        raise ModuleNotFoundError("timm is not installed: it provides the Lars optimizer (requirements.txt)",
                                  name="timm") from error
    return Lars


def __getattr__(name: str) -> object:
    """``optim.Lars``: timm's class, imported when first asked for (``lars_class``)."""
    if name == "Lars":
        return lars_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_lars(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is timm's Lars; without timm imported, none can be."""
    lars = sys.modules.get("timm.optim.lars")
    return lars is not None and isinstance(optimizer, lars.Lars)


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    adapted, plain = [], []
    for param in model.parameters():
        if param.requires_grad:
            (adapted if param.ndim > 1 else plain).append(param)
    return [{"params": adapted, "weight_decay": weight_decay},
            {"params": plain, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: OptimConfig, global_batch: int) -> torch.optim.Optimizer:
    groups, lr = parameter_groups(model, cfg.weight_decay), peak_lr(cfg, global_batch)
    if cfg.name == "apex_larc":
        # Optional, where apex is built: LARC adapts every parameter (BN and bias too), unlike Lars.
        from apex.parallel.LARC import LARC

        return LARC(torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum),
                    trust_coefficient=cfg.trust_coeff, clip=False)
    return lars_class()(groups, lr=lr, momentum=cfg.momentum, trust_coeff=cfg.trust_coeff)


def peak_lr(cfg: OptimConfig, global_batch: int) -> float:
    return cfg.base_lr * global_batch / cfg.base_batch_size


@dataclass(frozen=True)
class WarmupPolySchedule:
    """lr(step) for step = 0, 1, ...: linear warm-up from peak/warmup_steps to peak over
    ``warmup_steps`` iterations, then (peak - end) * (1 - progress)^power + end."""

    peak: float
    warmup_steps: int
    total_steps: int
    power: float = 2.0
    end: float = 0.0

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.peak * (step + 1) / self.warmup_steps
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        return (self.peak - self.end) * (1.0 - progress) ** self.power + self.end


def build_schedule(cfg: OptimConfig, global_batch: int, steps_per_epoch: int,
                   epochs: int) -> WarmupPolySchedule:
    return WarmupPolySchedule(peak=peak_lr(cfg, global_batch),
                              warmup_steps=round(cfg.warmup_epochs * steps_per_epoch),
                              total_steps=epochs * steps_per_epoch, power=cfg.poly_power,
                              end=cfg.end_lr)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
