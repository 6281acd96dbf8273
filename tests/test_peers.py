"""The peers that run PyTorch's own DDP hooks (``comm=ddp-fp16``, ``comm=powersgd``), in real gloo processes.

- ``ddp-fp16`` (and ``comm=ddp comm.wire=fp16``, the same knobs) gives exactly what torch's
  ``fp16_compress_hook`` gives when registered directly on an identical DDP model, which is the
  ``all_reduce`` mean within fp16 rounding, and counts the fp16 payload.
- ``powersgd`` gives the ``all_reduce`` mean during its dense warm-up, then exactly what torch's
  ``powerSGD_hook`` gives when registered directly (our wrapper changes nothing), and counts
  the bytes and collectives torch really issues (``dist.all_reduce`` watched).
- A PowerSGD run resumed from a checkpoint (loaded with ``weights_only=True``) in new processes
  reaches bit for bit the parameters of the run that never stopped, compression active across the cut.
World sizes 2, 3 and 4 on a small model of odd sizes, over several DDP buckets.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from gradientflow_repro.comm import build_communicator
from gradientflow_repro.comm.base import ring_bytes
from gradientflow_repro.comm.ddp import STABLE_BUCKETS, PowerSGDCommunicator
from gradientflow_repro.comm.hooks import PowerSGDHookState, powersgd_in_order
from gradientflow_repro.comm.plan import resolve

from comm_workers import CPU, ThreeLayerNet, rank_batch
from conftest import save_failures, spawn_checked

BUCKET_MB = 0.004  # a few KB: the model spans several buckets
WARMUP_STEPS = 3  # begin_step(epoch=step): dense for steps 0-2
STEPS = 6
RANK = 2


class _WatchedAllreduce:
    """``dist.all_reduce`` that records (elements, bytes) of every call while ``on``."""

    def __init__(self) -> None:
        self.original, self.on, self.calls = dist.all_reduce, False, []

    def __call__(self, tensor, *args, **kwargs):
        if self.on:
            self.calls.append(tensor.numel() * tensor.element_size())
        return self.original(tensor, *args, **kwargs)


def _loss(module: nn.Module, rank: int, step: int) -> torch.Tensor:
    return module(rank_batch(rank, step)).pow(2).mean()


def _mean_of_own_gradients(model: nn.Module, rank: int, step: int, world: int) -> list[torch.Tensor]:
    plain = copy.deepcopy(model)
    plain.zero_grad(set_to_none=True)
    _loss(plain, rank, step).backward()
    grads = [p.grad.clone() for p in plain.parameters()]
    for grad in grads:
        dist.all_reduce(grad)
        grad /= world
    return grads


def _direct(model: nn.Module, state, hook, **options: bool) -> DistributedDataParallel:
    ddp = DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB, **options)
    ddp.register_comm_hook(state, hook)
    return ddp


def _fp16_worker(rank: int, world: int, out: str) -> None:
    failures = []
    for options in ({"strategy": "ddp-fp16"}, {"strategy": "ddp", "wire": "fp16"}):
        model = ThreeLayerNet()
        reference = copy.deepcopy(model)
        comm = build_communicator({**options, "ddp_bucket_mb": BUCKET_MB}, CPU)
        module = comm.attach(model)
        direct = _direct(reference, None, default_hooks.fp16_compress_hook)
        watched = _WatchedAllreduce()
        dist.all_reduce = watched
        try:
            for step in range(3):
                expected = _mean_of_own_gradients(model, rank, step, world)
                before = comm.stats.take()
                watched.on = True
                _loss(module, rank, step).backward()
                watched.on = False
                counted = comm.stats.take()
                _loss(direct, rank, step).backward()
                if counted["bytes"] != sum(ring_bytes(b, world) for b in watched.calls) or not watched.calls:
                    failures.append(f"{options} step {step}: counted {counted}, sent {watched.calls}")
                if counted["collectives"] != len(watched.calls) or before["bytes"]:
                    failures.append(f"{options} step {step}: {counted['collectives']} collectives counted, "
                                    f"{len(watched.calls)} issued")
                watched.calls.clear()
                for mine, theirs, mean in zip(model.parameters(), reference.parameters(), expected):
                    if not torch.equal(mine.grad, theirs.grad):
                        failures.append(f"{options} step {step}: not torch's fp16_compress_hook")
                    bound = 2e-3 * world * mean.abs().max().item() + 1e-6
                    if not (mine.grad - mean).abs().max().item() <= bound:
                        failures.append(f"{options} step {step}: not the all_reduce mean within fp16 rounding")
                model.zero_grad(set_to_none=True)
                reference.zero_grad(set_to_none=True)
        finally:
            dist.all_reduce = watched.original
    save_failures(failures, out, rank)


@pytest.mark.parametrize("world", (2, 3, 4))
def test_ddp_fp16_is_torchs_fp16_compress_hook_counted(world: int, tmp_path: Path) -> None:
    spawn_checked(_fp16_worker, world, tmp_path)


def _powersgd_options() -> dict:
    return {"strategy": "powersgd", "ddp_bucket_mb": BUCKET_MB, "powersgd_rank": RANK,
            "csc_warmup_epochs": float(WARMUP_STEPS)}


def _powersgd_worker(rank: int, world: int, out: str) -> None:
    failures = []
    model = ThreeLayerNet()
    reference = copy.deepcopy(model)
    comm = build_communicator(_powersgd_options(), CPU)
    module = comm.attach(model)
    torch_state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=RANK,
                                              use_error_feedback=True, warm_start=True,
                                              start_powerSGD_iter=WARMUP_STEPS)
    # torch's hook alone, its buckets in order on gloo as ours (``hooks.powersgd_in_order``)
    direct = _direct(reference, PowerSGDHookState(torch_state, list(reference.parameters())), powersgd_in_order,
                     find_unused_parameters=STABLE_BUCKETS)
    watched = _WatchedAllreduce()
    dist.all_reduce = watched
    try:
        for step in range(STEPS):
            expected = _mean_of_own_gradients(model, rank, step, world)
            comm.begin_step(float(step))
            compressing = comm.compressing
            watched.on = True
            _loss(module, rank, step).backward()
            watched.on = False
            counted = comm.stats.take()
            _loss(direct, rank, step).backward()
            if compressing != (step >= WARMUP_STEPS):
                failures.append(f"step {step}: compressing is {compressing}")
            if counted["bytes"] != sum(ring_bytes(b, world) for b in watched.calls):
                failures.append(f"step {step}: counted {counted['bytes']} bytes, sent "
                                f"{sum(ring_bytes(b, world) for b in watched.calls)}")
            if counted["collectives"] != len(watched.calls) or len(watched.calls) < 2:
                failures.append(f"step {step}: {counted['collectives']} collectives counted, "
                                f"{len(watched.calls)} issued")
            watched.calls.clear()
            dense = all(torch.allclose(p.grad, mean, rtol=1e-5, atol=1e-7)
                        for p, mean in zip(model.parameters(), expected))
            if dense != (step < WARMUP_STEPS):
                failures.append(f"step {step}: {'the dense mean' if dense else 'not the dense mean'}")
            if not all(torch.equal(mine.grad, theirs.grad)
                       for mine, theirs in zip(model.parameters(), reference.parameters())):
                failures.append(f"step {step}: not what torch's powerSGD_hook gives")
            model.zero_grad(set_to_none=True)
            reference.zero_grad(set_to_none=True)
    finally:
        dist.all_reduce = watched.original
    if len(comm.hook_state.layouts) < 2:
        failures.append(f"{len(comm.hook_state.layouts)} bucket(s): the test means several")
    save_failures(failures, out, rank)


@pytest.mark.parametrize("world", (2, 3, 4))
def test_powersgd_is_dense_then_torchs_powersgd_hook_counted(world: int, tmp_path: Path) -> None:
    spawn_checked(_powersgd_worker, world, tmp_path)


# ---------------------------------------------------------------- bit-exact resume

RESUME_STEPS, CUT = 8, 4  # compression from step 2 (warm-up 0: torch's earliest), the cut at 4


def _train(rank: int, out: Path, steps: range, load: bool, save_at: int | None) -> nn.Module:
    model = ThreeLayerNet()
    options = {**_powersgd_options(), "csc_warmup_epochs": 0.0}
    comm = build_communicator(options, CPU)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if load:
        saved = torch.load(out / f"cut_rank{rank}.pt", weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        comm.load_state_dict(saved["comm"])  # before attach, as a trainer may
    module = comm.attach(model, optimizer)
    for step in steps:
        if step == save_at:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "comm": comm.state_dict()}, out / f"cut_rank{rank}.pt")
        comm.begin_step(float(step))
        optimizer.zero_grad(set_to_none=True)
        _loss(module, rank, step).backward()
        comm.synchronize()
        optimizer.step()
    if not comm.compressing:
        raise AssertionError("PowerSGD never compressed")
    return model


def _straight_and_cut(rank: int, world: int, out: str) -> None:
    model = _train(rank, Path(out), range(RESUME_STEPS), load=False, save_at=CUT)
    torch.save([p.detach().clone() for p in model.parameters()], Path(out) / f"straight_rank{rank}.pt")


def _resumed(rank: int, world: int, out: str) -> None:
    model = _train(rank, Path(out), range(CUT, RESUME_STEPS), load=True, save_at=None)
    straight = torch.load(Path(out) / f"straight_rank{rank}.pt")
    failures = [f"parameter {i} differs by {(mine - theirs).abs().max().item():.3g}"
                for i, (mine, theirs) in enumerate(zip(model.parameters(), straight)) if not torch.equal(mine, theirs)]
    save_failures(failures, out, rank)


@pytest.mark.parametrize("world", (2, 3))
def test_powersgd_resumes_bit_exactly_in_new_processes(world: int, tmp_path: Path) -> None:
    from gradientflow_repro.cluster.world import spawn

    spawn(_straight_and_cut, world, str(tmp_path))
    saved = torch.load(tmp_path / "cut_rank0.pt", weights_only=True)
    assert saved["comm"]["error"] and saved["comm"]["iteration"] == CUT  # compressed before the cut
    spawn_checked(_resumed, world, tmp_path)


# ---------------------------------------------------------------- configuration


def test_powersgd_needs_ddp_fusion() -> None:
    with pytest.raises(ValueError, match="comm.fusion.*needs comm.fusion=ddp"):
        resolve({"strategy": "powersgd", "fusion": "lazy"})
    with pytest.raises(ValueError, match="comm.fusion"):
        build_communicator({"strategy": "powersgd", "fusion": "lazy"}, CPU)


def test_powersgd_is_compressed_after_csc_warmup_and_one_rank_sends_nothing() -> None:
    config = resolve({"strategy": "powersgd", "density": 1.0}, lr_warmup_epochs=2.5)  # PowerSGD has no density
    assert config.sends_sparse and config.dense_warmup_epochs == 2.5
    assert not resolve({"strategy": "ddp-fp16"}).sends_sparse
    comm = build_communicator({"strategy": "powersgd", "csc_warmup_epochs": 1}, CPU)
    assert isinstance(comm, PowerSGDCommunicator) and "PowerSGD rank 4" in comm.schedule
    model = nn.Linear(5, 3)
    assert comm.attach(model) is model and comm.state_dict() == {}
