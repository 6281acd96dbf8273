"""Small-message allreduce: recursive doubling vs our ring vs gloo's own, by message size ->
results/small_allreduce.json (rendered to .md), and from it the switch-over size ``SMALL_MESSAGE_BYTES``.

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

import logging
import os
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from gradientflow_repro import logs, render
from gradientflow_repro.bench import provenance
from gradientflow_repro.cluster.world import spawn
from gradientflow_repro.comm.recursive_doubling import recursive_doubling_allreduce_
from gradientflow_repro.comm.ring import ring_allreduce_
from gradientflow_repro.scaling.netbench import trimmed_mean

ALGORITHMS = ("recursive doubling", "ring", "builtin")
BANDWIDTH_FROM = 64 << 10
KIND = "bench.small_allreduce"
log = logging.getLogger(__name__)


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
    logs.configure("bench_small_allreduce", rank)
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
            log.info(f"world {world} {label(size):>8s} {name:18s} {seconds.item() * 1e6:10.1f} us "
                     f"({len(times[name])} calls)")
    if rank == 0:
        torch.save(rows, Path(out) / f"world{world}.pt")


def switch_over(seconds: dict[int, dict[str, float]]) -> Optional[int]:
    """The largest size at which recursive doubling is faster than the ring (None: at none)."""
    faster = [size for size, by in seconds.items() if by["recursive doubling"] < by["ring"]]
    return max(faster) if faster else None


def bench_small(out: Path, worlds: Sequence[int] = (2, 4, 8), max_bytes: int = 4 << 20, budget_s: float = 1.0,
                rounds: int = 3, min_calls: int = 5, max_calls: int = 300,
                command: str = "python scripts/bench_small_allreduce.py") -> str:
    """Time every world size of ``worlds``; write the figures, each world size's switch-over and the
    value for ``SMALL_MESSAGE_BYTES`` beside ``out`` (.json, kind ``bench.small_allreduce``) and
    the Markdown rendered from them to ``out``; returns the Markdown."""
    out.parent.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    started = time.perf_counter()
    rows = []
    for world in worlds:
        spawn(_measure, world, str(out.parent), max_bytes, budget_s, rounds, min_calls, max_calls, timeout_s=600)
        rows += torch.load(out.parent / f"world{world}.pt", weights_only=True)
        os.remove(out.parent / f"world{world}.pt")
    elapsed = time.perf_counter() - started
    document = {"provenance": provenance(command, list(worlds)), "load_average": load, "elapsed_s": elapsed,
                "rounds": rounds, "bandwidth_from": BANDWIDTH_FROM, "worlds": []}
    for world in worlds:
        seconds = {size: {r["algorithm"]: r["seconds"] for r in rows if (r["world"], r["bytes"]) == (world, size)}
                   for size in sizes(max_bytes)}
        switch = switch_over(seconds)
        document["worlds"].append({
            "world": world, "sizes": [{"bytes": size, "seconds": by} for size, by in seconds.items()],
            "switch_over": switch, "slower_below": [s for s in seconds if switch is not None and s < switch
                                                    and seconds[s]["recursive doubling"] >= seconds[s]["ring"]]})
    # the smallest switch-over measured: at every world size a message sent by recursive doubling is
    # one it is faster for
    document["small_message_bytes"] = min((w["switch_over"] or 0) for w in document["worlds"])
    data = render.write_data(out.with_suffix(".json"), KIND, document)
    return render.render_file(data, out).read_text()
