"""The scaling model against the emulated two-level cluster (``bench.cluster``).

For each layout (nodes x ranks per node) and strategy the benchmark measured one step's
communication alone: every gradient of a real model ready at once, in backward order, then
``synchronize()``. The model (``perfmodel``) predicts the same: a profile whose tensors are those
gradients, all ready at time 0 with no compute, so a step is the sum of its messages' costs; the
network is the one measured in the same launch (``network_fields``: per-message latency between
node leaders, the uplink's bandwidth from the fastest ring that crosses it, bandwidth and latency
inside a node, gloo's own allreduce by message size), with the same placement rules that price the
paper's cluster: small messages by recursive doubling with a node's ranks sharing its uplink when
they cross it together, the two-level ring for ``hierarchical``; and the uplink's burst credit
(``netemu``'s token bucket). CSC's and the fp16 wire's local work per element, and the replayed backward's own
time (autograd's hand-over of the gradients, and for pooled strategies the pool's copies), are
measured in the same launch as a step does them: every rank at once, the slowest rank's time.
Nothing is fitted to the benchmark's step times.
"""

from __future__ import annotations

import statistics
from typing import Any, Optional

from gradientflow_repro import variants
from gradientflow_repro.comm.plan import resolve
from gradientflow_repro.reproduction.lineup import PEER_LABELS
from gradientflow_repro.scaling import perfmodel as pm

GOAL_ERROR = 0.15  # the model within 15% of every measured strategy
GOAL_RATIO = 0.5  # gradientflow (hierarchical) at most half of DDP-style bucketed builtin allreduce


def comm_only_profile(tensors: list[list[Any]], local_work: dict[str, float],
                      backward_s: float = 0.0) -> pm.ModelProfile:
    """No compute: a "backward" of ``backward_s`` (the replay's own work, measured) over which the
    gradients become ready in proportion to their size; the model's step is then that and the
    communication not done by its end. A tensor is ``[elements, one-dimensional]`` or, where the
    launch recorded it, ``[elements, one-dimensional, first dimension]`` (PowerSGD's matrix view);
    PowerSGD's local work per element is ``local_work["low_rank_s_per_element"]`` where measured."""
    total, done, profiled = sum(int(t[0]) for t in tensors), 0, []
    for elements, flat, *rows in tensors:
        done += int(elements)
        profiled.append(pm.TensorProfile(int(elements), backward_s * done / max(1, total), bool(flat),
                                         int(rows[0]) if rows and rows[0] else None))
    return pm.ModelProfile(0.0, backward_s, 0.0, tuple(profiled),
                           local_work["sparsify_s_per_element"], local_work["wire_cast_s_per_element"],
                           low_rank_s_per_element=local_work.get("low_rank_s_per_element", 0.0))


def network_fields(measured: dict[str, Any]) -> dict[str, Any]:
    """``perfmodel.Network``'s fields from the rings one launch measured (``bench_cluster``): the
    per-message latency of the node leaders' ring (each of its messages crosses an uplink), the
    node's own ring inside it, and the uplink's bandwidth as the fastest of the rings that carry
    what the model's B stands for, one flow per uplink and direction: the flat ring of all ranks
    and the leaders' ring (in both segment sizes). Contention on a shared host slows a ring by an
    amount that changes from launch to launch, so the fastest is the best estimate of the link;
    what can make one faster than the link is the shaper's
    burst, which the model spends itself, so ``model_network`` caps the figure at the shaped rate."""
    inter, intra, leaders = measured["flat"], measured.get("intra"), measured.get("leaders")
    crossing = [inter] + ([leaders, leaders.get("segmented") or {}] if leaders else [])
    return {"bandwidth_Bps": max(ring.get("bandwidth_Bps", 0.0) for ring in crossing),
            "latency_s": (leaders or inter)["latency_s"], "ranks_per_node": measured["ranks_per_node"],
            "intra_bandwidth_Bps": intra["bandwidth_Bps"] if intra else None,  # None: no intra-node links
            "intra_latency_s": intra["latency_s"] if intra else None,
            "tiny_allreduce_s": measured["tiny_allreduce_s"],
            "builtin_cost_by_size": measured.get("builtin_cost_by_size")}


def model_network(measured: dict[str, Any], burst_bytes: float = 0.0,
                  shaped_Bps: Optional[float] = None) -> pm.Network:
    """``perfmodel.Network`` from a launch's measured rings (``network_fields``, applied to the rings
    themselves, so a launch recorded before the rule changed is priced by it too) and its shaper's
    burst and payload rate (``netemu.EmulatedNetwork.burst_payload_bytes`` and ``payload_Bps``: no
    measured ring is taken as faster than the shaper lets a long transfer go, since part of a
    measured ring's speed may be burst credit, which the model spends on its own). The one-value
    allreduce is left to the model (recursive doubling step by step, as the fp16 wire sends it),
    not the one-value MAX timed in the launch."""
    figures = network_fields(measured)
    table = figures.get("builtin_cost_by_size")
    bandwidth = min(figures["bandwidth_Bps"], shaped_Bps) if shaped_Bps else figures["bandwidth_Bps"]
    return pm.Network(bandwidth, figures["latency_s"], figures["ranks_per_node"],
                      figures["intra_bandwidth_Bps"] or float("inf"), figures["intra_latency_s"] or 0.0,
                      builtin_cost_by_size=tuple(map(tuple, table)) if table else None,
                      burst_bytes=burst_bytes)


def strategy(label: str, options: dict[str, Any]) -> pm.Strategy:
    """The model's view of a benchmarked strategy; the benchmark replays gradients under SGD, so CSC
    sends no trust-ratio noise sketches."""
    return pm.Strategy.from_plan(label, resolve(options), lars=False)


def launch_of(item: dict[str, Any]) -> int:
    """Which launch of its layout a measured row or layout is (1 in results recorded with one)."""
    return int(item.get("launch", 1))


def over_launches(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per layout and strategy from its rows of every launch, in first-seen order: the launches'
    medians (``comm_s_launches``) and their median (``comm_s_median``), the steps' min and max over
    all launches; with the model (``predictions``), its prediction for each launch on that launch's
    network (``predicted_launches``, ``error_launches``) and their median against the measured
    median (``predicted_s``, ``error``). Launches in which the strategy failed are left out
    (``failed_launches``); a strategy that failed in every launch keeps its first error."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["layout"], row["strategy"]), []).append(row)
    combined = []
    for group in groups.values():
        ran = [r for r in group if not isinstance(r.get("error"), str)]
        failed = [launch_of(r) for r in group if isinstance(r.get("error"), str)]
        if not ran:
            combined.append({**group[0], "failed_launches": failed})
            continue
        measured = [r["comm_s_median"] for r in ran]
        row = {**ran[0], "launches": [launch_of(r) for r in ran], "failed_launches": failed,
               "comm_s_launches": measured, "comm_s_median": statistics.median(measured),
               "comm_s_min": min(r["comm_s_min"] for r in ran), "comm_s_max": max(r["comm_s_max"] for r in ran)}
        if "predicted_s" in ran[0]:
            row["predicted_launches"] = [r["predicted_s"] for r in ran]
            row["error_launches"] = [r["error"] for r in ran]
            row["predicted_s"] = statistics.median(row["predicted_launches"])
            row["error"] = row["predicted_s"] / row["comm_s_median"] - 1
        combined.append(row)
    return combined


def predictions(facts: dict[str, Any]) -> list[dict[str, Any]]:
    """Each measured row with the model's prediction beside it, on the network of its own launch."""
    layouts = {(layout["layout"], launch_of(layout)): layout for layout in facts["layouts"]}
    rows = []
    for row in facts["rows"]:
        layout = layouts[row["layout"], launch_of(row)]
        if row.get("error") or not (layout["network"] or {}).get("local_work_in_step"):
            continue
        chosen = strategy(row["strategy"], row["options"])
        replay = layout["network"].get("replay_in_step") or {"bare": 0.0, "pool": 0.0}
        profile = comm_only_profile(facts["model"]["tensors_in_backward_order"],
                                    layout["network"]["local_work_in_step"],
                                    replay["pool" if chosen.fusion == "bucket" else "bare"])
        network = model_network(layout["network"], layout.get("burst_payload_bytes", 0.0),
                                layout.get("shaped_payload_Bps"))
        predicted = pm.predict_step(profile, row["world"], network, chosen).step_s  # from backward's start
        rows.append({**row, "predicted_s": predicted, "error": predicted / row["comm_s_median"] - 1})
    return rows


def model_check(facts: dict[str, Any]) -> dict[str, Any]:
    """The model against every measured strategy, as data: each strategy's median over the launches
    and its prediction (``rows``), each launch's own error (``single_errors``), the layouts not
    modelled, and the two goals per 8-rank layout, each with its verdict as a value (``met``):
    gradientflow (hierarchical) at most ``GOAL_RATIO`` of DDP-style bucketed builtin allreduce, and
    ahead of what ships in PyTorch (``PEER_LABELS``) on communication time (medians)."""
    each = predictions(facts)
    rows = over_launches(each)
    errors = [abs(r["error"]) for r in rows]
    check: dict[str, Any] = {
        "launches": facts.get("launches", 1), "rows": rows, "single_errors": [abs(r["error"]) for r in each],
        "goal_error": GOAL_ERROR, "goal_ratio": GOAL_RATIO,
        "within_goal": sum(e <= GOAL_ERROR for e in errors), "goals": [],
        "unmodelled": sorted({layout["layout"] for layout in facts["layouts"]
                              if not (layout["network"] or {}).get("local_work_in_step")})}
    for layout in sorted({r["layout"] for r in rows if r["world"] == 8}):
        by_label = {variants.canonical(r["strategy"]): r for r in rows if r["layout"] == layout}
        full, ddp = by_label.get(variants.HIERARCHICAL), by_label.get(variants.DDP_STYLE)
        if full and ddp:
            ddp_by_launch = dict(zip(ddp["launches"], ddp["comm_s_launches"]))
            ratio = full["comm_s_median"] / ddp["comm_s_median"]
            check["goals"].append({
                "goal": "ddp_ratio", "layout": layout, "ratio": ratio, "met": ratio <= GOAL_RATIO,
                "full_s": full["comm_s_median"], "ddp_s": ddp["comm_s_median"],
                "by_launch": [[launch, seconds / ddp_by_launch[launch]] for launch, seconds
                              in zip(full["launches"], full["comm_s_launches"]) if launch in ddp_by_launch]})
        peers = [by_label[label] for label in PEER_LABELS if label in by_label]
        if full and peers:
            fewest = min([full, *peers], key=lambda r: r["bytes_per_step"])
            check["goals"].append({
                "goal": "peers", "layout": layout, "full_s": full["comm_s_median"],
                "full_bytes": full["bytes_per_step"],
                "met": all(full["comm_s_median"] < peer["comm_s_median"] for peer in peers),
                "peers": [{"label": variants.canonical(p["strategy"]), "comm_s": p["comm_s_median"],
                           "bytes": p["bytes_per_step"]} for p in peers],
                "fewest": variants.canonical(fewest["strategy"])})
    return check
