#!/usr/bin/env python3
"""Accuracy over the whole schedule, dense against sparse communication: every configuration trained
once per seed without stopping at the target, on loopback, then results/convergence.md.

    python scripts/convergence.py --report                          # what `make convergence` runs
    python scripts/convergence.py --configs ddp gradientflow 'cap0=comm=gradientflow comm.release_cap=0'
    python scripts/convergence.py --seeds 0 1 2 3 4 -- epochs=6     # Hydra overrides for every run after --

Finished runs are kept (results/runs/convergence/) and reused by the next study with the same
overrides, world size and code (commit and uncommitted changes): run it again after an interruption
and it continues. What it does: gradientflow_repro/reproduction/convergence.py.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from gradientflow_repro import logs, render
from gradientflow_repro.cluster.netemu import run_script
from gradientflow_repro.reproduction import convergence


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiment", default="patterns_cpu")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--configs", nargs="+", default=list(convergence.DEFAULT_CONFIGS),
                        help="labels of make reproduce's configurations, or LABEL='Hydra overrides'; "
                             "ddp (else the first dense one) is the reference")
    parser.add_argument("--targets", type=float, nargs="*", default=[],
                        help="top-1 targets (%%) besides the experiment's own, e.g. --targets 85 88")
    parser.add_argument("--runs-dir", type=Path, default=convergence.RUNS_DIR)
    parser.add_argument("--report", action="store_true",
                        help="write results/convergence.md (and .json, runs.csv, the figure) instead of "
                             "results/runs/convergence/convergence.md")
    parser.add_argument("--out", type=Path, default=None, help="the report's path (overrides --report)")
    parser.add_argument("--timeout-s", type=float, default=900, help="per training run")
    parser.add_argument("--fresh", action="store_true", help="train every run again (default: keep finished ones)")
    parser.add_argument("--report-only", action="store_true",
                        help="train nothing: rewrite the report from the kept runs (whatever code trained them)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after --)")
    args = parser.parse_args()
    logs.configure()
    out = args.out or render.output_dir("convergence", args.report) / "convergence.md"
    try:
        configs = convergence.parse_configs(args.configs)
        convergence.check_overrides(args.overrides, "overrides for every run")
        convergence.experiment_target(args.experiment)  # the preset exists
    except ValueError as error:
        parser.error(str(error))
    try:
        convergence.study(configs=configs, experiment=args.experiment, world=args.world, seeds=args.seeds,
                          targets=args.targets, runs_dir=args.runs_dir, out=out, overrides=args.overrides,
                          timeout_s=args.timeout_s, fresh=args.fresh, report_only=args.report_only,
                          command=shlex.join(["python", "scripts/convergence.py", *sys.argv[1:]]))
    except ValueError as error:
        if not args.report_only:
            raise
        parser.error(str(error))


if __name__ == "__main__":
    run_script(main)
