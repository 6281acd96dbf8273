"""Launching a job's ranks on this machine, each in its own network namespace or all on loopback.

``run_ranks`` starts ``world`` processes with the environment torchrun would give them (rank, local
rank, world size, master address), streams rank 0's progress lines with a prefix, keeps every
rank's output in ``rank<r>.log``, and ends every rank when one fails or the deadline passes (then
it raises with the failed ranks' last lines): nothing waits forever. ``network`` is the emulated
network (``cluster.netemu``) when it can be had, else nothing (loopback); with ``ranks_per_node``
G > 1 it emulates nodes of G ranks sharing one shaped uplink, and each rank is told its place in
its node as torchrun would (LOCAL_RANK = rank % G, LOCAL_WORLD_SIZE = G). Ranks of a module are
forked from a rank server that imports torch and the rest once (``cluster.preloaded``), where that
is safe; elsewhere, and for other programs, each is a fresh interpreter. What the ranks say is
logged (``log``): rank 0's progress lines as they come, a rank that would not end.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Optional, Sequence

from gradientflow_repro import REPO
from gradientflow_repro.cluster import netemu, preloaded

TRAIN = ("-m", "gradientflow_repro.train")
# After every rank has exited, how long rank 0's last lines may take to be read and logged
RELAY_GRACE_S = 5.0
log = logging.getLogger(__name__)


def run_ranks(world: int, overrides: Sequence[str], run_dir: Path, label: str,
              net: Optional[netemu.EmulatedNetwork], timeout_s: float, show: bool = True,
              module: Sequence[str] = TRAIN) -> None:
    """Start ``world`` ranks of ``python *module *overrides`` (in the emulated network or on
    loopback), stream rank 0's output with a prefix, keep the others' in files, and fail with their
    tails if any rank fails."""
    run_dir.mkdir(parents=True, exist_ok=True)
    port = 29400 + (os.getpid() + int(time.time())) % 2000
    master = net.address(0) if net else "127.0.0.1"
    logs: list[IO[str]] = []
    processes: list[subprocess.Popen | preloaded.ForkedRank] = []
    deadline = time.monotonic() + timeout_s
    stop = threading.Event()

    def watchdog() -> None:  # a failed rank or the deadline ends every rank: nothing waits forever
        while not stop.wait(0.2):
            failed = any(p.poll() not in (None, 0) for p in processes)
            if failed or time.monotonic() > deadline:
                for process in processes:
                    try:
                        netemu.kill_group(process, grace_s=2.0)
                    except Exception as error:  # noqa: BLE001 (one that will not die must not spare the rest)
                        log.warning(f"{label:>15} | could not end pid {process.pid}: {error}")
                return

    def relay(stream: IO[str]) -> None:  # rank 0's progress, as it comes
        try:
            for line in stream:
                logs[0].write(line)
                if show and (line.startswith("[") and not line.startswith("[W") or "error" in line.lower()):
                    log.info(f"{label:>15} | {line.rstrip()}")
        except ValueError:  # its log was closed: the launch is over
            pass

    forked = preloaded.fork_available(module)  # decided once: every rank of a launch starts alike
    guard: Optional[threading.Thread] = None
    try:  # from the first rank on: whatever stops this launch ends the ranks started so far
        nodes_of_several = net is not None and net.ranks_per_node > 1
        for rank in range(world):
            # one rank per namespace (or loopback): every rank runs on this machine, its local rank is
            # its rank (with device=cuda, its GPU); emulated nodes of several ranks: its place in the node
            local_rank, local_world = (net.local_rank(rank), net.ranks_per_node) if nodes_of_several else (rank, world)
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank),
                   "LOCAL_WORLD_SIZE": str(local_world), "MASTER_ADDR": master, "MASTER_PORT": str(port),
                   "OMP_NUM_THREADS": "1", "WANDB_MODE": os.environ.get("WANDB_MODE", "offline"),
                   "PYTHONUNBUFFERED": "1"}
            rank_log = open(run_dir / f"rank{rank}.log", "w")
            logs.append(rank_log)
            processes.append(start_rank(rank, module, overrides, env, subprocess.PIPE if rank == 0 else rank_log, net,
                                        forked))
        guard = threading.Thread(target=watchdog, daemon=True)
        guard.start()
        # read in a thread of its own: a process that a rank started in a session of its own may
        # hold the pipe open after every rank is gone, and the launch ends with its ranks
        relaying = threading.Thread(target=relay, args=(processes[0].stdout,), daemon=True)
        relaying.start()
        codes = [process.wait() for process in processes]
        stop.set()
        relaying.join(timeout=RELAY_GRACE_S)  # what rank 0 wrote last is read before its log closes
        if any(code != 0 for code in codes):
            for rank_log in logs:
                rank_log.flush()
            tails = "\n".join(f"--- rank {r} (exit {c}) ---\n" + tail(run_dir / f"rank{r}.log")
                              for r, c in enumerate(codes) if c != 0)
            raise RuntimeError(f"{label}: ranks failed or timed out after {timeout_s:.0f}s "
                               f"(exit codes {codes}):\n{tails}")
    finally:
        stop.set()
        for process in processes:
            netemu.kill_group(process)
        for rank_log in logs:
            rank_log.close()
        if guard is not None:
            guard.join(timeout=60)  # every rank accounted for before the next launch


def start_rank(rank: int, module: Sequence[str], overrides: Sequence[str], env: dict[str, str],
               stdout: IO[str] | int, net: Optional[netemu.EmulatedNetwork],
               forked: bool) -> "subprocess.Popen | preloaded.ForkedRank":
    """Start one rank of ``python *module *overrides`` with ``env``, in ``rank``'s network namespace
    if ``net``, in a session of its own, output and errors to ``stdout``: ``forked`` from the rank
    server (``cluster.preloaded``), else as a fresh interpreter."""
    if forked:
        rank_env = net.rank_env(env) if net else env
        process = preloaded.fork_rank(module[1], overrides, rank_env, stdout, REPO,
                                      net.namespace_file(rank) if net else None)
        return net.adopt(process) if net else process
    argv = [sys.executable, *module, *overrides]
    if net:
        return net.launch(rank, argv, env, stdout, cwd=REPO)
    return subprocess.Popen(argv, env=env, cwd=REPO, stdout=stdout, text=True, stderr=subprocess.STDOUT,
                            start_new_session=True)


def tail(path: Path, lines: int = 15) -> str:
    """The last ``lines`` lines of a log file."""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


class network:
    """``with network(world, rate_mbit, reason) as net``: the emulated network when ``reason`` (why
    it is unavailable) is None, else None (loopback). ``ranks_per_node``: ranks sharing one node's
    namespace and shaped uplink (on loopback there are no nodes to emulate)."""

    def __init__(self, world: int, rate_mbit: Optional[float], reason: Optional[str],
                 ranks_per_node: int = 1) -> None:
        self.net = netemu.EmulatedNetwork(world, rate_mbit, ranks_per_node=ranks_per_node) if reason is None else None

    def __enter__(self) -> Optional[netemu.EmulatedNetwork]:
        return self.net.__enter__() if self.net else None

    def __exit__(self, kind: Optional[type], error: Optional[BaseException],
                 trace: Optional[TracebackType]) -> None:
        if self.net:
            self.net.close()
