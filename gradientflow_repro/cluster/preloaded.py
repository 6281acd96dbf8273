"""Ranks forked from a rank server, a fresh interpreter that has imported torch once, instead of
started as fresh interpreters.

A rank's first seconds go to importing torch, Hydra, DALI, wandb, timm and this package: CPU time
that every rank pays again at every launch (ranks sharing few cores one after another) before its
first step, and a reproduction launches its ranks dozens of times. Here one process per launcher,
the rank server (``python -m gradientflow_repro.cluster.preloaded``, started on first use), imports
those modules once (``PRELOAD``) and forks each rank, which then becomes what ``python -m MODULE
ARGS`` would have been: a session (process group) of its own, its node's network namespace
(``setns``, as ``ip netns exec`` does), its output on the file given, exactly the environment and
``sys.path`` given, signal handlers as a fresh interpreter has them, the module run as ``__main__``
(``runpy``, as ``-m`` does), that command line in ``ps`` (``setproctitle``). It ends as an
interpreter ends, because it is one: an exception or ``sys.exit`` leaves the server's loop and the
interpreter exits with it (exit handlers, threads joined, an uncaught Ctrl-C ending it by SIGINT).

Why a server of its own rather than multiprocessing's: the server is a fresh interpreter that has
done nothing but import, so a rank inherits no state of a launcher (exit handlers, logging
handlers, multiprocessing's children, resource tracker or fork server) and nothing needs undoing; it
runs one thread, so forking it is safe (a fork copies only the caller's thread, and with it any
lock another one held: a launcher's watchdog threads make forking the launcher unsafe). A
multiprocessing child, by contrast, ends through ``os._exit`` without exit handlers and shares its
parent's resource tracker through inherited descriptors. The ranks are the server's children: it
reports each one's exit status to the launcher (``ForkedRank``, which offers what
``launch.run_ranks`` and ``netemu.kill_group`` use of a ``subprocess.Popen``).

Forked only where that is safe (``fork_available``): on Linux, where no GPU device exists (a CUDA or
ROCm context does not survive a fork), while the server runs no other Python thread than its own
after importing, for ranks started as ``-m MODULE``; and not where ``LAUNCH_RANKS=exec`` asks for
fresh interpreters. Elsewhere ``launch.run_ranks`` starts them as before. The server's environment
is the launcher's when it started (what the imports read then); each rank's is the one given.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import json
import os
import runpy
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Optional, Sequence

from gradientflow_repro.cluster.netemu import STOP_SIGNALS

# What a training rank, the network measurement and the cluster benchmark import (the rest they
# import is small). Importing them starts no Python thread and touches no GPU. torch._dynamo is
# there for `ddp` and the optimizers: DDP imports it when it wraps the model, and torch's optimizers
# on their first use of methods marked not to be compiled; timm.optim for the Lars optimizer.
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "hydra", "omegaconf", "nvidia.dali", "wandb",
           "timm.optim", "gradientflow_repro.engine", "gradientflow_repro.checkpoint",
           "gradientflow_repro.distributed", "gradientflow_repro.comm.factory")
GPU_DEVICES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd")  # NVIDIA's and AMD's
HANDSHAKE_S = 30.0  # from the request to the rank in its session and namespace: milliseconds
SERVER_START_S = 300.0  # the server's imports: seconds, more on a loaded machine
CLONE_NEWNET = 0x40000000
MESSAGE_BYTES = 1 << 20  # a request: the environment and sys.path, a few KB


def fork_available(module: Sequence[str]) -> bool:
    """Whether ranks of ``module`` (``("-m", NAME)`` or other interpreter arguments) may be forked
    from the rank server (the module's docstring says when); if so, the server is started now."""
    if not (sys.platform == "linux" and len(module) == 2 and module[0] == "-m"
            and os.environ.get("LAUNCH_RANKS", "fork") != "exec"
            and not any(os.path.exists(device) for device in GPU_DEVICES)):
        return False
    return server().safe


class RankServer:
    """The launcher's side of the rank server: requests go out on one socket (SOCK_SEQPACKET: one
    message each, descriptors attached), and a reader thread takes the answers: the pid of each
    rank started, and the exit status of each rank that ended."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self.process = subprocess.Popen(
                [sys.executable, "-m", __name__, str(theirs.fileno()), json.dumps(PRELOAD)],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, start_new_session=True)
        self.socket = ours
        self.safe = False
        self.codes: dict[int, int] = {}  # pid -> exit status (negative: the signal that ended it)
        self.ended = threading.Condition()
        self._started: list[dict] = []
        self._request = threading.Lock()  # one request at a time: its answer is the next "started"
        ready = self._receive(SERVER_START_S)
        if ready is None:
            self.close()
            raise RuntimeError(f"the rank server did not start within {SERVER_START_S:.0f} s")
        self.safe = bool(ready.get("safe"))
        threading.Thread(target=self._read, name="gradientflow-rank-server", daemon=True).start()

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def _receive(self, timeout_s: Optional[float]) -> Optional[dict]:
        """The server's next message; None after ``timeout_s`` or once the server is gone."""
        try:
            if not select.select([self.socket], [], [], timeout_s)[0]:
                return None
            message = self.socket.recv(MESSAGE_BYTES)
        except OSError:  # closed
            return None
        return json.loads(message) if message else None

    def _read(self) -> None:
        while (message := self._receive(None)) is not None:
            with self.ended:
                if "exited" in message:
                    self.codes[message["exited"]] = message["code"]
                else:
                    self._started.append(message)
                self.ended.notify_all()
        with self.ended:  # the server is gone: nothing more will come
            self._started.append({"error": "the rank server ended"})
            self.ended.notify_all()

    def start(self, request: dict, fds: list[int]) -> int:
        """Send ``request`` with ``fds`` (the rank's output, the handshake's writing end); the pid."""
        with self._request:
            socket.send_fds(self.socket, [json.dumps(request).encode()], fds)
            with self.ended:
                if not self.ended.wait_for(lambda: self._started, HANDSHAKE_S):
                    raise RuntimeError(f"the rank server did not start a rank within {HANDSHAKE_S:.0f} s")
                answer = self._started.pop(0)
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return answer["pid"]

    def code(self, pid: int) -> Optional[int]:
        """The rank's exit status, None while it runs. Once the server is gone, a rank still
        running is not reported: one that no longer exists counts as failed (255)."""
        with self.ended:
            if pid in self.codes:
                return self.codes[pid]
        if not self.alive:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return self.codes.setdefault(pid, 255)
        return None

    def close(self) -> None:
        """End the server (its ranks, in sessions of their own, are the launcher's to end)."""
        try:
            self.socket.shutdown(socket.SHUT_RDWR)  # the server ends when its socket does
        except OSError:  # it has ended already
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


_server: Optional[RankServer] = None
_server_lock = threading.Lock()


def server() -> RankServer:
    """This launcher's rank server, started on first use (and again if it has ended)."""
    global _server
    with _server_lock:
        if _server is None or not _server.alive:
            _server = RankServer()
        return _server


class ForkedRank:
    """A forked rank, seen as ``subprocess.Popen`` sees a child: ``pid`` (also its process group),
    ``stdout`` (a pipe's reading end, or None), ``poll()``, ``wait(timeout)`` and ``returncode``
    (negative: the signal that ended it). Safe to poll from two threads."""

    def __init__(self, pid: int, stdout: Optional[IO[str]], args: list[str], via: RankServer) -> None:
        self.pid, self.stdout, self.args, self._server = pid, stdout, args, via
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.returncode = self._server.code(self.pid)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            with self._server.ended:
                self._server.ended.wait(0.1)
        return self.returncode


def fork_rank(module: str, args: Sequence[str], env: dict[str, str], stdout: IO[str] | int,
              cwd: Path, namespace: Optional[Path] = None) -> ForkedRank:
    """Fork a rank that runs ``python -m module *args`` with exactly ``env``, in ``cwd``, in the
    network namespace bound at ``namespace`` (``/var/run/netns/NAME``) if given, writing its output
    and errors to ``stdout`` (an open file, or ``subprocess.PIPE``: then ``ForkedRank.stdout``
    reads it). Returns once the rank runs in its own session and namespace; raises if it could not
    get there (the rank is then gone). Its ``sys.path`` is this process's, the working directory first."""
    via = server()
    read_end = write_end = None
    if stdout == subprocess.PIPE:
        read_end, write_end = os.pipe()
        out_fd = write_end
    else:
        out_fd = stdout.fileno()
    ready_read, ready_write = os.pipe()
    request = {"module": module, "args": list(args), "env": env, "cwd": str(cwd), "sys_path": sys.path,
               "namespace": None if namespace is None else str(namespace)}
    # a stop signal (the launcher's: netemu.STOP_SIGNALS) waits until the rank is accounted for:
    # else its unwinding could lose the rank
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    pid = None
    try:
        pid = via.start(request, [out_fd, ready_write])
        for fd in (ready_write, write_end):  # the rank has its own copies
            if fd is not None:
                os.close(fd)
        ready_write = write_end = None
        with os.fdopen(ready_read, "rb") as ready:
            ready_read = None
            if not select.select([ready], [], [], HANDSHAKE_S)[0]:
                raise RuntimeError(f"a rank of {module} did not start within {HANDSHAKE_S:.0f} s")
            said = ready.read()  # empty: the rank closed the pipe without a word (it died)
        rank = ForkedRank(pid, None if read_end is None else os.fdopen(read_end, "r", errors="replace"),
                          [sys.executable, "-m", module, *args], via)
    except BaseException:
        if pid:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            ForkedRank(pid, None, [], via).wait(timeout=10)
        for fd in (ready_read, ready_write, read_end, write_end):
            if fd is not None:
                os.close(fd)
        raise
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    if said != b"ok":
        rank.wait(timeout=10)
        if rank.stdout:
            rank.stdout.close()
        raise RuntimeError(f"a rank of {module} could not start: "
                           f"{said.decode(errors='replace') or f'exit {rank.returncode}'}")
    return rank


# ------------------------------------------------------------------ the server (its own process)

def serve(channel: socket.socket, preload: Sequence[str]) -> None:
    """The rank server: import ``preload``, say whether forking is safe, then fork a rank for each
    request until the launcher's socket closes, and report every rank's exit. Returns in the server
    when the launcher is gone; in a rank it never returns (the rank's own exit unwinds from here)."""
    for name in preload:
        try:
            importlib.import_module(name)
        except ImportError:  # left to the rank, which reports it as it would anyway
            pass
    # what the imports made lives as long as the server: out of the collector's sight, in the
    # server and in every rank, so that no rank's collection walks it (nor copies its pages)
    gc.collect()
    gc.freeze()
    safe = threading.active_count() == 1
    channel.send(json.dumps({"safe": safe}).encode())
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)  # a rank that ends wakes the loop below
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(channel, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            if key.fileobj is wake_read:
                os.read(wake_read, 4096)
                _report_exits(channel)
                continue
            message, fds, _, _ = socket.recv_fds(channel, MESSAGE_BYTES, 2)
            if not message:
                return  # the launcher is gone
            request = json.loads(message)
            if not safe:
                _close(fds)
                channel.send(json.dumps({"error": "the rank server runs threads: forking it is unsafe"}).encode())
                continue
            pid = os.fork()
            if pid == 0:  # the rank: runs the module, and its exit unwinds through here
                selector.close()
                channel.close()
                for fd in (wake_read, wake_write):
                    os.close(fd)
                _become(request, *fds)
                return
            _close(fds)
            channel.send(json.dumps({"pid": pid}).encode())
        _report_exits(channel)  # a rank that ended while the loop was busy


def _report_exits(channel: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if not pid:
            return
        channel.send(json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


def _close(fds: Sequence[int]) -> None:
    for fd in fds:
        os.close(fd)


def _become(request: dict, out_fd: int, ready: int) -> None:
    """In the forked rank: become ``python -m MODULE ARGS`` as ``request`` says and run it; its
    exception or ``SystemExit`` propagates, ending this interpreter as it would end that one."""
    module, args = request["module"], request["args"]
    try:
        os.setsid()  # its own process group, so that ending it ends what it starts
        if request["namespace"] is not None:
            with open(request["namespace"], "rb") as handle:  # as `ip netns exec` does
                if ctypes.CDLL(None, use_errno=True).setns(handle.fileno(), CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns({request['namespace']})")
        os.chdir(request["cwd"])
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        _fresh_signals()
        os.write(ready, b"ok")
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # as subprocess's close_fds: nothing of the server's
    except BaseException as error:  # noqa: BLE001 - the launcher reports it
        try:
            os.write(ready, f"{type(error).__name__}: {error}".encode())
        finally:
            os._exit(127)
    sys.stdout = sys.__stdout__ = open(1, "w", buffering=1, closefd=False)
    sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")
    _show_command([sys.executable, "-m", module, *args])  # first: it finds its room next to the environment
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [module, *args]
    sys.path[:] = [request["cwd"], *request["sys_path"][1:]]  # as `python -m` puts the working directory first
    torch = sys.modules.get("torch")
    if torch is not None and request["env"].get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(max(1, int(request["env"]["OMP_NUM_THREADS"])))  # what torch's import would read
    sys.modules.pop(module, None)  # run anew as __main__, as -m does
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def _fresh_signals() -> None:
    """Every signal's handler as a fresh interpreter has it: Python's own for SIGINT, SIGPIPE and
    SIGXFSZ ignored, the system's default for the rest; no signal blocked, no wake-up descriptor."""
    signal.set_wakeup_fd(-1)
    for signum in signal.valid_signals():
        if signum in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            signal.signal(signum, signal.SIG_DFL)
        except (OSError, ValueError, RuntimeError):
            pass
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def _show_command(argv: list[str]) -> None:
    """Show ``argv`` as this process's command line (``ps``, ``/proc/PID/cmdline``), as a fresh
    interpreter's would read, instead of the server's; cut to the room the server's had."""
    try:
        from setproctitle import setproctitle
    except ImportError:  # a requirement; without it, ps shows the server's command line
        return
    setproctitle(" ".join(argv))


if __name__ == "__main__":
    with socket.socket(fileno=int(sys.argv[1])) as launcher:
        serve(launcher, json.loads(sys.argv[2]))
