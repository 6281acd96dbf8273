"""When checkpoints are written: at a stop signal and at the end always, and periodically by whole
epochs (``checkpoint.every_epochs``) or by wall-clock minutes (``checkpoint.every_minutes``), the
latter decided by all ranks together in the step's one agreement. The 512-GPU experiments write
only the stop's and the end's by default."""

from __future__ import annotations

from pathlib import Path

import pytest

from gradientflow_repro.checkpoint import CheckpointClock, complete_checkpoints, step_of

from conftest import FAST, train


@pytest.mark.parametrize("experiment", ["alexnet_512gpu", "resnet50_512gpu"])
def test_512gpu_experiments_checkpoint_only_at_a_stop_and_at_the_end(experiment: str) -> None:
    from gradientflow_repro.checks import field_problems
    from gradientflow_repro.config import Config, compose

    cfg = compose([f"+experiment={experiment}"])
    assert cfg.checkpoint.every_epochs is None and cfg.checkpoint.every_minutes is None, cfg.checkpoint
    assert not [p for p in field_problems(Config, cfg) if p[0].startswith("checkpoint.")]
    # the periodic interval in minutes is an option, validated where it is declared
    assert compose([f"+experiment={experiment}", "checkpoint.every_minutes=30"]).checkpoint.every_minutes == 30
    bad = compose([f"+experiment={experiment}", "checkpoint.every_minutes=0"])
    assert ("checkpoint.every_minutes", 0, "must be positive, or null") in list(field_problems(Config, bad))


def test_checkpoint_clock_starts_with_the_first_step_and_restarts_at_each_checkpoint(monkeypatch) -> None:
    import gradientflow_repro.checkpoint as checkpoint

    now = [100.0]
    monkeypatch.setattr(checkpoint.time, "monotonic", lambda: now[0])
    assert CheckpointClock(None).due() == 0.0  # off
    clock = CheckpointClock(every_minutes=0.5)
    now[0] = 5000.0
    assert clock.due() == 0.0  # the start-up before the first step does not count
    now[0] += 29.9
    assert clock.due() == 0.0
    now[0] += 0.1
    assert clock.due() == 1.0
    clock.restart()
    now[0] += 29.0
    assert clock.due() == 0.0


# A rank whose checkpoint clock runs a million times as fast as the others' (then the trainer, as
# ``python -m gradientflow_repro.train`` runs it): with every_minutes=1 it finds a checkpoint due
# after 60 microseconds (every step), the others after a minute (never in this run). Run as
# ``python -c`` (a fresh interpreter per rank).
FAST_CLOCK_RANK = """
import os, runpy, time, types
if os.environ["RANK"] == os.environ["FAST_CLOCK_RANK"]:
    from gradientflow_repro import checkpoint
    checkpoint.time = types.SimpleNamespace(monotonic=lambda: 1e6 * time.monotonic())
runpy.run_module("gradientflow_repro.train", run_name="__main__", alter_sys=True)
"""


def test_a_checkpoint_by_minutes_is_written_by_every_rank_after_the_same_step(tmp_path: Path, digits_root: Path,
                                                                             monkeypatch) -> None:
    """Only one rank's clock passes the interval (1 minute) within the run, after each step from the
    second on. Decided on each rank's own clock, that rank would enter a checkpoint's collectives
    and the others the next step's, and the run would fail (dist_timeout_s); agreed, every rank
    saves after each of those steps. None after the first (the clock starts with the first step)
    and none for the epoch's end at step 11 beyond the interval's (every_epochs=null)."""
    from gradientflow_repro.cluster.launch import run_ranks

    from conftest import for_this_cpu

    monkeypatch.setenv("FAST_CLOCK_RANK", "1")  # not rank 0, which completes each checkpoint
    run = tmp_path / "run"
    overrides = [*FAST, f"data.root={digits_root}", "dist_timeout_s=30", "max_steps=13", "target_top1=null",
                 "checkpoint.every_epochs=null", "checkpoint.every_minutes=1", "checkpoint.keep=100"]
    run_ranks(2, [f"run_dir={run}", *for_this_cpu(overrides)], run, "train", None, 240, show=False,
              module=("-c", FAST_CLOCK_RANK))
    assert [step_of(path) for path in complete_checkpoints(run)] == list(range(2, 14))


def test_without_a_periodic_interval_only_the_end_is_checkpointed(tmp_path: Path, digits_root: Path) -> None:
    """The 512-GPU experiments' policy on the CPU miniature: across an epoch's end (step 11, with its
    evaluation), no checkpoint but the last."""
    run = tmp_path / "run"
    train(2, [*FAST, f"data.root={digits_root}", "max_steps=13", "target_top1=null",
              "checkpoint.every_epochs=null", "checkpoint.every_minutes=null"], run)
    assert [step_of(path) for path in complete_checkpoints(run)] == [13]
