"""Data: the embedded dataset, sharding (each validation image exactly once), exact mid-epoch resume."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from gradientflow_repro.data.dali import DaliSource
from gradientflow_repro.data.digits import build_digits
from gradientflow_repro.data.folder import TorchvisionSource
from gradientflow_repro.data.listing import DatasetError, ImageOptions, Listing, list_image_folder

CPU = torch.device("cpu")


def indexed(listing: Listing) -> Listing:
    """Same files, label = position in the listing: the loader's labels then name the images."""
    return Listing(listing.classes, listing.files, list(range(len(listing))))


def source(kind: type, root: Path, rank: int, world: int, global_batch: int, threads: int = 1):
    train = indexed(list_image_folder(root / "train"))
    val = indexed(list_image_folder(root / "val", train.classes))
    options = ImageOptions(image_size=32, val_resize=32, min_crop_scale=0.5, flip=True,
                           mean=(0.0,) * 3, std=(255.0,) * 3, num_threads=threads, prefetch=2)
    return kind(train, val, options, device=CPU, local_batch=global_batch // world,
                global_batch=global_batch, rank=rank, world_size=world, seed=3)


def test_digits_build_is_deterministic(tmp_path: Path) -> None:
    def digest(root: Path) -> dict[str, str]:
        return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(root.rglob("*.JPEG"))}

    first, second = digest(build_digits(tmp_path / "a")), digest(build_digits(tmp_path / "b"))
    assert first == second
    assert len(first) == 1797
    assert sum(k.startswith("val/") for k in first) == 355
    assert len({k.split("/")[1] for k in first}) == 10
    assert not (tmp_path / "a.partial").exists()


@pytest.mark.parametrize("world,batch_per_rank", [(1, 64), (2, 13), (3, 16), (4, 7)])
def test_dali_validation_sees_each_image_exactly_once(digits_root: Path, world: int,
                                                      batch_per_rank: int) -> None:
    seen: list[int] = []
    for rank in range(world):
        src = source(DaliSource, digits_root, rank, world, batch_per_rank * world)
        for _ in range(2):  # a second pass (the next evaluation) sees the same shard again
            shard = [int(i) for _, labels in src.val_batches() for i in labels]
        seen += shard
    assert sorted(seen) == list(range(src.num_val))


@pytest.mark.parametrize("world", [2, 3])
def test_dali_training_shards_are_disjoint_and_equal_length(digits_root: Path, world: int) -> None:
    global_batch = 30 * world
    per_rank = []
    for rank in range(world):
        src = source(DaliSource, digits_root, rank, world, global_batch)
        batches = list(src.train_batches(epoch=1))
        assert len(batches) == src.steps_per_epoch == src.num_train // global_batch
        assert all(images.shape == (30, 3, 32, 32) for images, _ in batches)
        per_rank.append([int(i) for _, labels in batches for i in labels])
    together = [i for shard in per_rank for i in shard]
    assert len(set(together)) == len(together)  # no image twice in one epoch


def test_epochs_differ_and_repeat_exactly(digits_root: Path) -> None:
    src = source(DaliSource, digits_root, 0, 2, 64)
    epoch0 = [labels for _, labels in src.train_batches(0)]
    again = [labels for _, labels in src.train_batches(0)]
    epoch1 = [labels for _, labels in src.train_batches(1)]
    assert all(torch.equal(a, b) for a, b in zip(epoch0, again))
    assert not all(torch.equal(a, b) for a, b in zip(epoch0, epoch1))


@pytest.mark.parametrize("kind", [DaliSource, TorchvisionSource])
def test_mid_epoch_resume_replays_the_same_batches(digits_root: Path, kind: type) -> None:
    src = source(kind, digits_root, 1, 2, 64, threads=0 if kind is TorchvisionSource else 1)
    full = list(src.train_batches(epoch=2))
    tail = list(src.train_batches(epoch=2, skip=5))
    assert len(tail) == len(full) - 5
    for (x_full, y_full), (x_tail, y_tail) in zip(full[5:], tail):
        assert torch.equal(y_full, y_tail) and torch.equal(x_full, x_tail)


def test_torchvision_fallback_reads_the_same_shards(digits_root: Path) -> None:
    dali = source(DaliSource, digits_root, 1, 3, 48)
    folder = source(TorchvisionSource, digits_root, 1, 3, 48, threads=0)
    assert [y.tolist() for _, y in dali.train_batches(4)] == [y.tolist() for _, y in folder.train_batches(4)]
    assert sorted(int(i) for _, y in dali.val_batches() for i in y) == \
        sorted(int(i) for _, y in folder.val_batches() for i in y)
    x_dali, x_folder = next(dali.val_batches())[0], next(folder.val_batches())[0]
    assert x_dali.shape == x_folder.shape and (x_dali - x_folder).abs().mean() < 0.02


def test_empty_class_folder_is_named(tmp_path: Path) -> None:
    (tmp_path / "train" / "cat").mkdir(parents=True)
    with pytest.raises(DatasetError, match="cat: class folder has no images"):
        list_image_folder(tmp_path / "train")


def test_validation_classes_must_match_training(digits_root: Path, tmp_path: Path) -> None:
    train = list_image_folder(digits_root / "train")
    (tmp_path / "digit_0").mkdir()
    with pytest.raises(DatasetError, match="differ from training"):
        list_image_folder(tmp_path, train.classes)
