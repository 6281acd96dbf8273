"""Loader and harness-overhead benchmark -> results/loader.json, rendered to results/loader.md

Each item below measures into its part of one document (kind ``bench.loader``: ``loaders`` for
items 1 and 2, ``feeder``, ``shards``), each part with the provenance of the run that measured it,
so that one part can be measured again alone (``write_parts``) and the Markdown rendered from all.

1. Images/s of the DALI CPU pipeline against the torchvision ImageFolder-style loader, reading the
   same JPEG folder with the same number of threads (DALI threads = DataLoader workers), measured
   side by side in one run, alternating rounds. Two folders: the embedded digits (32 px) and the same
   digits re-encoded at ImageNet size (320x256 JPEGs, 224-px crops), where decoding dominates.
2. The harness's per-step overhead: Trainer.train_step (schedule, autocast, communicator, agreed
   finiteness check, logging) against a plain PyTorch loop over the same model, optimizer and batch.
3. The training feeder alone (``bench_feeder``, also run by itself with ``--feeder-only``, which
   replaces only its part): the DALI external source's work per batch (read each file, parse its
   header, draw the crop window and flip: ``dali.EpochBatches``), without decoding, on synthetic
   JPEGs of ImageNet's typical size, in one process (one reader worker's rate) and through DALI's
   pool of reader workers; hence how many workers one rank needs for the paper's per-GPU rate.
4. ImageNet from shards against files (``loader_shards``, alone with ``--shards-only``).
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from gradientflow_repro import REPO, render
from gradientflow_repro.bench import provenance
from gradientflow_repro.config import compose
from gradientflow_repro.data.dali import DaliSource, EpochBatches
from gradientflow_repro.data.digits import build_digits
from gradientflow_repro.data.folder import TorchvisionSource
from gradientflow_repro.data.listing import ImageOptions, Listing, list_image_folder

log = logging.getLogger(__name__)
KIND = "bench.loader"
DALI_GOAL_RATIO = 1.3  # DALI at least 1.3x the torchvision loader's images/s
OVERHEAD_LIMIT_PERCENT = 5.0  # the harness's step at most 5% slower than a plain loop


def imagenet_sized_copy(digits: Path, dest: Path, per_class: int = 60) -> Path:
    """The digits re-encoded as 320x256 JPEGs (``per_class`` per class and split), once."""
    from PIL import Image

    if (dest / "val").is_dir():
        return dest
    for split in ("train", "val"):
        for class_dir in sorted((digits / split).iterdir()):
            (dest / split / class_dir.name).mkdir(parents=True, exist_ok=True)
            for image in sorted(class_dir.iterdir())[:per_class]:
                with Image.open(image) as small:
                    small.convert("RGB").resize((320, 256), Image.BICUBIC).save(
                        dest / split / class_dir.name / image.name, quality=90)
    return dest


def loader_rate(kind: type, root: Path, threads: int, batch: int, batches: int, size: int) -> float:
    """Training images per second of loader ``kind`` over ``batches`` batches after the first."""
    train = list_image_folder(root / "train")
    val = list_image_folder(root / "val", train.classes)
    options = ImageOptions(image_size=size, val_resize=size, min_crop_scale=0.25, flip=True,
                           mean=(124.0, 116.0, 104.0), std=(58.0, 57.0, 57.0), num_threads=threads,
                           prefetch=2)
    source = kind(train, val, options, device=torch.device("cpu"), local_batch=batch,
                  global_batch=batch, rank=0, world_size=1, seed=0)
    epoch, seen, started = 0, 0, None
    while seen < batches:
        for images, _ in source.train_batches(epoch):
            if started is None:  # the first batch pays for start-up (workers, pipeline build)
                started = time.perf_counter()
                continue
            seen += 1
            if seen == batches:
                break
        epoch += 1
    return batches * batch / (time.perf_counter() - started)


def step_overhead(steps: int, rounds: int) -> tuple[float, float]:
    """Median seconds per step of ``Trainer.train_step`` and of a plain loop, alternated."""
    from gradientflow_repro.distributed import discover_world
    from gradientflow_repro.engine import Trainer

    cfg = compose([
        "+experiment=digits_cpu", "data=synthetic", "data.num_classes=10", "data.image_size=32",
        "global_batch_size=64", "logger=jsonl", "logger.log_every=10", "resume=never",
        f"run_dir={REPO / 'results' / 'runs' / 'bench_overhead'}", "threads_per_rank=2"])
    torch.set_num_threads(2)
    trainer = Trainer(cfg, discover_world({}), torch.device("cpu"))
    images, labels = next(trainer.data.train_batches(0))
    model, optimizer, criterion = trainer.model, trainer.optimizer, torch.nn.CrossEntropyLoss()

    def plain() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = criterion(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    harness_times, plain_times = [], []
    for fn in (lambda: trainer.train_step(images, labels), plain):
        fn()  # warm
    for _ in range(rounds * steps):  # alternate step by step: both loops see the same machine state
        for fn, times in ((lambda: trainer.train_step(images, labels), harness_times), (plain, plain_times)):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
    trainer.tracker.finish({"name": "bench_overhead"})
    return statistics.median(harness_times), statistics.median(plain_times)


def bench_loader(threads: int = 2, batches: int = 30, rounds: int = 3, steps: int = 60,
                 command: str = "python scripts/bench_loader.py") -> dict[str, Any]:
    """Items 1 and 2 of the module: the loaders side by side and the harness's overhead, with the
    goals' verdicts; the document's ``loaders`` part (``write_parts``)."""
    torch.set_num_threads(1)
    digits = build_digits(REPO / "data" / "digits")
    large = imagenet_sized_copy(digits, REPO / "data" / "digits_320")
    folders = [("digits 32x32 JPEG, crop 32", digits, 32, 128),
               ("digits re-encoded 320x256 JPEG, crop 224", large, 224, 32)]
    rows = []
    for label, root, size, batch in folders:
        rates: dict[str, list[float]] = {"dali": [], "torchvision": []}
        for round_ in range(rounds):
            for name, kind in (("dali", DaliSource), ("torchvision", TorchvisionSource)):
                rates[name].append(loader_rate(kind, root, threads, batch, batches, size))
                log.info(f"{label} round {round_ + 1}/{rounds} {name}: {rates[name][-1]:.0f} images/s")
        ratio = statistics.median(rates["dali"]) / statistics.median(rates["torchvision"])
        rows.append({"label": label, "batch": batch, **{name: _spread(rates[name]) for name in rates},
                     "ratio": ratio, "met": ratio >= DALI_GOAL_RATIO})
    harness, plain = step_overhead(steps, rounds)
    overhead = 100 * (harness / plain - 1)
    return {"provenance": provenance(command, 1), "threads": threads, "batches": batches, "rounds": rounds,
            "rows": rows, "goal_ratio": DALI_GOAL_RATIO,
            "overhead": {"steps": rounds * steps, "plain_s": plain, "harness_s": harness, "percent": overhead,
                         "limit_percent": OVERHEAD_LIMIT_PERCENT, "met": overhead < OVERHEAD_LIMIT_PERCENT}}


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def write_parts(out_json: Path, parts: dict[str, Any]) -> str:
    """Put ``parts`` (``loaders``, ``feeder``, ``shards``) into the document ``out_json`` (kind
    ``bench.loader``), keeping the parts it already holds and the runs that measured them, and
    render it beside (.md); returns the Markdown."""
    document = json.loads(out_json.read_text()) if out_json.exists() else {}
    document = {key: value for key, value in document.items() if key != "kind"}
    document.update(parts)
    return render.render_file(render.write_data(out_json, KIND, document)).read_text()


PAPER_IMAGES_PER_GPU = 3297  # AlexNet-BN images/s per GPU in the paper (fp16)
IMAGENET_SHAPES = ((500, 375), (375, 500), (500, 333), (500, 400))  # the commonest ILSVRC-2012 shapes


def synthetic_imagenet(dest: Path, count: int = 320, classes: int = 8, seed: int = 0, split: str = "train") -> Path:
    """``count`` JPEGs of ImageNet's typical size (500x375 and its neighbours, quality 90, about
    100 KB: smooth colour fields with pixel noise, which compress like photographs), in ImageNet's
    layout under ``dest/split``; every eighth carries an EXIF orientation that swaps width and height,
    so the header parse reads EXIF as it must for such photographs."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    for i in range(count):
        width, height = IMAGENET_SHAPES[i % len(IMAGENET_SHAPES)]
        yy, xx = np.mgrid[0:height, 0:width]
        phase = rng.uniform(0, 6, 3)
        field = np.stack([np.sin(xx / rng.uniform(15, 40) + p) * 60 + np.cos(yy / rng.uniform(15, 40) + p) * 60
                          for p in phase], axis=-1) + 128
        pixels = np.clip(field + rng.normal(0, 24, field.shape), 0, 255).astype(np.uint8)
        folder = dest / split / f"n{i % classes:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        exif = Image.Exif()
        if i % 8 == 7:
            exif[0x0112] = 6  # rotated 90 degrees: the decoder swaps width and height
        Image.fromarray(pixels).save(folder / f"{i:05d}.JPEG", quality=90, exif=exif)
    return dest


class _CachedSizes(EpochBatches):
    """The feeder with every image's oriented size read once up front (what caching the sizes once
    per listing would give): the header parse's share of the feeder's work."""

    def __init__(self, *args, **kwargs) -> None:
        import numpy as np

        from gradientflow_repro.data.dali import oriented_size

        super().__init__(*args, **kwargs)
        self.sizes = {i: oriented_size(np.fromfile(f, dtype=np.uint8)) for i, f in enumerate(self.files)}

    def image_size(self, index: int, encoded) -> tuple[int, int]:
        return self.sizes[index]


def _feeder(kind: type, listing: Listing, batch: int) -> EpochBatches:
    return kind(listing, seed=0, first_epoch=0, skip=0, rank=0, world_size=1, local_batch=batch,
                steps_per_epoch=len(listing) // batch, min_scale=0.08, flip=True)


def feeder_rate(source: EpochBatches, batches: int) -> float:
    """Batches per second of ``source`` called in this process, as one reader worker calls it:
    ``batches`` batches after a warm-up one, across epochs."""
    from nvidia.dali.types import BatchInfo

    def calls():
        epoch = 0
        while True:
            for step in range(source.steps_per_epoch):
                yield BatchInfo(step, epoch)
            epoch += 1

    infos = calls()
    source(next(infos))
    started = time.perf_counter()
    for _ in range(batches):
        source(next(infos))
    return batches / (time.perf_counter() - started)


def pool_rate(source: EpochBatches, workers: int, depth: int, batches: int,
              warm_up: int = 10) -> tuple[float, float]:
    """(batches per second, CPU seconds per batch spent in this process: the training process's
    share, its DALI thread included) of DALI's parallel external source with ``workers`` reader
    processes and ``depth`` batches scheduled ahead, in a pipeline that only passes the feeder's
    outputs on (no decoding), after ``warm_up`` batches (the workers' start and the growth of their
    shared-memory buffers to the batch's size)."""
    from nvidia.dali import fn, pipeline_def

    @pipeline_def(batch_size=source.local_batch, num_threads=1, device_id=None, py_num_workers=workers,
                  py_start_method="spawn", prefetch_queue_depth=2)
    def feeder_only():
        return tuple(fn.external_source(source=source, num_outputs=5, batch=True, batch_info=True,
                                        parallel=True, prefetch_queue_depth=depth))

    pipe = feeder_only()
    pipe.build()
    done, started, cpu = -warm_up, time.perf_counter(), time.process_time()
    try:
        while done < batches:
            try:
                pipe.run()
            except StopIteration:
                pipe.reset()
                continue
            done += 1
            if done == 0:
                started, cpu = time.perf_counter(), time.process_time()
    finally:
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
        del pipe
    return batches / elapsed, cpu / batches


def bench_feeder(batch: int = 128, batches: int = 40, rounds: int = 3, files: int = 320,
                 command: str = "python scripts/bench_loader.py") -> dict[str, Any]:
    """Item 3 of the module, the training feeder alone: the document's ``feeder`` part."""
    from gradientflow_repro.data.cpus import loader_cpus, source_queue_depth

    slurm = loader_cpus(None, None, on_gpu=True, environ={"SLURM_CPUS_PER_TASK": "12"}, affinity=set(range(12)))

    rows, pool_rows = [], []
    with tempfile.TemporaryDirectory(prefix="feeder-") as tmp:
        root = synthetic_imagenet(Path(tmp), count=files)
        listing = list_image_folder(root / "train")
        sizes = [Path(f).stat().st_size for f in listing.files]
        # the same files listed many times over: epochs long enough for the pool to run steadily
        repeated = Listing(listing.classes, listing.files * 40, listing.labels * 40)
        variants = (("as in training: read file, parse header (PIL, with EXIF), draw window and flip",
                     EpochBatches),
                    ("sizes cached once per listing: read file, draw window and flip", _CachedSizes))
        sources = {label: _feeder(kind, repeated, batch) for label, kind in variants}
        rates: dict[str, list[float]] = {label: [] for label, _ in variants}
        for round_ in range(rounds):  # alternate the variants: both see the same machine state
            for label, _ in variants:
                rates[label].append(feeder_rate(sources[label], batches))
                log.info(f"feeder round {round_ + 1}/{rounds} {label.split(':')[0]}: "
                         f"{rates[label][-1] * batch:.0f} images/s")
        for label, _ in variants:
            rows.append({"label": label, "batches_per_s": _spread(rates[label])})
        for workers in (1, 2):
            for depth in sorted({1, source_queue_depth(2, workers)}):
                measured = sorted(pool_rate(sources[variants[0][0]], workers, depth, batches)
                                  for _ in range(rounds))
                rate, main_cpu = measured[len(measured) // 2]  # the round of median rate
                log.info(f"pool {workers} worker(s), depth {depth}: {rate * batch:.0f} images/s")
                pool_rows.append({"workers": workers, "depth": depth, "batches_per_s": rate, "main_cpu_s": main_cpu,
                                  "min": measured[0][0], "max": measured[-1][0]})
    per_worker = rows[0]["batches_per_s"]["median"] * batch
    pooled = max(row["batches_per_s"] for row in pool_rows if row["workers"] == 1) * batch
    return {"provenance": provenance(command, 1), "files": files, "batch": batch, "batches": batches,
            "rounds": rounds, "shapes": [f"{w}x{h}" for w, h in IMAGENET_SHAPES],
            "mean_bytes": statistics.mean(sizes), "rows": rows, "pool": pool_rows,
            "paper_images_per_gpu": PAPER_IMAGES_PER_GPU, "images_per_worker": per_worker,
            "needed_workers": math.ceil(PAPER_IMAGES_PER_GPU / per_worker), "pooled_images_per_s": pooled,
            "needed_workers_through_pool": math.ceil(PAPER_IMAGES_PER_GPU / pooled),
            "header_share_percent": 100 * (1 - rows[0]["batches_per_s"]["median"]
                                           / rows[1]["batches_per_s"]["median"]),
            "default_workers": {"workers": slurm.workers, "cpus": slurm.cpus, "threads": slurm.threads}}
