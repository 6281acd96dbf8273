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

Modules: ``world`` (the world and the device), ``liveness`` (heartbeat, watchdog, marks),
``collectives`` (the trainer's small collectives); here the process group this rank joins, its
watchdog's state, and the diagnosis of a failed collective.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from typing import NoReturn, Optional

import torch
import torch.distributed as dist

from gradientflow_repro.distributed.collectives import agree_max, all_reduce_scalars, barrier, ranks_that_differ
from gradientflow_repro.distributed.liveness import (
    DONE,
    FINISHED,
    LEFT,
    MARK_CHARS,
    STOPPED,
    Liveness,
    Mark,
    dump_flight_recorder,
    flight_recorder_file,
    furthest_behind,
    stuck_text,
)
from gradientflow_repro.distributed.world import (
    GPU_EXCHANGE_S,
    World,
    WorldError,
    _generation,
    check_one_rank_per_gpu,
    describe_rank,
    discover_world,
    first_slurm_host,
    gpu_identity,
    gpu_index,
    gpu_sharers,
    select_device,
    slurm_tasks_per_node,
)

__all__ = [
    "DONE", "FINISHED", "GPU_EXCHANGE_S", "LEFT", "LOST_RANK_WAIT_S", "MARK_CHARS", "NCCL_TIMEOUT_GRACE_S",
    "STOPPED", "Liveness", "Mark", "World", "WorldError", "agree_max", "all_reduce_scalars", "barrier",
    "check_one_rank_per_gpu", "describe_failure", "describe_rank", "destroy_process_group",
    "destroy_process_group_and_exit", "diagnose_failure", "discover_world", "dump_flight_recorder",
    "first_slurm_host", "flight_recorder_file", "furthest_behind", "gpu_identity", "gpu_index",
    "gpu_sharers", "init_process_group", "mark_progress", "ranks_that_differ", "select_device",
    "slurm_tasks_per_node", "stop_liveness", "stuck_text", "unresponsive_ranks", "wait_for_watchdog",
    "watchdog_fired", "_generation",
]

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
