"""Data sources by configuration: DALI (default), torchvision folder fallback, or synthetic."""

from __future__ import annotations

from pathlib import Path

import torch

from gradientflow_repro.config import DataConfig
from gradientflow_repro.data.base import Batch, DataSource
from gradientflow_repro.data.listing import DatasetError, ImageOptions, list_image_folder


def build_data(cfg: DataConfig, *, global_batch: int, rank: int, world_size: int,
               device: torch.device, seed: int) -> DataSource:
    local_batch = global_batch // world_size
    if cfg.kind == "synthetic":
        from gradientflow_repro.data.synthetic import SyntheticSource
        return SyntheticSource(num_train=cfg.synthetic_train_size, num_val=cfg.synthetic_val_size,
                               num_classes=cfg.num_classes, image_size=cfg.image_size,
                               local_batch=local_batch, global_batch=global_batch, rank=rank,
                               world_size=world_size, device=device, seed=seed)
    root = Path(cfg.root)
    train = list_image_folder(root / "train")
    val = list_image_folder(root / "val", train.classes)
    if len(train.classes) != cfg.num_classes:
        raise DatasetError(f"{root}: {len(train.classes)} class folders but data.num_classes="
                           f"{cfg.num_classes}")
    options = ImageOptions(cfg.image_size, cfg.val_resize, cfg.min_crop_scale, cfg.flip,
                           tuple(cfg.mean), tuple(cfg.std), cfg.num_threads, cfg.prefetch)
    shard = dict(local_batch=local_batch, global_batch=global_batch, rank=rank,
                 world_size=world_size, seed=seed)
    if cfg.loader == "dali":
        from gradientflow_repro.data.dali import DaliSource
        return DaliSource(train, val, options, device=device, **shard)
    from gradientflow_repro.data.folder import TorchvisionSource
    return TorchvisionSource(train, val, options, device=device, **shard)


__all__ = ["Batch", "DataSource", "DatasetError", "build_data"]
