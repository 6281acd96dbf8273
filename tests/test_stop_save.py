"""A stop asked for by the scheduler loses nothing and spends nothing it need not: a stop at an
epoch's end writes its checkpoint before the evaluation (which the resumed run does first), a
signal during a periodic save stops right there (no second full checkpoint one step later), a
signal before the trainer listens is acted on (not a crash), and a stop whose checkpoint cannot be
written still exits with the status that asks for a requeue."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from gradientflow_repro.checkpoint import complete_checkpoints
from gradientflow_repro.preemption import EXIT_REQUEUE
from gradientflow_repro.tracking import read_records

from conftest import FAST, REPO, for_this_cpu, torchrun

# 15 steps an epoch (96 images a step of the digits' 1,437)
RUN = [*FAST, "global_batch_size=96", "optim.warmup_epochs=1", "target_top1=null", "checkpoint.every_epochs=1",
       "logger.log_every=5", "data.loader=torchvision", "data.reader_workers=0", "epochs=2"]


def _stopped(result: subprocess.CompletedProcess, code: int = EXIT_REQUEUE) -> bool:
    return f"exitcode  : {code}" in result.stdout + result.stderr


def _evals(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_records(run_dir / "metrics.jsonl") if r.get("kind") == "eval"]


def test_a_stop_at_an_epochs_end_saves_before_it_evaluates_and_the_resume_evaluates_first(tmp_path: Path) -> None:
    run = tmp_path / "run"
    # rank 1 is warned during the epoch's last step: the ranks agree to stop after it, at the epoch's end
    first = torchrun(2, RUN, run, check=False, env={"GFR_INJECT_FAULT": "usr1@forward:rank=1:step=14"})
    assert _stopped(first), first.stdout[-3000:] + first.stderr[-3000:]
    assert [p.name for p in complete_checkpoints(run)] == ["step_000000015"]
    assert "eval  step 15" not in first.stdout and _evals(run) == []  # no evaluation before the save
    shared = torch.load(run / "checkpoints" / "step_000000015" / "shared.pt", weights_only=True)
    assert shared["progress"]["eval_pending"] is True
    resumed = torchrun(2, RUN, run)
    assert "at step 15" in resumed.stdout
    assert _evals(run) == [15, 30]  # the pending evaluation first, then the next epoch's


def test_a_signal_during_a_periodic_save_stops_there_without_a_second_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    first = torchrun(2, RUN, run, check=False, env={"GFR_INJECT_FAULT": "usr1@checkpoint:rank=1:step=15"})
    assert _stopped(first), first.stdout[-3000:] + first.stderr[-3000:]
    assert [p.name for p in complete_checkpoints(run)] == ["step_000000015"]
    assert json.loads((run / "summary.json").read_text())["steps"] == 15


def test_a_stop_whose_checkpoint_cannot_be_written_still_asks_for_a_requeue(tmp_path: Path) -> None:
    run = tmp_path / "run"
    first = torchrun(2, [*RUN, "checkpoint.every_epochs=5"], run, check=False,
                     env={"GFR_INJECT_FAULT": "usr1@forward:rank=1:step=5,full@checkpoint:rank=1:step=6"})
    assert _stopped(first), first.stdout[-3000:] + first.stderr[-3000:]
    assert "checkpoint of step 6 not written: rank 1: cannot write" in first.stderr
    assert "No space left on device" in first.stderr and "the newest checkpoint is none" in first.stderr
    assert complete_checkpoints(run) == [] and not list((run / "checkpoints").glob("*.tmp"))


def test_a_stop_signal_before_the_trainer_listens_is_acted_on_not_a_crash(tmp_path: Path) -> None:
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    job = subprocess.Popen([sys.executable, "-m", "gradientflow_repro.train", f"run_dir={tmp_path / 'run'}",
                            *for_this_cpu(RUN)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    time.sleep(1.0)  # inside the imports, seconds before the trainer installs its handlers
    job.send_signal(signal.SIGUSR1)
    output = job.communicate(timeout=180)[0]
    assert job.returncode == EXIT_REQUEUE, output[-3000:]
    assert "stopped by SIGUSR1 after step 1: checkpoint saved" in output
