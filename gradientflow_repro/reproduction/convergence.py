"""Accuracy over the whole schedule: what sparse communication costs at the end of training.

``make reproduce`` trains the whole schedule too, but on the emulated network and only the
experiment's default configurations (``reproduce.DEFAULT_RUNGS``); this study trains any of them,
every one of ``knobs.COMPARED`` by default, on loopback, to say whether sparse communication still
costs accuracy when training ends, which is what the paper claims it does not. It trains chosen
configurations over the experiment's whole schedule (never stopping at the target), once per seed,
and writes ``results/convergence.md``: epochs to
each target, top-1 after every epoch (median over seeds), top-1 at the end against the dense
reference seed by seed, the largest fall after the learning-rate warm-up, what our additions to the
paper's stack buy (``gradientflow`` against ``gradientflow-paper``), and a figure; and its rows of
``results/runs.csv`` (``runs.RUNS_CSV_COLUMNS``, study ``convergence``; ``make reproduce``'s rows kept).

Runs go over loopback: accuracy per epoch does not depend on the network's speed. A configuration is
a label of ``knobs.COMPARED`` (what ``make reproduce`` can train: the strategy registry's ladder,
sparse variants and peers, ``comm/registry.py``) or ``LABEL=OVERRIDES`` (any Hydra overrides, e.g.
``cap0="comm=gradientflow comm.release_cap=0"``), so the experiments behind the recipe tables
(docs/notes/2026-12-01-digits-recipe-search.md) are one command each. A finished run is kept under
``runs_dir`` and reused when the study is run again with the same overrides, world size and code
(commit and uncommitted changes: ``code_version``): an interrupted study continues where it stopped
(``fresh`` starts over); changed code trains again.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import statistics
import time
from pathlib import Path
from typing import Optional, Sequence

from gradientflow_repro import REPO
from gradientflow_repro.cluster.launch import run_ranks
from gradientflow_repro.comm import knobs
from gradientflow_repro.provenance import code_version, environment_facts
from gradientflow_repro.reproduction.progress import Timeline
from gradientflow_repro.reproduction.report import (
    PAPER_STACK,
    density_label,
    falls_after_warmup,
    final_gaps,
    plot_top1,
    run_seed,
    sparsification_section,
    spread,
)
from gradientflow_repro.reproduction.reproduce import EXPERIMENT_OVERRIDES, ladder_overrides, machine_overrides
from gradientflow_repro.reproduction.runs import (
    evaluations,
    is_dense,
    largest_fall,
    load_run,
    run_row,
    run_warmup_epochs,
    update_runs_csv,
)
from gradientflow_repro.tracking import duration

DEFAULT_CONFIGS = tuple(knobs.COMPARED)  # every configuration make reproduce can train: ladder, variants, peers
REFERENCE = "ddp"  # the dense configuration the others are set against, when trained (as make reproduce)
RUNS_DIR = REPO / "results" / "runs" / "convergence"
OUT = REPO / "results" / "convergence.md"
RECORD_FILE = "study_run.json"  # how a kept run was trained: overrides, world size, code
LABEL = re.compile(r"[\w.@+-]+")  # a directory name and a Hydra value as it is


def parse_configs(texts: Sequence[str]) -> dict[str, list[str]]:
    """``LABEL`` (of ``knobs.COMPARED``) or ``LABEL=OVERRIDES`` -> label: Hydra overrides."""
    configs: dict[str, list[str]] = {}
    for text in texts:
        label, _, overrides = text.partition("=")
        if not LABEL.fullmatch(label) or label in (".", ".."):
            raise ValueError(f"configuration {text!r}: the label before '=' must be a plain name "
                             "(letters, digits, _ . @ + -)")
        if label in configs:
            raise ValueError(f"configuration {label!r} given twice")
        if not overrides:
            if label not in knobs.COMPARED:
                raise ValueError(f"configuration {label!r}: not one of {', '.join(knobs.COMPARED)}; "
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
    print(f"convergence: {len(configs)} configurations x {len(seeds)} seeds at world size {world} on loopback, "
          f"whole schedule; {len(kept)} of {len(jobs)} runs kept from before", flush=True)
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
    print(f"convergence: wrote {out} in {duration(time.time() - started)}", flush=True)
    return runs


def write_study(out: Path, runs: dict[str, list[dict]], *, configs: dict[str, list[str]], targets: Sequence[float],
                world: int, experiment: str, command: str, elapsed_s: float, kept: int, overrides: list[str],
                machine: dict, target: Optional[float] = None) -> None:
    """``out`` and its figure beside it (``<stem>_top1.png``) from ``runs`` (label -> one run per seed,
    trained with ``configs[label]``; ``kept`` of them from an earlier launch), and the runs' rows of
    ``runs.csv`` beside it, their time and epochs to ``target`` (the experiment's, which ``make
    reproduce`` stops at; None: the lowest of ``targets``)."""
    first = next(iter(runs.values()))[0]
    config = first.get("config") or {}
    epochs, warmup = config.get("epochs"), run_warmup_epochs(first)
    dense = [label for label, items in runs.items() if is_dense(items[0])]
    reference = REFERENCE if REFERENCE in dense else (dense[0] if dense else None)
    seeds = [run_seed(r) for r in next(iter(runs.values()))]
    trained = sorted({str(r["summary"].get("git_commit")) for items in runs.values() for r in items})
    machine_line = machine["gpu"] or f"{machine['cpu']}, {machine['cpu_count']} cores, no GPU"
    lines = ["# Accuracy over the whole schedule: dense against sparse communication", "",
             f"- Machine: {machine_line}. torch {machine['torch']}, commit {machine['git_commit']}."
             + (f" Runs trained at commit {', '.join(trained)}." if trained != [machine["git_commit"]] else ""),
             f"- Command: `{command}` ({elapsed_s / 60:.1f} min"
             + (f"; {kept} of {sum(map(len, runs.values()))} runs kept from an earlier launch" if kept else "") + ").",
             f"- Experiment `{experiment}`, world size {world} on loopback (accuracy per epoch does not depend on "
             f"the network), {epochs} epochs, learning-rate warm-up {warmup:g} epochs (unless a configuration "
             f"sets its own), never stopped at the target; seeds "
             f"{', '.join(str(s) for s in seeds)} (initial weights and data order): median [range]."
             + (f" Overrides for every run: `{' '.join(overrides)}`." if overrides else ""),
             "- Configurations: " + "; ".join(f"{label}: `{' '.join(configs[label])}`" for label in runs) + ".", ""]
    header = ["configuration", "density", *[f"epochs to {t:g}%" for t in targets], "top-1 at the end (%)",
              *([f"top-1 at the end - `{reference}`'s, same seed (points)"] if reference else []),
              "best top-1 (%)", "largest fall after the warm-up (points)"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, items in runs.items():
        cells = [label, density_label(items[0]), *[spread([first_epoch_at(r, t) for r in items], "g") for t in targets],
                 spread([r["summary"].get("final_top1") for r in items], ".2f"),
                 *([("- (the reference)" if label == reference else final_gaps(items, runs[reference]))]
                   if reference else []),
                 spread([r["summary"].get("best_top1") for r in items], ".2f"),
                 spread([largest_fall(r) for r in items], ".1f")]
        lines.append("| " + " | ".join(cells) + " |")
    evaluated = sorted({e for items in runs.values() for r in items for e, _ in evaluations(r)})
    lines += ["", "Top-1 after each epoch (%), median over the seeds:", "",
              "| configuration | " + " | ".join(f"{e:g}" for e in evaluated) + " |",
              "|---|" + "---|" * len(evaluated)]
    for label, items in runs.items():
        at = [[a for r in items for e, a in evaluations(r) if e == epoch] for epoch in evaluated]
        lines.append(f"| {label} | " + " | ".join(f"{statistics.median(v):.1f}" if v else "-" for v in at) + " |")
    dropped = falls_after_warmup(runs)
    lines += ["", f"Falls of more than 5 points from one evaluation to the next after the warm-up: {len(dropped)} in "
              f"{sum(map(len, runs.values()))} runs" + (": " + "; ".join(dropped) if dropped else "") + ".",
              "", *_verdicts(runs, reference, targets[0]), *_additions(runs, targets[0]), "",
              *sparsification_section(runs), f"![validation top-1 against epochs]({out.stem}_top1.png)", ""]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    plot_top1(runs, out.parent / f"{out.stem}_top1.png", x="epoch", targets=targets)
    csv_target = targets[0] if target is None else target
    update_runs_csv(out.parent / "runs.csv", "convergence",
                    [run_row(run, study="convergence", label=label, target=csv_target)
                     for label, items in runs.items() for run in items])


def _final(run: dict) -> Optional[float]:
    return run["summary"].get("final_top1")


def _range(items: list[dict]) -> float:
    """Highest minus lowest top-1 at the end over ``items``: how much the seed alone moves it."""
    ends = [e for e in map(_final, items) if e is not None]
    return max(ends) - min(ends) if ends else 0.0


def _verdicts(runs: dict[str, list[dict]], reference: Optional[str], target: float) -> list[str]:
    """Each sparse configuration against the dense reference: epochs to ``target`` (medians over the
    seeds that reached it) and top-1 at the end, seed by seed (the same seed: the same initial
    weights and data order; runs whose seed is unknown are not paired)."""
    if reference is None:
        return ["No dense configuration was trained: nothing to set the sparse ones against."]
    by_seed = {run_seed(r): r for r in runs[reference] if run_seed(r) != "?"}
    dense_epochs = [first_epoch_at(r, target) for r in runs[reference]]
    dense_known = [e for e in dense_epochs if e is not None]
    lines = [f"Against `{reference}` (dense): epochs to {target:g}% as medians over the seeds that reached it "
             f"(`{reference}`: {len(dense_known)} of {len(dense_epochs)}), top-1 at the end seed by seed:"]
    for label, items in runs.items():
        if label == reference or is_dense(items[0]):
            continue
        pairs = [(r, by_seed[run_seed(r)]) for r in items if run_seed(r) in by_seed]
        final = [_final(r) - _final(d) for r, d in pairs if _final(r) is not None and _final(d) is not None]
        epochs = [first_epoch_at(r, target) for r in items]
        reached = [e for e in epochs if e is not None]
        if reached and dense_known:
            mine, theirs = statistics.median(reached), statistics.median(dense_known)
            to_target = f"{mine:g} epochs to {target:g}% against {theirs:g} ({mine / theirs - 1:+.0%})"
            if len(reached) < len(epochs):
                to_target += f", reached in {len(reached)} of {len(epochs)} seeds"
        else:
            to_target = f"{target:g}% reached in {len(reached)} of {len(epochs)} seeds"
        ends = (f"top-1 at the end {statistics.median(final):+.2f} points against the same seed's dense run "
                f"(from {min(final):+.2f} to {max(final):+.2f} over {len(final)} seeds; the dense runs' own "
                f"spread over the seeds: {_range(runs[reference]):.2f})" if final else "no pair of seeds to compare")
        lines.append(f"- `{label}`: {to_target}; {ends}.")
    return lines


def _additions(runs: dict[str, list[dict]], target: float) -> list[str]:
    """What our additions to the paper's stack (the release cap, the trust-ratio noise correction)
    buy over the whole schedule: ``gradientflow`` against ``gradientflow-paper`` (the paper's stack as
    published), seed by seed where both ran: epochs to ``target``, top-1 at the end, and falls of more
    than 5 points after the warm-up. Nothing unless both were trained."""
    ours, paper = runs.get("gradientflow"), runs.get(PAPER_STACK)
    if not ours or not paper:
        return []
    theirs = {run_seed(r): r for r in paper if run_seed(r) != "?"}
    pairs = [(r, theirs[run_seed(r)]) for r in ours if run_seed(r) in theirs]
    gaps = [_final(a) - _final(b) for a, b in pairs if _final(a) is not None and _final(b) is not None]
    epochs = [[first_epoch_at(r, target) for r in items] for items in (ours, paper)]
    known = [[e for e in each if e is not None] for each in epochs]
    mine, paper_epochs = (f"{statistics.median(k):g}" + (f" ({len(k)} of {len(e)} seeds)" if len(k) < len(e) else "")
                          if k else "not reached" for k, e in zip(known, epochs))
    large = [sum((largest_fall(r) or 0.0) > 5 for r in items) for items in (ours, paper)]
    ends = (f"top-1 at the end {statistics.median(gaps):+.2f} points against the same seed's (from "
            f"{min(gaps):+.2f} to {max(gaps):+.2f} over {len(gaps)} seeds)" if gaps else "no pair of seeds to compare")
    return ["", f"Our additions (release cap, trust-ratio noise correction): `gradientflow` against `{PAPER_STACK}` "
            f"(the paper's stack as published): epochs to {target:g}% {mine} against {paper_epochs} "
            f"(medians); {ends}; falls of more than 5 points after the warm-up in {large[0]} of {len(ours)} runs "
            f"against {large[1]} of {len(paper)}."]
