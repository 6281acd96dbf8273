"""Accuracy over the whole schedule: what sparse communication costs at the end of training.

``make reproduce`` trains the whole schedule too, but on the emulated network and only the
experiment's default configurations (``reproduce.DEFAULT_RUNGS``); this study trains any of them,
every one of ``lineup.COMPARED`` by default, on loopback, to say whether sparse communication still
costs accuracy when training ends, which is what the paper claims it does not. It trains chosen
configurations over the experiment's whole schedule (never stopping at the target), once per seed,
and writes ``results/convergence.md`` (``--report``; else under ``results/runs/convergence/``) from
its data, ``convergence.json`` beside it (``study_data``, rendered by ``render/reproduction_study.py``): epochs to
each target, top-1 after every epoch (median over seeds), top-1 at the end against the dense
reference seed by seed, the largest fall after the learning-rate warm-up, what our additions to the
paper's stack buy (``gradientflow`` against ``gradientflow-paper``), and a figure; and its rows of
``results/runs.csv`` (``runs.RUNS_CSV_COLUMNS``, study ``convergence``; ``make reproduce``'s rows kept).

Runs go over loopback: accuracy per epoch does not depend on the network's speed. A configuration is
a label of ``lineup.COMPARED`` (what ``make reproduce`` can train: its ladder, sparse variants and
peers, ``reproduction/lineup.py``) or ``LABEL=OVERRIDES`` (any Hydra overrides, e.g.
``cap0="comm=gradientflow comm.release_cap=0"``), so the experiments behind the recipe tables
(docs/notes/2026-12-01-digits-recipe-search.md) are one command each. A finished run is kept under
``runs_dir`` and reused when the study is run again with the same overrides, world size and code
(commit and uncommitted changes: ``code_version``): an interrupted study continues where it stopped
(``fresh`` starts over); changed code trains again.
"""

from __future__ import annotations

import json
import logging
import re
import shlex
import shutil
import statistics
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from gradientflow_repro import REPO, render
from gradientflow_repro.cluster.launch import run_ranks
from gradientflow_repro.provenance import code_version, environment_facts
from gradientflow_repro.reproduction import lineup
from gradientflow_repro.reproduction.figures import plot_top1
from gradientflow_repro.reproduction.measures import (
    falls_after_warmup,
    final_gaps,
    median,
    run_seed,
    sparsification_rows,
)
from gradientflow_repro.reproduction.progress import Timeline
from gradientflow_repro.reproduction.reproduce import EXPERIMENT_OVERRIDES, ladder_overrides, machine_overrides
from gradientflow_repro.reproduction.runs import (
    compression_label,
    evaluations,
    is_dense,
    largest_fall,
    load_run,
    run_row,
    run_warmup_epochs,
    update_runs_csv,
)
from gradientflow_repro.tracking import duration

log = logging.getLogger(__name__)

KIND = "reproduction.convergence"  # the renderer of the study's document (render/reproduction_study.py)
PAPER_STACK = "gradientflow-paper"  # the paper's stack as published, which our additions are set against
DEFAULT_CONFIGS = tuple(lineup.COMPARED)  # every configuration make reproduce can train: ladder, variants, peers
REFERENCE = "ddp"  # the dense configuration the others are set against, when trained (as make reproduce)
RUNS_DIR = render.RUNS / "convergence"
OUT = render.output_dir("convergence", report=False) / "convergence.md"  # (``--report``: results/convergence.md)
RECORD_FILE = "study_run.json"  # how a kept run was trained: overrides, world size, code
LABEL = re.compile(r"[\w.@+-]+")  # a directory name and a Hydra value as it is


def parse_configs(texts: Sequence[str]) -> dict[str, list[str]]:
    """``LABEL`` (of ``lineup.COMPARED``) or ``LABEL=OVERRIDES`` -> label: Hydra overrides."""
    configs: dict[str, list[str]] = {}
    for text in texts:
        label, _, overrides = text.partition("=")
        if not LABEL.fullmatch(label) or label in (".", ".."):
            raise ValueError(f"configuration {text!r}: the label before '=' must be a plain name "
                             "(letters, digits, _ . @ + -)")
        if label in configs:
            raise ValueError(f"configuration {label!r} given twice")
        if not overrides:
            if label not in lineup.COMPARED:
                raise ValueError(f"configuration {label!r}: not one of {', '.join(lineup.COMPARED)}; "
                                 "give LABEL=OVERRIDES for another")
            configs[label] = ladder_overrides(label)
        else:
            configs[label] = shlex.split(overrides)
        check_overrides(configs[label], f"configuration {label!r}")
    return configs


def check_overrides(overrides: Sequence[str], where: str) -> None:
    """Refuse what would defeat the study: a target the runs would stop at."""
    for override in overrides:
        if override.lstrip("+~").startswith("target_top1="):
            raise ValueError(f"{where}: {override!r}: the study never stops at a target; give targets "
                             "to report with --targets")


def experiment_target(experiment: str) -> Optional[float]:
    """The experiment preset's ``target_top1`` (None: it sets none)."""
    import yaml

    preset = REPO / "configs" / "experiment" / f"{experiment}.yaml"
    if not preset.is_file():
        raise ValueError(f"experiment {experiment!r}: no {preset.relative_to(REPO)}")
    return (yaml.safe_load(preset.read_text()) or {}).get("target_top1")


def kept_run(run_dir: Path, record: dict, any_code: bool = False) -> Optional[dict]:
    """The run in ``run_dir`` (``load_run``) if it was trained as ``record`` says (overrides, world
    size, code; code None: unknown, never reused; ``any_code``: whatever code trained it) and went
    through its whole schedule, else None."""
    if record.get("code") is None and not any_code:
        return None
    try:
        saved = json.loads((run_dir / RECORD_FILE).read_text())
        if any_code:
            saved = {**saved, "code": record.get("code")}
        if saved != record:
            return None
        run = load_run(run_dir)
    except (OSError, ValueError):
        return None
    summary = run["summary"]
    whole = (summary.get("stopped_by") is None and summary.get("epochs") == run["config"].get("epochs")
             and summary.get("world_size") == record["world"] and summary.get("target_top1") is None)
    return run if whole else None


def first_epoch_at(run: dict, top1: float) -> Optional[float]:
    """The first evaluated epoch with top-1 at or above ``top1`` (None: never)."""
    return next((epoch for epoch, accuracy in evaluations(run) if accuracy >= top1), None)


def study(*, configs: dict[str, list[str]], experiment: str = "patterns_cpu", world: int = 4,
          seeds: Sequence[int] = (0, 1, 2), targets: Sequence[float] = (), runs_dir: Path = RUNS_DIR,
          out: Path = OUT, overrides: Sequence[str] = (), timeout_s: float = 900, fresh: bool = False,
          command: str = "python scripts/convergence.py", report_only: bool = False) -> dict[str, list[dict]]:
    """Train every configuration once per seed over the whole schedule (seed-major), then write ``out``.
    ``report_only``: train nothing; write ``out`` from the kept runs, whatever code trained them (the
    report names their commit), e.g. with other targets; a run missing raises ValueError."""
    started = time.time()
    runs_dir = runs_dir.resolve()  # the ranks run in the repository, this process may not
    check_overrides(overrides, "overrides for every run")
    targets = sorted({*targets, *([t] if (t := experiment_target(experiment)) is not None else [])})
    if not targets:
        raise ValueError(f"experiment {experiment!r} sets no target_top1: give --targets")
    if fresh:
        shutil.rmtree(runs_dir, ignore_errors=True)
    adapted = machine_overrides([f"+experiment={experiment}", *EXPERIMENT_OVERRIDES.get(experiment, []), *overrides],
                                program="convergence")  # as make reproduce does
    overrides = [*adapted, *overrides]  # so the study's report lists them
    base = [f"+experiment={experiment}", "target_top1=null", "save_final_params=false", "resume=never",
            "logger=jsonl", *EXPERIMENT_OVERRIDES.get(experiment, []), *overrides]
    jobs = [(label, seed, runs_dir / label / f"seed{seed}") for seed in seeds for label in configs]
    code = code_version()
    record = {(label, seed): {"argv": [*base, *configs[label], f"seed={seed}", f"run_dir={d}"], "world": world,
                              "code": code} for label, seed, d in jobs}
    kept = {(label, seed): run for label, seed, d in jobs
            if (run := kept_run(d, record[label, seed], any_code=report_only)) is not None}
    if report_only and len(kept) < len(jobs):
        missing = [f"{label} seed {seed}" for label, seed, _ in jobs if (label, seed) not in kept]
        raise ValueError(f"--report-only: no finished run of {', '.join(missing)} under {runs_dir} with these "
                         f"overrides and world size: run the study without --report-only")
    log.info(f"convergence: {len(configs)} configurations x {len(seeds)} seeds at world size {world} on loopback, "
             f"whole schedule; {len(kept)} of {len(jobs)} runs kept from before")
    timeline = Timeline([("train", label) for label, seed, _ in jobs if (label, seed) not in kept], name="convergence")
    runs: dict[str, list[dict]] = {label: [] for label in configs}
    for label, seed, run_dir in jobs:
        if (label, seed) in kept:
            runs[label].append(kept[label, seed])
            continue
        timeline.begin("train", label, f"[{label}] seed {seed}")
        shutil.rmtree(run_dir, ignore_errors=True)  # a half-finished run starts again
        run_ranks(world, record[label, seed]["argv"], run_dir, f"{label} s{seed}", None, timeout_s, show=False)
        (run_dir / RECORD_FILE).write_text(json.dumps(record[label, seed]))
        runs[label].append(load_run(run_dir))
    timeline.end()
    own = experiment_target(experiment)
    write_study(out, runs, configs=configs, targets=targets, world=world, experiment=experiment, command=command,
                elapsed_s=time.time() - started, kept=len(kept), overrides=list(overrides),
                machine=environment_facts(), target=own if own is not None else targets[0])
    log.info(f"convergence: wrote {out} in {duration(time.time() - started)}")
    return runs


def write_study(out: Path, runs: dict[str, list[dict]], *, configs: dict[str, list[str]], targets: Sequence[float],
                world: int, experiment: str, command: str, elapsed_s: float, kept: int, overrides: list[str],
                machine: dict, target: Optional[float] = None) -> Path:
    """``out`` (the Markdown), its data beside it (``.json``, ``study_data``) and its figure
    (``<stem>_top1.png``) from ``runs`` (label -> one run per seed, trained with ``configs[label]``;
    ``kept`` of them from an earlier launch), and the runs' rows of ``runs.csv`` beside it, their
    time and epochs to ``target`` (the experiment's, which ``make reproduce`` stops at; None: the
    lowest of ``targets``). Returns the data's path."""
    data = study_data(runs, configs=configs, targets=targets, world=world, experiment=experiment, command=command,
                      elapsed_s=elapsed_s, kept=kept, overrides=overrides, machine=machine,
                      figure=f"{out.stem}_top1.png")
    out.parent.mkdir(parents=True, exist_ok=True)
    written = render.write_data(out.with_suffix(".json"), KIND, data)
    render.render_file(written, out)
    plot_top1(runs, out.parent / data["figure"], x="epoch", targets=targets)
    csv_target = targets[0] if target is None else target
    update_runs_csv(out.parent / "runs.csv", "convergence",
                    [run_row(run, study="convergence", label=label, target=csv_target)
                     for label, items in runs.items() for run in items])
    return written


def study_data(runs: dict[str, list[dict]], *, configs: dict[str, list[str]], targets: Sequence[float], world: int,
               experiment: str, command: str, elapsed_s: float, kept: int, overrides: list[str], machine: dict,
               figure: str) -> dict[str, Any]:
    """The study's document: its facts, per configuration its epochs to each target, top-1 at the end
    (against the dense reference's, seed by seed), best top-1 and largest fall, top-1 after each
    epoch, the falls after the warm-up, each sparse configuration against the dense reference
    (``against_dense``), what our additions buy (``additions``) and what sparsification did."""
    first = next(iter(runs.values()))[0]
    dense = [label for label, items in runs.items() if is_dense(items[0])]
    reference = REFERENCE if REFERENCE in dense else (dense[0] if dense else None)
    evaluated = sorted({e for items in runs.values() for r in items for e, _ in evaluations(r)})
    return {
        "machine": {key: machine.get(key) for key in ("gpu", "cpu", "cpu_count", "torch", "git_commit")},
        "trained": sorted({str(r["summary"].get("git_commit")) for items in runs.values() for r in items}),
        "command": command, "elapsed_s": elapsed_s, "kept": kept, "runs": sum(map(len, runs.values())),
        "experiment": experiment, "world": world, "epochs": (first.get("config") or {}).get("epochs"),
        "warmup": run_warmup_epochs(first), "seeds": [run_seed(r) for r in next(iter(runs.values()))],
        "overrides": list(overrides), "configs": [[label, list(configs[label])] for label in runs],
        "targets": list(targets), "reference": reference,
        "rows": [{"label": label, "density": compression_label(items[0]),
                  "epochs_to": [[first_epoch_at(r, t) for r in items] for t in targets],
                  "final": [_final(r) for r in items],
                  "gaps": None if reference is None or label == reference else final_gaps(items, runs[reference]),
                  "best": [r["summary"].get("best_top1") for r in items],
                  "largest_fall": [largest_fall(r) for r in items]} for label, items in runs.items()],
        "evaluated": evaluated,
        "per_epoch": [[label, [median([a for r in items for e, a in evaluations(r) if e == epoch])
                               for epoch in evaluated]] for label, items in runs.items()],
        "falls": falls_after_warmup(runs), "against_dense": against_dense(runs, reference, targets[0]),
        "additions": additions(runs, targets[0]), "sparsification": sparsification_rows(runs), "figure": figure}


def _final(run: dict) -> Optional[float]:
    return run["summary"].get("final_top1")


def _range(items: list[dict]) -> float:
    """Highest minus lowest top-1 at the end over ``items``: how much the seed alone moves it."""
    ends = [e for e in map(_final, items) if e is not None]
    return max(ends) - min(ends) if ends else 0.0


def _gaps(pairs: list[tuple[dict, dict]]) -> Optional[list[float]]:
    """Top-1 at the end of each pair's first run less its second's: [median, lowest, highest, pairs]
    (None: no pair with both known)."""
    gaps = [_final(a) - _final(b) for a, b in pairs if _final(a) is not None and _final(b) is not None]
    return [statistics.median(gaps), min(gaps), max(gaps), len(gaps)] if gaps else None


def against_dense(runs: dict[str, list[dict]], reference: Optional[str], target: float) -> Optional[dict[str, Any]]:
    """Each sparse configuration against the dense reference: epochs to ``target`` (medians over the
    seeds that reached it) and top-1 at the end, seed by seed (the same seed: the same initial
    weights and data order; runs whose seed is unknown are not paired). None without a dense one."""
    if reference is None:
        return None
    theirs = {run_seed(r): r for r in runs[reference] if run_seed(r) != "?"}
    dense_epochs = [first_epoch_at(r, target) for r in runs[reference]]
    rows = []
    for label, items in runs.items():
        if label == reference or is_dense(items[0]):
            continue
        rows.append({"label": label, "epochs": [first_epoch_at(r, target) for r in items],
                     "gaps": _gaps([(r, theirs[run_seed(r)]) for r in items if run_seed(r) in theirs])})
    return {"target": target, "dense_epochs": dense_epochs, "dense_spread": _range(runs[reference]), "rows": rows}


def additions(runs: dict[str, list[dict]], target: float) -> Optional[dict[str, Any]]:
    """What our additions to the paper's stack (the release cap, the trust-ratio noise correction)
    buy over the whole schedule: ``gradientflow`` against ``gradientflow-paper`` (the paper's stack as
    published), seed by seed where both ran: epochs to ``target``, top-1 at the end, and falls of more
    than 5 points after the warm-up. None unless both were trained."""
    ours, paper = runs.get("gradientflow"), runs.get(PAPER_STACK)
    if not ours or not paper:
        return None
    theirs = {run_seed(r): r for r in paper if run_seed(r) != "?"}
    return {"target": target, "paper": PAPER_STACK,
            "epochs": [[first_epoch_at(r, target) for r in items] for items in (ours, paper)],
            "gaps": _gaps([(r, theirs[run_seed(r)]) for r in ours if run_seed(r) in theirs]),
            "large_falls": [sum((largest_fall(r) or 0.0) > 5 for r in items) for items in (ours, paper)],
            "runs": [len(ours), len(paper)]}
