"""Real multi-process training: torchrun with gloo ranks on this machine, the actual entry point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import FAST, final_params, torchrun
from gradientflow_repro.tracking import read_records


def params_only(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if "running" not in k and "num_batches" not in k}


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_end_with_identical_parameters_and_full_results(world: int, tmp_path: Path,
                                                              digits_root: Path) -> None:
    run = tmp_path / "run"
    torchrun(world, [*FAST, f"data.root={digits_root}", "global_batch_size=64", "epochs=1",
                     "optim.warmup_epochs=0.5", "eval_every_epochs=1", "save_final_params=true",
                     "logger=wandb", "logger.mode=offline", "logger.log_every=5"], run)
    reference = params_only(final_params(run, 0))
    for rank in range(1, world):
        other = params_only(final_params(run, rank))
        assert all(torch.equal(reference[k], other[k]) for k in reference), f"rank {rank} differs"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == world and summary["steps"] == 1442 // 64
    for key in ("time_to_target_mlperf_s", "time_to_target_train_s", "final_top1", "images_per_s",
                "git_commit", "torch", "cpu", "bytes_per_step", "sync_wait_s_per_step"):
        assert key in summary
    assert 0 < summary["final_top1"] <= 100 and summary["images_per_s"] > 0
    records = read_records(run / "metrics.jsonl")
    assert [r["kind"] for r in records if r["kind"] == "eval"] == ["eval"]
    assert sum(r["kind"] == "train" for r in records) >= 4
    assert all(r["collectives_per_step"] > 0 for r in records if r["kind"] == "train")
    assert (run / "top1_vs_time.png").stat().st_size > 1000
    assert list((run / "wandb").glob("offline-run-*")), "no offline wandb run was written"


@pytest.mark.parametrize("world", [2, 4])
def test_allreduce_and_ddp_leave_the_same_parameters(world: int, tmp_path: Path,
                                                     digits_root: Path) -> None:
    # K=3 steps: the two sum gradients in different orders (per tensor vs 25 MB buckets), and over
    # more steps max-pool ties on the digits' black background turn rounding into different routes.
    common = [*FAST, f"data.root={digits_root}", "global_batch_size=64", "epochs=1",
              "optim.warmup_epochs=0.5", "max_steps=3", "precision=fp32", "save_final_params=true"]
    torchrun(world, [*common, "comm=allreduce"], tmp_path / "allreduce")
    torchrun(world, [*common, "comm=ddp"], tmp_path / "ddp")
    for rank in range(world):
        a = params_only(final_params(tmp_path / "allreduce", rank))
        b = params_only(final_params(tmp_path / "ddp", rank))
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-6, msg=f"{key} rank {rank}")
    ddp_summary = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    assert ddp_summary["bytes_per_step"] > 0  # DDP's buckets were counted by the comm hook


def test_interrupted_run_resumes_to_exactly_the_same_parameters(tmp_path: Path, digits_root: Path) -> None:
    world = 2
    common = [*FAST, f"data.root={digits_root}", "global_batch_size=128", "epochs=2",
              "optim.warmup_epochs=1", "eval_every_epochs=1", "save_final_params=true",
              "deterministic=true"]
    torchrun(world, common, tmp_path / "straight")
    torchrun(world, [*common, "max_steps=15"], tmp_path / "cut")  # stops mid-epoch 2, checkpoints
    assert (tmp_path / "cut" / "checkpoints" / "step_000000015").is_dir()
    resumed = torchrun(world, common, tmp_path / "cut")
    assert "resumed from" in resumed.stdout and "at step 15" in resumed.stdout
    for rank in range(world):
        a, b = final_params(tmp_path / "straight", rank), final_params(tmp_path / "cut", rank)
        assert a.keys() == b.keys()
        for key in a:  # buffers too: per-rank BatchNorm statistics are restored per rank
            assert torch.equal(a[key], b[key]), f"{key} differs on rank {rank}"
    straight = json.loads((tmp_path / "straight" / "summary.json").read_text())
    cut = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert straight["final_top1"] == cut["final_top1"] and cut["steps"] == straight["steps"] == 22
