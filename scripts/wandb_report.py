#!/usr/bin/env python3
"""A W&B report comparing time to accuracy of one reproduction (a wandb group).

The runs of `make reproduce` are offline wandb runs. Upload them first, then build the report:

    wandb login
    wandb sync results/runs/reproduce/*/seed*/wandb/offline-run-*
    python scripts/wandb_report.py --group reproduce-YYYYMMDD-HHMMSS [--entity ME] [--project P]

The report holds validation top-1 against wall-clock seconds (MLPerf clock) for every strategy,
time per step, bytes per step and seconds waited in synchronize, and a table of the runs. It needs
the ``wandb-workspaces`` package (``pip install wandb-workspaces``) and a login; without them it
says what is missing, and results/REPORT.md has the same comparison.
"""

from __future__ import annotations

import argparse
import sys

from gradientflow_repro.reproduction.wandb_report import build_report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--group", required=True, help="the wandb group printed in results/REPORT.md")
    parser.add_argument("--project", default="gradientflow-repro")
    parser.add_argument("--entity", default=None, help="default: your wandb default entity")
    args = parser.parse_args()
    return build_report(args.group, args.project, args.entity)


if __name__ == "__main__":
    sys.exit(main())
