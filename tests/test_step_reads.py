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
