"""The CUDA path: skipped (and reported as skipped) on machines without a GPU."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import torch

from gradientflow_repro.data.dali import DaliSource
from gradientflow_repro.data.listing import ImageOptions, list_image_folder

from conftest import free_port, requires_cuda

pytestmark = requires_cuda("CUDA path: needs a GPU (DALI mixed decoding, NCCL)")


def test_dali_mixed_decoding_on_gpu(digits_root: Path) -> None:
    train = list_image_folder(digits_root / "train")
    val = list_image_folder(digits_root / "val", train.classes)
    options = ImageOptions(image_size=32, val_resize=32, min_crop_scale=0.6, flip=False,
                           mean=(0.0,) * 3, std=(255.0,) * 3, num_threads=2, prefetch=2)
    src = DaliSource(train, val, options, device=torch.device("cuda", 0), local_batch=32,
                     global_batch=32, rank=0, world_size=1, seed=0)
    images, labels = next(src.train_batches(0))
    assert images.is_cuda and labels.is_cuda and images.shape == (32, 3, 32, 32)
    assert sum(y.numel() for _, y in src.val_batches()) == len(val)


def test_nccl_single_rank_allreduce() -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60),
                            device_id=torch.device("cuda", 0))
    try:
        tensor = torch.arange(7, dtype=torch.float32, device="cuda")
        dist.all_reduce(tensor)
        assert torch.equal(tensor.cpu(), torch.arange(7, dtype=torch.float32))
    finally:
        dist.destroy_process_group()
