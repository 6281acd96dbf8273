"""Training and validation from webdataset shards (``data.kind=shards``): DALI's own reader,
``fn.readers.webdataset``, over the shards a manifest lists (``shards.py``).

The manifest is read once per rank; no folder is listed. Each rank's reader maps every shard (one
open per file at start-up, none afterwards), reads its part of the split front to back through a
shuffle buffer of ``data.shuffle_buffer`` samples, decodes each image's random-resized crop alone
(``decoders.image_random_crop``, the window drawn by DALI) and flips with DALI's coin. One training
pipeline serves the whole run: no rebuild between epochs.

What an epoch is. DALI splits the split's samples into ``world_size`` contiguous parts and pads
every part to the largest with copies of its last sample (``pad_last_batch``), then to whole
batches; a reader epoch is that many batches, after which DALI empties its shuffle buffer and the
rank moves on to the next part (rank r reads part ``(r + e) mod world_size`` in epoch e: no
``stick_to_shard``). Training takes the first ``steps_per_epoch`` batches of each reader epoch and
drops the rest: ``discarded_per_epoch``, 0 or 1 batch holding the images the folder reader leaves
out too and DALI's padding (at ImageNet's 1.28M images, 512 ranks and 128 per rank, 1 batch in 20
is decoded and dropped). So within an epoch no image is seen twice, every rank takes the same
number of steps, and when the split divides into whole global batches every image is seen exactly
once per epoch.

What resume means here. The folder reader replays a resumed epoch exactly; a shuffle buffer's state
is not saved, so here a run resumed in epoch e rebuilds the pipeline with each rank on the part it
reads in epoch e (the same images per rank and epoch as the uninterrupted run, from then on) and a
seed drawn from (seed, epoch, rank): another order inside each epoch. Resumed mid-epoch, it skips
(decodes and drops) the batches already trained, so the rest of that one epoch is a random subset
of the right size of the rank's part: some images of it are seen twice, as many not at all.

Validation reads each rank's part in stored order, the last batch padded by the reader and trimmed
by the iterator (each image once), from one pipeline rewound after every pass, as the folder
reader's does.
"""

from __future__ import annotations

import math
from typing import Iterator, Optional

import torch
from nvidia.dali import fn, pipeline_def, types
from nvidia.dali.plugin.pytorch import DALIGenericIterator

from gradientflow_repro.data.base import Batch
from gradientflow_repro.data.cpus import loader_cpus
from gradientflow_repro.data.dali import READER, ValidationPasses, as_batch, output_format, val_images
from gradientflow_repro.data.listing import ImageOptions, steps_per_epoch
from gradientflow_repro.data.shards import IMAGE, LABEL, Manifest, SplitShards
from gradientflow_repro.preemption import workers_ignore_stop_signals


def _reader(split: SplitShards, shard_id: int, num_shards: int, **settings):
    return fn.readers.webdataset(paths=split.tars, index_paths=split.indexes, ext=[IMAGE, LABEL],
                                 dtypes=[types.UINT8, types.INT32], missing_component_behavior="error",
                                 shard_id=shard_id, num_shards=num_shards, pad_last_batch=True,
                                 name=READER, **settings)


@pipeline_def
def shard_train_pipeline(split: SplitShards, shard_id: int, num_shards: int, shuffle_buffer: int,
                         image_size: int, min_scale: float, flip: bool, mean: list[float],
                         std: list[float], on_gpu: bool, dtype, layout: str):
    jpegs, labels = _reader(split, shard_id, num_shards, random_shuffle=True, initial_fill=shuffle_buffer,
                            stick_to_shard=False)
    images = fn.decoders.image_random_crop(jpegs, device="mixed" if on_gpu else "cpu", output_type=types.RGB,
                                           random_area=[min_scale, 1.0], random_aspect_ratio=[3 / 4, 4 / 3],
                                           num_attempts=10)
    images = fn.resize(images, size=(image_size, image_size))
    mirror = fn.random.coin_flip(probability=0.5) if flip else 0
    images = fn.crop_mirror_normalize(images, dtype=dtype, output_layout=layout, mean=mean, std=std,
                                      mirror=mirror)
    return images, labels.gpu() if on_gpu else labels


@pipeline_def
def shard_val_pipeline(split: SplitShards, shard_id: int, num_shards: int, image_size: int, resize: int,
                       mean: list[float], std: list[float], on_gpu: bool, dtype, layout: str):
    jpegs, labels = _reader(split, shard_id, num_shards, random_shuffle=False, stick_to_shard=True)
    images = val_images(jpegs, image_size, resize, mean, std, on_gpu, dtype, layout)
    return images, labels.gpu() if on_gpu else labels


def reader_epoch_batches(samples: int, world_size: int, local_batch: int) -> int:
    """Batches in each rank's reader epoch: its part padded to the largest part, then to whole
    batches (DALI's ``pad_last_batch``)."""
    return math.ceil(math.ceil(samples / world_size) / local_batch)


class ShardSource:
    """The ``DataSource`` over a manifest's shards; ``shuffle_buffer``: DALI's ``initial_fill``."""

    def __init__(self, manifest: Manifest, options: ImageOptions, *, device: torch.device,
                 shuffle_buffer: int, local_batch: int, global_batch: int, rank: int, world_size: int,
                 seed: int) -> None:
        self.manifest, self.options, self.shuffle_buffer = manifest, options, shuffle_buffer
        self.num_train, self.num_val = manifest.train.samples, manifest.val.samples
        self.steps_per_epoch = steps_per_epoch(self.num_train, global_batch)
        self.discarded_per_epoch = (reader_epoch_batches(self.num_train, world_size, local_batch)
                                    - self.steps_per_epoch)
        self.local_batch, self.rank, self.world_size, self.seed = local_batch, rank, world_size, seed
        self.on_gpu = device.type == "cuda"
        self.common = dict(batch_size=local_batch,
                           num_threads=loader_cpus(options.num_threads, 0, on_gpu=self.on_gpu).threads,
                           device_id=device.index if self.on_gpu else None, prefetch_queue_depth=options.prefetch,
                           mean=list(options.mean), std=list(options.std), image_size=options.image_size,
                           on_gpu=self.on_gpu, num_shards=world_size, **output_format(options))
        self._train: Optional[DALIGenericIterator] = None
        self._next_epoch = -1  # the run's epoch the training pipeline delivers next
        self._val = ValidationPasses(lambda: shard_val_pipeline(
            split=manifest.val, shard_id=rank, resize=options.val_resize, seed=seed, **self.common),
            options.channels_last)
        self._train_builds = 0

    @property
    def pipelines_built(self) -> int:
        return self._train_builds + self._val.built

    def epoch_seed(self, epoch: int) -> int:
        return (self.seed * 100_003 + epoch * 1_009 + self.rank) % 2**31

    def _training_iterator(self, epoch: int, skip: int) -> DALIGenericIterator:
        if self._train is not None and epoch == self._next_epoch and skip == 0:
            return self._train
        self._train = None  # a first epoch, a resume, or an epoch cut short: a pipeline that starts here
        pipe = shard_train_pipeline(split=self.manifest.train, shard_id=(self.rank + epoch) % self.world_size,
                                    shuffle_buffer=self.shuffle_buffer, min_scale=self.options.min_crop_scale,
                                    flip=self.options.flip, seed=self.epoch_seed(epoch), **self.common)
        with workers_ignore_stop_signals():  # no Python workers: any DALI ever starts
            pipe.build()
        self._train_builds += 1
        # no reader_name: the iterator never ends an epoch by itself; train_batches counts
        self._train = DALIGenericIterator(pipe, ["images", "labels"], auto_reset=False)
        return self._train

    def train_batches(self, epoch: int, skip: int = 0) -> Iterator[Batch]:
        iterator = self._training_iterator(epoch, skip)
        self._next_epoch = -1  # until this epoch is delivered whole
        for _ in range(skip):
            next(iterator)
        for _ in range(skip, self.steps_per_epoch):
            yield as_batch(next(iterator), self.options.channels_last)
        for _ in range(self.discarded_per_epoch):  # the rest of the reader epoch
            next(iterator)
        self._next_epoch = epoch + 1

    def val_batches(self) -> Iterator[Batch]:
        yield from self._val
