"""A finished training run as the harness reads it: its summary, its records, its communication
options, and its steady step time (median logged interval, after CSC's dense warm-up).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any

from gradientflow_repro.comm import knobs
from gradientflow_repro.tracking import read_records


def load_run(run_dir: Path) -> dict:
    """``summary`` (summary.json), ``records`` (metrics.jsonl) and ``comm``: the run's ``comm.*``
    options as its config.yaml recorded them (else its strategy alone, from the summary)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"summary": summary, "records": read_records(run_dir / "metrics.jsonl"),
            "comm": comm_options(run_dir, summary)}


def comm_options(run_dir: Path, summary: dict) -> dict[str, Any]:
    """The ``comm.*`` keys a run was configured with (``knobs.resolve`` takes them)."""
    import yaml

    config = run_dir / "config.yaml"
    fields = {f.name for f in dataclasses.fields(knobs.CommConfig)}
    if config.is_file():
        comm = (yaml.safe_load(config.read_text()) or {}).get("comm") or {}
        options = {key: value for key, value in comm.items() if key in fields}
        if options.get("strategy"):
            return options
    return {"strategy": summary.get("strategy", "allreduce")}


def dense_warmup_epochs(run: dict) -> float:
    """Epochs the run trained densely before its steady state (``knobs.dense_warmup_epochs``)."""
    return knobs.dense_warmup_epochs(knobs.resolve(run.get("comm") or {"strategy": run["summary"].get("strategy")}))


def steady_step(run: dict, after_epoch: float = 0.0) -> dict[str, float]:
    """Median step time and synchronize wait over the logged intervals (after ``after_epoch``)."""
    train = [r for r in run["records"] if r["kind"] == "train" and r["epoch"] > after_epoch]
    train = train or [r for r in run["records"] if r["kind"] == "train"]
    if not train:  # ended before its first progress line: the run's averages
        s = run["summary"]
        return {"step_s": s["train_s"] / max(1, s["steps"]), "sync_wait_s": s["sync_wait_s_per_step"],
                "bytes_per_step": s["bytes_per_step"]}
    return {"step_s": statistics.median(r["step_s"] for r in train),
            "sync_wait_s": statistics.median(r["sync_wait_s_per_step"] for r in train),
            "bytes_per_step": statistics.median(r["bytes_per_step"] for r in train)}


def median_step(repeats: list[dict], skip_warmup: bool = True) -> dict:
    """``steady_step`` of each repeat of one strategy (after CSC's dense warm-up if
    ``skip_warmup``): the median of each figure, and every repeat's step time (``step_s_each``)."""
    steps = [steady_step(run, dense_warmup_epochs(run) if skip_warmup else 0.0) for run in repeats]
    return {**{key: statistics.median(step[key] for step in steps) for key in steps[0]},
            "step_s_each": [step["step_s"] for step in steps]}
