"""An emulated cluster network on one Linux machine, and launching ranks into it.

Each rank runs in its own network namespace with one interface (eth0, 10.77.0.<rank+1>) joined to
a bridge that lives in a namespace of its own, so the host's network is untouched. Each eth0's
egress is shaped by a token bucket (``tc qdisc ... tbf rate R``): a ring allreduce sends the same
volume from every rank, so shaping egress alone limits every link of the ring to R. Only rate is
emulated (kernels without netem cannot add delay). Needs root and iproute2; without them the ranks
run on loopback and ``why_unavailable()`` says why.

Set-up and tear-down are complete: namespaces carry a per-process prefix, processes started in
them are killed (as process groups) before the namespaces are deleted, and deleting a namespace
removes its veth and the bridge. Tear-down runs on normal exit, on an exception, on Ctrl-C and on
SIGTERM.
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
from typing import IO, Optional, Sequence

PREFIX = "gfr"
SUBNET = "10.77.0"
# tbf counts whole Ethernet frames (1514 bytes carry 1448 of TCP payload at MTU 1500)
FRAME_EFFICIENCY = 1448 / 1514


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
    """``with EmulatedNetwork(4, rate_mbit=400) as net: net.launch(...)``."""

    def __init__(self, ranks: int, rate_mbit: Optional[float], mtu: int = 1500) -> None:
        self.ranks, self.rate_mbit, self.mtu = ranks, rate_mbit, mtu
        self.prefix = f"{PREFIX}{os.getpid()}-"
        self.processes: list[subprocess.Popen] = []
        self._previous_sigterm = None

    def namespace(self, rank: int) -> str:
        return f"{self.prefix}n{rank}"

    def address(self, rank: int) -> str:
        return f"{SUBNET}.{rank + 1}"

    @property
    def payload_Bps(self) -> float:
        """What the shaped link carries of TCP payload, in bytes per second."""
        return float("inf") if not self.rate_mbit else self.rate_mbit * 1e6 / 8 * FRAME_EFFICIENCY

    def __enter__(self) -> "EmulatedNetwork":
        reason = why_unavailable()
        if reason:
            raise RuntimeError(f"cannot emulate a network: {reason}")
        self._previous_sigterm = signal.signal(signal.SIGTERM, _raise_exit)
        try:
            switch = f"{self.prefix}sw"
            _ip("netns", "add", switch)
            _ip("-n", switch, "link", "set", "lo", "up")
            _ip("-n", switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", switch, "link", "set", "br0", "mtu", str(self.mtu), "up")
            for rank in range(self.ranks):
                ns = self.namespace(rank)
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("link", "add", f"v{rank}", "netns", switch, "mtu", str(self.mtu), "type", "veth",
                    "peer", "name", "eth0", "netns", ns, "mtu", str(self.mtu))
                _ip("-n", switch, "link", "set", f"v{rank}", "master", "br0", "up")
                _ip("-n", ns, "addr", "add", f"{self.address(rank)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                if self.rate_mbit:
                    _ip("netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate",
                        f"{self.rate_mbit}mbit", "burst", "256kb", "latency", "50ms")
        except BaseException:
            self.close()
            raise
        return self

    def launch(self, rank: int, argv: Sequence[str], env: dict[str, str], stdout: IO | int,
               cwd: Optional[Path] = None) -> subprocess.Popen:
        """Start ``argv`` in rank ``rank``'s namespace, in a new process group (killed on close)."""
        command = ["ip", "netns", "exec", self.namespace(rank), *argv]
        process = subprocess.Popen(command, env={**env, "GLOO_SOCKET_IFNAME": "eth0"}, cwd=cwd,
                                   stdout=stdout, stderr=subprocess.STDOUT, start_new_session=True,
                                   text=True)
        self.processes.append(process)
        return process

    def close(self) -> None:
        for process in self.processes:
            kill_group(process)
        self.processes = []
        for ns in namespaces(self.prefix):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None

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


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
