"""Synthetic data (``data=synthetic``): fixed random images for throughput runs, no disk or decoding.
Generated on the training device once, so a step measures the model and the communication only."""

from __future__ import annotations

from typing import Iterator

import torch

from gradientflow_repro.data.base import Batch
from gradientflow_repro.data.listing import shard_bounds, steps_per_epoch


class SyntheticSource:
    def __init__(self, *, num_train: int, num_val: int, num_classes: int, image_size: int,
                 local_batch: int, global_batch: int, rank: int, world_size: int,
                 device: torch.device, seed: int, channels_last: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        self.num_train, self.num_val = num_train, num_val
        self.steps_per_epoch = steps_per_epoch(num_train, global_batch)
        generator = torch.Generator().manual_seed(seed * 7 + rank)
        images = torch.randn(local_batch, 3, image_size, image_size, generator=generator).to(device, dtype)
        # data.channels_last: the same values in channels_last memory, as the image loaders deliver them
        self.images = images.contiguous(memory_format=torch.channels_last) if channels_last else images
        self.labels = torch.randint(num_classes, (local_batch,), generator=generator).to(device)
        start, end = shard_bounds(num_val, rank, world_size)
        self.val_count = end - start
        self.local_batch = local_batch

    def train_batches(self, epoch: int, skip: int = 0) -> Iterator[Batch]:
        for _ in range(skip, self.steps_per_epoch):
            yield self.images, self.labels

    def val_batches(self) -> Iterator[Batch]:
        remaining = self.val_count
        while remaining > 0:
            n = min(remaining, self.local_batch)
            yield self.images[:n], self.labels[:n]
            remaining -= n
