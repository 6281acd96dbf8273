"""Stop requests from the scheduler, agreed by every rank at a step boundary.

Slurm warns a job before its time limit with the signal given by ``--signal`` (the templates use
SIGUSR1) and sends SIGTERM when it preempts or cancels it. A signal reaches each rank at a different
moment, so acting on it locally would leave ranks in different steps (and one rank waiting in a
collective for the others until the timeout). Instead the handler only records the signal; after
every step the ranks all-reduce (MAX) the recorded signal number, so all of them see the same
decision after the same step, checkpoint together and exit. (The trainer folds that number into the
step's overflow agreement: one collective and one read-back per step for both.)

- SIGUSR1: checkpoint, then exit with ``EXIT_REQUEUE`` so that the batch script runs
  ``scontrol requeue`` and the job continues from this checkpoint when it starts again;
- SIGTERM (preemption, ``scancel``): checkpoint, then exit with 128 + 15. Requeueing is left to
  Slurm (preemption in requeue mode) or the user (``scancel`` means stop).

More signals while the checkpoint is written are recorded and otherwise ignored, so they cannot
interrupt the write; the checkpoint itself is renamed into place only when complete.

Only the trainer decides. Slurm's ``--signal`` without ``B:`` (and its SIGTERM) reaches every
process of the step, the data loaders' worker processes included, whose default action for both
signals is to die; a dead worker ends the next batch with an error and the run with no checkpoint.
So workers are started inside ``workers_ignore_stop_signals()`` and run ``ignore_stop_signals``;
where a fork server forks them (the torchvision loader's), the server is started inside the block.
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from types import FrameType
from typing import Iterable, Iterator, Optional

import torch

from gradientflow_repro.distributed import all_reduce_scalars

EXIT_REQUEUE = 75  # sysexits' EX_TEMPFAIL: "temporary failure, try again"; the batch script requeues
REQUEUE_SIGNALS = (signal.SIGUSR1,)
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class StopRequests:
    """Records stop signals; ``agreed()`` is the collective decision (0 when nobody got one)."""

    def __init__(self, signals: Iterable[signal.Signals] = STOP_SIGNALS, received: int = 0) -> None:
        """``received``: a signal that came before these handlers were installed (acted on alike)."""
        self.received: int = received
        self.agreed_signal: int = 0
        self._previous = {}
        for signum in signals:
            self._previous[signum] = signal.signal(signum, self._record)

    def _record(self, signum: int, frame: Optional[FrameType]) -> None:
        # Only the strongest wish counts (SIGTERM 15 outranks SIGUSR1 10): a SIGTERM after the
        # warning means stop without requeue. Nothing else happens in a handler.
        self.received = max(self.received, signum)

    def agreed(self, device: torch.device) -> int:
        """Collective: the largest signal number any rank has received (0 for none)."""
        if not self.agreed_signal:
            self.agreed_signal = int(all_reduce_scalars([float(self.received)], device, op="max")[0])
        return self.agreed_signal

    @property
    def requeue(self) -> bool:
        return self.agreed_signal in REQUEUE_SIGNALS

    @property
    def exit_code(self) -> int:
        if not self.agreed_signal:
            return 0
        return EXIT_REQUEUE if self.requeue else 128 + self.agreed_signal

    @property
    def name(self) -> str:
        return signal.Signals(self.agreed_signal).name if self.agreed_signal else ""

    def ignore_from_now(self) -> None:
        """After the last checkpoint there is nothing left to protect: ignore further stop signals,
        so one arriving while the interpreter shuts down (when Python's handlers are gone) does not
        kill the process and turn a clean exit into a crash."""
        for signum in self._previous:
            signal.signal(signum, signal.SIG_IGN)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def ignore_stop_signals(*_: object) -> None:
    """In a data worker process, first thing: the stop signals no longer end it, except a SIGTERM
    from the process that started it (the trainer's ``Process.terminate()``, the loaders' and
    ``multiprocessing``'s last resort at shutdown: a worker deaf to it would hang the trainer's exit
    in ``join()``).

    SIGUSR1 is ignored (``SIG_IGN``). SIGTERM stays blocked in every thread (as the worker was born,
    ``workers_ignore_stop_signals``; blocked here too for this thread and the threads it starts),
    and a daemon thread takes each one with ``sigwaitinfo``, which says who sent it: the starter's
    ends the worker (exit status 0, as PyTorch's own worker handler does: the DataLoader reports any
    other status as a crash), anyone else's is dropped. The starter is the trainer: the worker's
    parent, or, for a worker forked by a fork server (the server is its parent), the process that
    asked the server for it (``multiprocessing.parent_process()``); a SIGTERM from the parent is
    taken too. Such a worker also ends when the trainer is gone (a second daemon thread waits on the
    trainer's end of a pipe): the DataLoader's own check in the worker watches the parent, which is
    the server, and the server lives as long as any of its workers, so both would be left behind.
    Takes and ignores arguments, so that it serves as a DataLoader ``worker_init_fn``; must run in
    the worker's main thread (Python sets dispositions there only)."""
    from multiprocessing import parent_process

    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    if not hasattr(signal, "sigwaitinfo"):  # no sender to tell (not Linux): ignore both
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
    parent, starter = os.getppid(), parent_process()  # starter: None in DALI's workers at this point
    senders = {parent} if starter is None else {parent, starter.pid}

    def end_when_the_starter_asks() -> None:
        while signal.sigwaitinfo([signal.SIGTERM]).si_pid not in senders:
            pass
        os._exit(0)

    threading.Thread(target=end_when_the_starter_asks, name="stop-signals", daemon=True).start()
    if starter is not None and starter.pid != parent:
        def end_with_the_starter() -> None:
            starter.join()  # returns when the trainer's end of the pipe closes: it has exited
            os._exit(0)

        threading.Thread(target=end_with_the_starter, name="starter-watch", daemon=True).start()


@contextmanager
def workers_ignore_stop_signals(processes: bool = False) -> Iterator[None]:
    """Start data worker processes inside this block: they are born deaf to the stop signals, and
    the trainer still gets every one of them. ``processes``: whether the block starts processes
    through ``multiprocessing`` (DALI's reader workers, a DataLoader's, a fork server); see below.

    How: the calling thread blocks SIGUSR1 and SIGTERM (``pthread_sigmask``) for the duration. A
    child inherits its parent thread's signal mask through fork and keeps it through exec, so the
    workers (forked by the DataLoader, spawned by DALI: fork and exec) start with both blocked: one
    sent to them stays pending instead of killing them, from their first instruction on, until
    ``ignore_stop_signals`` (run in each worker: the DataLoader's ``worker_init_fn``; DALI's, when
    it unpickles our source) takes over. On leaving, the thread's mask is restored: a signal sent to
    this thread meanwhile was held pending and reaches the trainer's handler now.

    Why not set ``SIG_IGN`` in the trainer while the workers start (``SIG_IGN`` also survives fork
    and exec)? The disposition is per process, the mask per thread: a signal sent to the process
    during that window goes to a thread that does not block it (the trainer has several: DALI's,
    the heartbeat's, torch's), and with ``SIG_IGN`` in place it would be discarded, the trainer never
    hearing of its preemption; setting ``SIG_IGN`` also discards one already pending. With the mask
    alone nothing is ever ignored in the trainer: such a signal runs the trainer's handler as at any
    other time (CPython catches it in any thread and runs the Python handler in the main thread),
    and one aimed at this thread waits (Linux queues a blocked signal). Threads started inside the
    block (DALI's, the DataLoader's pin-memory thread) keep both blocked, which only steers the
    signals to other threads.

    Workers forked by a fork server (multiprocessing's ``forkserver``: the torchvision loader's, so
    that none is a fork of the threaded trainer) inherit the server's mask, not the trainer's: the
    server is started inside the block (``data.folder.start_fork_server``; fork and exec, so it
    keeps the mask) and keeps both signals blocked for its whole life, so its workers are born with
    them blocked whenever they start (and a signal sent to the server waits, harmless: it exits when
    the trainer and its workers are gone). Not covered: a fork server that other code of the same
    process started outside the block (none in the trainer) forks workers with the signals
    unblocked; only ``ignore_stop_signals`` protects those, once it runs.

    With ``processes``, multiprocessing's resource tracker (which every such process start needs)
    is started first, under the mask, and the mask is set again after it: starting the tracker
    unblocks SIGINT and SIGTERM in the calling thread (CPython's guard for the tracker's own start),
    so the first worker, or the fork server, started after it would be born with SIGTERM unblocked.
    Born under the mask, the tracker is deaf to SIGUSR1 too (it ignores SIGTERM itself).
    """
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        if processes:
            from multiprocessing import resource_tracker

            resource_tracker.ensure_running()
            signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
