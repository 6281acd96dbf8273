"""Who am I in the job: the world from torchrun's or Slurm's environment, and this rank's device.

The world comes from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), else
from Slurm's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, master = first host of the node list),
else it is a single process. With CUDA each local rank drives one GPU; two ranks on one GPU are
refused before NCCL starts, naming them (``check_one_rank_per_gpu``).
"""

from __future__ import annotations

import datetime
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

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


def slurm_tasks_per_node(env: Mapping[str, str]) -> int:
    """Ranks per node of this Slurm step. srun sets SLURM_STEP_TASKS_PER_NODE ("8(x64)", or "2,1"
    when nodes differ); sbatch sets SLURM_NTASKS_PER_NODE only with --ntasks-per-node, and
    SLURM_TASKS_PER_NODE for the job. Nodes with different task counts cannot form the equal blocks
    a two-level allreduce needs: that is an error naming the variable."""
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        value = env.get(name, "").strip()
        if not value:
            continue
        counts = {int(re.match(r"\d+", part).group()) for part in value.split(",") if re.match(r"\d+", part)}
        if len(counts) != 1:
            raise WorldError(f"{name}={value!r}: nodes run different numbers of tasks; launch the same "
                             f"number of tasks on every node (--ntasks-per-node)")
        return counts.pop()
    return 1


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
        world = World(
            rank=int(env["SLURM_PROCID"]), world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            local_world_size=slurm_tasks_per_node(env),
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
    """The device of this rank. With CUDA: GPU ``local_rank`` when the rank sees every GPU of its
    node, GPU 0 when the launcher gave each rank one GPU of its own (Slurm's ``--gpus-per-task=1``,
    a per-rank CUDA_VISIBLE_DEVICES), and under Slurm's ``--gpu-bind=closest`` (each task sees the
    GPUs of its NUMA domain, shared with the node's other tasks there) its place among the tasks
    that see the same GPUs (``gpu_sharers``); fewer GPUs than ranks is an error naming the
    settings, never two ranks silently sharing a GPU (NCCL would fail later with "Duplicate GPU")."""
    if preference == "cpu" or (preference == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise WorldError(f"rank {world.rank}: device=cuda asked for but CUDA is not available")
    visible = torch.cuda.device_count()
    sharing = None
    if 1 < visible < world.local_world_size:  # a subset of the node's GPUs, seen by several tasks
        # the set named by the GPUs' own identities: CUDA_VISIBLE_DEVICES may number each task's from 0
        sharing = gpu_sharers(world, ",".join(gpu_identity(torch.device("cuda", i)) for i in range(visible)))
    index = gpu_index(world, visible, os.environ.get("CUDA_VISIBLE_DEVICES"), sharing)
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def gpu_index(world: World, visible: int, cuda_visible_devices: Optional[str],
              sharing: Optional[Sequence[int]] = None) -> int:
    """Which of the ``visible`` GPUs this rank drives (see ``select_device``). ``sharing``: the
    local ranks of this node that see the same GPUs as this one, this one included (None: not
    known); each takes the GPU at its place among them, in local-rank order."""
    if visible >= world.local_world_size and world.local_rank < visible:
        # every rank's index differs, so ranks that see the same GPUs get different ones, and ranks
        # that see disjoint sets (--gpu-bind=closest with at most one task per GPU) do too
        return world.local_rank
    if visible == 1:
        return 0  # one GPU per rank, bound by the launcher; duplicates are caught at start-up
    if sharing and world.local_rank in sharing and len(sharing) <= visible:
        return sorted(sharing).index(world.local_rank)
    shared = (f"; {len(sharing)} ranks of this node (local ranks {sorted(sharing)}) see these GPUs"
              if sharing else "")
    raise WorldError(
        f"rank {world.rank}: local rank {world.local_rank} of {world.local_world_size} ranks on this "
        f"node, but only {visible} GPU(s) are visible (CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}){shared}; "
        f"NCCL needs one GPU per rank: start at most {visible} ranks per node (torchrun "
        f"--nproc-per-node, Slurm --ntasks-per-node) or give each rank its own GPU (--gpus-per-task=1)")


GPU_EXCHANGE_S = 300.0  # the node's tasks start together; one that never comes is named after this


def gpu_sharers(world: World, gpus: str, env: Optional[Mapping[str, str]] = None,
                timeout_s: float = GPU_EXCHANGE_S, folder: Optional[Path] = None) -> Optional[list[int]]:
    """Collective among the tasks of this node in a Slurm step, before any process group exists:
    the local ranks (this one included) whose visible GPUs ``gpus`` (a string naming the set) are
    the same as this rank's. None outside a Slurm step (no such exchange there: ``gpu_index``
    then refuses what it cannot tell apart).

    Why an exchange: which tasks share a NUMA domain's GPUs under ``--gpu-bind=closest`` follows
    from the CPU distribution (Slurm's default, ``block:cyclic``, alternates sockets: local ranks
    0, 2, 4, 6 on the first, 1, 3, 5, 7 on the second; ``block:block`` fills one socket first), the
    cores per socket and ``--cpus-per-task``; no variable of a task says it. So each task writes its
    set to a node-local folder (the temporary directory, one folder per job, step, restart and
    node) and reads the others'; the last to have read removes the folder."""
    env = os.environ if env is None else env
    job, step = env.get("SLURM_JOB_ID"), env.get("SLURM_STEP_ID")
    if world.source != "slurm" or not job or step is None:
        return None
    where = folder or Path(tempfile.gettempdir()) / (
        f"gradientflow-gpus-{job}.{step}.{env.get('SLURM_RESTART_COUNT', '0')}.{env.get('SLURM_NODEID', '0')}")
    where.mkdir(parents=True, exist_ok=True)
    partial = where / f".{world.local_rank}.partial"
    partial.write_text(gpus)
    os.replace(partial, where / str(world.local_rank))  # whole or absent to a reader
    deadline = time.monotonic() + timeout_s
    while True:
        seen = {int(p.name): p.read_text() for p in where.iterdir() if p.name.isdigit()}
        if len(seen) >= world.local_world_size:
            break
        if time.monotonic() > deadline:
            missing = sorted(set(range(world.local_world_size)) - set(seen))
            raise WorldError(f"rank {world.rank}: local rank(s) {missing} of this node did not say which "
                             f"GPUs they see within {timeout_s:.0f} s (through {where})")
        time.sleep(0.05)
    (where / f"read.{world.local_rank}").touch()
    try:
        if sum(p.name.startswith("read.") for p in where.iterdir()) >= world.local_world_size:
            shutil.rmtree(where, ignore_errors=True)
    except OSError:  # another rank removed it meanwhile
        pass
    return sorted(rank for rank, theirs in seen.items() if theirs == gpus)


def gpu_identity(device: torch.device) -> str:
    """A name for the physical GPU behind ``device``, the same from every process that sees it."""
    properties = torch.cuda.get_device_properties(device)
    uuid = getattr(properties, "uuid", None)
    return f"GPU-{uuid}" if uuid else f"{socket.gethostname()}/pci-{getattr(properties, 'pci_bus_id', device.index)}"


def check_one_rank_per_gpu(store: dist.Store, world: World, gpu: str, timeout_s: float) -> None:
    """Collective over the store, before NCCL starts: every rank claims its GPU; if two ranks claim
    the same one, every rank raises the same error naming them (rather than NCCL failing on some
    ranks with "Duplicate GPU" and leaving the others waiting)."""
    generation = _generation()
    key = f"gradientflow/gpu/{generation}/"
    owner = store.compare_set(key + "owner/" + gpu, "", str(world.rank)).decode()
    if owner != str(world.rank):
        store.set(key + "conflict", f"ranks {owner} and {world.rank} both use GPU {gpu}")
    if store.add(key + "checked", 1) == world.world_size:
        store.set(key + "done", "1")
    store.wait([key + "done"], datetime.timedelta(seconds=timeout_s))
    if store.check([key + "conflict"]):
        conflict = store.get(key + "conflict").decode()
        raise WorldError(f"rank {world.rank}: {conflict} (and maybe more): NCCL needs one GPU per rank; "
                         f"check CUDA_VISIBLE_DEVICES, Slurm's --gpus-per-task / --gpu-bind and the "
                         f"number of ranks per node")


def _generation() -> str:
    """Keys of an earlier attempt of this job (torchrun restart, Slurm requeue) stay apart."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", os.environ.get("SLURM_RESTART_COUNT", "0"))


