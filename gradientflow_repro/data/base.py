"""The data interface the trainer sees: exactly ``steps_per_epoch`` training batches per epoch and one
pass over this rank's validation shard (every validation image on exactly one rank)."""

from __future__ import annotations

from typing import Iterator, Protocol

import torch

Batch = tuple[torch.Tensor, torch.Tensor]


class DataSource(Protocol):
    steps_per_epoch: int
    num_train: int
    num_val: int

    def train_batches(self, epoch: int, skip: int = 0) -> Iterator[Batch]:
        """Batches of ``epoch`` for this rank, starting after ``skip`` of them (resume mid-epoch)."""

    def val_batches(self) -> Iterator[Batch]:
        """This rank's validation shard, each image once, the last batch possibly smaller."""
