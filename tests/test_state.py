"""The train state: Stateful parts under their on-disk keys; checkpoints from before the format key
still load, other formats and other models are refused with a message; the run summary's keys."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from gradientflow_repro import checkpoint
from gradientflow_repro.checkpoint import CheckpointError
from gradientflow_repro.state import (
    FORMAT,
    TrainingProgress,
    TrainState,
)

from support import make_state


def train_a_little(model: nn.Module, state: TrainState, progress: TrainingProgress) -> None:
    optimizer = state.shared["optimizer"]
    for _ in range(3):
        model(torch.randn(8, 3)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        progress.stepped(0.5)
    progress.last_top1 = progress.best_top1 = 42.0


def test_a_saved_state_restores_every_part(tmp_path: Path) -> None:
    state, model, progress, run = make_state()
    train_a_little(model, state, progress)
    run["wandb_id"] = "abc123"
    state.save(tmp_path, progress.step, keep=2)
    expected_rng = torch.get_rng_state()
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    fresh, fresh_model, fresh_progress, fresh_run = make_state()
    torch.manual_seed(1234)
    assert fresh.resume(tmp_path, "auto") == tmp_path / "checkpoints" / "step_000000003"
    assert all(torch.equal(fresh_model.state_dict()[k], v) for k, v in expected.items())
    assert torch.equal(torch.get_rng_state(), expected_rng) and fresh_run["wandb_id"] == "abc123"
    assert (fresh_progress.step, fresh_progress.best_top1) == (3, 42.0)
    assert fresh_progress.train_s == pytest.approx(1.5)  # the training clock continues
    momentum = [s["momentum_buffer"] for s in state.shared["optimizer"].state_dict()["state"].values()]
    restored = [s["momentum_buffer"] for s in fresh.shared["optimizer"].state_dict()["state"].values()]
    assert all(torch.equal(a, b) for a, b in zip(momentum, restored, strict=True))
    assert fresh.resume(tmp_path, "never") is None


def test_on_disk_keys_are_those_of_format_1(tmp_path: Path) -> None:
    state, *_ = make_state()
    path = state.save(tmp_path, 0, keep=1)
    shared, mine = checkpoint.load_checkpoint(path, 0, 1)
    assert FORMAT == 1 and shared["format"] == 1
    assert set(shared) == {"format", "model_name", "model", "optimizer", "wandb_id", "progress"}
    assert set(mine) == {"buffers", "torch_rng", "cuda_rng"}
    # eval_pending: added within format 1 (older checkpoints lack it and load as False; older code
    # reading a newer checkpoint ignores it)
    assert set(shared["progress"]) == {"step", "mlperf_s", "train_s", "eval_s", "startup_s", "init_s",
                                       "last_top1", "best_top1", "reached_at", "comm_totals", "eval_pending"}


def test_progress_from_before_eval_pending_loads_with_no_evaluation_pending() -> None:
    from gradientflow_repro.state import TrainingProgress

    progress = TrainingProgress()
    progress.eval_pending = True
    old = {key: value for key, value in TrainingProgress().state_dict().items() if key != "eval_pending"}
    progress.load_state_dict(old)
    assert progress.eval_pending is False


def test_a_checkpoint_written_before_the_format_key_still_loads(tmp_path: Path) -> None:
    state, model, progress, _ = make_state()
    train_a_little(model, state, progress)
    shared = state.shared_state()
    del shared["format"]  # as the trainer wrote them before
    path = checkpoint.save_checkpoint(tmp_path, 3, shared, state.rank_state(), rank=0, world_size=1,
                                      barrier=lambda: None, keep=1)
    fresh, fresh_model, fresh_progress, _ = make_state()
    fresh.load(path)
    assert fresh_progress.step == 3
    assert all(torch.equal(fresh_model.state_dict()[k], v) for k, v in model.state_dict().items())


def test_a_checkpoint_as_the_previous_writer_laid_it_out_still_loads(tmp_path: Path) -> None:
    """Files from plain ``torch.save``, hashed afterwards, and a manifest without ``bytes``: the
    layout before ranks hashed their own files while writing them."""
    import hashlib
    import json

    state, model, progress, _ = make_state()
    train_a_little(model, state, progress)
    path = tmp_path / "checkpoints" / "step_000000003"
    path.mkdir(parents=True)
    torch.save(state.shared_state(), path / "shared.pt")
    torch.save(state.rank_state(), path / "rank_00000.pt")
    digests = {name: hashlib.sha256((path / name).read_bytes()).hexdigest() for name in ("rank_00000.pt", "shared.pt")}
    (path / "manifest.json").write_text(json.dumps({"step": 3, "world_size": 1, "sha256": digests}, indent=1))
    fresh, fresh_model, fresh_progress, _ = make_state()
    assert fresh.resume(tmp_path, "auto") == path and fresh_progress.step == 3
    assert all(torch.equal(fresh_model.state_dict()[k], v) for k, v in model.state_dict().items())
    (path / "manifest.json").write_text(json.dumps({"step": 3, "ranks": 1}))
    with pytest.raises(CheckpointError, match="manifest.json is not a manifest of this checkpoint format"):
        make_state()[0].load(path)


def test_another_format_is_refused_naming_it(tmp_path: Path) -> None:
    state, *_ = make_state()
    path = checkpoint.save_checkpoint(tmp_path, 1, {**state.shared_state(), "format": 7}, state.rank_state(),
                                      rank=0, world_size=1, barrier=lambda: None, keep=1)
    with pytest.raises(CheckpointError, match="step_000000001 is in checkpoint format 7; this code reads format 1"):
        make_state()[0].load(path)


def test_another_model_is_refused_naming_it(tmp_path: Path) -> None:
    state, *_ = make_state()
    state.save(tmp_path, 1, keep=1)
    with pytest.raises(CheckpointError, match="step_000000001 holds a tiny model, the config asks for other"):
        make_state(name="other")[0].resume(tmp_path, "auto")
    with pytest.raises(CheckpointError, match=r"step_000000001 does not fit this model \(tiny, width 8\): "
                                              r"size mismatch .*; use resume=never or another run_dir"):
        make_state(width=8)[0].resume(tmp_path, "auto")


def test_the_run_summary_keeps_its_keys() -> None:
    from gradientflow_repro.tracking import run_summary

    cfg = SimpleNamespace(experiment="digits_cpu", comm=SimpleNamespace(strategy="ring"),
                          precision=SimpleNamespace(dtype="fp32"), global_batch_size=64, target_top1=90.0)
    progress = TrainingProgress()
    progress.start_clock(init_s=0.0)
    progress.stepped(2.0)
    progress.reached_at = {"step": 1, "mlperf_s": 3.0, "train_s": 2.0}
    world = SimpleNamespace(world_size=2, local_world_size=2, source="torchrun")
    summary = run_summary(cfg, progress, world=world, device="cpu", steps_per_epoch=4, skipped_steps=0,
                          stopped_by="", exit_code=0, run_id=None)
    assert list(summary)[:25] == [
        "name", "experiment", "strategy", "world_size", "device", "precision", "global_batch_size", "steps",
        "epochs", "target_top1", "reached_target", "time_to_target_mlperf_s", "time_to_target_train_s",
        "final_top1", "best_top1", "mlperf_s", "train_s", "images_per_s", "bytes_per_step",
        "collectives_per_step", "sync_wait_s_per_step", "skipped_steps", "stopped_by", "exit_code",
        "wandb_run_id"]
    assert {"clock_policy", "command", "environment", "git_commit", "torch", "cpu", "gpu"} <= set(summary)
    assert summary["name"] == "digits_cpu/ring" and summary["images_per_s"] == 32.0
    assert summary["time_to_target_train_s"] == 2.0 and summary["stopped_by"] is None
    assert summary["command"].startswith("torchrun --nnodes=1 --nproc-per-node=2 -m gradientflow_repro.train")


class _Kept:
    """A per-rank part added after checkpoints were written; ``absent_from_checkpoint`` lets it start
    without its state when ``optional``."""

    rank_rule = "own"

    def __init__(self, optional: bool) -> None:
        self.kept, self.started_fresh = [torch.ones(2)], False
        if optional:
            self.absent_from_checkpoint = self._fresh

    def _fresh(self) -> None:
        self.kept, self.started_fresh = [], True

    def state_dict(self) -> list:
        return self.kept

    def load_state_dict(self, kept: list) -> None:
        self.kept = kept

    def reseed(self, seed: int) -> None:
        self.kept = []


@pytest.mark.parametrize("old_world", [1, 2])
def test_a_part_added_since_the_checkpoint_starts_fresh_or_is_refused_naming_it(tmp_path: Path,
                                                                               old_world: int) -> None:
    """A checkpoint written before a per-rank part existed (as before precise BatchNorm's kept
    batches), on the same number of ranks and on another: the part starts fresh where it says it
    can, else the resume is refused naming the part."""
    import hashlib
    import json

    state, model, progress, _ = make_state()
    train_a_little(model, state, progress)
    path = tmp_path / "checkpoints" / "step_000000003"
    path.mkdir(parents=True)
    torch.save(state.shared_state(), path / "shared.pt")
    names = ["shared.pt"]
    for rank in range(old_world):
        torch.save(state.rank_state(), path / f"rank_{rank:05d}.pt")
        names.append(f"rank_{rank:05d}.pt")
    digests = {name: hashlib.sha256((path / name).read_bytes()).hexdigest() for name in names}
    (path / "manifest.json").write_text(json.dumps({"step": 3, "world_size": old_world, "sha256": digests}))

    fresh, fresh_model, fresh_progress, _ = make_state()
    fresh.per_rank["kept"] = part = _Kept(optional=True)
    assert fresh.resume(tmp_path, "auto") == path and fresh_progress.step == 3
    assert part.started_fresh and part.kept == []
    assert all(torch.equal(fresh_model.state_dict()[k], v) for k, v in model.state_dict().items())

    refusing = make_state()[0]
    refusing.per_rank["kept"] = _Kept(optional=False)
    with pytest.raises(CheckpointError, match=r"has no 'kept' .*written before this code's 'kept' existed"):
        refusing.resume(tmp_path, "auto")
