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


def test_one_training_pipeline_serves_every_epoch_exactly(digits_root: Path) -> None:
    """Epochs read in order come from one pipeline (building one per epoch costs as much as an epoch
    at large batch) and hold exactly the batches a fresh pipeline gives for that epoch; an epoch
    cut short makes the next call start afresh, still exact."""
    persistent = source(DaliSource, digits_root, 1, 2, 64)
    streamed = [list(persistent.train_batches(epoch)) for epoch in range(3)]
    assert persistent.pipelines_built == 1
    for epoch in range(3):
        fresh = list(source(DaliSource, digits_root, 1, 2, 64).train_batches(epoch))
        for (x, y), (x_fresh, y_fresh) in zip(streamed[epoch], fresh, strict=True):
            assert torch.equal(y, y_fresh) and torch.equal(x, x_fresh), f"epoch {epoch} differs"
    cut = persistent.train_batches(3)
    next(cut)
    cut.close()  # max_steps or a stop signal in the middle of epoch 3
    again = list(persistent.train_batches(4))
    assert persistent.pipelines_built == 2
    fresh = list(source(DaliSource, digits_root, 1, 2, 64).train_batches(4))
    assert all(torch.equal(x, xf) and torch.equal(y, yf) for (x, y), (xf, yf) in zip(again, fresh, strict=True))


def test_validation_pipeline_is_built_once_and_every_pass_is_the_same(digits_root: Path) -> None:
    src = source(DaliSource, digits_root, 0, 3, 48)
    passes = [[(x, y) for x, y in src.val_batches()] for _ in range(3)]
    assert src.pipelines_built == 1
    for other in passes[1:]:
        assert all(torch.equal(x, xo) and torch.equal(y, yo) for (x, y), (xo, yo) in zip(passes[0], other, strict=True))


def test_crop_windows_follow_torchvision_random_resized_crop() -> None:
    import numpy as np

    from gradientflow_repro.data.dali import crop_window

    rng = np.random.default_rng(0)
    for width, height in [(32, 32), (500, 375), (375, 500), (40, 400)]:
        for _ in range(200):
            x, y, w, h = crop_window(width, height, rng, min_scale=0.25)
            assert 0 <= x and x + w <= width and 0 <= y and y + h <= height and w > 0 and h > 0
            if (width, height) != (40, 400):  # fall-backs aside, area and aspect stay in range
                assert 0.25 * width * height * 0.9 <= w * h and 0.7 <= w / h <= 1.4
    again = crop_window(500, 375, np.random.default_rng([3, 1, 7]), 0.25)
    assert again == crop_window(500, 375, np.random.default_rng([3, 1, 7]), 0.25)  # keyed, replayable


def test_reader_processes_give_the_same_batches(digits_root: Path) -> None:
    """On a GPU the files are read by DALI's parallel external source (worker processes): the same
    batches as reading them in the training process."""
    train = indexed(list_image_folder(digits_root / "train"))
    val = indexed(list_image_folder(digits_root / "val", train.classes))
    options = ImageOptions(image_size=32, val_resize=32, min_crop_scale=0.5, flip=True,
                           mean=(0.0,) * 3, std=(255.0,) * 3, num_threads=1, prefetch=2)
    shard = dict(device=CPU, local_batch=32, global_batch=64, rank=1, world_size=2, seed=3)
    workers = DaliSource(train, val, options, reader_workers=2, **shard)
    inline = DaliSource(train, val, options, reader_workers=0, **shard)
    for epoch in range(2):
        pairs = zip(workers.train_batches(epoch), inline.train_batches(epoch), strict=True)
        assert all(torch.equal(x, xi) and torch.equal(y, yi) for (x, y), (xi, yi) in pairs)
