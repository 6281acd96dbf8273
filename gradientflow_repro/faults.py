"""Fault injection for the reliability tests: make one rank fail at a chosen point.

Set ``GFR_INJECT_FAULT`` to ``WHAT@WHERE:rank=R:step=S`` (several separated by ``,``):

- WHAT: ``kill`` (SIGKILL to this process), ``freeze`` (SIGSTOP: the process stays, its connections
  stay open, it answers nothing: how a peer that is gone looks to NCCL, which hangs rather than
  fails), ``vanish`` (SIGKILL, while a child process keeps this one's connections open for
  ``VANISH_HOLD_S``: a node lost without closing its connections, or a dead peer under NCCL over
  InfiniBand, where the others see no error but a hang), ``nan`` (this rank's loss becomes NaN),
  ``perturb`` (this rank's first parameter is nudged: ranks silently disagree), ``delay`` (this
  rank sleeps ``DELAY_S``: a straggler, which the others wait for), ``usr1`` (SIGUSR1 to this
  process: the scheduler's preemption warning, at a chosen point), ``full`` (an ``OSError``
  ENOSPC raised here: a full disk or quota while this rank writes its checkpoint), ``hang`` (this
  rank's main thread sleeps ``HANG_S`` while its heartbeat goes on: a rank alive but stuck outside
  any collective, as in a data loader that never returns);
- WHERE: ``forward`` (start of a step), ``comm`` (entering ``synchronize``, while the other ranks
  already wait in the step's collectives), ``checkpoint`` (after this rank's file is half written,
  before the checkpoint is renamed into place), ``loss``, ``params`` (after the optimizer step).

``GFR_FAULT_LOG`` names a file where each fired fault appends its wall-clock time. Without the
variable every call is a dictionary lookup that finds nothing. Nothing in a normal run
sets it; it exists so that tests can reach the failure paths of real multi-process runs.

Faults fire only where ``GFR_ALLOW_FAULTS=1`` is set too (the test suite and the fault report set
both): a ``GFR_INJECT_FAULT`` left in a user's environment must not sabotage a real run. Then it
is ignored, and the trainer says so on its first lines (``ignored_warning``).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch

ENV = "GFR_INJECT_FAULT"
ALLOW = "GFR_ALLOW_FAULTS"
DELAY_S = 0.5
VANISH_HOLD_S = 180.0
HANG_S = 600.0


@dataclass(frozen=True)
class Fault:
    what: str
    where: str
    rank: int
    step: int


def planned() -> tuple[Fault, ...]:
    """The faults ``GFR_INJECT_FAULT`` plans now (read each call: a rank forked from a launcher that
    had read it before has its own environment); none unless ``GFR_ALLOW_FAULTS=1``."""
    if os.environ.get(ALLOW) != "1":
        return ()
    return _parse(os.environ.get(ENV, ""))


def ignored_warning() -> Optional[str]:
    """The warning for faults planned without ``GFR_ALLOW_FAULTS=1`` (None where there are none), for
    ``log.warning`` (whose formatter says "warning: ")."""
    if os.environ.get(ENV) and os.environ.get(ALLOW) != "1":
        return (f"{ENV}={os.environ[ENV]!r} is set but ignored: faults are injected only in "
                f"tests, which also set {ALLOW}=1")
    return None


@lru_cache(maxsize=4)
def _parse(specs: str) -> tuple[Fault, ...]:
    faults = []
    for spec in filter(None, specs.split(",")):
        head, *fields = spec.split(":")
        what, where = head.split("@")
        values = dict(field.split("=") for field in fields)
        faults.append(Fault(what, where, int(values.get("rank", 0)), int(values.get("step", 0))))
    return tuple(faults)


def _this_rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))


def due(where: str, step: int) -> Optional[Fault]:
    for fault in planned():
        if fault.where == where and fault.step == step and fault.rank == _this_rank():
            return fault
    return None


def _hold_sockets() -> int:
    """Fork a child that holds this process's open connections for ``VANISH_HOLD_S`` and does
    nothing else (its output goes nowhere: a launcher reading the rank's output must not wait for
    it). Returns its process id (for the test to end it)."""
    pid = os.fork()
    if pid == 0:
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        time.sleep(VANISH_HOLD_S)
        os._exit(0)
    return pid


def inject(where: str, step: int, tensor: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """Apply the fault planned here, if any. Returns ``tensor`` (changed for nan/perturb)."""
    fault = due(where, step) if planned() else None
    if fault is None:
        return tensor
    holder = _hold_sockets() if fault.what == "vanish" else None
    if os.environ.get("GFR_FAULT_LOG"):  # when it fired, for measuring time to detection
        with open(os.environ["GFR_FAULT_LOG"], "a") as log:
            log.write(json.dumps({**fault.__dict__, "time": time.time(), "holder": holder}) + "\n")
    if fault.what in ("kill", "vanish"):
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.what == "freeze":
        os.kill(os.getpid(), signal.SIGSTOP)
    if fault.what == "usr1":
        os.kill(os.getpid(), signal.SIGUSR1)
    if fault.what == "hang":
        time.sleep(HANG_S)
    if fault.what == "full":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if fault.what == "nan" and tensor is not None:
        return tensor * float("nan")
    if fault.what == "delay":
        time.sleep(DELAY_S)
    if fault.what == "perturb" and tensor is not None:
        with torch.no_grad():
            tensor.add_(1e-3)
    return tensor
