"""Who am I in the job: world discovery, device choice and the process group.

The world comes from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), else
from Slurm's (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, master = first host of the node list),
else it is a single process. The backend follows the device: NCCL with one GPU per local rank when
CUDA is there, gloo otherwise; two ranks on one GPU are refused before NCCL starts, naming them.

A lost rank must end the job quickly with one line that names it, not a hang. Under gloo a
collective with a peer whose process died fails at once and ``describe_failure`` names the ranks
that no longer answer (the trainer then exits 1 on that line, without a traceback). Under NCCL
collectives return before they finish, so a dead peer is a hang in the next host synchronisation
(under gloo too when a node vanishes without closing its connections), and NCCL's own watchdog
aborts the process without a word, after its timeout. So every rank runs a ``Liveness`` watchdog:
a thread that beats in the rendezvous store and reads everyone's beats in one round trip; a rank
whose beat stops is named within a few beats (about 40 s at the 512-GPU settings), whatever
``watchdog_s`` says, and a rank that has made no progress for ``watchdog_s`` while every beat moves
(stuck, not lost) says so. Either way the process ends, after dumping NCCL's flight recorder when
one is on. Under Slurm a rank whose process exits badly ends the step sooner still (slurm/task.sh).

A rank can also be alive but stuck outside any collective (a data loader that never returns, a
hang in Python): its heartbeat moves, and the others wait for it in the next collective. Every
heartbeat also publishes the rank's mark (``mark_progress``: how many marks, where, for how long;
``Mark``), and every rank makes the same marks, so the stuck rank is the one furthest behind. Its
peers name it stuck, with where it is, not lost: under gloo when their collective times out
(``diagnose_failure``: the ranks that do not answer and whose heartbeat still moves), under NCCL
when their watchdog fires; the stuck rank's own watchdog says that it is the one.
"""

from __future__ import annotations

import datetime
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, NoReturn, Optional, Sequence

import torch
import torch.distributed as dist

from gradientflow_repro.comm.base import CommStats
from gradientflow_repro.comm.recursive_doubling import small_sum


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


NCCL_TIMEOUT_GRACE_S = 60.0  # NCCL's watchdog aborts silently: ours must speak first
_STORE: Optional[dist.Store] = None
_LIVENESS: Optional["Liveness"] = None


def init_process_group(world: World, device: torch.device, timeout_s: float,
                       watchdog_s: Optional[float] = None) -> None:
    """Join the job: rendezvous, refuse two ranks on one GPU, start the process group (NCCL eagerly
    on this rank's GPU) and this rank's ``Liveness`` watchdog."""
    global _STORE, _LIVENESS
    if world.world_size == 1 or dist.is_initialized():
        return
    nccl = device.type == "cuda"
    os.environ.setdefault("MASTER_ADDR", world.master_addr)
    os.environ.setdefault("MASTER_PORT", str(world.master_port))
    timeout = datetime.timedelta(seconds=timeout_s)
    # the store init_process_group would make itself (torchrun's agent store under torchrun)
    store, _, _ = next(dist.rendezvous("env://", rank=world.rank, world_size=world.world_size,
                                       timeout=timeout))
    if nccl:
        check_one_rank_per_gpu(store, world, gpu_identity(device), timeout_s)
        timeout = datetime.timedelta(seconds=max(timeout_s, watchdog_s or 0) + NCCL_TIMEOUT_GRACE_S)
    dist.init_process_group(backend="nccl" if nccl else "gloo", store=store, rank=world.rank,
                            world_size=world.world_size, timeout=timeout,
                            device_id=device if nccl else None)
    _STORE = store
    # Under NCCL the watchdog must have spoken (limit, beat, diagnosis) within timeout_s. gloo raises
    # on its own after timeout_s (and describe_failure names the lost and the stuck ranks, within
    # the longer of LOST_RANK_WAIT_S and two beats): there the watchdog is only a backstop, for the
    # stuck rank itself.
    limit = watchdog_s or (max(timeout_s / 2, timeout_s - 3 * Liveness.beat_for(timeout_s) - 1) if nccl
                           else timeout_s + LOST_RANK_WAIT_S + 30)
    _LIVENESS = Liveness(store, world, limit, nccl=nccl)
    _LIVENESS.start()


def mark_progress(where: Optional[str]) -> None:
    """This rank is alive and at ``where`` (a step, evaluation, checkpoint): the watchdog's clock
    starts again; the first mark arms it. ``None`` disarms it, and stops judging the others'
    heartbeats (after the last collective, while rank 0 alone writes the summary and uploads and the
    other ranks leave). Every rank makes the same marks in the same order, so the number of marks
    says who is behind when a rank is stuck (the heartbeat publishes it with ``where``). Plain
    assignments: cheap enough for every step."""
    if _LIVENESS is not None:
        _LIVENESS.mark(where)


def watchdog_fired() -> bool:
    """Whether this rank's watchdog has already named the lost ranks and is ending the process."""
    return _LIVENESS is not None and _LIVENESS.fired.is_set()


def _watchdog_speaks() -> bool:
    """Whether this rank's watchdog has spoken or is about to (it is reading why this rank stalled):
    its line then says it all, and it ends the process."""
    return _LIVENESS is not None and (_LIVENESS.judging or _LIVENESS.fired.is_set())


def wait_for_watchdog() -> None:
    """Let this rank's watchdog, which has spoken, end the process (rank 0 keeps the store up a
    few seconds for the others' reads first); returns only if it has not after that long."""
    if _LIVENESS is not None:
        time.sleep(_LIVENESS.window_s + 3 * _LIVENESS.store_timeout_s + 5)


DONE = b"done"  # a rank's heartbeat after it left cleanly: finished, not lost
# a rank's heartbeat after its own watchdog ended it: it named the lost ranks itself, and the peers
# judging at the same moment must not count it among them
STOPPED = b"stopped"
LEFT = (DONE, STOPPED)
FINISHED = b"finished"  # a rank's mark after mark_progress(None): past its last collective
MARK_CHARS = 64  # of a mark's text, as published: enough for a step, an evaluation, a checkpoint


@dataclass(frozen=True)
class Mark:
    """Where a rank is, as its heartbeat publishes it next to its count: how many marks it has
    made (``mark_progress``: the same sequence on every rank), how long ago the last one was, and
    its text (None before the first). A rank stuck outside a collective stays at its mark while the
    others make the next one and wait for it there: it is the one furthest behind."""

    progress: int
    age_s: float
    where: Optional[str]

    def encode(self) -> str:
        head = f"{self.progress} {self.age_s:.0f}"
        return head if self.where is None else f"{head} {self.where[:MARK_CHARS]}"

    @staticmethod
    def decode(value: bytes) -> Optional["Mark"]:
        """The mark in ``value``; None for a rank that has finished, or a value that is no mark."""
        parts = value.decode("utf-8", "replace").split(" ", 2)
        try:
            return Mark(int(parts[0]), float(parts[1]), parts[2] if len(parts) > 2 else None)
        except (ValueError, IndexError):
            return None

    @property
    def place(self) -> str:
        return self.where if self.where is not None else "start-up (before its first step)"


def furthest_behind(marks: Mapping[int, Optional[Mark]]) -> list[int]:
    """The ranks with the fewest marks, when the ranks do not all have the same number (finished
    ranks and unknown marks aside): the stuck ones, which the others have gone past to wait for them
    in a collective."""
    known = {rank: mark.progress for rank, mark in marks.items() if mark is not None}
    if len(set(known.values())) < 2:
        return []
    lowest = min(known.values())
    return sorted(rank for rank, progress in known.items() if progress == lowest)


def _ranks_text(ranks: Sequence[int], most: int = 16) -> str:
    """A list of ranks for a line: all of them, or the first ``most`` and how many in all."""
    ranks = list(ranks)
    return str(ranks) if len(ranks) <= most else f"{str(ranks[:most])[:-1]}, ...] ({len(ranks)} ranks)"


def stuck_text(stuck: Sequence[int], marks: Mapping[int, Optional[Mark]], ended: Iterable[int] = ()) -> str:
    """The part of a line that names stuck ranks and where each is, grouped by place: alive (the
    heartbeat moves), unlike a lost rank; ``ended``: ranks whose own watchdog has ended them since."""
    ended, groups = set(ended), {}
    for rank in stuck:
        mark = marks.get(rank)
        groups.setdefault((mark.place if mark else None, rank in ended), []).append(rank)
    parts = []
    for (place, gone), ranks in groups.items():
        ages = [marks[rank].age_s for rank in ranks if marks.get(rank)]
        where = (f" in {place}" if place else "") + (f" for {max(ages):.0f} s" if ages and not gone else "")
        one = len(ranks) == 1
        who = f"rank {ranks[0]} is" if one else f"ranks {_ranks_text(ranks)} are"
        why = ("its own watchdog has ended it" if one else "their own watchdogs have ended them") if gone else (
            "alive: its heartbeat moves" if one else "alive: their heartbeats move")
        parts.append(f"{who} stuck{where} ({why})")
    return "; ".join(parts)


class Liveness:
    """A rank's heartbeat in the rendezvous store, and its watchdog.

    One thread writes an increasing count under this rank's key every ``beat_s`` seconds, and
    reads everyone's counts back in one ``multi_get``; a rank whose process is dead or frozen (or
    whose node is gone) stops counting. Every rank also appends its number to one registry key
    when it starts, so a single ``get`` tells who came up at all. A poll is thus a constant number
    of store round trips whatever the world size (the store still sends one count per rank: a few
    KB at 512 ranks). A rank that leaves cleanly writes ``done`` instead of a count. With each count,
    in the same ``multi_set``, the rank writes its ``Mark`` (how many marks it made, how long ago the
    last one was, its text) under a second key that no poll reads: only a diagnosis does, once.

    Another thread watches, and ends the process (exit status 1) after one line naming the lost
    ranks, so that the launcher ends the others, in two cases:

    - a peer's count has not moved for ``lost_after_s`` (a few beats, well under a minute): a dead
      process or node, which under NCCL (and for a node that vanished without closing its
      connections, under gloo too) is no error but a hang in the next collective. Under Slurm the
      task wrapper (slurm/task.sh) already ends the step when a rank's process exits; this catches
      what it cannot see: a node that froze or lost power, and torchrun across nodes, whose agents
      only watch their own node's workers.
    - this rank, armed by its first ``mark_progress`` (start-up work such as listing and checking
      the files can take long and is not judged), has made no progress for ``limit_s``: it is stuck
      in a collective although every heartbeat moves (a rank stuck, not lost). The watchdog then
      reads everyone's counts twice, a few beats apart, and names the ranks whose count did not move
      (lost); then everyone's marks, once, and names the ranks furthest behind (``furthest_behind``)
      and where they are: stuck outside a collective (a data loader, a hang in Python) while the
      others wait for them in the next one. When this rank is the one behind, it says so.

    Under ``srun`` the store lives in rank 0: if it does not answer, the line says rank 0 is the
    likely loss. Store calls can block when the store's host is frozen, so none of them is made by
    the watching thread itself."""

    LOST_AFTER_BEATS = 6

    def __init__(self, store: dist.Store, world: World, limit_s: float,
                 beat_s: Optional[float] = None, lost_after_s: Optional[float] = None,
                 nccl: bool = False) -> None:
        self.world, self.limit_s, self.nccl = world, limit_s, nccl
        self.beat_s = beat_s or self.beat_for(limit_s)
        # a missed beat or two (a store slow under load, a busy interpreter) is not a loss
        self.lost_after_s = lost_after_s or min(limit_s, self.LOST_AFTER_BEATS * self.beat_s + self.store_timeout_s)
        self.store = store.clone() if hasattr(store, "clone") else store  # its own connection
        self.store.set_timeout(datetime.timedelta(seconds=self.store_timeout_s))
        prefix = f"gradientflow/alive/{_generation()}/"
        self.keys = [f"{prefix}{rank}" for rank in range(world.world_size)]
        self.mark_keys = [f"gradientflow/mark/{_generation()}/{rank}" for rank in range(world.world_size)]
        self.registry = prefix + "registered"
        self.where: Optional[str] = None  # unarmed until the first mark_progress
        self.since = time.monotonic()
        self.progress = 0  # marks made (mark_progress with a place): the same sequence on every rank
        self.finishing = False  # mark_progress(None): the others may leave; judge nobody any more
        self.judging = False  # the watchdog is reading the store to say why this rank stalled
        self.fired = threading.Event()
        self._count = 0
        self._registered: list[int] = []
        self._last_values: list[bytes] = []
        self._changed: dict[int, float] = {}  # rank -> when its count last moved (monotonic)
        self._lock = threading.Lock()  # the heartbeat thread writes what the watchdog reads
        self._write_lock = threading.Lock()  # this rank's key: counts, then why it left
        self._last_read = time.monotonic()  # when the store last answered a read
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=target, name=f"gradientflow-{name}", daemon=True)
                         for name, target in (("heartbeat", self._beat_forever), ("watchdog", self._watch))]

    @staticmethod
    def beat_for(limit_s: float) -> float:
        return min(5.0, max(0.5, limit_s / 10))

    @property
    def store_timeout_s(self) -> float:
        return max(5.0, 2 * self.beat_s)

    @property
    def window_s(self) -> float:
        return 2 * self.beat_s + 0.5

    def mark(self, where: Optional[str]) -> None:
        """``mark_progress``: this rank is at ``where`` (None: past its last collective)."""
        self.where, self.since = where, time.monotonic()
        if where is None:
            self.finishing = True
        else:
            self.progress += 1

    def published_mark(self) -> bytes:
        """What this rank's heartbeat publishes as its mark."""
        if self.finishing:
            return FINISHED
        return Mark(self.progress, time.monotonic() - self.since, self.where).encode().encode()

    def start(self) -> None:
        self._beat()  # the keys exist before this rank is registered (multi_get waits for keys)
        self.store.append(self.registry, f"{self.world.rank},")
        self._last_read = time.monotonic()
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:  # the heartbeat may sit in a store call: wait a little only
            thread.join(timeout=self.store_timeout_s if thread.name.endswith("heartbeat") else 2 * self.beat_s)

    def _beat(self) -> bool:
        try:
            with self._write_lock:  # never a count after the watchdog wrote why this rank is gone
                if self.fired.is_set():
                    return False
                self._count += 1
                rank = self.world.rank  # the count and the mark in one round trip
                self.store.multi_set([self.keys[rank], self.mark_keys[rank]],
                                     [str(self._count).encode(), self.published_mark()])
            return True
        except Exception:  # noqa: BLE001 - the store is gone; judged only when we are stuck
            return False

    def registered(self) -> list[int]:
        """Ranks that have started their heartbeat (one ``get``)."""
        return sorted({int(rank) for rank in self.store.get(self.registry).decode().split(",") if rank})

    def read(self) -> None:
        """One poll: who is registered (one ``get``, until everyone is) and every registered rank's
        count (one ``multi_get``); remembers when each count last moved."""
        if len(self._registered) < self.world.world_size:
            self._registered = self.registered()
        values = self.store.multi_get([self.keys[rank] for rank in self._registered])
        now = time.monotonic()
        with self._lock:
            before = dict(zip(self._registered, self._last_values))
            for rank, value in zip(self._registered, values):
                if before.get(rank) != value or rank not in self._changed:
                    self._changed[rank] = now
            self._last_values = values
            self._last_read = now

    def _beat_forever(self) -> None:
        while not self._stop.wait(self.beat_s):
            if self._beat():
                try:
                    self.read()
                except Exception:  # noqa: BLE001 - the store is gone: the watchdog sees _last_read age
                    pass
        if not self.fired.is_set():  # leaving cleanly: the others must not take this rank for lost
            self._set_quietly(DONE)

    def peers_lost(self, now: Optional[float] = None) -> Optional[list[int]]:
        """Registered ranks whose count has not moved for ``lost_after_s`` of answers from the store
        (None: the store itself has not answered for that long). A peer's silence counts only up to
        the last answer: when the store's host froze, its own count stopped too, but the store is
        what is gone. Reads only what the heartbeat thread recorded."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if now - self._last_read > self.lost_after_s:
                return None
            values = dict(zip(self._registered, self._last_values))
            return [rank for rank, changed in sorted(self._changed.items()) if rank != self.world.rank
                    and values.get(rank) not in LEFT and self._last_read - changed > self.lost_after_s]

    def _watch(self) -> None:
        while not self._stop.wait(self.beat_s):
            if self.finishing or self._stop.is_set():
                continue
            now = time.monotonic()
            stalled = now - self.since
            lost = self.peers_lost(now)
            if lost is None:
                message = self.diagnose(stalled, silent=None)
            elif lost:
                message = self.diagnose(stalled, silent=lost, silent_for_s=self.lost_after_s)
            elif self.where is not None and stalled > self.limit_s:
                self.judging = True  # seconds of reads: a collective that breaks meanwhile must wait
                silent = self.silent_ranks()
                message = self.diagnose(stalled, silent, marks=self._marks_of_the_others(silent))
            else:
                continue
            self.fired.set()
            dump = dump_flight_recorder(self.world.rank) if self.nccl else None
            print(f"error: {message}" + (f"; NCCL flight recorder in {dump}" if dump else ""),
                  file=sys.stderr, flush=True)
            self._stop.set()  # no more counts: the key says why this rank is gone
            self._write_left(STOPPED)
            if self.world.rank == 0:  # it may host the store the other ranks are still reading
                time.sleep(self.window_s + 2 * self.store_timeout_s)
            os._exit(1)

    def _write_left(self, value: bytes) -> None:
        """Write ``value`` under this rank's key from a helper thread (the store may be frozen: the
        watching thread never blocks on it for more than one store timeout)."""
        writer = threading.Thread(target=lambda: self._set_quietly(value), daemon=True)
        writer.start()
        writer.join(timeout=self.store_timeout_s)

    def _set_quietly(self, value: bytes) -> None:
        try:
            with self._write_lock:
                self.store.set(self.keys[self.world.rank], value)
        except Exception:  # noqa: BLE001 - the store is gone with rank 0: nobody is left to ask
            pass

    def silent_ranks(self) -> Optional[list[int]]:
        """Ranks that never started their heartbeat, or whose count did not move over a few beats
        (None: the store does not answer). Three store calls, whatever the world size."""
        result: list = []

        def compare() -> None:
            registered = self.registered()
            never = [rank for rank in range(self.world.world_size) if rank not in registered]
            keys = [self.keys[rank] for rank in registered]
            before = self.store.multi_get(keys)
            time.sleep(self.window_s)
            after = self.store.multi_get(keys)
            result.append(sorted(never + [rank for rank, a, b in zip(registered, before, after)
                                          if a == b and a not in LEFT and rank != self.world.rank]))

        reader = threading.Thread(target=compare, daemon=True)
        reader.start()
        reader.join(timeout=self.window_s + 3 * self.store_timeout_s)
        return result[0] if result else None

    def marks(self, ranks: Sequence[int], store: Optional[dist.Store] = None
              ) -> dict[int, tuple[Optional[Mark], bytes]]:
        """Where each of ``ranks`` is, with its heartbeat's value (a count, or why it left): one
        ``multi_get``, whatever the number of ranks. Blocks on the store: callers bound it."""
        ranks = list(ranks)
        if not ranks:
            return {}
        values = (store or self.store).multi_get([self.keys[rank] for rank in ranks]
                                                 + [self.mark_keys[rank] for rank in ranks])
        return {rank: (Mark.decode(values[len(ranks) + index]), values[index]) for index, rank in enumerate(ranks)}

    def _marks_of_the_others(self, silent: Optional[list[int]]) -> Optional[dict[int, tuple[Optional[Mark], bytes]]]:
        """``marks`` of the registered ranks that are not ``silent`` (lost), from a helper thread
        (the store may be frozen); None when the store does not answer in time."""
        if silent is None:
            return None
        others = [rank for rank in self._registered if rank != self.world.rank and rank not in silent]
        result: list = []
        reader = threading.Thread(target=lambda: result.append(self.marks(others)), daemon=True)
        reader.start()
        reader.join(timeout=self.store_timeout_s + 1)
        return result[0] if result else None

    def diagnose(self, stalled_s: float, silent: Optional[list[int]], silent_for_s: Optional[float] = None,
                 marks: Optional[Mapping[int, tuple[Optional[Mark], bytes]]] = None) -> str:
        """The line the watchdog prints: who is lost (``silent``: ranks whose heartbeat stopped,
        None when the store does not answer), who is stuck (given the others' ``marks``: the ranks
        furthest behind, alive; this rank itself, if it is one of them), where this rank is and for
        how long."""
        me, parts = self.world.rank, []
        if silent is None:
            parts.append("the rendezvous store is unreachable: rank 0 (which hosts it) is probably lost")
        elif silent:
            parts.append(f"lost rank(s) {silent} (no heartbeat for {silent_for_s or self.window_s:.0f} s)")
        stuck, known, left, ended = [], {}, set(), set()
        if marks is not None and self.where is not None:
            known = {rank: mark for rank, (mark, _) in marks.items()}
            known[me] = Mark(self.progress, stalled_s, self.where)
            left = {rank for rank, (_, value) in marks.items() if value in LEFT}
            ended = {rank for rank, (_, value) in marks.items() if value == STOPPED}
            stuck = furthest_behind(known)
        if me in stuck:
            ahead = [rank for rank, mark in known.items() if mark is not None and mark.progress > self.progress]
            front = max(ahead, key=lambda rank: known[rank].progress)
            waiting = " and wait for it" if not left.intersection(ahead) else ""
            parts.append(f"this rank is stuck in {self.where} for {stalled_s:.0f} s (alive: its heartbeat "
                         f"moves; watchdog after {self.limit_s:.0f} s): the other {len(ahead)} rank(s) have "
                         f"gone on to {known[front].place}{waiting}")
            return f"rank {me}: " + "; ".join(parts)
        if stuck:
            parts.append(stuck_text(stuck, known, ended))
        who = "; ".join(parts) or "every rank is still alive (a rank is stuck, not lost)"
        if self.where is None:
            return f"rank {me}: {who}; before the first step: ending this rank"
        waits = ("a collective waits for a rank that is gone" if not stuck else
                 "this rank waits in a collective for the stuck rank(s)" if silent == [] else
                 "a collective waits for ranks that are gone or stuck")
        return (f"rank {me}: {who}; no progress for {stalled_s:.0f} s in {self.where} "
                f"(watchdog after {self.limit_s:.0f} s): {waits}")

    def stuck_among(self, missing: Sequence[int], before: Mapping[int, bytes], until: float,
                    store: dist.Store) -> dict[int, tuple[Optional[Mark], bytes]]:
        """Of the ``missing`` ranks (they did not answer after a collective failed), those alive:
        whose count moved after ``before`` was read (after the failure, so a rank that died in it
        cannot have written since), and those that its own watchdog had already ended (``STOPPED``:
        a stuck rank's own watchdog can speak first, and its exit is what broke the collective);
        ``marks`` of them. Polls their counts (one ``multi_get`` a poll) until each has moved or
        ``until``: a live rank beats every ``beat_s``, so ``before`` plus ``window_s`` (two beats)
        tells a stopped heartbeat from a moving one, as ``silent_ranks`` does."""
        moved = [rank for rank in missing if before.get(rank) == STOPPED]
        pending = [rank for rank in missing if rank in before and rank not in moved]
        while pending:
            values = store.multi_get([self.keys[rank] for rank in pending])
            moved += [rank for rank, value in zip(pending, values) if value != before[rank]]
            pending = [rank for rank in pending if rank not in moved]
            if not pending or time.monotonic() >= until:
                break
            time.sleep(max(0.1, self.beat_s / 4))
        return self.marks(sorted(moved), store)

    def counts(self, store: dist.Store) -> dict[int, bytes]:
        """Every registered rank's heartbeat value now (two store calls, whatever the world size)."""
        registered = sorted({int(rank) for rank in store.get(self.registry).decode().split(",") if rank})
        return dict(zip(registered, store.multi_get([self.keys[rank] for rank in registered])))


def flight_recorder_file(rank: int) -> str:
    """Where NCCL's flight recorder of ``rank`` is dumped: the prefix in TORCH_FR_DUMP_TEMP_FILE or
    (its older name) TORCH_NCCL_DEBUG_INFO_TEMP_FILE, as torch's own dump on timeout names it."""
    prefix = (os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
              or os.path.join(tempfile.gettempdir(), "nccl_trace_rank_"))
    return f"{prefix}{rank}"


def dump_flight_recorder(rank: int, timeout_s: float = 10.0) -> Optional[str]:
    """Write NCCL's flight recorder (the last collectives of each communicator, with their state;
    on when TORCH_NCCL_TRACE_BUFFER_SIZE > 0) where torch's own dump on timeout would, in the same
    format (``python -m torch.distributed.flight_recorder.fr_trace`` reads it). The watchdog ends
    the process before NCCL's own timeout, so without this NCCL would never dump. Returns the path,
    or None when there is no recorder or it did not answer within ``timeout_s``."""
    if int(os.environ.get("TORCH_FR_BUFFER_SIZE", os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "0")) or 0) <= 0:
        return None
    path = flight_recorder_file(rank)
    written: list[str] = []

    def dump() -> None:
        try:
            from torch._C._distributed_c10d import _dump_nccl_trace

            data = _dump_nccl_trace()
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "wb") as file:
                file.write(data)
            written.append(path)
        except Exception:  # noqa: BLE001 - a diagnostic only: the line naming the lost ranks matters
            pass

    writer = threading.Thread(target=dump, daemon=True)  # a wedged communicator must not stop the exit
    writer.start()
    writer.join(timeout_s)
    return written[0] if written else None


def stop_liveness() -> None:
    global _LIVENESS
    if _LIVENESS is not None:
        _LIVENESS.stop()
        _LIVENESS = None


def destroy_process_group() -> None:
    global _STORE
    stop_liveness()
    if dist.is_initialized():
        dist.destroy_process_group()
    _STORE = None


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


def all_reduce_scalars(values: Sequence[torch.Tensor | float], device: torch.device,
                       op: str = "sum") -> list[float]:
    """Reduce a few numbers across ranks in one collective, read back once. A value may be a
    one-element tensor on the device (a count summed there without reading it back). A small
    message: recursive doubling on gloo (log2(N) latencies), NCCL's own allreduce (its trees), as
    ``recursive_doubling.small_sum`` sends it."""
    tensor = torch.stack([value.reshape(()).double() if isinstance(value, torch.Tensor)
                          else torch.full((), float(value), dtype=torch.float64, device=device)
                          for value in values])
    if op == "min":  # (recursive doubling knows sum and max)
        if dist.is_initialized():
            dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    else:
        small_sum(op=op)(tensor, CommStats())
    return tensor.tolist()


def agree_max(flags: Sequence[torch.Tensor | float], device: torch.device) -> list[float]:
    """Collective: the largest value of each flag over all ranks, in one MAX-allreduce, read back
    to the host once. Every rank gets the same answer, so every rank takes the same decision.
    Python numbers become device tensors by a fill, not a copy from the host (which would wait)."""
    return all_reduce_scalars(flags, device, op="max")


def ranks_that_differ(tensors: Iterable[torch.Tensor], device: torch.device) -> list[int]:
    """Collective: ranks whose tensors' checksum (float64 sum and sum of squares) differs from
    rank 0's. Identical tensors give identical sums; a changed element changes them. One
    collective and one read-back whatever the world size: each rank writes its checksum into its
    own row of a [world, 2] table of zeros, a SUM-allreduce fills the table (adding zeros is exact),
    and the rows are compared with rank 0's on the device."""
    checksum = torch.zeros(2, dtype=torch.float64, device=device)
    for tensor in tensors:
        values = tensor.detach().double()
        checksum[0] += values.sum()
        checksum[1] += values.square().sum()
    if not dist.is_initialized():
        return []
    table = torch.zeros(dist.get_world_size(), 2, dtype=torch.float64, device=device)
    table[dist.get_rank()] = checksum
    dist.all_reduce(table)
    return (table != table[0]).any(1).nonzero().flatten().tolist()


LOST_RANK_WAIT_S = 3.0  # survivors of a broken collective report within milliseconds of each other


def unresponsive_ranks(world: World, wait_s: float = LOST_RANK_WAIT_S,
                       store: Optional[dist.Store] = None) -> Optional[list[int]]:
    """After a collective failed: which ranks are gone? Every surviving rank appends its number to
    one key of the rendezvous store and waits ``wait_s`` for the others, reading that key back (one
    ``get`` per poll, whatever the world size); ranks that never appear are lost (or stuck: alive
    outside the collective; ``diagnose_failure`` tells them apart). None when the store itself is
    unreachable: it lives in rank 0 (or in torchrun's agent), so then rank 0 is the likely loss."""
    try:
        store = _own_store() if store is None else store
        store.set_timeout(datetime.timedelta(seconds=wait_s))
        key = f"gradientflow/failed/{_generation()}"
        store.append(key, f"{world.rank},")
        deadline = time.monotonic() + wait_s
        while True:
            answered = {int(rank) for rank in store.get(key).decode().split(",") if rank}
            missing = [rank for rank in range(world.world_size) if rank not in answered]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.1)
    except Exception:  # noqa: BLE001 - the store is as dead as the rank that hosted it
        return None


def _own_store() -> dist.Store:
    """A connection of this caller's own to the rendezvous store (the heartbeat thread uses another)."""
    return _STORE.clone() if _STORE is not None and hasattr(_STORE, "clone") else (
        _STORE or dist.distributed_c10d._get_default_store())


def describe_failure(world: World, error: BaseException) -> str:
    """One message for a failed run: the error, and which ranks were lost if a collective broke."""
    return diagnose_failure(world, error)[0]


def diagnose_failure(world: World, error: BaseException) -> tuple[str, bool]:
    """``describe_failure``'s line, and whether the error is a collective that broke because ranks
    are gone (or the store with rank 0) or stuck: then the line says all there is to say, and the
    traceback, which shows only where this rank waited, is noise repeated by every survivor.

    The ranks that do not answer ``unresponsive_ranks`` are lost or stuck: a rank hung outside the
    collective (a data loader, a hang in Python) makes the others' collective time out, and never
    answers either. Its heartbeat tells: the counts of every rank are read when the diagnosis starts
    (after the failure), and a missing rank whose count moves since, within two beats, is alive:
    stuck, named with its mark (``Mark``: where it is and for how long); one whose count does not
    move is lost. The two waits overlap, so the line comes after the longer of them."""
    first = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
    if world.world_size == 1 or not dist.is_initialized() or not _is_collective_failure(error):
        return f"rank {world.rank}: {first}", False
    if _watchdog_speaks():  # one line per rank: the watchdog's (a stuck peer that ended broke this one)
        wait_for_watchdog()
    liveness, store, before, started = _LIVENESS, None, None, time.monotonic()
    if liveness is not None and not liveness.finishing:
        try:
            store = _own_store()
            store.set_timeout(datetime.timedelta(seconds=LOST_RANK_WAIT_S))  # a frozen store: as long as
            before = liveness.counts(store)  # the roll call below would wait for it
        except Exception:  # noqa: BLE001 - no heartbeats to read: the ranks that do not answer are lost
            store = None
    lost = unresponsive_ranks(world, LOST_RANK_WAIT_S, store=store)
    stuck: dict[int, tuple[Optional[Mark], bytes]] = {}
    if lost and before is not None:
        try:
            store.set_timeout(datetime.timedelta(seconds=liveness.store_timeout_s))
            stuck = liveness.stuck_among(lost, before, started + liveness.window_s, store)
        except Exception:  # noqa: BLE001 - the store went with a rank: what it answered stands
            stuck = {}
        lost = [rank for rank in lost if rank not in stuck]
    if lost is None:
        who = "the rendezvous store is unreachable: rank 0 (which hosts it) is probably lost"
    else:
        parts = [f"lost rank(s) {lost} (no answer within {LOST_RANK_WAIT_S:.0f} s)"] if lost else []
        if stuck:
            parts.append(stuck_text(sorted(stuck), {rank: mark for rank, (mark, _) in stuck.items()},
                                    [rank for rank, (_, value) in stuck.items() if value == STOPPED]))
        who = "; ".join(parts) or "every rank is still alive"
    if _watchdog_speaks():  # it began while this diagnosis waited
        wait_for_watchdog()
    return f"rank {world.rank}: {who}; a collective failed: {first}", lost is None or bool(lost or stuck)


def _is_collective_failure(error: BaseException) -> bool:
    text = f"{type(error).__name__} {error}".lower()
    return isinstance(error, getattr(dist, "DistError", RuntimeError)) or any(
        word in text for word in ("gloo", "nccl", "connection", "timed out", "timeout", "peer"))


def barrier(device: torch.device) -> None:
    if dist.is_initialized():
        # An all_reduce rather than dist.barrier(): NCCL barriers guess the device, this does not.
        all_reduce_scalars([0.0], device)
