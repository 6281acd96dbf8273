#!/usr/bin/env python3
"""Inject every fault of the reliability suite into short real runs -> results/reliability.md

For each fault: what the harness did (exit code, the error it printed), how long after the fault
fired the job ended (time to detection), and whether anything was lost (the newest complete
checkpoint, and whether a resumed run finishes from it). The scenarios and the logic:
gradientflow_repro/reproduction/fault_report.py.

    python scripts/fault_report.py [--out results/reliability.md]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gradientflow_repro import REPO
from gradientflow_repro.reproduction.fault_report import fault_report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "results" / "reliability.md")
    args = parser.parse_args()
    fault_report(args.out)


if __name__ == "__main__":
    main()
