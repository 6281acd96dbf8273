"""The loader's CPU defaults (threads and reader workers follow the rank's CPUs), the reader workers'
queue depth, and label copies that never wait for the host."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gradientflow_repro.data import cpus
from gradientflow_repro.data.cpus import loader_cpus, rank_cpus, source_queue_depth
from gradientflow_repro.data.dali import DaliSource
from gradientflow_repro.data.folder import TorchvisionSource
from gradientflow_repro.data.listing import ImageOptions, list_image_folder

CPU = torch.device("cpu")
MANY = set(range(96))  # a whole node's affinity mask


@pytest.mark.parametrize("environ,affinity,expected", [
    ({"SLURM_CPUS_PER_TASK": "12"}, MANY, (12, "SLURM_CPUS_PER_TASK")),
    ({"SLURM_CPUS_PER_TASK": "12"}, set(range(4)), (4, "SLURM_CPUS_PER_TASK")),  # the mask binds
    ({}, set(range(8)), (8, "affinity mask")),
    ({"SLURM_CPUS_PER_TASK": "twelve"}, set(range(6)), (6, "affinity mask")),
    ({"SLURM_CPUS_PER_TASK": "0"}, set(range(6)), (6, "affinity mask")),
    ({"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "8"}, MANY, (12, "affinity mask shared by 8 torchrun ranks")),
    ({"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "4", "SLURM_CPUS_PER_TASK": "48"}, MANY,
     (12, "SLURM_CPUS_PER_TASK shared by 4 torchrun ranks")),
    ({"LOCAL_WORLD_SIZE": "8"}, set(range(12)), (12, "affinity mask")),  # srun binds each task itself
    ({"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "8"}, set(range(4)),
     (1, "affinity mask shared by 8 torchrun ranks")),
])
def test_rank_cpus_follow_slurm_then_the_affinity_mask(environ: dict, affinity: set, expected: tuple) -> None:
    assert rank_cpus(environ, affinity) == expected


def test_rank_cpus_read_this_process_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "12")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda pid: MANY, raising=False)
    assert rank_cpus() == (12, "SLURM_CPUS_PER_TASK")


@pytest.mark.parametrize("cpu_count,on_gpu,threads,workers", [
    (12, True, 9, 2),   # the 512-GPU templates: one core for the trainer, 2 read, 9 decode
    (8, True, 6, 1),
    (2, True, 1, 1),    # at least one reader on a GPU: reading in the trainer stalls its loop
    (1, True, 1, 1),
    (12, False, 11, 0),  # no GPU: files read in the training process, as before
    (1, False, 1, 0),
])
def test_threads_and_workers_follow_the_cpus(cpu_count: int, on_gpu: bool, threads: int, workers: int) -> None:
    got = loader_cpus(None, None, on_gpu=on_gpu, environ={"SLURM_CPUS_PER_TASK": str(cpu_count)}, affinity=MANY)
    assert (got.cpus, got.threads, got.workers) == (cpu_count, threads, workers)


def test_a_value_given_wins_and_the_other_takes_what_is_left() -> None:
    def split(threads: int | None, workers: int | None, on_gpu: bool = True) -> tuple[int, int]:
        got = loader_cpus(threads, workers, on_gpu=on_gpu, environ={"SLURM_CPUS_PER_TASK": "12"}, affinity=MANY)
        return got.threads, got.workers

    assert split(4, None) == (4, 2)
    assert split(None, 5) == (6, 5)
    assert split(None, 0) == (11, 0)
    assert split(3, 1, on_gpu=False) == (3, 1)


@pytest.mark.parametrize("prefetch,workers,depth", [(2, 0, 2), (2, 1, 2), (2, 2, 2), (2, 5, 5), (1, 3, 3), (4, 2, 4)])
def test_reader_queue_depth_covers_the_workers(prefetch: int, workers: int, depth: int) -> None:
    assert source_queue_depth(prefetch, workers) == depth


def options(num_threads: int | None, prefetch: int = 2) -> ImageOptions:
    return ImageOptions(image_size=32, val_resize=32, min_crop_scale=0.5, flip=True, mean=(0.0,) * 3,
                        std=(255.0,) * 3, num_threads=num_threads, prefetch=prefetch)


def folder_source(kind: type, root: Path, num_threads: int | None, device: torch.device = CPU, **extra):
    train = list_image_folder(root / "train")
    val = list_image_folder(root / "val", train.classes)
    return kind(train, val, options(num_threads, extra.pop("prefetch", 2)), device=device, local_batch=32,
                global_batch=32, rank=0, world_size=1, seed=0, **extra)


def test_dali_source_takes_the_default_rule(digits_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """num_threads null and reader_workers null: what the rule gives for the task's CPUs, on a GPU and
    off one (nothing is built: the constructor only decides)."""
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "20")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda pid: MANY, raising=False)
    on_gpu = folder_source(DaliSource, digits_root, None, torch.device("cuda", 0))
    assert (on_gpu.reader_workers, on_gpu.common["num_threads"], on_gpu.source_depth) == (4, 15, 4)
    on_cpu = folder_source(DaliSource, digits_root, None)
    assert (on_cpu.reader_workers, on_cpu.common["num_threads"], on_cpu.source_depth) == (0, 19, 2)
    pinned = folder_source(DaliSource, digits_root, 1)  # digits' configuration: as it always ran
    assert (pinned.reader_workers, pinned.common["num_threads"]) == (0, 1)
    assert folder_source(TorchvisionSource, digits_root, None).loader_args["num_workers"] == 19


def test_parallel_source_schedules_a_batch_for_every_worker(digits_root: Path) -> None:
    """The built pipeline's parallel external source has a queue as deep as its workers, above the
    pipeline's own depth (DALI's default of 1 would keep two of the three workers idle)."""
    src = folder_source(DaliSource, digits_root, 1, reader_workers=3, prefetch=1)
    images, labels = next(src.train_batches(0))
    pipe = src._train[1]._pipes[0]
    assert pipe.py_num_workers == 3
    assert [group.prefetch_queue_depth for group in pipe._parallel_input_callbacks] == [3]
    assert images.shape == (32, 3, 32, 32) and labels.shape == (32,)


def record_device_copies(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, bool]]:
    """(non_blocking, source pinned) of every Tensor.to(<device>) from now on."""
    copies: list[tuple[bool, bool]] = []
    original = torch.Tensor.to

    def to(self: torch.Tensor, *args, **kwargs):
        if args and isinstance(args[0], torch.device):
            copies.append((bool(kwargs.get("non_blocking", False)), self.is_pinned()))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    return copies


def test_torchvision_copies_images_and_labels_without_a_host_sync(digits_root: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    src = folder_source(TorchvisionSource, digits_root, 0)
    copies = record_device_copies(monkeypatch)
    next(src.train_batches(0))
    next(src.val_batches())
    assert len(copies) == 4 and all(non_blocking for non_blocking, _ in copies), copies


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: pinned host memory")
def test_torchvision_labels_arrive_from_pinned_memory_without_a_host_sync(digits_root: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    device = torch.device("cuda", 0)
    src = folder_source(TorchvisionSource, digits_root, 0, device)
    copies = record_device_copies(monkeypatch)
    images, labels = next(src.train_batches(0))
    assert copies == [(True, True), (True, True)]  # images and labels: pinned, non_blocking
    assert images.device == labels.device == device and labels.dtype == torch.int64


def test_imagenet_config_follows_the_cpus_and_digits_keeps_one_thread(digits_root: Path) -> None:
    from gradientflow_repro.config import ConfigError, compose, validate

    paper = compose(["+experiment=alexnet_512gpu", f"data.root={digits_root}", "data.num_classes=10"])
    assert paper.data.num_threads is None
    validate(paper, world_size=512)
    assert compose(["+experiment=digits_cpu"]).data.num_threads == 1
    with pytest.raises(ConfigError, match="num_threads"):
        validate(compose(["+experiment=alexnet_512gpu", f"data.root={digits_root}", "data.num_threads=0"]),
                 world_size=512)
