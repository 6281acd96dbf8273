#!/usr/bin/env python3
"""Run one test many times, each in a fresh pytest process with a time limit, and count how it ended.

A hang that shows once in dozens of runs is invisible to a single CI run. This runs the test that
used to hang now and then (the preemption test with the torchvision loader's workers, whose workers
could deadlock when forked from the threaded trainer) ``--runs`` times, one after another. Each run
is a pytest process in a session of its own; one that has not ended after ``--timeout`` seconds
counts as a hang and is killed with everything it started (the test starts its job in a session of
its own, so the whole tree of processes is stopped, then killed). Logs one line per run and the counts
(passes, failures, hangs); exits 1 if any run failed or hung. Not part of CI: minutes per run.

    python scripts/stress_preemption.py --runs 50 [--timeout 300] [--test NODE_ID] [--log FILE]
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from gradientflow_repro import REPO, logs

log = logging.getLogger("gradientflow_repro.stress_preemption")  # under the package: its handler
FLAKY = ("tests/test_preemption.py::test_stop_signal_checkpoints_every_rank_and_resumes_exactly"
         "[every process group-10-2-torchvision]")


def run_once(test: str, timeout_s: float) -> tuple[str, float, str]:
    """(outcome: "pass", "fail" or "hang"; seconds; the output's last lines) of one pytest run."""
    started = time.monotonic()
    job = subprocess.Popen([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", test],
                           cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)  # its own process group: a hang is ended whole
    try:
        output = job.communicate(timeout=timeout_s)[0]
        outcome = "pass" if job.returncode == 0 else "fail"
    except subprocess.TimeoutExpired:
        _end_tree(job.pid)
        output = job.communicate()[0]
        outcome = "hang"
    finally:
        try:  # whatever a finished run left in its group (it should leave nothing)
            os.killpg(job.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return outcome, time.monotonic() - started, "\n".join(output.splitlines()[-25:])


def _tree(pid: int) -> set[int]:
    """``pid`` and its descendants, from /proc (the children of each of their threads)."""
    found, todo = set(), [pid]
    while todo:
        found.add(current := todo.pop())
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                todo += [int(child) for child in (task / "children").read_text().split()
                         if int(child) not in found]
            except (OSError, ValueError):
                pass
    return found


def _end_tree(pid: int) -> None:
    """Stop ``pid`` and every descendant (none can start another or be orphaned meanwhile), look
    again for any started before it stopped, then kill them all."""
    stopped: set[int] = set()
    for _ in range(3):
        for member in _tree(pid) - stopped:
            try:
                os.kill(member, signal.SIGSTOP)
                stopped.add(member)
            except ProcessLookupError:
                pass
    for member in stopped:
        try:
            os.kill(member, signal.SIGKILL)
        except ProcessLookupError:
            pass


def stress(test: str, runs: int, timeout_s: float) -> dict[str, int]:
    """Run ``test`` ``runs`` times; log a line per run; the counts."""
    counts = {"pass": 0, "fail": 0, "hang": 0}
    log.info(f"{test}: {runs} runs, {timeout_s:.0f} s each at most")
    began = time.monotonic()
    for run in range(1, runs + 1):
        outcome, seconds, tail = run_once(test, timeout_s)
        counts[outcome] += 1
        log.info(f"run {run}/{runs}: {outcome} in {seconds:.1f} s (passes {counts['pass']}, "
                 f"failures {counts['fail']}, hangs {counts['hang']})")
        if outcome != "pass":
            log.info("  " + tail.replace("\n", "\n  "))
    log.info(f"done: {runs} runs in {time.monotonic() - began:.0f} s: passes {counts['pass']}, "
             f"failures {counts['fail']}, hangs {counts['hang']}")
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20, help="how many runs (default 20)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds after which a run counts as a hang (default 300)")
    parser.add_argument("--test", default=FLAKY, help="the pytest node id to run (default: the preemption "
                                                      "test with the torchvision loader's workers)")
    parser.add_argument("--log", type=Path, help="also append every line to this file")
    args = parser.parse_args()
    if args.runs < 1 or args.timeout <= 0:
        parser.error("--runs must be at least 1 and --timeout positive")
    logs.configure()
    if args.log is not None:  # every line in the file too, as on the terminal
        appended = logging.FileHandler(args.log, mode="a")
        appended.setFormatter(logs.PrefixFormatter())
        logging.getLogger(logs.PACKAGE).addHandler(appended)
    counts = stress(args.test, args.runs, args.timeout)
    sys.exit(1 if counts["fail"] or counts["hang"] else 0)


if __name__ == "__main__":
    main()
