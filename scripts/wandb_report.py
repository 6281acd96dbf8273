#!/usr/bin/env python3
"""Save the W&B dashboards of one reproduction (a wandb group): a report and a workspace view.

The runs of `make reproduce` are offline wandb runs. Upload them first, then save the dashboards:

    wandb login
    WANDB_RESUME=allow wandb sync results/runs/reproduce/*/seed*/wandb/offline-run-*
    python scripts/wandb_report.py --group reproduce-YYYYMMDD-HHMMSS [--entity ME] [--project P]

(`WANDB_RESUME=allow` makes the pieces of a requeued run append to one run: docs/outputs.md.)
Both show validation top-1 against the MLPerf clock and against epochs with each configuration's
seeds grouped (mean and range), a bar chart of time to target per configuration, seconds and bytes
per step, and the runs table with results/REPORT.md's columns. Needs the `wandb-workspaces` package
(`pip install -e .[dashboards]`) and a login or --entity; without them it says the command to
run later and exits with 2. results/REPORT.md has the same comparison offline.
"""

from __future__ import annotations

import argparse
import sys

from gradientflow_repro import logs
from gradientflow_repro.reproduction.wandb_report import PROJECT, save_dashboards


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--group", required=True, help="the wandb group printed in results/REPORT.md")
    parser.add_argument("--project", default=PROJECT)
    parser.add_argument("--entity", default=None, help="default: your wandb default entity")
    args = parser.parse_args()
    logs.configure()
    return save_dashboards(args.group, args.project, args.entity)


if __name__ == "__main__":
    sys.exit(main())
