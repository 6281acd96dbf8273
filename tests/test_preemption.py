"""Preemption without Slurm: a signal to one rank stops every rank after the same step, with a
checkpoint from which the run continues to exactly the parameters of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import torch

from gradientflow_repro.checkpoint import complete_checkpoints
from gradientflow_repro.preemption import EXIT_REQUEUE, StopRequests
from gradientflow_repro.tracking import read_records

from conftest import FAST, REPO, final_params, torchrun, torchrun_command, train


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _steps_done(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return 0
    return max((r.get("step", 0) for r in read_records(metrics)), default=0)


def _start(world: int, overrides: list[str], run_dir: Path) -> subprocess.Popen:
    command, env = torchrun_command(world, overrides, run_dir)
    return subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)


def test_stop_requests_record_the_strongest_signal_and_restore_handlers() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    stop = StopRequests()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)  # stronger: stop without requeue
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.received == signal.SIGTERM
        assert stop.agreed(torch.device("cpu")) == signal.SIGTERM  # no process group: local value
        assert not stop.requeue and stop.exit_code == 128 + signal.SIGTERM and stop.name == "SIGTERM"
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGUSR1) is before


def test_signal_to_one_rank_checkpoints_all_and_resumes_exactly(tmp_path: Path, digits_root: Path) -> None:
    world = 2
    common = [*FAST, f"data.root={digits_root}", "global_batch_size=128", "epochs=3",
              "optim.warmup_epochs=1", "eval_every_epochs=1", "save_final_params=true",
              "deterministic=true", "checkpoint.every_epochs=100"]
    train(world, common, tmp_path / "straight")  # the reference: launched as make reproduce does

    run_dir = tmp_path / "preempted"
    job = _start(world, common, run_dir)
    deadline = time.monotonic() + 180
    while _steps_done(run_dir) < 4 and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    ranks = _children(job.pid)
    assert len(ranks) == world, f"expected {world} worker processes, found {ranks}"
    os.kill(ranks[1], signal.SIGUSR1)  # only rank 1 is warned; rank 0 must follow it
    while job.poll() is None and time.monotonic() < deadline:  # more warnings during the checkpoint
        for pid in _children(job.pid):
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        time.sleep(0.02)
    output = job.communicate(timeout=60)[0]
    assert job.returncode != 0, output[-3000:]
    assert f"exitcode  : {EXIT_REQUEUE}" in output or f"exit code {EXIT_REQUEUE}" in output, output[-3000:]
    assert "stopped by SIGUSR1" in output, output[-3000:]
    saved = complete_checkpoints(run_dir)
    assert len(saved) == 1, saved
    stopped_at = int(saved[0].name.split("_")[1])
    assert 4 <= stopped_at < 33
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGUSR1" and summary["exit_code"] == EXIT_REQUEUE
    assert summary["steps"] == stopped_at

    resumed = torchrun(world, common, run_dir)
    assert f"at step {stopped_at}" in resumed.stdout
    for rank in range(world):
        a, b = final_params(tmp_path / "straight", rank), final_params(run_dir, rank)
        for key in a:
            assert torch.equal(a[key], b[key]), f"{key} differs on rank {rank}"
