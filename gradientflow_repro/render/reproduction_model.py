"""The report's network and scaling-model sections (``render/reproduction.py``), from the data of
``reproduction.model_check`` and the measured networks: words only, every figure and verdict read."""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from gradientflow_repro.render import size
from gradientflow_repro.render.reproduction_cells import said, spread

Document = Mapping[str, Any]


def network_table(network_by_world: Sequence[Sequence[Any]], default_bytes: int) -> list[str]:
    """The measured networks (``[world, figures]`` by world size) as a table, the backend's own
    allreduce by message size where measured, and how the figures were taken."""
    lines = ["| world | ring: bandwidth (MB/s) | ring: latency per message (us) | one-value allreduce (ms) "
             "| recursive doubling up to |", "|---|---|---|---|---|"]
    for world, measured in network_by_world:
        switch = measured.get("small_message_kb")
        tiny = measured.get("tiny_allreduce_s")
        lines.append(f"| {world} | {measured['bandwidth_Bps'] / 1e6:.1f} | {measured['latency_s'] * 1e6:.0f} "
                     f"| {(float('nan') if tiny is None else tiny) * 1e3:.2f} "
                     f"| {size(switch * 1024) if switch else size(default_bytes) + ' (default)'} |")
    lines += ["", "Ring: latency from a one-element-per-rank ring allreduce over its 2(N-1) messages, bandwidth "
              "from an 8 MiB one. The one-value allreduce is the fp16 wire's shared scale (recursive doubling) "
              "before each message the ring carries (small messages carry their own scale); "
              "CSC's chunk norms (one value per chunk, with the fp16 peak) go by recursive doubling too, priced "
              "at log2(N) steps of the ring's latency. Recursive doubling up to: the largest message our "
              "algorithms send by recursive doubling rather than the ring at that world size "
              "(`comm.small_message_kb`), where the model prices the two equal on the figures measured there "
              f"(`netbench.small_message_kb`), at most the default, {size(default_bytes)} "
              "(measured on loopback)."]
    measured_by = {int(w): m for w, m in network_by_world}
    worlds = [w for w, m in sorted(measured_by.items()) if m.get("builtin_cost_by_size")]
    if worlds:
        costs = {w: dict((size_, s) for size_, s in measured_by[w]["builtin_cost_by_size"]) for w in worlds}
        sizes = sorted({size_ for w in worlds for size_ in costs[w] if size_ > 4 * w})
        lines += ["", "The backend's own allreduce (gloo's, used by `allreduce` and `ddp`), ms per call by message "
                  "size, calls back to back as a training step issues them (the first row: one element per "
                  "rank); the model interpolates between these sizes:", "",
                  "| size | " + " | ".join(f"world {w}" for w in worlds) + " |", "|---|" + "---|" * len(worlds),
                  "| 1 element per rank | "
                  + " | ".join(f"{min(costs[w].items())[1] * 1e3:.2f}" for w in worlds) + " |"]
        lines += [f"| {size(size_)} | " + " | ".join(f"{costs[w][size_] * 1e3:.2f}" if size_ in costs[w] else "-"
                                                    for w in worlds) + " |" for size_ in sizes]
    launches = min(m.get("launches", 1) for m in measured_by.values())
    return lines + ["", "Every figure is the mean over its calls without the fastest and slowest tenth (a step "
                    "pays the sum of many calls, and small calls are bimodal when ranks share cores), then the "
                    f"mean over {launches} separate launch{'es' if launches > 1 else ''} of the ranks."]


def model_check(data: Document) -> list[str]:
    """The model's predictions against the measured steps, its goal, then ``hidden_communication``
    and ``per_tensor_alone``."""
    lines = ["| world | strategy | measured step (ms) | predicted step (ms) | predicted comm exposed (ms) | error |",
             "|---|---|---|---|---|---|"]
    for row in data["rows"]:
        shown = f"{row['label']} (not in the goal)" if row["peer"] else row["label"]
        if "unpriced" in row:
            lines.append(f"| {row['world']} | {shown} | {row['measured_s'][0] * 1e3:.1f} | - | - "
                         f"| not priced: {row['unpriced']} |")
        else:
            lines.append(f"| {row['world']} | {shown} | {spread(row['measured_s'], '.1f', 1e3)} "
                         f"| {row['predicted_s'] * 1e3:.1f} | {row['exposed_s'] * 1e3:.1f} "
                         f"| {row['error'] * 100:+.0f}% |")
    goal = data["goal"]
    if goal:
        lines += ["", f"Goal: within {goal['target']:.0%}. {goal['detail']['within']} of "
                  f"{goal['detail']['predictions']} predictions are; the largest error is "
                  f"{goal['measured'] * 100:.0f}%."]
    return lines + hidden_communication(data["hidden"]) + per_tensor_alone(data["alone"])


def hidden_communication(entries: Sequence[Document]) -> list[str]:
    lines = []
    for entry in entries:
        world, compute, ratio, goal = entry["world"], entry["compute_s"], entry["ratio"], entry["goal"]
        runs = "in its runs to the target" if entry["in_runs_to_target"] else "in runs beside `gradientflow`'s"
        lines.append(f"- world size {world}: `gradientflow`'s step is {ratio:.2f}x the compute-only step "
                     f"({compute * 1e3:.1f} ms: `allreduce`'s step less its wait, {runs}; 1.0 would hide all "
                     f"communication behind backward). Goal at most {goal['target']:g}x: {said(goal['met'])}.")
        behind = entry["behind"]
        if behind:
            lines.append("  The slowest rank's forward and backward took " + " and ".join(
                f"{seconds * 1e3:.1f} ms" for _, seconds in behind) + " longer than rank 0's per step (median; "
                "in " + " and ".join(f"`{name}`'s" for name, _ in behind) + " runs): what the first collective "
                "after backward waits before anything moves (the model above adds `allreduce`'s).")
        free = entry["unshaped"]
        if free:
            cores = entry["cores"]
            crowded = (f" With {world} ranks on {cores} cores they finish backward at different times, and "
                       "that wait is in `allreduce`'s wait, so the compute-only figure leaves it out."
                       if cores and cores < world else "")
            base = free["allreduce_compute_s"]
            drift = (f" (`allreduce`'s compute-only step in the unshaped runs beside them: "
                     f"{base * 1e3:.1f} ms, against {compute * 1e3:.1f}: how far this machine's "
                     "speed moved between the two sets of runs)" if base is not None else "")
            lines.append(f"  With the links unshaped (no rate limit; {free['runs']} short runs, the same "
                         f"settings): {free['step_s'] * 1e3:.1f} ms, {free['step_s'] / compute:.2f}x the compute-only "
                         f"step{drift}, so the link's rate accounts for {ratio - free['step_s'] / compute:+.2f}x. The "
                         "rest is no transfer that overlap could hide better: CSC's local work, the collectives' "
                         "latency and copies on the unshaped links, and the ranks waiting for each other at the first "
                         f"collective after backward.{crowded}")
    return ["", *lines] if lines else []


def per_tensor_alone(rows: Sequence[Document]) -> list[str]:
    if not rows:
        return []
    shown = []
    for row in rows:
        cells = ["- | -" if cell is None else
                 f"{cell[0] * 1e3:.1f} | {cell[1] * 1e3:.1f} ({cell[1] / cell[0] - 1:+.0%})" for cell in row["cells"]]
        shown.append(f"| {row['world']} | {' | '.join(cells)} |")
    return ["", "One allreduce per gradient of this model (in backward order; with the fp16 wire, a large "
            "gradient's one-value scale allreduce first, a small one's scale inside its message), back to "
            "back and alone on the network, against the model's communication time for the same messages:", "",
            "| world | builtin: measured (ms) | builtin: model (ms) | ring: measured (ms) | ring: model (ms) "
            "| ring+fp16: measured (ms) | ring+fp16: model (ms) |", "|---|---|---|---|---|---|---|", *shown]


def _optimizer_note(model: Document) -> str:
    """The optimizer's step as the profile measured it, whole and plain."""
    if model["plain_optimizer_s"] is None:  # (a profile from before it was measured)
        return ""
    return (f" The optimizer's step, measured there too: {model['optimizer_s'] * 1e3:.2f} ms, and "
            f"{model['plain_optimizer_s'] * 1e3:.2f} ms as plain SGD, as it runs while CSC's momentum correction "
            "does its momentum, weight decay and adaptation (that work is in CSC's figure above).")


def _check_runs(model: Document) -> str:
    """Which runs the model is checked against."""
    world, short_at_world = model["world"], model["short_at_world"]
    short = ", ".join(f"`{label}`" for label in short_at_world or [])
    text = (f"at world size {world} the ladder's {model['repeats']} runs to the target"
            + (f", but for {short} {model['check_repeats']} short runs sparse from the start (its runs to the target "
               "are mostly dense warm-up; "
               + ("`allreduce`'s short runs beside them are its reference below)" if model["beside"]
                  else "its ratio to the compute-only step below sets them against `allreduce`'s runs to "
                  "the target)") if short_at_world
               else " (`gradientflow` after its dense warm-up)" if short_at_world is None else ""))
    others = [str(w) for w in model["others"]]
    if others:
        text += (f"; at world size{'s' if len(others) > 1 else ''} {', '.join(others)}, {model['check_repeats']} "
                 "short runs per strategy (sparse from the start)")
    if model["peers"]:
        text += ("; below them, " + ", ".join(f"`{label}`" for label in model["peers"]) + f" at world size {world} "
                 "from their runs to the target (after their dense warm-up), shown where the model prices "
                 "them and not counted in the goal, which is the ladder's")
    return text


def model_lines(model: Document) -> list[str]:
    """The section "Scaling model against measurement"."""
    if not model["checked"]:
        return [f"Not checked here: {model['reason']}.", *per_tensor_alone(model["alone"])]
    low_rank: Optional[float] = model["low_rank_s_per_element"]
    return [
        "`gradientflow_repro/scaling/perfmodel.py` with the measured per-tensor backward profile of this model "
        "(one process) and the measured network above. Measured step time: each run's median logged "
        f"interval, then the median [range] over the repeats: {_check_runs(model)}. "
        "Local work on the communication path, measured in the same process per "
        f"gradient element: CSC {model['sparsify_s_per_element'] * 1e9:.2f} ns, "
        f"fp16 wire {model['wire_cast_s_per_element'] * 1e9:.2f} ns"
        + (f", PowerSGD {low_rank * 1e9:.2f} ns per element of the matrices it compresses" if low_rank else "") + " ("
        + ("scaled by how much the ranks slow each other, not by the per-rank batch" if model["by_contention"]
           else "scaled like the compute") + f").{_optimizer_note(model)}", "", *model_check(model["check"])]
