"""An emulated cluster network on one Linux machine, and launching ranks into it.

A *node* is a network namespace with one interface (eth0, 10.77.0.<node+1>) joined to a bridge that
lives in a namespace of its own, so the host's network is untouched. A node holds
``ranks_per_node`` consecutive ranks (rank r in node r // ranks_per_node), as a cluster node holds
its GPUs; by default one rank per node. Each eth0's egress is shaped by a token bucket (``tc qdisc
... tbf rate R``): the node's uplink, shared by all its ranks as a node's GPUs share its NIC. A ring
allreduce sends the same volume from every node, so shaping egress alone limits every inter-node
link of the ring to R. Ranks of one node reach each other at the node's own address, which the
kernel routes over loopback: fast and unshaped, the emulated NVLink/PCIe. Only rate is emulated
(kernels without netem cannot add delay). Needs root and iproute2; without them the ranks run on
loopback and ``why_unavailable()`` says why.

Set-up and tear-down are complete: namespaces carry a per-process prefix, processes started in
them are killed (as process groups) before the namespaces are deleted, and deleting a namespace
removes its veth and the bridge; a process started into a namespace by other means (or whose start
was cut short) is killed too (``ip netns pids``). Tear-down runs on normal exit, on an exception,
on Ctrl-C, SIGTERM and SIGHUP (``unwind``; ``end_on_signals`` makes the whole process unwind so).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Callable, Optional, Sequence

if TYPE_CHECKING:
    from gradientflow_repro.cluster import preloaded

PREFIX = "gfr"
NETNS_DIR = Path("/var/run/netns")  # where `ip netns add` binds each namespace
SUBNET = "10.77.0"
# tbf counts whole Ethernet frames (1514 bytes carry 1448 of TCP payload at MTU 1500)
FRAME_EFFICIENCY = 1448 / 1514
# tbf's bucket: what a link idle long enough passes at once, before the rate holds (tc's "kb" is 1024 B)
BURST_BYTES = 256 << 10


def why_unavailable() -> Optional[str]:
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' (iproute2) is not installed"
    return None


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


def namespaces(prefix: str = PREFIX) -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith(prefix)]


class EmulatedNetwork:
    """``with EmulatedNetwork(4, rate_mbit=400) as net: net.launch(...)``; with
    ``ranks_per_node=G``, ``ranks`` / G nodes of G ranks each behind one shaped uplink."""

    def __init__(self, ranks: int, rate_mbit: Optional[float], mtu: int = 1500, ranks_per_node: int = 1) -> None:
        if ranks_per_node < 1 or ranks % ranks_per_node:
            raise ValueError(f"ranks_per_node = {ranks_per_node} must divide the {ranks} ranks")
        self.ranks, self.rate_mbit, self.mtu, self.ranks_per_node = ranks, rate_mbit, mtu, ranks_per_node
        self.nodes = ranks // ranks_per_node
        self.prefix = f"{PREFIX}{os.getpid()}-"
        self.processes: list[subprocess.Popen] = []
        self._previous_handlers: dict[int, object] = {}

    def node(self, rank: int) -> int:
        """The node holding ``rank`` (ranks are numbered node by node, as torchrun and Slurm do)."""
        return rank // self.ranks_per_node

    def local_rank(self, rank: int) -> int:
        return rank % self.ranks_per_node

    def node_namespace(self, node: int) -> str:
        return f"{self.prefix}n{node}"

    def namespace(self, rank: int) -> str:
        """The namespace of ``rank``'s node."""
        return self.node_namespace(self.node(rank))

    def address(self, rank: int) -> str:
        """The address of ``rank``'s node (its eth0): every rank of a node binds to it."""
        return f"{SUBNET}.{self.node(rank) + 1}"

    @property
    def payload_Bps(self) -> float:
        """What the shaped link carries of TCP payload, in bytes per second."""
        return float("inf") if not self.rate_mbit else self.rate_mbit * 1e6 / 8 * FRAME_EFFICIENCY

    @property
    def burst_payload_bytes(self) -> float:
        """Payload a shaped link lets through at once after it has been idle (``perfmodel.Network
        .burst_bytes``): tbf's bucket, in whole frames; 0 when unshaped."""
        return BURST_BYTES * FRAME_EFFICIENCY if self.rate_mbit else 0.0

    def __enter__(self) -> "EmulatedNetwork":
        reason = why_unavailable()
        if reason:
            raise RuntimeError(f"cannot emulate a network: {reason}")
        # a SIGTERM or SIGHUP unwinds through close(): no namespace is left behind
        self._previous_handlers = {signum: signal.signal(signum, unwind) for signum in UNWIND_SIGNALS}
        try:
            switch = f"{self.prefix}sw"
            _ip("netns", "add", switch)
            _ip("-n", switch, "link", "set", "lo", "up")
            _ip("-n", switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", switch, "link", "set", "br0", "mtu", str(self.mtu), "up")
            for node in range(self.nodes):
                ns = self.node_namespace(node)
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")  # the node's ranks talk over it (own address)
                _ip("link", "add", f"v{node}", "netns", switch, "mtu", str(self.mtu), "type", "veth",
                    "peer", "name", "eth0", "netns", ns, "mtu", str(self.mtu))
                _ip("-n", switch, "link", "set", f"v{node}", "master", "br0", "up")
                _ip("-n", ns, "addr", "add", f"{SUBNET}.{node + 1}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                if self.rate_mbit:
                    _ip("netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate",
                        f"{self.rate_mbit}mbit", "burst", f"{BURST_BYTES >> 10}kb", "latency", "50ms")
        except BaseException:
            self.close()
            raise
        return self

    def launch(self, rank: int, argv: Sequence[str], env: dict[str, str], stdout: IO | int,
               cwd: Optional[Path] = None) -> subprocess.Popen:
        """Start ``argv`` in the namespace of ``rank``'s node, in a new process group (killed on
        close), with ``rank_env(env)``."""
        command = ["ip", "netns", "exec", self.namespace(rank), *argv]
        process = subprocess.Popen(command, env=self.rank_env(env), cwd=cwd, stdout=stdout,
                                   stderr=subprocess.STDOUT, start_new_session=True, text=True)
        return self.adopt(process)

    @staticmethod
    def rank_env(env: dict[str, str]) -> dict[str, str]:
        """``env`` for a rank in a node: GLOO_SOCKET_IFNAME=eth0 makes gloo bind to the node's
        address, which the node's other ranks reach over loopback and other nodes through the
        shaped uplink."""
        return {**env, "GLOO_SOCKET_IFNAME": "eth0"}

    def namespace_file(self, rank: int) -> Path:
        """Where ``ip netns`` keeps the namespace of ``rank``'s node (what ``setns`` enters)."""
        return NETNS_DIR / self.namespace(rank)

    def adopt(self, process: "subprocess.Popen | preloaded.ForkedRank") -> "subprocess.Popen | preloaded.ForkedRank":
        """Count ``process``, started into one of the namespaces, among those killed on close."""
        self.processes.append(process)
        return process

    def close(self) -> None:
        for process in self.processes:
            kill_group(process)
        self.processes = []
        for ns in namespaces(self.prefix):
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30).stdout
            for pid in pids.split():  # what is still in it: a rank whose start was cut short
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        if not _unwinding:  # while unwinding, further signals stay ignored to the end
            for signum, handler in self._previous_handlers.items():
                signal.signal(signum, handler)
        self._previous_handlers = {}

    def __exit__(self, kind: Optional[type], error: Optional[BaseException],
                 trace: Optional[TracebackType]) -> None:
        self.close()


def kill_group(process: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM the process group, then SIGKILL whatever is left after ``grace_s``."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
    except ProcessLookupError:
        pass


UNWIND_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # kill, timeout, a scheduler; a closed terminal
STOP_SIGNALS = (*UNWIND_SIGNALS, signal.SIGINT)  # and Ctrl-C
_unwinding = False  # a stop signal arrived: this process is cleaning up on its way out


def unwind(signum: int, frame: object) -> None:
    """A signal handler that unwinds this process as Ctrl-C does (``KeyboardInterrupt`` for SIGINT,
    else ``SystemExit``), so ``finally`` blocks end ranks and remove namespaces. Every stop signal
    is ignored from then on: a second one must not cut that clean-up short."""
    global _unwinding
    _unwinding = True
    for other in STOP_SIGNALS:
        signal.signal(other, signal.SIG_IGN)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


def run_script(main: Callable[[], None]) -> None:
    """Run a long script's ``main`` under ``end_on_signals``. By the time a Ctrl-C has unwound it,
    its ranks are ended, its network removed and what finished is kept and said
    (``progress.Progress``), so it exits with 130 (128 + SIGINT, as a shell reports it) and no
    traceback; other signals exit with 128 + their number (``unwind``)."""
    end_on_signals()
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(128 + signal.SIGINT)


def end_on_signals() -> None:
    """Make every stop signal (SIGTERM: ``kill``, ``timeout``, a scheduler; SIGHUP: a closed
    terminal; SIGINT) unwind this process (``unwind``), so ``launch.run_ranks`` ends the job's
    ranks (they run in sessions of their own, which a signal to this process does not reach) and
    the emulated network is removed, instead of leaving both; a second signal does not cut that short."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, unwind)
