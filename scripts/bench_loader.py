#!/usr/bin/env python3
"""Loader and harness-overhead benchmark -> loader.json, rendered to loader.md

1. Images/s of the DALI CPU pipeline against the torchvision ImageFolder-style loader, reading the
   same JPEG folder with the same number of threads (DALI threads = DataLoader workers), measured
   side by side in one run, alternating rounds. Two folders: the embedded digits (32 px) and the same
   digits re-encoded at ImageNet size (320x256 JPEGs, 224-px crops), where decoding dominates.
2. The harness's per-step overhead: Trainer.train_step (schedule, autocast, communicator, agreed
   finiteness check, logging) against a plain PyTorch loop over the same model, optimizer and batch.
3. The training feeder alone: the DALI external source's work per batch (read files, parse headers,
   draw crop windows) without decoding, per reader worker and through DALI's worker pool, on
   synthetic ImageNet-sized JPEGs; how many workers a rank needs for the paper's 3,297 images/s.
   --feeder-only runs just this one and replaces only its part of loader.json.
4. ImageNet from shards against files: one DALI thread reading synthetic ImageNet-sized JPEGs from
   a folder and from webdataset shards, with and without decoding; files opened per second; CPU
   cores per GPU at the paper's pace. --shards-only runs just this one (--shards-render renders
   loader.md again from loader.json without measuring).
Written under results/runs/bench_loader/, with --report to results/.
The logic: gradientflow_repro/bench/loader.py and loader_shards.py.

    python scripts/bench_loader.py [--threads 2] [--batches 30] [--rounds 3] [--feeder-only | --shards-only]
"""

from __future__ import annotations

import argparse
import logging
import sys

from gradientflow_repro import logs, render
from gradientflow_repro.bench.loader import bench_feeder, bench_loader, write_parts
from gradientflow_repro.bench.loader_shards import bench_shards

log = logging.getLogger("gradientflow_repro.scripts.bench_loader")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60, help="overhead: steps per round, alternated")
    parser.add_argument("--feeder-only", action="store_true",
                        help="measure only the training feeder; replace only its part of loader.json")
    parser.add_argument("--feeder-batches", type=int, default=40, help="feeder: batches per round")
    parser.add_argument("--shards-only", action="store_true", help="measure only shards against files")
    parser.add_argument("--shards-render", action="store_true", help="render loader.md again from loader.json")
    parser.add_argument("--shards-images", type=int, default=2048, help="shards: synthetic JPEGs to read")
    parser.add_argument("--report", action="store_true", help="write the committed results/loader.*")
    args = parser.parse_args()
    if min(args.threads, args.batches, args.rounds, args.steps, args.feeder_batches, args.shards_images) < 1:
        parser.error("--threads, --batches, --rounds, --steps, --feeder-batches, --shards-images must be positive")
    logs.configure("bench_loader")
    out = render.output_dir("bench_loader", args.report) / "loader.json"
    command = ("python scripts/bench_loader.py " + " ".join(sys.argv[1:])).strip()
    if args.shards_render:
        render.render_file(out)
    elif args.feeder_only:
        write_parts(out, {"feeder": bench_feeder(batches=args.feeder_batches, rounds=args.rounds, command=command)})
    elif args.shards_only:
        write_parts(out, {"shards": bench_shards(count=args.shards_images, rounds=args.rounds, command=command)})
    else:
        write_parts(out, {"loaders": bench_loader(args.threads, args.batches, args.rounds, args.steps, command),
                          "feeder": bench_feeder(rounds=args.rounds, command=command),
                          "shards": bench_shards(rounds=args.rounds, command=command)})
    log.info(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
