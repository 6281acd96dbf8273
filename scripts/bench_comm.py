#!/usr/bin/env python3
"""Communication strategies on real gradient shapes -> comm.json and comm.md

For torchvision's AlexNet and ResNet-50 (their gradient shapes do not depend on the input size:
both end in an adaptive pool, so a small random input gives the real 61M / 25.6M-parameter
gradients at a fraction of the compute), each strategy runs real steps (forward, backward,
``synchronize()``) in ``--world`` gloo processes. Reported per step: seconds the trainer waited in
``synchronize()``, the whole step, bytes this rank sent and collectives issued. CSC is measured in
its sparse phase (after warm-up). Written under results/runs/bench_comm/, with --report to results/.
The logic: gradientflow_repro/bench/comm.py.

    python scripts/bench_comm.py [--world 4] [--steps 3] [--models alexnet resnet50]
"""

from __future__ import annotations

import argparse
import logging
import sys

from gradientflow_repro import logs, render
from gradientflow_repro.bench.comm import bench_comm

log = logging.getLogger("gradientflow_repro.scripts.bench_comm")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--image", type=int, default=64)
    parser.add_argument("--models", nargs="+", default=["alexnet", "resnet50"])
    parser.add_argument("--report", action="store_true", help="write the committed results/ files")
    args = parser.parse_args()
    logs.configure("bench_comm")
    out = render.output_dir("bench_comm", args.report) / "comm.md"
    bench_comm(out, args.world, args.steps, args.image, args.models,
               command=" ".join(["python scripts/bench_comm.py", *sys.argv[1:]]))
    log.info(f"wrote {out} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
