#!/usr/bin/env python3
"""Checkpoint save and resume time against world size, and the 512-rank projection -> checkpoint.json and .md

For each world size, gloo ranks on this machine save checkpoints of a per-rank state sized like a
scaled-down CSC residual + velocity (every rank writes and hashes its own file) and resume from them
(each rank verifies and loads only its files), next to what the previous design's rank-0-only
verification cost; then the projection for 512 ranks of AlexNet-BN and ResNet-50 with
comm=gradientflow at a stated file-system bandwidth, against the 180 s preemption warning.
Written under results/runs/bench_checkpoint/, with --report to results/.
The logic: gradientflow_repro/bench/checkpoint.py.

    python scripts/bench_checkpoint.py [--worlds 1 2 4 8] [--rank-mb 64] [--shared-mb 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import logging
import sys

from gradientflow_repro import logs, render
from gradientflow_repro.bench.checkpoint import bench_checkpoint

log = logging.getLogger("gradientflow_repro.scripts.bench_checkpoint")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--rank-mb", type=float, default=64.0, help="per-rank state (residual + velocity), MB")
    parser.add_argument("--shared-mb", type=float, default=32.0, help="shared state (rank 0), MB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--report", action="store_true", help="write the committed results/ files")
    args = parser.parse_args()
    logs.configure("bench_checkpoint")
    out = render.output_dir("bench_checkpoint", args.report) / "checkpoint.md"
    if min(args.worlds) < 1 or args.rank_mb <= 0 or args.shared_mb <= 0 or args.repeats < 1:
        parser.error("--worlds, --rank-mb, --shared-mb and --repeats must be positive")
    bench_checkpoint(out, args.worlds, args.rank_mb, args.shared_mb, args.repeats,
                     command=" ".join(["python scripts/bench_checkpoint.py", *sys.argv[1:]]))
    log.info(f"wrote {out} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
