"""Preemption without Slurm: a signal to one rank, or to every process of every rank as Slurm sends
it (data workers included, which must not die of it), stops every rank after the same step, with a
checkpoint from which the run continues to exactly the parameters of an uninterrupted run."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from gradientflow_repro.checkpoint import complete_checkpoints
from gradientflow_repro.preemption import EXIT_REQUEUE, StopRequests
from gradientflow_repro.tracking import read_records

from conftest import FAST, REPO, final_params, torchrun, torchrun_command, train
from support import process_group


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


# A rank with its data workers, as Slurm signals a step: the stop signals reach every process. The
# loader is built by build_data from data.reader_workers; the script reads a batch, then after each
# signal to its process group (sent by the test) waits for its handler to record it and reads on.
WORKERS_SCENARIO = r"""
import json, os, signal, sys, time
from pathlib import Path
import torch
from gradientflow_repro.config import DataConfig
from gradientflow_repro.data import build_data
from gradientflow_repro.preemption import StopRequests

def children():
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == os.getpid():
                found.append(int(entry.name))
        except OSError:
            pass
    return sorted(found)

stop = StopRequests()
cfg = DataConfig(root=sys.argv[2], loader=sys.argv[1], reader_workers=2, num_classes=10, image_size=32,
                 val_resize=32, min_crop_scale=0.6, flip=False, mean=[0.0] * 3, std=[255.0] * 3,
                 num_threads=1, prefetch=2, verify_files=False)
data = build_data(cfg, global_batch=32, rank=0, world_size=1, device=torch.device("cpu"), seed=0)
batches = data.train_batches(0)
next(batches)
workers, received = children(), []
print("ready", flush=True)
for expected in (signal.SIGUSR1, signal.SIGTERM):
    sys.stdin.readline()  # the test has signalled the process group
    deadline = time.monotonic() + 30
    while stop.received != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    received.append(stop.received)
    for _ in range(6):  # more than the loader holds ready: the workers must produce some of them
        next(batches)
    print("read", flush=True)
print(json.dumps({"workers": workers, "after": children(), "received": received}), flush=True)
"""


@pytest.mark.parametrize("loader", ["dali", "torchvision"])
def test_data_workers_ignore_stop_signals_sent_to_the_whole_process_group(
        loader: str, digits_root: Path) -> None:
    job = subprocess.Popen([sys.executable, "-c", WORKERS_SCENARIO, loader, str(digits_root)], cwd=REPO,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines: queue.Queue = queue.Queue()  # the script's output, read with a deadline (a hang is a failure)
    threading.Thread(target=lambda: [*map(lines.put, job.stdout), lines.put("")], daemon=True).start()
    seen: list[str] = []

    def wait_for(word: str) -> None:
        deadline = time.monotonic() + 60
        while not seen or seen[-1].strip() != word:
            try:
                seen.append(lines.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                seen.append("(no output for 60 s)")
            if seen[-1] in ("", "(no output for 60 s)"):  # ended, or hangs
                raise AssertionError(f"no '{word}' from the script:\n" + "".join(seen)[-3000:])

    try:
        wait_for("ready")
        for signum in (signal.SIGUSR1, signal.SIGTERM):
            os.killpg(job.pid, signum)  # the script, and every data worker it started
            job.stdin.write("go\n")
            job.stdin.flush()
            wait_for("read")
        job.wait(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    while seen[-1] != "":  # the rest of the output, up to its end
        seen.append(lines.get(timeout=10))
    output = "".join(seen)
    assert job.returncode == 0 and output.strip().endswith("}"), output[-3000:]
    report = json.loads(output.strip().splitlines()[-1])
    assert len(report["workers"]) >= 2, report  # the workers were there to be signalled
    assert set(report["workers"]) <= set(report["after"]), report  # and none of them died
    assert report["received"] == [signal.SIGUSR1, signal.SIGTERM], report  # the trainer heard both


def _overrides(digits_root: Path) -> list[str]:
    return [*FAST, f"data.root={digits_root}", "global_batch_size=128", "epochs=2", "optim.warmup_epochs=1",
            "eval_every_epochs=1", "save_final_params=true", "deterministic=true", "checkpoint.every_epochs=100"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory, digits_root: Path):
    """The uninterrupted reference run of a loader (no reader workers: they must not change a bit
    either), launched as make reproduce does; each loader's is run once, when first asked for."""
    runs: dict[str, Path] = {}

    def run(loader: str) -> Path:
        if loader not in runs:
            runs[loader] = tmp_path_factory.mktemp(f"straight-{loader}")
            train(2, [*_overrides(digits_root), f"data.loader={loader}"], runs[loader])
        return runs[loader]
    return run


# Who gets the signal: Slurm's --signal=USR1 (no B:) and its SIGTERM reach every process of the step,
# the data workers included; torchrun starts each rank in a session of its own, so a rank's process
# group is the rank and its data workers. "rank 1": the warning reaches one rank only, first. The
# workers are DALI's parallel external source's (the default loader) and, once, the torchvision
# fallback's DataLoader workers.
@pytest.mark.parametrize("signalled, signum, workers, loader", [
    ("rank 1", signal.SIGUSR1, 0, "dali"),
    ("every process group", signal.SIGUSR1, 2, "dali"),
    ("every process group", signal.SIGTERM, 2, "dali"),
    ("every process group", signal.SIGUSR1, 2, "torchvision"),
])
def test_stop_signal_checkpoints_every_rank_and_resumes_exactly(
        tmp_path: Path, digits_root: Path, straight, signalled: str, signum: int, workers: int,
        loader: str) -> None:
    world, name = 2, signal.Signals(signum).name
    exit_code = EXIT_REQUEUE if signum == signal.SIGUSR1 else 128 + signum
    common = [*_overrides(digits_root), f"data.loader={loader}", f"data.reader_workers={workers}"]
    run_dir = tmp_path / "preempted"
    command, env = torchrun_command(world, common, run_dir)
    job = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=env, start_new_session=True)

    def send(pids: list[int]) -> None:
        for pid in pids:
            try:
                os.killpg(pid, signum) if signalled != "rank 1" else os.kill(pid, signum)
            except ProcessLookupError:
                pass

    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 180
        while _steps_done(run_dir) < 4 and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        ranks = _children(job.pid)
        assert len(ranks) == world, f"expected {world} rank processes, found {ranks}"
        assert all(len(process_group(rank)) >= 1 + workers for rank in ranks), [process_group(rank) for rank in ranks]
        if signalled == "rank 1":
            send(ranks[1:])  # rank 0 must follow rank 1
        else:  # Slurm signals the processes one by one: here the data workers first, while the ranks
            for rank in ranks:  # still train and read batches for a moment, which must not fail
                for worker in set(process_group(rank)) - {rank}:
                    os.kill(worker, signum)
            time.sleep(1.0)
            send(ranks)
        while job.poll() is None and time.monotonic() < deadline:  # more signals during the checkpoint
            send(ranks)
            time.sleep(0.02)
        output = job.communicate(timeout=60)[0]
    finally:
        for pid in [job.pid, *ranks]:  # whatever is left of a failed run
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert f"exitcode  : {exit_code}" in output or f"exit code {exit_code}" in output, output[-3000:]
    assert f"stopped by {name}" in output, output[-3000:]
    saved = complete_checkpoints(run_dir)
    assert len(saved) == 1, saved
    stopped_at = int(saved[0].name.split("_")[1])
    assert 4 <= stopped_at < 22
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"] == name and summary["exit_code"] == exit_code
    assert summary["steps"] == stopped_at

    resumed = torchrun(world, [*_overrides(digits_root), f"data.loader={loader}"], run_dir)  # without
    assert f"at step {stopped_at}" in resumed.stdout  # workers: the same bits either way
    for rank in range(world):
        a, b = final_params(straight(loader), rank), final_params(run_dir, rank)
        for key in a:
            assert torch.equal(a[key], b[key]), f"{key} differs on rank {rank}"


def test_the_worker_block_keeps_both_signals_blocked_after_the_resource_tracker_starts() -> None:
    """multiprocessing unblocks SIGINT and SIGTERM in the calling thread once it has started its
    resource tracker, which the first worker start of a process does: inside the block the mask is
    set again, so that worker (or the fork server) is still born with both stop signals blocked. In
    a fresh process: the tracker is one per process, and the test process's may run already."""
    code = ("import signal\n"
            "from multiprocessing import resource_tracker\n"
            "from gradientflow_repro.preemption import workers_ignore_stop_signals\n"
            "assert resource_tracker._resource_tracker._fd is None  # not started yet\n"
            "with workers_ignore_stop_signals(processes=True):\n"
            "    print(sorted(s.name for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[0] == "['SIGTERM', 'SIGUSR1']", done.stdout
