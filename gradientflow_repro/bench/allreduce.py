"""Bus bandwidth of the builtin allreduce, our ring and hierarchical allreduce, side by side ->
results/allreduce.json and .csv, rendered to results/allreduce.md.

For each world size, one set of processes (``cluster.world.spawn``) measures every message size
with the three algorithms side by side (in rounds; in each round every algorithm runs a warm-up call
and a block of timed calls back to back, as nccl-tests does), so ratios are not skewed by drift; the
whole sweep is repeated and the table gives the median and the range over the sweeps. Bus bandwidth
follows nccl-tests: algbw = bytes / time, busbw = algbw * 2(N-1)/N (what each link carries for a
bandwidth-optimal allreduce). Hierarchical treats blocks of ``ranks_per_node`` ranks as nodes.
"""

from __future__ import annotations

import csv
import logging
import os
import statistics
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from gradientflow_repro import logs, render
from gradientflow_repro.bench import provenance
from gradientflow_repro.cluster.world import spawn
from gradientflow_repro.comm.base import CommStats
from gradientflow_repro.comm.hierarchical import HierarchicalSum
from gradientflow_repro.comm.ring import DEFAULT_SEGMENT_BYTES, ring_allreduce_

log = logging.getLogger(__name__)
BLOCK_CALLS = 3  # timed calls per algorithm and round
GOAL_RATIO, GOAL_FROM_BYTES = 0.9, 4 << 20  # the ring at least 0.9x builtin from 4 MiB up
KIND = "bench.allreduce"


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
    logs.configure("bench_allreduce", rank)
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
                log.info(f"world {world} repeat {repeat} {size / 2**20:9.3f} MiB {name:12s} "
                         f"{seconds * 1e3:9.2f} ms busbw {busbw:7.3f} GB/s")
            del tensor
    if rank == 0:
        torch.save(rows, Path(out) / f"world{world}.pt")


def _segments_name(kb: int) -> str:
    return f"ring, {kb} KiB segments"


def _figures(rows: list[dict], world: int, size: int, algorithm: str, key: str) -> list[float]:
    """``key`` of every sweep's row for one world size, message size and algorithm."""
    return [r[key] for r in rows if (r["world"], r["bytes"], r["algorithm"]) == (world, size, algorithm)]


def goal(sizes_of_world: list[dict], ratio: float = GOAL_RATIO, from_bytes: int = GOAL_FROM_BYTES) -> dict:
    """The goal's verdict for one world size (``summary``'s sizes): the ring at least ``ratio`` x
    builtin, by the median over the sweeps, at every size from ``from_bytes`` up; with the worst
    median and the lowest single sweep. Not judged (``met`` None) where no such size was timed."""
    judged = [(statistics.median(s["vs_builtin"]["ring"]), min(s["vs_builtin"]["ring"]), s["bytes"])
              for s in sizes_of_world if s["bytes"] >= from_bytes]
    verdict = {"ratio": ratio, "from_bytes": from_bytes, "judged": bool(judged), "met": None}
    if judged:
        worst, lowest = min(judged), min(judged, key=lambda v: v[1])
        verdict.update(met=worst[0] >= ratio, worst_median=worst[0], worst_bytes=worst[2], lowest=lowest[1],
                       lowest_bytes=lowest[2])
    return verdict


def summary(rows: list[dict], worlds: Sequence[int], max_mb: int, segment_kbs: Sequence[int]) -> list[dict]:
    """Per world size and message size, every sweep's bus bandwidth by algorithm and ratio to
    builtin by ring variant (from the CSV's rows), and the goal's verdict."""
    out = []
    for world in worlds:
        entries = [{"bytes": size,
                    "busbw_GBps": {name: _figures(rows, world, size, name, "busbw_GBps")
                                   for name in ("builtin", "ring", "hierarchical")},
                    "vs_builtin": {name: _figures(rows, world, size, name, "vs_builtin")
                                   for name in ["ring", *(_segments_name(kb) for kb in segment_kbs)]}}
                   for size in sizes(max_mb)]
        out.append({"world": world, "sizes": entries, "goal": goal(entries)})
    return out


def bench_allreduce(out: Path, worlds: Sequence[int] = (2, 4), max_mb: int = 256, backend: Optional[str] = None,
                    ranks_per_node: int = 2, budget_s: float = 3.0, repeats: int = 5,
                    segment_kbs: Sequence[int] = (), command: str = "python scripts/bench_allreduce.py") -> str:
    """Sweep every world size of ``worlds`` and write ``out``.csv (every row), ``out``.json (every
    sweep's figures and the goal's verdicts, kind ``bench.allreduce``) and ``out``.md rendered from
    it; returns the Markdown. ``backend``: default NCCL with CUDA, else gloo."""
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
    document = {"provenance": provenance(command, list(worlds)), "backend": backend,
                "ranks_per_node": ranks_per_node, "repeats": repeats, "block_calls": BLOCK_CALLS,
                "default_segment_kb": DEFAULT_SEGMENT_BYTES // 1024, "segment_kbs": segment_kbs,
                "worlds": summary(rows, worlds, max_mb, segment_kbs)}
    data = render.write_data(out.with_suffix(".json"), KIND, document)
    return render.render_file(data, out.with_suffix(".md")).read_text()
