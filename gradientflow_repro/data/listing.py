"""Dataset listing and the per-epoch global order shared by every loader.

Each epoch's order is a permutation drawn from (seed, epoch) alone, so every rank computes the same
one and a resumed run replays the exact epoch it stopped in. Rank r reads the r-th contiguous shard
of it (the same split DALI's file reader uses for ``shard_id``/``num_shards``); training reads
``steps_per_epoch * local_batch`` images of its shard, so every rank takes the same number of steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

IMAGE_SUFFIXES = {".jpeg", ".jpg", ".png"}


@dataclass(frozen=True)
class Listing:
    classes: list[str]
    files: list[str]
    labels: list[int]

    def __len__(self) -> int:
        return len(self.files)


class DatasetError(ValueError):
    pass


def list_image_folder(split_dir: Path, classes: list[str] | None = None) -> Listing:
    """Files of ``split_dir/<class>/*`` in sorted order; labels index ``classes`` (default: the
    sorted class folders). Empty class folders and classes unknown to ``classes`` are errors."""
    if not split_dir.is_dir():
        raise DatasetError(f"{split_dir}: not a directory")
    found = sorted(p.name for p in split_dir.iterdir() if p.is_dir())
    if classes is None:
        classes = found
    elif found != classes:
        missing, extra = sorted(set(classes) - set(found)), sorted(set(found) - set(classes))
        raise DatasetError(f"{split_dir}: class folders differ from training "
                           f"(missing {missing[:5]}, extra {extra[:5]})")
    files: list[str] = []
    labels: list[int] = []
    for label, name in enumerate(classes):
        images = sorted(str(p) for p in (split_dir / name).iterdir()
                        if p.suffix.lower() in IMAGE_SUFFIXES)
        if not images:
            raise DatasetError(f"{split_dir / name}: class folder has no images")
        files += images
        labels += [label] * len(images)
    return Listing(classes, files, labels)


JPEG_START, PNG_START = b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n"


def file_problem(path: str) -> str | None:
    """What would break decoding, found without a decoder (cheap enough for every file of
    ImageNet at start-up): an empty file, content that is neither JPEG nor PNG whatever the name
    says, or a JPEG cut short (no end-of-image marker near its end). PNG content, grayscale and
    CMYK JPEGs are fine: the loaders decode them to RGB."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(8)
            size = handle.seek(0, 2)
            handle.seek(max(0, size - 4096))
            tail = handle.read()
    except OSError as error:
        return f"unreadable: {error.strerror}"
    if size == 0:
        return "empty file"
    if head.startswith(JPEG_START):
        return None if b"\xff\xd9" in tail else "JPEG without its end-of-image marker (truncated)"
    if head.startswith(PNG_START):
        return None if b"IEND" in tail else "PNG without its IEND chunk (truncated)"
    return f"neither JPEG nor PNG (starts with bytes {head[:4].hex()})"


def file_problems(paths: list[str], threads: int = 16) -> list[tuple[str, str]]:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=threads) as pool:
        return [(p, problem) for p, problem in zip(paths, pool.map(file_problem, paths, chunksize=64))
                if problem]


def epoch_permutation(n: int, seed: int, epoch: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=generator).tolist()


def shard_bounds(n: int, shard: int, num_shards: int) -> tuple[int, int]:
    """The contiguous shard DALI's readers give ``shard_id`` out of ``num_shards``."""
    return n * shard // num_shards, n * (shard + 1) // num_shards


def steps_per_epoch(n: int, global_batch: int) -> int:
    steps = n // global_batch
    if steps == 0:
        raise DatasetError(f"training set of {n} images is smaller than global_batch_size={global_batch}")
    return steps


@dataclass(frozen=True)
class ImageOptions:
    """Decoding and augmentation settings shared by the DALI and torchvision loaders."""

    image_size: int
    val_resize: int
    min_crop_scale: float
    flip: bool
    mean: tuple[float, ...]
    std: tuple[float, ...]
    num_threads: Optional[int]  # None: follow the rank's CPUs (cpus.loader_cpus)
    prefetch: int
    # batches as NCHW-shaped tensors in channels_last memory (DALI emits NHWC; the torchvision
    # loader converts), for cuDNN's NHWC tensor-core convolutions
    channels_last: bool = False
    output_dtype: torch.dtype = torch.float32  # float16 for fp16 runs: DALI emits half directly


class ShardedFolder:
    """What both folder loaders share: the listings, this rank's place, steps per epoch, and the
    seed of each (epoch, rank) that makes augmentation replayable."""

    def __init__(self, train: Listing, val: Listing, options: ImageOptions, *, local_batch: int,
                 global_batch: int, rank: int, world_size: int, seed: int) -> None:
        self.train, self.val, self.options = train, val, options
        self.num_train, self.num_val = len(train), len(val)
        self.steps_per_epoch = steps_per_epoch(len(train), global_batch)
        self.local_batch, self.rank, self.world_size, self.seed = local_batch, rank, world_size, seed

    def epoch_seed(self, epoch: int) -> int:
        return (self.seed * 100_003 + epoch * 1_009 + self.rank) % 2**31
