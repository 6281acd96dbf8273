"""A W&B report comparing time to accuracy of one reproduction (a wandb group): validation top-1
against wall-clock seconds (MLPerf clock) for every strategy, time per step, bytes per step,
seconds waited in synchronize, the fraction of chunks sent, and a table of the runs.

Needs the ``wandb-workspaces`` package and a wandb login; without them ``build_report`` says what is
missing and returns 2. ``PANELS`` names the metrics as ``tracking.wandb_keys`` logs them (a test
checks that a real offline run logged every one).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from gradientflow_repro import REPO

X_AXIS = "time/mlperf_s"
# wandb metric (as gradientflow_repro.tracking.wandb_keys names it) -> panel title
PANELS = {"val/top1": "validation top-1 (%)",
          "train/step_s": "seconds per step",
          "comm/bytes_per_step": "bytes sent per rank per step",
          "comm/sync_wait_s_per_step": "seconds waited in synchronize per step",
          "comm/density": "fraction of gradient chunks sent (CSC)"}


def offline_runs() -> list[Path]:
    """The offline wandb runs of the last `make reproduce`, not yet uploaded."""
    return sorted((REPO / "results" / "runs" / "reproduce").glob("*/r*/wandb/offline-run-*"))


def build_report(group: str, project: str = "gradientflow-repro", entity: Optional[str] = None) -> int:
    """Save the report of wandb group ``group``; returns the exit status (2: something is missing)."""
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
    entity = entity or api.default_entity
    if not entity:
        print("error: not logged in to wandb (run `wandb login`) and no --entity given", file=sys.stderr)
        return 2
    runs = api.runs(f"{entity}/{project}", filters={"group": group})
    if len(runs) == 0:
        print(f"error: no runs in group {group!r} of {entity}/{project}: sync them first", file=sys.stderr)
        return 2
    runset = wr.Runset(entity=entity, project=project, name=group, filters=f"Group = '{group}'", groupby=["Name"])

    def line(y: str, title: str) -> "wr.LinePlot":
        return wr.LinePlot(title=title, x=X_AXIS, y=[y], smoothing_factor=0.0)

    report = wr.Report(
        entity=entity, project=project, title=f"GradientFlow reproduction: {group}",
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
