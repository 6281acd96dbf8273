"""Structured configuration: the types, defaults and allowed values behind the Hydra tree in ``configs/``.

Hydra composes YAML over these dataclasses (so a misspelt key is rejected by OmegaConf). What each
field allows is declared next to it (``checks.setting``) and checked from there by ``validate``,
which adds the rules that involve several keys. Everything here runs before any process group
starts (and without torch), so a bad configuration never costs a cluster allocation more than a
few seconds.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from gradientflow_repro import REPO
from gradientflow_repro.checks import (
    boolean,
    config_keys,
    field_problems,
    in_range,
    non_negative,
    numbers,
    one_of,
    optional,
    options_node,
    positive,
    setting,
    text,
)
from gradientflow_repro.comm.knobs import CommConfig
from gradientflow_repro.comm.plan import resolve

MODEL_NAMES = ("alexnet_bn", "alexnet", "resnet50")
DATA_KINDS = ("folder", "shards", "synthetic")
LOADERS = ("dali", "torchvision")
OPTIMIZERS = ("lars", "apex_larc")
PRECISIONS = ("fp32", "bf16", "fp16")
DEVICES = ("auto", "cpu", "cuda")
optional_text = optional(text)


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the key and what is allowed."""


@dataclass
class ModelConfig:
    name: str = setting("alexnet_bn", one_of(*MODEL_NAMES))
    width: float = setting(1.0, positive)  # channel multiplier of alexnet_bn; 1.0 is the ImageNet network
    dropout: float = setting(0.5, in_range(0, 1, high_open=True))
    # BatchNorm's running statistics: the weight of each step's batch (0.1: PyTorch's default). A short
    # run (few steps per epoch, large steps) needs a larger one, or evaluation uses stale statistics.
    bn_momentum: float = setting(0.1, in_range(0, 1, low_open=True))


@dataclass
class DataConfig:
    # folder: root/{train,val}/<class>/*.JPEG; shards: root/manifest.json and the webdataset shards it
    # lists (scripts/prepare_imagenet.py --shards; DALI only); synthetic
    kind: str = setting("folder", one_of(*DATA_KINDS))
    root: Optional[str] = setting(None, optional_text)
    loader: str = setting("dali", one_of(*LOADERS))
    num_classes: int = setting(1000, positive)
    image_size: int = setting(224, positive)  # crop fed to the network
    val_resize: int = setting(256, positive)  # shorter side before the validation centre crop
    min_crop_scale: float = setting(0.08, in_range(0, 1, low_open=True))  # random-resized-crop area (min, 1)
    flip: bool = setting(True, boolean)  # horizontal flip (off for digits: a mirrored 2 is not a 2)
    mean: list[float] = setting(None, numbers(3, non_negative),
                                factory=lambda: [0.485 * 255, 0.456 * 255, 0.406 * 255])
    std: list[float] = setting(None, numbers(3, positive),
                               factory=lambda: [0.229 * 255, 0.224 * 255, 0.225 * 255])
    # decoding threads per rank (torchvision: DataLoader workers); null: follow the rank's CPUs
    # (SLURM_CPUS_PER_TASK or the affinity mask: data/cpus.py)
    num_threads: Optional[int] = setting(2, optional(positive))
    # worker processes per rank: DALI's parallel external source (reads the training files), or the
    # torchvision loader's DataLoader workers (load and decode); null: the loader's own default
    reader_workers: Optional[int] = setting(None, optional(non_negative))
    prefetch: int = setting(2, positive)
    verify_files: bool = setting(True, boolean)  # check every image file (cheaply) before training
    # batches as NCHW-shaped tensors in channels_last memory (DALI emits NHWC), for NHWC convolutions
    channels_last: bool = setting(False, boolean)
    shuffle_buffer: int = setting(1024, positive)  # shards: samples in each rank's DALI shuffle buffer
    synthetic_train_size: int = setting(4096, positive)
    synthetic_val_size: int = setting(512, positive)


@dataclass
class OptimConfig:
    name: str = setting("lars", one_of(*OPTIMIZERS))
    base_lr: float = setting(2.0, positive)  # peak LR at ``base_batch_size``; scaled linearly with the batch
    base_batch_size: int = setting(256, positive)
    momentum: float = setting(0.9, in_range(0, 1, high_open=True))
    weight_decay: float = setting(5e-4, non_negative)
    trust_coeff: float = setting(0.001, positive)
    warmup_epochs: float = setting(5.0, non_negative)  # at most `epochs` (checked in validate)
    poly_power: float = setting(2.0, non_negative)
    end_lr: float = setting(0.0, non_negative)


@dataclass
class PrecisionConfig:
    dtype: str = setting("bf16", one_of(*PRECISIONS))
    # fp16 only: GradScaler settings
    init_scale: float = setting(65536.0, positive)
    growth_interval: int = setting(2000, positive)


@dataclass
class LoggerConfig:
    wandb: bool = setting(True, boolean)
    mode: str = setting("offline", one_of("offline", "online", "disabled"))
    project: str = setting("gradientflow-repro", text)
    entity: Optional[str] = setting(None, optional_text)
    group: Optional[str] = setting(None, optional_text)  # defaults to the experiment name
    name: Optional[str] = setting(None, optional_text)  # the run's name; defaults to the strategy
    log_every: int = setting(10, positive)  # steps between progress lines and JSONL step records


@dataclass
class CheckpointConfig:
    # A checkpoint is always written at a stop signal (preemption, time limit) and at the end; these
    # add periodic ones. every_epochs: after every this-many whole epochs (null: none by epoch).
    every_epochs: Optional[int] = setting(1, optional(positive))
    # every_minutes: once this much wall-clock time has passed since the last checkpoint (or the
    # start), after the step at which the first rank's clock passed it: the ranks agree on it in the
    # step's one read-back, so all of them save after the same step (null: off)
    every_minutes: Optional[float] = setting(None, optional(positive))
    keep: int = setting(3, positive)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    # comm.*: the keys every strategy shares (CommConfig's), then the preset's (configs/comm/), whose
    # sparsifier may declare keys of its own: an open node, checked whole by ``plan.resolve``
    comm: dict[str, Any] = setting(None, options_node, factory=lambda: dataclasses.asdict(CommConfig()))
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    experiment: str = setting("default", text)
    run_dir: str = setting(MISSING, text)  # stable per experiment (and Slurm job): resume=auto finds it
    global_batch_size: int = setting(256, positive)  # divisible by the world size (checked in validate)
    epochs: int = setting(90, positive)
    eval_every_epochs: int = setting(1, positive)
    # evaluate with BatchNorm statistics recomputed from the epoch's last this-many training batches
    # (precise_bn.py); 0: BatchNorm's running statistics as they are
    precise_bn_batches: int = setting(0, non_negative)
    target_top1: Optional[float] = setting(None, optional(in_range(0, 100, low_open=True)))  # stop there
    max_steps: Optional[int] = setting(None, optional(positive))  # stop after this many steps (tests)
    seed: int = setting(0, non_negative)
    device: str = setting("auto", one_of(*DEVICES))
    deterministic: bool = setting(False, boolean)
    resume: str = setting("auto", text)  # auto | never | path to a checkpoint directory
    # keys allowed to differ from the configuration the run_dir's run recorded (run_dir.py): the
    # resumed run goes on under the new values and records the change
    accept_config_change: list[str] = setting(None, config_keys, factory=list)
    # how long ranks wait for each other: the rendezvous at start-up, gloo's collectives (NCCL's are
    # given the later of this and watchdog_s, plus a minute: the watchdog must speak first)
    dist_timeout_s: float = setting(300.0, positive)
    # a rank with no progress mark (step, evaluation, checkpoint) for this long while every rank's
    # heartbeat still moves is stuck: it says so and exits (null: about dist_timeout_s under NCCL,
    # whose collectives hang on a dead peer; a backstop after gloo's own timeout). A rank that is
    # gone (its heartbeat stops) is named within a few heartbeats, whatever this says
    watchdog_s: Optional[float] = setting(None, optional(positive))
    threads_per_rank: int = setting(4, positive)  # torch intra-op threads per process (CPU training)
    save_final_params: bool = setting(False, boolean)  # write params.pt at the end (tests compare runs)
    consistency_every_steps: int = setting(100, non_negative)  # parameter checksums across ranks (0: off)
    max_nonfinite_steps: int = setting(20, positive)  # fp16: stop after this many skipped steps in a row


def register_configs() -> None:
    ConfigStore.instance().store(name="base_config", node=Config)


def _fail(key: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"config key '{key}' = {value!r}: {allowed}")


def validate(cfg: Config | DictConfig, world_size: int) -> None:
    """Raise ConfigError naming the first bad key. Called before the process group starts."""
    for key, value, allowed in field_problems(Config, cfg):  # what each field declares
        _fail(key, value, allowed)
    try:
        knobs = resolve(cfg.comm, world=world_size)  # raises naming the comm.* key at fault
    except ValueError as error:
        raise ConfigError(str(error)) from None
    # rules that involve several keys, or the machine
    if cfg.optim.name == "apex_larc" and knobs.sparsity == "csc" and knobs.keys.momentum_correction:
        _fail("optim.name", cfg.optim.name, "LARC rescales every update, so under CSC's momentum correction it "
              "would rescale the accumulated velocity: use optim.name=lars (CSC then applies its rescaling "
              "before the velocity) or comm.momentum_correction=false")
    if cfg.optim.name == "apex_larc" and importlib.util.find_spec("apex") is None:
        _fail("optim.name", cfg.optim.name,
              "needs NVIDIA apex, which is not installed (docs/clusters.md, 'NVIDIA apex')")
    if cfg.optim.warmup_epochs > cfg.epochs:
        _fail("optim.warmup_epochs", cfg.optim.warmup_epochs, f"must not exceed epochs ({cfg.epochs})")
    if cfg.global_batch_size % world_size != 0:
        _fail("global_batch_size", cfg.global_batch_size,
              f"must be divisible by the world size {world_size} "
              f"(nearest valid: {max(world_size, cfg.global_batch_size // world_size * world_size)})")
    if cfg.resume not in ("auto", "never") and not Path(cfg.resume).is_dir():
        _fail("resume", cfg.resume, "must be auto, never, or an existing checkpoint directory")
    if cfg.accept_config_change:
        from gradientflow_repro.run_dir import flatten

        known = flatten(OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, DictConfig)
                        else dataclasses.asdict(cfg))
        unknown = [key for key in cfg.accept_config_change if key not in known]
        if unknown:
            _fail("accept_config_change", list(cfg.accept_config_change), f"{unknown} name no config key "
                  f"(keys are dotted, e.g. optim.base_lr)")
    if cfg.data.kind == "folder":
        _validate_image_folder(cfg.data.root)
    _validate_run_dir(cfg.run_dir)


def _validate_run_dir(run_dir: str) -> None:
    path = Path(run_dir)
    existing = next(p for p in [path, *path.parents] if p.exists())  # "." or "/" at the latest
    if not existing.is_dir():
        _fail("run_dir", run_dir, f"cannot be created: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        _fail("run_dir", run_dir, f"cannot be created or written: {existing} is not writable")


def _validate_image_folder(root: Optional[str]) -> None:
    if not root:
        _fail("data.root", root, "data.kind=folder needs a dataset root (DATA=/path/to/imagenet)")
    base = Path(root)
    if not base.is_dir():
        _fail("data.root", root, "directory does not exist")
    for split in ("train", "val"):
        split_dir = base / split
        if not split_dir.is_dir():
            _fail("data.root", root, f"has no '{split}' directory (expected {split}/<class>/<image>)")
        if not any(p.is_dir() for p in split_dir.iterdir()):
            _fail("data.root", root, f"'{split}' has no class folders (expected {split}/<class>/<image>)")


def compose(overrides: Sequence[str]) -> "DictConfig":
    """The configuration ``gradientflow_repro.train`` runs with these Hydra ``overrides``, composed in
    this process from the checkout's ``configs/`` (no Hydra app, no run directory, nothing validated):
    how the benchmarks, profiles and checks read an experiment instead of restating it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        return hydra_compose(config_name="config", overrides=list(overrides))
