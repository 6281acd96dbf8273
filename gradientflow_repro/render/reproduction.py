"""The reproduction's Markdown from its data: ``report`` writes results/REPORT.md from the document
``reproduction.report.report_data`` builds, ``convergence`` results/convergence.md from the one
``reproduction.convergence.study_data`` builds, ``reliability`` results/reliability.md from the fault
table's (``reproduction.fault_report``). Nothing is measured or decided here: every number
and every verdict (``met``) is read from the document; this module words them.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from gradientflow_repro.render.reproduction_cells import known_spread, said, seed_gaps, spread
from gradientflow_repro.render.reproduction_model import model_lines, network_table
from gradientflow_repro.render.reproduction_peers import peers_section
from gradientflow_repro.render.reproduction_study import (
    convergence,  # noqa: F401 - the study's renderer
    falls,
    sparsification_section,
)

Document = Mapping[str, Any]


def comparison_table(data: Document) -> list[str]:
    lines = ["| strategy | time to target, MLPerf clock (s) | epochs to target | top-1 at the last evaluation (%) "
             "| images/s "
             "| MB sent per rank per step | s waited in synchronize per step | speedup over "
             f"{data['first']} (MLPerf clock) |", "|---|---|---|---|---|---|---|---|"]
    for row in data["rows"]:
        speed = "-" if row["speedup"] is None else f"{row['speedup']:.2f}x"
        lines.append(" | ".join([
            f"| {row['label']}", spread(row["time"], ".1f"), spread(row["epochs"], ".0f"), spread(row["final"], ".2f"),
            spread(row["images_per_s"], ".0f"), spread(row["bytes"], ".3f", 1e-6), spread(row["wait"], ".4f"),
            speed]) + " |")
    return lines


def clock_table(rows: Sequence[Document]) -> list[str]:
    lines = ["| strategy | start-up (s) | training (s) | evaluation (s) | other (s) | MLPerf clock to target (s) "
             "| initialisation before the clock (s) |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(" | ".join([f"| {row['label']}", *(spread(row[c], ".1f") for c in (
            "startup_s", "train_s", "eval_s", "other_s", "mlperf_s", "init_s"))]) + " |")
    return lines


def decomposition_table(rows: Sequence[Document], reference: str) -> list[str]:
    lines = [f"| strategy | time to target / {reference}'s | = step time ratio | x epochs to target ratio "
             "| x overhead (start-up, evaluation, rest) | seeds that reached the target |", "|---|---|---|---|---|---|"]
    for row in rows:
        reached = f"{row['reached']} of {row['seeds']}"
        if row["ratios"] is not None:
            cells = " | ".join(f"{row['ratios'][key]:.2f}x" for key in ("time", "step", "epochs", "overhead"))
            lines.append(f"| {row['label']} | {cells} | {reached} |")
        else:
            lines.append(f"| {row['label']} | not reached{'' if row['label'] != reference else ' (the reference)'} "
                         f"| - | - | - | {reached} |")
    return lines


def decomposition_section(data: Document) -> list[str]:
    reference = data["reference"]
    lines = [f"### Time to target against `{reference}`'s, decomposed (below 1: faster)", "",
             *decomposition_table(data["rows"], reference), "",
             "Each ratio is of the medians over the seeds that reached the target. Step time: training seconds "
             "to the target over its steps (a sparse strategy's dense warm-up included); overhead: what the two "
             "do not explain (start-up, evaluation, the rest, and the medians coming from different seeds; the "
             "same order of seconds for every strategy, so it pulls every ratio towards 1). Epochs are counted "
             "at evaluations, one per epoch: at 2 epochs to target one evaluation is 50%."]
    goal = data["goal"]
    if goal:
        d = goal["detail"]
        lines += ["", f"Goal: `gradientflow`'s time to target at most {goal['target']:g}x `{reference}`'s (median): "
                  f"{goal['measured']:.2f}x = {d['step']:.2f}x (step time) x {d['epochs']:.2f}x (epochs) x "
                  f"{d['overhead']:.2f}x (overhead): {said(goal['met'])}."]
        floor = data["floor"]
        if floor:
            f = floor["floor"]
            lines.append(f"The floor under it: no step is shorter than the compute-only step "
                         f"({floor['compute_s'] * 1e3:.1f} ms, `allreduce`'s step less its wait, in the same runs), "
                         f"{f:.2f}x `{reference}`'s step ({floor['reference_step_s'] * 1e3:.1f} ms). With all "
                         "communication hidden behind backward, no epoch lost to sparse communication and the same "
                         f"overhead, the ratio would be {f:.2f}x x {d['overhead']:.2f}x = {f * d['overhead']:.2f}x.")
    return lines


def schedule_table(rows: Sequence[Document], reference: str) -> list[str]:
    lines = ["| strategy | time to finish the schedule, MLPerf clock (s) | top-1 at the end (%) "
             f"| top-1 at the end - `{reference}`'s, same seed (points) | largest fall after the warm-up (points) |",
             "|---|---|---|---|---|"]
    for row in rows:
        gaps = "- (the reference)" if row["gaps"] is None else seed_gaps(row["gaps"])
        lines.append(" | ".join([f"| {row['label']}", known_spread(row["schedule_s"], ".1f"),
                                 known_spread(row["final"], ".2f"), gaps,
                                 known_spread(row["largest_fall"], ".1f")]) + " |")
    return lines


def final_gap_goal(goal: Optional[Document]) -> list[str]:
    """The goal on the paper's criterion, one line (nothing without it)."""
    if not goal:
        return []
    d = goal["detail"]
    return [f"Goal: in every seed `gradientflow`'s top-1 at the end at most {d['goal_points']:g} points below the "
            f"same seed's `{d['reference']}` run, or the `{d['reference']}` seeds' own spread "
            f"({d['reference_spread']:.2f} points) if larger: " + seed_gaps(goal["measured"])
            + f": {said(goal['met'])}.", ""]


def schedule_section(data: Document) -> list[str]:
    heading = ["## The paper's criterion: the fixed schedule", ""]
    if not data["whole"]:
        return [*heading, "These runs stopped at the target, so they cannot say how long the whole schedule "
                "takes or where top-1 ends: `make convergence` trains it (`results/convergence.md`)."]
    reference = data["reference"]
    return [*heading, *schedule_table(data["rows"], reference), "", *final_gap_goal(data["goal"]),
            f"The paper's criterion, from the same runs as MLPerf's above: every configuration trains the "
            f"experiment's whole schedule ({data['epochs']} epochs), never stopped at the target. "
            "Time to finish it: MLPerf's clock at the last evaluation (median [range] over the seeds). Top-1 at "
            f"the end: at that evaluation, and less that of `{reference}`'s run of the same seed (the same initial "
            "weights and data order), seed by seed. Largest fall: the most top-1 dropped from one evaluation to "
            f"the next after the learning-rate warm-up ({data['warmup']:g} epochs; 0: it never fell)."]


def convergence_table(rows: Sequence[Document], budget: float) -> list[str]:
    lines = [f"| strategy | density | epochs to target | of them sparse | top-1 at epoch {budget:.0f} (%) "
             "| best top-1 (%) |", "|---|---|---|---|---|---|"]
    for row in rows:
        sparse = "-" if row["sparse_epochs"] is None else spread(row["sparse_epochs"], "g")
        lines.append(f"| {row['label']} | {row['density']} | {spread(row['epochs'], '.0f')} | {sparse} "
                     f"| {spread(row['at_budget'], '.1f')} | {spread(row['best'], '.1f')} |")
    return lines


def convergence_section(data: Document) -> list[str]:
    budget, whole = data["budget"], data["whole"]
    where = (f"Every run trained the whole schedule, so epoch {budget:.0f} is its end; top-1 there against the "
             "same seed's dense run and the falls after the warm-up: the paper's criterion above."
             if whole else
             f"Runs stop at the target, so epoch {budget:.0f} is the last one every run was evaluated at. Over the "
             "whole schedule, never stopped at the target (top-1 at the end, falls after the target): "
             "`make convergence`, `results/convergence.md`.")
    lines = [*convergence_table(data["rows"], budget), "",
             where + " Same seeds for every strategy (seed = initial weights and data order)."]
    dropped = falls(data["falls"])
    lines += ["", f"- Stable recipe: after the learning-rate warm-up ({data['warmup']:g} epochs), no evaluation may "
              f"fall more than 5 points below the previous one: {len(dropped)} such fall(s)"
              + (": " + "; ".join(dropped) if dropped else "") + "."]
    agreement = data["agreement"]
    if agreement:
        lines.append("- Dense strategies (the same SGD) reach the target at the same epoch, within one evaluation, "
                     "in every seed: " + ", ".join(
                         f"seed {seed}: " + ("not all reached" if gap is None else f"spread {gap:.0f} epoch(s)")
                         for seed, gap in agreement["measured"]) + f": {said(agreement['met'])}.")
    for entry in data["sparse"]:
        label, goal = entry["label"], entry["goal"]
        name = (f"`{label}` ({entry['sends']})" if entry["low_rank"] else
                f"`{label}` (density {entry['density']:g}{'' if entry['corrected'] else ', no momentum correction'})")
        if not entry["compared"]:
            reached = sum(e is not None for e in entry["epochs"])
            lines.append(f"- {name}: reached the target in {reached} of {len(entry['epochs'])} seeds (best top-1 "
                         f"{spread(entry['best'], '.1f')}%)" + (f": goal {said(goal['met'])}." if goal else "."))
            continue
        mine, dense = entry["median"], entry["dense"]
        stated = (f" Goal at density {entry['density']:g}: within {goal['target']:.0%}: {said(goal['met'])}."
                  if goal else "")
        lines.append(f"- {name}: {mine:g} epochs to target against {dense:g} for "
                     f"dense training (medians): {mine / dense - 1:+.0%}, {entry['sparse']:g} of them sparse, after "
                     f"{entry['dense_warmup']:g} dense.{stated}")
    if data["short"]:
        lines.append(f"- {', '.join(f'`{label}`' for label in data['short'])}: at most one sparse epoch before the "
                     "target (median), so here epochs to target say little about what sparse communication costs "
                     "per epoch; the whole schedule is " + ("in the paper's criterion above." if whole else
                                                            "in `results/convergence.md` (`make convergence`)."))
    return lines


def launches_note(launches: Sequence[Document]) -> str:
    """How an interrupted reproduction was continued ('' for one launch)."""
    if len(launches) < 2:
        return ""
    parts = [f"launch {i + 1}: {launch['elapsed_s'] / 60:.1f} min"
             + (f", {launch['kept_jobs']} jobs kept from before" if i else "") for i, launch in enumerate(launches)]
    return (f", over {len(launches)} launches of the same plan, code and machine, each continuing the one before, "
            f"which had stopped early ({'; '.join(parts)}); every run was trained whole in one launch")


def runs_lines(doc: Document) -> list[str]:
    """How the runs were trained: to the target, or over the whole schedule with both criteria read
    from them; and the configurations not trained."""
    seeds = f"(seeds 0-{doc['repeats'] - 1}: initial weights and data order; median, range in brackets)"
    every = f"Overrides for every run: `{' '.join(doc['overrides'])}`."
    if not doc["whole"]:
        lines = [f"- Experiment `{doc['experiment']}`, world size {doc['world']}, each configuration trained to the "
                 f"target once per seed {seeds}. {every}"]
    else:
        target = doc["target"]
        lines = [f"- Experiment `{doc['experiment']}`, world size {doc['world']}, each configuration trained over "
                 f"the whole schedule ({doc['epochs']} epochs, `target_top1=null`) once per seed {seeds}. {every}",
                 "- Two criteria from the same runs: MLPerf's, time to the target ("
                 + (f"{target:g}% top-1" if target is not None else "none set") + ": MLPerf's clock at the first "
                 "evaluation at or above it; \"Time to accuracy\" below), and the paper's, the fixed schedule (the "
                 "time to finish it and top-1 at the end; \"The paper's criterion\" below)."]
    if doc["untrained"]:
        lines.append(f"- Not trained here: {', '.join(f'`{label}`' for label in doc['untrained'])} (`--rungs` chooses "
                     "the configurations). `make convergence` trains every configuration on loopback over the whole "
                     "schedule (`results/convergence.md`).")
    return lines


def report(doc: Document) -> str:
    """results/REPORT.md from the document of ``reproduction.report.report_data``."""
    facts, network, model = doc["machine"], doc["network"], doc["model"]
    machine_line = facts["gpu"] or f"{facts['cpu']}, {facts['cpu_count']} cores, no GPU"
    if network["emulated"]:
        net_line = (f"emulated: one network namespace per rank, bridged, each link shaped to "
                    f"{network['rate_mbit']} Mbit/s with tbf (no added delay: this kernel has no netem)")
    else:
        net_line = f"loopback, not emulated ({network['why_not']}): communication is nearly free here"
    calibration, world = doc["calibration"], doc["world"]
    rate_note = (f"Our baseline (`allreduce`, fp32) computes for {calibration['compute_s'] * 1e3:.1f} ms per step "
                 f"and sends {calibration['bytes_per_step'] / 1e6:.3f} MB per rank per step (measured on an "
                 f"unshaped network, world size {world}); at {network['rate_mbit']} Mbit/s "
                 f"(tbf counts Ethernet frames: TCP payload is about 96% of the rate) that takes "
                 f"{calibration['bytes_per_step'] * 8 / 1e6 / (network['rate_mbit'] or 1) * 1e3:.1f} ms, "
                 f"the paper's ratio times the compute." if network["emulated"] else "No rate: loopback.")
    repeats, check_repeats = doc["repeats"], model["check_repeats"]
    trimmed = (f"- Step-time runs around the ladder (the model's check): {check_repeats} per strategy and world "
               "size" + (f", fewer than the {repeats} seeds of the runs to the target: trimmed so that every "
                         "configuration keeps its seeds within the time budget (`--check-repeats N` for more)"
                         if check_repeats < repeats else "") + "." if model["checked"]
               else f"- Step-time runs around the ladder (the model's check): none ({model['reason']}).")
    sparse = [f"`{label}`" for label in doc["sparse_labels"]]
    peers = peers_section(doc["peers"])
    text = [
        "# Reproducing GradientFlow's comparison", "",
        f"- Machine: {machine_line}. torch {facts['torch']}, commit {facts['git_commit']}"
        + (f"; this report was rewritten from the run's measurements by commit {doc['written_by']} (`--report-only`)."
           if doc["written_by"] else "."),
        f"- Command: `{doc['command']}` ({doc['elapsed_s'] / 60:.1f} min in all{launches_note(doc['launches'])}).",
        *runs_lines(doc), f"- Network: {net_line}.", trimmed,
        f"- wandb group `{doc['group']}` (offline; see Dashboards below).", "",
        "## Time to accuracy", "", *comparison_table(doc["comparison"]), "",
        "Clocks: MLPerf's, from run_start (initialisation done, no data touched) to the evaluation that "
        "reached the target, never paused. Epochs to target: at the first evaluation at or above it; a "
        "configuration that never reached it is in every table as not reached. Bytes: what each rank put on "
        "the wire per step (ring-equivalent for builtin collectives); "
        + (", ".join(sparse) + (" are" if len(sparse) > 1 else " is") + " dense during the warm-up. " if sparse else "")
        + "Waiting: seconds the trainer spent in `synchronize()` after backward; "
        + ", ".join(f"`{label}`" for label in doc["ddp_fused"])
        + " wait for their buckets inside backward (DDP, with PyTorch's own hooks), so their waiting is counted "
        "as compute in the table and the figure. Every run is a row of `runs.csv` beside this report (one per "
        "run and seed, with `make convergence`'s: columns in `gradientflow_repro/reproduction/runs.py`).", "",
        "![validation top-1 against wall-clock seconds](reproduce_top1.png)", "",
        "### Where the time to target goes", "", *clock_table(doc["clocks"]), "",
        "Start-up: from run_start to the first training step (listing and checking the files, building the "
        "data pipelines). Other: waiting for the next batch between steps, logging, checkpoints. "
        "Initialisation (imports, process group, model, "
        "communicator, wandb, resume) runs before MLPerf's clock starts, as MLPerf's rules allow; it is shown "
        "so nothing is hidden. Every run's start record has its phases (`init_phases_s`).", "",
        *decomposition_section(doc["decomposition"]), "",
        *schedule_section(doc["schedule"]), "", *sparsification_section(doc["sparsification"]),
        *([*peers, ""] if peers else []),
        "## Convergence: dense against sparse communication", "", *convergence_section(doc["convergence"]), "",
        "![validation top-1 against epochs](reproduce_top1_epochs.png)", "",
        *(["![time per step: compute and communication](reproduce_step_split.png)", ""] if doc["step_split"] else []),
        "## How the link rate was chosen", "",
        "The paper's setting: " + doc["ratio_note"] + ".", "", rate_note, "",
        "Measured on the shaped network at each world size the model is checked at:", "",
        *network_table(doc["network_by_world"], doc["small_message_bytes"]), "",
        "## Scaling model against measurement", "",
        *model_lines(model), "",
        "## Scaling model against the paper", "", *doc["paper"], "",
        "![speedup against GPU count](scaling.png)", "",
        "## Dashboards", "",
        "Every run above is one wandb run (offline), named by strategy and grouped as "
        f"`{doc['group']}`. Upload them with `WANDB_RESUME=allow wandb sync "
        "results/runs/reproduce/*/seed*/wandb/offline-run-*` (the resume setting appends the pieces of a resumed "
        f"run to one run), then `python scripts/wandb_report.py --group {doc['group']}` (needs `pip install -e "
        ".[dashboards]` and a wandb login or `--entity`) saves a W&B report and a workspace view: top-1 against "
        "the MLPerf clock and against epochs with each strategy's seeds grouped (mean and range), time to target "
        "per strategy, step time and bytes per step, and the runs with this report's columns.", ""]
    return "\n".join(text)
