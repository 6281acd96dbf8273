"""Checkpoints: atomic directories, checksums, damaged ones skipped with a warning."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gradientflow_repro import checkpoint


def save(run: Path, step: int, value: float, keep: int = 3) -> Path:
    return checkpoint.save_checkpoint(run, step, {"w": torch.full((3,), value)}, {"r": step},
                                      rank=0, world_size=1, barrier=lambda: None, keep=keep)


def test_latest_complete_checkpoint_is_found_and_loaded(tmp_path: Path) -> None:
    save(tmp_path, 5, 1.0)
    save(tmp_path, 10, 2.0)
    (tmp_path / "checkpoints" / "step_000000015.tmp").mkdir()  # a write that never finished
    latest = checkpoint.find_resumable(tmp_path)
    assert latest.name == "step_000000010"
    shared, mine = checkpoint.load_checkpoint(latest, rank=0, world_size=1)
    assert torch.equal(shared["w"], torch.full((3,), 2.0)) and mine == {"r": 10}


def test_only_the_last_k_are_kept(tmp_path: Path) -> None:
    for step in range(1, 6):
        save(tmp_path, step, float(step), keep=2)
    assert [p.name for p in checkpoint.complete_checkpoints(tmp_path)] == ["step_000000004", "step_000000005"]


def test_corrupted_checkpoint_is_skipped_with_a_warning_naming_it(tmp_path: Path) -> None:
    save(tmp_path, 1, 1.0)
    bad = save(tmp_path, 2, 2.0)
    with open(bad / "shared.pt", "r+b") as handle:
        handle.truncate(10)
    with pytest.warns(UserWarning, match="step_000000002"):
        assert checkpoint.find_resumable(tmp_path).name == "step_000000001"


def test_checkpoint_from_another_world_size_is_refused(tmp_path: Path) -> None:
    path = save(tmp_path, 3, 1.0)
    with pytest.raises(checkpoint.CheckpointError, match="written by 1 ranks, this job has 4"):
        checkpoint.load_checkpoint(path, rank=0, world_size=4)

