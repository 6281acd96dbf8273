#!/usr/bin/env python3
"""A W&B report comparing time to accuracy of one reproduction (a wandb group).

The runs of `make reproduce` are offline wandb runs. Upload them first, then build the report:

    wandb login
    wandb sync results/runs/reproduce/*/r*/wandb/offline-run-*
    python scripts/wandb_report.py --group reproduce-YYYYMMDD-HHMMSS [--entity ME] [--project P]

The report holds validation top-1 against wall-clock seconds (MLPerf clock) for every strategy,
time per step, bytes per step and seconds waited in synchronize, and a table of the runs. It needs
the ``wandb-workspaces`` package (``pip install wandb-workspaces``) and a login; without them it
says what is missing, and results/REPORT.md has the same comparison.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
X_AXIS = "time/mlperf_s"
# wandb metric (as gradientflow_repro.tracking.wandb_keys names it) -> panel title
PANELS = {"val/top1": "validation top-1 (%)",
          "train/step_s": "seconds per step",
          "comm/bytes_per_step": "bytes sent per rank per step",
          "comm/sync_wait_s_per_step": "seconds waited in synchronize per step",
          "comm/density": "fraction of gradient chunks sent (CSC)"}


def offline_runs() -> list[Path]:
    return sorted((REPO / "results" / "runs" / "reproduce").glob("*/r*/wandb/offline-run-*"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--group", required=True, help="the wandb group printed in results/REPORT.md")
    parser.add_argument("--project", default="gradientflow-repro")
    parser.add_argument("--entity", default=None, help="default: your wandb default entity")
    args = parser.parse_args()
    pending = offline_runs()
    if pending:
        print(f"{len(pending)} offline run(s) under results/runs/reproduce; upload them first with:\n"
              "  wandb sync results/runs/reproduce/*/r*/wandb/offline-run-*", file=sys.stderr)
    try:
        import wandb
        import wandb_workspaces.reports.v2 as wr
    except ImportError as error:
        print(f"error: {error.name} is not installed: pip install wandb-workspaces", file=sys.stderr)
        return 2
    api = wandb.Api()
    entity = args.entity or api.default_entity
    if not entity:
        print("error: not logged in to wandb (run `wandb login`) and no --entity given", file=sys.stderr)
        return 2
    runs = api.runs(f"{entity}/{args.project}", filters={"group": args.group})
    if len(runs) == 0:
        print(f"error: no runs in group {args.group!r} of {entity}/{args.project}: sync them first",
              file=sys.stderr)
        return 2
    runset = wr.Runset(entity=entity, project=args.project, name=args.group,
                       filters=f"Group = '{args.group}'", groupby=["Name"])

    def line(y: str, title: str) -> wr.LinePlot:
        return wr.LinePlot(title=title, x=X_AXIS, y=[y], smoothing_factor=0.0)

    report = wr.Report(
        entity=entity, project=args.project, title=f"GradientFlow reproduction: {args.group}",
        description="Time to accuracy of each communication strategy (make reproduce).",
        blocks=[
            wr.H1("Time to accuracy"),
            wr.P("Validation top-1 against wall-clock seconds (MLPerf clock: from before data "
                 "loading, never paused, evaluation included), one line per strategy and repeat."),
            wr.PanelGrid(runsets=[runset], panels=[
                *[line(metric, title) for metric, title in PANELS.items()],
                wr.RunComparer(diff_only=False)]),
        ])
    report.save()
    print(f"report saved: {report.url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
