"""Small-message allreduce: recursive doubling vs our ring vs gloo's own, by message size ->
results/small_allreduce.md, and from it the switch-over size ``SMALL_MESSAGE_BYTES``.

For each world size one set of gloo processes on loopback (``cluster.world.spawn``) times every
message size (4 B, then times 4) with the three algorithms. Per size the algorithms take turns in
rounds, the order rotating, so load from other processes on a shared machine falls on all of them
alike; in each round an algorithm runs after a barrier, one untimed warm-up call and then a block
of calls back to back (as nccl-tests times an operation, and as a training step issues one small
allreduce after another: a call then also pays for the ranks it waits for). Each call is timed on
its own; a rank's figure is the trimmed mean of its calls (``netbench.trimmed_mean``: with ranks
sharing cores small calls are bimodal, a rank that is not running answers a scheduler slice late,
and the median would miss what that costs), and the table gives the slowest rank's. The number of
calls per block follows from ``budget_s`` and one warm-up call's time, agreed by all ranks.

algbw = bytes / time and busbw = algbw * 2(N-1)/N as in nccl-tests, shown only from
``BANDWIDTH_FROM`` bytes up: below that a call is all latency and a bandwidth says nothing.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from gradientflow_repro.cluster.world import spawn
from gradientflow_repro.comm.recursive_doubling import recursive_doubling_allreduce_
from gradientflow_repro.comm.ring import ring_allreduce_
from gradientflow_repro.provenance import environment_facts
from gradientflow_repro.scaling.netbench import trimmed_mean

ALGORITHMS = ("recursive doubling", "ring", "builtin")
BANDWIDTH_FROM = 64 << 10


def sizes(max_bytes: int) -> list[int]:
    """Message sizes in bytes: 4 B (one fp32), then times 4 up to ``max_bytes``."""
    out, size = [], 4
    while size <= max_bytes:
        out.append(size)
        size *= 4
    return out


def label(size: int) -> str:
    return f"{size} B" if size < 1024 else f"{size >> 10} KiB" if size < 2**20 else f"{size >> 20} MiB"


def _algorithms() -> dict[str, Callable[[torch.Tensor], object]]:
    return {"recursive doubling": recursive_doubling_allreduce_, "ring": ring_allreduce_,
            "builtin": lambda t: dist.all_reduce(t)}


def _agreed_calls(fn: Callable, tensor: torch.Tensor, budget_s: float, rounds: int, min_calls: int,
                  max_calls: int) -> int:
    """Calls per block, the same on every rank: the budget over the slowest rank's warm-up call."""
    fn(tensor)
    started = time.perf_counter()
    fn(tensor)
    seconds = torch.tensor([time.perf_counter() - started])
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return int(min(max_calls, max(min_calls, budget_s / rounds / max(seconds.item(), 1e-7))))


def _measure(rank: int, world: int, out: str, max_bytes: int, budget_s: float, rounds: int, min_calls: int,
             max_calls: int) -> None:
    """One rank's timings; rank 0 saves the rows to ``out/world<N>.pt``."""
    algorithms = _algorithms()
    names = list(algorithms)
    rows = []
    for size in sizes(max_bytes):
        tensor = torch.zeros(size // 4)  # zeros stay zeros: no overflow or denormals over many calls
        calls = {name: _agreed_calls(fn, tensor, budget_s, rounds, min_calls, max_calls)
                 for name, fn in algorithms.items()}
        times: dict[str, list[float]] = {name: [] for name in names}
        for round_ in range(rounds):
            for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                fn = algorithms[name]
                dist.barrier()
                fn(tensor)  # warm-up: the block measures this algorithm after itself
                for _ in range(calls[name]):
                    started = time.perf_counter()
                    fn(tensor)
                    times[name].append(time.perf_counter() - started)
        for name in names:
            seconds = torch.tensor([trimmed_mean(times[name])])
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            rows.append({"world": world, "bytes": size, "algorithm": name, "seconds": seconds.item(),
                         "calls": len(times[name])})
            if rank == 0:
                print(f"world {world} {label(size):>8s} {name:18s} {seconds.item() * 1e6:10.1f} us "
                      f"({len(times[name])} calls)", flush=True)
    if rank == 0:
        torch.save(rows, Path(out) / f"world{world}.pt")


def switch_over(seconds: dict[int, dict[str, float]]) -> Optional[int]:
    """The largest size at which recursive doubling is faster than the ring (None: at none)."""
    faster = [size for size, by in seconds.items() if by["recursive doubling"] < by["ring"]]
    return max(faster) if faster else None


def bench_small(out: Path, worlds: Sequence[int] = (2, 4, 8), max_bytes: int = 4 << 20, budget_s: float = 1.0,
                rounds: int = 3, min_calls: int = 5, max_calls: int = 300,
                command: str = "python scripts/bench_small_allreduce.py") -> str:
    """Time every world size of ``worlds`` and write the Markdown table to ``out``; returns it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    started = time.perf_counter()
    rows = []
    for world in worlds:
        spawn(_measure, world, str(out.parent), max_bytes, budget_s, rounds, min_calls, max_calls, timeout_s=600)
        rows += torch.load(out.parent / f"world{world}.pt", weights_only=True)
        os.remove(out.parent / f"world{world}.pt")
    elapsed = time.perf_counter() - started
    facts = environment_facts()
    machine = facts["gpu"] or f"{facts['cpu']}, {facts['cpu_count']} cores"
    cores = facts["cpu_count"] or 1
    lines = ["# Small-message allreduce: recursive doubling vs ring vs gloo builtin", "",
             f"Machine: {machine}; backend gloo, all ranks on this one machine over loopback, one torch "
             f"thread per rank. torch {facts['torch']}, commit {facts['git_commit']}. Load average at the "
             f"start: {load:.2f}; the run took {elapsed:.0f} s.",
             f"Command: `{command}`.", "",
             "Each cell: time per call in microseconds, float32, the slowest rank's trimmed mean (without "
             f"the fastest and slowest tenth) over {rounds} rounds of calls back to back, each round after a "
             "barrier and one untimed warm-up call, the algorithms taking turns in a rotating order. "
             "ring / rd: the ring's time over recursive doubling's (above 1: recursive doubling is faster). "
             "busbw = bytes/time * 2(N-1)/N (nccl-tests), in GB/s, shown from "
             f"{label(BANDWIDTH_FROM)} up (below, a call is all latency). builtin: gloo's own `all_reduce`.", ""]
    if any(world > cores for world in worlds):
        lines += [f"With {cores} cores, world sizes above {cores} are CPU-bound: ranks take turns on the cores, "
                  "so a step that waits for a peer also waits for the scheduler to run that peer. "
                  "Those rows measure this machine's scheduling as much as the algorithms; on a real "
                  "cluster every rank has its own cores and the latency is the network's.", ""]
    switches: dict[int, Optional[int]] = {}
    for world in worlds:
        seconds = {size: {r["algorithm"]: r["seconds"] for r in rows if (r["world"], r["bytes"]) == (world, size)}
                   for size in sizes(max_bytes)}
        lines += [f"## World size {world}", "",
                  "| size | recursive doubling us | ring us | builtin us | ring / rd "
                  "| rd busbw | ring busbw | builtin busbw |",
                  "|---|---|---|---|---|---|---|---|"]
        for size, by in seconds.items():
            times = " | ".join(f"{by[name] * 1e6:.1f}" for name in ALGORITHMS)
            busbw = " | ".join(f"{size / by[name] * 2 * (world - 1) / world / 1e9:.3f}"
                               if size >= BANDWIDTH_FROM else "-" for name in ALGORITHMS)
            lines.append(f"| {label(size)} | {times} | {by['ring'] / by['recursive doubling']:.2f}x | {busbw} |")
        switch = switches[world] = switch_over(seconds)
        slower_below = [label(s) for s in seconds if switch is not None and s < switch
                        and seconds[s]["recursive doubling"] >= seconds[s]["ring"]]
        if switch is None:
            verdict = "recursive doubling is faster than the ring at no size measured."
        elif switch == max(seconds):
            verdict = (f"recursive doubling is faster than the ring up to the largest size measured, "
                       f"{label(switch)}: the switch-over lies beyond it.")
        else:
            verdict = f"recursive doubling is faster than the ring up to {label(switch)} (the largest such size)."
        if slower_below:
            verdict += f" Below that it is not faster at: {', '.join(slower_below)}."
            if label(4) in slower_below and world > 2:
                p = 1 << (world.bit_length() - 1)
                verdict += (" (With one element all the ring's chunks but one are empty and it leaves empty pieces "
                            f"out: {2 * (world - 1)} messages in all, one after another, against recursive "
                            f"doubling's {p * (p.bit_length() - 1) + 2 * (world - p)}; with the ranks sharing "
                            f"{cores} cores fewer messages is less work.)")
        lines += ["", f"Switch-over at world size {world}: {verdict}", ""]
    chosen = min((s or 0) for s in switches.values())
    lines += ["## The switch-over size", "",
              "| world size | switch-over |", "|---|---|",
              *[f"| {w} | {label(s) if s else 'none'} |" for w, s in switches.items()], "",
              f"Value for `SMALL_MESSAGE_BYTES` (gradientflow_repro/comm/knobs.py): **{chosen}** "
              f"bytes ({label(chosen) if chosen else 'never recursive doubling'}), the smallest switch-over "
              "over the world sizes measured, so that at each of them a message sent by recursive doubling is "
              "one it is faster for. In the alpha-beta model (latency alpha, bandwidth beta per link) the "
              "switch-over is alpha*beta*(2(N-1) - log2 N) / (log2 N - 2(N-1)/N): unbounded at N = 2 (the same "
              "bytes in one step instead of two), about 8 alpha*beta at N = 4 and 8, and growing beyond, so "
              "the smallest measured is the cautious choice for larger worlds too, on a network whose alpha*beta "
              "matches this machine's loopback. Another network has another alpha*beta: measure there.", ""]
    text = "\n".join(lines)
    out.write_text(text)
    return text
