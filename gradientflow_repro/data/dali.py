"""DALI pipelines: file reader sharded by global rank, decoding and augmentation.

Without a GPU every operator runs on the CPU (``device_id=None``); with one, JPEGs are decoded by
nvJPEG (``mixed``) and augmented on the GPU. Training builds one pipeline per epoch over that epoch's
global permutation (see ``listing``), seeded by (seed, epoch, rank), so a resumed run sees exactly
the images and augmentations the uninterrupted run would have. Validation reads this rank's shard
with the last batch padded by the reader and trimmed by the iterator, so no image counts twice.
"""

from __future__ import annotations

from typing import Iterator

import torch
from nvidia.dali import fn, pipeline_def, types
from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

from gradientflow_repro.data.base import Batch
from gradientflow_repro.data.listing import ImageOptions, Listing, ShardedFolder, epoch_permutation

READER = "Reader"


@pipeline_def
def train_pipeline(files: list[str], labels: list[int], shard_id: int, num_shards: int,
                   image_size: int, min_crop_scale: float, flip: bool, mean: list[float],
                   std: list[float], on_gpu: bool):
    jpegs, label = fn.readers.file(files=files, labels=labels, shard_id=shard_id,
                                   num_shards=num_shards, random_shuffle=False, name=READER)
    images = fn.decoders.image(jpegs, device="mixed" if on_gpu else "cpu", output_type=types.RGB)
    images = fn.random_resized_crop(images, size=(image_size, image_size),
                                    random_area=(min_crop_scale, 1.0))
    mirror = fn.random.coin_flip(probability=0.5) if flip else 0
    images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW",
                                      mean=mean, std=std, mirror=mirror)
    return images, label.gpu() if on_gpu else label


@pipeline_def
def val_pipeline(files: list[str], labels: list[int], shard_id: int, num_shards: int,
                 image_size: int, resize: int, mean: list[float], std: list[float], on_gpu: bool):
    jpegs, label = fn.readers.file(files=files, labels=labels, shard_id=shard_id,
                                   num_shards=num_shards, random_shuffle=False,
                                   pad_last_batch=True, name=READER)
    images = fn.decoders.image(jpegs, device="mixed" if on_gpu else "cpu", output_type=types.RGB)
    images = fn.resize(images, resize_shorter=resize)
    images = fn.crop_mirror_normalize(images, crop=(image_size, image_size), dtype=types.FLOAT,
                                      output_layout="CHW", mean=mean, std=std)
    return images, label.gpu() if on_gpu else label


def _as_batch(output: list[dict]) -> Batch:
    return output[0]["images"], output[0]["labels"].view(-1).long()


class DaliSource(ShardedFolder):
    def __init__(self, train: Listing, val: Listing, options: ImageOptions, *, device: torch.device,
                 **shard: int) -> None:
        super().__init__(train, val, options, **shard)
        self.on_gpu = device.type == "cuda"
        self.common = dict(batch_size=self.local_batch, num_threads=options.num_threads,
                           device_id=device.index if self.on_gpu else None,
                           prefetch_queue_depth=options.prefetch, mean=list(options.mean),
                           std=list(options.std), image_size=options.image_size, on_gpu=self.on_gpu)

    def train_batches(self, epoch: int, skip: int = 0) -> Iterator[Batch]:
        order = epoch_permutation(len(self.train), self.seed, epoch)
        pipe = train_pipeline(files=[self.train.files[i] for i in order],
                              labels=[self.train.labels[i] for i in order],
                              shard_id=self.rank, num_shards=self.world_size,
                              seed=self.epoch_seed(epoch), min_crop_scale=self.options.min_crop_scale,
                              flip=self.options.flip, **self.common)
        pipe.build()
        iterator = DALIGenericIterator(pipe, ["images", "labels"], reader_name=READER,
                                       last_batch_policy=LastBatchPolicy.DROP)
        for step, output in enumerate(iterator):
            if step >= self.steps_per_epoch:
                break
            if step >= skip:
                yield _as_batch(output)
        del iterator, pipe

    def val_batches(self) -> Iterator[Batch]:
        # A fresh pipeline per pass: an evaluation cut short can never shift the next one.
        pipe = val_pipeline(files=self.val.files, labels=self.val.labels, shard_id=self.rank,
                            num_shards=self.world_size, resize=self.options.val_resize, seed=self.seed,
                            **self.common)
        pipe.build()
        iterator = DALIGenericIterator(pipe, ["images", "labels"], reader_name=READER,
                                       last_batch_policy=LastBatchPolicy.PARTIAL)
        for output in iterator:
            yield _as_batch(output)
        del iterator, pipe
