"""The liveness checks of gradientflow_repro/distributed/liveness.py against a real store: who is
lost, and how many store round trips a poll costs. At 512 ranks every rank polls the store in rank 0 at
once, so a poll must cost the same few calls whatever the world size (the store then sends one
count per rank in one answer). Other ranks are emulated by writing their keys."""

from __future__ import annotations

import collections
import pickle
import re
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from gradientflow_repro import distributed, logs
from gradientflow_repro.distributed import DONE, STOPPED, Liveness, World


class CountingStore:
    """A store that counts the calls made through it (no ``clone``: the liveness code then uses
    this very object)."""

    def __init__(self, store: dist.Store) -> None:
        self.store, self.calls = store, collections.Counter()

    def __getattr__(self, name: str):
        if name == "clone":
            raise AttributeError(name)
        method = getattr(self.store, name)

        def counted(*args, **kwargs):
            self.calls[name] += 1
            return method(*args, **kwargs)
        return counted

    def round_trips(self) -> int:
        return sum(n for name, n in self.calls.items() if name != "set_timeout")


def _world(rank: int, size: int) -> World:
    return World(rank, size, rank, size, "127.0.0.1", 0, "torchrun")


def _liveness(size: int, lost_after_s: float = 1.0, registered: int | None = None,
              **kwargs) -> tuple[Liveness, dist.Store, CountingStore]:
    """Rank 0's Liveness in a world of ``size``; ranks 1.. ``registered`` have started (keys set)."""
    store = dist.HashStore()
    counting = CountingStore(store)
    liveness = Liveness(counting, _world(0, size), limit_s=30.0, beat_s=0.05, lost_after_s=lost_after_s,
                        **kwargs)
    liveness._beat()
    counting.append(liveness.registry, "0,")
    for rank in range(1, size if registered is None else registered):
        store.set(liveness.keys[rank], "1")
        store.append(liveness.registry, f"{rank},")
    counting.calls.clear()
    return liveness, store, counting


def _bump(liveness: Liveness, store: dist.Store, ranks) -> None:
    for rank in ranks:
        store.add(liveness.keys[rank], 1)


@pytest.mark.parametrize("size", [4, 64])
def test_a_heartbeat_poll_costs_the_same_few_store_calls_at_any_world_size(size: int) -> None:
    liveness, store, counting = _liveness(size)
    liveness.read()  # the first poll also reads who registered
    first = counting.round_trips()
    counting.calls.clear()
    for _ in range(3):
        liveness.read()
    assert first == 2, counting.calls
    assert counting.round_trips() == 3 and counting.calls["multi_get"] == 3, counting.calls


def test_a_rank_whose_heartbeat_stops_is_lost_and_a_rank_that_left_is_not() -> None:
    liveness, store, _ = _liveness(6, lost_after_s=1.0)
    liveness.read()
    time.sleep(0.6)
    store.set(liveness.keys[4], DONE)  # left cleanly after its last collective
    _bump(liveness, store, [1, 3, 5])  # rank 2 has stopped counting
    liveness.read()
    assert liveness.peers_lost() == []  # silent for 0.6 s only
    time.sleep(0.6)
    _bump(liveness, store, [1, 3, 5])
    liveness.read()
    assert liveness.peers_lost() == [2]  # silent for 1.2 s of answers; rank 4 said done
    # the store stops answering (its host froze): that is what is lost, not the ranks it last showed
    assert liveness.peers_lost(liveness._last_read + 0.9) == [2]
    assert liveness.peers_lost(liveness._last_read + 1.5) is None


def test_a_peer_whose_own_watchdog_ended_it_is_not_named_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks stuck in the same collective arm at the same step and fire within a beat of each
    other: one that has already printed its line and left must not appear in the next one's list
    (a real race in a three-rank run with one rank frozen)."""
    store = dist.HashStore()
    ended = Liveness(store, _world(2, 3), limit_s=0.3, beat_s=0.05, lost_after_s=30.0)
    judge = Liveness(store, _world(0, 3), limit_s=30.0, beat_s=0.05, lost_after_s=30.0)
    for liveness in (ended, judge):
        liveness._beat()
        store.append(liveness.registry, f"{liveness.world.rank},")
    store.set(judge.keys[1], "1")  # rank 1: frozen, never counts again
    store.append(judge.registry, "1,")
    exits: list[int] = []
    monkeypatch.setattr(distributed.os, "_exit", exits.append)
    ended.where = "step 5"
    ended.since = time.monotonic() - 1.0  # stalled past its limit: its watchdog fires at once
    ended.start()
    deadline = time.monotonic() + 10
    while not exits and time.monotonic() < deadline:
        time.sleep(0.05)
    ended.stop()
    assert exits == [1] and store.get(ended.keys[2]) == STOPPED
    assert judge.silent_ranks() == [1]


@pytest.mark.parametrize("size", [4, 64])
def test_silent_ranks_costs_three_store_calls_and_names_silent_and_missing_ranks(size: int) -> None:
    liveness, store, counting = _liveness(size, registered=size - 1)  # the last rank never came up
    alive = [rank for rank in range(1, size - 1) if rank != 2]
    stop = threading.Event()

    def others_beat() -> None:
        while not stop.wait(0.02):
            _bump(liveness, store, alive)

    beating = threading.Thread(target=others_beat, daemon=True)
    beating.start()
    try:
        silent = liveness.silent_ranks()
    finally:
        stop.set()
        beating.join()
    assert silent == [2, size - 1]
    assert counting.round_trips() == 3, counting.calls


@pytest.mark.parametrize("size", [4, 64])
def test_unresponsive_ranks_reads_one_key_per_poll(size: int) -> None:
    store = dist.HashStore()
    counting = CountingStore(store)
    key = f"gradientflow/failed/{distributed._generation()}"
    for rank in range(size):
        if rank not in (0, 1):
            store.append(key, f"{rank},")  # the other survivors have marked themselves
    wait_s = 0.5
    started = time.monotonic()
    lost = distributed.unresponsive_ranks(_world(0, size), wait_s, store=counting)
    polls = (time.monotonic() - started) / 0.1 + 2
    assert lost == [1]
    assert counting.calls["append"] == 1 and counting.calls["check"] == 0, counting.calls
    assert counting.calls["get"] <= polls, counting.calls
    assert counting.round_trips() == 1 + counting.calls["get"], counting.calls


def test_the_watchdog_dumps_the_nccl_flight_recorder_where_torch_would(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCH_FR_DUMP_TEMP_FILE", raising=False)
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE", raising=False)
    monkeypatch.setenv("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(tmp_path / "dumps" / "nccl_trace_rank_"))
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "0")
    assert distributed.dump_flight_recorder(3) is None  # no recorder, nothing to dump
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    path = distributed.dump_flight_recorder(3)
    assert path == str(tmp_path / "dumps" / "nccl_trace_rank_3")
    assert "entries" in pickle.loads(Path(path).read_bytes())  # torch's flight recorder format


def test_a_lost_peer_is_named_by_the_watchdog_without_waiting_for_the_limit(tmp_path: Path) -> None:
    """The watchdog thread itself, in a subprocess (it ends its process): rank 1 of 3 sees rank 2's
    heartbeat stop and exits 1 with one line, long before its 30 s limit."""
    import subprocess
    import sys

    code = """
import time, torch.distributed as dist
from gradientflow_repro import logs
from gradientflow_repro.distributed import Liveness, World
logs.configure(rank=1)  # as train.py does: the watchdog's line is a logged error
store = dist.HashStore()
live = Liveness(store, World(1, 3, 1, 3, "127.0.0.1", 0, "torchrun"), limit_s=30.0, beat_s=0.1,
                lost_after_s=1.0)
for rank in (0, 2):
    store.set(live.keys[rank], "1"); store.append(live.registry, f"{rank},")
live.start()
live.where, live.since = "step 7", time.monotonic()
for _ in range(100):
    store.add(live.keys[0], 1)
    time.sleep(0.1)
print("not ended")
"""
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stdout + result.stderr
    assert time.monotonic() - started < 8
    lines = result.stderr.strip().splitlines()
    assert lines == [lines[0]] and lines[0].startswith("error: rank 1: lost rank(s) [2] (no heartbeat for 1 s)"), \
        result.stderr
    assert "in step 7" in lines[0]


def _rank(rank: int, roles: list[str], port: int, timeout_s: float, limit_s: float, before: str, after: str,
          out: str) -> None:
    """One rank of a small gloo job, for the tests below (a process of its own: the watchdog ends
    it), writing to ``out``/rank<R>.err and .out. Every rank marks ``before`` and passes one
    all-reduce with the others; then the ``stuck`` rank hangs outside any collective (as in a data
    loader), a ``killed`` rank marks ``after`` and dies, and the others mark ``after`` and wait in
    the next all-reduce: gloo's timeout ends it with an error they diagnose, or (a long timeout: a
    hang, as under NCCL) their watchdog speaks after ``limit_s``."""
    import datetime
    import os
    import signal
    import sys

    import torch

    sys.stdout = open(f"{out}/rank{rank}.out", "w", buffering=1)
    sys.stderr = open(f"{out}/rank{rank}.err", "w", buffering=1)  # where the watchdog writes its line
    logs.configure(rank=rank)  # as train.py does: the watchdog's line is a logged error
    size, role = len(roles), roles[rank]
    store = dist.TCPStore("127.0.0.1", port, size, False, timeout=datetime.timedelta(seconds=30))
    store.add("up", 1)
    while store.add("up", 0) < size:  # everyone is up: the collectives' timeout is about them alone
        time.sleep(0.05)
    world = World(rank, size, rank, size, "127.0.0.1", port, "torchrun")
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    distributed._STORE = store
    distributed._LIVENESS = Liveness(store, world, limit_s=limit_s, beat_s=0.2, lost_after_s=30.0)
    distributed._LIVENESS.start()
    distributed.mark_progress(before)
    dist.all_reduce(torch.ones(1))
    if role == "stuck":
        time.sleep(60)
        os._exit(3)
    distributed.mark_progress(after)
    if role == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        dist.all_reduce(torch.ones(1))
    except Exception as error:  # noqa: BLE001 - what the trainer does with it (train.py)
        line, complete = distributed.diagnose_failure(world, error)
        print(f"error: {line}", file=sys.stderr, flush=True)
        print(f"complete: {complete}", flush=True)
        os._exit(0)
    os._exit(4)


def _start_ranks(tmp_path: Path, roles: list[str], **args) -> tuple[dist.TCPStore, list]:
    """The ranks of ``_rank`` (forked from the fork server, which has imported torch already), and
    the store they share, served by this process (so that it outlives any rank)."""
    import datetime
    import multiprocessing

    from gradientflow_repro.cluster.world import PRELOAD

    store = dist.TCPStore("127.0.0.1", 0, len(roles) + 1, True, timeout=datetime.timedelta(seconds=30),
                          wait_for_workers=False)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    processes = [context.Process(target=_rank, args=(rank, roles, store.port, args["timeout_s"], args["limit_s"],
                                                     args["before"], args["after"], str(tmp_path)), daemon=True)
                 for rank in range(len(roles))]
    for process in processes:
        process.start()
    return store, processes


def _error_lines(tmp_path: Path, rank: int) -> list[str]:
    err = tmp_path / f"rank{rank}.err"
    return [line for line in err.read_text().splitlines() if line.startswith("error:")] if err.exists() else []


def _end(processes: list) -> None:
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join(timeout=30)


def test_under_gloo_a_rank_stuck_outside_a_collective_is_named_stuck_and_a_killed_one_lost(tmp_path: Path) -> None:
    """Rank 1 hangs fetching its next batch (alive: its heartbeat moves) while rank 2 dies and ranks
    0 and 3 wait in the next step's all-reduce: gloo's timeout ends it, and the survivors' line
    names rank 1 as stuck, with where it is, and rank 2 as lost (neither answers the store's roll
    call; only rank 1's heartbeat moves after the failure)."""
    store, processes = _start_ranks(tmp_path, ["wait", "stuck", "killed", "wait"], timeout_s=2.0,
                                    limit_s=60.0, before="step 3", after="step 4")
    try:
        for rank in (0, 3):
            processes[rank].join(timeout=45)
            assert processes[rank].exitcode == 0, (tmp_path / f"rank{rank}.err").read_text()[-3000:]
        processes[2].join(timeout=5)
        assert processes[2].exitcode == -9
        assert processes[1].is_alive()  # still hanging: nothing ended it
    finally:
        _end(processes)
    for rank in (0, 3):
        lines = _error_lines(tmp_path, rank)
        assert len(lines) == 1, lines
        assert lines[0].startswith(f"error: rank {rank}: lost rank(s) [2] (no answer within 3 s); "
                                   f"rank 1 is stuck in step 3 for "), lines
        assert "s (alive: its heartbeat moves); a collective failed: " in lines[0], lines
        # the line says it all: no traceback of where this rank waited
        assert (tmp_path / f"rank{rank}.out").read_text().splitlines()[-1] == "complete: True"


def test_under_hanging_collectives_the_watchdogs_name_the_rank_behind_the_others(tmp_path: Path) -> None:
    """As under NCCL (collectives hang, they do not fail): in an evaluation, rank 1 hangs in its data
    loop while ranks 0 and 2 have counted and wait in the all-reduce after it; every heartbeat
    moves. Each rank's watchdog fires after ``limit_s`` without progress: ranks 0 and 2 name rank 1
    (the one furthest behind in the marks) and where it is; rank 1 says that it is the stuck one."""
    store, processes = _start_ranks(tmp_path, ["wait", "stuck", "wait"], timeout_s=60.0, limit_s=2.5,
                                    before="evaluation after step 8", after="evaluation after step 8: counting")
    try:
        deadline = time.monotonic() + 45
        while time.monotonic() < deadline and not all(_error_lines(tmp_path, rank) for rank in range(3)):
            time.sleep(0.1)
    finally:
        _end(processes)
    lines = {rank: _error_lines(tmp_path, rank) for rank in range(3)}
    assert all(len(found) == 1 for found in lines.values()), lines
    assert lines[1][0].startswith("error: rank 1: this rank is stuck in evaluation after step 8 for "), lines
    assert "the other 2 rank(s) have gone on to evaluation after step 8: counting" in lines[1][0], lines
    for rank in (0, 2):
        assert lines[rank][0].startswith(f"error: rank {rank}: rank 1 is stuck in evaluation after step 8 "), lines
        assert re.search(r"; no progress for \d+ s in evaluation after step 8: counting \(watchdog after 2 s\)",
                         lines[rank][0]), lines


@pytest.mark.parametrize("size", [4, 64])
def test_the_mark_travels_with_the_beat_and_all_marks_are_read_in_one_call(size: int) -> None:
    """A beat writes the count and the mark in one store call; a diagnosis reads every rank's mark
    in one more, whatever the world size, and names the rank furthest behind: here rank 2 stuck
    fetching its batch after step 4 while the others have marked step 5 and wait for it."""
    liveness, store, counting = _liveness(size)
    for where in ("step 4", "step 5"):
        liveness.mark(where)
    liveness._beat()
    assert counting.round_trips() == 1 and counting.calls["multi_set"] == 1, counting.calls
    assert int(store.get(liveness.keys[0])) == 2  # the count, as every poll parses it
    assert distributed.Mark.decode(store.get(liveness.mark_keys[0])) == distributed.Mark(2, 0, "step 5")
    for rank in range(1, size):
        mark = distributed.Mark(1, 31, "step 4") if rank == 2 else distributed.Mark(2, 31, "step 5")
        store.set(liveness.mark_keys[rank], mark.encode())
    store.set(liveness.keys[size - 1], STOPPED)  # its own watchdog ended it: still where it was
    counting.calls.clear()
    marks = liveness.marks(range(1, size))
    assert counting.round_trips() == 1 and counting.calls["multi_get"] == 1, counting.calls
    assert marks[size - 1] == (distributed.Mark(2, 31, "step 5"), STOPPED)
    line = liveness.diagnose(31.0, [], marks=marks)
    assert line == ("rank 0: rank 2 is stuck in step 4 for 31 s (alive: its heartbeat moves); no progress for "
                    "31 s in step 5 (watchdog after 30 s): this rank waits in a collective for the stuck rank(s)")
    liveness.mark(None)  # past the last collective: nothing to compare any more
    liveness._beat()
    assert store.get(liveness.mark_keys[0]) == distributed.FINISHED
    assert distributed.Mark.decode(distributed.FINISHED) is None
