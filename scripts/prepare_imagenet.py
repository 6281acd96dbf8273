#!/usr/bin/env python3
"""Check an ImageNet-layout folder, and arrange a flat validation set into class folders.

    python scripts/prepare_imagenet.py /data/imagenet                  # check train/ and val/
    python scripts/prepare_imagenet.py /data/imagenet --arrange-val LOC_val_solution.csv

Checking prints the number of classes and images per split, the smallest and largest classes,
classes present in one split only, empty class folders, every file that cannot be decoded or that
the trainer's start-up check would refuse (by path), and notes for odd files that the loaders
handle (PNG content behind a .JPEG name, CMYK or grayscale JPEGs); exit code 1 if any problem
was found. The label file for --arrange-val is either the Kaggle CSV
(``ImageId,PredictionString`` with the wnid first) or lines of ``<file name> <wnid>``; images are
moved (same filesystem) into ``val/<wnid>/``. Nothing is moved unless every listed file exists.
The logic: gradientflow_repro/data/imagenet.py.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from gradientflow_repro.data.imagenet import arrange_val, check


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", type=Path)
    parser.add_argument("--arrange-val", type=Path, metavar="LABELS")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    return arrange_val(args.root / "val", args.arrange_val) if args.arrange_val else check(args.root, args.workers)


if __name__ == "__main__":
    sys.exit(main())
