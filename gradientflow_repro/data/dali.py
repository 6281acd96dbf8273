"""DALI pipelines: this rank's shard of each epoch's global order, decoding and augmentation.

Without a GPU every operator runs on the CPU (``device_id=None``); with one, JPEGs are decoded by
nvJPEG (``mixed``) and augmented on the GPU.

Training uses one pipeline for the whole run, not one per epoch (building one lists and indexes the
files again: for AlexNet at a 64K batch, with 19 steps per epoch, that would cost as much as the
epoch). An external source feeds it, batch by batch, the encoded files of this rank's shard of the
epoch's global permutation (see ``listing``), with each sample's random-resized-crop window and flip
drawn from a generator keyed by (seed, epoch, position in the epoch): so any batch of any epoch is
the same whatever ran before, and a resumed run sees exactly the images and augmentations of the
uninterrupted one, without replaying the pipeline's random state. The crop is decoded alone
(``decoders.image_slice``: ROI decoding where the format allows), never the whole image. Pipeline
epoch k is the run's epoch ``first + k``; an epoch cut short (``max_steps``, a stop signal) leaves
the pipeline behind its data, so the next call builds a new one.

Validation reads this rank's shard with the last batch padded by the reader and trimmed by the
iterator, so no image counts twice; its pipeline is also built once and rewound after every pass.

Output: float32 NCHW by default; ``ImageOptions.output_dtype=float16`` makes
``crop_mirror_normalize`` emit half precision (fp16 runs: half the bytes, no cast on the GPU) and
``channels_last`` makes it emit NHWC, which reaches torch as ``permute(0, 3, 1, 2)`` of it: an
NCHW-shaped tensor in channels_last memory, no copy.
"""

from __future__ import annotations

import io
import math
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
from nvidia.dali import fn, pipeline_def, types
from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy
from PIL import Image

from gradientflow_repro.data.base import Batch
from gradientflow_repro.data.cpus import loader_cpus, source_queue_depth
from gradientflow_repro.data.listing import ImageOptions, Listing, ShardedFolder, epoch_permutation, shard_bounds
from gradientflow_repro.preemption import ignore_stop_signals, workers_ignore_stop_signals

READER = "Reader"
EXIF_ORIENTATION, TRANSPOSED = 0x0112, (5, 6, 7, 8)  # orientations that swap width and height


def crop_window(width: int, height: int, rng: np.random.Generator, min_scale: float,
                ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
    """torchvision's ``RandomResizedCrop.get_params``, drawn from ``rng``: (x, y, w, h) of a window
    of ``min_scale``..1 of the area and aspect ratio in ``ratio`` (log-uniform); after ten misses, the
    largest centred window the ratio bounds allow."""
    area, log_ratio = width * height, (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(min_scale, 1.0)
        aspect = math.exp(rng.uniform(*log_ratio))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1)), w, h
    aspect = width / height
    if aspect < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif aspect > ratio[1]:
        w, h = round(height * ratio[1]), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def oriented_size(encoded: np.ndarray) -> tuple[int, int]:
    """(width, height) as the decoder will orient the image, from the file's header alone."""
    with Image.open(io.BytesIO(encoded.tobytes())) as image:
        width, height = image.size
        orientation = image.getexif().get(EXIF_ORIENTATION) if image.format == "JPEG" else None
    return (height, width) if orientation in TRANSPOSED else (width, height)


class EpochBatches:
    """The external source: for DALI's (epoch, iteration), this rank's batch of encoded files,
    labels, crop windows and flips. Stateless (everything follows from the arguments), as DALI's
    batch-info sources should be."""

    def __init__(self, train: Listing, seed: int, first_epoch: int, skip: int, rank: int,
                 world_size: int, local_batch: int, steps_per_epoch: int, min_scale: float,
                 flip: bool) -> None:
        self.files, self.labels, self.seed = train.files, train.labels, seed
        self.first_epoch, self.skip, self.rank, self.world_size = first_epoch, skip, rank, world_size
        self.local_batch, self.steps_per_epoch = local_batch, steps_per_epoch
        self.min_scale, self.flip = min_scale, flip
        self._order: tuple[int, list[int]] = (-1, [])

    def __setstate__(self, state: dict) -> None:
        # Unpickled only in a reader worker (DALI sends the source to each spawned worker), so this
        # is the first of our code a worker runs: from now on it ignores the stop signals, which it
        # has held blocked since its birth (preemption.workers_ignore_stop_signals).
        self.__dict__.update(state)
        ignore_stop_signals()

    def epoch_of(self, pipeline_epoch: int) -> int:
        return self.first_epoch + pipeline_epoch

    def image_size(self, index: int, encoded: np.ndarray) -> tuple[int, int]:
        """(width, height) of training file ``index`` as decoded, from its header: parsed for every
        image (a fraction of the feeder's work: ``results/loader.md``), so nothing goes stale."""
        return oriented_size(encoded)

    def __call__(self, info: "types.BatchInfo") -> tuple:
        epoch = self.epoch_of(info.epoch_idx)
        step = info.iteration + (self.skip if info.epoch_idx == 0 else 0)
        if step >= self.steps_per_epoch:
            raise StopIteration
        if self._order[0] != epoch:
            self._order = (epoch, epoch_permutation(len(self.files), self.seed, epoch))
        start, _ = shard_bounds(len(self.files), self.rank, self.world_size)
        first = start + step * self.local_batch
        encoded, labels, anchors, shapes, mirrors = [], [], [], [], []
        for position in range(first, first + self.local_batch):
            index = self._order[1][position]
            data = np.fromfile(self.files[index], dtype=np.uint8)
            rng = np.random.default_rng([self.seed, epoch, position])
            width, height = self.image_size(index, data)
            x, y, w, h = crop_window(width, height, rng, self.min_scale)
            encoded.append(data)
            labels.append(np.array([self.labels[index]], dtype=np.int32))
            anchors.append(np.array([x / width, y / height], dtype=np.float32))
            shapes.append(np.array([w / width, h / height], dtype=np.float32))
            mirrors.append(np.array(int(self.flip and rng.random() < 0.5), dtype=np.int32))
        return encoded, labels, anchors, shapes, mirrors


DALI_DTYPES = {torch.float32: types.FLOAT, torch.float16: types.FLOAT16}


def output_format(options: ImageOptions) -> dict:
    """``crop_mirror_normalize``'s dtype and layout for ``options`` (DALI has no bfloat16: a bf16
    run takes float32 batches, which autocast casts)."""
    if options.output_dtype not in DALI_DTYPES:
        raise ValueError(f"DALI emits float32 or float16 batches, not {options.output_dtype}")
    return dict(dtype=DALI_DTYPES[options.output_dtype], layout="HWC" if options.channels_last else "CHW")


def val_images(jpegs, image_size: int, resize: int, mean: list[float], std: list[float], on_gpu: bool,
               dtype, layout: str):
    """Validation's decoding and augmentation, the same for every reader: shorter side to
    ``resize``, centre crop, normalize."""
    images = fn.decoders.image(jpegs, device="mixed" if on_gpu else "cpu", output_type=types.RGB)
    images = fn.resize(images, resize_shorter=resize)
    return fn.crop_mirror_normalize(images, crop=(image_size, image_size), dtype=dtype,
                                    output_layout=layout, mean=mean, std=std)


@pipeline_def
def train_pipeline(source: EpochBatches, image_size: int, mean: list[float], std: list[float],
                   on_gpu: bool, parallel: bool, dtype, layout: str, source_depth: int = 1):
    # source_depth: batches the reader workers compute ahead (cpus.source_queue_depth); DALI
    # accepts the argument only from a parallel source
    ahead = dict(prefetch_queue_depth=source_depth) if parallel else {}
    jpegs, label, anchor, shape, mirror = fn.external_source(
        source=source, num_outputs=5, batch=True, batch_info=True, parallel=parallel, **ahead)
    # the window in fractions of the image: inside it whatever size the decoder finds
    images = fn.decoders.image_slice(jpegs, anchor, shape, device="mixed" if on_gpu else "cpu",
                                     output_type=types.RGB, normalized_anchor=True,
                                     normalized_shape=True, axis_names="WH")
    images = fn.resize(images, size=(image_size, image_size))
    images = fn.crop_mirror_normalize(images, dtype=dtype, output_layout=layout,
                                      mean=mean, std=std, mirror=mirror)
    return images, label.gpu() if on_gpu else label


@pipeline_def
def val_pipeline(files: list[str], labels: list[int], shard_id: int, num_shards: int,
                 image_size: int, resize: int, mean: list[float], std: list[float], on_gpu: bool,
                 dtype, layout: str):
    jpegs, label = fn.readers.file(files=files, labels=labels, shard_id=shard_id,
                                   num_shards=num_shards, random_shuffle=False, stick_to_shard=True,
                                   pad_last_batch=True, name=READER)  # every pass: this rank's shard
    images = val_images(jpegs, image_size, resize, mean, std, on_gpu, dtype, layout)
    return images, label.gpu() if on_gpu else label


def as_batch(output: list[dict], channels_last: bool) -> Batch:
    """The iterator's output as (images, labels): images NCHW-shaped, in channels_last memory when
    the pipeline emitted NHWC (a view, no copy)."""
    images = output[0]["images"]
    return images.permute(0, 3, 1, 2) if channels_last else images, output[0]["labels"].view(-1).long()


class ValidationPasses:
    """One validation pipeline (from ``build``) kept for every pass and rewound after each; a pass
    cut short drops it, so the next pass starts from a fresh one."""

    def __init__(self, build: Callable[[], Any], channels_last: bool) -> None:
        self.build, self.channels_last = build, channels_last
        self._iterator: Optional[DALIGenericIterator] = None
        self.built = 0

    def __iter__(self) -> Iterator[Batch]:
        if self._iterator is None:
            pipe = self.build()
            with workers_ignore_stop_signals():  # no Python workers today: any it ever starts
                pipe.build()
            self.built += 1
            self._iterator = DALIGenericIterator(pipe, ["images", "labels"], reader_name=READER,
                                                 last_batch_policy=LastBatchPolicy.PARTIAL, auto_reset=True)
        finished = False
        try:
            for output in self._iterator:
                yield as_batch(output, self.channels_last)
            finished = True
        finally:
            if not finished:
                self._iterator = None


class DaliSource(ShardedFolder):
    """``reader_workers``: processes that read the files for the training pipeline (DALI's parallel
    external source); 0 reads them in the training process, enough for small images and CPU
    training. ``reader_workers=None`` and ``options.num_threads=None`` follow the rank's CPUs
    (``cpus.loader_cpus``: on a GPU a quarter of the spare cores read, the rest decode; none read
    on the CPU)."""

    def __init__(self, train: Listing, val: Listing, options: ImageOptions, *, device: torch.device,
                 reader_workers: Optional[int] = None, **shard: int) -> None:
        super().__init__(train, val, options, **shard)
        self.on_gpu = device.type == "cuda"
        self.cpus = loader_cpus(options.num_threads, reader_workers, on_gpu=self.on_gpu)
        self.reader_workers = self.cpus.workers
        self.source_depth = source_queue_depth(options.prefetch, self.reader_workers)
        self.common = dict(batch_size=self.local_batch, num_threads=self.cpus.threads,
                           device_id=device.index if self.on_gpu else None,
                           prefetch_queue_depth=options.prefetch, mean=list(options.mean),
                           std=list(options.std), image_size=options.image_size, on_gpu=self.on_gpu,
                           **output_format(options))
        self._train: Optional[tuple[EpochBatches, DALIGenericIterator]] = None
        self._next_epoch = -1  # the run's epoch the training pipeline delivers next
        self._val = ValidationPasses(lambda: val_pipeline(
            files=self.val.files, labels=self.val.labels, shard_id=self.rank, num_shards=self.world_size,
            resize=self.options.val_resize, seed=self.seed, **self.common), options.channels_last)
        self._train_builds = 0

    @property
    def pipelines_built(self) -> int:
        """For tests and benchmarks: builds should be rare."""
        return self._train_builds + self._val.built

    def _training_iterator(self, epoch: int, skip: int) -> DALIGenericIterator:
        if self._train is not None and epoch == self._next_epoch and skip == 0:
            self._train[1].reset()
            return self._train[1]
        self._train = None  # another epoch, or a resume mid-epoch: a pipeline that starts there
        source = EpochBatches(self.train, self.seed, epoch, skip, self.rank, self.world_size,
                              self.local_batch, self.steps_per_epoch, self.options.min_crop_scale,
                              self.options.flip)
        # "spawn": each reader worker is a fresh interpreter, started by fork and exec with no Python
        # run in between (multiprocessing's spawn, CPython's _posixsubprocess): the threads of the
        # trainer (gloo's, DALI's) cannot leave it holding a lock, as a plain fork of the trainer can
        # (CPython issue 112275; why the torchvision loader's workers come from a fork server)
        pipe = train_pipeline(source=source, seed=self.epoch_seed(epoch), parallel=self.reader_workers > 0,
                              py_num_workers=max(1, self.reader_workers), py_start_method="spawn",
                              source_depth=self.source_depth,
                              **self.common)
        with workers_ignore_stop_signals(processes=self.reader_workers > 0):  # build() starts the workers
            pipe.build()
        self._train_builds += 1
        iterator = DALIGenericIterator(pipe, ["images", "labels"], auto_reset=False)
        self._train = (source, iterator)
        return iterator

    def train_batches(self, epoch: int, skip: int = 0) -> Iterator[Batch]:
        iterator = self._training_iterator(epoch, skip)
        self._next_epoch = -1  # until this epoch is delivered whole
        delivered = skip
        for output in iterator:
            delivered += 1
            yield as_batch(output, self.options.channels_last)
        if delivered == self.steps_per_epoch:
            self._next_epoch = epoch + 1

    def val_batches(self) -> Iterator[Batch]:
        yield from self._val
