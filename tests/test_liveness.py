"""The liveness checks of gradientflow_repro/distributed.py against a real store: who is lost, and
how many store round trips a poll costs. At 512 ranks every rank polls the store in rank 0 at
once, so a poll must cost the same few calls whatever the world size (the store then sends one
count per rank in one answer). Other ranks are emulated by writing their keys."""

from __future__ import annotations

import collections
import pickle
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from gradientflow_repro import distributed
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
from gradientflow_repro.distributed import Liveness, World
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
