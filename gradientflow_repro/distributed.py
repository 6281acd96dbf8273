"""Who am I in the job: world discovery, device choice and the process group.

The world comes from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), else
from Slurm's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, master = first host of the node list),
else it is a single process. The backend follows the device: NCCL with one GPU per local rank when
CUDA is there, gloo otherwise. Every collective has a timeout so that a lost rank ends the job with
an error instead of a hang.
"""

from __future__ import annotations

import datetime
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Iterable, Mapping, NoReturn, Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str  # torchrun | slurm | single

    @property
    def is_main(self) -> bool:
        return self.rank == 0


class WorldError(RuntimeError):
    pass


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm node list, e.g. 'gpu[003-010,017],cpu1' -> 'gpu003'."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                             text=True, timeout=10, check=True).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.SubprocessError):
        pass
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if not match:
        raise WorldError(f"cannot parse SLURM_JOB_NODELIST={nodelist!r}")
    prefix, ranges = match.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def discover_world(env: Optional[Mapping[str, str]] = None) -> World:
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        world = World(
            rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)), source="torchrun")
        _check_slurm_agrees(world, env)
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env and int(env["SLURM_NTASKS"]) > 1:
        nodelist = env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", "127.0.0.1"))
        tasks_per_node = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
        world = World(
            rank=int(env["SLURM_PROCID"]), world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            local_world_size=int(tasks_per_node) if tasks_per_node.isdigit() else 1,
            master_addr=env.get("MASTER_ADDR") or first_slurm_host(nodelist),
            master_port=int(env.get("MASTER_PORT", 29500)), source="slurm")
    else:
        world = World(0, 1, 0, 1, "127.0.0.1", int(env.get("MASTER_PORT", 29500)), "single")
    if not 0 <= world.rank < world.world_size:
        raise WorldError(f"rank {world.rank} is outside world size {world.world_size} ({world.source})")
    return world


def _check_slurm_agrees(world: World, env: Mapping[str, str]) -> None:
    """torchrun inside a Slurm step: one task per node, or one task per rank. Anything else is a
    launch mistake (e.g. srun with 8 tasks each starting torchrun with 8 processes)."""
    if "SLURM_NTASKS" not in env or "SLURM_STEP_ID" not in env:
        return
    ntasks = int(env["SLURM_NTASKS"])
    nnodes = int(env.get("SLURM_NNODES", env.get("SLURM_JOB_NUM_NODES", 1)))
    if ntasks not in (world.world_size, nnodes):
        raise WorldError(
            f"rank {world.rank}: torchrun says WORLD_SIZE={world.world_size} but Slurm started "
            f"SLURM_NTASKS={ntasks} tasks on {nnodes} node(s); launch either one torchrun per node "
            f"or one task per rank without torchrun")


def describe_rank(world: World, device: torch.device) -> str:
    """One line per rank for the job log: where every rank landed, e.g. to check a Slurm layout."""
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    node_id = os.environ.get("SLURM_NODEID", os.environ.get("GROUP_RANK", "0"))
    return (f"rank {world.rank}/{world.world_size} local_rank {world.local_rank}/"
            f"{world.local_world_size} node {node} node_id {node_id} device {device} "
            f"(world from {world.source}, master {world.master_addr}:{world.master_port})")


def select_device(preference: str, world: World) -> torch.device:
    if preference == "cpu" or (preference == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise WorldError(f"rank {world.rank}: device=cuda asked for but CUDA is not available")
    index = world.local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def init_process_group(world: World, device: torch.device, timeout_s: float) -> None:
    if world.world_size == 1 or dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    os.environ.setdefault("MASTER_ADDR", world.master_addr)
    os.environ.setdefault("MASTER_PORT", str(world.master_port))
    dist.init_process_group(
        backend=backend, init_method="env://", rank=world.rank, world_size=world.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None)


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def destroy_process_group_and_exit() -> NoReturn:
    """End a worker process whose work is done: destroy the process group, flush the output and exit
    with status 0 without finalizing the interpreter.

    Gloo's worker threads release a finished collective's tensors a moment after ``wait()`` has
    returned to the caller. When that moment falls in the interpreter's finalization, the thread
    cannot take the GIL to free them and the whole process aborts ("terminate called without an
    active exception") after all its work succeeded; a short-lived worker that exits right after
    its last barrier hits this about once in a few hundred runs. Nothing is left to finalize here:
    results are written and the group is gone."""
    destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def all_reduce_scalars(values: list[float], device: torch.device, op: str = "sum") -> list[float]:
    """Reduce a few Python numbers across ranks in one collective (identity without a group)."""
    if not dist.is_initialized():
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
    dist.all_reduce(tensor, op=reduce_op)
    return tensor.tolist()


def ranks_that_differ(tensors: Iterable[torch.Tensor], device: torch.device) -> list[int]:
    """Collective: ranks whose tensors' checksum (float64 sum and sum of squares) differs from
    rank 0's. Identical tensors give identical sums; a changed element changes them."""
    checksum = torch.zeros(2, dtype=torch.float64, device=device)
    for tensor in tensors:
        values = tensor.detach().double()
        checksum[0] += values.sum()
        checksum[1] += values.square().sum()
    if not dist.is_initialized():
        return []
    gathered = [torch.empty_like(checksum) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, checksum)
    return [rank for rank, other in enumerate(gathered) if not torch.equal(other, gathered[0])]


LOST_RANK_WAIT_S = 3.0  # survivors of a broken collective report within milliseconds of each other


def unresponsive_ranks(world: World, wait_s: float = LOST_RANK_WAIT_S) -> Optional[list[int]]:
    """After a collective failed: which ranks are gone? Every surviving rank marks itself in the
    rendezvous store and waits ``wait_s`` for the others; ranks that never mark themselves are
    lost (or stuck). None when the store itself is unreachable: it lives in rank 0 (or in
    torchrun's agent), so then rank 0 is the likely loss."""
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(datetime.timedelta(seconds=wait_s))
        generation = os.environ.get("TORCHELASTIC_RESTART_COUNT", os.environ.get("SLURM_RESTART_COUNT", "0"))
        key = f"gradientflow/failed/{generation}/" + "{}"
        store.set(key.format(world.rank), "1")
        deadline = time.monotonic() + wait_s
        while True:
            missing = [r for r in range(world.world_size) if not store.check([key.format(r)])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.1)
    except Exception:  # noqa: BLE001 - the store is as dead as the rank that hosted it
        return None


def describe_failure(world: World, error: BaseException) -> str:
    """One message for a failed run: the error, and which ranks were lost if a collective broke."""
    first = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
    if world.world_size == 1 or not dist.is_initialized() or not _is_collective_failure(error):
        return f"rank {world.rank}: {first}"
    lost = unresponsive_ranks(world, LOST_RANK_WAIT_S)
    if lost is None:
        who = "the rendezvous store is unreachable: rank 0 (which hosts it) is probably lost"
    elif lost:
        who = f"lost rank(s) {lost} (no answer within {LOST_RANK_WAIT_S:.0f} s)"
    else:
        who = "every rank is still alive"
    return f"rank {world.rank}: {who}; a collective failed: {first}"


def _is_collective_failure(error: BaseException) -> bool:
    text = f"{type(error).__name__} {error}".lower()
    return isinstance(error, getattr(dist, "DistError", RuntimeError)) or any(
        word in text for word in ("gloo", "nccl", "connection", "timed out", "timeout", "peer"))


def barrier(device: torch.device) -> None:
    if dist.is_initialized():
        # An all_reduce rather than dist.barrier(): NCCL barriers guess the device, this does not.
        all_reduce_scalars([0.0], device)
