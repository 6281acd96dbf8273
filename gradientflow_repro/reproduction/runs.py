"""A finished training run as the harness reads it: its summary, its records, its communication
options, its steady step time (median logged interval, after CSC's dense warm-up), and its row of
``results/runs.csv``, the tidy table of every run of ``make reproduce`` and ``make convergence``
(``RUNS_CSV_COLUMNS``, ``run_row``, ``update_runs_csv``), so other tools read the results without
parsing Markdown.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import statistics
from pathlib import Path
from typing import Any, Optional, Sequence

from gradientflow_repro.comm.plan import Plan, resolve
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
    """The ``comm.*`` keys a run was configured with (``plan.resolve`` takes them: keys of a sparsifier
    other than the run's, as runs recorded every key before sparsifiers declared their own, it leaves out)."""
    options = dict(config.get("comm") or {})
    return options if options.get("strategy") else {"strategy": summary.get("strategy", "allreduce")}


def run_knobs(run: dict) -> Plan:
    """The run's communication plan, resolved (from its strategy alone when its options are unknown)."""
    return resolve(run.get("comm") or {"strategy": run["summary"].get("strategy")})


def is_dense(run: dict) -> bool:
    """Every step sends every gradient: the same SGD whatever the communication strategy."""
    return not run_knobs(run).sends_sparse


def evaluations(run: dict) -> list[tuple[float, float]]:
    """(epoch, top-1) of every evaluation, in order."""
    return [(r["epoch"], r["top1"]) for r in run["records"] if r["kind"] == "eval"]


def with_target(run: dict, target: Optional[float]) -> dict:
    """``run`` with ``target`` as the top-1 its time and epochs to target are for: a run of the whole
    schedule was given none to stop at (``target_top1=null``), so the report names the one it is
    measured against (``run_target``)."""
    return {**run, "target_top1": target}


def run_target(run: dict) -> Optional[float]:
    """The top-1 target the run is measured against: the one given by ``with_target``, else the one
    it stopped at (None: neither)."""
    return run["target_top1"] if "target_top1" in run else run["summary"].get("target_top1")


def reached(run: dict) -> Optional[dict]:
    """The run's clocks, step and epoch when it first reached its target (``run_target``; None: never)."""
    return at_target(run, run_target(run))


def epochs_to_target(run: dict) -> Optional[float]:
    """Epochs trained when the target was first reached (None: never)."""
    at = reached(run)
    return None if at is None else at.get("epoch")


def run_warmup_epochs(run: dict) -> float:
    """The run's learning-rate warm-up, in epochs (0 when its configuration is unknown)."""
    return float((run.get("config") or {}).get("optim", {}).get("warmup_epochs", 0.0))


def dense_warmup_epochs(run: dict) -> float:
    """Epochs the run trained densely before its steady state (``Plan.dense_warmup_epochs``)."""
    return dataclasses.replace(run_knobs(run), lr_warmup_epochs=run_warmup_epochs(run)).dense_warmup_epochs


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


def sparsification(run: dict) -> Optional[dict[str, Any]]:
    """What the run's sparse steps did, from its progress records (``CSCCommunicator.sparsity_stats``):
    ``intervals`` (per layer, the median over the records of its median steps between two sends),
    ``masked_share`` (the median share of the chunks' momentum erased by masking; None without
    momentum correction) and ``bytes_per_step`` after the dense warm-up. None for a run that logged
    none (dense, or from before they were logged)."""
    records = [r for r in run["records"] if r["kind"] == "train" and "csc_send_interval_median" in r]
    if not records:
        return None
    layers: dict[str, list[float]] = {}
    for record in records:
        for layer, interval in record["csc_send_interval_median"].items():
            layers.setdefault(layer, []).append(interval)
    shares = [r["csc_masked_momentum_share"] for r in records if "csc_masked_momentum_share" in r]
    return {"intervals": {layer: statistics.median(values) for layer, values in layers.items()},
            "masked_share": statistics.median(shares) if shares else None,
            "bytes_per_step": steady_step(run, dense_warmup_epochs(run))["bytes_per_step"]}


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


def compression_label(run: dict) -> str:
    """What a run sends, for a table's density column: "1 (dense)", the density a sparse run sends
    at, or the rank of a low-rank one (PowerSGD has no density)."""
    if is_dense(run):
        return "1 (dense)"
    options = run_knobs(run)
    if options.sparsifier.pricing == "low_rank":
        return f"rank {options.keys.powersgd_rank}"
    density = getattr(options.keys, "density", None)  # CSC's; another sparsifier says what it sends
    return f"{density:g}" if density is not None else options.sparsifier.in_words(options.keys)


def falls(run: dict, warmup_epochs: Optional[float] = None) -> list[tuple[float, float, float, float]]:
    """(epoch, top-1, next epoch, its top-1) of each pair of consecutive evaluations whose second
    comes after the learning-rate warm-up (``warmup_epochs``, else the run's own)."""
    after = run_warmup_epochs(run) if warmup_epochs is None else warmup_epochs
    curve = evaluations(run)
    return [(e0, a0, e1, a1) for (e0, a0), (e1, a1) in zip(curve, curve[1:]) if e1 > after]


def largest_fall(run: dict) -> Optional[float]:
    """The largest drop in points from one evaluation to the next after the run's learning-rate
    warm-up (0: none; None: fewer than two evaluations)."""
    if len(evaluations(run)) < 2:
        return None
    return max([0.0, *(a0 - a1 for _, a0, _, a1 in falls(run))])


STUDIES = ("reproduce", "convergence")  # who writes results/runs.csv, in the file's order
# results/runs.csv, one row per run, in this order:
RUNS_CSV_COLUMNS = (
    "study",  # reproduce (on the emulated network) | convergence (on loopback): both train the whole schedule
    # (reproductions from before that stopped at the target)
    "strategy",  # the configuration's label (lineup.COMPARED, or a study's own LABEL)
    "seed", "world_size", "experiment",
    "target_top1",  # the target the row's time and epochs to target are for (the experiment's)
    "reached_target",  # true | false: a run that never reached it has its time and epochs to target empty
    "time_to_target_mlperf_s",  # MLPerf's clock (run_start to the evaluation at or above the target)
    "time_to_target_train_s",  # the training clock: seconds in training steps alone up to then
    "epochs_to_target", "sparse_epochs_to_target",  # of them after the dense warm-up (sparse strategies)
    "epochs",  # trained: the whole schedule (reproductions from before that: to the target)
    "final_top1", "best_top1",  # top-1 at the last evaluation, and the best one
    "largest_fall_after_warmup",  # points, from one evaluation to the next after the learning-rate warm-up
    "step_s", "bytes_per_step",  # steady state: median logged interval after the dense warm-up
    "bytes_per_step_run_mean",  # what the whole run sent per step (a sparse run's warm-up included)
    "dense_warmup_epochs",  # before a sparse strategy sparsifies (0: dense)
    "compression",  # 1 (dense), the density, or a low-rank strategy's rank
    "commit",  # the code that trained the run
)


def at_target(run: dict, target: Optional[float]) -> Optional[dict]:
    """The run's clocks, step and epoch when it first reached ``target`` (None: never, or no target):
    the summary's where the run stopped at that target, else its first evaluation at or above it
    (a run of the whole schedule)."""
    summary = run["summary"]
    if target is None:
        return None
    if summary.get("target_top1") == target:
        at = summary.get("clocks_at_target")
        return None if not at else {**at, "epoch": at["step"] / (summary["steps"] / summary["epochs"])}
    # an evaluation record carries the step, the epoch and every clock at that moment
    return next((record for record in run["records"] if record["kind"] == "eval" and record["top1"] >= target), None)


def last_evaluation(run: dict) -> Optional[dict]:
    """The run's last evaluation record (its clocks when it finished its schedule; None: never evaluated)."""
    return next((record for record in reversed(run["records"]) if record["kind"] == "eval"), None)


def trained_whole_schedule(run: dict) -> bool:
    """Whether the run had no target to stop at (``target_top1=null``): the paper's criterion, the
    fixed schedule, reads its last evaluation."""
    return run["summary"].get("target_top1") is None


def run_row(run: dict, *, study: str, label: str, target: Optional[float]) -> dict[str, Any]:
    """The run's row of ``results/runs.csv`` (``RUNS_CSV_COLUMNS``; None where unknown or never reached)."""
    summary = run["summary"]
    at = at_target(run, target)
    warmup = dense_warmup_epochs(run)
    logged = any(record["kind"] == "train" for record in run["records"]) or "train_s" in summary
    steady = steady_step(run, warmup) if logged else {}  # (neither: a run that ended before its first step)
    epochs = None if at is None else at.get("epoch")
    return {"study": study, "strategy": label, "seed": (run.get("config") or {}).get("seed"),
            "world_size": summary.get("world_size"), "experiment": summary.get("experiment"),
            "target_top1": target, "reached_target": at is not None,
            "time_to_target_mlperf_s": None if at is None else at.get("mlperf_s"),
            "time_to_target_train_s": None if at is None else at.get("train_s"),
            "epochs_to_target": epochs,
            "sparse_epochs_to_target": None if epochs is None else max(0.0, epochs - warmup),
            "epochs": summary.get("epochs"), "final_top1": summary.get("final_top1"),
            "best_top1": summary.get("best_top1"), "largest_fall_after_warmup": largest_fall(run),
            "step_s": steady.get("step_s"), "bytes_per_step": steady.get("bytes_per_step"),
            "bytes_per_step_run_mean": summary.get("bytes_per_step"), "dense_warmup_epochs": warmup,
            "compression": compression_label(run), "commit": summary.get("git_commit")}


def update_runs_csv(path: Path, study: str, rows: Sequence[dict[str, Any]]) -> None:
    """Write ``rows`` as ``study``'s rows of ``path``, keeping every other study's rows as they were
    (``make reproduce`` and ``make convergence`` share the file, each replacing its own). Replaced
    whole or not at all: a stopped write leaves the file as it was."""
    kept = [row for row in read_runs_csv(path) if row.get("study") != study]
    # the studies in a fixed order, whichever wrote last, so the file changes only where its runs did
    ordered = sorted([*kept, *rows], key=lambda row: (STUDIES.index(row["study"]) if row["study"] in STUDIES
                                                      else len(STUDIES), str(row["study"])))
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    with open(temporary, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=RUNS_CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in ordered:
            writer.writerow({key: "" if row.get(key) is None else row[key] for key in RUNS_CSV_COLUMNS})
    os.replace(temporary, path)


def read_runs_csv(path: Path, study: Optional[str] = None) -> list[dict[str, Any]]:
    """The rows of ``path`` (``study``'s only, if given), numbers as floats, empty cells as None,
    ``reached_target`` as a bool; no rows where the file is absent."""
    if not path.is_file():
        return []
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    text = {"study", "strategy", "experiment", "compression", "commit"}

    def value(key: str, cell: Optional[str]) -> Any:
        if cell is None or cell == "":
            return None
        if key == "reached_target":
            return cell == "True"
        if key in text:
            return cell
        try:
            number = float(cell)
        except ValueError:
            return cell
        return int(number) if key in ("seed", "world_size") and number.is_integer() else number

    return [{key: value(key, cell) for key, cell in row.items()} for row in rows
            if study is None or row.get("study") == study]
