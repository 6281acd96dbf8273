"""The report's section on CSC against PyTorch's PowerSGD and fp16 hooks and the paper's stack as
published (``render/reproduction.py``), from the data of ``reproduction.peers.peers``: the table, a
paragraph saying who leads on each figure, and the goals as their verdicts say."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

from gradientflow_repro.render.reproduction_cells import fmt, said, spread

Document = Mapping[str, Any]
CSC = "gradientflow"


def _leaders(labels: Sequence[str], score: Callable[[str], float], fmt: str) -> str:
    """The label(s) with the highest ``score`` as shown in ``fmt`` (ties, as the reader sees them, named together)."""
    best = f"{max(score(label) for label in labels):{fmt}}"
    tied = [label for label in labels if f"{score(label):{fmt}}" == best]
    return " and ".join(f"`{label}`" for label in tied) + (" (tied)" if len(tied) > 1 else "")


def peers_section(data: Optional[Document]) -> list[str]:
    """The section's lines (none without the data)."""
    if not data:
        return []
    rows = {row["label"]: row for row in data["rows"]}
    contenders, gpus, seeds = data["contenders"], data["gpus"], data["seeds"]
    ends_of = "these runs" if data["own_ends"] else "`make convergence`"

    def epochs_cell(row: Document) -> str:
        total = spread(row["epochs"], ".0f")
        if row["sparse_epochs"] is None or total == "not reached":
            return total
        return f"{total} ({spread(row['sparse_epochs'], 'g')} sparse)"

    table = ["| strategy | sends | time to target, MLPerf clock (s) | epochs to target | step after the warm-up (ms) "
             "| MB per rank per step after the warm-up | local work per step (ms) "
             f"| top-1 at the end of {ends_of} (%) | model (calibrated): speedup at {gpus} GPUs |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in data["rows"]:
        top1, work, scale = row["final_top1"], row["local_work_s"], row["speedup_at_scale"]
        table.append(" | ".join([
            f"| {row['label']}", row["sends"], spread(row["time"], ".1f"), epochs_cell(row),
            f"{row['step_s'] * 1e3:.1f}", f"{row['bytes_per_step'] / 1e6:.3f}",
            "not measured" if work is None else f"{work * 1e3:.2f}", "-" if top1 is None else f"{top1:.2f}",
            "-" if scale is None else f"{scale:.1f}x"]) + " |")

    time = {label: rows[label]["time_median"] for label in contenders}
    said = []
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
        f"`{label}` {fmt(rows[label]['epochs_median'], 'g')}" for label in contenders) + ".")
    said.append("Bytes per rank per step after the dense warm-up: " + ", ".join(
        f"`{label}` {rows[label]['bytes_per_step'] / 1e6:.3f} MB" for label in contenders)
        + f": fewest {_leaders(contenders, lambda label: -rows[label]['bytes_per_step'] / 1e6, '.3f')}; "
        "step time after the warm-up: " + ", ".join(
        f"`{label}` {rows[label]['step_s'] * 1e3:.1f} ms" for label in contenders)
        + f": shortest {_leaders(contenders, lambda label: -rows[label]['step_s'] * 1e3, '.1f')}.")
    measured_work = [label for label in contenders if rows[label]["local_work_s"] is not None]
    if measured_work:
        said.append("Local work on the communication path per step (the model's sum over this model's gradients "
                    "of the per-element costs measured in the calibration's profile, one process): " + ", ".join(
                        f"`{label}` {rows[label]['local_work_s'] * 1e3:.2f} ms" for label in measured_work)
                    + "".join(f"; `{label}`'s not measured" for label in contenders if label not in measured_work)
                    + ".")
    else:
        said.append("Local work per step: not measured (a calibration profile from before it was measured).")
    ends = [label for label in contenders if rows[label]["final_top1"] is not None]
    if ends:
        said.append(f"Top-1 at the end of {ends_of} (median over its seeds; {data['source']}, "
                    f"trained at commit {', '.join(data['commits'])}): " + ", ".join(
                        f"`{label}` {rows[label]['final_top1']:.2f}%" for label in ends)
                    + f": highest {_leaders(ends, lambda label: rows[label]['final_top1'], '.2f')}"
                    + "".join(f"; `{label}` not in it" for label in contenders if label not in ends) + ".")
    else:
        said.append("Top-1 at the end of `make convergence`: no rows of its runs in "
                    f"{data['source']}; run `make convergence` (it writes them and `results/convergence.md`), "
                    "then `python scripts/reproduce.py --report-only`.")
    scaled = [label for label in contenders if rows[label]["speedup_at_scale"] is not None]
    if scaled:
        said.append(f"The model calibrated on published results at {gpus} GPUs (the paper's setup, the "
                    "steady state after each dense warm-up, convergence not modelled: section \"Scaling model "
                    "against the paper\" below, with its band; in full: `results/scaling.md`): speedup " + ", ".join(
                        f"`{label}` {rows[label]['speedup_at_scale']:.1f}x" for label in scaled)
                    + f": highest {_leaders(scaled, lambda label: rows[label]['speedup_at_scale'], '.1f')}"
                    + "".join(f"; `{label}` not projected" for label in contenders if label not in scaled) + ".")
    else:
        said.append(f"The model at {gpus} GPUs: not projected here for these strategies; see `results/scaling.md`.")

    return ["## Against PyTorch's PowerSGD and fp16 hooks, and the paper's stack as published", "", *table, "",
            "Step and bytes after the warm-up: the median logged interval of the runs to the target after each "
            "run's dense warm-up (a run that reached the target inside it: all its intervals), median over the "
            "seeds. Sends: the density of CSC, the rank of PowerSGD's factors, or 1 (dense).", "",
            " ".join(said), "", *peer_goals(data["ahead"], data["below_ddp"], ends_of),
            *additions(data["additions"], ends_of)]


def peer_goals(ahead: Optional[Document], below: Optional[Document], ends_of: str) -> list[str]:
    """The goals against the peers and against ``ddp``, as their verdicts say."""
    lines = []
    if ahead:
        parts = []
        for part in ahead["measured"]:
            peer, mine, theirs = part["peer"], part["time"], part["peer_time"]
            ratio = (f"{mine / theirs:.2f}x" if mine and theirs else
                     f"`{CSC}` not reached" if mine is None else f"`{peer}` not reached")
            top1 = (f"top-1 at the end unknown (no rows of {ends_of})" if part["top1_gap"] is None
                    else f"top-1 at the end {part['top1_gap']:+.2f} points")
            parts.append(f"against `{peer}`: time to target {ratio} ({'ahead' if part['ahead'] else 'NOT ahead'}), "
                         f"{top1}")
        peers = ahead["detail"]["peers"]
        lines.append(f"- Goal: `{CSC}` ahead of {' and '.join(f'`{p}`' for p in peers)} on time to target (MLPerf "
                     f"clock, median over the seeds) at equal top-1 at the end of {ends_of} (at most "
                     f"{ahead['target']:g} points below): " + "; ".join(parts) + f": {said(ahead['met'])}.")
    if below:
        ratios = below["detail"]["median"]
        median = ("median: not reached" if ratios is None else
                  f"median {ratios['time']:.2f}x = {ratios['step']:.2f}x (step) x {ratios['epochs']:.2f}x (epochs) x "
                  f"{ratios['overhead']:.2f}x (overhead)")
        seeds = []
        for seed in below["detail"]["seeds"]:
            parts = seed["ratios"]
            if parts is None:
                seeds.append(f"seed {seed['seed']}: " + ("not reached" if not seed["reached"]
                                                         else "`ddp` did not reach it"))
            else:
                seeds.append(f"seed {seed['seed']}: {parts['time']:.2f}x = {parts['step']:.2f}x x "
                             f"{parts['epochs']:.2f}x x {parts['overhead']:.2f}x")
        lines.append(f"- Goal: `{CSC}`'s time to target below `ddp`'s in the median and in every seed (ratio = step "
                     f"time x epochs x overhead): {median}; " + "; ".join(seeds or ["no seed of both"])
                     + f": {said(below['met'])}.")
    return lines


def additions(data: Optional[Document], ends_of: str) -> list[str]:
    """What our additions to the paper's stack buy, one line (none without the paper's stack)."""
    if not data:
        return []
    line = (f"- Our additions (release cap, trust-ratio noise correction): `{CSC}` against `gradientflow-paper` (the "
            f"paper's stack as published): epochs to target {fmt(data['epochs'], 'g')} against "
            f"{fmt(data['paper_epochs'], 'g')} (medians)")
    mine, theirs = data["whole"], data["paper_whole"]
    if mine and theirs:
        gaps = data["gaps"]
        gap = f" ({gaps[0]:+.2f} points seed by seed, from {gaps[1]:+.2f} to {gaps[2]:+.2f})" if gaps else ""
        line += (f"; over the whole schedule ({ends_of}): top-1 at the end {fmt(mine['final_top1'], '.2f')}% "
                 f"against {fmt(theirs['final_top1'], '.2f')}%{gap}, epochs to target {fmt(mine['epochs'], 'g')} "
                 f"against {fmt(theirs['epochs'], 'g')}, falls of more than {data['large_fall_points']:g} points "
                 f"after the warm-up in {mine['large_falls']} of {mine['runs']} runs against {theirs['large_falls']} "
                 f"of {theirs['runs']} (largest fall, median: {fmt(mine['largest_fall'], '.1f')} against "
                 f"{fmt(theirs['largest_fall'], '.1f')} points)")
    else:
        line += "; over the whole schedule: `results/convergence.md` (`make convergence`)"
    return [line + "."]
