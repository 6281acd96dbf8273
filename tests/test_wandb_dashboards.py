"""The W&B dashboards (scripts/wandb_report.py) against what real offline runs write, and what a
requeued run leaves for the upload. No network: the report and the workspace view are built, never
saved; the runs are offline wandb runs of the real trainer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import wandb_workspaces.reports.v2 as wr
import wandb_workspaces.workspaces as ws

from gradientflow_repro.comm import knobs
from gradientflow_repro.reproduction import lineup, wandb_report
from gradientflow_repro.tracking import WANDB_LABEL_KEY

from conftest import FAST, REPO, train, wandb_records

# One epoch of 5 steps at batch 256, evaluated at its end; a target of 1% is reached there, so
# every run writes its time to target.
TINY = [*FAST, "logger=wandb", "logger.mode=offline", "logger.log_every=1", "global_batch_size=256",
        "optim.warmup_epochs=0.5", "eval_every_epochs=1"]


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def logged(run_file: Path) -> dict:
    """What one offline run holds: history metric names and steps, summary keys (``/``-joined as
    the W&B app shows them), config values, its run id and start time."""
    history, steps, summary, config, run = set(), [], set(), {}, None
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.update(_key(item) for item in record.history.item)
            steps.append(record.history.step.num)
        elif kind == "summary":
            summary.update(_key(item) for item in record.summary.update)
        elif kind == "run":
            run = record.run
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
    return {"history": history, "steps": steps, "summary": summary, "config": config, "run_id": run.run_id,
            "start": run.start_time.ToMicroseconds(), "resumed": run.resumed}


def panel_metrics(report) -> dict[str, set]:
    """The metrics the report's panels read, by where they read them: ``history`` (line plots' x
    and y), ``summary`` (bar charts), and the runs table's ``columns``."""
    found = {"history": set(), "summary": set(), "columns": set()}
    for block in report.blocks:
        for panel in getattr(block, "panels", []):
            if isinstance(panel, wr.LinePlot):
                found["history"].update([panel.x, *panel.y])
            elif isinstance(panel, wr.BarPlot):
                for metric in panel.metrics:
                    assert isinstance(metric, wr.SummaryMetric), f"{panel.title}: a bar reads a run's summary"
                    found["summary"].add(metric.name)
            else:
                raise AssertionError(f"a panel this test does not check: {panel!r}")
        for runset in getattr(block, "runsets", []):
            found["columns"].update(runset.pinned_columns)
    return found


def one_label_per_preset() -> dict[str, list[str]]:
    """A label of every communication preset ``make reproduce`` compares, with its overrides: labels
    of one preset (``gradientflow`` and ``gradientflow@0.01``) log the same metrics."""
    labels: dict[str, list[str]] = {}
    for label, options in lineup.COMPARED.items():
        overrides = knobs.hydra_overrides(options)
        if not any(chosen[0] == overrides[0] for chosen in labels.values()):
            labels[label] = overrides
    return labels


@pytest.fixture(scope="module")
def offline_runs(tmp_path_factory: pytest.TempPathFactory, digits_root: Path) -> dict[str, dict]:
    """label -> what its real offline run (one epoch, 2 ranks) logged, for one label per preset."""
    runs = {}
    for label, overrides in one_label_per_preset().items():
        run_dir = tmp_path_factory.mktemp("runs") / label.replace("@", "-")
        train(2, [*TINY, f"data.root={digits_root}", "epochs=1", "target_top1=1", "logger.group=dashboards",
                  f"logger.name={label}", *overrides], run_dir)
        (run_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
        runs[label] = logged(run_file)
    return runs


def test_every_panel_reads_what_a_real_run_of_every_configuration_logged(offline_runs: dict[str, dict]) -> None:
    report = wandb_report.build_report(wr, "dashboards", entity="someone")
    wanted = panel_metrics(report)
    assert {wandb_report.X_AXIS, wandb_report.EPOCH_AXIS, wandb_report.TOP1} <= wanted["history"]
    # the bar of time to target reads the summary key the runs write
    assert wanted["summary"] == {wandb_report.TIME_TO_TARGET}
    for label, run in offline_runs.items():
        assert wanted["history"] <= run["history"], f"{label} never logged {wanted['history'] - run['history']}"
        assert wanted["summary"] <= run["summary"], f"{label}'s summary lacks {wanted['summary'] - run['summary']}"
        assert run["config"][WANDB_LABEL_KEY] == label  # what the seeds are grouped by
        for column in wanted["columns"]:
            section, name = column.split(":", 1)
            if section == "summary":
                assert name in run["summary"], f"runs table column {column}: not in {label}'s summary"
            else:
                assert section == "config" and name.removesuffix(".value") in run["config"], column


def test_report_and_workspace_group_the_seeds_of_each_configuration() -> None:
    report = wandb_report.build_report(wr, "reproduce-1", entity="someone", project="p")
    workspace = wandb_report.build_workspace(ws, wr, "reproduce-1", entity="someone", project="p")
    panels = [panel for block in report.blocks for panel in getattr(block, "panels", [])]
    assert panels and [type(p) for p in panels] == [type(p) for s in workspace.sections for p in s.panels]
    for panel in panels:  # one line (bar) per configuration with the seeds' range, never one per run
        assert panel.groupby == wr.Config(WANDB_LABEL_KEY) and panel.groupby_rangefunc == "minmax", panel.title
        assert panel.groupby_aggfunc == ("median" if isinstance(panel, wr.BarPlot) else "mean"), panel.title
    assert sum(isinstance(p, wr.BarPlot) for p in panels) == 1
    grids = [block for block in report.blocks if isinstance(block, wr.PanelGrid)]
    for runset in (rs for grid in grids for rs in grid.runsets):
        assert runset.groupby == [f"config.{WANDB_LABEL_KEY}"]
        assert runset.pinned_columns == wandb_report.RUN_COLUMNS
    # what the workspace view would send: runs of the group only, grouped by the label, the
    # table's columns pinned (serialised without a network: only saving needs one)
    view = json.loads(workspace._to_model().model_dump_json(by_alias=True, exclude_none=True))
    runset = view["spec"]["section"]["runSets"][0]
    assert runset["grouping"] == [{"section": "config", "name": f"{WANDB_LABEL_KEY}.value"}]
    assert {"key": {"section": "run", "name": "group"}, "op": "=", "value": "reproduce-1",
            "disabled": False} in runset["filters"]["filters"]
    assert all(runset["runFeed"]["columnPinned"].get(column) for column in wandb_report.RUN_COLUMNS)


def test_upload_hint_finds_the_offline_runs_make_reproduce_writes(tmp_path: Path) -> None:
    assert wandb_report.upload_hint(tmp_path) is None
    runs = tmp_path / "results" / "runs" / "reproduce"
    pending = runs / "ring+fp16" / "seed1" / "wandb" / "offline-run-20260101_000000-abc123"
    synced = runs / "ddp" / "seed0" / "wandb" / "offline-run-20260101_000000-def456"
    for run in (pending, synced):
        run.mkdir(parents=True)
        (run / f"run-{run.name[-6:]}.wandb").write_bytes(b":W&B")
    (synced / "run-def456.wandb.synced").touch()  # what `wandb sync` leaves beside what it uploaded
    assert wandb_report.offline_runs(tmp_path) == [pending]
    hint = wandb_report.upload_hint(tmp_path)
    assert hint.startswith("1 offline run(s)") and wandb_report.SYNC_COMMAND in hint
    pattern = wandb_report.SYNC_COMMAND.split()[-1]  # the command's own glob finds them too
    assert sorted(tmp_path.glob(pattern)) == [synced, pending]


def test_without_a_login_it_prints_the_command_to_run_later(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path), WANDB_CONFIG_DIR=str(tmp_path), WANDB_BASE_URL="http://127.0.0.1:9")
    result = subprocess.run([sys.executable, "scripts/wandb_report.py", "--group", "reproduce-1"], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "python scripts/wandb_report.py --group reproduce-1 --entity" in result.stderr
    assert "Traceback" not in result.stderr, result.stderr


def test_a_requeued_run_leaves_pieces_of_one_wandb_run_whose_steps_follow_in_start_order(
        tmp_path: Path, digits_root: Path) -> None:
    common = [*TINY, f"data.root={digits_root}", "epochs=2", "checkpoint.every_epochs=1", "comm=allreduce"]
    train(2, [*common, "max_steps=5"], tmp_path)  # stopped at the checkpoint of epoch 1, as a preemption
    train(2, common, tmp_path)  # the requeued launch resumes it
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 10
    # `wandb sync` uploads the pieces of one run id one after another by their run's start time
    pieces = sorted((logged(f) for f in tmp_path.glob("wandb/offline-run-*/run-*.wandb")), key=lambda p: p["start"])
    assert len(pieces) == 2 and {p["run_id"] for p in pieces} == {summary["wandb_run_id"]}
    first, second = pieces[0]["steps"], pieces[1]["steps"]
    assert first == sorted(first) and second == sorted(second)
    assert max(first) == 5 and min(second) == 5 and max(second) == 10, (first, second)
    assert sorted(set(first + second)) == list(range(11))  # together: every step, in order
    # offline, wandb records no resume in the run: the upload must resume the id itself
    # (WANDB_RESUME=allow, docs/outputs.md), or the second piece replaces the first
    assert not any(p["resumed"] for p in pieces)
