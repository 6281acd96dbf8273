"""The reliability table's scenarios that take more than one launch: a run directory used twice, two
jobs at once, a stop at a chosen moment, a full disk, damaged checkpoints, a resumed run's metrics.

Each scenario is a function of (scratch folder, data root) returning its row: (fault, world size,
what the harness did, when it was detected, what was lost). They launch real training through
``fault_report.torchrun`` (torchrun, gloo, 2 ranks, the short ``BASE`` run: 15 steps an epoch, 3
epochs, a checkpoint every epoch).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from gradientflow_repro import REPO
from gradientflow_repro.checkpoint import complete_checkpoints

Row = tuple[str, int, str, str, str]


def _launch(overrides: list[str], run_dir: Path, env: dict[str, str] | None = None) -> tuple[int, str]:
    from gradientflow_repro.reproduction.fault_report import BASE, torchrun

    code, output, _ = torchrun(2, [*BASE, *overrides], run_dir, {"GFR_ALLOW_FAULTS": "1", **(env or {})})
    ranks = re.search(r"exitcode\s*:\s*(-?\d+)", output)  # torchrun exits 1 for any failed rank
    return (int(ranks.group(1)) if code and ranks else code), output


def _said(output: str, scratch: Path, *patterns: str) -> str:
    """The first line of ``output`` matching any of ``patterns`` (paths shortened), else '-'."""
    output = output.replace(str(REPO) + "/", "").replace(str(scratch), "$SCRATCH")
    for line in output.splitlines():
        if any(re.search(pattern, line) for pattern in patterns):
            return re.sub(r"\s+", " ", line.strip())[:240]
    return "-"


def _steps(run_dir: Path) -> list[str]:
    return [p.name.removeprefix("step_").lstrip("0") or "0" for p in complete_checkpoints(run_dir)]


def _resumed(output: str) -> str:
    found = re.search(r"resumed from \S+ at step (\d+)", output)
    return found.group(1) if found else "?"


def used_with_resume_never(scratch: Path, data: Path) -> Row:
    run = scratch / "run"
    _launch([f"data.root={data}"], run)
    code, output = _launch([f"data.root={data}", "epochs=2", "resume=never"], run)
    moved = sorted((run / "superseded").iterdir()) if (run / "superseded").is_dir() else []
    old = _steps(moved[0]) if moved else []
    again, rerun = _launch([f"data.root={data}"], run)
    return ("`resume=never` in a run directory holding a finished run (checkpoints 15, 30, 45), then the "
            "plain command", 2, f"exit {code}; {_said(output, scratch, 'resume=never:')}", "at start-up",
            f"nothing: the earlier run's checkpoints ({', '.join(old)}) and metrics kept under superseded/; the "
            f"plain rerun resumed the new run at step {_resumed(rerun)} and {'finished' if again == 0 else 'failed'}")


def another_configuration(scratch: Path, data: Path) -> Row:
    run = scratch / "run"
    _launch([f"data.root={data}", "max_steps=15"], run)
    code, output = _launch([f"data.root={data}", "optim.base_lr=0.5"], run)
    return ("another configuration (`optim.base_lr=0.5`) in the run directory of a run", 2,
            f"exit {code}; {_said(output, scratch, '^error:')}", "before the process group",
            f"nothing: checkpoint(s) {', '.join(_steps(run))} untouched; `accept_config_change=[optim.base_lr]` "
            f"resumes it with the change recorded")


def second_job(scratch: Path, data: Path) -> Row:
    from gradientflow_repro.reproduction.fault_report import BASE

    run = scratch / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "-m",
               "gradientflow_repro.train", f"run_dir={run}", *BASE, f"data.root={data}", "epochs=30",
               "target_top1=null"]
    first = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (run / "run.lock").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        code, output = _launch([f"data.root={data}", "epochs=30"], run)
        alive = first.poll() is None
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=60)
    return ("a second job started in a run directory in use", 2, f"exit {code}; {_said(output, scratch, '^error:')}",
            "before the process group", "nothing: the first job trained on undisturbed" if alive else
            "the first job had ended")


def all_checkpoints_damaged(scratch: Path, data: Path) -> Row:
    run = scratch / "run"
    _launch([f"data.root={data}", "max_steps=31"], run)
    for path in complete_checkpoints(run):
        target = path / "rank_00001.pt"
        target.write_bytes(target.read_bytes()[:1000])
    code, output = _launch([f"data.root={data}"], run)
    return ("every checkpoint damaged (rank 1's file truncated in each), then a rerun", 2,
            f"exit {code}; {_said(output, scratch, '^error:')}", "when resuming (SHA-256 mismatch)",
            f"nothing: the run stopped instead of starting again from step 0; checkpoints {', '.join(_steps(run))} "
            f"left in place for repair (`resume=never` sets them aside)")


def _fault_and_rerun(fault: str, inject: str, extra: list[str]) -> Callable[[Path, Path], Row]:
    def scenario(scratch: Path, data: Path) -> Row:
        run = scratch / "run"
        code, output = _launch([f"data.root={data}", *extra], run, {"GFR_INJECT_FAULT": inject})
        said = _said(output, scratch, "^error:", r"stopped by SIG\w+ after step")
        saved = _steps(run)
        again, rerun = _launch([f"data.root={data}", *extra], run)
        first_eval = re.search(r"eval +step (\d+)", rerun)
        pending = first_eval is not None and first_eval.group(1) == _resumed(rerun)
        retrained = " (the steps after it trained again: their checkpoint could not be written)" \
            if "not written" in said else ""
        return (fault, 2, f"exit {code}; {said}", "at the next step boundary",
                f"nothing saved: checkpoints {', '.join(saved) or 'none'}; the rerun resumed at step "
                f"{_resumed(rerun)}{retrained}"
                + (", did the evaluation the stop had put off first" if pending else "")
                + f" and {'finished' if again == 0 else 'failed (exit %d)' % again}")
    scenario.__name__ = inject
    return scenario


def early_signal(scratch: Path, data: Path) -> Row:
    from gradientflow_repro.reproduction.fault_report import BASE

    job = subprocess.Popen([sys.executable, "-m", "gradientflow_repro.train", f"run_dir={scratch / 'run'}", *BASE,
                            f"data.root={data}"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    time.sleep(1.0)
    job.send_signal(signal.SIGUSR1)
    output = job.communicate(timeout=300)[0]
    return ("SIGUSR1 one second after start, before the trainer installs its handlers (one process)", 1,
            f"exit {job.returncode}; {_said(output, scratch, r'stopped by SIG')}", "after the first step",
            f"nothing: checkpoint(s) {', '.join(_steps(scratch / 'run')) or 'none'}")


def metrics_after_a_crash(scratch: Path, data: Path) -> Row:
    from gradientflow_repro.tracking import read_records

    run = scratch / "run"
    code, _ = _launch([f"data.root={data}", "logger.log_every=1"], run,
                      {"GFR_INJECT_FAULT": "kill@forward:rank=1:step=20"})
    again, rerun = _launch([f"data.root={data}", "logger.log_every=1"], run)
    steps = [r["step"] for r in read_records(run / "metrics.jsonl") if r.get("kind") == "train"]
    side = run / "metrics.abandoned.jsonl"
    abandoned = len(side.read_text().splitlines()) if side.exists() else 0
    return ("rank 1 killed at step 20, 5 steps after the checkpoint of step 15, then a rerun: the metrics", 2,
            f"exit {code}, then the rerun exit {again} (resumed at step {_resumed(rerun)})", "at the resume",
            f"nothing: metrics.jsonl holds {len(steps)} step records, {len(set(steps))} distinct (each once); "
            f"{abandoned} records of the abandoned steps moved to metrics.abandoned.jsonl")


SCENARIOS: list[Callable[[Path, Path], Row]] = [
    used_with_resume_never, another_configuration, second_job, all_checkpoints_damaged,
    _fault_and_rerun("SIGUSR1 to rank 1 in an epoch's last step (the stop falls on the epoch's end)",
                     "usr1@forward:rank=1:step=14", []),
    _fault_and_rerun("SIGUSR1 to rank 1 while it writes the periodic checkpoint of step 15",
                     "usr1@checkpoint:rank=1:step=15", []),
    _fault_and_rerun("disk full (ENOSPC) on rank 1 while it writes the checkpoint of step 30",
                     "full@checkpoint:rank=1:step=30", []),
    _fault_and_rerun("disk full on rank 1 during the preemption save (SIGUSR1 in step 21)",
                     "usr1@forward:rank=1:step=20,full@checkpoint:rank=1:step=21", []),
    early_signal, metrics_after_a_crash,
]


# Faults of the Slurm templates, injected by tests under a real local Slurm (tests/test_slurm.py, which
# starts and stops it): (fault, test, what the harness does, when detected, what is lost).
SLURM = [
    ("SIGTERM to the batch script (`scancel --batch`) during the save after a preemption warning",
     "test_sigterm_during_the_stop_save_still_requeues_and_reaches_the_ranks",
     "one line; the SIGTERM passed to the ranks with scancel; they exit 75; `scontrol requeue`; restart 1 in "
     "the same run directory", "at the end of the save", "nothing (before: the batch shell died, no requeue)"),
    ("every run exits 75 without a newer checkpoint", "test_a_job_whose_runs_make_no_progress_stops_requeueing",
     "requeued twice, then fails with `error: job N: not requeued: no checkpoint newer than step S since 2 "
     "requeues in a row ...`", "at the third run", "nothing: the step to resume from is named"),
    ("job ids whose old rendezvous port fell in the ephemeral range (32768-60999)",
     "test_master_port_is_below_the_ephemeral_range_and_follows_the_job_id",
     "port below the range's start, the same across requeues, another for the next job id", "at submission",
     "nothing"),
]


def slurm_rows() -> list[Row]:
    """``SLURM``'s rows, each with its test's outcome at this checkout (pytest under the local Slurm)."""
    names = [test for _, test, *_ in SLURM]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
                           "tests/test_slurm.py", "-k", " or ".join(names)], cwd=REPO, capture_output=True,
                          text=True, timeout=900, env={**os.environ, "REQUIRE_SLURM_TESTS": "1"})
    rows = []
    for fault, test, did, when, lost in SLURM:
        outcome = re.search(rf"^(PASSED|FAILED|ERROR|SKIPPED)\S* tests/test_slurm.py::{test}", done.stdout, re.M)
        said = outcome.group(1).lower() if outcome else "not run"
        rows.append((f"{fault} (local Slurm: tests/test_slurm.py::{test}, {said})", 2, did, when, lost))
    return rows
