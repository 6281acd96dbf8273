"""A training step reads one value back to the host: the agreed overflow and stop flags. On a GPU
every other read (``item``, ``tolist``, ``bool`` or ``float`` of a tensor) would make the CPU wait for
the device and stall the queue of kernels; here, on the CPU, each is counted where it is made."""

from __future__ import annotations

import collections
import traceback
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from gradientflow_repro.config import register_configs
from gradientflow_repro.distributed import World

from conftest import CONFIGS

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")


@pytest.mark.parametrize("strategy,precision", [("gradientflow", "fp16"), ("lazy", "bf16"), ("allreduce", "fp32")])
def test_a_training_step_reads_one_value_back(strategy: str, precision: str, tmp_path: Path) -> None:
    from gradientflow_repro.engine import Trainer

    register_configs()
    overrides = ["+experiment=digits_cpu", "data=synthetic", "data.image_size=32", "model.width=0.125",
                 "logger=jsonl", "logger.log_every=1000", "global_batch_size=32", f"comm={strategy}",
                 "comm.csc_warmup_epochs=0", f"precision={precision}", f"run_dir={tmp_path}",
                 "resume=never", "consistency_every_steps=0", "data.synthetic_train_size=256"]
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    trainer = Trainer(cfg, World(0, 1, 0, 1, "127.0.0.1", 0, "single"), torch.device("cpu"))
    images, labels = next(iter(trainer.data.train_batches(0)))
    for _ in range(2):  # warm-up: the first steps may set things up
        trainer.train_step(images, labels)
    where: collections.Counter = collections.Counter()
    saved = {name: getattr(torch.Tensor, name) for name in READS}

    def counting(name: str):
        def read(self: torch.Tensor, *args, **kwargs):
            caller = traceback.extract_stack(limit=3)[0]
            where[f"{Path(caller.filename).name}:{caller.lineno} {name}"] += 1
            return saved[name](self, *args, **kwargs)
        return read

    try:
        for name in READS:
            setattr(torch.Tensor, name, counting(name))
        steps = 3
        for _ in range(steps):
            trainer.train_step(images, labels)
    finally:
        for name, function in saved.items():
            setattr(torch.Tensor, name, function)
        trainer.comm.close()
    assert sum(where.values()) == steps, dict(where)  # the agreement's one read, nothing else


def _counted(owner: object, name: str, counter: collections.Counter, counts=lambda *args: True) -> None:
    """Replace ``owner.name`` by a wrapper that counts its calls in ``counter`` (those ``counts`` takes)."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if counts(*args):
            counter.update([name])
        return original(*args, **kwargs)
    setattr(owner, name, wrapper)


def _differing_ranks(rank: int, world: int, out: str) -> None:
    import torch.distributed as dist

    from gradientflow_repro.distributed import ranks_that_differ

    from conftest import save_failures

    failures, calls, reads = [], collections.Counter(), collections.Counter()
    for name in ("all_reduce", "all_gather", "all_gather_object", "broadcast", "gather"):
        _counted(dist, name, calls)
    for name in READS:  # what returns a host value from a device tensor; torch.equal does too
        _counted(torch.Tensor, name, reads)
    _counted(torch, "equal", reads)
    tensors = [torch.arange(7.0).reshape(7, 1), torch.ones(5)]
    for odd_ones in ([], [1], [0], [world - 1, 1]):
        if rank in odd_ones:
            tensors[1][rank % 5] += 1e-6
        calls.clear()
        reads.clear()
        found = ranks_that_differ(tensors, torch.device("cpu"))
        if sum(reads.values()) != 1:
            failures.append(f"{dict(reads)}: one read back to the host expected")
        expected = [r for r in range(world) if r not in odd_ones] if 0 in odd_ones else sorted(set(odd_ones))
        if found != expected:
            failures.append(f"odd ranks {odd_ones}: found {found}, expected {expected}")
        if sum(calls.values()) != 1:
            failures.append(f"{dict(calls)}: one collective expected")
        if rank in odd_ones:
            tensors[1][rank % 5] -= 1e-6
            tensors[1].copy_(torch.ones(5))
    save_failures(failures, out, rank)


@pytest.mark.parametrize("world", [3, 4])
def test_parameter_consistency_is_one_collective(world: int, tmp_path: Path) -> None:
    """Ranks whose parameters differ from rank 0's, found with one collective and one read back to the
    host whatever the world size (every rank but 0 when rank 0 is the odd one)."""
    from conftest import spawn_checked

    spawn_checked(_differing_ranks, world, tmp_path)
