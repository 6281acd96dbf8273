"""Where CSC (``gradientflow``) stands against what researchers would use instead, PyTorch's PowerSGD
(``powersgd``) and fp16 (``ddp-fp16``) hooks, with plain ``ddp`` and the paper's stack as published
(``gradientflow-paper``), as data: the numbers per strategy and the goals as ``verdicts``. The
renderer (``render/reproduction_peers.py``) words them.
"""

from __future__ import annotations

import statistics
from typing import Any, Optional, Sequence

from gradientflow_repro.comm.plan import resolve
from gradientflow_repro.reproduction import lineup, verdicts
from gradientflow_repro.reproduction.measures import (
    at_target,
    by_seed,
    decomposition,
    median,
    sparse_epochs_to_target,
)
from gradientflow_repro.reproduction.runs import (
    compression_label,
    epochs_to_target,
    is_dense,
    median_step,
    run_row,
    run_target,
    trained_whole_schedule,
)
from gradientflow_repro.scaling import perfmodel as pm
from gradientflow_repro.scaling.profile import profile_from_json

# The configurations the peers' section compares: CSC (our full stack), what researchers would use
# instead (PyTorch's own DDP hooks), the paper's stack as published, and plain DDP (the goals' reference)
CSC = verdicts.CSC
POWERSGD = "powersgd"
DDP_FP16 = "ddp-fp16"
PAPER_STACK = "gradientflow-paper"
DDP = verdicts.DDP


def local_work_s(label: str, calibration: dict) -> Optional[float]:
    """Seconds of local work on the communication path per step of ``label`` (CSC's selection and
    residuals, PowerSGD's matrix products and orthogonalisation, the fp16 wire's casts), as the model
    sums it over this model's gradients from the per-element costs measured in the calibration's
    profile (one process); None where the one its sparsifier needs was not measured or the model
    does not price the configuration."""
    measured = calibration.get("profile") or {}
    if not measured.get("tensors"):
        return None
    try:
        options = resolve(lineup.COMPARED[label])
        strategy = pm.Strategy.from_plan(label, options)
    except (KeyError, ValueError):
        return None
    needs = {"csc": "sparsify_s_per_element", "chunks": "sparsify_s_per_element",
             "low_rank": "low_rank_s_per_element"}.get(options.sparsifier.pricing)
    if (needs and not measured.get(needs)) or (options.wire == "fp16" and not measured.get("wire_cast_s_per_element")):
        return None
    profile = profile_from_json(measured)
    return sum(message.local_work_s for message in pm.messages(profile, strategy))


def convergence_medians(rows: Sequence[dict], label: str) -> dict[str, Optional[float]]:
    """Medians over ``label``'s rows of ``make convergence`` (``runs.read_runs_csv``): top-1 at the end,
    epochs to target, largest fall after the warm-up, and how many runs fell more than
    ``verdicts.LARGE_FALL_POINTS``."""
    mine = [row for row in rows if row["strategy"] == label]
    falls_over = [row["largest_fall_after_warmup"] for row in mine if row["largest_fall_after_warmup"] is not None]
    return {"final_top1": median([row["final_top1"] for row in mine]),
            "epochs": median([row["epochs_to_target"] for row in mine]),
            "largest_fall": median(falls_over), "large_falls": sum(f > verdicts.LARGE_FALL_POINTS for f in falls_over),
            "runs": len(mine), "reached": sum(bool(row["reached_target"]) for row in mine)}


def seed_final_gaps(rows: Sequence[dict], label: str, other: str) -> list[float]:
    """``label``'s top-1 at the end less ``other``'s, seed by seed (``make convergence``'s rows)."""
    theirs = {row["seed"]: row["final_top1"] for row in rows if row["strategy"] == other}
    return [row["final_top1"] - theirs[row["seed"]] for row in rows if row["strategy"] == label
            and row["final_top1"] is not None and theirs.get(row["seed"]) is not None]


def peers(runs: dict[str, list[dict]], calibration: dict, convergence_rows: Sequence[dict] = (),
          projection: Optional[dict[str, list[float]]] = None, projection_counts: Sequence[int] = (),
          convergence_source: str = "`results/runs.csv`") -> Optional[dict[str, Any]]:
    """The peers' numbers: time to target (MLPerf clock, median over the seeds), epochs to target,
    step and bytes per step after the dense warm-up (from the runs to the target), local work per
    step (``local_work_s``), top-1 at the end of ``make convergence`` (its rows of ``results/runs.csv``,
    ``convergence_rows``; runs of the whole schedule: their own ends) and the model's speedup at 512
    GPUs (``projection``: label -> speedups at ``projection_counts``); then the goals and what our
    additions to the paper's stack buy. None when ``gradientflow`` or every peer is missing."""
    shown = [label for label in (CSC, POWERSGD, DDP_FP16, DDP, PAPER_STACK) if label in runs]
    contenders = [CSC, *(label for label in (POWERSGD, DDP_FP16) if label in runs)]
    if CSC not in runs or not (len(contenders) > 1 or PAPER_STACK in runs):
        return None
    rows = [row for row in convergence_rows if row.get("study", "convergence") == "convergence"]
    own_ends = all(trained_whole_schedule(r) for label in shown for r in runs[label])
    if own_ends:  # these runs: their own ends
        rows = [run_row(r, study="convergence", label=label, target=run_target(r))
                for label in shown for r in runs[label]]
        convergence_source = "the runs above"
    time = {label: median([at_target(r, "mlperf_s") for r in runs[label]]) for label in shown}
    final = {label: convergence_medians(rows, label) for label in shown}
    gpus = pm.PAPER_GPUS
    at_scale = ({label: projection[label][list(projection_counts).index(gpus)] for label in shown
                 if label in projection} if projection and gpus in projection_counts else {})
    table = []
    for label in shown:
        steady = median_step(runs[label])  # after each run's dense warm-up
        table.append({"label": label, "sends": compression_label(runs[label][0]),
                      "time": [at_target(r, "mlperf_s") for r in runs[label]],
                      "epochs": [epochs_to_target(r) for r in runs[label]],
                      "sparse_epochs": None if is_dense(runs[label][0]) else
                      [sparse_epochs_to_target(r) for r in runs[label]],
                      "step_s": steady["step_s"], "bytes_per_step": steady["bytes_per_step"],
                      "local_work_s": local_work_s(label, calibration), "time_median": time[label],
                      "epochs_median": median([epochs_to_target(r) for r in runs[label]]),
                      "final_top1": final[label]["final_top1"], "speedup_at_scale": at_scale.get(label)})
    ends = {label: final[label]["final_top1"] for label in shown}
    return {"own_ends": own_ends, "source": convergence_source, "seeds": len(runs[CSC]), "gpus": gpus,
            "contenders": contenders, "rows": table,
            "commits": sorted({str(row.get("commit"))[:12] for row in rows}),
            "ahead": (verdicts.peers_ahead(time, ends, contenders[1:]).data() if len(contenders) > 1 else None),
            "below_ddp": below_ddp(runs).data() if DDP in runs else None,
            "additions": additions(runs, rows, final)}


def below_ddp(runs: dict[str, list[dict]]) -> verdicts.Verdict:
    """``gradientflow``'s time to target below ``ddp``'s in the median and in every seed, each ratio
    split into step time x epochs x overhead (as ``decomposition``), seed by seed on the same seed."""
    theirs, seeds = by_seed(runs[DDP]), []
    for seed, mine in by_seed(runs[CSC]).items():
        other = theirs.get(seed)
        if other is not None:
            seeds.append((seed, decomposition({DDP: [other], CSC: [mine]}, DDP).get(CSC),
                          epochs_to_target(mine) is not None))
    return verdicts.below_ddp(decomposition(runs, DDP).get(CSC), seeds)


def additions(runs: dict[str, list[dict]], rows: list[dict], final: dict[str, dict]) -> Optional[dict[str, Any]]:
    """What our additions to the paper's stack (the release cap, the trust-ratio noise correction)
    buy: ``gradientflow`` against ``gradientflow-paper`` in epochs to target, top-1 at the end of
    ``make convergence`` and falls after the warm-up (None: the paper's stack not trained)."""
    if PAPER_STACK not in runs:
        return None
    ours, paper = (median([epochs_to_target(r) for r in runs[label]]) for label in (CSC, PAPER_STACK))
    whole = bool(final[CSC]["runs"] and final[PAPER_STACK]["runs"])
    gaps = seed_final_gaps(rows, CSC, PAPER_STACK) if whole else []
    return {"epochs": ours, "paper_epochs": paper, "whole": final[CSC] if whole else None,
            "paper_whole": final[PAPER_STACK] if whole else None,
            "gaps": [statistics.median(gaps), min(gaps), max(gaps)] if gaps else None,
            "large_fall_points": verdicts.LARGE_FALL_POINTS}
