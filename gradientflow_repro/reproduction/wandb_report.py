"""W&B dashboards of one reproduction (a wandb group): a saved **report** and a saved **workspace
view** with the same panels.

What they show, with the seeds of each compared configuration grouped into one line (mean, with the
range from the lowest to the highest seed as a band):

1. validation top-1 against the MLPerf clock (``time/mlperf_s``) and against epochs (``val/epoch``);
2. a bar per configuration of its time to target on the MLPerf clock (the summary key
   ``time_to_target_mlperf_s`` that ``tracking.run_summary`` writes; median over seeds, range as
   whiskers; a run that never reached the target has no value there and adds nothing to its bar);
3. seconds per step, bytes sent per rank per step, seconds waited in synchronize, fraction of
   chunks sent (CSC), against the MLPerf clock;
4. the runs table with results/REPORT.md's columns (``RUN_COLUMNS``).

Seeds are grouped by the config key ``tracking.WANDB_LABEL_KEY`` (the run's label: ``ring+fp16``,
``gradientflow@0.01``, ...), which every run writes; ``comm.strategy`` cannot group them, several
labels share one strategy. Every metric named here is checked against what a real offline run of
every compared configuration logged (tests/test_wandb_dashboards.py).

Needs the ``wandb-workspaces`` package (an optional dependency: ``pip install -e .[dashboards]``)
and a wandb login or ``--entity``; without them ``save_dashboards`` logs the command to run later
and returns 2. The runs must be uploaded first (``upload_hint``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

from gradientflow_repro import REPO
from gradientflow_repro.tracking import WANDB_LABEL_KEY

log = logging.getLogger(__name__)

PROJECT = "gradientflow-repro"
X_AXIS = "time/mlperf_s"  # MLPerf's clock, as tracking.wandb_keys logs it
EPOCH_AXIS = "val/epoch"  # the epoch of each evaluation
TOP1 = "val/top1"
# wandb metric (as gradientflow_repro.tracking.wandb_keys names it) -> panel title, against X_AXIS
PANELS = {TOP1: "validation top-1 (%)",
          "train/step_s": "seconds per step",
          "comm/bytes_per_step": "bytes sent per rank per step",
          "comm/sync_wait_s_per_step": "seconds waited in synchronize per step",
          "comm/density": "fraction of gradient chunks sent (CSC)"}
TIME_TO_TARGET = "time_to_target_mlperf_s"  # summary key (tracking.run_summary), only when reached
# The runs table: results/REPORT.md's columns, as wandb run-table accessors (summary: the run's
# summary.json values; config: the composed configuration)
RUN_COLUMNS = [f"config:{WANDB_LABEL_KEY}.value", "config:seed.value", f"summary:{TIME_TO_TARGET}",
               "summary:time_to_target_train_s", "summary:epochs", "summary:final_top1", "summary:images_per_s",
               "summary:bytes_per_step", "summary:sync_wait_s_per_step", "summary:world_size"]
REPRODUCE_RUNS = Path("results") / "runs" / "reproduce"
# the pieces of one wandb run (a requeued job leaves one per launch) append only when the upload
# resumes each run id: docs/outputs.md, "Requeued jobs"
SYNC_COMMAND = f"WANDB_RESUME=allow wandb sync {REPRODUCE_RUNS}/*/seed*/wandb/offline-run-*"


def offline_runs(root: Path = REPO) -> list[Path]:
    """The offline wandb runs of ``make reproduce`` under ``root`` not uploaded yet (``wandb sync``
    leaves a ``.synced`` marker beside each run file it uploaded). ``make reproduce`` writes each run
    into ``results/runs/reproduce/<label>/seed<N>/`` (``reproduce.py``)."""
    return sorted(run for run in (root / REPRODUCE_RUNS).glob("*/seed*/wandb/offline-run-*")
                  if not any(run.glob("run-*.wandb.synced")))


def upload_hint(root: Path = REPO) -> Optional[str]:
    """What to run to upload the pending offline runs under ``root``; None when there are none."""
    pending = offline_runs(root)
    if not pending:
        return None
    return (f"{len(pending)} offline run(s) under {REPRODUCE_RUNS} not uploaded yet; upload them first with:\n"
            f"  {SYNC_COMMAND}")


def dashboard_command(group: str, project: str = PROJECT, entity: Optional[str] = None) -> str:
    """The one command that saves the dashboards of ``group`` (with a wandb login or ``entity``)."""
    return ("python scripts/wandb_report.py --group " + group + ("" if project == PROJECT else f" --project {project}")
            + (f" --entity {entity}" if entity else " --entity YOUR_ENTITY"))


def _grouped(wr: Any, **fields: Any) -> dict:
    """Panel options that draw each configuration's seeds as one group: the mean (bars: the median,
    as results/REPORT.md) with the range over seeds."""
    return {"groupby": wr.Config(WANDB_LABEL_KEY), "groupby_rangefunc": "minmax", **fields}


def panels(wr: Any) -> dict[str, list]:
    """The panels of both dashboards by section, built with ``wandb_workspaces.reports.v2`` (``wr``)."""
    def line(y: str, title: str, x: str = X_AXIS) -> Any:
        return wr.LinePlot(title=title, x=x, y=[y], smoothing_factor=0.0, **_grouped(wr, groupby_aggfunc="mean"))

    return {
        "Time to accuracy": [
            line(TOP1, PANELS[TOP1] + " against the MLPerf clock (s)"),
            line(TOP1, PANELS[TOP1] + " against epochs", x=EPOCH_AXIS),
            wr.BarPlot(title="time to target, MLPerf clock (s): median over seeds, range as whiskers",
                       metrics=[wr.SummaryMetric(TIME_TO_TARGET)], orientation="h",
                       **_grouped(wr, groupby_aggfunc="median"))],
        "Communication": [line(metric, title) for metric, title in PANELS.items() if metric != TOP1],
    }


def _runs_of(group: str) -> str:
    return f"Group = '{group}'"


def build_report(wr: Any, group: str, entity: str, project: str = PROJECT) -> Any:
    """The report of ``group`` (not saved): both sections' panels over the group's runs, grouped by
    configuration, with the runs table (the runset's columns)."""
    runset = wr.Runset(entity=entity, project=project, name=group, filters=_runs_of(group),
                       groupby=[f"config.{WANDB_LABEL_KEY}"], pinned_columns=RUN_COLUMNS)
    blocks = [wr.H1(f"GradientFlow reproduction {group}"),
              wr.P("Each line is one configuration: the mean over its seeds, the band their range. Time is "
                   "MLPerf's clock: from before data loading, never paused, evaluation included. The table "
                   "below each grid lists the runs with results/REPORT.md's columns.")]
    for section, section_panels in panels(wr).items():
        blocks += [wr.H2(section), wr.PanelGrid(runsets=[runset], panels=section_panels)]
    return wr.Report(entity=entity, project=project, title=f"GradientFlow reproduction: {group}",
                     description="Time to accuracy of each communication strategy (make reproduce).",
                     blocks=blocks)


def build_workspace(ws: Any, wr: Any, group: str, entity: str, project: str = PROJECT) -> Any:
    """The saved workspace view of ``group`` (not saved): the report's panels, the runs table with
    its columns pinned, runs filtered to the group and grouped by configuration."""
    from wandb_workspaces import expr

    return ws.Workspace(
        entity=entity, project=project, name=f"GradientFlow reproduction {group}",
        sections=[ws.Section(name=name, panels=section_panels, is_open=True)
                  for name, section_panels in panels(wr).items()],
        settings=ws.WorkspaceSettings(x_axis=X_AXIS, smoothing_type="none", max_runs=100),
        runset_settings=ws.RunsetSettings(filters=_runs_of(group), groupby=[expr.Config(WANDB_LABEL_KEY)],
                                          pinned_columns=RUN_COLUMNS))


def save_dashboards(group: str, project: str = PROJECT, entity: Optional[str] = None) -> int:
    """Save the report and the workspace view of wandb group ``group``; returns the exit status
    (2: something is missing, and the command to run once it is there was logged)."""
    hint = upload_hint()
    if hint:
        log.warning(hint)
    later = f"then run:\n  {dashboard_command(group, project, entity)}"
    try:
        import wandb
        import wandb_workspaces.reports.v2 as wr
        import wandb_workspaces.workspaces as ws
    except ImportError as error:
        log.error(f"{error.name} is not installed (pip install -e .[dashboards]); {later}")
        return 2
    try:
        api = wandb.Api()
        entity = entity or api.default_entity
    except Exception as error:  # noqa: BLE001 - no login, no network: say what to do instead of a traceback
        log.error(f"wandb: {error}\nLog in (`wandb login`) or pass --entity; {later}")
        return 2
    if not entity:
        log.error(f"not logged in to wandb and no --entity given; `wandb login`, {later}")
        return 2
    try:
        if len(api.runs(f"{entity}/{project}", filters={"group": group})) == 0:
            log.error(f"no runs in group {group!r} of {entity}/{project}: upload them first:\n  {SYNC_COMMAND}\n"
                      f"{later}")
            return 2
        report = build_report(wr, group, entity, project)
        report.save()
        workspace = build_workspace(ws, wr, group, entity, project)
        workspace.save()
    except Exception as error:  # noqa: BLE001
        log.error(f"wandb: {type(error).__name__}: {error}\n{later}")
        return 2
    log.info(f"report saved: {report.url}\nworkspace view saved: {workspace.url}")
    return 0
