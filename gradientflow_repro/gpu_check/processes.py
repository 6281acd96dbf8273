"""Where an item runs: in this process, or in a fresh Python process with its own time limit.

Why child processes: a CUDA context, an NCCL communicator or a hang in one item must not touch the
next. The environment item runs in the check's own process; every other item runs in a child that
imports the item's function by module and name (``child_main``), so any importable function can
be an item (the tests run functions of their own this way). The child prints each result line as
soon as it is made, marked, and the parent turns the marked lines back into results:

1. ``run_in_child`` starts the child in a session (process group) of its own and reads its lines;
2. a child still running at its limit is killed with its whole process group (what it started
   too) and the item gets a FAIL "hung > N s" after the last line it reported;
3. a child that exits non-zero without a FAIL line, or reports nothing, is a FAIL naming its last
   line of output.

Inside a child, ``time_left`` says how long the item has before its parent kills it, and
``run_command`` and ``spawn_ranks`` run its own processes (a torchrun job, two ranks) so that
they end with it.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Optional

from gradientflow_repro import REPO, logs
from gradientflow_repro.cluster.world import free_port
from gradientflow_repro.gpu_check.results import Item, Reporter, Result, describe

MARK = "@@gpu_check "  # prefix of a result line on a child process's output
REPORTED_EXIT = 3  # a spawned rank that reported its own failure exits with this


def run_here(item: Item, emit: Callable[[Result], None] = lambda result: None) -> list[Result]:
    """Run an item in this process: its lines, with any exception turned into a FAIL line."""
    report = Reporter(item.name, emit)
    with report.part():
        item.check(report)
    if not report.results:
        report.add("FAIL", "the check reported nothing")
    return report.results


def stop_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM to the process group of ``proc`` (started with a session of its own), then SIGKILL."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)


def child_env(extra_paths: list[str]) -> dict[str, str]:
    """This process's environment for a child: ``extra_paths`` first on its PYTHONPATH, unbuffered
    output (its lines must arrive as they are made, not when it exits)."""
    paths = [*extra_paths, os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "PYTHONUNBUFFERED": "1"}


def import_root(module_file: str, name: str) -> Path:
    """The folder from which ``module_file`` imports as ``name``: one level up per dot in the name,
    one more for a package's ``__init__.py`` (``a.b`` is ``a/b.py`` or ``a/b/__init__.py``)."""
    path = Path(module_file).resolve()
    return path.parents[name.count(".") + (path.name == "__init__.py")]


CHILD_MAIN = "import sys; from gradientflow_repro.gpu_check.processes import child_main; child_main(sys.argv[1:])"


def run_in_child(item: Item, emit: Callable[[Result], None] = lambda result: None,
                 log: Optional[Callable[[str], None]] = None) -> list[Result]:
    """Run an item in a fresh Python process with its own time limit; lines stream as they come.
    The child imports the item's function by module and name, so any importable function works:
    the module's name is its import name (``__spec__.name`` for a script run as ``__main__``), and
    the folder it is imported from (the repository, or a test's folder) goes on the child's path."""
    module = sys.modules[item.check.__module__]
    name = module.__spec__.name if module.__name__ == "__main__" and module.__spec__ else module.__name__
    extra = [str(REPO)] + ([str(import_root(module.__file__, name))] if getattr(module, "__file__", None) else [])
    command = [sys.executable, "-c", CHILD_MAIN, f"{name}:{item.check.__qualname__}", item.name,
               str(item.timeout_s)]
    report = Reporter(item.name, emit)
    tail: collections.deque[str] = collections.deque(maxlen=30)
    proc = subprocess.Popen(command, cwd=REPO, env=child_env(extra), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)

    def read() -> None:
        for line in proc.stdout:
            if line.startswith(MARK):
                result = Result(**json.loads(line[len(MARK):]))
                report.results.append(result)
                emit(result)
            else:
                tail.append(line.rstrip())
                if log:
                    log(f"[{item.name}] {line.rstrip()}")

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        status: Optional[int] = proc.wait(timeout=item.timeout_s)
    except subprocess.TimeoutExpired:
        stop_group(proc)
        status = None
    except KeyboardInterrupt:  # the child has a session of its own: Ctrl-C does not reach it
        stop_group(proc)
        raise
    reader.join(timeout=10)
    last = next((line for line in reversed(tail) if line.strip()), "")
    if status is None:
        after = f" after its line {report.results[-1].item}" if report.results else ""
        report.add("FAIL", f"hung > {item.timeout_s:.0f} s{after}; killed")
    elif status != 0 and not any(r.status == "FAIL" for r in report.results):
        report.add("FAIL", f"its process exited with status {status}: {last[:300]}")
    elif not report.results:
        report.add("FAIL", f"its process reported nothing: {last[:300]}")
    return report.results


_DEADLINE: Optional[float] = None  # in a child: when its parent will kill it (minus a margin)
_GROUPS: set[int] = set()  # process groups a child started (killed with it)


def time_left(default: float = 3600.0) -> float:
    """Seconds before this item's parent kills it (minus a margin): what a part of it may still take."""
    return default if _DEADLINE is None else max(1.0, _DEADLINE - time.monotonic())


def _emit_marked(result: Result) -> None:
    print(MARK + json.dumps(asdict(result)), flush=True)


def child_main(argv: list[str]) -> None:
    """Entry of an item's child process: ``module:function item_name timeout_s``."""
    global _DEADLINE
    target, name, timeout_s = argv
    _DEADLINE = time.monotonic() + float(timeout_s) - 10.0

    def on_term(signum: int, frame: Any) -> None:
        for group in list(_GROUPS):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    logs.configure()  # the library's lines go to the log beside the report, which names the item
    module, qualname = target.split(":")
    check = importlib.import_module(module)
    for attribute in qualname.split("."):
        check = getattr(check, attribute)
    run_here(Item(name, check, float(timeout_s), 0, ""), _emit_marked)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # results are out: no interpreter finalisation racing NCCL or gloo threads


def run_command(command: list[str], timeout_s: float, **popen: Any) -> tuple[Optional[int], str, float]:
    """Run a command in a process group of its own: (exit status or None if it hung, output, s)."""
    started = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True, **popen)
    _GROUPS.add(proc.pid)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, output, time.monotonic() - started
    except subprocess.TimeoutExpired:
        stop_group(proc)
        try:
            output, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            output = ""
        return None, output or "", time.monotonic() - started
    finally:
        _GROUPS.discard(proc.pid)


def spawn_ranks(report: Reporter, worker: Callable[..., None], world: int, limit_s: float) -> None:
    """Run ``worker(rank, world, port, lines)`` in ``world`` spawned processes, ``lines`` a queue the
    ranks put their results into (``put_result``): each becomes a line of ``report`` as it comes. A
    rank that fails or is still running after ``limit_s`` is a FAIL line (the others are killed)."""
    import torch.multiprocessing as mp

    lines = mp.get_context("spawn").SimpleQueue()

    def take_lines() -> None:
        while not lines.empty():
            report.add_result(Result(**lines.get()))

    context = mp.start_processes(worker, args=(world, free_port(), lines), nprocs=world, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + limit_s
    try:
        while not context.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
            take_lines()
            if time.monotonic() >= deadline:
                running = [rank for rank, p in enumerate(context.processes) if p.is_alive()]
                report.add("FAIL", f"hung > {limit_s:.0f} s (rank(s) {running} still running); killed")
                break
    except mp.ProcessExitedException as error:
        if error.exit_code != REPORTED_EXIT:
            report.add("FAIL", f"rank {error.error_index} died: {describe(error)}")
    except mp.ProcessRaisedException as error:
        report.add("FAIL", f"rank {error.error_index}: {describe(error)}")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=5)
        take_lines()


def put_result(lines: Any, result: Result) -> None:
    """In a spawned rank: hand ``result`` to ``spawn_ranks`` (a plain pipe write: safe before os._exit)."""
    lines.put(asdict(result))
