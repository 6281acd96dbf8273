"""The one interface through which the trainer reaches gradients, and the strategy registry.

A communicator is attached to the model once, then after every backward ``synchronize()`` leaves
each ``p.grad`` holding the global mean over ranks. Per-rank state (residuals, velocities of sparse
strategies) travels through ``state_dict``/``load_state_dict`` into each rank's checkpoint file.
``stats`` counts, per step, the bytes handed to collectives, the collectives issued and the seconds
the trainer waited in ``synchronize()``. Hydra's ``comm.strategy`` picks a class from ``STRATEGIES``.
"""

from __future__ import annotations

import abc
from dataclasses import asdict, dataclass
from typing import Callable, TypeVar

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class CommStats:
    bytes: int = 0  # payload handed to collectives by this rank
    collectives: int = 0
    wait_s: float = 0.0  # seconds spent inside synchronize()

    def take(self) -> dict:
        """Return the counts since the last call and start new ones."""
        snapshot = asdict(self)
        self.bytes, self.collectives, self.wait_s = 0, 0, 0.0
        return snapshot


class Communicator(abc.ABC):
    name: str = "abstract"

    def __init__(self, device: torch.device, **options: object) -> None:
        self.device = device
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.stats = CommStats()

    def attach(self, model: nn.Module) -> nn.Module:
        """Prepare for ``model``; returns the module to run forward on. Broadcasts rank 0's
        parameters and buffers so that every rank starts from the same weights."""
        if self.world_size > 1:
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor.data, src=0)
        self.model = model
        return model

    @abc.abstractmethod
    def synchronize(self) -> None:
        """After backward: every parameter's ``grad`` becomes the mean over ranks."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


STRATEGIES: dict[str, type[Communicator]] = {}
C = TypeVar("C", bound=type[Communicator])


def register(name: str) -> Callable[[C], C]:
    def wrap(cls: C) -> C:
        cls.name = name
        STRATEGIES[name] = cls
        return cls
    return wrap


def build_communicator(strategy: str, device: torch.device, **options: object) -> Communicator:
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown comm.strategy '{strategy}' (allowed: {', '.join(sorted(STRATEGIES))})")
    return STRATEGIES[strategy](device, **options)
