#!/usr/bin/env python3
"""Loader and harness-overhead benchmark -> results/loader.md

1. Images/s of the DALI CPU pipeline against the torchvision ImageFolder-style loader, reading the
   same JPEG folder with the same number of threads (DALI threads = DataLoader workers), measured
   side by side in one run, alternating rounds. Two folders: the embedded digits (32 px) and the same
   digits re-encoded at ImageNet size (320x256 JPEGs, 224-px crops), where decoding dominates.
2. The harness's per-step overhead: Trainer.train_step (schedule, autocast, communicator, agreed
   finiteness check, logging) against a plain PyTorch loop over the same model, optimizer and batch.
3. The training feeder alone: the DALI external source's work per batch (read files, parse headers,
   draw crop windows) without decoding, per reader worker and through DALI's worker pool, on
   synthetic ImageNet-sized JPEGs; how many workers a rank needs for the paper's 3,297 images/s.
   --feeder-only runs just this one and rewrites only its section of the file.
4. ImageNet from shards against files: one DALI thread reading synthetic ImageNet-sized JPEGs from
   a folder and from webdataset shards, with and without decoding; files opened per second; CPU
   cores per GPU at the paper's pace. --shards-only runs just this one: its measurements go to
   results/loader_shards.json and its section is rendered from that file (--shards-render renders
   it again without measuring).
The logic: gradientflow_repro/bench/loader.py and loader_shards.py.

    python scripts/bench_loader.py [--threads 2] [--batches 30] [--rounds 3] [--feeder-only | --shards-only]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gradientflow_repro import REPO
from gradientflow_repro.bench.loader import bench_feeder, bench_loader, write_feeder_section
from gradientflow_repro.bench.loader_shards import SHARDS_JSON, bench_shards, write_shards_section


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60, help="overhead: steps per round, alternated")
    parser.add_argument("--feeder-only", action="store_true",
                        help="measure only the training feeder; rewrite only its section of --out")
    parser.add_argument("--feeder-batches", type=int, default=40, help="feeder: batches per round")
    parser.add_argument("--shards-only", action="store_true", help="measure only shards against files")
    parser.add_argument("--shards-render", action="store_true", help=f"render that section from {SHARDS_JSON}")
    parser.add_argument("--shards-images", type=int, default=2048, help="shards: synthetic JPEGs to read")
    parser.add_argument("--out", type=Path, default=REPO / "results" / "loader.md")
    args = parser.parse_args()
    if min(args.threads, args.batches, args.rounds, args.steps, args.feeder_batches, args.shards_images) < 1:
        parser.error("--threads, --batches, --rounds, --steps, --feeder-batches, --shards-images must be positive")
    command = ("python scripts/bench_loader.py " + " ".join(sys.argv[1:])).strip()
    if args.feeder_only:
        print(write_feeder_section(args.out, bench_feeder(batches=args.feeder_batches, rounds=args.rounds),
                                   command))
    elif args.shards_render:
        print(write_shards_section(args.out, json.loads((args.out.parent / SHARDS_JSON).read_text())))
    elif args.shards_only:
        data = bench_shards(args.out.parent / SHARDS_JSON, count=args.shards_images, rounds=args.rounds,
                            command=command)
        print(write_shards_section(args.out, data))
    else:
        print(bench_loader(args.out, args.threads, args.batches, args.rounds, args.steps, command=command))


if __name__ == "__main__":
    main()
