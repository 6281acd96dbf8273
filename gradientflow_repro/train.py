"""Entry point: compose the Hydra config, check it, join the process group, train.

    torchrun --nproc-per-node=4 -m gradientflow_repro.train +experiment=digits_cpu
    srun python -m gradientflow_repro.train +experiment=alexnet_512gpu data.root=/imagenet

Configuration errors are reported before any process group starts, naming the key at fault.
Exit codes: 0 done; 2 bad configuration or launch; 75 stopped by SIGUSR1 after a checkpoint (the
Slurm templates requeue the job); 143 stopped by SIGTERM after a checkpoint.
"""

from __future__ import annotations

import sys
import time

import hydra
from omegaconf import DictConfig

from gradientflow_repro.config import ConfigError, register_configs, validate

register_configs()


@hydra.main(version_base=None, config_path="../configs", config_name="config")
def main(cfg: DictConfig) -> None:
    clock_start = time.perf_counter()  # the MLPerf clock: before any data is touched
    from gradientflow_repro import distributed

    try:
        world = distributed.discover_world()
        validate(cfg, world.world_size)
    except (ConfigError, distributed.WorldError) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    import torch

    from gradientflow_repro.checkpoint import CheckpointError
    from gradientflow_repro.data import DatasetError
    from gradientflow_repro.engine import Trainer, TrainingError

    agreed_errors = (TrainingError, DatasetError, CheckpointError)  # every rank, same message
    torch.set_num_threads(max(1, cfg.threads_per_rank))
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        device = distributed.select_device(cfg.device, world)
        distributed.init_process_group(world, device, cfg.dist_timeout_s, cfg.watchdog_s)
    except distributed.WorldError as error:  # two ranks on one GPU, too few GPUs: every rank says it
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    if device.type == "cuda" and not cfg.deterministic:
        torch.backends.cudnn.benchmark = True  # fixed input shapes: pick the fastest kernels once
    print(distributed.describe_rank(world, device), flush=True)
    try:
        summary = Trainer(cfg, world, device, clock_start).fit()
    except Exception as error:  # noqa: BLE001 - one clear line, naming lost ranks
        if world.is_main or not isinstance(error, agreed_errors):  # agreed ones: the same everywhere
            print(f"error: {distributed.describe_failure(world, error)}", file=sys.stderr, flush=True)
        raise
    finally:
        distributed.destroy_process_group()
    if summary["exit_code"]:  # stopped by a signal after a checkpoint; 75 asks for a requeue
        sys.exit(summary["exit_code"])


if __name__ == "__main__":
    main()
