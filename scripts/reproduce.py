#!/usr/bin/env python3
"""The paper's comparison on one machine: the ablation ladder, each rung trained over the whole
schedule on an emulated cluster network once per seed, then results/REPORT.md with MLPerf's
criterion (time to the target accuracy) and the paper's (the fixed schedule) from the same runs.

    python scripts/reproduce.py --report                 # what `make reproduce` runs: results/REPORT.md
    python scripts/reproduce.py --repeats 1 --rungs allreduce gradientflow -- max_steps=40

Interrupted (Ctrl-C, kill, a closed terminal)? Run the same command again: the reproduction
continues, keeping every job that finished (runs_dir/progress.json). That needs the same plan: the
options that shape the runs (not --timeout-s, --report or --out), the overrides, the code (commit and
uncommitted changes) and the machine (CPU, cores, GPU, Python and torch versions); with another, it
stops and says what differs, and --fresh discards the unfinished reproduction and starts over. A
finished one is always done again; two launches never work in one directory at once.
What it does, step by step: gradientflow_repro/reproduction/reproduce.py.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from gradientflow_repro import logs, render
from gradientflow_repro.cluster.netemu import run_script
from gradientflow_repro.reproduction import reproduce
from gradientflow_repro.reproduction.lineup import COMPARED
from gradientflow_repro.reproduction.progress import CannotContinue


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiment", default="patterns_cpu")
    parser.add_argument("--world", type=int, default=4, help="ranks for the time-to-accuracy ladder")
    parser.add_argument("--check-world", type=int, nargs="*", default=None,
                        help="extra world sizes with short step-time runs for the scaling model "
                             f"(default: {' '.join(map(str, reproduce.DEFAULT_CHECK_WORLDS))}, "
                             "unless it is --world; none without allreduce among --rungs: the model's reference)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="seeds per configuration: repeat r runs with seed=r (initial weights, data order)")
    defaults = "; ".join(f"{name}: {' '.join(labels)}" for name, labels in reproduce.DEFAULT_RUNGS.items())
    parser.add_argument("--rungs", nargs="+", default=None, choices=list(COMPARED),
                        help="configurations to train: the ladder, gradientflow's variants for convergence and "
                             "the peers (PyTorch's fp16 and PowerSGD hooks, the paper's stack as published); "
                             f"default: per experiment ({defaults}), else all of them")
    parser.add_argument("--rate-mbit", type=float, default=None,
                        help="link rate; default: chosen to match the paper's comm/compute ratio")
    parser.add_argument("--no-emulation", action="store_true", help="loopback even as root")
    parser.add_argument("--runs-dir", type=Path, default=reproduce.RUNS_DIR)
    parser.add_argument("--report", action="store_true",
                        help="write results/REPORT.md (and .json, runs.csv, the figures) instead of "
                             "results/runs/reproduce/REPORT.md")
    parser.add_argument("--out", type=Path, default=None, help="the report's path (overrides --report)")
    parser.add_argument("--timeout-s", type=float, default=600, help="per training run")
    parser.add_argument("--check-steps", type=int, default=24, help="steps of each step-time run")
    parser.add_argument("--check-repeats", type=int, default=reproduce.CHECK_REPEATS,
                        help="step-time runs per strategy and world size (trimmed to fit the time budget; "
                             "more give a median over repeats)")
    parser.add_argument("--netbench-launches", type=int, default=reproduce.NETBENCH_LAUNCHES,
                        help="launches of the network measurement per world size (figures are averaged)")
    parser.add_argument("--fresh", action="store_true",
                        help="discard an unfinished reproduction in --runs-dir and start over")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite the report from the runs of the last reproduction, run nothing")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after --)")
    args = parser.parse_args()
    logs.configure()
    report = args.out or render.output_dir("reproduce", args.report) / "REPORT.md"
    try:
        reproduce.check_worlds_for(args.world, args.check_world)
    except ValueError as error:
        parser.error(f"--check-world: {error}")
    if args.report_only:
        reproduce.report_from(args.runs_dir, report)
        return
    try:
        reproduce.reproduce(
            experiment=args.experiment, world=args.world, check_worlds=args.check_world, repeats=args.repeats,
            rungs=args.rungs, rate_mbit=args.rate_mbit, emulate=not args.no_emulation, runs_dir=args.runs_dir,
            report=report, timeout_s=args.timeout_s, check_steps=args.check_steps,
            check_repeats=args.check_repeats, netbench_launches=args.netbench_launches, overrides=args.overrides,
            fresh=args.fresh, command=" ".join(["python scripts/reproduce.py", *sys.argv[1:]]))
    except CannotContinue as error:
        logging.getLogger("gradientflow_repro.reproduce").error(f"reproduce: {error}")
        sys.exit(2)


if __name__ == "__main__":
    run_script(main)
