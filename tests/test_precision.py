"""Mixed precision: fp16 overflow on one rank skips the step on every rank; autocast per device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from gradientflow_repro.config import PrecisionConfig
from gradientflow_repro.precision import Precision

from conftest import requires_cuda, spawn


def _overflow_on_one_rank(rank: int, world: int, out: str) -> None:
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    precision = Precision(PrecisionConfig(dtype="fp16", init_scale=1024.0), torch.device("cpu"))
    before = [p.detach().clone() for p in model.parameters()]
    with precision.autocast():
        loss = model(torch.randn(4, 6)).float().sum()
    precision.backward(loss)
    if rank == world - 1:
        model.weight.grad[0, 0] = float("inf")  # only the last rank overflows
    stepped = precision.step(optimizer)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # a finite step next: everyone steps
    with precision.autocast():
        loss = model(torch.randn(4, 6)).float().sum()
    precision.backward(loss)
    stepped_again = precision.step(optimizer)
    torch.save({"stepped": stepped, "unchanged": unchanged, "scale": precision.loss_scale,
                "skipped": precision.skipped_steps, "stepped_again": stepped_again},
               Path(out) / f"rank{rank}.pt")


@pytest.mark.parametrize("world", [2, 3])
def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(world: int, tmp_path: Path) -> None:
    spawn(_overflow_on_one_rank, world, str(tmp_path))
    for rank in range(world):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert result["stepped"] is False and result["unchanged"], f"rank {rank} stepped"
        assert result["scale"] == 512.0 and result["skipped"] == 1  # backed off once, everywhere
        assert result["stepped_again"] is True


def test_bf16_autocast_on_cpu_and_no_scaler() -> None:
    precision = Precision(PrecisionConfig(dtype="bf16"), torch.device("cpu"))
    assert precision.scaler is None and precision.loss_scale == 1.0
    with precision.autocast():
        out = nn.Linear(4, 4)(torch.randn(2, 4))
    assert out.dtype == torch.bfloat16


def test_nonfinite_step_without_scaler_is_skipped() -> None:
    model = nn.Linear(2, 2)
    precision = Precision(PrecisionConfig(dtype="fp32"), torch.device("cpu"))
    model(torch.randn(1, 2)).sum().backward()
    model.bias.grad[0] = float("nan")
    before = model.weight.detach().clone()
    assert precision.step(torch.optim.SGD(model.parameters(), lr=1.0)) is False
    assert torch.equal(before, model.weight) and precision.skipped_steps == 1


@requires_cuda()
def test_fp16_with_grad_scaler_on_cuda() -> None:
    device = torch.device("cuda")
    model = nn.Linear(64, 10).to(device)
    precision = Precision(PrecisionConfig(dtype="fp16"), device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with precision.autocast():
        out = model(torch.randn(8, 64, device=device))
    assert out.dtype == torch.float16
    precision.backward(nn.functional.cross_entropy(out.float(), torch.randint(10, (8,), device=device)))
    assert precision.step(optimizer) is True and model.weight.dtype == torch.float32


def _growth_restarts_after_an_overflow_anywhere(rank: int, world: int, out: str) -> None:
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    precision = Precision(PrecisionConfig(dtype="fp16", init_scale=1024.0, growth_interval=2),
                          torch.device("cpu"))
    scales = []
    for step in range(4):  # clean, overflow on the last rank only, clean, clean
        with precision.autocast():
            loss = model(torch.randn(4, 6)).float().sum()
        precision.backward(loss)
        if step == 1 and rank == world - 1:
            model.weight.grad[0, 0] = float("inf")
        precision.step(optimizer)
        scales.append(precision.loss_scale)
    torch.save(scales, Path(out) / f"rank{rank}.pt")


def test_an_overflow_on_any_rank_restarts_the_scale_s_growth_count_everywhere(tmp_path: Path) -> None:
    """As GradScaler does after an overflow of its own: back off, and count clean steps afresh
    before growing (growth_interval 2: the scale grows after steps 3 and 4, not after step 3)."""
    spawn(_growth_restarts_after_an_overflow_anywhere, 2, str(tmp_path))
    for rank in range(2):
        assert torch.load(tmp_path / f"rank{rank}.pt") == [1024.0, 512.0, 512.0, 1024.0], rank


@pytest.mark.parametrize("poison", [None, "inf", "nan"])
def test_fp16_overflow_check_reads_the_scalers_own_result(poison: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under loss scaling the overflow flag is what ``unscale_`` found while unscaling: no second
    pass over the gradients (a norm of them would fail here)."""
    model = nn.Linear(6, 3)
    precision = Precision(PrecisionConfig(dtype="fp16", init_scale=1024.0), torch.device("cpu"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    precision.backward(model(torch.randn(4, 6)).sum())
    if poison:
        model.weight.grad[1, 2] = float(poison)

    def second_pass(*args: object, **kwargs: object) -> None:
        raise AssertionError("the gradients were read again after unscale_")
    monkeypatch.setattr(torch.nn.utils, "get_total_norm", second_pass)
    flag = precision.nonfinite(optimizer)
    assert flag.shape == () and float(flag) == (1.0 if poison else 0.0)
    assert precision.apply(optimizer, bool(flag)) is (poison is None)
