"""Communication alone, on an emulated cluster of nodes: what an analytic scaling model is checked
against, in the regime where the paper's effects live (the network, not the CPU, is the limit).

For a model's real gradients (their sizes, and the order in which backward makes them ready,
recorded once from a real backward pass) every rank runs steps without training: a tiny autograd
graph (``Replay``) releases a fixed random gradient for each parameter in backward order with no
computation in between, so the communicators' post-accumulate-grad hooks (and DDP's) fire as in real
training, then ``comm.synchronize()``. A step's communication time is from the start of backward to
the end of ``synchronize()``, on the slowest rank. Communicators come from the factory, as the
trainer builds them; CSC is in its sparse phase (epoch 10, after its dense warm-up).

Each layout (nodes x ranks per node) is one launch of the ranks into the emulated cluster
(``cluster.netemu``: a namespace per node, ranks of a node on its loopback, one tbf-shaped uplink
per node), and measures in the same launch the network as an analytic model needs it: per-message
latency and bandwidth between node leaders (the uplink), inside a node, and over the flat ring of
all ranks, and the backend's own allreduce by message size. Every layout is launched ``launches``
times, in rounds (each round launches every layout once, so a drift of the shared host touches
them alike): with more ranks than cores a strategy's step moves between launches far more than
within one, so one launch is a draw, and what is reported and set against the
model is the median over the launches, each launch's figure beside it. Each rank runs this module:

    python -m gradientflow_repro.bench.cluster OUT.json SPEC.json    # RANK, WORLD_SIZE, MASTER_* set

The rate is checked to make the runs network-bound: the dense strategies of the first layout run
again on links twice as fast (the largest must take about half as long) and unshaped (what CPU and
per-message costs alone take). ``scripts/bench_cluster.py`` is the command line.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from gradientflow_repro import REPO
from gradientflow_repro.cluster import netemu
from gradientflow_repro.cluster.launch import network, run_ranks
from gradientflow_repro.comm import registry
from gradientflow_repro.config import compose
from gradientflow_repro.reproduction.progress import MACHINE_KEYS, Progress, Timeline
from gradientflow_repro.scaling.cluster_check import launch_of, markdown_lines, network_fields, over_launches
from gradientflow_repro.scaling.netbench import LARGE_BYTES, ring_figures, trimmed_mean

MODULE = ("-m", "gradientflow_repro.bench.cluster")
# The leaders' ring is timed again in segments of this size: with two nodes each step of 4 MiB
# segments was one large message each way on one gloo pair, and gloo then often carried the two
# directions one after the other (a 2-rank exchange of 8 MiB took 1x or 2x the wire time, where
# plain TCP sockets in the same namespaces take 1x). A two-rank ring now cuts its segments to
# ``ring.EXCHANGE_SEGMENT_BYTES`` (512 KiB) itself, so with two nodes both rows measure that; with
# more nodes this row shows 1 MiB segments beside the default 4 MiB. With the flat ring, whose
# flows also cross each uplink once each way, it gives the model's uplink bandwidth (the fastest of
# them: ``cluster_check.network_fields``).
SEGMENT_BYTES = 1 << 20
# (world, ranks per node): 8 ranks as 2 nodes x 4 and 4 nodes x 2, 4 ranks as 2 nodes x 2
LAYOUTS: tuple[tuple[int, int], ...] = ((8, 4), (8, 2), (4, 2))
# Per node uplink, Mbit/s. The run must be network-bound (the check below) on a slow 2-core machine
# too, where the CPU's share of a step is largest: at 50 such a machine's densest strategy of 8
# ranks nearly halves its step at twice the rate, where at 100 it did not (the measurements:
# results/cluster_comm.md). A check that fails names a rate that would pass (``rate_for_speedup``).
RATE_MBIT = 50.0
# Launches of every layout (see the module's docstring): the median of 3 is the least that outvotes one
# launch's draw.
LAUNCHES = 3
RUNS_DIR = REPO / "results" / "runs" / "bench_cluster"
OUT_MD, OUT_JSON = REPO / "results" / "cluster_comm.md", REPO / "results" / "cluster_comm.json"


def strategy_labels() -> tuple[str, ...]:
    """The strategies this benchmark measures unless told: the registry's ``CLUSTER_BENCH`` list."""
    return registry.labels(registry.CLUSTER_BENCH)


def strategy_options(label: str, ranks_per_node: int) -> dict[str, Any]:
    """The ``comm.*`` options of a strategy label, from the registry (a label that forces the
    two-level ring takes the layout's ranks per node)."""
    return registry.options(label, ranks_per_node)


def dense_fp32(options: dict[str, Any]) -> bool:
    """Whether a strategy sends every gradient in fp32 (the most bytes): the network-bound check's candidates."""
    from gradientflow_repro.comm.knobs import resolve

    knobs = resolve(options)
    return knobs.sparsity == "dense" and knobs.wire == "fp32"


# ---------------------------------------------------------------------------------------- the model
def model_spec(experiment: str = "digits_cpu", overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The experiment's model as ``build_model`` takes it (name, classes, image size, width, dropout),
    read from its composed configuration, so the bench follows the experiment."""
    cfg = compose([f"+experiment={experiment}", *overrides])
    return {"experiment": experiment, "name": cfg.model.name, "num_classes": cfg.data.num_classes,
            "image_size": cfg.data.image_size, "width": cfg.model.width, "dropout": cfg.model.dropout}


def build(spec: dict[str, Any]) -> Any:
    from gradientflow_repro.models import build_model

    return build_model(spec["name"], spec["num_classes"], spec["image_size"], spec["width"], spec["dropout"])


def backward_order(spec: dict[str, Any]) -> list[int]:
    """Indices of the model's trainable parameters in the order one real backward pass completes
    their gradients (post-accumulate-grad hooks): the order the replay releases them in."""
    import torch

    torch.manual_seed(0)
    model = build(spec)
    params = [p for p in model.parameters() if p.requires_grad]
    order: list[int] = []
    handles = [p.register_post_accumulate_grad_hook(lambda p, i=i: order.append(i)) for i, p in enumerate(params)]
    images = torch.randn(2, 3, spec["image_size"], spec["image_size"])
    labels = torch.randint(0, spec["num_classes"], (2,))
    torch.nn.functional.cross_entropy(model(images), labels).backward()
    for handle in handles:
        handle.remove()
    if sorted(order) != list(range(len(params))):
        raise RuntimeError(f"backward completed {len(order)} of {len(params)} gradients once each")
    return order


def make_replay(model: Any, order: Sequence[int], gradients: Sequence[Any]) -> Any:
    """A module over ``model`` (same parameters, same order) whose forward builds a chain of
    autograd nodes and returns a scalar: its backward hands parameter ``order[0]`` its gradient
    first, then ``order[1]``, ... with nothing computed in between. Each node's gradient goes to the
    parameter's AccumulateGrad before the chain moves on (autograd runs AccumulateGrad nodes first),
    so post-accumulate-grad hooks and DDP's hooks fire one by one in backward order."""
    import torch

    class Release(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, carry: torch.Tensor, param: torch.Tensor, gradient: torch.Tensor) -> torch.Tensor:
            ctx.gradient = gradient
            return carry.clone()

        @staticmethod
        def backward(ctx: Any, carried: torch.Tensor) -> tuple:
            return carried, ctx.gradient, None

    class Replay(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model  # its parameters and buffers are this module's, in the same order
            self.params = [p for p in model.parameters() if p.requires_grad]

        def forward(self) -> torch.Tensor:
            carry = torch.zeros(())
            for index in reversed(order):  # the last node applied is the first backward runs
                carry = Release.apply(carry, self.params[index], gradients[index])
            return carry

    return Replay()


# ---------------------------------------------------------------------------------------- one rank
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
    if rank == 0 and measured:
        print(f"[network] measured in {time.perf_counter() - started:.0f}s", flush=True)
    model = build(spec["model"])
    params = [p for p in model.parameters() if p.requires_grad]
    generator = torch.Generator().manual_seed(1000 + rank)  # each rank its own fixed gradients
    gradients = [torch.randn(p.shape, generator=generator) for p in params]
    if measured:
        measured["local_work_in_step"] = _local_work_in_step([tuple(p.shape) for p in params])
        measured["replay_in_step"] = _replay_in_step(spec, gradients)
    rows = []
    strategies = _with_switch_over(spec["strategies"], measured, world) if measured else spec["strategies"]
    for label, options in strategies:
        try:
            row = _run_strategy(rank, spec, label, options, spec["order"], gradients)
        except Exception as error:  # noqa: BLE001 (one strategy failing on every rank: report it, go on)
            row = {"strategy": label, "options": options, "error": f"{type(error).__name__}: {error}"}
        rows.append(row)
        if rank == 0:
            shown = (f"{row['comm_s_median']:.3f}s/step, {row['bytes_per_step'] / 2**20:.2f} MiB, "
                     f"{row['collectives_per_step']:.0f} collectives" if row["error"] is None else row["error"])
            print(f"[{label}] {shown} ({time.perf_counter() - started:.0f}s into the launch)", flush=True)
    if rank == 0:
        out.write_text(json.dumps({"network": measured, "rows": rows}))


def _with_switch_over(strategies: list[list[Any]], measured: dict[str, Any], world: int) -> list[list[Any]]:
    """Each strategy of our own algorithms with ``comm.small_message_kb`` set to this network's
    switch-over between recursive doubling and its ring (``perfmodel.switch_over_bytes`` on the
    figures just measured: a shaped uplink's latency x bandwidth is far below loopback's, where
    the default was measured), the same on every rank (rank 0's figures)."""
    import torch.distributed as dist

    from gradientflow_repro.comm import knobs
    from gradientflow_repro.scaling.cluster_check import model_network
    from gradientflow_repro.scaling.perfmodel import switch_over_bytes

    net = model_network(measured)
    chosen = [knobs.resolve(options).algorithm for _, options in strategies]
    sizes = [None if algorithm == "builtin" else max(1, switch_over_bytes(world, net, algorithm) // 1024)
             for algorithm in chosen]
    dist.broadcast_object_list(sizes, src=0)
    return [[label, options if size is None else {**options, "small_message_kb": size}]
            for (label, options), size in zip(strategies, sizes)]


def main(argv: Optional[Sequence[str]] = None) -> None:
    """A rank of the benchmark, as ``run_ranks`` starts it: ``OUT.json SPEC.json``."""
    from gradientflow_repro.cluster.world import run_rank

    out, spec_file = (Path(a) for a in (sys.argv[1:] if argv is None else argv))
    run_rank(_measure, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", out, spec_file,
             timeout_s=60)  # a step or a measured call takes seconds: a hang fails in a minute


# ---------------------------------------------------------------------------------------- the driver
def run_layout(world: int, ranks_per_node: int, rate_mbit: Optional[float], labels: Sequence[str],
               model: dict[str, Any], order: list[int], run_dir: Path, reason: Optional[str], steps: int = 5,
               warmup: int = 1, measure: Optional[str] = "full", timeout_s: float = 600,
               launch: int = 1) -> dict[str, Any]:
    """One launch (the ``launch``-th of this layout) of ``world`` ranks as nodes of ``ranks_per_node``
    on uplinks of ``rate_mbit`` (loopback when ``reason`` says why the network cannot be emulated):
    the network (``measure``: "full", "links" without the builtin table, or None) and the strategies
    ``labels``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = {"model": model, "order": order, "ranks_per_node": ranks_per_node, "steps": steps, "warmup": warmup,
            "measure": measure, "strategies": [[label, strategy_options(label, ranks_per_node)] for label in labels]}
    (run_dir / "spec.json").write_text(json.dumps(spec))
    out = run_dir / "measured.json"
    name = f"{world // ranks_per_node}x{ranks_per_node}"
    started = time.time()
    with network(world, rate_mbit, reason, ranks_per_node=ranks_per_node) as net:
        payload_Bps, burst = (net.payload_Bps, net.burst_payload_bytes) if net else (None, 0.0)
        run_ranks(world, [str(out), str(run_dir / "spec.json")], run_dir, name, net, timeout_s, module=MODULE)
    measured = json.loads(out.read_text())
    facts = {"layout": name, "world": world, "nodes": world // ranks_per_node, "ranks_per_node": ranks_per_node,
             "rate_mbit": rate_mbit if reason is None else None, "shaped_payload_Bps": payload_Bps,
             "burst_payload_bytes": burst, "launch": launch}
    return {**facts, "network": measured["network"], "launch_s": time.time() - started,
            "rows": [{**facts, **row} for row in measured["rows"]]}


def bench_cluster(out_md: Path = OUT_MD, out_json: Path = OUT_JSON, rate_mbit: float = RATE_MBIT,
                  layouts: Sequence[tuple[int, int]] = LAYOUTS, labels: Optional[Sequence[str]] = None,
                  steps: int = 5, warmup: int = 1, emulate: bool = True, check: bool = True,
                  experiment: str = "digits_cpu", runs_dir: Path = RUNS_DIR, measure: Optional[str] = "full",
                  command: str = "python scripts/bench_cluster.py", launches: int = LAUNCHES,
                  fresh: bool = False) -> str:
    """Every layout ``launches`` times, in rounds, and after the first round the network-bound check
    (the dense fp32 strategies of the first layout again at twice the rate and unshaped); writes
    ``out_json`` (raw rows, each with its launch) and ``out_md``; returns the Markdown. Each finished
    launch is saved as it ends (``progress.Progress`` in ``runs_dir``): run again with the same plan
    (these options, the code, the machine), an interrupted benchmark keeps them and goes on; another
    plan raises ``CannotContinue`` unless ``fresh``. ``labels``: the strategies, registry labels
    (None: ``strategy_labels()``)."""
    from gradientflow_repro.provenance import code_version, environment_facts

    labels = list(strategy_labels() if labels is None else labels)
    if launches < 1:
        raise ValueError(f"--launches {launches}: must be at least 1")
    reason = netemu.why_unavailable() if emulate else "disabled by --no-emulation"
    machine = environment_facts()
    plan = {"layouts": [list(layout) for layout in layouts], "launches": launches, "strategies": list(labels),
            "steps": steps, "warmup": warmup, "rate_mbit": rate_mbit, "emulated": reason is None, "check": check,
            "experiment": experiment, "measure": measure, "code": code_version(),
            "machine": {key: machine[key] for key in MACHINE_KEYS}}
    with Progress(runs_dir, plan, fresh, name="bench_cluster", what="cluster benchmark") as progress:
        from gradientflow_repro.scaling.profile import matrix_rows

        model = model_spec(experiment)
        order = backward_order(model)
        params = [p for p in build(model).parameters() if p.requires_grad]
        # [elements, one-dimensional, first dimension]: the last is how PowerSGD views it as a matrix
        tensors = [[params[i].numel(), params[i].dim() <= 1, matrix_rows(params[i])] for i in order]
        model = {**model, "tensors_in_backward_order": tensors, "parameters": sum(t[0] for t in tensors)}
        kept = f"; continuing: {progress.kept} finished job(s) kept" if progress.kept else ""
        print(f"bench_cluster: {model['name']} ({model['parameters'] / 1e6:.2f}M parameters, {len(tensors)} tensors); "
              f"network: {'emulated, uplinks %g Mbit/s' % rate_mbit if reason is None else 'loopback (' + reason + ')'}"
              f"{kept}", flush=True)
        jobs = [(launch, world, per_node) for launch in range(1, launches + 1) for world, per_node in layouts]
        checked = check and reason is None
        planned = [(f"{w // n}x{n} launch{k}", "launch", f"{w // n}x{n}") for k, w, n in jobs]  # name, kind, key
        if checked:
            planned.insert(len(layouts), ("rate check", "check", "rate"))  # after the first round
        timeline = Timeline([(kind, key) for name, kind, key in planned if progress.done(name) is None],
                            name="bench_cluster", guess_s={"launch": 200.0, "check": 150.0})
        results, rate_check = [], None
        for index, (launch, world, per_node) in enumerate(jobs):
            name = f"{world // per_node}x{per_node}"
            job = f"{name} launch{launch}"
            result = progress.done(job)
            if result is None:
                timeline.begin("launch", name, f"launch {launch}/{launches} of {world // per_node} nodes x "
                               f"{per_node} ranks")
                run_dir = runs_dir / name / f"launch{launch}"
                shutil.rmtree(run_dir, ignore_errors=True)  # a launch cut short left its logs: start clean
                result = run_layout(world, per_node, rate_mbit, labels, model, order, run_dir, reason, steps, warmup,
                                    measure, launch=launch)
                progress.record(job, result)
            results.append(result)
            if index + 1 == len(layouts) and checked:  # after the first round
                rate_check = progress.done("rate check")
                if rate_check is None:
                    timeline.begin("check", "rate", f"network-bound check on {results[0]['layout']} "
                                   "(twice the rate, and unshaped)")
                    try:
                        rate_check = network_bound_check(results[0], model, order, runs_dir / "rate_check", steps,
                                                         warmup)
                        progress.record("rate check", rate_check)
                        if not rate_check["network_bound"]:  # said now, not only after the last round
                            print(f"bench_cluster: NOT network-bound at {rate_mbit:g} Mbit/s "
                                  f"({rate_check['speedup']:.2f}x at twice the rate, "
                                  f"{NETWORK_BOUND_SPEEDUP:g}x required): the model check will not be one of "
                                  f"the network; stop and run again with a lower --rate-mbit{_suggestion(rate_check)}",
                                  flush=True)
                    except RuntimeError as error:  # said in the report; the rounds go on (not kept: tried again)
                        rate_check = {"layout": results[0]["layout"], "error": str(error)}
                        print(f"bench_cluster: {error}", flush=True)
        timeline.end()
        facts = {"machine": machine, "command": command, "elapsed_s": progress.elapsed_s,
                 "invocations": len(progress.state["launches"]),
                 "emulated": reason is None, "why_not": reason, "rate_mbit": rate_mbit if reason is None else None,
                 "steps": steps, "warmup": warmup, "launches": launches, "model": model, "rate_check": rate_check,
                 "layouts": [{k: v for k, v in r.items() if k != "rows"} for r in results],
                 "rows": [row for r in results for row in r["rows"]]}
        out_json.parent.mkdir(parents=True, exist_ok=True)
        out_json.write_text(json.dumps(facts, indent=1))
        text = markdown(facts)
        out_md.write_text(text)
        progress.finish()
    print(f"bench_cluster: wrote {out_md} and {out_json} in {facts['elapsed_s']:.0f}s", flush=True)
    return text


NETWORK_BOUND_SPEEDUP = 1.7  # at twice the rate the largest dense strategy must be this much faster
SUGGESTED_SPEEDUP = 1.8  # what a suggested lower rate aims at: a margin over the requirement, for noise


def _fixed_and_wire(at_rate_s: float, at_double_s: float) -> tuple[float, float]:
    """The fixed part f and the wire part w of a step that takes f + w at some rate and f + w/2 at
    twice it."""
    wire = 2.0 * (at_rate_s - at_double_s)
    return at_rate_s - wire, wire


def rate_for_speedup(rate_mbit: float, at_rate_s: float, at_double_s: float,
                     speedup: float = SUGGESTED_SPEEDUP) -> Optional[float]:
    """The highest uplink rate at which a step measured at ``rate_mbit`` (``at_rate_s``) and at
    twice it (``at_double_s``) would be ``speedup`` times faster at twice that rate, by the split
    these two imply: a fixed part (CPU, per-message costs) f and a wire part w that scales with 1/rate,
    t = f + w, t2 = f + w/2. At rate r the wire part is w * rate_mbit / r, and (f + w') / (f + w'/2)
    >= s needs w' >= f (s - 1) / (1 - s/2). None when the two times show no wire part, ``rate_mbit``
    itself when they show no fixed part."""
    fixed, wire = _fixed_and_wire(at_rate_s, at_double_s)
    if wire <= 0 or not 1.0 < speedup < 2.0:
        return None
    if fixed <= 0:
        return rate_mbit
    return rate_mbit * wire / (fixed * (speedup - 1.0) / (1.0 - speedup / 2.0))


def network_bound_check(layout: dict[str, Any], model: dict[str, Any], order: list[int], run_dir: Path,
                        steps: int, warmup: int) -> dict[str, Any]:
    """The dense fp32 strategies of ``layout`` again on uplinks twice as fast, and unshaped (what
    the CPU and per-message costs alone allow): a network-bound strategy nearly halves at twice the
    rate and takes a small part of its time unshaped. The verdict is on the largest dense strategy
    (the most bytes; of those the slowest)."""
    dense = [r for r in layout["rows"] if r["error"] is None and dense_fp32(r["options"])]
    if not dense:
        raise RuntimeError("network-bound check: no dense fp32 strategy ran")
    largest = max(dense, key=lambda r: (r["bytes_per_step"], r["comm_s_median"]))
    labels = [r["strategy"] for r in dense]
    rate = layout["rate_mbit"]
    runs = {"double": run_layout(layout["world"], layout["ranks_per_node"], 2 * rate, labels, model, order,
                                 run_dir / "double", None, steps, warmup, measure="links"),
            "unshaped": run_layout(layout["world"], layout["ranks_per_node"], None, labels, model, order,
                                   run_dir / "unshaped", None, steps, warmup, measure="links")}
    rows = []
    for row in dense:
        again = {name: next(r for r in run["rows"] if r["strategy"] == row["strategy"]) for name, run in runs.items()}
        failed = [f"{name}: {r['error']}" for name, r in again.items() if r["error"]]
        if failed:
            raise RuntimeError(f"network-bound check: {row['strategy']} failed ({'; '.join(failed)})")
        rows.append({"strategy": row["strategy"], "bytes_per_step": row["bytes_per_step"],
                     "comm_s": row["comm_s_median"], "double_comm_s": again["double"]["comm_s_median"],
                     "unshaped_comm_s": again["unshaped"]["comm_s_median"],
                     "speedup": row["comm_s_median"] / again["double"]["comm_s_median"],
                     "unshaped_share": again["unshaped"]["comm_s_median"] / row["comm_s_median"]})
    head = next(r for r in rows if r["strategy"] == largest["strategy"])
    leaders = {name: (run["network"] or {}).get("leaders") for name, run in
               (("rate", layout), ("double", runs["double"]), ("unshaped", runs["unshaped"]))}
    return {"layout": layout["layout"], "rate_mbit": rate, "double_rate_mbit": 2 * rate, **head,
            "network_bound": head["speedup"] >= NETWORK_BOUND_SPEEDUP, "rows": rows,
            "suggested_rate_mbit": rate_for_speedup(rate, head["comm_s"], head["double_comm_s"]),
            "leader_bandwidth_Bps": {name: f["segmented"]["bandwidth_Bps"] if f else None
                                     for name, f in leaders.items()},
            "networks": {name: run["network"] for name, run in runs.items()}}


# ---------------------------------------------------------------------------------------- the report
def _size(nbytes: float) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"


def _suggestion(check: dict[str, Any]) -> str:
    """The remedy's rate, from the check's two times (``rate_for_speedup``); older JSON lacks it."""
    rate = check.get("suggested_rate_mbit")
    if rate is None:
        return ""
    fixed, wire = _fixed_and_wire(check["comm_s"], check["double_comm_s"])
    return (f"; by the split these two times imply ({fixed:.3f} s fixed, {wire:.3f} s on the wire "
            f"at {check['rate_mbit']:g} Mbit/s), `--rate-mbit {math.floor(rate)}` or lower should give "
            f"{SUGGESTED_SPEEDUP:g}x")


def markdown(facts: dict[str, Any]) -> str:
    """results/cluster_comm.md from the facts ``bench_cluster`` writes as JSON."""
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
            f"network-bound, at least {NETWORK_BOUND_SPEEDUP:g}x required): "
            f"**{'network-bound' if check['network_bound'] else 'NOT network-bound'}**. Unshaped it takes "
            f"{check['unshaped_comm_s']:.3f} s ({100 * check['unshaped_share']:.0f}% of its time at "
            f"{check['rate_mbit']:g} Mbit/s): what CPU and per-message costs alone cost. Leader-to-leader ring "
            f"bandwidth (1 MiB segments) in the same launches: " + ", ".join(
                f"{name} {value / 1e6:.1f} MB/s" for name, value in
                (("at the rate", bandwidth["rate"]), ("at twice the rate", bandwidth["double"]),
                 ("unshaped", bandwidth["unshaped"])) if value) + "."
            + ("" if check["network_bound"] else " On this machine the CPU and per-message costs weigh too much at "
               "this rate for the model check to be one of the network: run again with a lower `--rate-mbit` (the "
               "dense strategies then take longer)" + _suggestion(check) + "."), "",
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
              "`bench/cluster.py`); a ring of two ranks, as the leaders' of 2 nodes, cuts both to "
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
        lines.append(f"| {layout['layout']} ({layout['world']} ranks), {launch_of(layout)} | {rate} "
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
            lines.append(f"| {_size(size)} | " + " | ".join(
                f"{statistics.median(table[i][1] for table in each) * 1e3:.2f} ms" for each in tables.values()) + " |")
        lines.append("")
    rows_of_every_launch = over_launches(facts["rows"])
    for layout in facts["layouts"]:
        if launch_of(layout) != 1:
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
                  f"{netemu.BURST_BYTES >> 10} KiB: {_burst_ms(facts)} of the uplink's time), which the model "
                  "spends and refills (`perfmodel.Network.burst_bytes`).", "",
                  *markdown_lines(facts), ""]
    return "\n".join(lines)


def _local_work_note(layout: dict[str, Any]) -> str:
    work = (layout["network"] or {}).get("local_work_in_step")
    if not work:
        return "not measured"
    low_rank = work.get("low_rank_s_per_element")  # not measured by launches before PowerSGD was priced
    return (f"{work['sparsify_s_per_element'] * 1e9:.1f}, {work['wire_cast_s_per_element'] * 1e9:.1f} and "
            + (f"{low_rank * 1e9:.1f} ns" if low_rank is not None else "(not measured) ns"))


def _burst_ms(facts: dict[str, Any]) -> str:
    layout = facts["layouts"][0]
    if not layout.get("shaped_payload_Bps"):
        return "none unshaped"
    return f"{layout.get('burst_payload_bytes', 0.0) / layout['shaped_payload_Bps'] * 1e3:.0f} ms"


def _switch_over_note(facts: dict[str, Any], layout: str) -> str:
    sizes = sorted({r["options"].get("small_message_kb") for r in facts["rows"]
                    if r["layout"] == layout and r["options"].get("small_message_kb")})
    return "/".join(f"{size} KiB" for size in sizes) or "default"


if __name__ == "__main__":
    main()
