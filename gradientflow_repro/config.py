"""Structured configuration: the types and defaults behind the Hydra tree in ``configs/``.

Hydra composes YAML over these dataclasses (so a misspelt key is rejected by OmegaConf), and
``validate`` checks the values that types cannot express. Everything here runs before any process
group starts, so a bad configuration never costs a cluster allocation more than a few seconds.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

MODEL_NAMES = ("alexnet_bn", "alexnet", "resnet50")
DATA_KINDS = ("folder", "synthetic")
LOADERS = ("dali", "torchvision")
OPTIMIZERS = ("lars", "apex_larc")
PRECISIONS = ("fp32", "bf16", "fp16")
DEVICES = ("auto", "cpu", "cuda")


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the key and what is allowed."""


@dataclass
class ModelConfig:
    name: str = "alexnet_bn"
    width: float = 1.0  # channel multiplier of alexnet_bn; 1.0 is the ImageNet network
    dropout: float = 0.5


@dataclass
class DataConfig:
    kind: str = "folder"  # folder: ImageNet layout root/{train,val}/<class>/*.JPEG; synthetic: random
    root: Optional[str] = None
    loader: str = "dali"
    num_classes: int = 1000
    image_size: int = 224  # crop fed to the network
    val_resize: int = 256  # shorter side before the validation centre crop
    min_crop_scale: float = 0.08  # random-resized-crop area range (min, 1.0)
    flip: bool = True  # horizontal flip (off for digits: a mirrored 2 is not a 2)
    mean: list[float] = field(default_factory=lambda: [0.485 * 255, 0.456 * 255, 0.406 * 255])
    std: list[float] = field(default_factory=lambda: [0.229 * 255, 0.224 * 255, 0.225 * 255])
    num_threads: int = 2  # decoding threads per rank
    prefetch: int = 2
    verify_files: bool = True  # check every image file (cheaply) before training; bad ones by path
    synthetic_train_size: int = 4096
    synthetic_val_size: int = 512


@dataclass
class OptimConfig:
    name: str = "lars"
    base_lr: float = 2.0  # peak LR at ``base_batch_size``; scaled linearly with the global batch
    base_batch_size: int = 256
    momentum: float = 0.9
    weight_decay: float = 5e-4
    trust_coeff: float = 0.001
    warmup_epochs: float = 5.0
    poly_power: float = 2.0
    end_lr: float = 0.0


@dataclass
class CommConfig:
    """``strategy`` names a preset (gradientflow_repro/comm/factory.py); a null knob takes the
    preset's value, a set one overrides it, so each technique can be switched alone."""

    strategy: str = "allreduce"
    algorithm: Optional[str] = None  # builtin | ring | hierarchical
    wire: Optional[str] = None  # fp32 | fp16
    fusion: Optional[str] = None  # per_tensor | lazy | ddp
    overlap: Optional[bool] = None  # lazy: send pool parts during backward
    sparsity: Optional[str] = None  # dense | csc
    bucket_mb: float = 32.0  # lazy-allreduce pool part (fusion threshold)
    ddp_bucket_mb: float = 25.0
    segment_kb: int = 4096  # ring: pipelining segment
    ranks_per_node: Optional[int] = None  # hierarchical: default the launcher's ranks per node
    chunk_size: int = 32768  # csc: elements per chunk
    density: float = 0.1  # csc: fraction of chunks sent
    csc_warmup_epochs: float = 1.0  # csc: dense training before sparsifying
    density_ramp_epochs: int = 0  # csc: epochs after the warm-up over which density falls to `density`
    momentum_correction: bool = True
    momentum_masking: bool = True


@dataclass
class PrecisionConfig:
    dtype: str = "bf16"
    # fp16 only: GradScaler settings
    init_scale: float = 65536.0
    growth_interval: int = 2000


@dataclass
class LoggerConfig:
    wandb: bool = True
    mode: str = "offline"  # offline | online | disabled
    project: str = "gradientflow-repro"
    entity: Optional[str] = None
    group: Optional[str] = None  # defaults to the experiment name
    name: Optional[str] = None  # the run's name; defaults to the strategy
    log_every: int = 10  # steps between progress lines and JSONL step records


@dataclass
class CheckpointConfig:
    every_epochs: int = 1
    keep: int = 3


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    experiment: str = "default"
    run_dir: str = MISSING  # stable per experiment (and per Slurm job): resume=auto finds it again
    global_batch_size: int = 256
    epochs: int = 90
    eval_every_epochs: int = 1
    target_top1: Optional[float] = None  # stop when validation top-1 (percent) reaches it
    max_steps: Optional[int] = None  # stop early after this many optimizer steps (tests, smoke runs)
    seed: int = 0
    device: str = "auto"
    deterministic: bool = False
    resume: str = "auto"  # auto | never | path to a checkpoint directory
    dist_timeout_s: float = 300.0
    # a rank with no progress for this long names the lost ranks and exits (null: dist_timeout_s
    # under NCCL, whose collectives hang on a dead peer; a backstop after gloo's own timeout)
    watchdog_s: Optional[float] = None
    threads_per_rank: int = 4  # torch intra-op threads per process (CPU training)
    save_final_params: bool = False  # write params.pt at the end (tests compare runs with it)
    consistency_every_steps: int = 100  # compare parameter checksums across ranks (0: never)
    max_nonfinite_steps: int = 20  # fp16: stop after this many skipped (overflowing) steps in a row


def register_configs() -> None:
    ConfigStore.instance().store(name="base_config", node=Config)


def _fail(key: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"config key '{key}' = {value!r}: {allowed}")


def validate(cfg: Config | DictConfig, world_size: int) -> None:
    """Raise ConfigError naming the first bad key. Called before the process group starts."""
    from gradientflow_repro.comm import resolve  # late: comm imports torch.distributed

    if cfg.model.name not in MODEL_NAMES:
        _fail("model.name", cfg.model.name, f"allowed values are {', '.join(MODEL_NAMES)}")
    if cfg.model.width <= 0:
        _fail("model.width", cfg.model.width, "must be positive")
    try:
        knobs = resolve(OmegaConf.to_container(cfg.comm) if isinstance(cfg, DictConfig) else vars(cfg.comm))
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if knobs["algorithm"] == "hierarchical" and cfg.comm.ranks_per_node and world_size % cfg.comm.ranks_per_node:
        _fail("comm.ranks_per_node", cfg.comm.ranks_per_node, f"must divide the world size {world_size}")
    for key in ("comm.bucket_mb", "comm.chunk_size", "comm.segment_kb"):
        if _select(cfg, key) <= 0:
            _fail(key, _select(cfg, key), "must be positive")
    if cfg.precision.dtype not in PRECISIONS:
        _fail("precision.dtype", cfg.precision.dtype, f"allowed values are {', '.join(PRECISIONS)}")
    if cfg.device not in DEVICES:
        _fail("device", cfg.device, f"allowed values are {', '.join(DEVICES)}")
    if cfg.data.kind not in DATA_KINDS:
        _fail("data.kind", cfg.data.kind, f"allowed values are {', '.join(DATA_KINDS)}")
    if cfg.data.loader not in LOADERS:
        _fail("data.loader", cfg.data.loader, f"allowed values are {', '.join(LOADERS)}")
    for key in ("optim.base_lr", "optim.base_batch_size", "global_batch_size", "epochs",
                "eval_every_epochs", "data.image_size", "data.num_classes", "data.num_threads",
                "dist_timeout_s", "logger.log_every", "checkpoint.every_epochs", "checkpoint.keep"):
        value = _select(cfg, key)
        if value is None or value <= 0:
            _fail(key, value, "must be positive")
    if cfg.optim.name not in OPTIMIZERS:
        _fail("optim.name", cfg.optim.name, f"allowed values are {', '.join(OPTIMIZERS)}")
    if cfg.optim.name == "apex_larc" and importlib.util.find_spec("apex") is None:
        _fail("optim.name", cfg.optim.name, "needs NVIDIA apex, which is not installed (README: apex)")
    if cfg.optim.warmup_epochs < 0:
        _fail("optim.warmup_epochs", cfg.optim.warmup_epochs, "must be zero or positive")
    if cfg.optim.warmup_epochs > cfg.epochs:
        _fail("optim.warmup_epochs", cfg.optim.warmup_epochs, f"must not exceed epochs ({cfg.epochs})")
    if not 0 < cfg.data.min_crop_scale <= 1:
        _fail("data.min_crop_scale", cfg.data.min_crop_scale, "must be in (0, 1]")
    if cfg.global_batch_size % world_size != 0:
        _fail("global_batch_size", cfg.global_batch_size,
              f"must be divisible by the world size {world_size} "
              f"(nearest valid: {max(world_size, cfg.global_batch_size // world_size * world_size)})")
    if cfg.consistency_every_steps < 0:
        _fail("consistency_every_steps", cfg.consistency_every_steps, "must be zero (off) or positive")
    if cfg.max_nonfinite_steps <= 0:
        _fail("max_nonfinite_steps", cfg.max_nonfinite_steps, "must be positive")
    if cfg.watchdog_s is not None and cfg.watchdog_s <= 0:
        _fail("watchdog_s", cfg.watchdog_s, "must be positive or null")
    if cfg.max_steps is not None and cfg.max_steps <= 0:
        _fail("max_steps", cfg.max_steps, "must be positive or null")
    if cfg.target_top1 is not None and not 0 < cfg.target_top1 <= 100:
        _fail("target_top1", cfg.target_top1, "must be a percentage in (0, 100] or null")
    if cfg.logger.mode not in ("offline", "online", "disabled"):
        _fail("logger.mode", cfg.logger.mode, "allowed values are offline, online, disabled")
    if cfg.resume not in ("auto", "never") and not Path(cfg.resume).is_dir():
        _fail("resume", cfg.resume, "must be auto, never, or an existing checkpoint directory")
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


def _select(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


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
