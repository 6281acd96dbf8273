"""torchvision fallback loader (``data.loader=torchvision``): the same files, order and sharding as
the DALI path, decoded by PIL in DataLoader workers. Useful where DALI is unavailable and as the
reference the DALI pipeline is benchmarked against."""

from __future__ import annotations

from typing import Iterator

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms

from gradientflow_repro.data.base import Batch
from gradientflow_repro.data.listing import Listing, epoch_permutation, shard_bounds, steps_per_epoch


class _Files(Dataset):
    """Each sample's augmentation is seeded by (``seed``, position), so batches do not depend on the
    number of workers or on what ran before, and the trainer's own RNG is left untouched."""

    def __init__(self, files: list[str], labels: list[int], transform: transforms.Compose,
                 seed: int = 0) -> None:
        self.files, self.labels, self.transform, self.seed = files, labels, transform, seed

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        with Image.open(self.files[index]) as image, torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed + index)
            return self.transform(image.convert("RGB")), self.labels[index]


class TorchvisionSource:
    def __init__(self, train: Listing, val: Listing, *, local_batch: int, global_batch: int,
                 rank: int, world_size: int, device: torch.device, seed: int, image_size: int,
                 val_resize: int, min_crop_scale: float, flip: bool, mean: list[float],
                 std: list[float], num_threads: int, prefetch: int) -> None:
        self.train, self.val = train, val
        self.num_train, self.num_val = len(train), len(val)
        self.steps_per_epoch = steps_per_epoch(len(train), global_batch)
        self.local_batch, self.rank, self.world_size, self.seed = local_batch, rank, world_size, seed
        self.device = device
        self.loader_args = dict(batch_size=local_batch, num_workers=num_threads,
                                pin_memory=device.type == "cuda",
                                prefetch_factor=prefetch if num_threads > 0 else None,
                                persistent_workers=False)
        normalize = transforms.Normalize([m / 255 for m in mean], [s / 255 for s in std])
        augment = [transforms.RandomResizedCrop(image_size, scale=(min_crop_scale, 1.0))]
        if flip:
            augment.append(transforms.RandomHorizontalFlip())
        self.train_transform = transforms.Compose([*augment, transforms.ToTensor(), normalize])
        self.val_transform = transforms.Compose([transforms.Resize(val_resize),
                                                 transforms.CenterCrop(image_size),
                                                 transforms.ToTensor(), normalize])

    def train_batches(self, epoch: int, skip: int = 0) -> Iterator[Batch]:
        order = epoch_permutation(len(self.train), self.seed, epoch)
        start, _ = shard_bounds(len(order), self.rank, self.world_size)
        mine = order[start:start + self.steps_per_epoch * self.local_batch]
        dataset = _Files([self.train.files[i] for i in mine], [self.train.labels[i] for i in mine],
                         self.train_transform,
                         seed=(self.seed * 100_003 + epoch * 1_009 + self.rank) * 1_000_003)
        loader = DataLoader(dataset, shuffle=False, drop_last=True, **self.loader_args)
        for step, (images, labels) in enumerate(loader):
            if step >= skip:
                yield images.to(self.device, non_blocking=True), labels.to(self.device)

    def val_batches(self) -> Iterator[Batch]:
        start, end = shard_bounds(len(self.val), self.rank, self.world_size)
        dataset = _Files(self.val.files[start:end], self.val.labels[start:end], self.val_transform)
        for images, labels in DataLoader(dataset, shuffle=False, **self.loader_args):
            yield images.to(self.device, non_blocking=True), labels.to(self.device)
