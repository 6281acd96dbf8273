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
"""

from __future__ import annotations

import signal
from types import FrameType
from typing import Iterable, Optional

import torch

from gradientflow_repro.distributed import all_reduce_scalars

EXIT_REQUEUE = 75  # sysexits' EX_TEMPFAIL: "temporary failure, try again"; the batch script requeues
REQUEUE_SIGNALS = (signal.SIGUSR1,)
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class StopRequests:
    """Records stop signals; ``agreed()`` is the collective decision (0 when nobody got one)."""

    def __init__(self, signals: Iterable[signal.Signals] = STOP_SIGNALS) -> None:
        self.received: int = 0
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
