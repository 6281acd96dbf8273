"""Fault injection under torchrun: lost ranks, half-written checkpoints, ranks that disagree,
non-finite values, bad data, bad configuration, a broken tracker, secrets in the environment.
Faults are planned with GFR_INJECT_FAULT (gradientflow_repro/faults.py); every run is short."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from PIL import Image

from gradientflow_repro.checkpoint import complete_checkpoints, find_resumable
from gradientflow_repro.tracking import read_records

from conftest import FAST, final_params, torchrun, train

COMMON = [*FAST, "global_batch_size=96", "epochs=3", "optim.warmup_epochs=1", "eval_every_epochs=1",
          "dist_timeout_s=30", "save_final_params=true"]


def _run(world: int, overrides: list[str], run_dir: Path, fault: str = "", **env: str):
    started = time.monotonic()
    result = torchrun(world, overrides, run_dir, check=False, timeout=180,
                      env={"GFR_INJECT_FAULT": fault, **env})
    return result, time.monotonic() - started


@pytest.mark.parametrize("where", ["forward", "comm", "checkpoint"])
def test_killed_rank_is_named_and_the_last_checkpoint_resumes(where: str, tmp_path: Path,
                                                              digits_root: Path) -> None:
    world = 3
    overrides = [*COMMON, f"data.root={digits_root}", "checkpoint.every_epochs=1"]
    # 15 steps per epoch: the first checkpoint is step 15; rank 1 dies at step 20 (or while
    # writing the checkpoint of step 30)
    step = 30 if where == "checkpoint" else 20
    result, seconds = _run(world, overrides, tmp_path, f"kill@{where}:rank=1:step={step}")
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert seconds < 30 + 60, f"took {seconds:.0f}s: detection must come within dist_timeout_s"
    assert "lost rank(s) [1]" in output, output[-4000:]
    # one line per survivor: the collective's traceback and Hydra's report would only repeat it
    assert "Error executing job" not in output and "a collective failed" in output, output[-4000:]
    frames = [line for line in output.splitlines() if line.strip().startswith('File "')]
    assert not any("gradientflow_repro" in frame for frame in frames), "\n".join(frames)
    for rank in (0, 2):
        lines = [line for line in output.splitlines() if line.startswith(f"error: rank {rank}:")]
        assert len(lines) <= 1 and all("lost rank(s) [1]" in line for line in lines), lines
    complete = complete_checkpoints(tmp_path)
    assert complete and int(complete[-1].name.split("_")[1]) == 15, complete
    if where == "checkpoint":
        assert (tmp_path / "checkpoints" / "step_000000030.tmp").is_dir()  # the half-written one
    assert find_resumable(tmp_path) == complete[-1]
    resumed, _ = _run(world, overrides, tmp_path)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert "at step 15" in resumed.stdout


def test_ranks_that_disagree_stop_the_job_naming_step_and_rank(tmp_path: Path, digits_root: Path) -> None:
    result, _ = _run(2, [*COMMON, f"data.root={digits_root}", "consistency_every_steps=2"], tmp_path,
                     "perturb@params:rank=1:step=4")
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "step 6: parameters differ between ranks: rank(s) [1]" in output, output[-3000:]


def test_non_finite_loss_in_bf16_stops_at_once_with_the_last_good_state(tmp_path: Path,
                                                                        digits_root: Path) -> None:
    result, _ = _run(2, [*COMMON, f"data.root={digits_root}", "precision=bf16"], tmp_path,
                     "nan@loss:rank=1:step=5")
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "step 6: gradients were non-finite on some rank for 1 step(s) in a row (bf16" in output, output[-3000:]
    saved = complete_checkpoints(tmp_path)[-1]
    assert saved.name == "step_000000006"
    model = torch.load(saved / "shared.pt", weights_only=True)["model"]
    assert all(torch.isfinite(t).all() for t in model.values() if t.is_floating_point())


def test_fp16_skips_single_overflows_and_stops_after_a_streak(tmp_path: Path, digits_root: Path) -> None:
    base = [*COMMON, f"data.root={digits_root}", "precision=fp16", "device=cpu", "max_nonfinite_steps=3",
            "max_steps=12"]
    single, _ = _run(2, base, tmp_path / "single", "nan@loss:rank=0:step=3")
    assert single.returncode == 0, (single.stdout + single.stderr)[-3000:]
    assert json.loads((tmp_path / "single" / "summary.json").read_text())["skipped_steps"] >= 1
    streak, _ = _run(2, base, tmp_path / "streak",
                     ",".join(f"nan@loss:rank=1:step={s}" for s in (5, 6, 7)))
    output = streak.stdout + streak.stderr
    assert streak.returncode != 0
    assert "step 8: gradients were non-finite on some rank for 3 step(s) in a row (fp16" in output, output[-3000:]


def _bad_copy(digits_root: Path, tmp_path: Path) -> tuple[Path, dict[str, Path]]:
    root = tmp_path / "digits"
    shutil.copytree(digits_root, root)
    first = sorted(sorted((root / "train").iterdir())[3].iterdir())
    rgb = Image.open(first[0]).convert("RGB")
    files = {"png": first[1], "cmyk": first[2], "gray": first[3], "truncated": first[4]}
    rgb.save(files["png"], format="PNG")  # PNG content behind a .JPEG name
    rgb.convert("CMYK").save(files["cmyk"], format="JPEG")
    rgb.convert("L").save(files["gray"], format="JPEG")
    data = first[4].read_bytes()
    files["truncated"].write_bytes(data[: len(data) // 2])
    return root, files


def test_bad_images_are_named_before_training_and_odd_ones_decode(tmp_path: Path, digits_root: Path) -> None:
    root, files = _bad_copy(digits_root, tmp_path)
    result, _ = _run(2, [*COMMON, f"data.root={root}", "max_steps=2"], tmp_path / "run")
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "1 image file(s) cannot be decoded" in output and str(files["truncated"]) in output, output[-3000:]
    assert "truncated" in output and not (tmp_path / "run" / "checkpoints").exists()
    files["truncated"].unlink()  # the PNG, CMYK and grayscale files are decoded as RGB
    fixed, _ = _run(2, [*COMMON, f"data.root={root}", "max_steps=2"], tmp_path / "fixed")
    assert fixed.returncode == 0, (fixed.stdout + fixed.stderr)[-3000:]


def test_unwritable_run_directory_is_a_clear_error_before_training(tmp_path: Path, digits_root: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    result, _ = _run(2, [*COMMON, f"data.root={digits_root}"], blocker / "run")
    output = result.stdout + result.stderr
    assert result.returncode != 0  # each rank exits 2; torchrun reports the failure
    assert "exitcode  : 2" in output and "config key 'run_dir'" in output and "cannot be created" in output, \
        output[-2000:]


def test_checkpoint_of_another_model_is_refused_before_training(tmp_path: Path, digits_root: Path) -> None:
    first, _ = _run(2, [*COMMON, f"data.root={digits_root}", "max_steps=2"], tmp_path)
    assert first.returncode == 0, (first.stdout + first.stderr)[-2000:]
    # past the run directory's configuration check (run_dir.py), which would refuse it first: the
    # checkpoint's own check, for a width accepted as a change or a checkpoint named by resume=<path>
    other, _ = _run(2, [*COMMON, f"data.root={digits_root}", "max_steps=4", "model.width=0.25",
                        "accept_config_change=[model.width]"], tmp_path)
    output = other.stdout + other.stderr
    assert other.returncode != 0
    assert "step_000000002 does not fit this model (alexnet_bn, width 0.25, 10 classes)" in output, output[-3000:]
    assert "size mismatch" in output and "[digits_cpu/allreduce] step" not in other.stdout  # no training


def test_broken_wandb_never_stops_training_and_secrets_stay_out(tmp_path: Path, digits_root: Path) -> None:
    secret = "sekrit-0123456789abcdef0123456789abcdef0123456789"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "wandb").write_text("a file where wandb wants its directory")
    result, _ = _run(2, [*COMMON, f"data.root={digits_root}", "logger=wandb", "logger.mode=online",
                         "max_steps=6", "logger.log_every=1"], run_dir,
                     WANDB_API_KEY=secret, WANDB_BASE_URL="http://127.0.0.1:9", HOME=str(tmp_path))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert output.count("UserWarning: wandb is off for this run") == 1, output[-3000:]
    steps = [r["step"] for r in read_records(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert secret not in output
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), f"{path} holds the API key"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "WANDB_API_KEY" not in summary["environment"] and "OMP_NUM_THREADS" in summary["environment"]


def test_rank_death_under_torchrun_leaves_finished_params_of_a_resumed_run_exact(tmp_path: Path,
                                                                                 digits_root: Path) -> None:
    """Nothing is lost: after a rank dies, resuming ends with the parameters of a run that never
    failed (deterministic CPU training)."""
    overrides = [*COMMON, f"data.root={digits_root}", "checkpoint.every_epochs=1", "deterministic=true"]
    train(2, overrides, tmp_path / "straight")
    failed, _ = _run(2, overrides, tmp_path / "failed", "kill@forward:rank=0:step=20")
    assert failed.returncode != 0
    resumed, _ = _run(2, overrides, tmp_path / "failed")
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    for rank in range(2):
        a, b = final_params(tmp_path / "straight", rank), final_params(tmp_path / "failed", rank)
        for key in a:
            assert torch.equal(a[key], b[key]), f"{key} differs on rank {rank}"


@pytest.mark.parametrize("frozen", [1, 0])
def test_a_rank_that_hangs_is_named_by_the_watchdog_before_any_timeout(frozen: int, tmp_path: Path,
                                                                        digits_root: Path) -> None:
    """Under NCCL a lost peer is a hang, not an error (collectives return before they finish, and
    NCCL's own watchdog aborts without a word). A frozen rank (SIGSTOP: its connections stay open, it
    answers nothing) is that hang here. Launched as ``srun`` does (one process per rank, the
    rendezvous store inside rank 0), the survivors name the frozen rank (or, when it is rank 0 and
    the store froze with it, say so) within ``watchdog_s``, long before ``dist_timeout_s``."""
    import os
    import signal
    import subprocess
    import sys

    from conftest import REPO, free_port

    world, port = 3, free_port()
    overrides = [o for o in COMMON if not o.startswith("dist_timeout_s")]
    overrides += [f"data.root={digits_root}", f"run_dir={tmp_path}", "dist_timeout_s=120", "watchdog_s=6"]
    processes = []
    started = time.monotonic()
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1", "GFR_INJECT_FAULT": f"freeze@comm:rank={frozen}:step=5"}
        processes.append(subprocess.Popen([sys.executable, "-m", "gradientflow_repro.train", *overrides],
                                          cwd=REPO, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
    try:
        survivors = [r for r in range(world) if r != frozen]
        outputs = {r: processes[r].communicate(timeout=100)[0] for r in survivors}
        seconds = time.monotonic() - started
    finally:
        for process in processes:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGKILL)
                process.wait()
    for rank in survivors:
        assert processes[rank].returncode == 1, outputs[rank][-3000:]
        expected = (f"lost rank(s) [{frozen}]" if frozen else
                    "rendezvous store is unreachable: rank 0 (which hosts it) is probably lost")
        assert expected in outputs[rank] and "no progress for" in outputs[rank], outputs[rank][-3000:]
        assert "in step 5" in outputs[rank], outputs[rank][-2000:]
    assert seconds < 90, f"took {seconds:.0f}s: the watchdog (6 s) must speak long before the 120 s timeout"


def test_an_error_every_rank_agrees_on_ends_with_one_line_and_no_traceback(tmp_path: Path,
                                                                           digits_root: Path) -> None:
    """A checkpoint that does not fit is the same error on every rank: the job ends with that one
    line and exit status 1, not with a traceback through the trainer."""
    first, _ = _run(2, [*COMMON, f"data.root={digits_root}", "max_steps=2"], tmp_path)
    assert first.returncode == 0, (first.stdout + first.stderr)[-2000:]
    result, _ = _run(2, [*COMMON, f"data.root={digits_root}", "model.width=0.25",
                         "accept_config_change=[model.width]"], tmp_path)  # past run_dir.py's check
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "exitcode  : 1" in output, output[-3000:]
    assert output.count("error: rank 0: CheckpointError") == 1, output[-3000:]
    frames = [line for line in output.splitlines() if line.strip().startswith('File "')]
    assert not any("gradientflow_repro" in frame for frame in frames), "\n".join(frames)


def test_a_vanished_rank_under_torchrun_ends_the_job_at_once_with_one_line_per_survivor(
        tmp_path: Path, digits_root: Path) -> None:
    """Rank 1 is killed while a child of it keeps its connections open (faults.py ``vanish``: to
    the others a hang, as a dead peer is under NCCL), with the 512-GPU experiments' timeouts
    (minutes). What torchrun's agent does by itself: it sees its worker die, sends the others
    SIGTERM (which the trainer takes for a stop request, to be agreed on at the next step that never
    comes) and SIGKILL 30 s later, and its summary names rank 1 as the root cause. (Across nodes no
    agent sees another node's workers: there the survivors' heartbeat watch names the rank within
    about 40 s, see tests/test_liveness.py.) No survivor prints a traceback or Hydra's error report."""
    overrides = [o for o in COMMON if not o.startswith("dist_timeout_s")]
    overrides += [f"data.root={digits_root}", "dist_timeout_s=600", "watchdog_s=300"]
    fired = tmp_path / "fired.jsonl"
    result, _ = _run(3, overrides, tmp_path / "run", "vanish@forward:rank=1:step=5", GFR_FAULT_LOG=str(fired))
    ended = time.time()
    output = result.stdout + result.stderr
    assert result.returncode != 0 and fired.exists(), output[-3000:]
    assert ended - json.loads(fired.read_text().splitlines()[0])["time"] < 90, output[-3000:]
    cause = output[output.index("Root Cause"):]
    assert "rank      : 1 (local_rank: 1)" in cause and "Signal 9 (SIGKILL)" in cause, output[-3000:]
    frames = [line for line in output.splitlines() if line.strip().startswith('File "')]
    assert not any("gradientflow_repro" in frame for frame in frames), "\n".join(frames)
    assert "Error executing job" not in output, output[-4000:]
    for rank in (0, 2):
        lines = [line for line in output.splitlines() if line.startswith(f"error: rank {rank}:")]
        assert len(lines) <= 1, lines
        if lines:  # a survivor stopped by the agent before its collective failed says nothing
            assert "lost rank(s) [1]" in lines[0], lines
