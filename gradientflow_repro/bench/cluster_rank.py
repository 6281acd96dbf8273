"""One rank of the cluster benchmark (``bench.cluster``): the network of its launch, then every
strategy's replayed steps. ``bench.cluster.run_layout`` starts the ranks of a launch, each as

    python -m gradientflow_repro.bench.cluster_rank OUT.json SPEC.json    # RANK, WORLD_SIZE, MASTER_* set

SPEC.json says what to run (the model and its backward order, the strategies with their options,
steps, what to measure of the network); rank 0 writes OUT.json: the measured network and one row
per strategy. A step's communication time is from the start of backward to the end of
``synchronize()`` on the slowest rank; the network's figures are rings between node leaders, inside
a node and over all ranks, as an analytic model takes them (``scaling.cluster_check``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from gradientflow_repro.bench.replay import build, make_replay
from gradientflow_repro.scaling.cluster_check import network_fields
from gradientflow_repro.scaling.netbench import LARGE_BYTES, ring_figures, trimmed_mean

log = logging.getLogger(__name__)
# The leaders' ring is timed again in segments of this size: with two nodes each step of 4 MiB
# segments was one large message each way on one gloo pair, and gloo then often carried the two
# directions one after the other (a 2-rank exchange of 8 MiB took 1x or 2x the wire time, where
# plain TCP sockets in the same namespaces take 1x). A two-rank ring now cuts its segments to
# ``ring.EXCHANGE_SEGMENT_BYTES`` (512 KiB) itself, so with two nodes both rows measure that; with
# more nodes this row shows 1 MiB segments beside the default 4 MiB. With the flat ring, whose
# flows also cross each uplink once each way, it gives the model's uplink bandwidth (the fastest of
# them: ``cluster_check.network_fields``).
SEGMENT_BYTES = 1 << 20


def _timed(work: Callable[[], Any], calls: int, takes_part: bool, back_to_back: bool = False,
           slowest: bool = False) -> float:
    """Trimmed mean seconds per call of ``work`` on the ranks that take part (the others only meet
    the barriers). Each call starts after a barrier of all ranks, or ``back_to_back`` after one
    barrier, as a step issues its collectives. ``slowest``: each call's time is the slowest
    rank's (work that every rank does at once, which the next collective waits for)."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    if takes_part:
        work()  # warm-up
    times = []
    for _ in range(calls):
        if not back_to_back:
            dist.barrier()
        started = time.perf_counter()
        if takes_part:
            work()
        times.append(time.perf_counter() - started)
    if slowest:
        each = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(each, op=dist.ReduceOp.MAX)
        times = each.tolist()
    dist.barrier()
    return trimmed_mean(times)


def _measure_network(rank: int, world: int, per_node: int, full: bool) -> dict[str, Any]:
    """The network of this launch as an analytic model takes it (``perfmodel.Network``'s fields),
    with the rings it was derived from: between node leaders (one rank per node: the uplink),
    inside every node at once, over all ranks; and (``full``) the builtin allreduce by size."""
    import torch
    import torch.distributed as dist

    from gradientflow_repro.comm.base import CommStats
    from gradientflow_repro.comm.recursive_doubling import small_sum
    from gradientflow_repro.comm.ring import ring_allreduce_

    nodes = world // per_node
    node_groups = [dist.new_group(list(range(n * per_node, (n + 1) * per_node))) for n in range(nodes)]
    leaders = dist.new_group([n * per_node for n in range(nodes)])
    mine, leader = node_groups[rank // per_node], rank % per_node == 0
    large = torch.ones(LARGE_BYTES // 4)
    measured: dict[str, Any] = {"ranks_per_node": per_node, "nodes": nodes}

    def rings(ranks: int, group: Any, takes_part: bool, segmented: bool = False) -> dict[str, float]:
        tiny = torch.ones(ranks)
        figures = ring_figures(_timed(lambda: ring_allreduce_(tiny, group), 20, takes_part),
                                _timed(lambda: ring_allreduce_(large, group), 5, takes_part), ranks)
        if segmented:  # the same in 1 MiB segments (see SEGMENT_BYTES)
            figures["segmented"] = ring_figures(
                figures["tiny_s"], _timed(lambda: ring_allreduce_(large, group, SEGMENT_BYTES), 5, takes_part), ranks)
        return figures

    if nodes > 1:
        measured["leaders"] = rings(nodes, leaders, leader, segmented=True)
    if per_node > 1:
        measured["intra"] = rings(per_node, mine, True)
    measured["flat"] = rings(world, None, True)
    scale_max = small_sum(op="max")  # the fp16 wire's shared scale, as it is sent
    measured["tiny_allreduce_s"] = _timed(lambda: scale_max(torch.ones(1), CommStats()), 20, True)
    if full:  # the backend's allreduce (allreduce, ddp) by size, back to back as a step issues them
        sizes = sorted({4 * world, 64, 256, 1024, *[4096 * 4 ** k for k in range(6)], 16 << 20})
        measured["builtin_cost_by_size"] = [
            [size, _timed(lambda t=torch.ones(size // 4): dist.all_reduce(t),
                          10 if size < 1 << 20 else 3 if size <= 4 << 20 else 2, True, back_to_back=True)]
            for size in sizes]
    measured["model_network"] = network_fields(measured)  # perfmodel.Network's fields, for readers of the JSON
    return measured


def _slowest_backward_s(out: Any, synchronize: Callable[[], None]) -> float:
    """Seconds from backward's start to the end of ``synchronize()`` on the slowest rank, every
    rank starting together after a barrier: a replayed step ends when the slowest rank is done."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    started = time.perf_counter()
    out.backward()
    synchronize()
    elapsed = torch.tensor([time.perf_counter() - started])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def _local_work_in_step(shapes: Sequence[tuple[int, ...]]) -> dict[str, float]:
    """CSC's, the fp16 wire's and PowerSGD's local work per element (of the gradients, of the
    gradients, of the matrices PowerSGD compresses) as a step does it: every rank at once on the
    shared cores (on the threads each rank trains with), the slowest rank's time, since the
    collective after it waits for that one. One process alone times each rank's share of a core
    fairly, but the scheduler does not: with more ranks than cores the slowest of them takes well
    over its fair share."""
    from gradientflow_repro.scaling.profile import low_rank_work, sparsify_work, wire_cast_work

    elements = sum(math.prod(shape) for shape in shapes)
    figures = {}
    for key, (work, covered) in (("sparsify_s_per_element", sparsify_work(elements, noise_sketch=False)),
                                 ("wire_cast_s_per_element", wire_cast_work(elements)),
                                 ("low_rank_s_per_element", low_rank_work(shapes))):
        figures[key] = _timed(work, 9, True, slowest=True) / covered if covered else 0.0
    return figures


def _replay_in_step(spec: dict[str, Any], gradients: list[Any], steps: int = 7) -> dict[str, float]:
    """Seconds the replayed backward takes when nothing is sent, as a step does it (every rank at
    once, the slowest rank's; median of ``steps`` after one warm-up): ``bare``, autograd handing each
    parameter its gradient (what a per-tensor strategy sums in place), and ``pool``, through the
    lazy pool with a summing function that sends nothing (its hooks' copies into the pool and
    ``synchronize()``'s write-back of the mean: the work a pooled strategy, lazy, CSC or DDP's
    buckets, does around its messages; DDP's own reducer is C++ and is priced by our pool's time,
    an approximation). With more ranks than cores this is far from negligible, and a model whose
    gradients are all ready at once would miss it."""
    import torch

    from gradientflow_repro.comm.lazy import LazyAllreduce

    def nothing(tensor: torch.Tensor, stats: Any) -> None:
        pass

    figures = {}
    for name in ("bare", "pool"):
        torch.manual_seed(0)
        replay = make_replay(build(spec["model"]), spec["order"], gradients)
        comm = (LazyAllreduce(torch.device("cpu"), nothing, bucket_bytes=1 << 40, overlap=False)
                if name == "pool" else None)
        if comm is not None:
            comm.attach(replay)
        seconds = []
        for step in range(1 + steps):
            elapsed = _slowest_backward_s(replay(), comm.synchronize if comm is not None else lambda: None)
            replay.zero_grad(set_to_none=True)
            if step:
                seconds.append(elapsed)
        if comm is not None:
            comm.close()
        figures[name] = statistics.median(seconds)
    return figures


def _run_strategy(rank: int, spec: dict[str, Any], label: str, options: dict[str, Any], order: list[int],
                  gradients: list[Any]) -> dict[str, Any]:
    """``warmup`` + ``steps`` replayed steps of one strategy (at least the steps it sends whole:
    ``Communicator.steps_sent_whole``); per step the slowest rank's seconds from backward start to
    the end of ``synchronize()``, and this rank's bytes and collectives."""
    import torch

    from gradientflow_repro.comm import build_communicator

    torch.manual_seed(0)
    replay = make_replay(build(spec["model"]), order, gradients)
    optimizer = torch.optim.SGD(replay.parameters(), lr=0.0, momentum=0.9)
    comm = build_communicator(options, torch.device("cpu"))
    # time only steps that send as the strategy does from then on, whatever the warm-up asked for
    warmup = max(spec["warmup"], comm.steps_sent_whole)
    try:
        train = comm.attach(replay, optimizer)
        seconds, sent, collectives, waits = [], [], [], []
        for step in range(warmup + spec["steps"]):
            comm.begin_step(epoch=10.0)  # CSC: past any dense warm-up
            out = train()  # builds the chain (and under DDP, its forward bookkeeping)
            elapsed = _slowest_backward_s(out, comm.synchronize)
            comm.end_step(True)
            stats = comm.stats.take()
            optimizer.zero_grad(set_to_none=True)
            if step >= warmup:
                seconds.append(elapsed)
                sent.append(stats["bytes"])
                collectives.append(stats["collectives"])
                waits.append(stats["wait_s"])
    finally:
        comm.close()
    return {"strategy": label, "options": options, "comm_s_median": statistics.median(seconds),
            "comm_s_min": min(seconds), "comm_s_max": max(seconds), "comm_s_all": seconds,
            "sync_wait_s_median": statistics.median(waits), "bytes_per_step": statistics.median(sent),
            "bytes_per_step_max": max(sent), "collectives_per_step": statistics.median(collectives),
            "warmup_steps": warmup, "error": None}


def _measure(rank: int, world: int, out: Path, spec_file: Path) -> None:
    """One rank's share of a layout: the network, then every strategy; rank 0 writes ``out``."""
    import torch

    spec = json.loads(spec_file.read_text())
    per_node = spec["ranks_per_node"]
    started = time.perf_counter()
    measured = _measure_network(rank, world, per_node, spec["measure"] == "full") if spec["measure"] else None
    if measured:
        log.info(f"network: measured in {time.perf_counter() - started:.0f}s")
    model = build(spec["model"])
    params = [p for p in model.parameters() if p.requires_grad]
    generator = torch.Generator().manual_seed(1000 + rank)  # each rank its own fixed gradients
    gradients = [torch.randn(p.shape, generator=generator) for p in params]
    if measured:
        measured["local_work_in_step"] = _local_work_in_step([tuple(p.shape) for p in params])
        measured["replay_in_step"] = _replay_in_step(spec, gradients)
    rows = []
    strategies = _with_switch_over(spec["strategies"], measured, world) if measured else spec["strategies"]
    for label, options, _ in strategies:
        try:
            row = _run_strategy(rank, spec, label, options, spec["order"], gradients)
        except Exception as error:  # noqa: BLE001 (one strategy failing on every rank: report it, go on)
            row = {"strategy": label, "options": options, "error": f"{type(error).__name__}: {error}"}
        rows.append(row)
        shown = (f"{row['comm_s_median']:.3f}s/step, {row['bytes_per_step'] / 2**20:.2f} MiB, "
                 f"{row['collectives_per_step']:.0f} collectives" if row["error"] is None else row["error"])
        log.info(f"{label}: {shown} ({time.perf_counter() - started:.0f}s into the launch)")
    if rank == 0:
        out.write_text(json.dumps({"network": measured, "rows": rows}))


def _with_switch_over(strategies: list[list[Any]], measured: dict[str, Any], world: int) -> list[list[Any]]:
    """Each strategy of our own algorithms with ``comm.small_message_kb`` set to this network's
    switch-over between recursive doubling and its ring (``perfmodel.switch_over_bytes`` on the
    figures just measured: a shaped uplink's latency x bandwidth is far below loopback's, where
    the default was measured), the same on every rank (rank 0's figures). Each strategy comes as
    [label, options, algorithm] (its allreduce algorithm, which the driver reads from comm/)."""
    import torch.distributed as dist

    from gradientflow_repro.scaling.cluster_check import model_network
    from gradientflow_repro.scaling.perfmodel import switch_over_bytes

    net = model_network(measured)
    chosen = [algorithm for _, _, algorithm in strategies]
    sizes = [None if algorithm == "builtin" else max(1, switch_over_bytes(world, net, algorithm) // 1024)
             for algorithm in chosen]
    dist.broadcast_object_list(sizes, src=0)
    return [[label, options if size is None else {**options, "small_message_kb": size}, algorithm]
            for (label, options, algorithm), size in zip(strategies, sizes)]


def main(argv: Optional[Sequence[str]] = None) -> None:
    """A rank of the benchmark, as ``run_ranks`` starts it: ``OUT.json SPEC.json``."""
    from gradientflow_repro import logs
    from gradientflow_repro.cluster.world import run_rank

    out, spec_file = (Path(a) for a in (sys.argv[1:] if argv is None else argv))
    logs.configure("bench_cluster", int(os.environ["RANK"]))  # rank 0's lines start with "[": relayed
    run_rank(_measure, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", out, spec_file,
             timeout_s=60)  # a step or a measured call takes seconds: a hang fails in a minute


if __name__ == "__main__":
    main()
