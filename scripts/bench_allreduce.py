#!/usr/bin/env python3
"""Bus bandwidth of builtin allreduce, ring and hierarchical -> allreduce.json, .csv and .md

For each world size, one set of processes measures every message size with the three algorithms
side by side (in rounds; in each round every algorithm runs a warm-up call and a block of timed
calls back to back, as nccl-tests does), so ratios are not skewed by drift; the whole sweep is
repeated (``--repeats``) and the table gives the median and the range over the sweeps. Bus bandwidth follows
nccl-tests: algbw = bytes / time, busbw = algbw * 2(N-1)/N (what each link carries for a
bandwidth-optimal allreduce). Hierarchical treats blocks of ``--ranks-per-node`` ranks as nodes.
Written under results/runs/bench_allreduce/, or with --report to the committed results/.
The logic: gradientflow_repro/bench/allreduce.py; the Markdown: gradientflow_repro/render/bench.py.

    python scripts/bench_allreduce.py [--worlds 2 4] [--max-mb 256] [--repeats 3] [--backend gloo] [--report]
    # the ring's segment size against the default, side by side:
    python scripts/bench_allreduce.py --worlds 2 --max-mb 16 --ring-segment-kb 1024 512 128 \\
        --name allreduce_segments
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Optional, Sequence

from gradientflow_repro import logs, render
from gradientflow_repro.bench.allreduce import bench_allreduce
from gradientflow_repro.comm.ring import DEFAULT_SEGMENT_BYTES

log = logging.getLogger("gradientflow_repro.scripts.bench_allreduce")


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--max-mb", type=int, default=256)
    parser.add_argument("--backend", choices=["gloo", "nccl"], default=None, help="default: nccl with CUDA, else gloo")
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=3.0, help="timing budget per point")
    parser.add_argument("--repeats", type=int, default=5, help="whole sweeps per world size")
    parser.add_argument("--ring-segment-kb", type=int, nargs="*", default=[],
                        help="also time the ring with these segment sizes (default segments: "
                             f"{DEFAULT_SEGMENT_BYTES // 1024} KiB)")
    parser.add_argument("--name", default="allreduce", help="the files' name, without suffix")
    parser.add_argument("--report", action="store_true", help="write the committed results/NAME.*")
    parser.add_argument("--out", type=Path, default=None, help="path without suffix (instead of --name, --report)")
    args = parser.parse_args(argv)
    logs.configure("bench_allreduce")
    out = args.out or render.output_dir("bench_allreduce", args.report) / args.name
    bench_allreduce(out, args.worlds, args.max_mb, args.backend, args.ranks_per_node, args.budget_s, args.repeats,
                    args.ring_segment_kb, command=" ".join(["python scripts/bench_allreduce.py",
                                                            *(sys.argv[1:] if argv is None else argv)]))
    log.info(f"wrote {out.with_suffix('.md')}, .json and .csv")


if __name__ == "__main__":
    main()
