"""The benchmarks' Markdown under results/, each from the JSON document its benchmark writes
(``gradientflow_repro/bench/``): allreduce bus bandwidth, small-message allreduce, communication
strategies on real gradients, checkpoints, the loader and the cluster benchmark
(``render/bench_cluster.py``). Every figure and verdict comes from the document: a goal's
``met`` is decided where it is measured, and here only worded.
"""

from __future__ import annotations

import statistics
from typing import Any, Mapping, Sequence

from gradientflow_repro.render import table
from gradientflow_repro.render.bench_cluster import cluster_comm

__all__ = ["allreduce", "checkpoint", "cluster_comm", "comm", "loader", "small_allreduce"]


def _met(flag: bool) -> str:
    return "met" if flag else "NOT met"


def _machine_line(environment: Mapping[str, Any]) -> str:
    return environment.get("gpu") or f"{environment['cpu']}, {environment['cpu_count']} cores"


# ---------------------------------------------------------------------------------------- allreduce
def _size_label(size: int) -> str:
    return f"{size // 1024} KiB" if size < 2**20 else f"{size // 2**20} MiB"


def _spread(values: Sequence[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"


def _allreduce_goal(goal: Mapping[str, Any]) -> str:
    if not goal["judged"]:
        return (f"Goal (ring at least {goal['ratio']:g}x builtin from {_size_label(goal['from_bytes'])} up): "
                f"not judged, no size from {_size_label(goal['from_bytes'])} up was timed.")
    return (f"Goal (ring at least {goal['ratio']:g}x builtin from {_size_label(goal['from_bytes'])} up, median "
            f"over sweeps): worst {goal['worst_median']:.2f}x at {_size_label(goal['worst_bytes'])}: "
            f"{_met(goal['met'])}. Lowest single sweep: {goal['lowest']:.2f}x at {_size_label(goal['lowest_bytes'])}.")


def allreduce(doc: Mapping[str, Any]) -> str:
    """results/allreduce.md: per world size, bus bandwidth by size (median and range over the
    sweeps), the ring's ratio to builtin, the goal's verdict, and the ring's segment sizes."""
    env = doc["provenance"]["environment"]
    lines = ["# Allreduce bus bandwidth: builtin vs ring vs hierarchical", "",
             f"Machine: {_machine_line(env)}; backend {doc['backend']}, all ranks on this one machine "
             f"(hierarchical: blocks of {doc['ranks_per_node']} ranks as nodes). torch {env['torch']}, "
             f"commit {env['git_commit']}.", f"Command: `{doc['provenance']['command']}`. Each cell: the median over "
             f"{doc['repeats']} repeated sweeps of the median time per call, as bus bandwidth, with the "
             "range over the sweeps in brackets. Within a sweep the algorithms are timed side by side, "
             "in rounds (at least 6 per size): in each round every algorithm runs one untimed warm-up "
             f"call and then {doc['block_calls']} timed calls back to back (as nccl-tests times an operation, "
             "and as training calls one algorithm again and again), in an order that rotates every "
             "round; a round's figure is the median of its block. ring / builtin: the median over the "
             "rounds of builtin's time over ring's in the same round (paired, so drift between rounds "
             "cancels), then median and range over the sweeps. busbw = bytes/time * 2(N-1)/N "
             "(nccl-tests).", ""]
    names = ("builtin", "ring", "hierarchical")
    for world in doc["worlds"]:
        rows = [[_size_label(s["bytes"]), *(_spread(s["busbw_GBps"][name], ".3f") for name in names),
                 _spread(s["vs_builtin"]["ring"], ".2f") + "x"] for s in world["sizes"]]
        lines += [f"## World size {world['world']}", "",
                  table(["size", "builtin GB/s", "ring GB/s", "hierarchical GB/s", "ring / builtin"], rows), "",
                  _allreduce_goal(world["goal"]), ""]
        segments = [name for name in world["sizes"][0]["vs_builtin"] if name != "ring"]
        if segments:
            rows = [[_size_label(s["bytes"]), *(_spread(s["vs_builtin"][name], ".2f") + "x"
                                                for name in ["ring", *segments])] for s in world["sizes"]]
            lines += [f"Ring segment sizes at world size {world['world']}, each as ring / builtin (paired within "
                      "rounds):", "", table(["size", f"ring ({doc['default_segment_kb']} KiB segments)", *segments],
                                            rows), ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- small allreduce
def _bytes_label(size: int) -> str:
    return f"{size} B" if size < 1024 else f"{size >> 10} KiB" if size < 2**20 else f"{size >> 20} MiB"


SMALL_ALGORITHMS = ("recursive doubling", "ring", "builtin")


def _switch_verdict(world: Mapping[str, Any], cores: int) -> str:
    switch, largest = world["switch_over"], world["sizes"][-1]["bytes"]
    if switch is None:
        verdict = "recursive doubling is faster than the ring at no size measured."
    elif switch == largest:
        verdict = (f"recursive doubling is faster than the ring up to the largest size measured, "
                   f"{_bytes_label(switch)}: the switch-over lies beyond it.")
    else:
        verdict = f"recursive doubling is faster than the ring up to {_bytes_label(switch)} (the largest such size)."
    slower = world["slower_below"]
    if slower:
        verdict += f" Below that it is not faster at: {', '.join(_bytes_label(s) for s in slower)}."
        n = world["world"]
        if 4 in slower and n > 2:
            p = 1 << (n.bit_length() - 1)
            verdict += (" (With one element all the ring's chunks but one are empty and it leaves empty pieces "
                        f"out: {2 * (n - 1)} messages in all, one after another, against recursive "
                        f"doubling's {p * (p.bit_length() - 1) + 2 * (n - p)}; with the ranks sharing "
                        f"{cores} cores fewer messages is less work.)")
    return verdict


def small_allreduce(doc: Mapping[str, Any]) -> str:
    """results/small_allreduce.md: microseconds per call by size, the switch-over per world size and
    the value for ``SMALL_MESSAGE_BYTES`` that follows."""
    env = doc["provenance"]["environment"]
    cores = env["cpu_count"] or 1
    lines = ["# Small-message allreduce: recursive doubling vs ring vs gloo builtin", "",
             f"Machine: {_machine_line(env)}; backend gloo, all ranks on this one machine over loopback, one torch "
             f"thread per rank. torch {env['torch']}, commit {env['git_commit']}. Load average at the "
             f"start: {doc['load_average']:.2f}; the run took {doc['elapsed_s']:.0f} s.",
             f"Command: `{doc['provenance']['command']}`.", "",
             "Each cell: time per call in microseconds, float32, the slowest rank's trimmed mean (without "
             f"the fastest and slowest tenth) over {doc['rounds']} rounds of calls back to back, each round after a "
             "barrier and one untimed warm-up call, the algorithms taking turns in a rotating order. "
             "ring / rd: the ring's time over recursive doubling's (above 1: recursive doubling is faster). "
             "busbw = bytes/time * 2(N-1)/N (nccl-tests), in GB/s, shown from "
             f"{_bytes_label(doc['bandwidth_from'])} up (below, a call is all latency). builtin: gloo's own "
             "`all_reduce`.", ""]
    if any(world["world"] > cores for world in doc["worlds"]):
        lines += [f"With {cores} cores, world sizes above {cores} are CPU-bound: ranks take turns on the cores, "
                  "so a step that waits for a peer also waits for the scheduler to run that peer. "
                  "Those rows measure this machine's scheduling as much as the algorithms; on a real "
                  "cluster every rank has its own cores and the latency is the network's.", ""]
    for world in doc["worlds"]:
        n, rows = world["world"], []
        for entry in world["sizes"]:
            size, by = entry["bytes"], entry["seconds"]
            busbw = [f"{size / by[name] * 2 * (n - 1) / n / 1e9:.3f}" if size >= doc["bandwidth_from"] else "-"
                     for name in SMALL_ALGORITHMS]
            rows.append([_bytes_label(size), *(f"{by[name] * 1e6:.1f}" for name in SMALL_ALGORITHMS),
                         f"{by['ring'] / by['recursive doubling']:.2f}x", *busbw])
        lines += [f"## World size {n}", "",
                  table(["size", "recursive doubling us", "ring us", "builtin us", "ring / rd", "rd busbw",
                         "ring busbw", "builtin busbw"], rows), "",
                  f"Switch-over at world size {n}: {_switch_verdict(world, cores)}", ""]
    chosen = doc["small_message_bytes"]
    lines += ["## The switch-over size", "",
              table(["world size", "switch-over"], [[w["world"], _bytes_label(w["switch_over"]) if w["switch_over"]
                                                     else "none"] for w in doc["worlds"]]), "",
              f"Value for `SMALL_MESSAGE_BYTES` (gradientflow_repro/comm/knobs.py): **{chosen}** "
              f"bytes ({_bytes_label(chosen) if chosen else 'never recursive doubling'}), the smallest switch-over "
              "over the world sizes measured, so that at each of them a message sent by recursive doubling is "
              "one it is faster for. In the alpha-beta model (latency alpha, bandwidth beta per link) the "
              "switch-over is alpha*beta*(2(N-1) - log2 N) / (log2 N - 2(N-1)/N): unbounded at N = 2 (the same "
              "bytes in one step instead of two), about 8 alpha*beta at N = 4 and 8, and growing beyond, so "
              "the smallest measured is the cautious choice for larger worlds too, on a network whose alpha*beta "
              "matches this machine's loopback. Another network has another alpha*beta: measure there.", ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- comm
def _comm_goal(goal: Mapping[str, Any]) -> str:
    if goal["goal"] == "lazy_wait":
        return (f"lazy with overlap waits at most half as long as per-tensor allreduce on ResNet-50: "
                f"{goal['config']} waits {goal['wait_s']:.3f}s vs {goal['dense_wait_s']:.3f}s "
                f"({goal['ratio']:.2f}x): {_met(goal['met'])}")
    return (f"csc at density {goal['density']:g} puts at most {100 * goal['limit']:.0f}% of the dense bytes on the "
            f"wire ({goal['model']}): {100 * goal['share']:.1f}%: {_met(goal['met'])}")


def comm(doc: Mapping[str, Any]) -> str:
    """results/comm.md: per model, every strategy's wait, step, bytes and collectives; the goals."""
    env = doc["provenance"]["environment"]
    lines = ["# Communication strategies on AlexNet and ResNet-50 gradients", "",
             f"Machine: {env['cpu']}, {env['cpu_count']} cores, no GPU; {doc['world']} gloo ranks on "
             f"this machine (loopback, no network emulation). torch {env['torch']}, commit {env['git_commit']}.",
             f"Command: `{doc['provenance']['command']}`. Batch 2 of {doc['image']}x{doc['image']} random images "
             f"per rank (the gradient shapes are the real ones); medians of {doc['steps']} steps after one warm-up "
             "step (PowerSGD: after the steps it sends whole, `Communicator.steps_sent_whole`). "
             "Bytes: what this rank sent (ring-equivalent 2(N-1)/N of the payload for builtin collectives). "
             "DDP and its hooks (`ddp`, `ddp-fp16`, `powersgd`) reduce inside backward, so they wait "
             "nothing in `synchronize()`: compare steps.", ""]
    for model in doc["models"]:
        rows = [[r["config"], f"{r['wait_s']:.3f}", f"{r['step_s']:.3f}", f"{r['bytes'] / 2**20:.1f}",
                 f"{100 * r['of_dense']:.1f}%", f"{r['collectives']:.0f}"] for r in model["rows"]]
        lines += [f"## {model['model']} ({model['params'] / 1e6:.1f}M parameters, "
                  f"{model['params'] * 4 / 2**20:.0f} MiB of fp32 gradients)", "",
                  table(["strategy", "wait in synchronize (s/step)", "step (s)", "MiB sent/step", "of dense",
                         "collectives/step"], rows), ""]
    lines += ["## Goals", ""] + [f"- {_comm_goal(goal)}" for goal in doc["goals"]] + [""]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------- checkpoint
def checkpoint(doc: Mapping[str, Any]) -> str:
    """results/checkpoint.md: save and resume time by world size, and the 512-rank projection with
    its verdict against the preemption warning."""
    env, fs = doc["provenance"]["environment"], doc["file_system"]
    cores = env["cpu_count"] or 1
    rows = [[m["world"], f"{m['bytes_per_rank'] / 1e6:.1f} MB", f"{m['total_bytes'] / 1e6:.0f} MB",
             f"{m['save_s']:.2f}", f"{m['resume_s']:.2f}", f"{m['old_s']:.2f}"] for m in doc["measured"]]
    warning = doc["warning_s"]
    projected = [[p["label"], f"{p['params'] / 1e6:.1f} M", f"{p['per_rank_gb']:.2f} GB", f"{p['total_gb']:.0f} GB",
                  f"{p['save_s']:.0f}", f"{p['resume_s']:.0f}", f"{p['old_save_s']:.0f}", f"{p['old_resume_s']:.0f}",
                  f"{'yes' if p['within_warning'] else 'no'} (previous: {'yes' if p['old_within_warning'] else 'no'})"]
                 for p in doc["projection"]]
    lines = ["# Checkpoints: save and resume time against world size", "",
             f"Machine: {_machine_line(env)}; gloo ranks on this one machine, one local disk (files read back from "
             f"its page cache). torch {env['torch']}, commit {env['git_commit']}. The run took "
             f"{doc['elapsed_s']:.0f} s.", f"Command: `{doc['provenance']['command']}`.", "",
             f"Per rank: a CSC-like state of {doc['rank_mb']:g} MB (residual + velocity, fp32; AlexNet-BN's is "
             f"about 490 MB); rank 0 also a shared state of {doc['shared_mb']:g} MB. Each figure: the slowest rank's "
             f"seconds, median of {doc['repeats']}. *rank 0 hashes all*: what the previous design added at every "
             "save and every resume (rank 0 alone hashing every rank's file, the others waiting).", "",
             table(["world size", "bytes per rank", "total bytes", "save s", "resume s (verify + load)",
                    "rank 0 hashes all s"], rows), "",
             f"With {cores} cores, ranks beyond {cores} take turns on them and share one disk: here the "
             "save and resume times grow with the total bytes, as they would on one file-system client; "
             "what the table shows is that no rank does more than its own share (save and resume stay "
             "one rank's file of work per rank), while *rank 0 hashes all* grows with the world size.", "",
             f"## Projection: {doc['ranks']} ranks ({doc['ranks'] // doc['ranks_per_node']} nodes of "
             f"{doc['ranks_per_node']}), `comm=gradientflow`", "",
             f"File system: {fs['aggregate_gbps']:g} GB/s aggregate, {fs['per_node_gbps']:g} GB/s per client node "
             f"(a mid-size Lustre or GPFS, one 100 Gb/s link per node), {fs['stream_gbps']:g} GB/s for one process "
             f"reading or writing one file; SHA-256 at {doc['hash_gbps']:.2f} GB/s per stream (measured here). "
             "Per rank: residual + velocity in fp32 (8 bytes per parameter; "
             "the residual covers the weights CSC sparsifies, taken here as every parameter); shared: "
             "weights + momentum in fp32, once. Save: max(total / aggregate, one node's bytes / per-node, "
             "rank 0's two files / one stream); "
             "resume: every rank reads shared + its own file (same bounds) and hashes them in parallel. "
             f"Previous design: plus rank 0 reading and hashing every file, one after another. Against the "
             f"{warning:.0f} s preemption warning (`--signal=USR1@{warning:.0f}`).", "",
             table(["model", "parameters", "per rank", "per checkpoint", "save s", "resume s", "previous save s",
                    "previous resume s", f"save within {warning:.0f} s"], projected), "",
             "Keep=3 holds three such checkpoints. The save is bound by the aggregate bandwidth (total "
             "bytes / aggregate), no longer by one rank's hashing.", ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- loader
def _made_by(part: Mapping[str, Any]) -> str:
    env = part["provenance"]["environment"]
    return (f"Made by `{part['provenance']['command']}` at commit {env['git_commit']} on {env['cpu']}, "
            f"{env['cpu_count']} cores, no GPU; torch {env['torch']}, DALI {env['dali']}.")


def loader(doc: Mapping[str, Any]) -> str:
    """results/loader.md: each part the document holds (loaders and harness overhead, the training
    feeder, shards against files), each under the provenance of the run that measured it."""
    from gradientflow_repro.render.bench_loader import feeder_section, loaders_section, shards_section

    lines = ["# Data loader and harness overhead", ""]
    if doc.get("loaders"):
        lines += loaders_section(doc["loaders"])
    if doc.get("feeder"):
        lines += ["## Training feeder alone", "", _made_by(doc["feeder"]), "", *feeder_section(doc["feeder"])]
    if doc.get("shards"):
        lines += ["## ImageNet from shards against files", "", *shards_section(doc["shards"])]
    return "\n".join(lines).rstrip("\n") + "\n"
