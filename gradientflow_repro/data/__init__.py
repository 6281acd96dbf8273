"""Data sources by configuration: an ImageNet-layout folder read by DALI (default) or the torchvision
fallback, webdataset shards read by DALI (``data.kind=shards``, for ImageNet at scale), or synthetic."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from gradientflow_repro.data.base import Batch, DataSource
from gradientflow_repro.data.listing import DatasetError, ImageOptions, file_problems, list_image_folder

if TYPE_CHECKING:  # only the type: ``config`` imports Hydra, and the readers must import without it
    from gradientflow_repro.config import DataConfig


def batch_dtype(precision: str) -> torch.dtype:
    """The images' dtype for a run in ``precision`` (``precision.dtype``): float16 for fp16 (DALI
    emits it directly), float32 otherwise (DALI has no bfloat16; autocast casts)."""
    return torch.float16 if precision == "fp16" else torch.float32


def build_data(cfg: DataConfig, *, global_batch: int, rank: int, world_size: int,
               device: torch.device, seed: int, output_dtype: torch.dtype = torch.float32) -> DataSource:
    """The data source ``cfg`` describes, for this rank. ``output_dtype``: the training and
    validation images' dtype (``batch_dtype``); ``data.channels_last`` their memory layout."""
    local_batch = global_batch // world_size
    if cfg.kind == "synthetic":
        from gradientflow_repro.data.synthetic import SyntheticSource
        return SyntheticSource(num_train=cfg.synthetic_train_size, num_val=cfg.synthetic_val_size,
                               num_classes=cfg.num_classes, image_size=cfg.image_size,
                               local_batch=local_batch, global_batch=global_batch, rank=rank,
                               world_size=world_size, device=device, seed=seed,
                               channels_last=cfg.channels_last, dtype=output_dtype)
    options = ImageOptions(cfg.image_size, cfg.val_resize, cfg.min_crop_scale, cfg.flip,
                           tuple(cfg.mean), tuple(cfg.std), cfg.num_threads, cfg.prefetch,
                           channels_last=cfg.channels_last, output_dtype=output_dtype)
    shard = dict(local_batch=local_batch, global_batch=global_batch, rank=rank,
                 world_size=world_size, seed=seed)
    if cfg.kind == "shards":
        return _shard_source(cfg, options, device, shard)
    root = Path(cfg.root)
    train = list_image_folder(root / "train")
    val = list_image_folder(root / "val", train.classes)
    if len(train.classes) != cfg.num_classes:
        raise DatasetError(f"{root}: {len(train.classes)} class folders but data.num_classes="
                           f"{cfg.num_classes}")
    if cfg.verify_files:
        verify_files(train.files + val.files, rank, world_size)
    if cfg.loader == "dali":
        from gradientflow_repro.data.dali import DaliSource
        return DaliSource(train, val, options, device=device, reader_workers=cfg.reader_workers, **shard)
    from gradientflow_repro.data.folder import TorchvisionSource
    return TorchvisionSource(train, val, options, device=device, reader_workers=cfg.reader_workers,
                             **shard)


def _shard_source(cfg: DataConfig, options: ImageOptions, device: torch.device, shard: dict) -> DataSource:
    """Shards (``shards.py``): the manifest read once, every shard file checked against it, before
    any pipeline is built; errors name the key or the file."""
    from gradientflow_repro.data.shards import load_manifest

    if not cfg.root:
        raise DatasetError("data.root: data.kind=shards needs the folder of the shards' manifest.json")
    if cfg.loader != "dali":
        raise DatasetError(f"data.loader={cfg.loader}: shards are read by DALI only (data.loader=dali)")
    manifest = load_manifest(Path(cfg.root))
    if len(manifest.classes) != cfg.num_classes:
        raise DatasetError(f"{manifest.root / 'manifest.json'}: {len(manifest.classes)} classes but "
                           f"data.num_classes={cfg.num_classes}")
    from gradientflow_repro.data.shard_reader import ShardSource

    return ShardSource(manifest, options, device=device, shuffle_buffer=cfg.shuffle_buffer, **shard)


def verify_files(files: list[str], rank: int, world_size: int) -> None:
    """Every rank checks its slice of the files; all ranks raise the same error, naming every bad
    file, before any training (a decoder failing deep inside DALI names none)."""
    import torch.distributed as dist

    lo, hi = len(files) * rank // world_size, len(files) * (rank + 1) // world_size
    problems = file_problems(files[lo:hi])
    if dist.is_initialized() and world_size > 1:
        gathered: list = [None] * world_size
        dist.all_gather_object(gathered, problems)
        problems = [item for part in gathered for item in part]
    if problems:
        listed = "\n".join(f"  {path}: {problem}" for path, problem in problems[:50])
        more = f"\n  ... and {len(problems) - 50} more" if len(problems) > 50 else ""
        raise DatasetError(f"{len(problems)} image file(s) cannot be decoded:\n{listed}{more}\n"
                           "Fix or remove them (scripts/prepare_imagenet.py --check lists them all), "
                           "or set data.verify_files=false to skip this check")


__all__ = ["Batch", "DataSource", "DatasetError", "batch_dtype", "build_data"]
