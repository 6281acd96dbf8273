#!/usr/bin/env python3
"""Communication alone on an emulated cluster -> cluster_comm.json, rendered to cluster_comm.md

Nodes of several ranks (a network namespace per node, its ranks on the node's loopback, one
tbf-shaped uplink per node), every strategy replaying a model's real gradients in backward order
with no computation, so the network is the limit: the numbers an analytic scaling model is checked
against, with the network measured in the same launches. Layouts: 8 ranks as 2 nodes x 4 and 4
nodes x 2, 4 ranks as 2 x 2; then the largest dense strategy again at twice the rate (the
network-bound check, after the first round). Every layout is launched 3 times in rounds
(--launches): the tables give the median over the launches and each launch's figure. Stopped, the
same command continues from the finished launches (--fresh discards them). Needs root for the
emulation (else loopback, and the report says so). Written under results/runs/cluster_comm/, with
--report to results/. The logic: gradientflow_repro/bench/cluster.py.

    python scripts/bench_cluster.py [--rate-mbit 50] [--steps 7] [--layouts 8x4 8x2 4x2] [--launches 3]
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from gradientflow_repro import logs, render
from gradientflow_repro.bench import cluster as bench
from gradientflow_repro.cluster.netemu import run_script
from gradientflow_repro.reproduction.progress import CannotContinue

log = logging.getLogger("gradientflow_repro.scripts.bench_cluster")


def layout(text: str) -> tuple[int, int]:
    """``WORLDxRANKS_PER_NODE``, e.g. 8x4: 8 ranks as 2 nodes of 4."""
    world, per_node = (int(part) for part in text.split("x"))
    if per_node < 1 or world % per_node:
        raise argparse.ArgumentTypeError(f"{text}: ranks per node must divide the world size")
    return world, per_node


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be at least 1")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate-mbit", type=float, default=bench.RATE_MBIT, help="per node uplink")
    parser.add_argument("--layouts", type=layout, nargs="+", default=list(bench.LAYOUTS),
                        help="WORLDxRANKS_PER_NODE (default: 8x4 8x2 4x2)")
    parser.add_argument("--strategies", nargs="+", default=list(bench.strategy_labels()),
                        choices=list(bench.strategy_labels()),
                        help="strategy labels (variants.py; the default: bench/lineup.py)")
    parser.add_argument("--steps", type=int, default=7, help="timed steps per strategy (after --warmup)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--launches", type=positive, default=bench.LAUNCHES,
                        help="launches of every layout, in rounds: the tables give their median and each one")
    parser.add_argument("--experiment", default="digits_cpu", help="whose model's gradients")
    parser.add_argument("--no-emulation", action="store_true", help="loopback even as root")
    parser.add_argument("--no-check", action="store_true", help="skip the network-bound check at twice the rate")
    parser.add_argument("--runs-dir", type=Path, default=bench.RUNS_DIR,
                        help="the ranks' logs and progress.json (an interrupted benchmark continues from it)")
    parser.add_argument("--fresh", action="store_true",
                        help="discard an unfinished benchmark of another plan in --runs-dir and start over")
    parser.add_argument("--report", action="store_true", help="write the committed results/cluster_comm.*")
    args = parser.parse_args()
    logs.configure("bench_cluster")
    out = render.output_dir("cluster_comm", args.report) / "cluster_comm.md"
    if len(set(args.layouts)) != len(args.layouts):
        parser.error(f"--layouts: each layout once ({' '.join(f'{w}x{n}' for w, n in args.layouts)})")
    try:
        bench.bench_cluster(out, out.with_suffix(".json"), args.rate_mbit, args.layouts, args.strategies, args.steps,
                                   args.warmup, emulate=not args.no_emulation, check=not args.no_check,
                                   experiment=args.experiment, runs_dir=args.runs_dir,
                                   command=" ".join(["python scripts/bench_cluster.py", *sys.argv[1:]]),
                                   launches=args.launches, fresh=args.fresh)
    except CannotContinue as error:
        log.error(f"bench_cluster: {error}")
        sys.exit(2)


if __name__ == "__main__":
    run_script(main)
