"""NCCL's collectives, and ours against them: the items ``nccl_1rank`` and ``nccl_2gpu``.

``nccl_1rank``: an NCCL process group of one rank. Every collective the trainer's helpers send
(all_reduce SUM/MAX/MIN, broadcast, all_gather, reduce, ...) is really sent through NCCL on random
data and its result checked (the out-of-place ones start from a filled output, which shows that
NCCL wrote it), with its time per call. The helpers themselves return before any collective at
world size 1: ``nccl_2gpu`` sends theirs. Then the lazy pool and CSC (``POOL_CASES``), built as the
trainer builds them but told to send at world size 1 (``build_communicator(..., at_world_1=True)``:
one rank's sum is itself, so only that NCCL runs changes), a few steps each: every pool part must
send from the pool's thread on its side stream (as on many GPUs), and the result must equal
``dist.all_reduce`` of what the rank accumulated (``pool_against_all_reduce``). Without that option
one rank sends nothing, and the one-GPU trainer has no process group at all: this is where NCCL
driven from the pool's thread and stream runs on one GPU.

``nccl_2gpu``: one NCCL rank per GPU on two GPUs:

1. our ring and hierarchical sums against ``dist.all_reduce`` on odd sizes, fp32 and fp16;
2. the trainer's collective helpers (agree_max, all_reduce_scalars, ranks_that_differ, barrier) on
   rank-dependent values;
3. a few lazy-allreduce steps whose gradients must equal ``dist.all_reduce`` of the reference
   model's gradients over the ranks (ranks that merely agree do not pass: a stale pool agrees too);
4. rank 1's process must hold no CUDA context on GPU 0.

Under the test device both run on gloo with CPU tensors; the sums under test go through
``break_sum`` and the lazy communicator through ``stale_pool`` (the test faults, ``hooks``).
"""

from __future__ import annotations

import copy
import datetime
import functools
import os
import sys
import threading
import traceback
from typing import Any, Callable, Optional

import torch

from gradientflow_repro.cluster.world import free_port
from gradientflow_repro.gpu_check.communicators import SmallNet, residuals, same_message
from gradientflow_repro.gpu_check.devices import backend_for, collective_device, median_us, synchronize
from gradientflow_repro.gpu_check.environment import cuda_uuid, gpu_processes
from gradientflow_repro.gpu_check.hooks import break_sum, stale_pool, test_device
from gradientflow_repro.gpu_check.processes import REPORTED_EXIT, put_result, spawn_ranks, time_left
from gradientflow_repro.gpu_check.results import Reporter, Result, Skip, describe, project_imports

# ---------------------------------------------------------------------------------------------
# nccl_1rank: every collective the trainer's helpers send, really sent at world size 1



def mean_over_ranks(tensors: list[torch.Tensor], world: int) -> list[torch.Tensor]:
    """Each of ``tensors`` replaced, in place, by its mean over the ranks (``dist.all_reduce``): the
    reference the communicators are compared with."""
    import torch.distributed as dist

    for tensor in tensors:
        dist.all_reduce(tensor)
        tensor.div_(world)
    return tensors

def _one_rank_collectives(device: torch.device) -> dict[str, tuple[Callable[[], Any], Callable[[], list[str]]]]:
    """name -> (call, verify) for one rank's process group. Each call sends one collective on random
    data; verify (after one more call on fresh inputs) lists what is wrong with the result. At world
    size 1 the sum of one rank is its own value; the out-of-place collectives start from a filled
    output, so a collective that never reached the backend leaves it visibly wrong. The sums under
    test go through ``break_sum`` (the test-only wrong_sum fault)."""
    import torch.distributed as dist

    generator = torch.Generator().manual_seed(7)
    x_small = torch.randn(1, generator=generator, dtype=torch.float64).to(device)  # the helpers' scalars
    x_big = torch.randn(1 << 20, generator=generator).to(device)  # 4 MiB of fp32
    x_half = torch.randn(1 << 20, generator=generator).to(device, torch.float16)  # the fp16 wire
    state: dict[str, Any] = {}

    def fresh(name: str, value: torch.Tensor) -> torch.Tensor:
        state[name] = value.clone()
        return state[name]

    def reduce(name: str, value: torch.Tensor, **kw: Any) -> Callable[[], Any]:
        def call() -> None:
            dist.all_reduce(fresh(name, value), **kw)
            break_sum(state[name])
        return call

    def same(name: str, value: torch.Tensor) -> Callable[[], list[str]]:
        def verify() -> list[str]:
            got = state[name]
            if got.dtype != value.dtype or not torch.equal(got, value):
                error = (got.double() - value.double()).abs().max().item()
                return [f"result differs from the one rank's input by up to {error:.3g}"]
            return []
        return verify

    def out_of_place(name: str, value: torch.Tensor, send: Callable[[torch.Tensor, torch.Tensor], Any],
                     ) -> tuple[Callable[[], Any], Callable[[], list[str]]]:
        def call() -> None:
            state[name] = torch.full_like(value, float("nan"))
            send(state[name], value)
        return call, same(name, value)

    objects: list[Any] = []
    gathered_objects: list[Any] = [None]

    def broadcast_objects() -> None:
        objects[:] = [{"checkpoint": "step_000000020", "x": x_small.item()}]
        dist.broadcast_object_list(objects, src=0)

    def gather_objects() -> None:
        dist.all_gather_object(gathered_objects, ("rank 0", x_small.item()))

    calls: dict[str, tuple[Callable[[], Any], Callable[[], list[str]]]] = {
        "all_reduce SUM 8 B fp64": (reduce("sum8", x_small), same("sum8", x_small)),
        "all_reduce SUM 4 MiB fp32": (reduce("sum4m", x_big), same("sum4m", x_big)),
        "all_reduce SUM 2 MiB fp16": (reduce("sum16", x_half), same("sum16", x_half)),
        "all_reduce MAX 8 B fp64": (reduce("max8", x_small, op=dist.ReduceOp.MAX), same("max8", x_small)),
        "all_reduce MIN 8 B fp64": (reduce("min8", x_small, op=dist.ReduceOp.MIN), same("min8", x_small)),
        "broadcast 4 MiB": (lambda: dist.broadcast(fresh("bcast", x_big), src=0), same("bcast", x_big)),
        "reduce 4 MiB": (lambda: dist.reduce(fresh("reduce", x_big), dst=0), same("reduce", x_big)),
        "all_gather 4 MiB (out of place)": out_of_place(
            "gather", x_big, lambda out, value: dist.all_gather([out], value)),
        "all_gather_into_tensor 4 MiB (out of place)": out_of_place(
            "gather_t", x_big, lambda out, value: dist.all_gather_into_tensor(out, value)),
        "broadcast_object_list": (broadcast_objects, lambda: [] if objects == [
            {"checkpoint": "step_000000020", "x": x_small.item()}] else [f"got {objects!r:.80}"]),
        "all_gather_object": (gather_objects, lambda: [] if gathered_objects == [("rank 0", x_small.item())]
                              else [f"got {gathered_objects!r:.80}"]),
    }
    if device.type == "cuda":  # gloo has no reduce_scatter
        calls["reduce_scatter_tensor 4 MiB (out of place)"] = out_of_place(
            "scatter_t", x_big, lambda out, value: dist.reduce_scatter_tensor(out, value))
    return calls


# The pool's cases at world size 1: the strategies' presets (their algorithm is moot for one rank:
# at_world_1 sends by the backend's allreduce, which carries them on NCCL by default), with pool
# parts of about 1 KiB so that the small model fills several, and CSC sparse from the first step.
POOL_CASES: dict[str, dict[str, Any]] = {
    "lazy": {"strategy": "lazy", "bucket_mb": 0.001},
    "gradientflow": {"strategy": "gradientflow", "bucket_mb": 0.001, "chunk_size": 64, "density": 0.1,
                     "csc_warmup_epochs": 0.0},
}
POOL_STEPS = 3


def watch_the_pool(comm: Any) -> list[tuple[str, bool, int]]:
    """Wrap ``comm.reduce_bucket``: per pool part sent, (the thread that sent it, whether it ran on
    the pool's side stream (always true without one: the CPU), the collectives it issued)."""
    seen: list[tuple[str, bool, int]] = []
    reduce_bucket = comm.reduce_bucket
    side = getattr(comm, "_stream", None)

    def watched(bucket: Any) -> None:
        before = comm.stats.collectives
        on_side = side is None or torch.cuda.current_stream(comm.device) == side
        reduce_bucket(bucket)
        seen.append((threading.current_thread().name, on_side, comm.stats.collectives - before))

    comm.reduce_bucket = watched
    return seen


def pool_against_all_reduce(options: dict[str, Any], device: torch.device) -> tuple[str, str]:
    """``POOL_STEPS`` steps of ``SmallNet`` through the communicator of ``options``, built as the
    trainer builds it (``build_communicator`` of the options, then ``attach``) but sending at world
    size 1. Per step, with this rank's gradient g (from a plain copy of the model) and CSC's
    residuals before (old) and after (new) the step: p.grad + new must equal ``dist.all_reduce(old +
    g) / world`` (the lazy pool has no residual: p.grad is the summed gradient), within float
    rounding (fp32 wire) or the fp16 wire's (2e-3 of the largest value of the message). Every pool
    part must have been sent from the pool's thread, on its side stream on a GPU, with at least one
    collective. Returns the verdict and the line's detail."""
    import torch.distributed as dist

    from gradientflow_repro.comm.factory import build_communicator
    from gradientflow_repro.comm.plan import resolve

    world = dist.get_world_size()
    fp16 = resolve(options).wire == "fp16"
    torch.manual_seed(0)
    model = SmallNet().to(device)
    reference = copy.deepcopy(model)
    comm = build_communicator(options, device, at_world_1=True)
    module = comm.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))  # momentum 0: CSC sends g
    stale_pool(comm)
    seen = watch_the_pool(comm)
    params = list(model.parameters())
    message = same_message(comm, params)
    worst, problems = 0.0, []
    try:
        for step in range(POOL_STEPS):
            x = torch.randn(16, 37, generator=torch.Generator().manual_seed(step)).to(device)
            reference.zero_grad(set_to_none=True)
            reference(x).pow(2).mean().backward()
            old = residuals(comm, params)
            expected = mean_over_ranks([(r.to(device) + p.grad).detach().clone()
                                        for r, p in zip(old, reference.parameters())], world)
            comm.begin_step(float(step), 1.0)
            module(x).pow(2).mean().backward()
            comm.synchronize()
            synced = [break_sum(p.grad.detach().float().cpu().clone()) for p in params]
            comm.end_step(applied=True)  # (CSC's new residuals are kept from here)
            got = [g + r for g, r in zip(synced, residuals(comm, params))]
            model.zero_grad(set_to_none=True)
            want = [t.float().cpu() for t in expected]
            largest = [max(t.abs().max().item(), 1e-30) for t in want]
            for i, (g, w) in enumerate(zip(got, want)):
                peak = max(largest[j] for j in message[i]) if fp16 else largest[i]
                error = (g - w).abs().max().item() / peak
                worst = max(worst, error)
                if not error <= (2e-3 if fp16 else 1e-6):  # a NaN fails too
                    problems.append(f"step {step} parameter {i}: |error| {error:.2g} of the largest value")
    finally:
        comm.close()
    parts = len(comm.buckets)
    threads = sorted({name for name, _, _ in seen})
    if not seen:
        problems.append("no pool part was sent")
    if any(not name.startswith("gradientflow-comm") for name in threads):
        problems.append(f"pool parts sent from thread(s) {threads}, not the pool's")
    if not all(on_side for _, on_side, _ in seen):
        problems.append("pool parts sent off the pool's side stream")
    silent = sum(1 for *_, sent in seen if sent < 1)
    if silent:
        problems.append(f"{silent} of {len(seen)} pool part(s) sent no collective (world size 1 short-circuited?)")
    collectives = sum(sent for *_, sent in seen)
    stream = "on its side stream" if device.type == "cuda" else "(no side stream on the CPU)"
    detail = (f"{POOL_STEPS} steps, {parts} pool parts: p.grad{' + residual' if hasattr(comm, 'residual') else ''} "
              f"vs dist.all_reduce of the accumulated gradient, worst |error| {worst:.2g} of the largest value "
              f"(tolerance {'2e-3, fp16 wire' if fp16 else '1e-6'}); {collectives} collectives through "
              f"{dist.get_backend()} ({collectives / max(1, len(seen)):.0f} per part), from the pool's thread "
              f"{', '.join(threads) or 'none'} {stream}")
    return ("FAIL", f"{'; '.join(problems[:4])} ({detail})") if problems else ("PASS", detail)


def check_nccl_single_rank(report: Reporter) -> None:
    """A process group of one rank (NCCL on cuda:0; gloo on the CPU under the test device): every
    collective really sent, its result checked, and the trainer's helpers' answers at world size 1
    (where they return before any collective: their collectives are sent in nccl_2gpu)."""
    import torch.distributed as dist

    device = collective_device(0)
    backend = backend_for(device)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group(backend, rank=0, world_size=1, device_id=device if device.type == "cuda" else None,
                            timeout=datetime.timedelta(seconds=60))
    try:
        if dist.get_backend() != backend:
            raise RuntimeError(f"the process group's backend is {dist.get_backend()}, not {backend}")
        for name, (call, verify) in _one_rank_collectives(device).items():
            with report.part(name):
                micros = median_us(call, device, repeats=20)
                call()
                synchronize(device)
                problems = verify()
                report.add("FAIL" if problems else "PASS",
                           f"{micros:.1f} us/call (median of 20, a fresh copy of the input included) through {backend}"
                           + (f": {'; '.join(problems)}" if problems else ", result checked"), name)
        with report.part("send/recv to self"):
            big = torch.randn(1 << 20, generator=torch.Generator().manual_seed(3)).to(device)
            received = torch.zeros_like(big)

            def self_send_recv() -> None:
                received.zero_()
                ops = [dist.P2POp(dist.isend, big, 0), dist.P2POp(dist.irecv, received, 0)]
                for work in dist.batch_isend_irecv(ops):
                    work.wait()

            try:
                self_send_recv()
            except Exception as error:  # noqa: BLE001 - torch or NCCL refusing is not a failure here
                raise Skip(f"refused by torch/{backend}: {describe(error)}") from None
            micros = median_us(self_send_recv, device, repeats=20)
            ok = bool(torch.equal(received, big))
            report.add("PASS" if ok else "FAIL", f"{micros:.1f} us per 4 MiB send+recv pair (median of 20)"
                       + ("" if ok else ": received data differ"), "send/recv to self")
        with report.part("the trainer's helpers at world size 1"):
            with project_imports():  # the collectives above need only torch; the helpers need the project's
                from gradientflow_repro.distributed import agree_max, all_reduce_scalars, barrier, ranks_that_differ
            flag = torch.ones((), device=device) * 3
            answers = {"agree_max": (agree_max([flag, 15.0], device), [3.0, 15.0]),
                       "all_reduce_scalars": (all_reduce_scalars([1.5, -2.0], device), [1.5, -2.0]),
                       "ranks_that_differ": (ranks_that_differ([flag], device), [])}
            barrier(device)
            wrong = [f"{name} gave {got}, not {want}" for name, (got, want) in answers.items() if got != want]
            report.add("FAIL" if wrong else "PASS", "; ".join(wrong) if wrong else
                       "agree_max, all_reduce_scalars, ranks_that_differ, barrier answer right (they send "
                       "nothing at world size 1: their collectives are in nccl_2gpu)",
                       "the trainer's helpers at world size 1")
        for label, options in POOL_CASES.items():
            part = f"{label} pool at world size 1 vs dist.all_reduce"
            with report.part(part):
                with project_imports():  # the presets (read when the options are resolved) need PyYAML
                    report.add(*pool_against_all_reduce(options, device), part)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# nccl_2gpu: our sums and the trainer's helpers against NCCL's, lazy allreduce against the
# reference, and no stray context on GPU 0

TWO_GPU_SIZES = (1, 7, 1000003)
TWO_GPU_ITEM = "nccl_2gpu"


def _two_gpu_rank(rank: int, world: int, port: int, lines: Any) -> None:
    """One NCCL rank per GPU (``cuda:rank``), or a gloo rank on the CPU under the test device."""
    import torch.distributed as dist

    device = torch.device("cpu") if test_device() == "cpu" else torch.device("cuda", rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # as the trainer does
    dist.init_process_group(backend_for(device), init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=device if device.type == "cuda" else None,
                            timeout=datetime.timedelta(seconds=45))
    report = Reporter(TWO_GPU_ITEM, functools.partial(put_result, lines) if rank == 0 else (lambda result: None))
    try:
        compare_with_builtin_allreduce(report, rank, world, device)
        helpers_across_ranks(report, rank, world, device)
        lazy_without_stray_context(report, rank, world, device)
    except Exception as error:  # noqa: BLE001 - report, then leave: the ranks are out of step
        traceback.print_exc()
        put_result(lines, Result("FAIL", TWO_GPU_ITEM, f"rank {rank}: {describe(error)}"))
        sys.stdout.flush()
        os._exit(REPORTED_EXIT)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def compare_with_builtin_allreduce(report: Reporter, rank: int, world: int, device: torch.device) -> None:
    """Ring and hierarchical (one rank per node, and all in one node) sums against the backend's allreduce, on odd sizes
    in fp32 and fp16; one line per algorithm and type (rank 0 reports the worst rank)."""
    import torch.distributed as dist

    from gradientflow_repro.comm.base import CommStats
    from gradientflow_repro.comm.hierarchical import HierarchicalSum
    from gradientflow_repro.comm.ring import ring_allreduce_

    # one rank per node: the ring among leaders; all ranks in one node: reduce and broadcast on the
    # node's group (the ops that share NCCL's streams with the leaders' ring on a real cluster)
    across_nodes, inside_node = HierarchicalSum(ranks_per_node=1), HierarchicalSum(ranks_per_node=world)
    algorithms: dict[str, Callable[[torch.Tensor], Any]] = {
        "ring": lambda t: ring_allreduce_(t),
        "hierarchical (1 rank per node)": lambda t: across_nodes(t, CommStats()),
        f"hierarchical ({world} ranks per node)": lambda t: inside_node(t, CommStats())}
    for dtype in (torch.float32, torch.float16):
        errors: dict[str, list[float]] = {name: [] for name in algorithms}
        for numel in TWO_GPU_SIZES:
            x = torch.randn(numel, generator=torch.Generator().manual_seed(1000 * rank + numel)).to(device, dtype)
            expected = x.clone()
            dist.all_reduce(expected)
            peak = max(expected.float().abs().max().item(), 1e-30)
            for name, algorithm in algorithms.items():
                got = x.clone()
                algorithm(got)
                break_sum(got)
                errors[name].append((got.float() - expected.float()).abs().max().item() / peak)
        big = torch.randn(TWO_GPU_SIZES[-1], device=device).to(dtype)
        builtin_us = median_us(lambda: dist.all_reduce(big.clone()), device, 1, 5)
        tolerance = 1e-6 if dtype == torch.float32 else 1e-3  # fp16: one rounding of the sum
        for name, algorithm in algorithms.items():
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, errors[name])
            worst = [max(r[i] for r in gathered) for i in range(len(TWO_GPU_SIZES))]
            micros = median_us(lambda: algorithm(big.clone()), device, 1, 5)
            report.add("PASS" if max(worst) <= tolerance else "FAIL",
                       f"sizes {', '.join(map(str, TWO_GPU_SIZES))}: |error| "
                       f"{', '.join(f'{w:.1g}' for w in worst)} of the largest value vs dist.all_reduce "
                       f"(tolerance {tolerance:g}); {TWO_GPU_SIZES[-1]} elements: {micros / 1e3:.2f} ms, "
                       f"the backend's own {builtin_us / 1e3:.2f} ms", f"{name} {str(dtype).split('.')[-1]}")


def helpers_across_ranks(report: Reporter, rank: int, world: int, device: torch.device) -> None:
    """The trainer's collective helpers (which return before any collective at world size 1) on
    rank-dependent values, against what every rank must get; rank 0 reports the ranks' verdicts."""
    import torch.distributed as dist

    from gradientflow_repro.distributed import agree_max, all_reduce_scalars, barrier, ranks_that_differ

    flag = torch.full((), float(rank == world - 1), device=device)  # only the last rank overflowed
    got = {"agree_max": agree_max([flag, float(10 + rank)], device),
           "all_reduce_scalars": all_reduce_scalars([float(rank + 1), -0.5], device),
           "ranks_that_differ": ranks_that_differ([torch.full((3,), float(rank > 0), device=device)], device)}
    got["all_reduce_scalars"][:1] = break_sum(torch.tensor(got["all_reduce_scalars"][:1])).tolist()
    want = {"agree_max": [1.0, float(9 + world)],
            "all_reduce_scalars": [float(world * (world + 1) // 2), -0.5 * world],
            "ranks_that_differ": list(range(1, world))}
    barrier(device)
    wrong = [f"{name} gave {got[name]}, not {want[name]}" for name in want if got[name] != want[name]]
    verdicts: list[Any] = [None] * world
    dist.all_gather_object(verdicts, wrong)
    if rank == 0:
        problems = [f"rank {r}: {w}" for r, ranks in enumerate(verdicts) for w in ranks]
        report.add("FAIL" if problems else "PASS", "; ".join(problems[:4]) if problems else
                   f"agree_max, all_reduce_scalars, ranks_that_differ and barrier through {dist.get_backend()} "
                   f"on rank-dependent values: every rank got the right answer", "the trainer's helpers")


def lazy_without_stray_context(report: Reporter, rank: int, world: int, device: torch.device) -> None:
    """A few steps of the lazy communicator (its default algorithm, overlap on its thread and
    stream) whose gradients must equal the mean of the ranks' reference gradients, summed by
    ``dist.all_reduce`` (ranks that merely agree with each other do not pass: a stale pool agrees
    too); and on GPUs rank 1's process must hold no CUDA context on GPU 0."""
    import torch.distributed as dist

    from gradientflow_repro.comm.factory import build_communicator
    from gradientflow_repro.distributed import barrier

    torch.manual_seed(0)
    model = SmallNet().to(device)
    reference = copy.deepcopy(model)
    comm = build_communicator({"strategy": "lazy"}, device)
    module = comm.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    stale_pool(comm)
    worst = 0.0
    steps = 3
    for step in range(steps):
        x = torch.randn(16, 37, generator=torch.Generator().manual_seed(100 * rank + step)).to(device)
        reference.zero_grad(set_to_none=True)
        reference(x).pow(2).mean().backward()
        expected = mean_over_ranks([p.grad.detach().clone() for p in reference.parameters()], world)
        comm.begin_step(float(step), 1.0)
        module(x).pow(2).mean().backward()
        comm.synchronize()
        for param, want in zip(model.parameters(), expected):
            peak = max(want.abs().max().item(), 1e-30)
            worst = max(worst, (param.grad - want).abs().max().item() / peak)
        comm.end_step(applied=True)
        model.zero_grad(set_to_none=True)
    comm.close()
    tolerance = 1e-5  # fp32 sums in another order than the reference's
    who: list[Any] = [None] * world
    dist.all_gather_object(who, (os.getpid(), cuda_uuid(rank) if device.type == "cuda" else None, worst))
    if rank == 0:  # rank 0 alone looks while rank 1 waits, alive, at the barrier
        errors = [w for *_, w in who]
        part = "lazy vs dist.all_reduce"
        with report.part(part):
            ok = all(e <= tolerance for e in errors)  # a NaN fails too
            report.add("PASS" if ok else "FAIL",
                       f"{steps} lazy steps: |p.grad - dist.all_reduce(reference gradients) / {world}| at most "
                       f"{', '.join(f'{e:.2g}' for e in errors)} (per rank) of the largest value "
                       f"(tolerance {tolerance:g})", part)
        if device.type == "cuda":
            part = "no context of rank 1 on GPU 0"
            with report.part(part):
                report.add(*_stray_context_verdict([w[:2] for w in who]), part)
    barrier(device)


def _stray_context_verdict(who: list[tuple[int, Optional[str]]]) -> tuple[str, str]:
    """Whether rank 1's process holds a context on GPU 0, from NVML's process lists."""
    processes = gpu_processes()
    if processes is None:
        raise Skip("neither pynvml nor nvidia-smi can list GPU processes")
    (_, gpu0), (pid1, gpu1) = who[0], who[1]
    order = list(processes)
    gpu0, gpu1 = gpu0 or (order[0] if order else None), gpu1 or (order[1] if len(order) > 1 else None)
    if pid1 not in processes.get(gpu1, set()):
        raise Skip(f"NVML does not list rank 1 (pid {pid1}) on its own GPU either: it cannot see this "
                   f"container's PIDs, so GPU 0 cannot be checked")
    if pid1 in processes.get(gpu0, set()):
        return "FAIL", f"rank 1 (pid {pid1}, cuda:1) holds a CUDA context on GPU 0"
    return "PASS", f"rank 1 (pid {pid1}) is on GPU 1 only after the lazy steps (ring over NCCL, overlap)"


def check_two_gpus(report: Reporter) -> None:
    """The item ``nccl_2gpu``: two spawned ranks, one per GPU (gloo ranks on the CPU under the test device)."""
    collective_device(1)
    with project_imports():
        import gradientflow_repro.comm.factory  # noqa: F401
    spawn_ranks(report, _two_gpu_rank, 2, max(5.0, time_left() - 5))
