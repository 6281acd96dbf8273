"""results/convergence.md from the document of ``reproduction.convergence.study_data`` (kind
``reproduction.convergence``): accuracy over the whole schedule, dense against sparse
communication; and results/reliability.md from the fault table's (``reproduction.reliability``).
Words only: every figure is read from the document."""

from __future__ import annotations

import statistics
from typing import Any, Mapping, Optional, Sequence

from gradientflow_repro.render.reproduction_cells import seed_gaps, spread

Document = Mapping[str, Any]


def falls(found: Sequence[Document]) -> list[str]:
    """Falls after the warm-up as ``label seed: epoch a -> b: x% -> y%``."""
    return [f"{f['label']} seed {f['seed']}: epoch {f['from_epoch']:.0f} -> {f['to_epoch']:.0f}: "
            f"{f['from_top1']:.1f}% -> {f['to_top1']:.1f}%" for f in found]


def sparsification_table(rows: Sequence[Document]) -> list[str]:
    if not rows:
        return []
    lines = ["| strategy | steps between sends of a layer's chunks (layers' range) | layer sent least often "
             "| momentum erased by masking | MB per rank per step after the warm-up |", "|---|---|---|---|---|"]
    for row in rows:
        share = row["masked_share"]
        lines.append(" | ".join([
            f"| {row['label']}", f"{row['fastest']:g}-{row['slowest']:g}",
            f"`{row['slowest_layer']}` ({row['slowest_interval']:g})",
            "- (none)" if share is None else f"{share:.0%}", f"{row['bytes_per_step'] / 1e6:.3f}"]) + " |")
    return lines


def sparsification_section(rows: Sequence[Document]) -> list[str]:
    """What sparse communication did in these runs, or nothing where no run logged it."""
    if not rows:
        return []
    return ["### What sparsification did", "", *sparsification_table(rows), "",
            "From every progress record of the sparse phase (`metrics.jsonl`: `csc_send_interval_median` per "
            "layer, `csc_masked_momentum_share`, `bytes_per_step`), medians over the records and then the seeds. "
            "A chunk sent every k steps under momentum factor masking keeps 1 - m(1 - m^k)/((1 - m)k) of its "
            "momentum's gain (0.41 at k = 10, m = 0.9); the share here is of the velocity's L1 norm erased per "
            "step.", ""]


def _gaps(gaps: Optional[Sequence[float]], against: str) -> str:
    if not gaps:
        return "no pair of seeds to compare"
    median, low, high, pairs = gaps
    return f"top-1 at the end {median:+.2f} points against {against} (from {low:+.2f} to {high:+.2f} over {pairs} seeds"


def against_dense(data: Optional[Document], reference: Optional[str]) -> list[str]:
    """Each sparse configuration against the dense reference."""
    if data is None:
        return ["No dense configuration was trained: nothing to set the sparse ones against."]
    target = data["target"]
    dense_known = [e for e in data["dense_epochs"] if e is not None]
    lines = [f"Against `{reference}` (dense): epochs to {target:g}% as medians over the seeds that reached it "
             f"(`{reference}`: {len(dense_known)} of {len(data['dense_epochs'])}), top-1 at the end seed by seed:"]
    for row in data["rows"]:
        epochs = row["epochs"]
        reached = [e for e in epochs if e is not None]
        if reached and dense_known:
            mine, theirs = statistics.median(reached), statistics.median(dense_known)
            to_target = f"{mine:g} epochs to {target:g}% against {theirs:g} ({mine / theirs - 1:+.0%})"
            if len(reached) < len(epochs):
                to_target += f", reached in {len(reached)} of {len(epochs)} seeds"
        else:
            to_target = f"{target:g}% reached in {len(reached)} of {len(epochs)} seeds"
        ends = _gaps(row["gaps"], "the same seed's dense run")
        if row["gaps"]:
            ends += f"; the dense runs' own spread over the seeds: {data['dense_spread']:.2f})"
        lines.append(f"- `{row['label']}`: {to_target}; {ends}.")
    return lines


def additions(data: Optional[Document]) -> list[str]:
    """What our additions to the paper's stack buy, one paragraph (nothing without both)."""
    if data is None:
        return []
    target, paper = data["target"], data["paper"]
    mine, paper_epochs = (f"{statistics.median(k):g}" + (f" ({len(k)} of {len(e)} seeds)" if len(k) < len(e) else "")
                          if k else "not reached" for e in data["epochs"] for k in [[x for x in e if x is not None]])
    ends = _gaps(data["gaps"], "the same seed's") + (")" if data["gaps"] else "")
    large, runs = data["large_falls"], data["runs"]
    return ["", f"Our additions (release cap, trust-ratio noise correction): `gradientflow` against `{paper}` "
            f"(the paper's stack as published): epochs to {target:g}% {mine} against {paper_epochs} "
            f"(medians); {ends}; falls of more than 5 points after the warm-up in {large[0]} of {runs[0]} runs "
            f"against {large[1]} of {runs[1]}."]


def convergence(doc: Document) -> str:
    """results/convergence.md."""
    machine, targets, reference = doc["machine"], doc["targets"], doc["reference"]
    machine_line = machine["gpu"] or f"{machine['cpu']}, {machine['cpu_count']} cores, no GPU"
    configs = dict((label, overrides) for label, overrides in doc["configs"])
    lines = ["# Accuracy over the whole schedule: dense against sparse communication", "",
             f"- Machine: {machine_line}. torch {machine['torch']}, commit {machine['git_commit']}."
             + (f" Runs trained at commit {', '.join(doc['trained'])}." if doc["trained"] != [machine["git_commit"]]
                else ""),
             f"- Command: `{doc['command']}` ({doc['elapsed_s'] / 60:.1f} min"
             + (f"; {doc['kept']} of {doc['runs']} runs kept from an earlier launch" if doc["kept"] else "") + ").",
             f"- Experiment `{doc['experiment']}`, world size {doc['world']} on loopback (accuracy per epoch does not "
             f"depend on the network), {doc['epochs']} epochs, learning-rate warm-up {doc['warmup']:g} epochs "
             "(unless a configuration sets its own), never stopped at the target; seeds "
             f"{', '.join(str(s) for s in doc['seeds'])} (initial weights and data order): median [range]."
             + (f" Overrides for every run: `{' '.join(doc['overrides'])}`." if doc["overrides"] else ""),
             "- Configurations: "
             + "; ".join(f"{label}: `{' '.join(overrides)}`" for label, overrides in configs.items()) + ".", ""]
    header = ["configuration", "density", *[f"epochs to {t:g}%" for t in targets], "top-1 at the end (%)",
              *([f"top-1 at the end - `{reference}`'s, same seed (points)"] if reference else []),
              "best top-1 (%)", "largest fall after the warm-up (points)"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in doc["rows"]:
        cells = [row["label"], row["density"], *[spread(epochs, "g") for epochs in row["epochs_to"]],
                 spread(row["final"], ".2f"),
                 *([("- (the reference)" if row["gaps"] is None else seed_gaps(row["gaps"]))] if reference else []),
                 spread(row["best"], ".2f"), spread(row["largest_fall"], ".1f")]
        lines.append("| " + " | ".join(cells) + " |")
    evaluated = doc["evaluated"]
    lines += ["", "Top-1 after each epoch (%), median over the seeds:", "",
              "| configuration | " + " | ".join(f"{e:g}" for e in evaluated) + " |",
              "|---|" + "---|" * len(evaluated)]
    for label, medians in doc["per_epoch"]:
        lines.append(f"| {label} | " + " | ".join("-" if v is None else f"{v:.1f}" for v in medians) + " |")
    dropped = falls(doc["falls"])
    lines += ["", f"Falls of more than 5 points from one evaluation to the next after the warm-up: {len(dropped)} in "
              f"{doc['runs']} runs" + (": " + "; ".join(dropped) if dropped else "") + ".",
              "", *against_dense(doc["against_dense"], reference), *additions(doc["additions"]), "",
              *sparsification_section(doc["sparsification"]),
              f"![validation top-1 against epochs]({doc['figure']})", ""]
    return "\n".join(lines)


def reliability(doc: Document) -> str:
    """results/reliability.md from the document of ``reproduction.fault_report.fault_report``."""
    facts = doc["machine"]
    lines = ["# Reliability under injected faults", "",
             f"Machine: {facts['cpu']}, {facts['cpu_count']} cores, no GPU; torch {facts['torch']}, gloo, torchrun; "
             f"commit {facts['git_commit']}. Command: `{doc['command']}` "
             f"({doc['elapsed_s'] / 60:.1f} min). World sizes as listed; `dist_timeout_s=30`; faults "
             "planned with `GFR_INJECT_FAULT` (gradientflow_repro/faults.py). Time to detection: from the "
             "moment the fault fired to the end of the whole job.", "",
             "| fault | world size | what the harness did | time to detection | lost |", "|---|---|---|---|---|"]
    for row in doc["rows"]:
        lines.append(f"| {row['fault']} | {row['world']} | {row['action'].replace('|', '/')} | {row['detection']} "
                     f"| {row['lost'].replace('|', '/')} |")
    if any("frozen" in row["fault"] for row in doc["rows"]):
        lines += ["", "A frozen rank cannot act on SIGTERM: the survivors name it after `watchdog_s` (6 s here) "
                  "and exit, and torchrun's agent then waits its 30 s before it SIGKILLs the stopped process, "
                  "most of that row's time to the end of the job. Under Slurm, `slurm/task.sh` ends the job "
                  "step with SIGKILL as soon as the first survivor exits, the frozen rank with it."]
    return "\n".join(lines) + "\n"
