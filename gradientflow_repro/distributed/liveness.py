"""A rank's heartbeat and watchdog (``Liveness``), the marks that tell a stuck rank from a lost one
(``Mark``), and NCCL's flight recorder dumped before the watchdog ends the process.

The package's docstring (``gradientflow_repro.distributed``) says why every rank runs one.
"""

from __future__ import annotations

import datetime
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence

import torch.distributed as dist

from gradientflow_repro.distributed.world import World, _generation

log = logging.getLogger(__name__)

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
            log.error(message + (f"; NCCL flight recorder in {dump}" if dump else ""))
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
        """The line the watchdog logs as its error: who is lost (``silent``: ranks whose heartbeat stopped,
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


