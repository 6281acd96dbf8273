"""A long harness job's progress: which job of how many is running and the time left
(``Timeline``), and what is done, saved as it happens so that an interrupted launch continues
where it stopped (``Progress``). ``make reproduce`` and the cluster benchmark use both.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import IO, Optional

from gradientflow_repro.tracking import duration

log = logging.getLogger(__name__)


class Timeline:
    """A whole long job as a list of jobs known in advance: before each one it logs which job of
    how many it is, the time so far and an estimate of the time left (each job left costs what jobs
    of the same key took, else jobs of the same kind, else ``guess_s`` of its kind)."""

    GUESS_S = {"calibration": 40.0, "netbench": 40.0, "train": 30.0, "check": 12.0}  # make reproduce's

    def __init__(self, jobs: list[tuple[str, str]], name: str = "reproduce",
                 guess_s: Optional[dict[str, float]] = None) -> None:
        self.jobs = jobs  # (kind, key) in the order they run
        self.name = name  # what the progress lines begin with
        self.guess_s = self.GUESS_S if guess_s is None else guess_s
        self.done: list[tuple[str, str, float]] = []
        self.started = time.time()
        self._current: Optional[tuple[str, str, float]] = None

    def _estimate(self, kind: str, key: str) -> float:
        for match in (lambda k, c: (k, c) == (kind, key), lambda k, c: k == kind):
            took = [s for k, c, s in self.done if match(k, c)]
            if took:
                return sum(took) / len(took)
        return self.guess_s[kind]

    def begin(self, kind: str, key: str, title: str) -> None:
        self.end()
        index = len(self.done)
        if index < len(self.jobs) and self.jobs[index] == (kind, key):
            left = sum(self._estimate(k, c) for k, c in self.jobs[index:])
        else:  # a display's mistake must not stop the work: say so, estimate nothing
            log.info(f"{self.name}: job {index + 1} ({kind} {key}) was not planned there: time left unknown")
            left = float("nan")
        log.info(f"{self.name}: [{index + 1}/{len(self.jobs)}] {title} | "
                 f"{duration(time.time() - self.started)} so far, about {duration(left)} left")
        self._current = (kind, key, time.time())

    def end(self) -> None:
        if self._current:
            kind, key, began = self._current
            self.done.append((kind, key, time.time() - began))
            self._current = None


class CannotContinue(Exception):
    """The runs directory holds work this launch may not touch: another plan's unfinished work (left
    as it is; ``fresh`` discards it), or work another launch is doing right now."""


MACHINE_KEYS = ("cpu", "cpu_count", "gpu", "python", "torch")  # of environment_facts(): what times the runs


class Progress:
    """A long job's progress on disk (``progress.json`` in its runs directory): its plan (the options
    that shape its runs, the code, the machine), its group (a name for all its launches: the wandb
    group of ``make reproduce``), the jobs done and what they left that later jobs and the report
    need (a reproduction's calibration and measured networks, the cluster benchmark's launches), and
    the time each launch took; saved after every job and when a launch ends, however it ends.

    A launch with the same plan continues the unfinished work: finished jobs are kept, a job cut
    short runs again. Finished work, or ``fresh``, starts over in an emptied directory. Unfinished
    work of another plan is never discarded unasked, and no two launches work in one directory at
    once (a lock file beside it): ``CannotContinue``. ``name`` begins what it logs and the group,
    ``what`` names the work in its messages. Use as a context manager."""

    FILE = "progress.json"

    def __init__(self, runs_dir: Path, plan: dict, fresh: bool = False, name: str = "reproduce",
                 what: str = "reproduction") -> None:
        self.file = runs_dir / self.FILE
        self.name, self.what = name, what
        self.started = time.time()
        self._lock = _lock_beside(runs_dir)
        try:
            state = None if fresh else self._earlier(plan)
        except CannotContinue:
            self._lock.close()
            raise
        if state is None:
            self.file.unlink(missing_ok=True)  # first: a start-over cut short leaves no stale plan behind
            shutil.rmtree(runs_dir, ignore_errors=True)  # the work is one set of runs
            runs_dir.mkdir(parents=True)
            state = {"plan": plan, "group": f"{name}-{time.strftime('%Y%m%d-%H%M%S')}", "done": {},
                     "launches": []}
        self.state = state
        self.kept = len(state["done"])  # jobs done by earlier launches
        state["launches"].append({"started": self.started, "elapsed_s": 0.0, "kept_jobs": self.kept})
        self.save()

    def _earlier(self, plan: dict) -> Optional[dict]:
        """The unfinished work to continue (None: nothing to continue)."""
        if not self.file.is_file():
            return None
        try:
            state = json.loads(self.file.read_text())
            state["plan"], state["group"], state["done"], state["launches"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise CannotContinue(f"{self.file} cannot be read ({error}); --fresh discards what is in "
                                 f"{self.file.parent} and starts over") from None
        if state.get("finished"):
            return None  # finished: a new launch starts it over
        differing = _differences(state["plan"], plan)
        if differing:
            raise CannotContinue(f"the unfinished {self.what} in {self.file.parent} was launched with another "
                                 f"{', '.join(differing)}: launch it as before to continue it, or add --fresh "
                                 "to discard it and start over")
        if plan["code"] is None:
            raise CannotContinue(f"git cannot say which code this is, so the unfinished {self.what} in "
                                 f"{self.file.parent} cannot be continued: add --fresh to start over")
        return state

    def done(self, job: str) -> Optional[dict]:
        """What ``job`` left when it finished (None: not finished)."""
        return self.state["done"].get(job)

    def record(self, job: str, facts: Optional[dict] = None) -> None:
        """``job`` finished, leaving ``facts``; saved at once, so an interruption loses only the job running."""
        self.state["done"][job] = facts or {}
        self.save()

    def finish(self) -> None:
        """Every job is done and reported: the next launch starts over."""
        self.state["finished"] = True
        self.save()

    @property
    def elapsed_s(self) -> float:
        """Seconds spent on this work over all its launches, this one until now."""
        self._stamp()
        return sum(launch["elapsed_s"] for launch in self.state["launches"])

    def _stamp(self) -> None:
        self.state["launches"][-1]["elapsed_s"] = time.time() - self.started

    def save(self) -> None:
        self._stamp()
        temporary = self.file.with_suffix(".tmp")
        temporary.write_text(json.dumps(self.state, indent=1))
        os.replace(temporary, self.file)  # whole or not at all, whenever the launch is stopped

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, kind: Optional[type], error: Optional[BaseException], trace: object) -> None:
        try:
            self.save()  # this launch's time, however it ends
            stopped = kind is not None and issubclass(kind, (KeyboardInterrupt, SystemExit))
            if stopped and not self.state.get("finished"):
                log.warning(f"{self.name}: stopped; {len(self.state['done'])} finished jobs are kept in "
                            f"{self.file.parent}: run the same command again to continue")
        finally:
            self._lock.close()  # releases it


def _differences(before: dict, now: dict, prefix: str = "") -> list[str]:
    """What differs between two plans, key by key (the code's versions shortened)."""
    said = []
    for key in sorted({*before, *now}):
        old, new = before.get(key), now.get(key)
        if old == new:
            continue
        if isinstance(old, dict) and isinstance(new, dict):
            said += _differences(old, new, f"{prefix}{key}.")
        elif key == "code":
            said.append(f"code ({str(old)[:12]}, now {str(new)[:12]}; uncommitted changes count)")
        else:
            said.append(f"{prefix}{key} ({old!r}, now {new!r})")
    return said


def _lock_beside(runs_dir: Path) -> IO[str]:
    """An exclusive lock on a file beside ``runs_dir`` (not in it: a start-over empties it), held
    while the returned file stays open; CannotContinue if another launch holds it."""
    import fcntl

    runs_dir.parent.mkdir(parents=True, exist_ok=True)
    lock = open(runs_dir.parent / f".{runs_dir.name}.lock", "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.seek(0)
        holder = lock.read().strip() or "?"
        lock.close()
        raise CannotContinue(f"another launch (pid {holder}) is working in {runs_dir} now: wait for it or "
                             "stop it first") from None
    lock.seek(0)
    lock.truncate()
    lock.write(str(os.getpid()))
    lock.flush()
    return lock
