"""results/REPORT.md from the runs of a reproduction (``reproduction.reproduce``), through data: the
report's facts, tables and goal verdicts as one document (``report_data``), written as
``REPORT.json`` beside the Markdown (``render.write_data``), which the renderer
(``render/reproduction.py``, kind ``reproduction.report``) writes from it alone:
``python -m gradientflow_repro.render results/REPORT.json`` rewrites ``results/REPORT.md``.

What the document holds: the comparison table, MLPerf's clock split, the time ratio decomposed,
the paper's criterion (``measures``), what sparsification did, CSC against PyTorch's PowerSGD and
fp16 hooks and the paper's stack as published (``peers``), the scaling model against measurement
(``model_check``) and against the paper; every goal as a ``verdicts.Verdict``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

from gradientflow_repro import render
from gradientflow_repro.comm import knobs
from gradientflow_repro.reproduction import lineup, measures, model_check, peers, verdicts
from gradientflow_repro.reproduction.figures import plot_step_split, plot_top1
from gradientflow_repro.reproduction.runs import (
    compression_label,
    compute_only_s,
    dense_warmup_epochs,
    epochs_to_target,
    is_dense,
    median_step,
    run_knobs,
    run_target,
    sends_trust_sketches,
)
from gradientflow_repro.scaling import perfmodel as pm
from gradientflow_repro.scaling.projection import GPU_COUNTS, paper_check, plot

KIND = "reproduction.report"  # the renderer of the document (render/reproduction.py's ``report``)


def decomposition_section(runs: dict[str, list[dict]], ladder_checks: Optional[dict[str, dict]] = None) -> dict:
    """The time ratio against the reference decomposed, the goal on it, and the floor under it."""
    reference = measures.reference_of(runs)
    ratios = measures.decomposition(runs, reference).get(verdicts.CSC)
    goal = verdicts.time_to_target(ratios, reference)
    return {"reference": reference, "rows": measures.decomposition_rows(runs, reference),
            "goal": None if goal is None else goal.data(),
            "floor": step_floor(ladder_checks or {}, reference) if goal is not None else None}


def step_floor(checks: dict[str, dict], reference: str) -> Optional[dict[str, float]]:
    """What the time ratio would be with all communication hidden and no epoch lost: no step is
    shorter than the compute-only step (``allreduce``'s less its wait in ``synchronize()``)."""
    if "allreduce" not in checks or reference not in checks:
        return None
    compute = compute_only_s(checks["allreduce"])
    return {"compute_s": compute, "reference_step_s": checks[reference]["step_s"],
            "floor": compute / checks[reference]["step_s"]}


def schedule_section(runs: dict[str, list[dict]]) -> dict[str, Any]:
    """The paper's criterion from the same runs as MLPerf's, when they trained the whole schedule
    (``whole``; else the renderer says where it is), with its goal (``verdicts.final_gap``)."""
    if not measures.whole(runs):
        return {"whole": False}
    reference = measures.reference_of(runs)
    every = [run for items in runs.values() for run in items]
    goal = None
    if verdicts.CSC in runs and reference != verdicts.CSC:
        theirs = measures.by_seed(runs[reference])
        goal = verdicts.final_gap({measures.run_seed(r): r["summary"].get("final_top1") for r in runs[verdicts.CSC]},
                                  {seed: run["summary"].get("final_top1") for seed, run in theirs.items()},
                                  reference).data()
    return {"whole": True, "reference": reference, "epochs": (every[0].get("config") or {}).get("epochs", "?"),
            "warmup": measures.warmup_of(runs), "rows": measures.schedule_rows(runs, reference), "goal": goal}


def convergence_section(runs: dict[str, list[dict]]) -> dict[str, Any]:
    """Accuracy per epoch, the falls after the warm-up, whether the dense strategies agree, and each
    sparse strategy's epochs to target against dense training (``gradientflow``'s goal at density 0.1)."""
    rows, budget = measures.convergence_rows(runs)
    first = next(iter(runs.values()))[0]
    agreement = measures.dense_agreement(runs)
    every = (first.get("config") or {}).get("eval_every_epochs", 1)
    dense = measures.median([epochs_to_target(r) for items in runs.values() for r in items if is_dense(r)])
    sparse = []
    for label, items in runs.items():
        if not items or is_dense(items[0]):
            continue
        epochs = [epochs_to_target(r) for r in items]
        reached = [e for e in epochs if e is not None]
        options = run_knobs(items[0])
        low_rank = options.sparsifier.pricing == "low_rank"
        entry: dict[str, Any] = {
            "label": label, "low_rank": low_rank, "sends": compression_label(items[0]),
            "density": getattr(options.keys, "density", None),
            "corrected": bool(getattr(options.keys, "momentum_correction", False) or low_rank), "epochs": epochs,
            "dense": dense,
            "best": [r["summary"].get("best_top1") for r in items],
            "sparse": measures.median([measures.sparse_epochs_to_target(r) for r in items]),
            "dense_warmup": dense_warmup_epochs(items[0]), "goal": None,
            # against dense training only where it reached the target in most seeds
            "compared": 2 * len(reached) > len(epochs) and dense is not None,
            "median": measures.median(reached)}
        if label == verdicts.CSC:
            goal = verdicts.sparse_epochs(epochs, dense)
            if goal.measured is None or abs(options.keys.density - verdicts.SPARSE_GOAL_DENSITY) < 1e-9:
                entry["goal"] = goal.data()
        sparse.append(entry)
    short = [entry["label"] for entry in sparse if entry["compared"] and entry["sparse"] <= 1]
    return {"rows": rows, "budget": budget, "short": short, "whole": measures.whole(runs),
            "warmup": measures.warmup_of(runs),
            "falls": measures.falls_after_warmup(runs), "sparse": sparse,
            "agreement": verdicts.dense_agreement(agreement, every).data() if agreement else None}


# Why a reproduction without `allreduce` has no step-time runs (``reproduce``) and no model check
NO_MODEL_CHECK = ("the scaling model is scaled to `allreduce`'s compute-only step (its step less its wait), and "
                  "`allreduce` was not among the configurations trained (`--rungs` adds it)")


def _model_checked(checks: dict[int, dict[str, dict]]) -> bool:
    """Whether any world size has the step times the model is checked against (`allreduce`'s among them)."""
    return any("allreduce" in by_label for by_label in checks.values())


def _global_batch(runs: dict[str, list[dict]]) -> Optional[int]:
    """The ladder's global batch, from its first run's saved configuration (every run has the same)."""
    return (next(iter(runs.values()))[0].get("config") or {}).get("global_batch_size")


def model_section(runs: dict[str, list[dict]], checks: dict[int, dict[str, dict]], calibration: dict,
                  network_by_world: dict[int, dict], world: int, repeats: int, check_repeats: int,
                  short_at_world: Optional[list[str]], unshaped: Optional[dict[int, dict[str, dict]]],
                  allreduce_beside: dict[int, dict], cores: Optional[int]) -> dict[str, Any]:
    """The scaling model against measurement: which runs it is checked against, the local work
    measured per gradient element, and the check itself (``model_check``), or why there is none."""
    profile = calibration["profile"]
    section: dict[str, Any] = {
        "checked": _model_checked(checks), "reason": NO_MODEL_CHECK, "world": world, "repeats": repeats,
        "check_repeats": check_repeats, "short_at_world": short_at_world,
        "beside": world in allreduce_beside, "others": [w for w in sorted(checks) if w != world],
        "sparsify_s_per_element": profile.get("sparsify_s_per_element", 0),
        "wire_cast_s_per_element": profile.get("wire_cast_s_per_element", 0),
        "low_rank_s_per_element": profile.get("low_rank_s_per_element"),
        "by_contention": bool(profile.get("batch") and _global_batch(runs)),
        "optimizer_s": profile.get("optimizer_s"), "plain_optimizer_s": profile.get("plain_optimizer_s")}
    if not section["checked"]:  # the network's description is checked all the same: it needs no configuration
        return {**section, "peers": [], "check": None,
                "alone": model_check.per_tensor_alone_of(calibration, network_by_world)}
    # configurations outside the ladder, checked against the model at the ladder's world size from
    # their runs to the target (after their dense warm-up), as the ladder's dense rungs are
    peer_steps = {label: median_step(items) for label, items in runs.items()
                  if label in lineup.PEERS and label not in lineup.LADDER}
    check = model_check.model_check(checks, calibration, network_by_world,
                                    sends_trust_sketches(next(iter(runs.values()))[0]), unshaped, cores,
                                    allreduce_beside, {world: short_at_world or []}, _global_batch(runs),
                                    {world: peer_steps} if peer_steps else None)
    return {**section, "peers": list(peer_steps), "check": check, "alone": check["alone"]}


def report_data(*, runs: dict[str, list[dict]], checks: dict[int, dict[str, dict]], calibration: dict,
                network: dict, world: int, repeats: int, command: str, elapsed_s: float, experiment: str,
                group: str, overrides: list[str], machine: dict, network_by_world: Optional[dict[int, dict]] = None,
                check_repeats: int = 1, launches: Optional[list[dict]] = None,
                short_at_world: Optional[list[str]] = None, unshaped: Optional[dict[int, dict[str, dict]]] = None,
                allreduce_beside: Optional[dict[int, dict]] = None, written_by: Optional[str] = None,
                convergence_rows: Sequence[dict] = (), convergence_source: str = "`results/runs.csv`",
                paper: Optional[tuple[list[str], dict]] = None) -> dict[str, Any]:
    """The report's document (``write_report`` says what each argument is); ``paper``: the scaling
    model against the paper (``projection.paper_check``; None: computed here)."""
    network_by_world = network_by_world or {world: network}  # reproductions before per-world measurement
    allreduce_beside = allreduce_beside or {}
    paper_lines, table = paper or paper_check()
    first = next(iter(runs.values()))[0]
    return {
        "machine": {key: machine.get(key) for key in ("gpu", "cpu", "cpu_count", "torch", "git_commit")},
        "written_by": written_by if written_by and written_by != machine["git_commit"] else None,
        "command": command, "elapsed_s": elapsed_s,
        "launches": [{"elapsed_s": launch["elapsed_s"], "kept_jobs": launch.get("kept_jobs", 0)}
                     for launch in launches or []],
        "experiment": experiment, "world": world, "repeats": repeats, "overrides": list(overrides),
        "whole": measures.whole(runs), "epochs": (first.get("config") or {}).get("epochs", "?"),
        "target": run_target(first), "untrained": [label for label in lineup.COMPARED if label not in runs],
        "network": {key: network.get(key) for key in ("emulated", "rate_mbit", "why_not")}, "group": group,
        "comparison": measures.comparison(runs),
        "sparse_labels": [label for label, items in runs.items() if not is_dense(items[0])],
        "ddp_fused": [label for label, items in runs.items() if run_knobs(items[0]).fusion == "ddp"],
        "clocks": measures.clocks(runs),
        "decomposition": decomposition_section(runs, checks.get(world)),
        "schedule": schedule_section(runs), "sparsification": measures.sparsification_rows(runs),
        "peers": peers.peers(runs, calibration, convergence_rows, table, GPU_COUNTS, convergence_source),
        "convergence": convergence_section(runs), "step_split": bool(checks.get(world)),
        "ratio_note": pm.paper_dense_ratio()[1],
        "calibration": {"compute_s": calibration["compute_s"], "bytes_per_step": calibration["bytes_per_step"]},
        "network_by_world": [[w, measured] for w, measured in sorted(network_by_world.items())],
        "small_message_bytes": knobs.SMALL_MESSAGE_BYTES,
        "model": model_section(runs, checks, calibration, network_by_world, world, repeats, check_repeats,
                               short_at_world, unshaped, allreduce_beside, machine.get("cpu_count")),
        "paper": paper_lines, "paper_table": table}


def write_report(path: Path, *, runs: dict[str, list[dict]], checks: dict[int, dict[str, dict]], **facts: Any) -> Path:
    """Writes ``path`` (the Markdown), its data beside it (``.json``, ``report_data``) and its figures.
    ``facts``: ``report_data``'s: ``calibration``, ``network`` (the one measured at ``world``),
    ``world``, ``repeats``, ``command``, ``elapsed_s``, ``experiment``, ``group``, ``overrides``;
    ``machine``: environment_facts() of the run; ``network_by_world``; ``check_repeats``;
    ``launches``: the reproduction's launches (``progress.Progress``), when it was interrupted and continued;
    ``short_at_world``: the rungs whose step time at ``world`` comes from short runs sparse from the
    start rather than the runs to the target (None: a reproduction from before there were any);
    ``unshaped``: those rungs' step times with the links unshaped, by world size (with `allreduce`'s
    beside them); ``allreduce_beside``: `allreduce`'s short runs beside those at ``world`` (None: a
    reproduction from before there were any, whose sparse rungs' ratios use its runs to the target);
    ``written_by``: the code writing the report, said where it is not the code that measured;
    ``convergence_rows``: ``make convergence``'s rows of ``results/runs.csv`` (``runs.read_runs_csv``),
    read from ``convergence_source``, for top-1 at the end in the peers' section (none: it says where
    to look). Returns the data's path."""
    figures = path.parent
    figures.mkdir(parents=True, exist_ok=True)  # --report may name a new directory
    world = facts["world"]
    plot_top1(runs, figures / "reproduce_top1.png")
    plot_top1(runs, figures / "reproduce_top1_epochs.png", x="epoch")
    if checks.get(world):  # (none: no step-time runs, ``_model_checked``)
        plot_step_split(checks[world], figures / "reproduce_step_split.png", world)
    paper_lines, table = paper_check()
    plot(table, figures / "scaling.png")
    data = report_data(runs=runs, checks=checks, paper=(paper_lines, table), **facts)
    written = render.write_data(path.with_suffix(".json"), KIND, data)
    render.render_file(written, path)
    return written
