#!/usr/bin/env python3
"""Inject every fault of the reliability suite into short real runs -> results/reliability.md

For each fault: what the harness did (exit code, the error it printed), how long after the fault
fired the job ended (time to detection), and whether anything was lost (the newest complete
checkpoint, and whether a resumed run finishes from it). The scenarios and the logic:
gradientflow_repro/reproduction/fault_report.py.

    python scripts/fault_report.py --report     # what `make reliability` runs: results/reliability.md
    python scripts/fault_report.py              # results/runs/reliability/reliability.md
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from pathlib import Path

from gradientflow_repro import logs, render
from gradientflow_repro.reproduction.fault_report import fault_report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report", action="store_true",
                        help="write results/reliability.md (and .json) instead of results/runs/reliability/")
    parser.add_argument("--out", type=Path, default=None, help="the table's path (overrides --report)")
    args = parser.parse_args()
    logs.configure()
    out = args.out or render.output_dir("reliability", args.report) / "reliability.md"
    try:
        fault_report(out, command=shlex.join(["python", "scripts/fault_report.py", *sys.argv[1:]]))
    except FileNotFoundError as error:
        logging.getLogger("gradientflow_repro.fault_report").error(str(error))
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
