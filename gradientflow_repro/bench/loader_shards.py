"""ImageNet from shards against files -> the section "ImageNet from shards against files" of
results/loader.md, rendered from results/loader_shards.json.

The same synthetic ImageNet-sized JPEGs (``loader.synthetic_imagenet``) read by one DALI thread
from the folder (``data.kind=folder``: one file per image, the external source of
``dali.EpochBatches``) and from webdataset shards (``data.kind=shards``: DALI's webdataset reader,
``data/shard_reader.py``), first reading only (what a rank's CPU does on a GPU node, where nvJPEG
decodes), then with decoding to 224-pixel crops; images/s, images per CPU-second of the process and
files opened per second (counted by inotify, without tracing the loader); hence the CPU cores per
GPU the paper's pace needs. ``bench_shards`` writes the measurements as JSON;
``render_shards_section`` makes the Markdown from that file alone.
"""

from __future__ import annotations

import json
import os
import statistics
import struct
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from gradientflow_repro.bench.loader import _feeder, synthetic_imagenet, write_section
from gradientflow_repro.data.dali import DaliSource, EpochBatches
from gradientflow_repro.data.listing import ImageOptions, list_image_folder
from gradientflow_repro.provenance import environment_facts

SHARDS_SECTION = "## ImageNet from shards against files"
SHARDS_JSON = "loader_shards.json"  # beside the Markdown
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


def bench_shards(out_json: Path, count: int = 2048, batch: int = 128, read_batches: int = 48,
                 decode_batches: int = 6, rounds: int = 3, command: str = "python scripts/bench_loader.py") -> dict:
    """Measure section 4 on ``count`` synthetic ImageNet-sized JPEGs in a temporary folder; write
    the measurements to ``out_json`` and return them."""
    from gradientflow_repro.data.shards import SAMPLES_PER_SHARD, write_shards

    load = [os.getloadavg()[0]]
    torch.set_num_threads(1)
    data: dict[str, Any] = {"command": command, "facts": environment_facts(), "world_size": 1, "count": count,
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
                    print(f"{stage} {kind} round {round_ + 1}/{rounds}: {measured['images_per_s']:.0f} images/s, "
                          f"{measured['opens_per_s']:.0f} opens/s", flush=True)
    load.append(os.getloadavg()[0])
    data["load_average"] = load
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(data, indent=1) + "\n")
    return data


def render_shards_section(data: dict) -> list[str]:
    """The section's Markdown from ``bench_shards``' measurements."""
    facts, per_gpu = data["facts"], PAPER_IMAGES_PER_S / PAPER_GPUS

    def median(key: str, field: str) -> float:
        return statistics.median(r[field] for r in data["results"][key])

    def spread(key: str, field: str) -> str:
        values = [r[field] for r in data["results"][key]]
        return f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"

    shared = (f"shared with other work (load average {data['load_average'][0]:.1f} at the start, "
              f"{data['load_average'][1]:.1f} at the end, on {facts['cpu_count']} cores)")
    lines = [f"Made by `{data['command']}` at commit {facts['git_commit']} on {facts['cpu']}, {facts['cpu_count']} "
             f"cores, {shared}, no GPU; torch {facts['torch']}, DALI {facts['dali']}. One process (world size "
             f"{data['world_size']}); measurements in `results/{SHARDS_JSON}`, this section rendered from it.",
             "",
             f"{data['count']} synthetic JPEGs of ImageNet's typical size ({data['mean_bytes'] / 1e3:.0f} KB on "
             f"average), 16 classes, read from the page cache: as a folder (`data.kind=folder`, one file per image) "
             f"and as webdataset shards of {data['samples_per_shard']} (`data.kind=shards`, written by "
             f"`scripts/prepare_imagenet.py --shards` at {data['write_images_per_cpu_s']:.0f} images per CPU-second, "
             "index and verification included). "
             f"Batch {data['batch']}, one DALI thread; each figure the median of {data['rounds']} alternating "
             f"rounds ({data['read_batches']} batches reading, {data['decode_batches']} decoding, after a warm-up "
             f"batch). Images per CPU-second: the process's CPU time, all its threads, so a per-core figure "
             "that other work on the machine does not lower.",
             "",
             "| reader | work | images/s (min-max) | images per CPU-second | files opened/s | files opened to start |",
             "|---|---|---|---|---|---|"]
    work = {"read": "read only (nvJPEG decodes on a GPU)", "decode": "read, decode the crop, resize to 224"}
    for stage in ("read", "decode"):
        for kind in ("files", "shards"):
            key = f"{stage}/{kind}"
            lines.append(f"| {kind} | {work[stage]} | {spread(key, 'images_per_s')} | "
                         f"{median(key, 'images_per_cpu_s'):.0f} | {median(key, 'opens_per_s'):.0f} | "
                         f"{median(key, 'opens_at_start'):.0f} |")
    ratio = {stage: median(f"{stage}/shards", "images_per_s") / median(f"{stage}/files", "images_per_s")
             for stage in ("read", "decode")}
    per_cpu = median("read/shards", "images_per_cpu_s") / median("read/files", "images_per_cpu_s")
    opens_files, opens_shards = median("read/files", "opens_per_s"), median("read/shards", "opens_per_s")
    fewer = opens_shards <= opens_files / data["samples_per_shard"]
    cores = {key: per_gpu / median(key, "images_per_cpu_s") for key in data["results"]}
    lines += [
        "",
        "**Goal: shards at least 2x the images/s of files per reader thread: "
        f"{'met' if min(ratio['read'], per_cpu) >= 2 else 'NOT met'}** "
        f"({ratio['read']:.1f}x the images/s reading, {per_cpu:.1f}x the images per CPU-second; "
        f"{ratio['decode']:.2f}x the images/s with decoding on the CPU, where the decoder's work is the same "
        "for both). **Files opened per second down by at least the shard size "
        f"({data['samples_per_shard']}): {'met' if fewer else 'NOT met'}** ({opens_files:.0f}/s from the folder, "
        f"one per image; {opens_shards:.0f}/s from shards: DALI maps each shard and its index once, when the "
        "pipeline is built (the last column: for files, those of the first batches it read ahead), and "
        "reads the mapped files from then on; at ImageNet's 1,252 training shards that is 2,504 opens "
        "per rank per run, against one per image from files).",
        "",
        f"CPU cores per GPU for the paper's pace (1.35M images/s over 512 GPUs: {per_gpu:.0f} images/s per GPU), "
        "at these images per CPU-second: reading only, as on a GPU node where nvJPEG decodes, "
        f"**{cores['read/files']:.2f} from files, {cores['read/shards']:.2f} from shards**; decoding on the CPU "
        f"too, {cores['decode/files']:.1f} from files and {cores['decode/shards']:.1f} from shards. Page cache "
        "and cores like these; a shared file system adds its latency to every file open, and a node that "
        "reads shards from its local disk needs none.",
        "",
    ]
    return lines


def write_shards_section(out: Path, data: dict) -> str:
    """Put the section rendered from ``data`` into ``out``, leaving the other sections as they are."""
    return write_section(out, SHARDS_SECTION, render_shards_section(data))
