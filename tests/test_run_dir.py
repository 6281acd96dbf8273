"""A run directory belongs to one run (gradientflow_repro/run_dir.py): another configuration is
refused before any process group starts, ``resume=never`` sets an earlier run aside instead of
mixing with it, a second job is refused naming the first, leftovers of interrupted saves are tidied,
and a run whose checkpoints are all damaged stops instead of starting again from step 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from gradientflow_repro import checkpoint, run_dir
from gradientflow_repro.checkpoint import CheckpointError, complete_checkpoints
from gradientflow_repro.run_dir import RunDirError, claim, claimed

from conftest import FAST, REPO, torchrun, torchrun_command

CONFIG = {"experiment": "x", "seed": 0, "epochs": 6, "run_dir": "r", "resume": "auto",
          "optim": {"base_lr": 0.125, "momentum": 0.9}, "logger": {"log_every": 10},
          "data": {"root": "/a", "image_size": 32}, "accept_config_change": []}


def _with(**changes: object) -> dict:
    config = json.loads(json.dumps(CONFIG))
    for key, value in changes.items():
        *parents, last = key.split("__")
        node = config
        for parent in parents:
            node = node[parent]
        node[last] = value
    return config


def _claim(path: Path, config: dict, resume: str = "auto", accepted: tuple = (), rank: int = 0) -> run_dir.Claim:
    owned = claim(path, config, resume=resume, accepted=list(accepted), rank=rank)
    owned.release()
    return owned


def test_another_configuration_is_refused_naming_the_keys_and_the_ways_out(tmp_path: Path) -> None:
    _claim(tmp_path, CONFIG)
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["config"]["optim.base_lr"] == 0.125 and "epochs" not in record["config"]
    # what may change on a resume changes nothing
    _claim(tmp_path, _with(epochs=9, logger__log_every=1, data__root="/b", resume="auto"))
    for rank in (0, 1):  # every rank refuses, before any process group
        with pytest.raises(RunDirError, match=r"optim\.base_lr: 0\.125 there, 0\.5 now.*run_dir=.*"
                                              r"accept_config_change=\[optim\.base_lr\]"):
            _claim(tmp_path, _with(optim__base_lr=0.5), rank=rank)
    assert not (tmp_path / "run.lock").exists()  # a refused run leaves no lock behind
    said = _claim(tmp_path, _with(optim__base_lr=0.5), accepted=("optim.base_lr",)).said
    assert any("optim.base_lr: 0.125 -> 0.5" in line for line in said)
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["config"]["optim.base_lr"] == 0.5
    assert record["changes"][-1]["accepted"] == {"optim.base_lr": [0.125, 0.5]}
    _claim(tmp_path, _with(optim__base_lr=0.5))  # the run goes on under the new fingerprint


def test_a_key_added_since_the_run_was_recorded_is_no_difference(tmp_path: Path) -> None:
    _claim(tmp_path, CONFIG)
    _claim(tmp_path, _with(optim__new_knob=3))


def test_a_directory_from_before_fingerprints_is_compared_with_its_config_yaml_and_adopted(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    (tmp_path / "checkpoints" / "step_000000010").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(CONFIG), tmp_path / "config.yaml")
    with pytest.raises(RunDirError, match=r"\(config\.yaml\): seed: 0 there, 1 now"):
        _claim(tmp_path, _with(seed=1))
    said = _claim(tmp_path, CONFIG).said
    assert any("written before run fingerprints: adopted" in line for line in said)
    assert (tmp_path / "run.json").exists()


def test_resume_never_moves_the_earlier_run_aside_under_a_printed_name(tmp_path: Path) -> None:
    _claim(tmp_path, CONFIG)
    (tmp_path / "checkpoints" / "step_000000066").mkdir(parents=True)
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    said = _claim(tmp_path, _with(optim__base_lr=0.5), resume="never").said  # any configuration
    moved = Path(said[-1].rsplit(" moved to ", 1)[1])
    assert moved.parent == tmp_path / "superseded"
    assert (moved / "checkpoints" / "step_000000066").is_dir() and (moved / "metrics.jsonl").exists()
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.jsonl").exists()
    assert json.loads((tmp_path / "run.json").read_text())["config"]["optim.base_lr"] == 0.5


def test_a_second_job_is_refused_naming_the_first_and_a_stale_lock_is_taken_over(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "111")
    with claimed(tmp_path, CONFIG, resume="auto", accepted=[], rank=0):
        held = json.loads((tmp_path / "run.lock").read_text())
        assert held["job"] == "slurm job 111" and held["pid"] == os.getpid()
        monkeypatch.setenv("SLURM_JOB_ID", "222")
        with pytest.raises(RunDirError, match=r"in use by slurm job 111 \(host .*, pid \d+"):
            _claim(tmp_path, CONFIG)
        monkeypatch.setenv("SLURM_JOB_ID", "111")  # the same job, requeued: its own lock
        assert any("this job's own" in line for line in _claim(tmp_path, CONFIG).said)
    assert not (tmp_path / "run.lock").exists()  # released at the end
    # a lock whose process on this host is gone
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "run.lock").write_text(json.dumps({"job": "slurm job 9", "host": run_dir.Lock(tmp_path).host,
                                                   "pid": dead.pid, "started": "then"}))
    monkeypatch.setenv("SLURM_JOB_ID", "333")
    said = _claim(tmp_path, CONFIG).said
    assert any("stale lock of slurm job 9" in line and f"process {dead.pid} on this host is gone" in line
               for line in said)
    # a lock on another host, not refreshed for longer than LOCK_STALE_S
    (tmp_path / "run.lock").write_text(json.dumps({"job": "slurm job 8", "host": "elsewhere", "pid": 1}))
    old = time.time() - run_dir.LOCK_STALE_S - 5
    os.utime(tmp_path / "run.lock", (old, old))
    assert any("last refreshed" in line for line in _claim(tmp_path, CONFIG).said)


def test_leftovers_of_interrupted_saves_are_tidied_and_an_interrupted_resave_put_back(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for name in ("step_000000010", "step_000000020.tmp", "step_000000030.old", "step_000000010.old"):
        (root / name).mkdir(parents=True)
        (root / name / "manifest.json").write_text("{}")
    said = _claim(tmp_path, CONFIG).said
    assert sorted(p.name for p in root.iterdir()) == ["step_000000010", "step_000000030"]
    assert any("step_000000020.tmp" in line for line in said)


def _save(path: Path, step: int, value: float) -> None:
    checkpoint.save_checkpoint(path, step, {"w": torch.tensor(value)}, {"r": torch.tensor(value)}, rank=0,
                               world_size=1, barrier=lambda: None, keep=3)


def test_a_step_saved_again_is_never_missing_between_the_two_copies(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    _save(tmp_path, 5, 1.0)
    renames = []
    real_rename = os.rename

    def crash_on_the_second(src: str, dst: str) -> None:
        renames.append(dst)
        if len(renames) == 2:
            raise KeyboardInterrupt  # the process dies between the two renames
        real_rename(src, dst)

    monkeypatch.setattr(checkpoint.os, "rename", crash_on_the_second)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 5, 2.0)
    monkeypatch.setattr(checkpoint.os, "rename", real_rename)
    checkpoint.tidy(tmp_path)  # what the next start does
    final = tmp_path / "checkpoints" / "step_000000005"
    assert checkpoint.verify(final) and checkpoint.load_checkpoint(final, 0, 1)[0]["w"] == 1.0


def test_a_manifest_of_wrong_types_is_skipped_with_a_warning(tmp_path: Path) -> None:
    _save(tmp_path, 1, 1.0)
    _save(tmp_path, 2, 2.0)
    manifest = tmp_path / "checkpoints" / "step_000000002" / "manifest.json"
    record = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**record, "sha256": ["x"]}))
    with pytest.warns(UserWarning, match=r"skipping damaged checkpoint .*step_000000002.*wrong type"):
        found = checkpoint.find_resumable(tmp_path)
    assert found.name == "step_000000001"


def test_checkpoints_that_all_fail_verification_stop_the_run_naming_each(tmp_path: Path) -> None:
    _save(tmp_path, 1, 1.0)
    _save(tmp_path, 2, 2.0)
    for path in complete_checkpoints(tmp_path):
        with open(path / "rank_00000.pt", "r+b") as handle:
            handle.truncate(10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointError, match=r"step_000000002: .*checksum.*step_000000001: .*resume=never"):
            checkpoint.find_resumable(tmp_path)
    assert checkpoint.find_resumable(tmp_path / "empty") is None  # no checkpoint at all: a fresh start


def _write_fails_on_rank_1(rank: int, world: int, run: str, out: str) -> None:
    import errno

    from gradientflow_repro.checkpoint import Group

    group = Group()
    checkpoint.save_checkpoint(Path(run), 1, {"w": torch.ones(1)} if rank == 0 else None,
                               {"r": torch.ones(3)}, rank=rank, world_size=world, barrier=group.barrier,
                               keep=3, group=group)
    if rank == 1:
        real = checkpoint._save_file

        def full_disk(obj: object, path: Path, step: int = -1) -> tuple[str, int]:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))

        checkpoint._save_file = full_disk
    try:
        checkpoint.save_checkpoint(Path(run), 2, {"w": torch.ones(1)} if rank == 0 else None,
                                   {"r": torch.ones(3)}, rank=rank, world_size=world, barrier=group.barrier,
                                   keep=3, group=group)
        message = ""
    except CheckpointError as error:
        message = str(error)
    finally:
        if rank == 1:
            checkpoint._save_file = real
    torch.save({"message": message}, Path(out) / f"rank{rank}.pt")


@pytest.mark.parametrize("world", [2, 3])
def test_a_write_error_on_one_rank_is_agreed_by_every_rank_naming_it(world: int, tmp_path: Path) -> None:
    from conftest import spawn

    spawn(_write_fails_on_rank_1, world, str(tmp_path / "run"), str(tmp_path), timeout_s=30)
    for rank in range(world):
        message = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)["message"]
        assert "checkpoint of step 2 not written: rank 1: cannot write" in message, f"rank {rank}: {message}"
        assert "No space left on device" in message and "step_000000001, intact" in message
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step_000000001"]


# ---------------------------------------------------------------- the defects as users met them
RUN = [*FAST, "global_batch_size=96", "optim.warmup_epochs=1", "target_top1=null", "checkpoint.every_epochs=1",
       "logger.log_every=15", "data.loader=torchvision", "data.reader_workers=0"]


def test_resume_never_sets_the_old_run_aside_and_another_configuration_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    torchrun(2, [*RUN, "epochs=2"], run)  # 15 steps an epoch: checkpoints 15 and 30
    second = torchrun(2, [*RUN, "epochs=1", "resume=never"], run)
    assert "resume=never: the earlier run" in second.stdout
    assert [p.name for p in complete_checkpoints(run)] == ["step_000000015"]  # not pruned for the old 30
    refused = torchrun(2, [*RUN, "epochs=2", "optim.base_lr=0.5"], run, check=False)
    assert refused.returncode != 0
    assert "error: run_dir" in refused.stderr and "optim.base_lr" in refused.stderr
    assert "rank 0/2" not in refused.stdout  # refused before the process group
    third = torchrun(2, [*RUN, "epochs=2"], run)  # the new run continues, not the old one
    assert "resumed from" in third.stdout and "step_000000015 at step 15" in third.stdout, third.stdout[-2000:]


def test_a_second_job_in_a_run_dir_in_use_is_refused_naming_the_first(tmp_path: Path) -> None:
    import signal

    from conftest import for_this_cpu

    run, overrides = tmp_path / "run", [*RUN, "epochs=30"]
    command, env = torchrun_command(1, overrides, run)
    first = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (run / "run.lock").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        second = subprocess.run([sys.executable, "-m", "gradientflow_repro.train", f"run_dir={run}",
                                 *for_this_cpu(overrides)], cwd=REPO, env=env, capture_output=True, text=True,
                                timeout=120)
        assert second.returncode == 2, second.stderr[-2000:]
        holder = json.loads((run / "run.lock").read_text())
        assert "is in use by torchrun at 127.0.0.1:" in second.stderr and f"pid {holder['pid']}" in second.stderr
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=60)


def test_faults_planned_without_the_tests_permission_are_ignored_and_said(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "GFR_ALLOW_FAULTS"}
    env |= {"GFR_INJECT_FAULT": "kill@forward:rank=0:step=2", "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    done = subprocess.run([sys.executable, "-m", "gradientflow_repro.train", f"run_dir={tmp_path / 'run'}",
                           *RUN, "max_steps=3", "precision=fp32"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "GFR_INJECT_FAULT='kill@forward:rank=0:step=2' is set but ignored" in done.stdout


def test_checkpoints_newer_than_the_one_resumed_are_set_aside_not_pruned_over_the_new_run(tmp_path: Path) -> None:
    from gradientflow_repro.state import TrainingProgress, TrainState

    def state() -> TrainState:
        return TrainState(shared={"progress": TrainingProgress()}, per_rank={}, rank=0, world_size=1,
                          device=torch.device("cpu"))

    first = state()
    for step in (1, 2, 3):
        first.progress = first.shared["progress"]
        first.shared["progress"].step = step
        first.save(tmp_path, step, keep=3)
    resumed = state()  # resume=<older path>: a lineage abandoned from step 1 on
    resumed.resume(tmp_path, str(tmp_path / "checkpoints" / "step_000000001"))
    assert "moved 2 checkpoint(s) newer than step 1" in resumed.set_aside
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_000000001"]
    for step in (2, 3):  # the new lineage: nothing of the old one is pruned in its favour
        resumed.shared["progress"].step = step
        resumed.save(tmp_path, step, keep=3)
    with open(tmp_path / "checkpoints" / "step_000000003" / "shared.pt", "r+b") as handle:
        handle.truncate(10)
    again = state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert again.resume(tmp_path, "auto").name == "step_000000002"  # the damaged newest is set aside
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_000000001", "step_000000002"]
    assert len(list((tmp_path / "superseded").iterdir())) == 2


def test_a_file_written_atomically_is_the_old_one_or_the_new_one_whole(tmp_path: Path) -> None:
    target = tmp_path / "summary.json"
    run_dir.write_text_atomically(target, '{"old": 1}\n')

    def torn(handle) -> None:  # noqa: ANN001 - a binary file
        handle.write(b'{"new": ')
        raise OSError("No space left on device")

    with pytest.raises(OSError):
        run_dir.write_atomically(target, torn)
    assert target.read_text() == '{"old": 1}\n' and [p.name for p in tmp_path.iterdir()] == ["summary.json"]
