"""A finished training run as the harness reads it: its summary, its records, its communication
options, and its steady step time (median logged interval, after CSC's dense warm-up).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any, Optional

from gradientflow_repro.comm import knobs
from gradientflow_repro.tracking import read_records


def load_run(run_dir: Path) -> dict:
    """``summary`` (summary.json), ``records`` (metrics.jsonl), ``config`` (config.yaml as the run
    used it; empty if absent) and ``comm``: the run's ``comm.*`` options (else its strategy alone)."""
    import yaml

    summary = json.loads((run_dir / "summary.json").read_text())
    config_file = run_dir / "config.yaml"
    config = (yaml.safe_load(config_file.read_text()) or {}) if config_file.is_file() else {}
    return {"summary": summary, "records": read_records(run_dir / "metrics.jsonl"), "config": config,
            "comm": comm_options(config, summary)}


def comm_options(config: dict, summary: dict) -> dict[str, Any]:
    """The ``comm.*`` keys a run was configured with (``knobs.resolve`` takes them)."""
    fields = {f.name for f in dataclasses.fields(knobs.CommConfig)}
    options = {key: value for key, value in (config.get("comm") or {}).items() if key in fields}
    return options if options.get("strategy") else {"strategy": summary.get("strategy", "allreduce")}


def run_knobs(run: dict) -> knobs.CommConfig:
    """The run's communication knobs, resolved (from its strategy alone when its options are unknown)."""
    return knobs.resolve(run.get("comm") or {"strategy": run["summary"].get("strategy")})


def is_dense(run: dict) -> bool:
    """Every step sends every gradient: the same SGD whatever the communication strategy."""
    return not knobs.sends_sparse(run_knobs(run))


def evaluations(run: dict) -> list[tuple[float, float]]:
    """(epoch, top-1) of every evaluation, in order."""
    return [(r["epoch"], r["top1"]) for r in run["records"] if r["kind"] == "eval"]


def epochs_to_target(run: dict) -> Optional[float]:
    """Epochs trained when the target was first reached (None: never)."""
    s = run["summary"]
    at = s.get("clocks_at_target")
    return None if not at else at["step"] / (s["steps"] / s["epochs"])


def run_warmup_epochs(run: dict) -> float:
    """The run's learning-rate warm-up, in epochs (0 when its configuration is unknown)."""
    return float((run.get("config") or {}).get("optim", {}).get("warmup_epochs", 0.0))


def dense_warmup_epochs(run: dict) -> float:
    """Epochs the run trained densely before its steady state (``knobs.dense_warmup_epochs``)."""
    return knobs.dense_warmup_epochs(run_knobs(run), run_warmup_epochs(run))


def steady_step(run: dict, after_epoch: float = 0.0) -> dict[str, float]:
    """Median step time, synchronize wait, bytes and (where the run logged it) ``behind_slowest_s``,
    how much sooner rank 0 finished its forward and backward than the slowest rank, over the logged
    intervals (those that begin at or after ``after_epoch``; all of them if none does)."""
    every = [r for r in run["records"] if r["kind"] == "train"]
    # a record's interval starts where the one before it ended: keep those wholly after ``after_epoch``
    train = [r for before, r in zip([{"epoch": 0.0}, *every], every) if before["epoch"] >= after_epoch]
    train = train or every
    if not train:  # ended before its first progress line: the run's averages
        s = run["summary"]
        return {"step_s": s["train_s"] / max(1, s["steps"]), "sync_wait_s": s["sync_wait_s_per_step"],
                "bytes_per_step": s["bytes_per_step"]}
    step = {"step_s": statistics.median(r["step_s"] for r in train),
            "sync_wait_s": statistics.median(r["sync_wait_s_per_step"] for r in train),
            "bytes_per_step": statistics.median(r["bytes_per_step"] for r in train)}
    if all("behind_slowest_s_per_step" in r for r in train):  # (not in runs from before it was logged)
        step["behind_slowest_s"] = statistics.median(r["behind_slowest_s_per_step"] for r in train)
    return step


def compute_only_s(step: dict, slowest: bool = False) -> float:
    """The compute-only step of a ``steady_step`` of ``allreduce`` (whose communication all waits in
    ``synchronize()``, after backward): its step less that wait, rank 0's forward, backward and
    optimizer. ``slowest``: plus how much longer the slowest rank's forward and backward took
    (where logged), the compute the first collective after backward waits for."""
    return step["step_s"] - step["sync_wait_s"] + (step.get("behind_slowest_s", 0.0) if slowest else 0.0)


def median_step(repeats: list[dict], skip_warmup: bool = True) -> dict:
    """``steady_step`` of each repeat of one strategy (after CSC's dense warm-up if
    ``skip_warmup``): the median of each figure, and every repeat's step time (``step_s_each``)."""
    steps = [steady_step(run, dense_warmup_epochs(run) if skip_warmup else 0.0) for run in repeats]
    return {**{key: statistics.median(step[key] for step in steps) for key in steps[0]
               if all(key in step for step in steps)},
            "step_s_each": [step["step_s"] for step in steps]}


def sends_trust_sketches(run: dict) -> bool:
    """Whether the run's optimizer is timm's Lars adapting its weight layers, so that CSC under
    momentum correction sends their trust ratios' noise sketches (``comm/csc/``, ``TrustNoise``):
    Lars adapts a group only with weight decay (``optim.parameter_groups`` gives BatchNorm and
    biases none). A run of unknown configuration counts as the default: Lars with weight decay."""
    optim = (run.get("config") or {}).get("optim") or {}
    return optim.get("name", "lars") == "lars" and float(optim.get("weight_decay", 1.0)) != 0
