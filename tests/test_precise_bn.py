"""Precise BatchNorm for evaluation (``precise_bn.py``): the statistics an evaluation reads are those
of the kept training batches under the current weights; training never sees them (running statistics
and random generators as before); the kept batches survive a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from gradientflow_repro.precise_bn import PreciseBatchNorm
from gradientflow_repro.state import LocalBuffers

from conftest import FAST, train


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=0.5), nn.ReLU(), nn.Dropout(0.5),
                         nn.Flatten(), nn.Linear(4 * 6 * 6, 3))


def test_only_the_last_batches_of_each_epoch_are_kept() -> None:
    keeper, steps_per_epoch = PreciseBatchNorm(2), 5
    for step in range(8):  # epoch 0 whole, then 3 steps of epoch 1 (before its window)
        keeper.remember(torch.full((1,), float(step)), step, steps_per_epoch)
    assert [int(t) for t in keeper.kept] == [3, 4]
    for step in range(8, 10):  # epoch 1's window replaces epoch 0's
        keeper.remember(torch.full((1,), float(step)), step, steps_per_epoch)
    assert [int(t) for t in keeper.kept] == [8, 9]
    off = PreciseBatchNorm(0)
    off.remember(torch.zeros(1), 4, steps_per_epoch)
    assert off.kept == []


def test_evaluation_reads_the_kept_batches_statistics_under_the_current_weights() -> None:
    model, steps_per_epoch = small_model(), 4
    buffers, keeper = LocalBuffers(model, world_size=1), PreciseBatchNorm(2)
    batches = [torch.randn(5, 3, 8, 8) for _ in range(steps_per_epoch)]
    for step, images in enumerate(batches):
        model(images)  # training forwards: the running statistics follow with momentum 0.5
        keeper.remember(images, step, steps_per_epoch)
    with torch.no_grad():
        model[0].weight.mul_(3.0)  # a large update after the last training forward
    running, generator = buffers.state_dict(), torch.get_rng_state()
    features = [model[0](images) for images in batches[-2:]]
    mean = torch.stack([f.mean(dim=(0, 2, 3)) for f in features]).mean(0)
    var = torch.stack([f.var(dim=(0, 2, 3), unbiased=True) for f in features]).mean(0)
    with keeper.recomputed(model, buffers, _no_autocast):
        assert torch.allclose(model[1].running_mean, mean, atol=1e-5)
        assert torch.allclose(model[1].running_var, var, atol=1e-4)
        assert model.training  # the mode the caller had
    for before, after in zip(running, buffers.state_dict()):
        assert torch.equal(before, after), "training must get its own running statistics back"
    assert torch.equal(generator, torch.get_rng_state()), "dropout's draws must not move training's generator"
    assert keeper.kept == []  # used once
    with keeper.recomputed(model, buffers, _no_autocast):  # nothing kept: the running statistics
        assert torch.equal(model[1].running_mean, running[0])


def _no_autocast() -> torch.autocast:
    return torch.autocast("cpu", enabled=False)


def test_kept_batches_are_checkpointed_and_an_evaluation_after_a_resume_reads_them(
        tmp_path: Path, digits_root: Path) -> None:
    """Cut at step 9 of an 11-step epoch: two of the four kept batches are in the checkpoint."""
    world = 2
    common = [*FAST, f"data.root={digits_root}", "global_batch_size=128", "epochs=1",
              "optim.warmup_epochs=0.5", "precise_bn_batches=4", "save_final_params=true",
              "deterministic=true", "target_top1=null"]
    train(world, common, tmp_path / "straight")
    train(world, [*common, "max_steps=9"], tmp_path / "cut")
    for rank in range(world):
        saved = torch.load(tmp_path / "cut" / "checkpoints" / "step_000000009" / f"rank_{rank:05d}.pt",
                           weights_only=True)
        assert len(saved["precise_bn"]) == 2
    assert "resumed from" in train(world, common, tmp_path / "cut")
    straight = json.loads((tmp_path / "straight" / "summary.json").read_text())
    cut = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert straight["final_top1"] == cut["final_top1"]
