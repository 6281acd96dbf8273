"""Ranks forked from a rank server that imported torch once (``cluster.preloaded``) are what ``python
-m MODULE ARGS`` would have been: exit status, output, environment, session, signal handlers, working
directory, the module as ``__main__``; a rank that cannot start is named. The same ranks in the
emulated network are ``test_netemu``'s probe, forked."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gradientflow_repro.cluster import netemu, preloaded

# A module that reports what a fresh interpreter would show, then exits as its argument says.
PROBE = """
import json, os, signal, sys, time
report = {"name": __name__, "argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd(),
          "own_session": os.getsid(0) == os.getpid() == os.getpgrp(),
          "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
          "sigint_python": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
          "sigusr1_default": signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL,
          "open_fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
          "cmdline": open("/proc/self/cmdline").read().replace("\\0", " ")}
print("REPORT " + json.dumps(report))
print("to stderr", file=sys.stderr)
how = sys.argv[1]
if how == "raise":
    raise ValueError("raised in the rank")
if how == "wait":
    time.sleep(60)
if how == "interrupt":
    raise KeyboardInterrupt
sys.exit(int(how))
"""


@pytest.fixture
def probe_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "forked_probe.py").write_text(PROBE)
    monkeypatch.setattr(sys, "path", [*sys.path, str(tmp_path)])  # the rank's sys.path is ours
    return "forked_probe"


def _report(output: str) -> dict:
    return json.loads(next(line for line in output.splitlines() if line.startswith("REPORT "))[7:])


def test_a_forked_rank_is_what_python_m_would_be(probe_module: str, tmp_path: Path, capfd) -> None:
    print("launcher's unfinished line", end="")  # buffered here: the rank must not write it again
    env = {"RANK": "1", "ONLY_THIS": "yes", "PATH": os.environ["PATH"]}
    rank = preloaded.fork_rank(probe_module, ["3", "a=b"], env, subprocess.PIPE, tmp_path)
    output = rank.stdout.read()
    assert rank.wait(timeout=30) == 3 and rank.returncode == 3
    report = _report(output)
    assert report["name"] == "__main__" and report["argv"] == ["3", "a=b"]
    assert report["env"] == env  # exactly what was given: nothing of the launcher's
    assert report["cwd"] == str(tmp_path)
    assert report["own_session"] and report["sigterm_default"] and report["sigint_python"]
    assert report["sigusr1_default"]
    assert report["open_fds"][:3] == [0, 1, 2] and len(report["open_fds"]) <= 4  # 3: listdir's own
    assert f"-m {probe_module} 3 a=b" in report["cmdline"]  # what ps shows: the rank, not the launcher
    assert "to stderr" in output
    assert "launcher's unfinished line" not in output
    assert "launcher's unfinished line" in capfd.readouterr().out


def test_a_forked_rank_starts_its_own_multiprocessing_resource_tracker(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A launcher that has spawned before runs a resource tracker, reached through a descriptor the
    rank closes; the rank's first semaphore (a DALI or DataLoader worker's lock) must still work."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()  # as an earlier spawn in the launcher leaves it
    assert resource_tracker._resource_tracker._fd is not None
    (tmp_path / "lock_probe.py").write_text(
        "import multiprocessing\nmultiprocessing.get_context('spawn').Lock()\nprint('LOCKED')\n")
    monkeypatch.setattr(sys, "path", [*sys.path, str(tmp_path)])
    rank = preloaded.fork_rank("lock_probe", [], {"PATH": os.environ["PATH"]}, subprocess.PIPE, tmp_path)
    output = rank.stdout.read()
    assert rank.wait(timeout=60) == 0 and "LOCKED" in output, output


def test_a_forked_rank_starts_its_own_fork_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A launcher that has used the fork server (``cluster.world.spawn`` does) runs one, which is
    not the rank's child; the rank's first worker from a fork server (the torchvision loader's)
    must still start."""
    from multiprocessing import forkserver

    forkserver.ensure_running()  # as an earlier spawn in the launcher leaves it
    assert forkserver._forkserver._forkserver_pid is not None
    (tmp_path / "server_probe.py").write_text(
        "import multiprocessing\n"
        "if __name__ == '__main__':\n"
        "    worker = multiprocessing.get_context('forkserver').Process(target=print, args=('WORKER',))\n"
        "    worker.start()\n    worker.join(60)\n    print('EXIT', worker.exitcode)\n")
    monkeypatch.setattr(sys, "path", [*sys.path, str(tmp_path)])
    rank = preloaded.fork_rank("server_probe", [], {"PATH": os.environ["PATH"]}, subprocess.PIPE, tmp_path)
    output = rank.stdout.read()
    assert rank.wait(timeout=60) == 0 and "EXIT 0" in output, output


def test_errors_and_signals_end_a_forked_rank_as_they_end_an_interpreter(probe_module: str, tmp_path: Path) -> None:
    log = tmp_path / "rank.log"
    with open(log, "w") as out:
        failed = preloaded.fork_rank(probe_module, ["raise"], {}, out, tmp_path)
        assert failed.wait(timeout=30) == 1 and failed.stdout is None
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "ValueError: raised in the rank" in text
    interrupted = preloaded.fork_rank(probe_module, ["interrupt"], {}, subprocess.PIPE, tmp_path)
    assert interrupted.wait(timeout=30) == -signal.SIGINT  # as CPython ends on an uncaught Ctrl-C
    assert "KeyboardInterrupt" in interrupted.stdout.read()
    interrupted.stdout.close()
    # the launcher's multiprocessing children are its own: a rank's exit leaves them be
    import multiprocessing
    helper = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,), daemon=True)
    helper.start()
    try:
        with open(tmp_path / "quick.log", "w") as out:
            assert preloaded.fork_rank(probe_module, ["0"], {}, out, tmp_path).wait(timeout=30) == 0
        assert helper.is_alive()
    finally:
        helper.kill()
        helper.join()
    waiting = preloaded.fork_rank(probe_module, ["wait"], {}, subprocess.PIPE, tmp_path)
    assert waiting.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        waiting.wait(timeout=0.2)
    started = time.monotonic()
    netemu.kill_group(waiting)  # SIGTERM to its process group: the default handler ends it
    assert waiting.returncode == -signal.SIGTERM and time.monotonic() - started < 5
    waiting.stdout.close()


def test_a_rank_that_cannot_enter_its_namespace_is_named_and_gone(probe_module: str, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-namespace"
    before = _children()
    with pytest.raises(RuntimeError, match="could not start.*no-such-namespace"):
        preloaded.fork_rank(probe_module, ["0"], {}, subprocess.PIPE, tmp_path, namespace=missing)
    assert _children() == before  # reaped: nothing left behind


def _children() -> set[str]:
    """This process's children and the rank server's (whose children the ranks are)."""
    found = set()
    for pid in (os.getpid(), preloaded.server().process.pid):
        found |= set(Path(f"/proc/{pid}/task/{pid}/children").read_text().split())
    return found


def test_forking_only_where_it_is_safe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preloaded, "GPU_DEVICES", ())
    assert preloaded.fork_available(("-m", "gradientflow_repro.train")) is (sys.platform == "linux")
    assert not preloaded.fork_available(("-c", "print(1)"))  # a program, not a module: an interpreter
    monkeypatch.setenv("LAUNCH_RANKS", "exec")
    assert not preloaded.fork_available(("-m", "gradientflow_repro.train"))
    monkeypatch.delenv("LAUNCH_RANKS")
    monkeypatch.setattr(preloaded, "GPU_DEVICES", (str(Path(__file__)),))  # "a GPU device exists"
    assert not preloaded.fork_available(("-m", "gradientflow_repro.train"))
    monkeypatch.setattr(preloaded, "GPU_DEVICES", ())
    # a server whose imports leave a thread running: a fork would copy that thread's locks, not the thread
    (tmp_path / "thread_probe.py").write_text(
        "import threading\nthreading.Thread(target=threading.Event().wait, daemon=True).start()\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the server's own sys.path
    monkeypatch.setattr(preloaded, "PRELOAD", ("thread_probe",))
    monkeypatch.setattr(preloaded, "_server", None)
    try:
        assert not preloaded.fork_available(("-m", "gradientflow_repro.train"))
        with pytest.raises(RuntimeError, match="runs threads"):
            preloaded.fork_rank("thread_probe", [], {}, subprocess.PIPE, tmp_path)
    finally:
        preloaded.server().close()
