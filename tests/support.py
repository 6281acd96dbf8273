"""Helpers that several test modules share (the multi-process and training helpers are conftest's;
the communication tests' rank workers, comm_workers')."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from gradientflow_repro.cluster import netemu
from gradientflow_repro.state import (
    LocalBuffers,
    ModelName,
    ModelWeights,
    TrainingProgress,
    TrainState,
    Value,
    rng_parts,
)


def make_state(width: int = 4, name: str = "tiny") -> tuple[TrainState, nn.Module, TrainingProgress, dict]:
    """A one-rank train state as the trainer builds it, of a small model named ``name`` (the model
    check compares it) with ``width`` features; returns the state, its model, its progress, and the
    run record its wandb id is kept in."""
    model = nn.Sequential(nn.Linear(3, width), nn.BatchNorm1d(width))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    progress = TrainingProgress()
    progress.start_clock(init_s=0.0)
    run = {"wandb_id": None}
    state = TrainState(
        shared={"model_name": ModelName(name), "model": ModelWeights(model, f"{name}, width {width}"),
                "optimizer": optimizer, "wandb_id": Value(lambda: run["wandb_id"], lambda v: run.update(wandb_id=v)),
                "progress": progress},
        per_rank={"buffers": LocalBuffers(model, 1), **rng_parts(torch.device("cpu"))},
        rank=0, world_size=1, device=torch.device("cpu"))
    return state, model, progress, run


def needs_netemu() -> None:
    """Skip the calling test where the emulated network cannot be built (``netemu.why_unavailable``
    says why), or fail it under ``REQUIRE_NETEMU_TESTS=1``, as CI sets it: there it must not skip."""
    reason = netemu.why_unavailable()
    if reason:
        if os.environ.get("REQUIRE_NETEMU_TESTS") == "1":
            pytest.fail(f"REQUIRE_NETEMU_TESTS=1 but {reason}")
        pytest.skip(reason)


def process_group(pgid: int) -> list[int]:
    """The processes of process group ``pgid``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                found.append(int(entry.name))
        except OSError:
            pass
    return found
