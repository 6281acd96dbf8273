"""results/REPORT.md from the runs of a reproduction (``reproduction.reproduce``): the comparison table,
figures, CSC against PyTorch's PowerSGD and fp16 hooks and against the paper's stack as published
(``peers_section``), the scaling model against measurement and against the paper.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

from gradientflow_repro.comm import knobs, registry
from gradientflow_repro.reproduction.runs import (
    compression_label,
    compute_only_s,
    dense_warmup_epochs,
    epochs_to_target,
    evaluations,
    falls,
    is_dense,
    largest_fall,
    last_evaluation,
    median_step,
    reached,
    run_knobs,
    run_row,
    run_target,
    run_warmup_epochs,
    sends_trust_sketches,
    sparsification,
    trained_whole_schedule,
)
from gradientflow_repro.scaling import perfmodel as pm
from gradientflow_repro.scaling.netbench import priced_network
from gradientflow_repro.scaling.profile import profile_from_json
from gradientflow_repro.scaling.projection import GPU_COUNTS, paper_check, plot


def spread(values: list[Optional[float]], fmt: str, scale: float = 1.0) -> str:
    """Median [min-max] of the known values in ``fmt``, and how many are unknown (not reached)."""
    known = [v * scale for v in values if v is not None]
    if not known:
        return "not reached"
    text = f"{statistics.median(known):{fmt}}"
    if len(known) > 1:
        text += f" [{min(known):{fmt}}-{max(known):{fmt}}]"
    if len(known) < len(values):
        text += f" ({len(values) - len(known)} of {len(values)} not reached)"
    return text


def _median(values: list[Optional[float]]) -> Optional[float]:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _at_target(run: dict, clock: str) -> Optional[float]:
    """A clock's reading (or the step) when the run first reached its target (``runs.reached``: where
    it stopped at it, or its first evaluation at or above it; None: never reached)."""
    at = reached(run)
    return None if at is None else at.get(clock)


def _step_to_target_s(run: dict) -> Optional[float]:
    """Mean training step up to the target (a sparse run's dense warm-up included)."""
    train_s, steps = _at_target(run, "train_s"), _at_target(run, "step")
    return None if train_s is None or not steps else train_s / steps


def comparison_table(runs: dict[str, list[dict]]) -> list[str]:
    first = next(iter(runs))
    baseline = _median([_at_target(r, "mlperf_s") for r in runs[first]])
    lines = ["| strategy | time to target, MLPerf clock (s) | epochs to target | top-1 at the last evaluation (%) "
             "| images/s "
             "| MB sent per rank per step | s waited in synchronize per step | speedup over "
             f"{first} (MLPerf clock) |", "|---|---|---|---|---|---|---|---|"]
    for label, items in runs.items():
        s = [r["summary"] for r in items]
        mine = _median([_at_target(r, "mlperf_s") for r in items])
        speed = f"{baseline / mine:.2f}x" if baseline and mine else "-"
        lines.append(" | ".join([
            f"| {label}", spread([_at_target(r, "mlperf_s") for r in items], ".1f"),
            spread([epochs_to_target(r) for r in items], ".0f"), spread([x["final_top1"] for x in s], ".2f"),
            spread([x["images_per_s"] for x in s], ".0f"), spread([x["bytes_per_step"] for x in s], ".3f", 1e-6),
            spread([x["sync_wait_s_per_step"] for x in s], ".4f"), speed]) + " |")
    return lines


def clock_table(runs: dict[str, list[dict]]) -> list[str]:
    """MLPerf's clock up to the target, split: start-up, training, evaluation, the rest; and the
    initialisation before the clock."""
    lines = ["| strategy | start-up (s) | training (s) | evaluation (s) | other (s) | MLPerf clock to target (s) "
             "| initialisation before the clock (s) |", "|---|---|---|---|---|---|---|"]
    for label, items in runs.items():
        parts = {clock: [_at_target(r, clock) for r in items]
                 for clock in ("startup_s", "train_s", "eval_s", "mlperf_s")}
        parts["init_s"] = [(r["summary"].get("clocks") or {}).get("init_s") for r in items]  # reached or not
        other = [m - (a or 0) - (t or 0) - (e or 0) if m is not None else None
                 for m, a, t, e in zip(parts["mlperf_s"], parts["startup_s"], parts["train_s"], parts["eval_s"])]
        lines.append(" | ".join([f"| {label}", *(spread(parts[c], ".1f") for c in ("startup_s", "train_s", "eval_s")),
                                 spread(other, ".1f"), spread(parts["mlperf_s"], ".1f"),
                                 spread(parts["init_s"], ".1f")]) + " |")
    return lines


def decomposition(runs: dict[str, list[dict]], reference: str) -> dict[str, dict[str, float]]:
    """Per strategy, from medians over the seeds: time-to-target ratio against ``reference`` =
    step-time ratio x epochs-to-target ratio x overhead (start-up, evaluation and the rest: the
    part of the ratio the training steps do not explain)."""
    def medians(items: list[dict]) -> dict[str, Optional[float]]:
        return {"time": _median([_at_target(r, "mlperf_s") for r in items]),
                "step": _median([_step_to_target_s(r) for r in items]),
                "epochs": _median([epochs_to_target(r) for r in items])}

    ref, ratios = medians(runs[reference]), {}
    for label, items in runs.items():
        mine = medians(items)
        if None in mine.values() or None in ref.values():
            continue
        time, step, epochs = mine["time"] / ref["time"], mine["step"] / ref["step"], mine["epochs"] / ref["epochs"]
        ratios[label] = {"time": time, "step": step, "epochs": epochs, "overhead": time / (step * epochs)}
    return ratios


def decomposition_table(runs: dict[str, list[dict]], reference: str) -> list[str]:
    lines = [f"| strategy | time to target / {reference}'s | = step time ratio | x epochs to target ratio "
             "| x overhead (start-up, evaluation, rest) | seeds that reached the target |", "|---|---|---|---|---|---|"]
    ratios = decomposition(runs, reference)
    for label, items in runs.items():
        reached = f"{sum(epochs_to_target(r) is not None for r in items)} of {len(items)}"
        if label in ratios:
            cells = " | ".join(f"{ratios[label][key]:.2f}x" for key in ("time", "step", "epochs", "overhead"))
            lines.append(f"| {label} | {cells} | {reached} |")
        else:
            lines.append(f"| {label} | not reached{'' if label != reference else ' (the reference)'} | - | - | - "
                         f"| {reached} |")
    return lines


def _known_spread(values: list[Optional[float]], fmt: str) -> str:
    """``spread`` of the known values ("-": none): for figures every finished run has, where a gap
    means a run without evaluations, not a target missed."""
    known = [v for v in values if v is not None]
    return spread(known, fmt) if known else "-"


def _schedule_s(run: dict) -> Optional[float]:
    """MLPerf's clock at the run's last evaluation: the time to finish its schedule."""
    last = last_evaluation(run)
    return None if last is None else last.get("mlperf_s")


def final_gaps(items: list[dict], reference: list[dict]) -> str:
    """Each run's top-1 at the end less that of the ``reference`` run of the same seed (the same
    initial weights and data order), seed by seed: "seed 0 +0.12, seed 1 -0.30"."""
    theirs = _by_seed(reference)
    cells = []
    for run in items:
        other = theirs.get(run_seed(run))
        mine = run["summary"].get("final_top1")
        gap = None if other is None or mine is None or other["summary"].get("final_top1") is None \
            else mine - other["summary"]["final_top1"]
        cells.append(f"seed {run_seed(run)} " + ("-" if gap is None else f"{gap:+.2f}"))
    return ", ".join(cells)


def schedule_table(runs: dict[str, list[dict]], reference: str) -> list[str]:
    """The paper's criterion, per strategy: the time to finish the fixed schedule (MLPerf's clock at
    the last evaluation), top-1 there, that less the same seed's ``reference`` run's, and the largest
    fall of top-1 between consecutive evaluations after the learning-rate warm-up."""
    lines = ["| strategy | time to finish the schedule, MLPerf clock (s) | top-1 at the end (%) "
             f"| top-1 at the end - `{reference}`'s, same seed (points) | largest fall after the warm-up (points) |",
             "|---|---|---|---|---|"]
    for label, items in runs.items():
        gaps = "- (the reference)" if label == reference else final_gaps(items, runs[reference])
        lines.append(" | ".join([
            f"| {label}", _known_spread([_schedule_s(r) for r in items], ".1f"),
            _known_spread([r["summary"].get("final_top1") for r in items], ".2f"), gaps,
            _known_spread([largest_fall(r) for r in items], ".1f")]) + " |")
    return lines


def _schedule_section(runs: dict[str, list[dict]]) -> list[str]:
    """The paper's criterion from the same runs as MLPerf's, when they trained the whole schedule;
    one line saying where it is when they stopped at the target (reproductions from before)."""
    heading = ["## The paper's criterion: the fixed schedule", ""]
    every = [run for items in runs.values() for run in items]
    if not all(trained_whole_schedule(run) for run in every):
        return [*heading, "These runs stopped at the target, so they cannot say how long the whole schedule "
                "takes or where top-1 ends: `make convergence` trains it (`results/convergence.md`)."]
    reference = _reference(runs)
    config = every[0].get("config") or {}
    return [*heading, *schedule_table(runs, reference), "", *_final_gap_goal(runs, reference),
            f"The paper's criterion, from the same runs as MLPerf's above: every configuration trains the "
            f"experiment's whole schedule ({config.get('epochs', '?')} epochs), never stopped at the target. "
            "Time to finish it: MLPerf's clock at the last evaluation (median [range] over the seeds). Top-1 at "
            f"the end: at that evaluation, and less that of `{reference}`'s run of the same seed (the same initial "
            "weights and data order), seed by seed. Largest fall: the most top-1 dropped from one evaluation to "
            f"the next after the learning-rate warm-up ({run_warmup_epochs(every[0]):g} epochs; 0: it never fell)."]


def sparsification_table(runs: dict[str, list[dict]]) -> list[str]:
    """Per sparse strategy that logged it (``runs.sparsification``), medians over the seeds: the
    steps between two sends of a layer's chunks (the layers' range and the slowest layer), the share of
    the chunks' momentum that masking erased, the bytes each rank sent per step after the warm-up."""
    lines = ["| strategy | steps between sends of a layer's chunks (layers' range) | layer sent least often "
             "| momentum erased by masking | MB per rank per step after the warm-up |", "|---|---|---|---|---|"]
    for label, items in runs.items():
        found = [s for s in (sparsification(r) for r in items) if s is not None]
        if not found:
            continue
        layers = sorted({layer for s in found for layer in s["intervals"]})
        median_of = {layer: statistics.median(s["intervals"][layer] for s in found if layer in s["intervals"])
                     for layer in layers}
        slowest = max(layers, key=lambda layer: median_of[layer])
        shares = [s["masked_share"] for s in found if s["masked_share"] is not None]
        lines.append(" | ".join([
            f"| {label}", f"{min(median_of.values()):g}-{max(median_of.values()):g}",
            f"`{slowest}` ({median_of[slowest]:g})", f"{statistics.median(shares):.0%}" if shares else "- (none)",
            f"{statistics.median(s['bytes_per_step'] for s in found) / 1e6:.3f}"]) + " |")
    return lines if len(lines) > 2 else []


def sparsification_section(runs: dict[str, list[dict]]) -> list[str]:
    """What sparse communication did in these runs, or nothing where no run logged it."""
    table = sparsification_table(runs)
    if not table:
        return []
    return ["### What sparsification did", "", *table, "",
            "From every progress record of the sparse phase (`metrics.jsonl`: `csc_send_interval_median` per "
            "layer, `csc_masked_momentum_share`, `bytes_per_step`), medians over the records and then the seeds. "
            "A chunk sent every k steps under momentum factor masking keeps 1 - m(1 - m^k)/((1 - m)k) of its "
            "momentum's gain (0.41 at k = 10, m = 0.9); the share here is of the velocity's L1 norm erased per "
            "step.", ""]


def _final_gap_goal(runs: dict[str, list[dict]], reference: str) -> list[str]:
    """The goal on the paper's criterion: in every seed, ``gradientflow``'s top-1 at the end at most
    ``FINAL_GAP_GOAL`` points below the same seed's ``reference`` run, or the reference seeds' own spread
    if that is larger; one line, met or NOT met."""
    if "gradientflow" not in runs or reference == "gradientflow":
        return []
    ends = [r["summary"].get("final_top1") for r in runs[reference]]
    spread_points = max(ends) - min(ends) if ends and None not in ends else 0.0
    allowed = max(FINAL_GAP_GOAL, spread_points)
    theirs = _by_seed(runs[reference])
    gaps = [(run_seed(r), r["summary"].get("final_top1") - theirs[run_seed(r)]["summary"].get("final_top1"))
            for r in runs["gradientflow"] if run_seed(r) in theirs]
    met = bool(gaps) and all(gap >= -allowed for _, gap in gaps)
    return [f"Goal: in every seed `gradientflow`'s top-1 at the end at most {FINAL_GAP_GOAL:g} points below the same "
            f"seed's `{reference}` run, or the `{reference}` seeds' own spread ({spread_points:.2f} points) if larger: "
            + ", ".join(f"seed {seed} {gap:+.2f}" for seed, gap in gaps) + f": {'met' if met else 'NOT met'}.", ""]


def falls_after_warmup(runs: dict[str, list[dict]], warmup_epochs: Optional[float] = None,
                       drop_points: float = 5.0) -> list[str]:
    """Evaluations after the learning-rate warm-up (``warmup_epochs``, else each run's own) that fall
    more than ``drop_points`` below the previous one, as ``label seed: epoch a -> b: x% -> y%``."""
    return [f"{label} seed {run_seed(run)}: epoch {e0:.0f} -> {e1:.0f}: {a0:.1f}% -> {a1:.1f}%"
            for label, items in runs.items() for run in items
            for e0, a0, e1, a1 in falls(run, warmup_epochs) if a1 < a0 - drop_points]


def run_seed(run: dict) -> Union[int, str]:
    """The run's seed ("?" when its configuration is unknown)."""
    return (run.get("config") or {}).get("seed", "?")


def density_label(run: dict) -> str:
    """"1 (dense)", the density a sparse run sends at, or a low-rank run's rank (``runs.compression_label``)."""
    return compression_label(run)


def dense_agreement(runs: dict[str, list[dict]]) -> dict[Union[int, str], list[Optional[float]]]:
    """Per seed, the epochs to target of every dense strategy (the same SGD: they should agree)."""
    by_seed: dict[Union[int, str], list[Optional[float]]] = {}
    for items in runs.values():
        for run in items:
            if is_dense(run):
                by_seed.setdefault(run_seed(run), []).append(epochs_to_target(run))
    return by_seed


def sparse_epochs_to_target(run: dict) -> Optional[float]:
    """Of a run's epochs to target, those after its dense warm-up (None: target never reached)."""
    epochs = epochs_to_target(run)
    return None if epochs is None else max(0.0, epochs - dense_warmup_epochs(run))


def convergence_table(runs: dict[str, list[dict]]) -> tuple[list[str], float]:
    """Accuracy per epoch: epochs to target (for a sparse strategy, how many of them it sent sparsely,
    after its dense warm-up), and top-1 at the largest epoch every run was evaluated at (where runs
    stop at the target, that is where they can all be compared; else the end of the schedule)."""
    budget = min((max((epoch for epoch, _ in evaluations(r)), default=0.0) for items in runs.values() for r in items),
                 default=0.0)
    lines = [f"| strategy | density | epochs to target | of them sparse | top-1 at epoch {budget:.0f} (%) "
             "| best top-1 (%) |", "|---|---|---|---|---|---|"]
    for label, items in runs.items():
        density = density_label(items[0])
        at_budget = [next((a for e, a in evaluations(r) if abs(e - budget) < 1e-6), None) for r in items]
        sparse = "-" if is_dense(items[0]) else spread([sparse_epochs_to_target(r) for r in items], "g")
        lines.append(f"| {label} | {density} | {spread([epochs_to_target(r) for r in items], '.0f')} | {sparse} "
                     f"| {spread(at_budget, '.1f')} | {spread([r['summary']['best_top1'] for r in items], '.1f')} |")
    return lines, budget


def plot_top1(runs: dict[str, list[dict]], path: Path, x: str = "mlperf_s",
              targets: Optional[Sequence[float]] = None) -> None:
    """Validation top-1 against the MLPerf clock (``x="mlperf_s"``) or against epochs (``"epoch"``),
    with ``targets`` as lines (default: the target the runs stopped at, if any)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for index, (label, items) in enumerate(runs.items()):
        for repeat, run in enumerate(items):
            evals = [r for r in run["records"] if r["kind"] == "eval"]
            # the colour cycle has ten colours: past them, the line's style tells configurations apart
            ax.plot([r[x] for r in evals], [r["top1"] for r in evals], color=f"C{index % 10}",
                    linestyle=("-", "--", ":")[index // 10 % 3], alpha=1.0 if repeat == 0 else 0.35,
                    marker="o" if repeat == 0 else None, markersize=3,
                    label=label if repeat == 0 else None)
    if targets is None:
        target = run_target(next(iter(runs.values()))[0])
        targets = [target] if target else []
    for index, target in enumerate(targets):
        ax.axhline(target, color="grey", linestyle="--" if index == 0 else ":", linewidth=1,
                   label=f"target {target:g}%")
    ax.set_xlabel("wall-clock seconds (MLPerf clock)" if x == "mlperf_s" else "epochs")
    ax.set_ylabel("validation top-1 (%)")
    ax.set_title(f"Validation top-1 against {'time' if x == 'mlperf_s' else 'epochs'} (faint: other seeds)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_step_split(checks: dict[str, dict], path: Path, world: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(checks)
    comm = [checks[k]["sync_wait_s"] * 1e3 for k in labels]
    compute = [max(0.0, checks[k]["step_s"] * 1e3 - c) for k, c in zip(labels, comm)]
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar(labels, compute, label="compute (and hidden communication)")
    ax.bar(labels, comm, bottom=compute, label="waiting for communication")
    for label, bar in zip(labels, bars):
        if label == "ddp":  # DDP waits for its buckets inside backward: not separable from compute
            bar.set_hatch("//")
            ax.annotate("waits inside\nbackward", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=7)
    ax.set_ylabel("ms per step")
    ax.set_title(f"Time per step, world size {world}")
    ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _size(nbytes: float) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"


def _network_table(network_by_world: dict[int, dict]) -> list[str]:
    lines = ["| world | ring: bandwidth (MB/s) | ring: latency per message (us) | one-value allreduce (ms) "
             "| recursive doubling up to |", "|---|---|---|---|---|"]
    for world, measured in sorted(network_by_world.items()):
        switch = measured.get("small_message_kb")
        lines.append(f"| {world} | {measured['bandwidth_Bps'] / 1e6:.1f} | {measured['latency_s'] * 1e6:.0f} "
                     f"| {measured.get('tiny_allreduce_s', float('nan')) * 1e3:.2f} "
                     f"| {_size(switch * 1024) if switch else _size(knobs.SMALL_MESSAGE_BYTES) + ' (default)'} |")
    lines += ["", "Ring: latency from a one-element-per-rank ring allreduce over its 2(N-1) messages, bandwidth "
              "from an 8 MiB one. The one-value allreduce is the fp16 wire's shared scale (recursive doubling) "
              "before each message the ring carries (small messages carry their own scale); "
              "CSC's chunk norms (one value per chunk, with the fp16 peak) go by recursive doubling too, priced "
              "at log2(N) steps of the ring's latency. Recursive doubling up to: the largest message our "
              "algorithms send by recursive doubling rather than the ring at that world size "
              "(`comm.small_message_kb`), where the model prices the two equal on the figures measured there "
              f"(`netbench.small_message_kb`), at most the default, {_size(knobs.SMALL_MESSAGE_BYTES)} "
              "(measured on loopback)."]
    worlds = [w for w, m in sorted(network_by_world.items()) if m.get("builtin_cost_by_size")]
    if worlds:
        costs = {w: dict((size, s) for size, s in network_by_world[w]["builtin_cost_by_size"]) for w in worlds}
        sizes = sorted({size for w in worlds for size in costs[w] if size > 4 * w})
        lines += ["", "The backend's own allreduce (gloo's, used by `allreduce` and `ddp`), ms per call by message "
                  "size, calls back to back as a training step issues them (the first row: one element per "
                  "rank); the model interpolates between these sizes:", "",
                  "| size | " + " | ".join(f"world {w}" for w in worlds) + " |", "|---|" + "---|" * len(worlds),
                  "| 1 element per rank | "
                  + " | ".join(f"{min(costs[w].items())[1] * 1e3:.2f}" for w in worlds) + " |"]
        lines += [f"| {_size(size)} | " + " | ".join(f"{costs[w][size] * 1e3:.2f}" if size in costs[w] else "-"
                                                   for w in worlds) + " |" for size in sizes]
    launches = min(m.get("launches", 1) for m in network_by_world.values())
    return lines + ["", "Every figure is the mean over its calls without the fastest and slowest tenth (a step "
                    "pays the sum of many calls, and small calls are bimodal when ranks share cores), then the "
                    f"mean over {launches} separate launch{'es' if launches > 1 else ''} of the ranks."]


def model_check(checks: dict[int, dict[str, dict]], calibration: dict,
                network_by_world: dict[int, dict], lars: bool = True,
                unshaped: Optional[dict[int, dict[str, dict]]] = None, cores: Optional[int] = None,
                allreduce_beside: Optional[dict[int, dict]] = None,
                short_runs: Optional[dict[int, Sequence[str]]] = None,
                global_batch: Optional[int] = None, peers: Optional[dict[int, dict[str, dict]]] = None) -> list[str]:
    """Predicted vs measured step times. The measured single-process profile is scaled, per world
    size, to the slowest rank's compute in the ``allreduce`` runs that are the strategy's reference
    (``compute_only_s``: their step less their wait, plus how much longer their slowest rank's
    forward and backward took): on a shared CPU the ranks slow each other, and every collective
    after backward waits for the last of them. That compute and its spread are all the model takes
    from the runs. Forward and backward scale with the per-rank batch (``global_batch`` over the
    world size, against the profile's), the work per gradient element (optimizer, local work) only
    with the ranks slowing each other. The network is the one measured at that world size. The
    reference is ``allreduce``'s runs beside the strategy's own (``_compute_reference``:
    ``allreduce_beside``, ``short_runs``). ``lars``: the runs' Lars adapted their weight layers
    (``runs.sends_trust_sketches``); ``unshaped``: step times with the links unshaped, by world
    size (``_hidden_communication``); ``cores``: the machine's. ``peers``: by world size, the measured
    steps of configurations outside the ladder (``knobs.PEERS``, from their runs to the target after
    their dense warm-up), shown below the ladder's where the model prices them and left out of the
    goal, which is the ladder's."""
    allreduce_beside, short_runs, peers = allreduce_beside or {}, short_runs or {}, peers or {}
    profile = profile_from_json(calibration["profile"])
    profiled_batch = calibration["profile"].get("batch")  # (not in profiles from before it was written)
    lines = ["| world | strategy | measured step (ms) | predicted step (ms) | predicted comm exposed (ms) | error |",
             "|---|---|---|---|---|---|"]
    errors = []
    for world, by_label in sorted(checks.items()):
        if "allreduce" not in by_label:
            continue
        net = priced_network(network_by_world[world])
        switch = network_by_world[world].get("small_message_kb")  # the runs' (none before it was measured)
        strategies = {label: pm.Strategy.from_knobs(label, knobs.resolve(knobs.on_network(options, switch)), lars=lars)
                      for label, options in knobs.LADDER.items()}
        batch = (global_batch // world) / profiled_batch if global_batch and profiled_batch else 1.0
        rows = [(label, label, step, _compute_reference(world, label, by_label, allreduce_beside, short_runs))
                for label, step in by_label.items()]
        if world in allreduce_beside:  # allreduce's short runs beside the sparse rungs' check it too
            rows.append(("allreduce", "allreduce (short runs)", allreduce_beside[world], allreduce_beside[world]))
        ladder_rows, unpriced = len(rows), []
        for label, step in peers.get(world, {}).items():  # set against allreduce's runs to the target, as they are
            try:
                strategies[label] = pm.Strategy.from_knobs(
                    label, knobs.resolve(knobs.on_network(knobs.COMPARED[label], switch)), lars=lars)
            except ValueError as error:  # a pricing rule the model does not know: said, not guessed
                unpriced.append(f"| {world} | {label} (not in the goal) | {step['step_s'] * 1e3:.1f} | - | - "
                                f"| not priced: {error} |")
                continue
            rows.append((label, f"{label} (not in the goal)", step, by_label["allreduce"]))
        for index, (label, shown, measured, reference) in enumerate(rows):
            # its compute = (forward + backward) x contention x batch + optimizer x contention
            contention = compute_only_s(reference, slowest=True) / (
                (profile.forward_s + profile.backward_s) * batch + profile.optimizer_s)
            predicted = pm.predict_step(profile.scaled(contention * batch, contention), world, net, strategies[label])
            error = predicted.step_s / measured["step_s"] - 1
            if index < ladder_rows:
                errors.append(abs(error))
            each = measured.get("step_s_each") or [measured["step_s"]]
            lines.append(f"| {world} | {shown} | {spread(each, '.1f', 1e3)} | {predicted.step_s * 1e3:.1f} "
                         f"| {predicted.exposed_comm_s * 1e3:.1f} | {error * 100:+.0f}% |")
        lines += unpriced
    if errors:
        within = sum(e <= 0.15 for e in errors)
        lines += ["", f"Goal: within 15%. {within} of {len(errors)} predictions are; the largest error is "
                  f"{max(errors) * 100:.0f}%."]
    return (lines + _hidden_communication(checks, unshaped or {}, cores, allreduce_beside, short_runs)
            + _per_tensor_alone(profile, network_by_world))


def _global_batch(runs: dict[str, list[dict]]) -> Optional[int]:
    """The ladder's global batch, from its first run's saved configuration (every run has the same)."""
    return (next(iter(runs.values()))[0].get("config") or {}).get("global_batch_size")


def _optimizer_note(profile: dict) -> str:
    """The optimizer's step as the profile measured it, whole and plain (``profile.measure_optimizer_s``)."""
    if profile.get("plain_optimizer_s") is None:  # (a profile from before it was measured)
        return ""
    return (f" The optimizer's step, measured there too: {profile['optimizer_s'] * 1e3:.2f} ms, and "
            f"{profile['plain_optimizer_s'] * 1e3:.2f} ms as plain SGD, as it runs while CSC's momentum correction "
            "does its momentum, weight decay and adaptation (that work is in CSC's figure above).")


def _compute_reference(world: int, label: str, by_label: dict[str, dict], allreduce_beside: dict[int, dict],
                       short_runs: dict[int, Sequence[str]]) -> dict:
    """The ``allreduce`` step that ``label``'s at ``world`` is set against: ``allreduce``'s short runs
    beside those of a rung with short runs at the ladder's world size (``short_runs[world]``; a
    reproduction from before there were any set them against the runs to the target), else
    ``by_label``'s, of the same kind as ``label``'s and side by side (runs to the target, or at the
    other world sizes short runs of every strategy)."""
    if label in short_runs.get(world, ()) and world in allreduce_beside:
        return allreduce_beside[world]
    return by_label["allreduce"]


def _hidden_communication(checks: dict[int, dict[str, dict]], unshaped: dict[int, dict[str, dict]],
                          cores: Optional[int] = None, allreduce_beside: Optional[dict[int, dict]] = None,
                          short_runs: Optional[dict[int, Sequence[str]]] = None) -> list[str]:
    """How close the full stack comes to hiding all communication: its step over the compute-only
    step (``compute_only_s`` of the ``allreduce`` runs beside it, ``_compute_reference``), and where
    measured, the same step with the links unshaped: no wire time, so what remains over the
    compute-only step is CSC's local work, latency and the ranks waiting for each other, which no
    overlap of communication with backward can hide. Both over the same compute-only step, so the
    link's part is the difference of ``gradientflow``'s own steps; ``allreduce``'s unshaped beside
    them (where measured) shows how far the machine's speed moved between the two sets of runs."""
    allreduce_beside, short_runs = allreduce_beside or {}, short_runs or {}
    lines = []
    for world, by_label in sorted(checks.items()):
        if "allreduce" not in by_label or "gradientflow" not in by_label:
            continue
        base = _compute_reference(world, "gradientflow", by_label, allreduce_beside, short_runs)
        compute = compute_only_s(base)
        ratio = by_label["gradientflow"]["step_s"] / compute
        runs = ("in its runs to the target" if "gradientflow" in short_runs.get(world, ())
                and world not in allreduce_beside else "in runs beside `gradientflow`'s")
        lines.append(f"- world size {world}: `gradientflow`'s step is {ratio:.2f}x the compute-only step "
                     f"({compute * 1e3:.1f} ms: `allreduce`'s step less its wait, {runs}; 1.0 would hide all "
                     f"communication behind backward). Goal at most 1.2x: {'met' if ratio <= 1.2 else 'NOT met'}.")
        behind = [(name, step["behind_slowest_s"]) for name, step in
                  (("`allreduce`'s", base), ("`gradientflow`'s", by_label["gradientflow"]))
                  if "behind_slowest_s" in step]
        if behind:
            lines.append("  The slowest rank's forward and backward took " + " and ".join(
                f"{seconds * 1e3:.1f} ms" for _, seconds in behind) + " longer than rank 0's per step (median; "
                "in " + " and ".join(name for name, _ in behind) + " runs): what the first collective after "
                "backward waits before anything moves (the model above adds `allreduce`'s).")
        free = unshaped.get(world, {}).get("gradientflow")
        if free:
            crowded = (f" With {world} ranks on {cores} cores they finish backward at different times, and "
                       "that wait is in `allreduce`'s wait, so the compute-only figure leaves it out."
                       if cores and cores < world else "")
            free_base = unshaped[world].get("allreduce")
            drift = (f" (`allreduce`'s compute-only step in the unshaped runs beside them: "
                     f"{compute_only_s(free_base) * 1e3:.1f} ms, against {compute * 1e3:.1f}: how far this machine's "
                     "speed moved between the two sets of runs)" if free_base else "")
            lines.append(f"  With the links unshaped (no rate limit; {len(free['step_s_each'])} short runs, the same "
                         f"settings): {free['step_s'] * 1e3:.1f} ms, {free['step_s'] / compute:.2f}x the compute-only "
                         f"step{drift}, so the link's rate accounts for {ratio - free['step_s'] / compute:+.2f}x. The "
                         "rest is no transfer that overlap could hide better: CSC's local work, the collectives' "
                         "latency and copies on the unshaped links, and the ranks waiting for each other at the first "
                         f"collective after backward.{crowded}")
    return ["", *lines] if lines else []


def _per_tensor_alone(profile: pm.ModelProfile, network_by_world: dict[int, dict]) -> list[str]:
    """The model against one allreduce per gradient measured alone on the same network: where a
    per-tensor strategy's step time is missed, this says whether the network's description is at
    fault (missed here too) or the training around the communication (not missed here)."""
    rows = []
    for world, measured in sorted(network_by_world.items()):
        if measured.get("per_tensor_builtin_s") is None:
            continue
        net = priced_network(measured)
        cells = []
        # our algorithms where they are asked for (as measured: ``implementation`` "ours")
        for key, strategy in (("per_tensor_builtin_s", pm.strategy_of("allreduce")),
                              ("per_tensor_ring_s", replace(pm.strategy_of("ring"), implementation="ours")),
                              ("per_tensor_ring_fp16_s", replace(pm.strategy_of(registry.RING_FP16),
                                                                 implementation="ours"))):
            model = pm.predict_step(profile, world, net, strategy).comm_s
            cells.append(f"{measured[key] * 1e3:.1f} | {model * 1e3:.1f} ({model / measured[key] - 1:+.0%})"
                         if measured.get(key) else "- | -")
        rows.append(f"| {world} | {' | '.join(cells)} |")
    if not rows:
        return []
    return ["", "One allreduce per gradient of this model (in backward order; with the fp16 wire, a large "
            "gradient's one-value scale allreduce first, a small one's scale inside its message), back to "
            "back and alone on the network, against the model's communication time for the same messages:", "",
            "| world | builtin: measured (ms) | builtin: model (ms) | ring: measured (ms) | ring: model (ms) "
            "| ring+fp16: measured (ms) | ring+fp16: model (ms) |", "|---|---|---|---|---|---|---|", *rows]


def _reference(runs: dict[str, list[dict]]) -> str:
    return "ddp" if "ddp" in runs else next(iter(runs))


def _decomposition_section(runs: dict[str, list[dict]], ladder_checks: Optional[dict[str, dict]] = None) -> list[str]:
    reference = _reference(runs)
    lines = [f"### Time to target against `{reference}`'s, decomposed (below 1: faster)", "",
             *decomposition_table(runs, reference), "",
             "Each ratio is of the medians over the seeds that reached the target. Step time: training seconds "
             "to the target over its steps (a sparse strategy's dense warm-up included); overhead: what the two "
             "do not explain (start-up, evaluation, the rest, and the medians coming from different seeds; the "
             "same order of seconds for every strategy, so it pulls every ratio towards 1). Epochs are counted "
             "at evaluations, one per epoch: at 2 epochs to target one evaluation is 50%."]
    ratios = decomposition(runs, reference).get("gradientflow")
    if ratios and reference != "gradientflow":
        lines += ["", f"Goal: `gradientflow`'s time to target at most {TIME_GOAL:g}x `{reference}`'s (median): "
                  f"{ratios['time']:.2f}x = {ratios['step']:.2f}x (step time) x {ratios['epochs']:.2f}x (epochs) x "
                  f"{ratios['overhead']:.2f}x (overhead): {'met' if ratios['time'] <= TIME_GOAL else 'NOT met'}."]
        lines += _step_floor(ladder_checks or {}, reference, ratios)
    return lines


def _step_floor(checks: dict[str, dict], reference: str, ratios: dict[str, float]) -> list[str]:
    """What the time ratio would be with all communication hidden and no epoch lost: no step is
    shorter than the compute-only step (``allreduce``'s less its wait in ``synchronize()``)."""
    if "allreduce" not in checks or reference not in checks:
        return []
    compute = compute_only_s(checks["allreduce"])
    floor = compute / checks[reference]["step_s"]
    return [f"The floor under it: no step is shorter than the compute-only step ({compute * 1e3:.1f} ms, "
            f"`allreduce`'s step less its wait, in the same runs), {floor:.2f}x `{reference}`'s step "
            f"({checks[reference]['step_s'] * 1e3:.1f} ms). With all communication hidden behind backward, "
            f"no epoch lost to sparse communication and the same overhead, the ratio would be "
            f"{floor:.2f}x x {ratios['overhead']:.2f}x = {floor * ratios['overhead']:.2f}x."]


# The configurations the peers' section compares: CSC (our full stack), what researchers would use
# instead (PyTorch's own DDP hooks), the paper's stack as published, and plain DDP (the goals' reference)
CSC = "gradientflow"
POWERSGD = "powersgd"
DDP_FP16 = "ddp-fp16"
PAPER_STACK = "gradientflow-paper"
DDP = "ddp"
FINAL_TOP1_POINTS = 0.5  # "at equal final top-1": at most this many points below
TIME_GOAL = 0.6  # gradientflow's time to target over ddp's, median over the seeds, at most this
FINAL_GAP_GOAL = 0.3  # gradientflow's top-1 at the end at most this far below the same seed's dense run's
# (or the dense seeds' own spread, if larger)
LARGE_FALL_POINTS = 5.0  # a fall after the warm-up larger than this makes a recipe unstable


def _by_seed(items: list[dict]) -> dict[Union[int, str], dict]:
    return {run_seed(run): run for run in items}


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
        options = knobs.resolve(knobs.COMPARED[label])
        strategy = pm.Strategy.from_knobs(label, options)
    except (KeyError, ValueError):
        return None
    needs = {"csc": "sparsify_s_per_element", "chunks": "sparsify_s_per_element",
             "low_rank": "low_rank_s_per_element"}.get(registry.sparsifier(options.sparsity).pricing)
    if (needs and not measured.get(needs)) or (options.wire == "fp16" and not measured.get("wire_cast_s_per_element")):
        return None
    profile = profile_from_json(measured)
    return sum(message.local_work_s for message in pm.messages(profile, strategy))


def _convergence_medians(rows: list[dict], label: str) -> dict[str, Optional[float]]:
    """Medians over ``label``'s rows of ``make convergence`` (``runs.read_runs_csv``): top-1 at the end,
    epochs to target, largest fall after the warm-up, and how many runs fell more than
    ``LARGE_FALL_POINTS``."""
    mine = [row for row in rows if row["strategy"] == label]
    falls_over = [row["largest_fall_after_warmup"] for row in mine if row["largest_fall_after_warmup"] is not None]
    return {"final_top1": _median([row["final_top1"] for row in mine]),
            "epochs": _median([row["epochs_to_target"] for row in mine]),
            "largest_fall": _median(falls_over), "large_falls": sum(f > LARGE_FALL_POINTS for f in falls_over),
            "runs": len(mine), "reached": sum(bool(row["reached_target"]) for row in mine)}


def _seed_final_gaps(rows: list[dict], label: str, other: str) -> list[float]:
    """``label``'s top-1 at the end less ``other``'s, seed by seed (``make convergence``'s rows)."""
    theirs = {row["seed"]: row["final_top1"] for row in rows if row["strategy"] == other}
    return [row["final_top1"] - theirs[row["seed"]] for row in rows if row["strategy"] == label
            and row["final_top1"] is not None and theirs.get(row["seed"]) is not None]


def peers_section(runs: dict[str, list[dict]], calibration: dict, convergence_rows: Sequence[dict] = (),
                  projection: Optional[dict[str, list[float]]] = None,
                  projection_counts: Sequence[int] = (), convergence_source: str = "`results/runs.csv`") -> list[str]:
    """Where CSC (``gradientflow``) stands against what researchers would use instead, PyTorch's
    PowerSGD (``powersgd``) and fp16 (``ddp-fp16``) hooks, with plain ``ddp`` and the paper's stack
    as published (``gradientflow-paper``), all from the numbers: time to target (MLPerf clock, median
    over the seeds), epochs to target, step and bytes per step after the dense warm-up (from the runs
    to the target), local work per step (``local_work_s``), top-1 at the end of ``make convergence``
    (its rows of ``results/runs.csv``, ``convergence_rows``; where there are none, where to look) and
    the model's speedup at 512 GPUs (``projection``: label -> speedups at ``projection_counts``). Then
    the goals, each met or NOT met, and what our additions to the paper's stack buy. Nothing when
    ``gradientflow`` or every peer is missing."""
    shown = [label for label in (CSC, POWERSGD, DDP_FP16, DDP, PAPER_STACK) if label in runs]
    peers = [label for label in (POWERSGD, DDP_FP16) if label in runs]
    if CSC not in runs or not (peers or PAPER_STACK in runs):
        return []
    rows = [row for row in convergence_rows if row.get("study", "convergence") == "convergence"]
    ends_of = "`make convergence`"  # where top-1 at the end comes from
    if all(trained_whole_schedule(r) for label in shown for r in runs[label]):  # these runs: their own ends
        rows = [run_row(r, study="convergence", label=label, target=run_target(r))
                for label in shown for r in runs[label]]
        ends_of, convergence_source = "these runs", "the runs above"
    seeds = len(runs[CSC])
    time = {label: _median([_at_target(r, "mlperf_s") for r in runs[label]]) for label in shown}
    steady = {label: median_step(runs[label]) for label in shown}  # after each run's dense warm-up
    work = {label: local_work_s(label, calibration) for label in shown}
    final = {label: _convergence_medians(rows, label) for label in shown}
    gpus = pm.PAPER_GPUS
    at_scale = ({label: projection[label][list(projection_counts).index(gpus)] for label in shown
                 if label in projection} if projection and gpus in projection_counts else {})

    def epochs_cell(label: str) -> str:
        total = spread([epochs_to_target(r) for r in runs[label]], ".0f")
        if is_dense(runs[label][0]) or total == "not reached":
            return total
        return f"{total} ({spread([sparse_epochs_to_target(r) for r in runs[label]], 'g')} sparse)"

    table = ["| strategy | sends | time to target, MLPerf clock (s) | epochs to target | step after the warm-up (ms) "
             "| MB per rank per step after the warm-up | local work per step (ms) "
             f"| top-1 at the end of {ends_of} (%) | model (calibrated): speedup at {gpus} GPUs |",
             "|---|---|---|---|---|---|---|---|---|"]
    for label in shown:
        top1 = final[label]["final_top1"]
        table.append(" | ".join([
            f"| {label}", compression_label(runs[label][0]),
            spread([_at_target(r, "mlperf_s") for r in runs[label]], ".1f"), epochs_cell(label),
            f"{steady[label]['step_s'] * 1e3:.1f}", f"{steady[label]['bytes_per_step'] / 1e6:.3f}",
            "not measured" if work[label] is None else f"{work[label] * 1e3:.2f}",
            "-" if top1 is None else f"{top1:.2f}",
            f"{at_scale[label]:.1f}x" if label in at_scale else "-"]) + " |")

    said = []
    contenders = [CSC, *peers]
    reached = sorted((label for label in contenders if time[label] is not None), key=lambda label: time[label])
    if reached:
        said.append(f"Time to target (MLPerf clock, median over {seeds} seeds): "
                    + ", ".join(f"`{label}` {time[label]:.1f} s" for label in reached)
                    + "".join(f", `{label}` not reached in any seed" for label in contenders if time[label] is None)
                    + f": `{reached[0]}` reaches the target first"
                    + (f" ({time[reached[0]] / time[reached[1]]:.2f}x the next, `{reached[1]}`)." if len(reached) > 1
                       else "."))
    else:
        said.append("None of " + ", ".join(f"`{label}`" for label in contenders) + " reached the target.")
    said.append("Epochs to target (median): " + ", ".join(
        f"`{label}` {_fmt(_median([epochs_to_target(r) for r in runs[label]]), 'g')}" for label in contenders) + ".")
    said.append("Bytes per rank per step after the dense warm-up: " + ", ".join(
        f"`{label}` {steady[label]['bytes_per_step'] / 1e6:.3f} MB" for label in contenders)
        + f": fewest {_leaders(contenders, lambda label: -steady[label]['bytes_per_step'] / 1e6, '.3f')}; "
        "step time after the warm-up: " + ", ".join(
        f"`{label}` {steady[label]['step_s'] * 1e3:.1f} ms" for label in contenders)
        + f": shortest {_leaders(contenders, lambda label: -steady[label]['step_s'] * 1e3, '.1f')}.")
    measured_work = [label for label in contenders if work[label] is not None]
    if measured_work:
        said.append("Local work on the communication path per step (the model's sum over this model's gradients "
                    "of the per-element costs measured in the calibration's profile, one process): " + ", ".join(
                        f"`{label}` {work[label] * 1e3:.2f} ms" for label in measured_work)
                    + "".join(f"; `{label}`'s not measured" for label in contenders if label not in measured_work)
                    + ".")
    else:
        said.append("Local work per step: not measured (a calibration profile from before it was measured).")
    ends = [label for label in contenders if final[label]["final_top1"] is not None]
    if ends:
        commits = sorted({str(row.get("commit"))[:12] for row in rows})
        said.append(f"Top-1 at the end of {ends_of} (median over its seeds; {convergence_source}, "
                    f"trained at commit {', '.join(commits)}): " + ", ".join(
                        f"`{label}` {final[label]['final_top1']:.2f}%" for label in ends)
                    + f": highest {_leaders(ends, lambda label: final[label]['final_top1'], '.2f')}"
                    + "".join(f"; `{label}` not in it" for label in contenders if label not in ends) + ".")
    else:
        said.append("Top-1 at the end of `make convergence`: no rows of its runs in "
                    f"{convergence_source}; run `make convergence` (it writes them and `results/convergence.md`), "
                    "then `python scripts/reproduce.py --report-only`.")
    scaled = [label for label in contenders if label in at_scale]
    if scaled:
        said.append(f"The model calibrated on published results at {gpus} GPUs (the paper's setup, the "
                    "steady state after each dense warm-up, convergence not modelled: section \"Scaling model "
                    "against the paper\" below, with its band; in full: `results/scaling.md`): speedup " + ", ".join(
                        f"`{label}` {at_scale[label]:.1f}x" for label in scaled)
                    + f": highest {_leaders(scaled, lambda label: at_scale[label], '.1f')}"
                    + "".join(f"; `{label}` not projected" for label in contenders if label not in scaled) + ".")
    else:
        said.append(f"The model at {gpus} GPUs: not projected here for these strategies; see `results/scaling.md`.")

    lines = ["## Against PyTorch's PowerSGD and fp16 hooks, and the paper's stack as published", "", *table, "",
             "Step and bytes after the warm-up: the median logged interval of the runs to the target after each "
             "run's dense warm-up (a run that reached the target inside it: all its intervals), median over the "
             "seeds. Sends: the density of CSC, the rank of PowerSGD's factors, or 1 (dense).", "",
             " ".join(said), "", *_peer_goals(runs, final, time, peers, ends_of),
             *_additions(runs, rows, final, ends_of)]
    return lines


def _leaders(labels: Sequence[str], score: Callable[[str], float], fmt: str) -> str:
    """The label(s) with the highest ``score`` as shown in ``fmt`` (ties, as the reader sees them, named together)."""
    best = f"{max(score(label) for label in labels):{fmt}}"
    tied = [label for label in labels if f"{score(label):{fmt}}" == best]
    return " and ".join(f"`{label}`" for label in tied) + (" (tied)" if len(tied) > 1 else "")


def _fmt(value: Optional[float], fmt: str) -> str:
    return "not reached" if value is None else f"{value:{fmt}}"


def _peer_goals(runs: dict[str, list[dict]], final: dict[str, dict], time: dict[str, Optional[float]],
                peers: list[str], ends_of: str = "`make convergence`") -> list[str]:
    """The issue's goals against the peers and against ``ddp``, each met or NOT met from the numbers."""
    lines = []
    if peers:
        parts, met = [], True
        for peer in peers:
            ahead = time[CSC] is not None and (time[peer] is None or time[CSC] < time[peer])
            mine, theirs = final[CSC]["final_top1"], final[peer]["final_top1"]
            equal = mine is not None and theirs is not None and mine >= theirs - FINAL_TOP1_POINTS
            ratio = (f"{time[CSC] / time[peer]:.2f}x" if time[CSC] and time[peer] else
                     f"`{CSC}` not reached" if time[CSC] is None else f"`{peer}` not reached")
            top1 = (f"top-1 at the end unknown (no rows of {ends_of})" if mine is None or theirs is None
                    else f"top-1 at the end {mine - theirs:+.2f} points")
            parts.append(f"against `{peer}`: time to target {ratio} ({'ahead' if ahead else 'NOT ahead'}), {top1}")
            met = met and ahead and equal
        lines.append(f"- Goal: `{CSC}` ahead of {' and '.join(f'`{p}`' for p in peers)} on time to target (MLPerf "
                     f"clock, median over the seeds) at equal top-1 at the end of {ends_of} (at most "
                     f"{FINAL_TOP1_POINTS:g} points below): " + "; ".join(parts) + f": {'met' if met else 'NOT met'}.")
    if DDP in runs:
        lines.append(_below_ddp_goal(runs))
    return lines


def _below_ddp_goal(runs: dict[str, list[dict]]) -> str:
    """``gradientflow``'s time to target below ``ddp``'s in the median and in every seed, each ratio
    split into step time x epochs x overhead (as ``decomposition``), seed by seed on the same seed."""
    ratios = decomposition(runs, DDP).get(CSC)
    median = ("median: not reached" if ratios is None else
              f"median {ratios['time']:.2f}x = {ratios['step']:.2f}x (step) x {ratios['epochs']:.2f}x (epochs) x "
              f"{ratios['overhead']:.2f}x (overhead)")
    met = ratios is not None and ratios["time"] < 1
    theirs, seeds = _by_seed(runs[DDP]), []
    for seed, mine in _by_seed(runs[CSC]).items():
        other = theirs.get(seed)
        if other is None:
            continue
        parts = decomposition({DDP: [other], CSC: [mine]}, DDP).get(CSC)
        if parts is None:
            seeds.append(f"seed {seed}: " + ("not reached" if epochs_to_target(mine) is None
                                             else f"`{DDP}` did not reach it"))
            met = met and epochs_to_target(mine) is not None
            continue
        seeds.append(f"seed {seed}: {parts['time']:.2f}x = {parts['step']:.2f}x x {parts['epochs']:.2f}x x "
                     f"{parts['overhead']:.2f}x")
        met = met and parts["time"] < 1
    if not seeds:
        met = False
    return (f"- Goal: `{CSC}`'s time to target below `{DDP}`'s in the median and in every seed (ratio = step time "
            f"x epochs x overhead): {median}; " + "; ".join(seeds or ["no seed of both"])
            + f": {'met' if met else 'NOT met'}.")


def _additions(runs: dict[str, list[dict]], rows: list[dict], final: dict[str, dict],
               ends_of: str = "`make convergence`") -> list[str]:
    """What our additions to the paper's stack (the release cap, the trust-ratio noise correction)
    buy: ``gradientflow`` against ``gradientflow-paper`` in epochs to target, top-1 at the end of
    ``make convergence`` and falls after the warm-up."""
    if PAPER_STACK not in runs:
        return []
    ours, paper = (_median([epochs_to_target(r) for r in runs[label]]) for label in (CSC, PAPER_STACK))
    line = (f"- Our additions (release cap, trust-ratio noise correction): `{CSC}` against `{PAPER_STACK}` (the "
            f"paper's stack as published): epochs to target {_fmt(ours, 'g')} against {_fmt(paper, 'g')} (medians)")
    mine, theirs = final[CSC], final[PAPER_STACK]
    if mine["runs"] and theirs["runs"]:
        gaps = _seed_final_gaps(rows, CSC, PAPER_STACK)
        gap = (f" ({statistics.median(gaps):+.2f} points seed by seed, from {min(gaps):+.2f} to {max(gaps):+.2f})"
               if gaps else "")
        line += (f"; over the whole schedule ({ends_of}): top-1 at the end {_fmt(mine['final_top1'], '.2f')}% "
                 f"against {_fmt(theirs['final_top1'], '.2f')}%{gap}, epochs to target {_fmt(mine['epochs'], 'g')} "
                 f"against {_fmt(theirs['epochs'], 'g')}, falls of more than {LARGE_FALL_POINTS:g} points after the "
                 f"warm-up in {mine['large_falls']} of {mine['runs']} runs against {theirs['large_falls']} of "
                 f"{theirs['runs']} (largest fall, median: {_fmt(mine['largest_fall'], '.1f')} against "
                 f"{_fmt(theirs['largest_fall'], '.1f')} points)")
    else:
        line += "; over the whole schedule: `results/convergence.md` (`make convergence`)"
    return [line + "."]


def _convergence_section(runs: dict[str, list[dict]]) -> list[str]:
    table, budget = convergence_table(runs)
    first = next(iter(runs.values()))[0]
    warmup = run_warmup_epochs(first)
    every = (first.get("config") or {}).get("eval_every_epochs", 1)
    whole = all(trained_whole_schedule(r) for items in runs.values() for r in items)
    where = (f"Every run trained the whole schedule, so epoch {budget:.0f} is its end; top-1 there against the "
             "same seed's dense run and the falls after the warm-up: the paper's criterion above."
             if whole else
             f"Runs stop at the target, so epoch {budget:.0f} is the last one every run was evaluated at. Over the "
             "whole schedule, never stopped at the target (top-1 at the end, falls after the target): "
             "`make convergence`, `results/convergence.md`.")
    lines = [*table, "", where + " Same seeds for every strategy (seed = initial weights and data order)."]
    dropped = falls_after_warmup(runs)
    lines += ["", f"- Stable recipe: after the learning-rate warm-up ({warmup:g} epochs), no evaluation may fall more "
              f"than 5 points below the previous one: {len(dropped)} such fall(s)"
              + (": " + "; ".join(dropped) if dropped else "") + "."]
    agreement = dense_agreement(runs)
    spreads = {seed: (max(e) - min(e)) if None not in e else None for seed, e in sorted(agreement.items(), key=str)}
    agree = all(s is not None and s <= every for s in spreads.values())
    if agreement:
        lines.append("- Dense strategies (the same SGD) reach the target at the same epoch, within one evaluation, "
                     "in every seed: " + ", ".join(
                         f"seed {seed}: " + ("not all reached" if spread is None else f"spread {spread:.0f} epoch(s)")
                         for seed, spread in spreads.items()) + f": {'met' if agree else 'NOT met'}.")
    dense = _median([epochs_to_target(r) for items in runs.values() for r in items if is_dense(r)])
    short = []  # sparse strategies that reached the target within one sparse epoch
    for label, items in runs.items():
        if items and not is_dense(items[0]):
            epochs = [epochs_to_target(r) for r in items]
            reached = [e for e in epochs if e is not None]
            options = run_knobs(items[0])
            density = options.density
            low_rank = registry.sparsifier(options.sparsity).pricing == "low_rank"
            corrected = "" if options.momentum_correction or low_rank else ", no momentum correction"
            name = (f"`{label}` ({compression_label(items[0])})" if low_rank
                    else f"`{label}` (density {density:g}{corrected})")
            if 2 * len(reached) <= len(epochs) or dense is None:
                best = spread([r["summary"].get("best_top1") for r in items], ".1f")
                lines.append(f"- {name}: reached the target in {len(reached)} of {len(epochs)} seeds (best top-1 "
                             f"{best}%)" + (": goal NOT met." if label == "gradientflow" else "."))
                continue
            mine = statistics.median(reached)
            extra = mine / dense - 1
            goal = (f" Goal at density 0.1: within 10%: {'met' if extra <= 0.1 else 'NOT met'}."
                    if label == "gradientflow" and abs(density - 0.1) < 1e-9 else "")
            sparse = _median([sparse_epochs_to_target(r) for r in items])  # of the seeds that reached it
            lines.append(f"- {name}: {mine:g} epochs to target against {dense:g} for "
                         f"dense training (medians): {extra:+.0%}, {sparse:g} of them sparse, after "
                         f"{dense_warmup_epochs(items[0]):g} dense.{goal}")
            if sparse <= 1:
                short.append(f"`{label}`")
    if short:
        lines.append(f"- {', '.join(short)}: at most one sparse epoch before the target (median), so here epochs to "
                     "target say little about what sparse communication costs per epoch; the whole schedule is "
                     + ("in the paper's criterion above." if whole else
                        "in `results/convergence.md` (`make convergence`)."))
    return lines


def launches_note(launches: list[dict]) -> str:
    """How an interrupted reproduction was continued ('' for one launch)."""
    if len(launches) < 2:
        return ""
    parts = [f"launch {i + 1}: {launch['elapsed_s'] / 60:.1f} min"
             + (f", {launch['kept_jobs']} jobs kept from before" if i else "") for i, launch in enumerate(launches)]
    return (f", over {len(launches)} launches of the same plan, code and machine, each continuing the one before, "
            f"which had stopped early ({'; '.join(parts)}); every run was trained whole in one launch")


# Why a reproduction without `allreduce` has no step-time runs (``reproduce``) and no model check
NO_MODEL_CHECK = ("the scaling model is scaled to `allreduce`'s compute-only step (its step less its wait), and "
                  "`allreduce` was not among the configurations trained (`--rungs` adds it)")


def _model_checked(checks: dict[int, dict[str, dict]]) -> bool:
    """Whether any world size has the step times the model is checked against (`allreduce`'s among them)."""
    return any("allreduce" in by_label for by_label in checks.values())


def _runs_lines(runs: dict[str, list[dict]], experiment: str, world: int, repeats: int,
                overrides: list[str]) -> list[str]:
    """The report's lines on how the runs were trained: to the target, or over the whole schedule
    with both criteria read from them; and the configurations of ``knobs.COMPARED`` not trained."""
    first = next(iter(runs.values()))[0]
    seeds = f"(seeds 0-{repeats - 1}: initial weights and data order; median, range in brackets)"
    every = f"Overrides for every run: `{' '.join(overrides)}`."
    if not all(trained_whole_schedule(r) for items in runs.values() for r in items):
        lines = [f"- Experiment `{experiment}`, world size {world}, each configuration trained to the target once "
                 f"per seed {seeds}. {every}"]
    else:
        target = run_target(first)
        lines = [f"- Experiment `{experiment}`, world size {world}, each configuration trained over the whole "
                 f"schedule ({(first.get('config') or {}).get('epochs', '?')} epochs, `target_top1=null`) once per "
                 f"seed {seeds}. {every}",
                 "- Two criteria from the same runs: MLPerf's, time to the target ("
                 + (f"{target:g}% top-1" if target is not None else "none set") + ": MLPerf's clock at the first "
                 "evaluation at or above it; \"Time to accuracy\" below), and the paper's, the fixed schedule (the "
                 "time to finish it and top-1 at the end; \"The paper's criterion\" below)."]
    untrained = [f"`{label}`" for label in knobs.COMPARED if label not in runs]
    if untrained:
        lines.append(f"- Not trained here: {', '.join(untrained)} (`--rungs` chooses the configurations). "
                     "`make convergence` trains every configuration on loopback over the whole schedule "
                     "(`results/convergence.md`).")
    return lines


def write_report(path: Path, *, runs: dict[str, list[dict]], checks: dict[int, dict[str, dict]],
                 calibration: dict, network: dict, world: int, repeats: int, command: str,
                 elapsed_s: float, experiment: str, group: str, overrides: list[str],
                 machine: dict, network_by_world: Optional[dict[int, dict]] = None, check_repeats: int = 1,
                 launches: Optional[list[dict]] = None, short_at_world: Optional[list[str]] = None,
                 unshaped: Optional[dict[int, dict[str, dict]]] = None,
                 allreduce_beside: Optional[dict[int, dict]] = None, written_by: Optional[str] = None,
                 convergence_rows: Sequence[dict] = (), convergence_source: str = "`results/runs.csv`") -> None:
    """Writes ``path`` and its figures beside it. ``machine``: environment_facts() of the run;
    ``launches``: the reproduction's launches (``progress.Progress``), when it was interrupted and continued;
    ``short_at_world``: the rungs whose step time at ``world`` comes from short runs sparse from the
    start rather than the runs to the target (None: a reproduction from before there were any);
    ``unshaped``: those rungs' step times with the links unshaped, by world size (with `allreduce`'s
    beside them); ``allreduce_beside``: `allreduce`'s short runs beside those at ``world`` (None: a
    reproduction from before there were any, whose sparse rungs' ratios use its runs to the target);
    ``written_by``: the code writing the report, said where it is not the code that measured;
    ``convergence_rows``: ``make convergence``'s rows of ``results/runs.csv`` (``runs.read_runs_csv``),
    read from ``convergence_source``, for top-1 at the end in the peers' section (none: it says where
    to look)."""
    network_by_world = network_by_world or {world: network}  # reproductions before per-world measurement
    allreduce_beside = allreduce_beside or {}
    global_batch = _global_batch(runs)
    # configurations outside the ladder, checked against the model at the ladder's world size from
    # their runs to the target (after their dense warm-up), as the ladder's dense rungs are
    peer_steps = {label: median_step(items) for label, items in runs.items()
                  if label in knobs.PEERS and label not in knobs.LADDER}
    sparse_labels = [f"`{label}`" for label, items in runs.items() if not is_dense(items[0])]

    figures = path.parent
    figures.mkdir(parents=True, exist_ok=True)  # --report may name a new directory
    facts = machine
    machine_line = facts["gpu"] or f"{facts['cpu']}, {facts['cpu_count']} cores, no GPU"
    if network["emulated"]:
        net_line = (f"emulated: one network namespace per rank, bridged, each link shaped to "
                    f"{network['rate_mbit']} Mbit/s with tbf (no added delay: this kernel has no netem)")
    else:
        net_line = f"loopback, not emulated ({network['why_not']}): communication is nearly free here"
    plot_top1(runs, figures / "reproduce_top1.png")
    plot_top1(runs, figures / "reproduce_top1_epochs.png", x="epoch")
    if checks.get(world):  # (none: no step-time runs, ``_model_checked``)
        plot_step_split(checks[world], figures / "reproduce_step_split.png", world)
    ratio_note = pm.paper_dense_ratio()[1]
    rate_note = (f"Our baseline (`allreduce`, fp32) computes for {calibration['compute_s'] * 1e3:.1f} ms per step "
                 f"and sends {calibration['bytes_per_step'] / 1e6:.3f} MB per rank per step (measured on an "
                 f"unshaped network, world size {world}); at {network['rate_mbit']} Mbit/s "
                 f"(tbf counts Ethernet frames: TCP payload is about 96% of the rate) that takes "
                 f"{calibration['bytes_per_step'] * 8 / 1e6 / (network['rate_mbit'] or 1) * 1e3:.1f} ms, "
                 f"the paper's ratio times the compute." if network["emulated"] else "No rate: loopback.")
    others = [str(w) for w in sorted(checks) if w != world]
    short = ", ".join(f"`{label}`" for label in short_at_world or [])
    check_runs = (f"at world size {world} the ladder's {repeats} runs to the target"
                  + (f", but for {short} {check_repeats} short runs sparse from the start (its runs to the target "
                     "are mostly dense warm-up; "
                     + ("`allreduce`'s short runs beside them are its reference below)" if world in allreduce_beside
                        else "its ratio to the compute-only step below sets them against `allreduce`'s runs to "
                        "the target)") if short_at_world
                     else " (`gradientflow` after its dense warm-up)" if short_at_world is None else ""))
    if others:
        check_runs += (f"; at world size{'s' if len(others) > 1 else ''} {', '.join(others)}, {check_repeats} "
                       "short runs per strategy (sparse from the start)")
    if peer_steps:
        check_runs += ("; below them, " + ", ".join(f"`{label}`" for label in peer_steps) + f" at world size {world} "
                       "from their runs to the target (after their dense warm-up), shown where the model prices "
                       "them and not counted in the goal, which is the ladder's")
    trimmed = (f"- Step-time runs around the ladder (the model's check): {check_repeats} per strategy and world "
               "size" + (f", fewer than the {repeats} seeds of the runs to the target: trimmed so that every "
                         "configuration keeps its seeds within the time budget (`--check-repeats N` for more)"
                         if check_repeats < repeats else "") + "." if _model_checked(checks)
               else f"- Step-time runs around the ladder (the model's check): none ({NO_MODEL_CHECK}).")
    if _model_checked(checks):
        model_lines = [
            "`gradientflow_repro/scaling/perfmodel.py` with the measured per-tensor backward profile of this model "
            "(one process) and the measured network above. Measured step time: each run's median logged "
            f"interval, then the median [range] over the repeats: {check_runs}. "
            "Local work on the communication path, measured in the same process per "
            f"gradient element: CSC {calibration['profile'].get('sparsify_s_per_element', 0) * 1e9:.2f} ns, "
            f"fp16 wire {calibration['profile'].get('wire_cast_s_per_element', 0) * 1e9:.2f} ns"
            + (f", PowerSGD {calibration['profile']['low_rank_s_per_element'] * 1e9:.2f} ns per element of the "
               "matrices it compresses" if calibration["profile"].get("low_rank_s_per_element") else "") + " ("
            + ("scaled by how much the ranks slow each other, not by the per-rank batch"
               if calibration["profile"].get("batch") and global_batch else "scaled like the compute")
            + f").{_optimizer_note(calibration['profile'])}", "",
            *model_check(checks, calibration, network_by_world, sends_trust_sketches(next(iter(runs.values()))[0]),
                         unshaped, facts.get("cpu_count"), allreduce_beside, {world: short_at_world or []},
                         global_batch, {world: peer_steps} if peer_steps else None)]
    else:  # the network's description is checked all the same: it needs no configuration
        model_lines = [f"Not checked here: {NO_MODEL_CHECK}.",
                       *_per_tensor_alone(profile_from_json(calibration["profile"]), network_by_world)]
    paper_lines, table = paper_check()
    plot(table, figures / "scaling.png")
    peers = peers_section(runs, calibration, convergence_rows, table, GPU_COUNTS, convergence_source)
    text = [
        "# Reproducing GradientFlow's comparison", "",
        f"- Machine: {machine_line}. torch {facts['torch']}, commit {facts['git_commit']}"
        + (f"; this report was rewritten from the run's measurements by commit {written_by} (`--report-only`)."
           if written_by and written_by != facts["git_commit"] else "."),
        f"- Command: `{command}` ({elapsed_s / 60:.1f} min in all{launches_note(launches or [])}).",
        *_runs_lines(runs, experiment, world, repeats, overrides),
        f"- Network: {net_line}.", trimmed,
        f"- wandb group `{group}` (offline; see Dashboards below).", "",
        "## Time to accuracy", "", *comparison_table(runs), "",
        "Clocks: MLPerf's, from run_start (initialisation done, no data touched) to the evaluation that "
        "reached the target, never paused. Epochs to target: at the first evaluation at or above it; a "
        "configuration that never reached it is in every table as not reached. Bytes: what each rank put on "
        "the wire per step (ring-equivalent for builtin collectives); "
        + (", ".join(sparse_labels) + (" are" if len(sparse_labels) > 1 else " is")
           + " dense during the warm-up. " if sparse_labels else "")
        + "Waiting: seconds the trainer spent in `synchronize()` after backward; "
        + ", ".join(f"`{label}`" for label, items in runs.items() if run_knobs(items[0]).fusion == "ddp")
        + " wait for their buckets inside backward (DDP, with PyTorch's own hooks), so their waiting is counted "
        "as compute in the table and the figure. Every run is a row of `runs.csv` beside this report (one per "
        "run and seed, with `make convergence`'s: columns in `gradientflow_repro/reproduction/runs.py`).", "",
        "![validation top-1 against wall-clock seconds](reproduce_top1.png)", "",
        "### Where the time to target goes", "", *clock_table(runs), "",
        "Start-up: from run_start to the first training step (listing and checking the files, building the "
        "data pipelines). Other: waiting for the next batch between steps, logging, checkpoints. "
        "Initialisation (imports, process group, model, "
        "communicator, wandb, resume) runs before MLPerf's clock starts, as MLPerf's rules allow; it is shown "
        "so nothing is hidden. Every run's start record has its phases (`init_phases_s`).", "",
        *_decomposition_section(runs, checks.get(world)), "",
        *_schedule_section(runs), "", *sparsification_section(runs),
        *([*peers, ""] if peers else []),
        "## Convergence: dense against sparse communication", "", *_convergence_section(runs), "",
        "![validation top-1 against epochs](reproduce_top1_epochs.png)", "",
        *(["![time per step: compute and communication](reproduce_step_split.png)", ""] if checks.get(world) else []),
        "## How the link rate was chosen", "",
        "The paper's setting: " + ratio_note + ".", "", rate_note, "",
        "Measured on the shaped network at each world size the model is checked at:", "",
        *_network_table(network_by_world), "",
        "## Scaling model against measurement", "",
        *model_lines, "",
        "## Scaling model against the paper", "", *paper_lines, "",
        "![speedup against GPU count](scaling.png)", "",
        "## Dashboards", "",
        "Every run above is one wandb run (offline), named by strategy and grouped as "
        f"`{group}`. Upload them with `WANDB_RESUME=allow wandb sync "
        "results/runs/reproduce/*/seed*/wandb/offline-run-*` (the resume setting appends the pieces of a resumed "
        f"run to one run), then `python scripts/wandb_report.py --group {group}` (needs `pip install -e "
        ".[dashboards]` and a wandb login or `--entity`) saves a W&B report and a workspace view: top-1 against "
        "the MLPerf clock and against epochs with each strategy's seeds grouped (mean and range), time to target "
        "per strategy, step time and bytes per step, and the runs with this report's columns.", ""]
    path.write_text("\n".join(text))
