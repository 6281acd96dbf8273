"""The cluster benchmark's Markdown (results/cluster_comm.md) from its document (``bench.cluster``):
the network-bound check with its verdict, the network each launch measured, the strategies' medians
over the launches with each launch's figure, and the scaling model against them with its two goals
(``model_check_lines``, from the data of ``scaling/cluster_check.model_check``: the verdicts are its
values). Registered as the renderer ``bench.cluster_comm`` (``render/bench.py``)."""

from __future__ import annotations

import math
import statistics
from typing import Any, Mapping, Optional

from gradientflow_repro.render import size as size_label


def suggestion(check: Mapping[str, Any]) -> str:
    """The remedy's rate (``bench.cluster.rate_for_speedup``) and the split of a step it follows
    from: a fixed part f and a wire part w with t = f + w at the rate and f + w/2 at twice it.
    Empty where the check has no suggested rate (older JSON)."""
    rate = check.get("suggested_rate_mbit")
    if rate is None:
        return ""
    wire = 2.0 * (check["comm_s"] - check["double_comm_s"])
    fixed = check["comm_s"] - wire
    aim = check.get("suggested_speedup")
    return (f"; by the split these two times imply ({fixed:.3f} s fixed, {wire:.3f} s on the wire "
            f"at {check['rate_mbit']:g} Mbit/s), `--rate-mbit {math.floor(rate)}` or lower"
            + (f" should give {aim:g}x" if aim else ""))


def cluster_comm(facts: Mapping[str, Any]) -> str:
    """results/cluster_comm.md from the document ``bench.cluster.bench_cluster`` writes."""
    machine, model, launches = facts["machine"], facts["model"], facts.get("launches", 1)
    where = (f"emulated cluster (`cluster.netemu`): a network namespace per node, its ranks on the node's "
             f"loopback (unshaped), one uplink per node shaped by `tc tbf` to {facts['rate_mbit']:g} Mbit/s"
             if facts["emulated"] else f"loopback, not emulated ({facts['why_not']})")
    lines = [
        "# Communication alone on an emulated cluster", "",
        f"Machine: {machine['cpu']}, {machine['cpu_count']} cores, no GPU; torch {machine['torch']}, commit "
        f"{machine['git_commit']}. Network: {where}.",
        f"Command: `{facts['command']}` ({facts['elapsed_s']:.0f} s"
        + (f", in {facts['invocations']} invocations: interrupted, then continued" if facts.get("invocations", 1) > 1
           else "") + ").", "",
        f"Gradients: `{model['name']}` of the `{model['experiment']}` experiment (width {model['width']}, "
        f"{model['image_size']} px, {model['num_classes']} classes): {model['parameters'] / 1e6:.2f}M parameters "
        f"in {len(model['tensors_in_backward_order'])} tensors, {model['parameters'] * 4 / 2**20:.1f} MiB in fp32. "
        "Each rank replays backward without computing: every parameter gets a fixed random gradient in the "
        "order a real backward completes them, with nothing in between, so the communicators' hooks (and "
        "DDP's) fire as in training; then `synchronize()`. Communication time: backward start to the end "
        f"of `synchronize()` on the slowest rank; each launch's figure is the median of {facts['steps']} steps "
        f"after {facts['warmup']} warm-up, and every layout was launched {launches} time(s), in rounds (each "
        "round launches every layout once): the tables give the median of the launches' figures, the range of "
        "all steps, and each launch's figure (with 8 ranks on 2 cores a step moves between launches more than "
        "within one). CSC and gradientflow are in their sparse "
        "phase (density 0.1). Bytes and collectives: rank 0's per step (a node leader; builtin collectives "
        "count the ring-equivalent 2(N-1)/N of the payload). The raw rows and the measured networks, "
        "for an analytic model: `results/cluster_comm.json` (`layouts[].network.model_network` holds "
        "`perfmodel.Network`'s fields).", ""]
    check = facts.get("rate_check")
    if check and check.get("error"):
        lines += ["## Network-bound check", "", f"Failed on layout {check['layout']}: {check['error']}", ""]
    elif check:
        bandwidth = check["leader_bandwidth_Bps"]
        lines += [
            "## Network-bound check", "",
            f"The largest dense strategy of layout {check['layout']} (its first launch; `{check['strategy']}`, fp32, "
            f"{check['bytes_per_step'] / 2**20:.2f} MiB/step) takes {check['comm_s']:.3f} s/step at "
            f"{check['rate_mbit']:g} Mbit/s per uplink and {check['double_comm_s']:.3f} s at "
            f"{check['double_rate_mbit']:g} Mbit/s: {check['speedup']:.2f}x faster (2x if purely "
            f"network-bound, at least {check['required_speedup']:g}x required): "
            f"**{'network-bound' if check['network_bound'] else 'NOT network-bound'}**. Unshaped it takes "
            f"{check['unshaped_comm_s']:.3f} s ({100 * check['unshaped_share']:.0f}% of its time at "
            f"{check['rate_mbit']:g} Mbit/s): what CPU and per-message costs alone cost. Leader-to-leader ring "
            f"bandwidth (1 MiB segments) in the same launches: " + ", ".join(
                f"{name} {value / 1e6:.1f} MB/s" for name, value in
                (("at the rate", bandwidth["rate"]), ("at twice the rate", bandwidth["double"]),
                 ("unshaped", bandwidth["unshaped"])) if value) + "."
            + ("" if check["network_bound"] else " On this machine the CPU and per-message costs weigh too much at "
               "this rate for the model check to be one of the network: run again with a lower `--rate-mbit` (the "
               "dense strategies then take longer)" + suggestion(check) + "."), "",
            f"Every dense fp32 strategy of layout {check['layout']}:", "",
            f"| strategy | at {check['rate_mbit']:g} Mbit/s | at {check['double_rate_mbit']:g} Mbit/s | speed-up "
            "| unshaped | unshaped / at the rate |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['strategy']} | {r['comm_s']:.3f} s | {r['double_comm_s']:.3f} s | {r['speedup']:.2f}x "
                  f"| {r['unshaped_comm_s']:.3f} s | {100 * r['unshaped_share']:.0f}% |" for r in check["rows"]]
        lines.append("")
    elif facts["emulated"]:
        lines += ["## Network-bound check", "", "Not run (--no-check).", ""]
    lines += ["## Network per layout and launch", "",
              "Rings of one element per rank (latency) and of 8 MiB (bandwidth), in 4 MiB segments (our "
              "ring's default) and, between leaders, also in 1 MiB segments (see `SEGMENT_BYTES` in "
              "`bench/cluster_rank.py`); a ring of two ranks, as the leaders' of 2 nodes, cuts both to "
              "512 KiB (`ring.EXCHANGE_SEGMENT_BYTES`: its two directions share one gloo connection). The model "
              "takes the per-message latency from the leaders' ring and the uplink's bandwidth from the fastest "
              "of the rings whose flows cross each uplink once each way, the flat ring and the leaders' (contention "
              "on a shared host slows a ring by an amount that changes between launches), at most the shaped rate "
              "(`scaling/cluster_check.py`).", "",
              "| layout, launch | uplink payload rate | leaders: latency, bandwidth (1 MiB segments) "
              "| inside a node: latency, bandwidth | flat ring of all ranks: latency, bandwidth "
              "| one-value MAX allreduce (the fp16 scale) |",
              "|---|---|---|---|---|---|"]

    def ring(figures: Optional[dict]) -> str:
        if not figures:
            return "-"
        text = f"{figures['latency_s'] * 1e6:.0f} us, {figures['bandwidth_Bps'] / 1e6:.1f} MB/s"
        segmented = figures.get("segmented")
        return text + (f" ({segmented['bandwidth_Bps'] / 1e6:.1f} MB/s)" if segmented else "")

    for layout in facts["layouts"]:
        net = layout["network"] or {}
        rate = f"{layout['shaped_payload_Bps'] / 1e6:.1f} MB/s" if layout["shaped_payload_Bps"] else "unshaped"
        tiny = f"{net['tiny_allreduce_s'] * 1e6:.0f} us" if net.get("tiny_allreduce_s") else "-"
        lines.append(f"| {layout['layout']} ({layout['world']} ranks), {_launch(layout)} | {rate} "
                     f"| {ring(net.get('leaders'))} "
                     f"| {ring(net.get('intra'))} | {ring(net.get('flat'))} | {tiny} |")
    lines.append("")
    tables: dict[str, list[list[list[float]]]] = {}  # layout -> each launch's [size, seconds] pairs
    for layout in facts["layouts"]:
        table = (layout["network"] or {}).get("builtin_cost_by_size")
        if table:
            tables.setdefault(layout["layout"], []).append(table)
    if tables:
        lines += ["Builtin (gloo) allreduce by size, seconds per call back to back (median over the launches; each "
                  "launch's model uses its own table):", "",
                  "| size | " + " | ".join(tables) + " |", "|---|" + "---|" * len(tables)]
        first = next(iter(tables.values()))[0]
        for i, (size, _) in enumerate(first):
            lines.append(f"| {size_label(size)} | " + " | ".join(
                f"{statistics.median(table[i][1] for table in each) * 1e3:.2f} ms" for each in tables.values()) + " |")
        lines.append("")
    rows_of_every_launch = facts["rows_over_launches"]
    for layout in facts["layouts"]:
        if _launch(layout) != 1:
            continue
        rows = [r for r in rows_of_every_launch if r["layout"] == layout["layout"] and r["world"] == layout["world"]]
        base = next((r for r in rows if r["strategy"] == "allreduce" and "comm_s_launches" in r), None)
        lines += [f"## {layout['nodes']} nodes x {layout['ranks_per_node']} ranks ({layout['world']} ranks)", "",
                  "| strategy | comm s/step: median (min-max) | each launch | vs allreduce | MiB sent/step "
                  "| collectives/step |", "|---|---|---|---|---|---|"]
        for r in rows:
            if "comm_s_launches" not in r:
                lines.append(f"| {r['strategy']} | failed: {r['error'][:200]} | | | | |")
                continue
            versus = f"{base['comm_s_median'] / r['comm_s_median']:.2f}x" if base else "-"
            failed = f" (failed in launch {', '.join(map(str, r['failed_launches']))})" if r["failed_launches"] else ""
            lines.append(f"| {r['strategy']} | {r['comm_s_median']:.3f} ({r['comm_s_min']:.3f}-{r['comm_s_max']:.3f}) "
                         f"| {', '.join(f'{s:.3f}' for s in r['comm_s_launches'])}{failed} | {versus} "
                         f"| {r['bytes_per_step'] / 2**20:.2f} | {r['collectives_per_step']:.0f} |")
        lines.append("")
    if facts["emulated"]:
        names = list(dict.fromkeys(layout["layout"] for layout in facts["layouts"]))
        lines += ["## The scaling model against these measurements", "",
                  "`gradientflow_repro/scaling/perfmodel.py` fed with each layout's measured network "
                  "(`scaling/cluster_check.py` says how; nothing fitted to the step times). Our algorithms send "
                  "messages up to this network's "
                  "switch-over between recursive doubling and the ring (`comm.small_message_kb`, from the model "
                  "on the figures measured at the start of each launch: " + ", ".join(
                      f"{name} {_switch_over_note(facts, name)}" for name in names)
                  + "). CSC's, the fp16 wire's and PowerSGD's local work per element (of the gradients, of the "
                  "gradients, of the matrices PowerSGD compresses), measured in each launch as a step does "
                  "it (every rank at once on the shared cores, the slowest rank's time), launch by launch: "
                  + "; ".join(f"{name} " + ", ".join(_local_work_note(layout) for layout in facts["layouts"]
                                                   if layout["layout"] == name) for name in names)
                  + ". Each emulated uplink also passes a burst at once after it has idled (tbf's bucket, "
                  f"{facts['burst_bytes'] >> 10} KiB: {_burst_ms(facts)} of the uplink's time), which the model "
                  "spends and refills (`perfmodel.Network.burst_bytes`).", "",
                  *(model_check_lines(facts["model_check"]) if facts.get("model_check") else []), ""]
    return "\n".join(lines)


def _local_work_note(layout: Mapping[str, Any]) -> str:
    work = (layout["network"] or {}).get("local_work_in_step")
    if not work:
        return "not measured"
    low_rank = work.get("low_rank_s_per_element")  # not measured by launches before PowerSGD was priced
    return (f"{work['sparsify_s_per_element'] * 1e9:.1f}, {work['wire_cast_s_per_element'] * 1e9:.1f} and "
            + (f"{low_rank * 1e9:.1f} ns" if low_rank is not None else "(not measured) ns"))


def _burst_ms(facts: Mapping[str, Any]) -> str:
    layout = facts["layouts"][0]
    if not layout.get("shaped_payload_Bps"):
        return "none unshaped"
    return f"{layout.get('burst_payload_bytes', 0.0) / layout['shaped_payload_Bps'] * 1e3:.0f} ms"


def _switch_over_note(facts: Mapping[str, Any], layout: str) -> str:
    sizes = sorted({r["options"].get("small_message_kb") for r in facts["rows"]
                    if r["layout"] == layout and r["options"].get("small_message_kb")})
    return "/".join(f"{size} KiB" for size in sizes) or "default"



def _launch(item: Mapping[str, Any]) -> int:
    """Which launch of its layout a layout's figures are (1 in results recorded with one)."""
    return int(item.get("launch", 1))


def _each_launch(launches: int, figures: Mapping[int, float], form: str, suffix: str = "") -> str:
    """One figure per launch, in launch order; "-" where the strategy failed or was not modelled."""
    return ", ".join(format(figures[launch], form) + suffix if launch in figures else "-"
                     for launch in range(1, launches + 1))


def model_check_lines(check: Mapping[str, Any]) -> list[str]:
    """The model against every measured strategy (the median over the launches, each launch's error
    beside it), and the two goals, worded from ``cluster_check.model_check``'s data."""
    launches, rows, goal_error = check["launches"], check["rows"], check["goal_error"]
    lines = [f"| layout | strategy | measured (ms) | model (ms) | error | error in each of the {launches} launches |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['layout']} | {row['strategy']} | {row['comm_s_median'] * 1e3:.1f} "
                     f"| {row['predicted_s'] * 1e3:.1f} | {row['error'] * 100:+.0f}% "
                     f"| {_each_launch(launches, dict(zip(row['launches'], row['error_launches'])), '+.0%')} |")
    if check["unmodelled"]:
        lines += ["", f"Not modelled: {', '.join(check['unmodelled'])} (no local work measured in the launch: "
                  "recorded before it was, or without the network measurement)."]
    errors, singles = [abs(r["error"]) for r in rows], check["single_errors"]
    if errors:
        lines += ["", f"Measured: the median over {launches} launch(es) of each launch's median step; model: the "
                  "median of its predictions, each on the network measured in that launch. Goal: the model within "
                  f"{goal_error:.0%} of each. {check['within_goal']} of {len(errors)} are; median "
                  f"error {statistics.median(errors) * 100:.0f}%, largest {max(errors) * 100:.0f}%. Launch by launch "
                  f"(each prediction against its own launch's step): {sum(e <= goal_error for e in singles)} of "
                  f"{len(singles)} within {goal_error:.0%}, largest {max(singles) * 100:.0f}%."]
    for goal in check["goals"]:
        if goal["goal"] == "ddp_ratio":
            lines.append(f"- {goal['layout']}: `gradientflow` (hierarchical) communicates {goal['ratio']:.2f}x as "
                         f"long as DDP-style bucketed builtin allreduce ({goal['full_s'] * 1e3:.0f} against "
                         f"{goal['ddp_s'] * 1e3:.0f} ms per step, medians; side by side in each launch: "
                         f"{_each_launch(launches, dict(goal['by_launch']), '.2f', 'x')}). Goal at "
                         f"most {check['goal_ratio']}x: {'met' if goal['met'] else 'NOT met'}.")
        else:
            peers = goal["peers"]
            lines.append(f"- {goal['layout']}: `gradientflow` (hierarchical) against what ships in PyTorch "
                         f"(medians): {goal['full_s'] * 1e3:.0f} ms and {goal['full_bytes'] / 2**20:.2f} MiB per "
                         "step against " + ", ".join(f"`{p['label']}` {p['comm_s'] * 1e3:.0f} ms and "
                                                     f"{p['bytes'] / 2**20:.2f} MiB" for p in peers)
                         + f". Goal ahead of {'both' if len(peers) == 2 else 'each'} on communication time: "
                         f"{'met' if goal['met'] else 'NOT met'}; fewest bytes: `{goal['fewest']}`.")
    return lines
