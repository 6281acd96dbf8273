"""Loader and harness-overhead benchmark -> results/loader.md

1. Images/s of the DALI CPU pipeline against the torchvision ImageFolder-style loader, reading the
   same JPEG folder with the same number of threads (DALI threads = DataLoader workers), measured
   side by side in one run, alternating rounds. Two folders: the embedded digits (32 px) and the same
   digits re-encoded at ImageNet size (320x256 JPEGs, 224-px crops), where decoding dominates.
2. The harness's per-step overhead: Trainer.train_step (schedule, autocast, communicator, agreed
   finiteness check, logging) against a plain PyTorch loop over the same model, optimizer and batch.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from gradientflow_repro.data.dali import DaliSource
from gradientflow_repro.data.digits import build_digits
from gradientflow_repro.data.folder import TorchvisionSource
from gradientflow_repro.data.listing import ImageOptions, list_image_folder
from gradientflow_repro.harness import REPO, compose
from gradientflow_repro.tracking import environment_facts


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


def bench_loader(out: Path, threads: int = 2, batches: int = 30, rounds: int = 3, steps: int = 60,
                 command: str = "python scripts/bench_loader.py") -> str:
    """Both measurements, written to ``out``; returns the Markdown."""
    torch.set_num_threads(1)
    digits = build_digits(REPO / "data" / "digits")
    large = imagenet_sized_copy(digits, REPO / "data" / "digits_320")
    folders = [("digits 32x32 JPEG, crop 32", digits, 32, 128),
               ("digits re-encoded 320x256 JPEG, crop 224", large, 224, 32)]
    rows = []
    for label, root, size, batch in folders:
        rates = {"dali": [], "torchvision": []}
        for round_ in range(rounds):
            for name, kind in (("dali", DaliSource), ("torchvision", TorchvisionSource)):
                rates[name].append(loader_rate(kind, root, threads, batch, batches, size))
                print(f"{label} round {round_ + 1}/{rounds} {name}: {rates[name][-1]:.0f} images/s", flush=True)
        dali, tv = statistics.median(rates["dali"]), statistics.median(rates["torchvision"])
        rows.append((label, batch, dali, min(rates["dali"]), max(rates["dali"]), tv,
                     min(rates["torchvision"]), max(rates["torchvision"]), dali / tv))
    harness, plain = step_overhead(steps, rounds)
    facts = environment_facts()
    lines = [
        "# Data loader and harness overhead",
        "",
        f"Machine: {facts['cpu']}, {facts['cpu_count']} cores, no GPU. torch {facts['torch']}, DALI "
        f"{facts['dali']}, commit {facts['git_commit']}. One process (world size 1).",
        f"Command: `{command}` (loaders: medians of {rounds} alternating rounds, {batches} batches each "
        f"after a warm-up batch; {threads} DALI threads vs {threads} DataLoader workers; torch uses 1 thread).",
        "",
        "## DALI CPU pipeline vs torchvision loader (training augmentation: random-resized crop, flip, normalize)",
        "",
        "| folder | batch | DALI images/s (min-max) | torchvision images/s (min-max) | DALI / torchvision |",
        "|---|---|---|---|---|",
    ]
    for label, batch, dali, dmin, dmax, tv, tmin, tmax, ratio in rows:
        lines.append(f"| {label} | {batch} | {dali:.0f} ({dmin:.0f}-{dmax:.0f}) | {tv:.0f} ({tmin:.0f}-{tmax:.0f}) "
                     f"| {ratio:.2f}x |")
    overhead = 100 * (harness / plain - 1)
    lines += [
        "",
        "Goal: DALI at least 1.3x: "
        + ", ".join(f"{'met' if r[-1] >= 1.3 else 'NOT met'} on {r[0]}" for r in rows) + ".",
        "",
        "## Harness per-step overhead",
        "",
        "AlexNet-BN (width 0.25, 32-px input), batch 64, bf16 autocast, LARS, synthetic batch, world size 1, "
        "2 torch threads; "
        f"{rounds * steps} steps of each loop, alternated step by step; median step time.",
        "",
        "| loop | seconds per step (median) |",
        "|---|---|",
        f"| plain PyTorch (autocast, backward, optimizer.step) | {plain:.4f} |",
        f"| harness Trainer.train_step (schedule, communicator, agreed finiteness, logging) | {harness:.4f} |",
        "",
        f"Overhead: {overhead:+.1f}% (goal: under 5%: {'met' if overhead < 5 else 'NOT met'}).",
        "",
    ]
    text = "\n".join(lines)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return text
