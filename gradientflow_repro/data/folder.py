"""torchvision fallback loader (``data.loader=torchvision``): the same files, order and sharding as
the DALI path, decoded by PIL in DataLoader workers. Useful where DALI is unavailable and as the
reference the DALI pipeline is benchmarked against."""

from __future__ import annotations

from typing import Iterator, Optional

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms

from gradientflow_repro.data.base import Batch
from gradientflow_repro.data.cpus import loader_cpus
from gradientflow_repro.data.listing import ImageOptions, Listing, ShardedFolder, epoch_permutation, shard_bounds
from gradientflow_repro.preemption import ignore_stop_signals, workers_ignore_stop_signals


def to_device(images: torch.Tensor, labels: torch.Tensor, device: torch.device) -> Batch:
    """Both tensors copied without waiting for the host: on CUDA the DataLoader pins its batches
    (``pin_memory``), so a ``non_blocking`` copy is queued on the stream and the step goes on (a
    blocking one would stall every step until the copy lands); on the CPU nothing is copied."""
    return images.to(device, non_blocking=True), labels.to(device, non_blocking=True)


def _own_generator(seed: int) -> torch.Generator:
    """For the DataLoader's one draw per iterator (its workers' base seed): without a generator of
    its own it draws from the trainer's global RNG, so a run resumed mid-epoch, which starts one
    more iterator than the uninterrupted run at that point, would draw other dropout masks from then
    on. (The samples do not use that seed: ``_Files`` seeds each one itself.)"""
    return torch.Generator().manual_seed(seed)


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


class TorchvisionSource(ShardedFolder):
    def __init__(self, train: Listing, val: Listing, options: ImageOptions, *, device: torch.device,
                 reader_workers: Optional[int] = None, **shard: int) -> None:
        super().__init__(train, val, options, **shard)
        self.device = device
        # reader_workers (data.reader_workers) where given; else num_threads=None: every spare core
        # decodes (cpus.loader_cpus; no separate readers here)
        workers = (loader_cpus(options.num_threads, 0, on_gpu=device.type == "cuda").threads
                   if reader_workers is None else reader_workers)
        # the workers ignore the stop signals: only the trainer decides (preemption.py)
        self.loader_args = dict(batch_size=self.local_batch, num_workers=workers,
                                worker_init_fn=ignore_stop_signals,
                                pin_memory=device.type == "cuda",
                                prefetch_factor=options.prefetch if workers > 0 else None)
        normalize = transforms.Normalize([m / 255 for m in options.mean], [s / 255 for s in options.std])
        augment = [transforms.RandomResizedCrop(options.image_size, scale=(options.min_crop_scale, 1.0))]
        if options.flip:
            augment.append(transforms.RandomHorizontalFlip())
        self.train_transform = transforms.Compose([*augment, transforms.ToTensor(), normalize])
        self.val_transform = transforms.Compose([transforms.Resize(options.val_resize),
                                                 transforms.CenterCrop(options.image_size),
                                                 transforms.ToTensor(), normalize])

    def train_batches(self, epoch: int, skip: int = 0) -> Iterator[Batch]:
        order = epoch_permutation(len(self.train), self.seed, epoch)
        start, _ = shard_bounds(len(order), self.rank, self.world_size)
        mine = order[start:start + self.steps_per_epoch * self.local_batch]
        dataset = _Files([self.train.files[i] for i in mine], [self.train.labels[i] for i in mine],
                         self.train_transform, seed=self.epoch_seed(epoch) * 1_000_003)
        loader = DataLoader(dataset, shuffle=False, drop_last=True, generator=_own_generator(epoch),
                            **self.loader_args)
        with workers_ignore_stop_signals():  # the workers start with the iterator
            batches = iter(loader)
        for step, (images, labels) in enumerate(batches):
            if step >= skip:
                yield to_device(images, labels, self.device)

    def val_batches(self) -> Iterator[Batch]:
        start, end = shard_bounds(len(self.val), self.rank, self.world_size)
        dataset = _Files(self.val.files[start:end], self.val.labels[start:end], self.val_transform)
        with workers_ignore_stop_signals():  # the workers start with the iterator
            batches = iter(DataLoader(dataset, shuffle=False, generator=_own_generator(0), **self.loader_args))
        for images, labels in batches:
            yield to_device(images, labels, self.device)
