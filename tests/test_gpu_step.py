"""The GPU step without avoidable work, checked on CPUs: the lazy pool's gradients are views of the
pool (no copy out; channels_last weights keep channels_last gradients), and CSC's local work is a
fixed number of operations per pool part whatever the number of layers (what a GPU pays per kernel
launch), counted with the profiler."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gradientflow_repro.comm.base import builtin_sum
from gradientflow_repro.comm.csc import CSCCommunicator
from gradientflow_repro.comm.lazy import LazyAllreduce
from gradientflow_repro.comm.ring import ring_sum
from gradientflow_repro.optim import Lars

from conftest import save_failures, spawn_checked

CPU = torch.device("cpu")
# what the profiler lists that launches no kernel: views, metadata, allocation
NO_KERNEL = {"aten::slice", "aten::view", "aten::view_as", "aten::detach", "aten::reshape", "aten::as_strided",
             "aten::unbind", "aten::select", "aten::expand", "aten::permute", "aten::alias", "aten::empty",
             "aten::t", "aten::unsqueeze", "aten::squeeze", "aten::_reshape_alias", "aten::lift_fresh",
             "aten::empty_like", "aten::empty_strided", "aten::result_type"}


def convnet(layers: int, channels_last: bool = False) -> nn.Module:
    torch.manual_seed(0)
    blocks = [module for _ in range(layers) for module in (nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())]
    model = nn.Sequential(*blocks, nn.Flatten(), nn.Linear(8 * 8 * 8, 10))
    return model.to(memory_format=torch.channels_last) if channels_last else model


def lars(model: nn.Module) -> torch.optim.Optimizer:
    decayed = [p for p in model.parameters() if p.ndim > 1]
    plain = [p for p in model.parameters() if p.ndim <= 1]
    return Lars([{"params": decayed, "weight_decay": 5e-4}, {"params": plain, "weight_decay": 0.0}],
                lr=0.1, momentum=0.9, trust_coeff=0.001)


def launches_of_a_sparse_step(layers: int, momentum_correction: bool) -> Counter:
    """The operations (kernels on a GPU) of one sparse ``synchronize`` on one rank: one pool part."""
    model = convnet(layers)
    optimizer = lars(model)
    comm = CSCCommunicator(CPU, builtin_sum(), bucket_bytes=10**9, overlap=False, chunk_size=64, density=0.1,
                           warmup_epochs=0, momentum_correction=momentum_correction)
    comm.attach(model, optimizer)
    assert len(comm.buckets) == 1
    images = torch.randn(4, 8, 8, 8)
    for step in range(3):
        comm.begin_step(1.0)
        model(images).sum().backward()
        if step < 2:
            comm.synchronize()
        else:
            with torch.profiler.profile() as profile:
                comm.synchronize()
        comm.end_step(True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    top = [event for event in profile.events() if event.name.startswith("aten::")
           and (event.cpu_parent is None or not event.cpu_parent.name.startswith("aten::"))]
    return Counter(event.name for event in top if event.name not in NO_KERNEL)


@pytest.mark.parametrize("momentum_correction", [False, True])
def test_csc_local_work_does_not_grow_with_the_layers(momentum_correction: bool) -> None:
    """Two and eight conv layers in one pool part: the same operations. Without momentum correction
    (`gradientflow`) at most 20; with it (`gradientflow-paper`: LARS's step moved before the momentum,
    masking) the count is fixed too, and larger (docs/strategies.md says how much)."""
    few, many = (launches_of_a_sparse_step(layers, momentum_correction) for layers in (2, 8))
    assert few == many, (few, many)
    if not momentum_correction:
        assert sum(many.values()) <= 20, many
    else:
        assert sum(many.values()) <= 50, many


def test_gradients_are_views_of_the_pool() -> None:
    """After ``synchronize`` each ``p.grad`` lies in its pool part (no copy out, no fresh tensor), laid
    out like its parameter, and the next step's gradients land in the same place."""
    model = convnet(2, channels_last=True)
    pool = LazyAllreduce(CPU, builtin_sum(), bucket_bytes=4096, overlap=True)
    pool.attach(model)
    images = torch.randn(4, 8, 8, 8).contiguous(memory_format=torch.channels_last)
    for _ in range(2):
        model(images).sum().backward()
        expected = {param: param.grad.detach().clone() for param in model.parameters()}
        pool.synchronize()
        for bucket in pool.buckets:
            start, end = bucket.flat.data_ptr(), bucket.flat.data_ptr() + bucket.flat.numel() * 4
            for param in bucket.params:
                assert start <= param.grad.data_ptr() < end
                assert param.grad.stride() == param.stride()  # channels_last weights: channels_last gradients
                assert torch.equal(param.grad, expected[param])
        model.zero_grad(set_to_none=True)
    pool.close()


def _channels_last_parity(rank: int, world: int, out: str) -> None:
    from gradientflow_repro.comm.factory import build_communicator

    failures = []
    for name in ("lazy", "csc", "ring", "allreduce"):
        model = convnet(3, channels_last=True)
        reference = convnet(3, channels_last=True)
        if name == "lazy":
            comm = LazyAllreduce(CPU, ring_sum(segment_bytes=1024), bucket_bytes=8192, overlap=True)
        elif name == "csc":  # every chunk sent: the mean gradient, chunked in the weights' memory order
            comm = CSCCommunicator(CPU, ring_sum(segment_bytes=1024), bucket_bytes=8192, overlap=True,
                                   chunk_size=100, density=1.0, warmup_epochs=0, momentum_correction=False)
        else:  # per tensor: our ring and recursive doubling, gloo's allreduce (both need one dense dimension)
            comm = build_communicator({"strategy": name}, CPU)
        comm.attach(model)
        images = torch.randn(4, 8, 8, 8, generator=torch.Generator().manual_seed(rank)).contiguous(
            memory_format=torch.channels_last)
        for _ in range(2):
            comm.begin_step(1.0)
            model(images).pow(2).mean().backward()
            comm.synchronize()
            comm.end_step(True)
            reference.zero_grad(set_to_none=True)
            reference(images).pow(2).mean().backward()
            for (label, param), mine in zip(reference.named_parameters(), model.parameters()):
                expected = param.grad.detach().clone()
                dist.all_reduce(expected)
                expected /= world
                if not torch.allclose(mine.grad, expected, rtol=1e-5, atol=1e-6):
                    failures.append(f"{name} {label}: {(mine.grad - expected).abs().max():.3g} from dist.all_reduce")
            model.zero_grad(set_to_none=True)
        comm.close()
    save_failures(failures, out, rank)


@pytest.mark.parametrize("world", [2, 3])
def test_channels_last_gradients_are_the_mean(world: int, tmp_path: Path) -> None:
    """A channels_last model through the lazy pool, CSC (all chunks) and the per-tensor strategies:
    the mean gradient, as ``dist.all_reduce`` gives it."""
    spawn_checked(_channels_last_parity, world, tmp_path)


def test_a_channels_last_run_keeps_weights_and_gradients_channels_last(tmp_path: Path) -> None:
    """``data.channels_last=true``: NHWC batches, channels_last conv weights, and (through the lazy pool
    and CSC) channels_last gradients, step after step."""
    from hydra import compose, initialize_config_dir

    from gradientflow_repro.config import register_configs
    from gradientflow_repro.distributed import World
    from gradientflow_repro.engine import Trainer

    from conftest import CONFIGS

    register_configs()
    overrides = ["+experiment=digits_cpu", "data=synthetic", "data.image_size=32", "model.width=0.125",
                 "logger=jsonl", "logger.log_every=1000", "global_batch_size=32", "comm=gradientflow",
                 "comm.csc_warmup_epochs=0", f"run_dir={tmp_path}", "resume=never", "data.channels_last=true",
                 "data.synthetic_train_size=256"]
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    trainer = Trainer(cfg, World(0, 1, 0, 1, "127.0.0.1", 0, "single"), CPU)
    images, labels = next(iter(trainer.data.train_batches(0)))
    assert images.is_contiguous(memory_format=torch.channels_last) and not images.is_contiguous()
    convs = [p for p in trainer.model.parameters() if p.dim() == 4]
    assert convs and all(p.is_contiguous(memory_format=torch.channels_last) for p in convs)
    seen = []
    trainer.optimizer.register_step_pre_hook(lambda *_: seen.append([p.grad.stride() == p.stride() for p in convs]))
    for _ in range(2):
        trainer.train_step(images, labels)
    trainer.comm.close()
    assert len(seen) == 2 and all(all(step) for step in seen), seen
