"""Bus bandwidth of the builtin allreduce, our ring and hierarchical allreduce, side by side ->
results/allreduce.md and .csv.

For each world size, one set of processes (``cluster.world.spawn``) measures every message size
with the three algorithms side by side (in rounds; in each round every algorithm runs a warm-up call
and a block of timed calls back to back, as nccl-tests does), so ratios are not skewed by drift; the
whole sweep is repeated and the table gives the median and the range over the sweeps. Bus bandwidth
follows nccl-tests: algbw = bytes / time, busbw = algbw * 2(N-1)/N (what each link carries for a
bandwidth-optimal allreduce). Hierarchical treats blocks of ``ranks_per_node`` ranks as nodes.
"""

from __future__ import annotations

import csv
import os
import statistics
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from gradientflow_repro.cluster.world import spawn
from gradientflow_repro.comm.base import CommStats
from gradientflow_repro.comm.hierarchical import HierarchicalSum
from gradientflow_repro.comm.ring import DEFAULT_SEGMENT_BYTES, ring_allreduce_
from gradientflow_repro.provenance import environment_facts

BLOCK_CALLS = 3  # timed calls per algorithm and round


def sizes(max_mb: int) -> list[int]:
    """Message sizes in bytes: 4 KiB, then times 4 up to ``max_mb`` MiB."""
    out, size = [], 4 * 1024
    while size <= max_mb * 2**20:
        out.append(size)
        size *= 4
    return out


def _one_call(fn: Callable, tensor: torch.Tensor, device: torch.device) -> float:
    """Seconds of one call, from a common start to the end of the slowest rank."""
    flag = torch.zeros(1, device=device)
    dist.all_reduce(flag)  # start together
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    fn(tensor)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = torch.tensor([time.perf_counter() - started], device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def _time_round_robin(algorithms: dict, tensor: torch.Tensor, budget_s: float,
                      device: torch.device, block: int = BLOCK_CALLS) -> dict[str, list[float]]:
    """Per-call seconds of every algorithm, taken in rounds: in each round every algorithm runs
    one untimed warm-up call and then ``block`` timed calls back to back, as nccl-tests times an
    operation (and as training calls one algorithm again and again). A call is faster after a call
    of its own kind than after another algorithm's (the ring's buffers and the sockets' state are
    warm): timing single calls in turn would charge each algorithm for its predecessor. Rounds
    spread load from other processes over all algorithms alike, and the order rotates from round
    to round. Returns, per algorithm, the median of each round's block."""
    names = list(algorithms)
    times: dict[str, list[float]] = {name: [] for name in algorithms}
    rounds, spent = 0, 0.0
    while rounds < 6 or (spent < budget_s and rounds < 400):
        for name in names[rounds % len(names):] + names[:rounds % len(names)]:
            algorithms[name](tensor)  # warm-up: the block measures this algorithm after itself
            calls = [_one_call(algorithms[name], tensor, device) for _ in range(block)]
            spent += sum(calls)
            times[name].append(statistics.median(calls))
        rounds += 1
    return times


def _segmented(kb: int) -> Callable:
    return lambda t: ring_allreduce_(t, segment_bytes=kb * 1024)


def _measure(rank: int, world: int, backend: str, max_mb: int, per_node: int, out: str, budget_s: float,
             repeats: int, segment_kbs: list[int]) -> None:
    """One rank's sweeps; rank 0 saves the rows to ``out/world<N>.pt``."""
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    hierarchical = HierarchicalSum(per_node if world % per_node == 0 else 1)
    algorithms = {"builtin": lambda t: dist.all_reduce(t), "ring": ring_allreduce_,
                  "hierarchical": lambda t: hierarchical(t, CommStats()),
                  **{_segments_name(kb): _segmented(kb) for kb in segment_kbs}}
    rows = []
    for repeat in range(repeats):  # whole sweeps repeated, so slow drift shows up as spread
        for size in sizes(max_mb):
            tensor = torch.ones(size // 4, device=device)
            timed = _time_round_robin(algorithms, tensor, budget_s, device)
            for name, times in timed.items():
                seconds = statistics.median(times)
                busbw = size / seconds * 2 * (world - 1) / world / 1e9
                # paired within each round, so drift between rounds cancels
                vs_builtin = statistics.median(b / t for b, t in zip(timed["builtin"], times))
                rows.append({"world": world, "repeat": repeat, "bytes": size, "algorithm": name,
                             "seconds": seconds, "calls": len(times), "busbw_GBps": busbw,
                             "vs_builtin": vs_builtin})
                if rank == 0:
                    print(f"world {world} repeat {repeat} {size / 2**20:9.3f} MiB {name:12s} "
                          f"{seconds * 1e3:9.2f} ms busbw {busbw:7.3f} GB/s", flush=True)
            del tensor
    if rank == 0:
        torch.save(rows, Path(out) / f"world{world}.pt")


def _segments_name(kb: int) -> str:
    return f"ring, {kb} KiB segments"


def _figures(rows: list[dict], world: int, size: int, algorithm: str, key: str) -> list[float]:
    """``key`` of every sweep's row for one world size, message size and algorithm."""
    return [r[key] for r in rows if (r["world"], r["bytes"], r["algorithm"]) == (world, size, algorithm)]


def _label(size: int) -> str:
    return f"{size // 1024} KiB" if size < 2**20 else f"{size // 2**20} MiB"


def _spread(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"


def _segments_table(rows: list[dict], world: int, max_mb: int, segment_kbs: list[int]) -> list[str]:
    """ring / builtin with the default segments and with each ``--ring-segment-kb``, side by side."""
    names = ["ring"] + [_segments_name(kb) for kb in segment_kbs]
    lines = [f"Ring segment sizes at world size {world}, each as ring / builtin (paired within rounds):", "",
             f"| size | ring ({DEFAULT_SEGMENT_BYTES // 1024} KiB segments) | "
             + " | ".join(names[1:]) + " |", "|---|" + "---|" * len(names)]
    for size in sizes(max_mb):
        cells = [_spread(_figures(rows, world, size, name, "vs_builtin"), ".2f") + "x" for name in names]
        lines.append(f"| {_label(size)} | {' | '.join(cells)} |")
    return lines + [""]


def _goal_verdict(verdicts: list[tuple[float, float, str]]) -> str:
    """The goal's line from (median ratio, lowest ratio, size label) of each size from 4 MiB up."""
    if not verdicts:
        return "Goal (ring at least 0.9x builtin from 4 MiB up): not judged, no size from 4 MiB up was timed."
    worst = min(verdicts)
    lowest = min(verdicts, key=lambda v: v[1])
    return (f"Goal (ring at least 0.9x builtin from 4 MiB up, median over sweeps): worst {worst[0]:.2f}x "
            f"at {worst[2]}: {'met' if worst[0] >= 0.9 else 'NOT met'}. Lowest single sweep: "
            f"{lowest[1]:.2f}x at {lowest[2]}.")


def bench_allreduce(out: Path, worlds: Sequence[int] = (2, 4), max_mb: int = 256, backend: Optional[str] = None,
                    ranks_per_node: int = 2, budget_s: float = 3.0, repeats: int = 5,
                    segment_kbs: Sequence[int] = (), command: str = "python scripts/bench_allreduce.py") -> str:
    """Sweep every world size of ``worlds`` and write ``out``.csv (every row) and ``out``.md (the
    tables); returns the Markdown. ``backend``: default NCCL with CUDA, else gloo."""
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    segment_kbs = list(segment_kbs)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for world in worlds:
        spawn(_measure, world, backend, max_mb, ranks_per_node, str(out.parent), budget_s, repeats, segment_kbs,
              backend=backend, timeout_s=600)
        rows += torch.load(out.parent / f"world{world}.pt", weights_only=True)
        os.remove(out.parent / f"world{world}.pt")
    with open(out.with_suffix(".csv"), "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    facts = environment_facts()
    machine = facts["gpu"] or f"{facts['cpu']}, {facts['cpu_count']} cores"
    lines = ["# Allreduce bus bandwidth: builtin vs ring vs hierarchical", "",
             f"Machine: {machine}; backend {backend}, all ranks on this one machine "
             f"(hierarchical: blocks of {ranks_per_node} ranks as nodes). torch {facts['torch']}, "
             f"commit {facts['git_commit']}.", f"Command: `{command}`. Each cell: the median over "
             f"{repeats} repeated sweeps of the median time per call, as bus bandwidth, with the "
             "range over the sweeps in brackets. Within a sweep the algorithms are timed side by side, "
             "in rounds (at least 6 per size): in each round every algorithm runs one untimed warm-up "
             f"call and then {BLOCK_CALLS} timed calls back to back (as nccl-tests times an operation, "
             "and as training calls one algorithm again and again), in an order that rotates every "
             "round; a round's figure is the median of its block. ring / builtin: the median over the "
             "rounds of builtin's time over ring's in the same round (paired, so drift between rounds "
             "cancels), then median and range over the sweeps. busbw = bytes/time * 2(N-1)/N "
             "(nccl-tests).", ""]
    for world in worlds:
        lines += [f"## World size {world}", "",
                  "| size | builtin GB/s | ring GB/s | hierarchical GB/s | ring / builtin |",
                  "|---|---|---|---|---|"]
        verdicts = []
        for size in sizes(max_mb):
            busbw = {name: _figures(rows, world, size, name, "busbw_GBps")
                     for name in ("builtin", "ring", "hierarchical")}
            ratios = _figures(rows, world, size, "ring", "vs_builtin")
            label = _label(size)
            cells = [_spread(busbw[name], ".3f") for name in ("builtin", "ring", "hierarchical")]
            lines.append(f"| {label} | {' | '.join(cells)} | {_spread(ratios, '.2f')}x |")
            if size >= 4 * 2**20:
                verdicts.append((statistics.median(ratios), min(ratios), label))
        lines += ["", _goal_verdict(verdicts), ""]
        if segment_kbs:
            lines += _segments_table(rows, world, max_mb, segment_kbs)
    text = "\n".join(lines)
    out.with_suffix(".md").write_text(text)
    return text
