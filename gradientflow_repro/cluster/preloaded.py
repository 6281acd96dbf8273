"""Ranks forked from the launching process, which has imported torch once, instead of started as
fresh interpreters.

A rank's first seconds go to importing torch, Hydra, DALI, wandb and this package: CPU time that
every rank pays again at every launch (ranks sharing few cores one after another) before its first
step, and a reproduction launches its ranks dozens of times. Here the launching process imports those modules
once (``preload``) and each rank is a ``fork`` of it that then becomes what ``python -m MODULE
ARGS`` would have been: a session (process group) of its own, its node's network namespace
(``setns``, as ``ip netns exec`` does), its output on the file given, exactly the environment
given, signal and exit handlers as a fresh interpreter has them, the module run as ``__main__``
(``runpy``, as ``-m`` does), that command line in ``ps`` (``setproctitle``) and the
interpreter's exit status. ``ForkedRank`` offers what
``launch.run_ranks`` and ``netemu.kill_group`` use of a ``subprocess.Popen``.

Forked only where that is safe (``fork_available``): on Linux, where no GPU device exists (a CUDA
or ROCm context does not survive a fork, and a launcher that asked torch about GPUs may hold one),
while the launcher runs no other thread than importing started (a fork copies only the caller's
thread, and with it any lock another one held), for ranks started as ``-m MODULE``; and not where ``LAUNCH_RANKS=exec``
asks for fresh interpreters. Elsewhere ``launch.run_ranks`` starts them as before. What the
launcher had already written to its own output is flushed before the fork, so it is not repeated.
"""

from __future__ import annotations

import atexit
import ctypes
import faulthandler
import gc
import importlib
import io
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import IO, Optional, Sequence

from gradientflow_repro.cluster.netemu import STOP_SIGNALS

# What a training rank, the network measurement and the cluster benchmark import (the rest they
# import is small). Importing them starts no Python thread and touches no GPU. torch._dynamo is
# there for `ddp`: DDP imports it when it wraps the model (a large import, in every rank of every
# `ddp` launch), which the launcher pays once.
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "hydra", "omegaconf", "nvidia.dali", "wandb",
           "gradientflow_repro.engine", "gradientflow_repro.checkpoint", "gradientflow_repro.distributed",
           "gradientflow_repro.comm.factory")
GPU_DEVICES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd")  # NVIDIA's and AMD's
HANDSHAKE_S = 30.0  # from fork to the rank in its session and namespace: milliseconds
CLONE_NEWNET = 0x40000000


def fork_available(module: Sequence[str]) -> bool:
    """Whether ranks of ``module`` (``("-m", NAME)`` or other interpreter arguments) may be forked
    from this process (the module's docstring says when); if so, ``PRELOAD`` is imported now."""
    if not (sys.platform == "linux" and len(module) == 2 and module[0] == "-m"
            and os.environ.get("LAUNCH_RANKS", "fork") != "exec"
            and not any(os.path.exists(device) for device in GPU_DEVICES)):
        return False
    preload()
    # one Python thread, and no native thread beyond what importing started (torch's compute
    # threads, once started by an operation here, would be copied mid-work)
    return threading.active_count() == 1 and _threads() <= _threads_after_preload


_threads_after_preload: Optional[int] = None  # set by preload()


def preload() -> None:
    """Import ``PRELOAD`` here, once; a module that cannot be imported is left to the rank."""
    global _threads_after_preload
    if _threads_after_preload is not None:
        return
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    # what the imports made lives as long as the launcher: out of the collector's sight, so the
    # collection before each fork looks only at what came after (otherwise it walks all of it again
    # for every rank, one rank after another, while the ranks started first wait for the last at the
    # rendezvous)
    gc.collect()
    gc.freeze()
    _threads_after_preload = _threads()


def _threads() -> int:
    """Threads of this process, native ones included."""
    return len(os.listdir("/proc/self/task"))


class ForkedRank:
    """A forked rank, seen as ``subprocess.Popen`` sees a child: ``pid`` (also its process group),
    ``stdout`` (a pipe's reading end, or None), ``poll()``, ``wait(timeout)`` and ``returncode``
    (negative: the signal that ended it). Safe to poll from two threads."""

    def __init__(self, pid: int, stdout: Optional[IO[str]], args: list[str]) -> None:
        self.pid, self.stdout, self.args = pid, stdout, args
        self.returncode: Optional[int] = None
        self._lock = threading.Lock()

    def poll(self) -> Optional[int]:
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # reaped by someone else: its status is lost
                    pid, status = self.pid, 255 << 8
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode


def fork_rank(module: str, args: Sequence[str], env: dict[str, str], stdout: IO[str] | int,
              cwd: Path, namespace: Optional[Path] = None) -> ForkedRank:
    """Fork a rank that runs ``python -m module *args`` with exactly ``env``, in ``cwd``, in the
    network namespace bound at ``namespace`` (``/var/run/netns/NAME``) if given, writing its output
    and errors to ``stdout`` (an open file, or ``subprocess.PIPE``: then ``ForkedRank.stdout``
    reads it). Returns once the rank runs in its own session and namespace; raises if it could not
    get there (the rank is then gone). Its ``sys.path`` is this process's, the working directory first."""
    preload()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # else the rank would write the launcher's buffered lines again
    read_end = write_end = None
    if stdout == subprocess.PIPE:
        read_end, write_end = os.pipe()
        out_fd = write_end
    else:
        out_fd = stdout.fileno()
    ready_read, ready_write = os.pipe()
    gc.collect()  # what is garbage now is the launcher's to finalize, not the rank's (it freezes the rest)
    # a stop signal (the launcher's: netemu.STOP_SIGNALS) waits until the rank is accounted for:
    # else its unwinding could lose the rank
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    pid = None
    try:
        pid = os.fork()
        if pid == 0:  # the rank: never returns
            os.close(ready_read)
            _become(module, list(args), env, out_fd, cwd, namespace, ready_write)
        os.close(ready_write)
        ready_write = None
        if write_end is not None:
            os.close(write_end)
            write_end = None
        with os.fdopen(ready_read, "rb") as ready:
            ready_read = None
            if not select.select([ready], [], [], HANDSHAKE_S)[0]:
                raise RuntimeError(f"a rank of {module} did not start within {HANDSHAKE_S:.0f} s")
            said = ready.read()  # empty: the rank closed the pipe without a word (it died)
        rank = ForkedRank(pid, None if read_end is None else os.fdopen(read_end, "r", errors="replace"),
                          [sys.executable, "-m", module, *args])
    except BaseException:
        if pid:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
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


def _become(module: str, args: list[str], env: dict[str, str], out_fd: int, cwd: Path,
            namespace: Optional[Path], ready: int) -> None:
    """In the forked child: become ``python -m module *args`` and exit with its status."""
    try:
        os.setsid()  # its own process group, so that ending it ends what it starts
        if namespace is not None:
            with open(namespace, "rb") as handle:  # as `ip netns exec` does
                if ctypes.CDLL(None, use_errno=True).setns(handle.fileno(), CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns({namespace})")
        os.chdir(cwd)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        _fresh_signals()
        os.write(ready, b"ok")
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # as subprocess's close_fds: nothing of the launcher's
    except BaseException as error:  # noqa: BLE001 - the launcher reports it
        try:
            os.write(ready, f"{type(error).__name__}: {error}".encode())
        finally:
            os._exit(127)
    code = 1
    try:
        sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True,
                                                       write_through=True)
        sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), errors="backslashreplace",
                                                       line_buffering=True, write_through=True)
        _show_command([sys.executable, "-m", module, *args])  # first: it finds its room next to the environment
        os.environ.clear()
        os.environ.update(env)
        sys.argv = [module, *args]
        sys.path[0] = str(cwd)  # as `python -m` puts the working directory first
        _fresh_interpreter_state(env)
        _forget_hydra()
        sys.modules.pop(module, None)  # run anew as __main__, as -m does
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as stop:
        code = _exit_status(stop.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT  # the interpreter ends itself by SIGINT then (below)
    except BaseException:  # noqa: BLE001 - printed as the interpreter prints an uncaught error
        traceback.print_exc()
        code = 1
    finally:
        try:
            threading._shutdown()  # as the interpreter's exit: wait for the rank's own threads
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
            if code < 0:
                signal.signal(-code, signal.SIG_DFL)
                os.kill(os.getpid(), -code)
        finally:
            os._exit(code & 0xFF)


def _fresh_signals() -> None:
    """Every signal's handler as a fresh interpreter has it: Python's own for SIGINT, SIGPIPE and
    SIGXFSZ ignored, the system's default for the rest (the launcher's unwinding handlers are not
    the rank's); no signal blocked."""
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
    interpreter's would read, instead of the launcher's; cut to the room the launcher's had."""
    try:
        from setproctitle import setproctitle
    except ImportError:  # a requirement; without it, ps shows the launcher's command line
        return
    setproctitle(" ".join(argv))


def _fresh_interpreter_state(env: dict[str, str]) -> None:
    """What the launcher's process holds that a fresh interpreter would not, undone in the rank:
    objects inherited are frozen (never collected here, so no finalizer of the launcher's closes a
    descriptor the rank reuses); its exit handlers, ``weakref.finalize`` callbacks, logging
    handlers and multiprocessing children are the launcher's, so the rank forgets them (as
    multiprocessing's own forked children do) and registers the standard ones anew; torch's thread
    count is what ``OMP_NUM_THREADS`` in ``env`` would have given at import."""
    import logging
    import weakref

    gc.freeze()
    atexit._clear()
    weakref.finalize._registry.clear()
    weakref.finalize._registered_with_atexit = False  # the rank's own register it again
    logging._handlerList[:] = []  # Hydra's logging set-up would close the launcher's files
    logging.root.handlers.clear()
    atexit.register(logging.shutdown)
    if "multiprocessing.process" in sys.modules:
        from multiprocessing import process, util

        process._children = set()
        util._finalizer_registry.clear()
        util._run_after_forkers()
        atexit.register(util._exit_function)
    if "multiprocessing.resource_tracker" in sys.modules:
        # the launcher's tracker (started by an earlier spawn there) talks through a descriptor the
        # rank has closed: the rank's first semaphore (a DALI or DataLoader worker's) would fail with
        # EBADF. Forgotten, the rank starts its own tracker when it first needs one.
        from multiprocessing import resource_tracker

        tracker = resource_tracker._resource_tracker
        tracker._fd, tracker._pid = None, None
    if "multiprocessing.forkserver" in sys.modules:
        # likewise the launcher's fork server: not the rank's child, so the rank's first worker start
        # (the torchvision loader's) would fail waiting for it (ChildProcessError). Forgotten, the
        # rank starts its own, with the stop signals blocked as its loader asks.
        from multiprocessing import forkserver

        forkserver._forkserver.__init__()
    faulthandler.disable()
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:  # forked from a thread other than the launcher's main one
        pass
    if "torch" in sys.modules and env.get("OMP_NUM_THREADS", "").isdigit():
        sys.modules["torch"].set_num_threads(max(1, int(env["OMP_NUM_THREADS"])))


def _forget_hydra() -> None:
    """A launcher that composed a config holds Hydra's global state; ``@hydra.main`` starts anew."""
    hydra_core = sys.modules.get("hydra.core.global_hydra")
    if hydra_core is not None:
        hydra_core.GlobalHydra.instance().clear()


def _exit_status(code: object) -> int:
    """What the interpreter exits with for ``sys.exit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1
