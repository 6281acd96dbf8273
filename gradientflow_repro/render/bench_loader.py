"""The sections of results/loader.md (``render.bench.loader``), each from its part of the loader
benchmark's document (``bench.loader``, ``bench.loader_shards``): the loaders side by side with the
harness's overhead, the training feeder alone, and ImageNet from shards against files. Figures,
ratios and verdicts are the document's; this module words them."""

from __future__ import annotations

import statistics
from typing import Any, Mapping

from gradientflow_repro.render import table


def _met(flag: bool) -> str:
    return "met" if flag else "NOT met"


def _range(figures: Mapping[str, float], fmt: str = ".0f", scale: float = 1.0) -> str:
    return f"{figures['median'] * scale:{fmt}} ({figures['min'] * scale:{fmt}}-{figures['max'] * scale:{fmt}})"


def loaders_section(part: Mapping[str, Any]) -> list[str]:
    """The run's header, DALI against torchvision with the goal, and the harness's overhead."""
    env, overhead = part["provenance"]["environment"], part["overhead"]
    rows = [[r["label"], r["batch"], _range(r["dali"]), _range(r["torchvision"]), f"{r['ratio']:.2f}x"]
            for r in part["rows"]]
    return [
        f"Machine: {env['cpu']}, {env['cpu_count']} cores, no GPU. torch {env['torch']}, DALI "
        f"{env['dali']}, commit {env['git_commit']}. One process (world size 1).",
        f"Command: `{part['provenance']['command']}` (loaders: medians of {part['rounds']} alternating rounds, "
        f"{part['batches']} batches each after a warm-up batch; {part['threads']} DALI threads vs {part['threads']} "
        "DataLoader workers; torch uses 1 thread).", "",
        "## DALI CPU pipeline vs torchvision loader (training augmentation: random-resized crop, flip, normalize)", "",
        table(["folder", "batch", "DALI images/s (min-max)", "torchvision images/s (min-max)", "DALI / torchvision"],
              rows), "",
        f"Goal: DALI at least {part['goal_ratio']:g}x: "
        + ", ".join(f"{_met(r['met'])} on {r['label']}" for r in part["rows"]) + ".", "",
        "## Harness per-step overhead", "",
        "AlexNet-BN (width 0.25, 32-px input), batch 64, bf16 autocast, LARS, synthetic batch, world size 1, "
        f"2 torch threads; {overhead['steps']} steps of each loop, alternated step by step; median step time.", "",
        table(["loop", "seconds per step (median)"],
              [["plain PyTorch (autocast, backward, optimizer.step)", f"{overhead['plain_s']:.4f}"],
               ["harness Trainer.train_step (schedule, communicator, agreed finiteness, logging)",
                f"{overhead['harness_s']:.4f}"]]), "",
        f"Overhead: {overhead['percent']:+.1f}% (goal: under {overhead['limit_percent']:g}%: "
        f"{_met(overhead['met'])}).", ""]


def feeder_section(part: Mapping[str, Any]) -> list[str]:
    """The feeder's work per batch in one process and through DALI's pool of reader workers, and
    how many workers a rank needs for the paper's per-GPU rate."""
    batch, paper, slurm = part["batch"], part["paper_images_per_gpu"], part["default_workers"]
    rows = [[r["label"], _range(r["batches_per_s"], ".1f"), f"{r['batches_per_s']['median'] * batch:.0f}"]
            for r in part["rows"]]
    pool = [[r["workers"], r["depth"], f"{r['batches_per_s']:.1f}",
             f"{r['batches_per_s'] * batch:.0f} ({r['min'] * batch:.0f}-{r['max'] * batch:.0f})",
             f"{1000 * r['main_cpu_s']:.1f}"] for r in part["pool"]]
    needed, through_pool = part["needed_workers"], part["needed_workers_through_pool"]
    return [
        f"{part['files']} synthetic JPEGs of ImageNet's typical size ({', '.join(part['shapes'])}, "
        f"quality 90, {part['mean_bytes'] / 1e3:.0f} KB on average, one in eight with an EXIF "
        f"rotation), read from the page cache; batch {batch} (AlexNet-BN's per-GPU batch at 64K on 512 "
        f"GPUs); no decoding. One reader worker's rate: `EpochBatches` called in one process, "
        f"{part['batches']} batches after a warm-up one, median of {part['rounds']} alternating rounds.", "",
        table(["feeder work per batch", "batches/s per worker (min-max)", "images/s per worker"], rows), "",
        "Through DALI's pool of reader workers (parallel external source, a pipeline that only passes "
        "the feeder's outputs on; `depth`: the source's `prefetch_queue_depth`, batches scheduled ahead, "
        "one worker each; the loader sets it to at least the number of workers):", "",
        table(["reader workers", "depth", "batches/s", "images/s (min-max over rounds)",
               "training process CPU ms per batch"], pool), "",
        f"The header parse is {part['header_share_percent']:.0f}% of one worker's work (caching the sizes would "
        "save that, not needed at the paper's rate). One worker does the feeder's work for "
        f"{part['images_per_worker']:.0f} images/s: **{needed} reader worker{'s' if needed > 1 else ''}** per rank "
        f"for the paper's {paper} images/s per GPU. Through DALI's pool, on "
        f"{part['provenance']['environment']['cpu_count']} cores shared by the worker, the training process and "
        f"its DALI thread, one worker delivered {part['pooled_images_per_s']:.0f} images/s "
        f"({100 * (part['pooled_images_per_s'] / paper - 1):+.0f}% against the paper's rate): **{through_pool}** "
        "by that count. Both with files in the page cache and cores as fast as these. The default (`data/cpus.py`: "
        f"a quarter of the spare cores, at least one on a GPU: {slurm['workers']} of a {slurm['cpus']}-CPU task, "
        f"{slurm['threads']} DALI threads) covers "
        "the larger count, with room for file systems whose reads wait on the network. Decoding is not "
        "in these numbers: on a GPU it runs in nvJPEG and DALI's threads.", ""]


def shards_section(data: Mapping[str, Any]) -> list[str]:
    """Shards against files from ``bench.loader_shards``' measurements and summary."""
    facts, summary = data["facts"], data["summary"]

    def median(key: str, field: str) -> float:
        return statistics.median(r[field] for r in data["results"][key])

    def spread(key: str, field: str) -> str:
        values = [r[field] for r in data["results"][key]]
        return f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"

    shared = (f"shared with other work (load average {data['load_average'][0]:.1f} at the start, "
              f"{data['load_average'][1]:.1f} at the end, on {facts['cpu_count']} cores)")
    work = {"read": "read only (nvJPEG decodes on a GPU)", "decode": "read, decode the crop, resize to 224"}
    rows = [[kind, work[stage], spread(f"{stage}/{kind}", "images_per_s"),
             f"{median(f'{stage}/{kind}', 'images_per_cpu_s'):.0f}", f"{median(f'{stage}/{kind}', 'opens_per_s'):.0f}",
             f"{median(f'{stage}/{kind}', 'opens_at_start'):.0f}"] for stage in ("read", "decode")
            for kind in ("files", "shards")]
    ratio, cores = summary["images_per_s_ratio"], summary["cores_per_gpu"]
    return [
        f"Made by `{data['command']}` at commit {facts['git_commit']} on {facts['cpu']}, {facts['cpu_count']} "
        f"cores, {shared}, no GPU; torch {facts['torch']}, DALI {facts['dali']}. One process (world size "
        f"{data['world_size']}); measurements in `results/loader.json` (`shards`), this section rendered from it.", "",
        f"{data['count']} synthetic JPEGs of ImageNet's typical size ({data['mean_bytes'] / 1e3:.0f} KB on "
        f"average), 16 classes, read from the page cache: as a folder (`data.kind=folder`, one file per image) "
        f"and as webdataset shards of {data['samples_per_shard']} (`data.kind=shards`, written by "
        f"`scripts/prepare_imagenet.py --shards` at {data['write_images_per_cpu_s']:.0f} images per CPU-second, "
        "index and verification included). "
        f"Batch {data['batch']}, one DALI thread; each figure the median of {data['rounds']} alternating "
        f"rounds ({data['read_batches']} batches reading, {data['decode_batches']} decoding, after a warm-up "
        "batch). Images per CPU-second: the process's CPU time, all its threads, so a per-core figure "
        "that other work on the machine does not lower.", "",
        table(["reader", "work", "images/s (min-max)", "images per CPU-second", "files opened/s",
               "files opened to start"], rows), "",
        f"**Goal: shards at least {summary['goal_ratio']:g}x the images/s of files per reader thread: "
        f"{_met(summary['faster_met'])}** "
        f"({ratio['read']:.1f}x the images/s reading, {summary['images_per_cpu_s_ratio']:.1f}x the images per "
        f"CPU-second; {ratio['decode']:.2f}x the images/s with decoding on the CPU, where the decoder's work is the "
        "same for both). **Files opened per second down by at least the shard size "
        f"({data['samples_per_shard']}): {_met(summary['fewer_opens_met'])}** ({summary['opens_per_s']['files']:.0f}/s "
        f"from the folder, one per image; {summary['opens_per_s']['shards']:.0f}/s from shards: DALI maps each shard "
        "and its index once, when the pipeline is built (the last column: for files, those of the first batches it "
        "read ahead), and reads the mapped files from then on; at ImageNet's 1,252 training shards that is 2,504 "
        "opens per rank per run, against one per image from files).", "",
        f"CPU cores per GPU for the paper's pace (1.35M images/s over 512 GPUs: {summary['per_gpu']:.0f} images/s "
        "per GPU), at these images per CPU-second: reading only, as on a GPU node where nvJPEG decodes, "
        f"**{cores['read/files']:.2f} from files, {cores['read/shards']:.2f} from shards**; decoding on the CPU "
        f"too, {cores['decode/files']:.1f} from files and {cores['decode/shards']:.1f} from shards. Page cache "
        "and cores like these; a shared file system adds its latency to every file open, and a node that "
        "reads shards from its local disk needs none.", ""]
