#!/usr/bin/env python3
"""Check an ImageNet-layout folder, arrange a flat validation set into class folders, and write it
once as webdataset shards for DALI.

    python scripts/prepare_imagenet.py /data/imagenet                  # check train/ and val/
    python scripts/prepare_imagenet.py /data/imagenet --arrange-val LOC_val_solution.csv
    python scripts/prepare_imagenet.py /data/imagenet --shards /data/imagenet-shards [--workers N]
    python scripts/prepare_imagenet.py --verify-shards /data/imagenet-shards

Checking lists the number of classes and images per split, the smallest and largest classes,
classes present in one split only, empty class folders, every file that cannot be decoded or that
the trainer's start-up check would refuse (by path), and notes for odd files that the loaders
handle (PNG content behind a .JPEG name, CMYK or grayscale JPEGs); exit code 1 if any problem
was found. The label file for --arrange-val is either the Kaggle CSV
(``ImageId,PredictionString`` with the wnid first) or lines of ``<file name> <wnid>``; images are
moved (same filesystem) into ``val/<wnid>/``. Nothing is moved unless every listed file exists.

--shards writes train/ and val/ as tar shards of --samples-per-shard images (shuffled once with
--seed), each with DALI's index and verified as written, and manifest.json last (read with
``data=imagenet_shards data.root=OUT``); rerun after an interruption, it keeps the shards already
written and verified and writes the rest. --verify-shards re-reads every file a manifest lists and
checks its size and sha256 (exit code 1 on any difference). The logic:
gradientflow_repro/data/imagenet.py and gradientflow_repro/data/shards.py (why shards: its docstring).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from gradientflow_repro import logs
from gradientflow_repro.data.imagenet import arrange_val, check
from gradientflow_repro.data.listing import DatasetError
from gradientflow_repro.data.shards import SAMPLES_PER_SHARD, verify_shards, write_shards


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", type=Path, nargs="?")
    parser.add_argument("--arrange-val", type=Path, metavar="LABELS")
    parser.add_argument("--shards", type=Path, metavar="OUT", help="write webdataset shards and a manifest to OUT")
    parser.add_argument("--samples-per-shard", type=int, default=SAMPLES_PER_SHARD)
    parser.add_argument("--seed", type=int, default=0, help="--shards: the one shuffle of each split")
    parser.add_argument("--verify-shards", type=Path, metavar="DIR", help="check every file of DIR/manifest.json")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    if args.root is None and not args.verify_shards:
        parser.error("the dataset root is required")
    log = logs.configure()  # the command's own lines: no run to name
    try:
        if args.verify_shards:
            problems = verify_shards(args.verify_shards, args.workers)
            for problem in problems:
                log.warning(problem)
            if not problems:
                log.info(f"{args.verify_shards}: every file matches its manifest")
            return 1 if problems else 0
        if args.arrange_val:
            return arrange_val(args.root / "val", args.arrange_val)
        if args.shards:
            write_shards(args.root, args.shards, samples_per_shard=args.samples_per_shard, seed=args.seed,
                         workers=args.workers)
            return 0
    except DatasetError as error:
        log.error(str(error))
        return 1
    return check(args.root, args.workers)


if __name__ == "__main__":
    sys.exit(main())
