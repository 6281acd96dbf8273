"""The reproduction's numbers, read from its runs as data: each table of the report as rows of
values (lists over the seeds where the report shows median [range]), for the renderer
(``render/reproduction.py``) to word. Nothing here formats text.
"""

from __future__ import annotations

import statistics
from typing import Any, Optional, Union

from gradientflow_repro.reproduction.runs import (
    compression_label,
    dense_warmup_epochs,
    epochs_to_target,
    evaluations,
    falls,
    is_dense,
    largest_fall,
    last_evaluation,
    reached,
    run_warmup_epochs,
    sparsification,
    trained_whole_schedule,
)

Seed = Union[int, str]


def median(values: list[Optional[float]]) -> Optional[float]:
    """The median of the known values (None: none known)."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def at_target(run: dict, clock: str) -> Optional[float]:
    """A clock's reading (or the step) when the run first reached its target (``runs.reached``: where
    it stopped at it, or its first evaluation at or above it; None: never reached)."""
    at = reached(run)
    return None if at is None else at.get(clock)


def step_to_target_s(run: dict) -> Optional[float]:
    """Mean training step up to the target (a sparse run's dense warm-up included)."""
    train_s, steps = at_target(run, "train_s"), at_target(run, "step")
    return None if train_s is None or not steps else train_s / steps


def run_seed(run: dict) -> Seed:
    """The run's seed ("?" when its configuration is unknown)."""
    return (run.get("config") or {}).get("seed", "?")


def by_seed(items: list[dict]) -> dict[Seed, dict]:
    return {run_seed(run): run for run in items}


def sparse_epochs_to_target(run: dict) -> Optional[float]:
    """Of a run's epochs to target, those after its dense warm-up (None: target never reached)."""
    epochs = epochs_to_target(run)
    return None if epochs is None else max(0.0, epochs - dense_warmup_epochs(run))


def reference_of(runs: dict[str, list[dict]]) -> str:
    """The configuration the others are set against: ``ddp`` where trained, else the first."""
    return "ddp" if "ddp" in runs else next(iter(runs))


def comparison(runs: dict[str, list[dict]]) -> dict[str, Any]:
    """Time to accuracy per strategy, every figure over its seeds, and the speedup of its median
    time to target over the first strategy's."""
    first = next(iter(runs))
    baseline = median([at_target(r, "mlperf_s") for r in runs[first]])
    rows = []
    for label, items in runs.items():
        s = [r["summary"] for r in items]
        mine = median([at_target(r, "mlperf_s") for r in items])
        rows.append({"label": label, "time": [at_target(r, "mlperf_s") for r in items],
                     "epochs": [epochs_to_target(r) for r in items], "final": [x["final_top1"] for x in s],
                     "images_per_s": [x["images_per_s"] for x in s], "bytes": [x["bytes_per_step"] for x in s],
                     "wait": [x["sync_wait_s_per_step"] for x in s],
                     "speedup": baseline / mine if baseline and mine else None})
    return {"first": first, "rows": rows}


def clocks(runs: dict[str, list[dict]]) -> list[dict[str, Any]]:
    """MLPerf's clock up to the target, split: start-up, training, evaluation, the rest; and the
    initialisation before the clock (reached or not)."""
    rows = []
    for label, items in runs.items():
        parts = {clock: [at_target(r, clock) for r in items]
                 for clock in ("startup_s", "train_s", "eval_s", "mlperf_s")}
        parts["init_s"] = [(r["summary"].get("clocks") or {}).get("init_s") for r in items]
        parts["other_s"] = [m - (a or 0) - (t or 0) - (e or 0) if m is not None else None
                            for m, a, t, e in zip(parts["mlperf_s"], parts["startup_s"], parts["train_s"],
                                                  parts["eval_s"])]
        rows.append({"label": label, **parts})
    return rows


def decomposition(runs: dict[str, list[dict]], reference: str) -> dict[str, dict[str, float]]:
    """Per strategy, from medians over the seeds: time-to-target ratio against ``reference`` =
    step-time ratio x epochs-to-target ratio x overhead (start-up, evaluation and the rest: the
    part of the ratio the training steps do not explain)."""
    def medians(items: list[dict]) -> dict[str, Optional[float]]:
        return {"time": median([at_target(r, "mlperf_s") for r in items]),
                "step": median([step_to_target_s(r) for r in items]),
                "epochs": median([epochs_to_target(r) for r in items])}

    ref, ratios = medians(runs[reference]), {}
    for label, items in runs.items():
        mine = medians(items)
        if None in mine.values() or None in ref.values():
            continue
        time, step, epochs = mine["time"] / ref["time"], mine["step"] / ref["step"], mine["epochs"] / ref["epochs"]
        ratios[label] = {"time": time, "step": step, "epochs": epochs, "overhead": time / (step * epochs)}
    return ratios


def decomposition_rows(runs: dict[str, list[dict]], reference: str) -> list[dict[str, Any]]:
    """Each strategy's ``decomposition`` against ``reference`` (None: not reached) and its seeds that
    reached the target."""
    ratios = decomposition(runs, reference)
    return [{"label": label, "ratios": ratios.get(label),
             "reached": sum(epochs_to_target(r) is not None for r in items), "seeds": len(items)}
            for label, items in runs.items()]


def schedule_s(run: dict) -> Optional[float]:
    """MLPerf's clock at the run's last evaluation: the time to finish its schedule."""
    last = last_evaluation(run)
    return None if last is None else last.get("mlperf_s")


def final_gaps(items: list[dict], reference: list[dict]) -> list[list[Any]]:
    """Each run's top-1 at the end less that of the ``reference`` run of the same seed (the same
    initial weights and data order), seed by seed: [seed, gap or None]."""
    theirs = by_seed(reference)
    cells = []
    for run in items:
        other = theirs.get(run_seed(run))
        mine = run["summary"].get("final_top1")
        gap = None if other is None or mine is None or other["summary"].get("final_top1") is None \
            else mine - other["summary"]["final_top1"]
        cells.append([run_seed(run), gap])
    return cells


def schedule_rows(runs: dict[str, list[dict]], reference: str) -> list[dict[str, Any]]:
    """The paper's criterion, per strategy: the time to finish the fixed schedule, top-1 at the end,
    that less the same seed's ``reference`` run's (None for the reference), the largest fall after
    the learning-rate warm-up."""
    return [{"label": label, "schedule_s": [schedule_s(r) for r in items],
             "final": [r["summary"].get("final_top1") for r in items],
             "gaps": None if label == reference else final_gaps(items, runs[reference]),
             "largest_fall": [largest_fall(r) for r in items]} for label, items in runs.items()]


def sparsification_rows(runs: dict[str, list[dict]]) -> list[dict[str, Any]]:
    """Per sparse strategy that logged it (``runs.sparsification``), medians over the seeds: the
    steps between two sends of a layer's chunks (the layers' range and the slowest layer), the share of
    the chunks' momentum that masking erased, the bytes each rank sent per step after the warm-up."""
    rows = []
    for label, items in runs.items():
        found = [s for s in (sparsification(r) for r in items) if s is not None]
        if not found:
            continue
        layers = sorted({layer for s in found for layer in s["intervals"]})
        median_of = {layer: statistics.median(s["intervals"][layer] for s in found if layer in s["intervals"])
                     for layer in layers}
        slowest = max(layers, key=lambda layer: median_of[layer])
        shares = [s["masked_share"] for s in found if s["masked_share"] is not None]
        rows.append({"label": label, "fastest": min(median_of.values()), "slowest": max(median_of.values()),
                     "slowest_layer": slowest, "slowest_interval": median_of[slowest],
                     "masked_share": statistics.median(shares) if shares else None,
                     "bytes_per_step": statistics.median(s["bytes_per_step"] for s in found)})
    return rows


def falls_after_warmup(runs: dict[str, list[dict]], warmup_epochs: Optional[float] = None,
                       drop_points: float = 5.0) -> list[dict[str, Any]]:
    """Evaluations after the learning-rate warm-up (``warmup_epochs``, else each run's own) that fall
    more than ``drop_points`` below the previous one: label, seed, the two epochs and their top-1."""
    return [{"label": label, "seed": run_seed(run), "from_epoch": e0, "to_epoch": e1, "from_top1": a0, "to_top1": a1}
            for label, items in runs.items() for run in items
            for e0, a0, e1, a1 in falls(run, warmup_epochs) if a1 < a0 - drop_points]


def dense_agreement(runs: dict[str, list[dict]]) -> dict[Seed, list[Optional[float]]]:
    """Per seed, the epochs to target of every dense strategy (the same SGD: they should agree)."""
    found: dict[Seed, list[Optional[float]]] = {}
    for items in runs.values():
        for run in items:
            if is_dense(run):
                found.setdefault(run_seed(run), []).append(epochs_to_target(run))
    return found


def convergence_rows(runs: dict[str, list[dict]]) -> tuple[list[dict[str, Any]], float]:
    """Accuracy per epoch: epochs to target (for a sparse strategy, how many of them it sent sparsely,
    after its dense warm-up), and top-1 at the largest epoch every run was evaluated at (where runs
    stop at the target, that is where they can all be compared; else the end of the schedule)."""
    budget = min((max((epoch for epoch, _ in evaluations(r)), default=0.0) for items in runs.values() for r in items),
                 default=0.0)
    rows = [{"label": label, "density": compression_label(items[0]), "epochs": [epochs_to_target(r) for r in items],
             "sparse_epochs": None if is_dense(items[0]) else [sparse_epochs_to_target(r) for r in items],
             "at_budget": [next((a for e, a in evaluations(r) if abs(e - budget) < 1e-6), None) for r in items],
             "best": [r["summary"]["best_top1"] for r in items]} for label, items in runs.items()]
    return rows, budget


def whole(runs: dict[str, list[dict]]) -> bool:
    """Whether every run trained its whole schedule (the paper's criterion reads their ends)."""
    return all(trained_whole_schedule(r) for items in runs.values() for r in items)


def warmup_of(runs: dict[str, list[dict]]) -> float:
    """The first run's learning-rate warm-up, in epochs."""
    return run_warmup_epochs(next(iter(runs.values()))[0])
