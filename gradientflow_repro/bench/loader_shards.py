"""ImageNet from shards against files -> the ``shards`` part of results/loader.json, rendered as the
section "ImageNet from shards against files" of results/loader.md.

The same synthetic ImageNet-sized JPEGs (``loader.synthetic_imagenet``) read by one DALI thread
from the folder (``data.kind=folder``: one file per image, the external source of
``dali.EpochBatches``) and from webdataset shards (``data.kind=shards``: DALI's webdataset reader,
``data/shard_reader.py``), first reading only (what a rank's CPU does on a GPU node, where nvJPEG
decodes), then with decoding to 224-pixel crops; images/s, images per CPU-second of the process and
files opened per second (counted by inotify, without tracing the loader); hence the CPU cores per
GPU the paper's pace needs. ``bench_shards`` returns the measurements with their ``summary`` (the
ratios and the goals' verdicts); ``render/bench_loader.py`` words them.
"""

from __future__ import annotations

import logging
import os
import statistics
import struct
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from gradientflow_repro.bench import provenance
from gradientflow_repro.bench.loader import _feeder, synthetic_imagenet
from gradientflow_repro.data.dali import DaliSource, EpochBatches
from gradientflow_repro.data.listing import ImageOptions, list_image_folder
from gradientflow_repro.provenance import environment_facts

log = logging.getLogger(__name__)
SHARDS_GOAL_RATIO = 2.0  # shards at least 2x the images/s of files per reader thread
PAPER_IMAGES_PER_S, PAPER_GPUS = 1.35e6, 512  # the paper's AlexNet pace, over all its GPUs
IN_OPEN, IN_ISDIR, IN_Q_OVERFLOW = 0x20, 0x40000000, 0x4000


class OpenCounter:
    """Files opened in the watched folders, by any thread or process (inotify's IN_OPEN; Linux):
    what a loader costs a file system's metadata service, counted without tracing the loader."""

    def __init__(self, folders: list[Path]) -> None:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.inotify_init1(os.O_NONBLOCK)
        if self.fd < 0 or any(libc.inotify_add_watch(self.fd, str(f).encode(), IN_OPEN) < 0 for f in folders):
            raise OSError(ctypes.get_errno(), "inotify")
        self.count, self.overflowed = 0, False

    def drain(self) -> int:
        """Reads the events so far (the kernel's queue is bounded: drain every batch); the count."""
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return self.count
            at = 0
            while at < len(data):
                _, mask, _, length = struct.unpack_from("iIII", data, at)
                self.overflowed |= bool(mask & IN_Q_OVERFLOW)
                self.count += bool(mask & IN_OPEN and length and not mask & IN_ISDIR)
                at += 16 + length

    def close(self) -> None:
        os.close(self.fd)


def _rate(next_batch: Callable[[], Any], batch: int, batches: int, counter: OpenCounter) -> dict:
    """Wall images/s, images per CPU-second of this process (all its threads) and files opened per
    second over ``batches`` batches after a warm-up one; and the files opened since ``counter``
    started until the warm-up batch came (the pipeline's build and first batches)."""
    next_batch()
    start_opens, counter.count = counter.drain(), 0
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(batches):
        next_batch()
        counter.drain()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"images_per_s": batches * batch / wall, "images_per_cpu_s": batches * batch / cpu,
            "opens_per_s": counter.drain() / wall, "opens_at_start": start_opens, "overflowed": counter.overflowed}


def _reader_only(kind: str, root: Path, shards: Path, batch: int) -> Callable[[], None]:
    """``next_batch`` of a one-thread DALI pipeline that only reads (what a rank's CPU does when
    nvJPEG decodes): the folder's feeder in this process, or DALI's webdataset reader."""
    from nvidia.dali import fn, pipeline_def

    from gradientflow_repro.data.shard_reader import _reader
    from gradientflow_repro.data.shards import load_manifest

    if kind == "files":
        listing = list_image_folder(root / "train")
        feeder = _feeder(EpochBatches, listing, batch)

        @pipeline_def(batch_size=batch, num_threads=1, device_id=None, prefetch_queue_depth=2)
        def files():
            return tuple(fn.external_source(source=feeder, num_outputs=5, batch=True, batch_info=True))
        pipe = files()
    else:
        split = load_manifest(shards).train

        @pipeline_def(batch_size=batch, num_threads=1, device_id=None, prefetch_queue_depth=2)
        def tars():
            return tuple(_reader(split, 0, 1, random_shuffle=True, initial_fill=1024, stick_to_shard=False))
        pipe = tars()
    pipe.build()

    def next_batch():
        try:
            pipe.run()
        except StopIteration:  # the feeder's epoch ended: the next one
            pipe.reset()
            pipe.run()
    return next_batch


def _decoding(kind: str, root: Path, shards: Path, batch: int) -> Callable[[], Any]:
    """``next_batch`` of the training loader itself on the CPU, one DALI thread: read, decode the
    random-resized crop, resize to 224, flip, normalize."""
    from gradientflow_repro.data.shard_reader import ShardSource
    from gradientflow_repro.data.shards import load_manifest

    options = ImageOptions(image_size=224, val_resize=256, min_crop_scale=0.08, flip=True,
                           mean=(124.0, 116.0, 104.0), std=(58.0, 57.0, 57.0), num_threads=1, prefetch=2)
    shard = dict(device=torch.device("cpu"), local_batch=batch, global_batch=batch, rank=0, world_size=1, seed=0)
    if kind == "files":
        train = list_image_folder(root / "train")
        source = DaliSource(train, list_image_folder(root / "val", train.classes), options, reader_workers=0, **shard)
    else:
        source = ShardSource(load_manifest(shards), options, shuffle_buffer=1024, **shard)

    def epochs():
        epoch = 0
        while True:
            yield from source.train_batches(epoch)
            epoch += 1
    batches = epochs()
    return lambda: next(batches)


def _cpu_with_children() -> float:
    """CPU seconds of this process and of its children waited for (DALI's ``wds2idx`` runs ``tar``)."""
    import resource

    return sum(part for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for part in resource.getrusage(who)[:2])


def bench_shards(count: int = 2048, batch: int = 128, read_batches: int = 48,
                 decode_batches: int = 6, rounds: int = 3, command: str = "python scripts/bench_loader.py") -> dict:
    """Measure section 4 on ``count`` synthetic ImageNet-sized JPEGs in a temporary folder: the
    document's ``shards`` part (``loader.write_parts``), every round's figures and their ``summary``."""
    from gradientflow_repro.data.shards import SAMPLES_PER_SHARD, write_shards

    load = [os.getloadavg()[0]]
    torch.set_num_threads(1)
    facts = environment_facts()
    data: dict[str, Any] = {"provenance": provenance(command, 1, facts), "command": command, "facts": facts,
                            "world_size": 1, "count": count,
                            "batch": batch, "rounds": rounds, "samples_per_shard": SAMPLES_PER_SHARD,
                            "read_batches": read_batches, "decode_batches": decode_batches, "results": {}}
    with tempfile.TemporaryDirectory(prefix="shards-bench-") as tmp:
        root = synthetic_imagenet(Path(tmp) / "imagenet", count=count, classes=16)
        synthetic_imagenet(Path(tmp) / "imagenet", count=16, classes=16, seed=1, split="val")
        data["mean_bytes"] = statistics.mean(p.stat().st_size for p in (root / "train").rglob("*.JPEG"))
        cpu = _cpu_with_children()
        write_shards(root, Path(tmp) / "shards", workers=1)
        data["write_images_per_cpu_s"] = (count + 16) / (_cpu_with_children() - cpu)
        folders = [*sorted((root / "train").iterdir()), Path(tmp) / "shards" / "train"]
        for stage, make, batches in (("read", _reader_only, read_batches), ("decode", _decoding, decode_batches)):
            for round_ in range(rounds):
                for kind in ("files", "shards"):  # alternated: both see the same machine state
                    counter = OpenCounter(folders)
                    try:
                        measured = _rate(make(kind, root, Path(tmp) / "shards", batch), batch, batches, counter)
                    finally:
                        counter.close()
                    data["results"].setdefault(f"{stage}/{kind}", []).append(measured)
                    log.info(f"{stage} {kind} round {round_ + 1}/{rounds}: {measured['images_per_s']:.0f} "
                             f"images/s, {measured['opens_per_s']:.0f} opens/s")
    load.append(os.getloadavg()[0])
    data["load_average"] = load
    data["summary"] = summarize(data)
    return data


def summarize(data: dict) -> dict[str, Any]:
    """The figures and verdicts the section states, from ``bench_shards``' rounds (medians): the
    shards' images/s and images per CPU-second over the files' (goal: at least 2x per reader
    thread), files opened per second (goal: down by at least the shard size), and CPU cores per GPU
    at the paper's pace."""
    per_gpu = PAPER_IMAGES_PER_S / PAPER_GPUS

    def median(key: str, field: str) -> float:
        return statistics.median(r[field] for r in data["results"][key])

    ratio = {stage: median(f"{stage}/shards", "images_per_s") / median(f"{stage}/files", "images_per_s")
             for stage in ("read", "decode")}
    per_cpu = median("read/shards", "images_per_cpu_s") / median("read/files", "images_per_cpu_s")
    opens = {kind: median(f"read/{kind}", "opens_per_s") for kind in ("files", "shards")}
    return {"images_per_s_ratio": ratio, "images_per_cpu_s_ratio": per_cpu, "goal_ratio": SHARDS_GOAL_RATIO,
            "faster_met": min(ratio["read"], per_cpu) >= SHARDS_GOAL_RATIO, "opens_per_s": opens,
            "fewer_opens_met": opens["shards"] <= opens["files"] / data["samples_per_shard"], "per_gpu": per_gpu,
            "cores_per_gpu": {key: per_gpu / median(key, "images_per_cpu_s") for key in data["results"]}}
