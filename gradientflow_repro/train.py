"""Entry point: compose the Hydra config, check it, join the process group, train.

    torchrun --nproc-per-node=4 -m gradientflow_repro.train +experiment=digits_cpu
    srun python -m gradientflow_repro.train +experiment=alexnet_512gpu data.root=/imagenet

Configuration errors are reported before any process group starts, naming the key at fault.
Exit codes: 0 done; 1 training failed (an error every rank agrees on, such as bad images, a checkpoint
that does not fit or non-finite gradients, ends with its one-line message and no traceback; so
does a collective that broke because ranks are lost, with one line naming them); 2 bad configuration
or launch; 75 stopped by SIGUSR1 after a checkpoint (the Slurm templates requeue the job);
143 stopped by SIGTERM after a checkpoint.
"""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

# Stop signals that arrive before the trainer listens (imports and start-up take seconds): by
# default either would kill the rank, which reads as a crash and forfeits the requeue. Remembered
# here and handed to the trainer's StopRequests, which acts on them after its first step.
EARLY_STOP_SIGNALS: list[int] = []


def _remember_early(signum: int, _frame: Any) -> None:
    EARLY_STOP_SIGNALS.append(signum)


if __name__ == "__main__":  # before the slow imports below
    for _signum in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(_signum, _remember_early)

import hydra  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from gradientflow_repro.config import ConfigError, register_configs, validate  # noqa: E402

if TYPE_CHECKING:
    import torch

register_configs()
LOGGER = "gradientflow_repro.train"  # also when run as __main__ (python -m): under the package's handler
log = logging.getLogger(LOGGER)


@hydra.main(version_base=None, config_path="../configs", config_name="config")
def main(cfg: DictConfig) -> None:
    from gradientflow_repro.tracking import Phases

    phases = Phases()  # start-up, phase by phase; MLPerf's clock starts in the Trainer
    from gradientflow_repro import distributed, logs
    from gradientflow_repro.run_dir import RunDirError, claim

    prefix = f"{cfg.experiment}/{cfg.logger.name or cfg.comm.strategy}"
    logs.configure(prefix)  # before the rank is known: an error then reads the same on every rank
    try:
        world = distributed.discover_world()
        logs.configure(prefix, world.rank)
        validate(cfg, world.world_size)
        # the run directory is this run's (configuration, lock), before any process group starts
        owned = claim(Path(cfg.run_dir), OmegaConf.to_container(cfg, resolve=True), resume=cfg.resume,
                      accepted=list(cfg.accept_config_change), rank=world.rank)
    except (ConfigError, distributed.WorldError, RunDirError) as error:
        log.error(error)
        sys.exit(2)
    from gradientflow_repro.faults import ignored_warning

    for line in owned.said:  # rank 0's first lines: what was adopted, moved aside or taken over
        log.info(line)
    if (faults_ignored := ignored_warning()) and world.is_main:  # faults left set in the environment
        log.warning(faults_ignored)
    try:
        _train(cfg, world, phases)
    finally:
        owned.release()


def _train(cfg: DictConfig, world: Any, phases: Any) -> None:
    """Join the process group and train; exits with the status the module docstring lists."""
    import torch

    from gradientflow_repro import distributed
    from gradientflow_repro.checkpoint import CheckpointError
    from gradientflow_repro.data import DatasetError
    from gradientflow_repro.engine import Trainer, TrainingError

    agreed_errors = (TrainingError, DatasetError, CheckpointError)  # every rank, same message
    torch.set_num_threads(max(1, cfg.threads_per_rank))
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    phases.done("config check and imports")
    try:
        device = distributed.select_device(cfg.device, world)
        from gradientflow_repro.comm.factory import prepare_backend  # refusals: before NCCL starts

        prepare_backend(cfg.comm, device, world.world_size)
        distributed.init_process_group(world, device, cfg.dist_timeout_s, cfg.watchdog_s)
    except distributed.WorldError as error:  # two ranks on one GPU, too few GPUs: every rank says it
        log.error(error)
        sys.exit(2)
    configure_backends(device, cfg.deterministic)
    _placement_log().info(distributed.describe_rank(world, device))
    phases.done("process group")
    trainer: Optional[Trainer] = None
    try:
        trainer = Trainer(cfg, world, device, phases, early_signal=max(EARLY_STOP_SIGNALS, default=0))
        summary = trainer.fit()
    except agreed_errors as error:  # the same on every rank, and its message says it all: no traceback
        if world.is_main:  # the whole message: a dataset error lists every bad file after its first line
            log.error(f"rank {world.rank}: {type(error).__name__}: {str(error).strip()}")
        distributed.destroy_process_group()
        # a stop's checkpoint that could not be written: still the stop's status, so that a
        # preemption warning is requeued (from the previous checkpoint) rather than read as a crash
        stopping = isinstance(error, CheckpointError) and trainer is not None and trainer.stop.agreed_signal
        sys.exit(trainer.stop.exit_code if stopping else 1)
    except Exception as error:  # noqa: BLE001 - one clear line, naming lost ranks
        if distributed.watchdog_fired():  # its line named the lost ranks; it ends this process
            distributed.wait_for_watchdog()
        line, ranks_lost = distributed.diagnose_failure(world, error)
        log.error(line)
        if not ranks_lost:  # perhaps a bug here: the traceback shows where
            raise
        sys.exit(1)  # a collective broke because ranks are gone: the line says it all, every
        # survivor's traceback would only show where it waited
    finally:
        if trainer is not None:
            trainer.abandon()  # after an error: the MLPerf log says aborted (nothing after a finished run)
        distributed.destroy_process_group()
    if summary["exit_code"]:  # stopped by a signal after a checkpoint; 75 asks for a requeue
        sys.exit(summary["exit_code"])


def _placement_log() -> logging.Logger:
    """The logger of each rank's placement line (``describe_rank``: ``rank R/N local_rank ... node
    ... node_id ...``). Unlike the run's progress, every rank writes it, unprefixed, to stdout: the
    job log's one record of where each rank landed, read across ranks (a Slurm layout's check)."""
    placement = logging.getLogger(f"{LOGGER}.placement")
    if not placement.handlers:
        handler = logging.StreamHandler(sys.stdout)  # the default format: the message alone
        placement.addHandler(handler)
        placement.setLevel(logging.INFO)
        placement.propagate = False
    return placement


def configure_backends(device: torch.device, deterministic: bool) -> None:
    """cuDNN picks the fastest convolution kernels once for the run's fixed input shapes
    (``cudnn.benchmark``); with ``deterministic=true`` it may not, since the pick can differ between
    runs (and then a resumed GPU run would not be bit-identical to an uninterrupted one)."""
    import torch

    torch.backends.cudnn.benchmark = device.type == "cuda" and not deterministic


if __name__ == "__main__":
    main()
