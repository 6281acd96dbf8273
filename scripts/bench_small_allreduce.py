#!/usr/bin/env python3
"""Small-message allreduce: recursive doubling vs our ring vs gloo's own -> small_allreduce.json and .md

For each world size, gloo ranks on loopback time every message size (4 B, then times 4 up to
``--max-bytes``) with the three algorithms taking turns in rounds of calls back to back after a
warm-up; each figure is the slowest rank's trimmed mean per call. The file states, per world size,
the largest size at which recursive doubling beats the ring, and the value for
``SMALL_MESSAGE_BYTES`` (gradientflow_repro/comm/knobs.py) that follows.
Written under results/runs/bench_small_allreduce/, with --report to results/.
The logic: gradientflow_repro/bench/small_allreduce.py.

    python scripts/bench_small_allreduce.py [--worlds 2 4 8] [--max-bytes 4194304] [--budget-s 1.0]
"""

from __future__ import annotations

import argparse
import logging
import sys

from gradientflow_repro import logs, render
from gradientflow_repro.bench.small_allreduce import bench_small

log = logging.getLogger("gradientflow_repro.scripts.bench_small_allreduce")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--max-bytes", type=int, default=4 << 20, help="largest message (default 4 MiB)")
    parser.add_argument("--budget-s", type=float, default=1.0,
                        help="seconds of timed calls per algorithm and size (within the call limits)")
    parser.add_argument("--rounds", type=int, default=3, help="turns each algorithm takes per size")
    parser.add_argument("--min-calls", type=int, default=5, help="timed calls per round, at least")
    parser.add_argument("--max-calls", type=int, default=300, help="timed calls per round, at most")
    parser.add_argument("--report", action="store_true", help="write the committed results/ files")
    args = parser.parse_args()
    logs.configure("bench_small_allreduce")
    out = render.output_dir("bench_small_allreduce", args.report) / "small_allreduce.md"
    bench_small(out, args.worlds, args.max_bytes, args.budget_s, args.rounds, args.min_calls, args.max_calls,
                command=" ".join(["python scripts/bench_small_allreduce.py", *sys.argv[1:]]))
    log.info(f"wrote {out} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
