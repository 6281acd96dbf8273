"""ImageNet from shards: writing (manifest, resume, verification), DALI's webdataset reader on the
CPU (each image once per epoch across ranks, one pipeline for every epoch), the loader's refusals,
and the staging command."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gradientflow_repro.config import DataConfig
from gradientflow_repro.data import build_data
from gradientflow_repro.data.listing import DatasetError, ImageOptions, list_image_folder
from gradientflow_repro.data.shard_reader import ShardSource
from gradientflow_repro.data.shards import MANIFEST, load_manifest, sha256_of, verify_shards, write_shards
from gradientflow_repro.data.stage import main as stage_main

from conftest import REPO

CPU = torch.device("cpu")
OPTIONS = ImageOptions(image_size=32, val_resize=32, min_crop_scale=0.5, flip=True, mean=(0.0,) * 3,
                       std=(255.0,) * 3, num_threads=1, prefetch=2)


@pytest.fixture(scope="module")
def digit_shards(digits_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The digits (1,442 training and 355 validation images) in shards of 200, by two processes."""
    out = tmp_path_factory.mktemp("shards") / "digits"
    write_shards(digits_root, out, samples_per_shard=200, seed=5, workers=2)
    return out


@pytest.fixture(scope="module")
def one_per_class(digits_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """48 classes of one training and one validation image each, in shards of 10: a label names
    its image, so the reader's output says which images it delivered."""
    folder = tmp_path_factory.mktemp("one_per_class")
    images = sorted((digits_root / "train").rglob("*.JPEG"))
    for number in range(48):
        for split, image in (("train", images[2 * number]), ("val", images[2 * number + 1])):
            (folder / split / f"c{number:02d}").mkdir(parents=True)
            shutil.copy(image, folder / split / f"c{number:02d}" / image.name)
    write_shards(folder, folder / "shards", samples_per_shard=10)
    return folder / "shards"


def shard_source(root: Path, rank: int, world: int, local_batch: int, **options) -> ShardSource:
    return ShardSource(load_manifest(root), ImageOptions(**{**OPTIONS.__dict__, **options}), device=CPU,
                       shuffle_buffer=16, local_batch=local_batch, global_batch=local_batch * world, rank=rank,
                       world_size=world, seed=3)


def test_the_manifest_describes_the_shards(digits_root: Path, digit_shards: Path) -> None:
    manifest = json.loads((digit_shards / MANIFEST).read_text())
    train = list_image_folder(digits_root / "train")
    assert manifest["classes"] == train.classes and manifest["format_version"] == 1
    assert manifest["source_root"] == str(digits_root) and manifest["seed"] == 5
    for split, listing in (("train", train), ("val", list_image_folder(digits_root / "val", train.classes))):
        described = manifest["splits"][split]
        assert described["samples"] == len(listing) == sum(s["samples"] for s in described["shards"])
        assert described["counts_per_class"] == {c: listing.labels.count(i) for i, c in enumerate(train.classes)}
        assert [s["samples"] for s in described["shards"]][:-1] == [200] * (len(described["shards"]) - 1)
        for record in described["shards"]:
            for kind, size, digest in (("tar", "bytes", "sha256"), ("index", "index_bytes", "index_sha256")):
                path = digit_shards / record[kind]
                assert path.stat().st_size == record[size] and sha256_of(path) == record[digest]
    assert load_manifest(digit_shards).train.samples == 1442
    # shuffled once: the first shard already holds every class
    source = shard_source(digit_shards, 0, 8, 25)  # rank 0 of 8 reads about the first shard
    first_batches = [y for _, (_, y) in zip(range(4), source.train_batches(0))]
    assert len({int(i) for y in first_batches for i in y}) == 10
    assert verify_shards(digit_shards) == []


def test_a_rerun_keeps_verified_shards_and_completes_an_interrupted_set(digits_root: Path, digit_shards: Path,
                                                                       tmp_path: Path) -> None:
    """As a run killed while writing leaves it: a shard missing, a temporary file, no manifest; and
    one shard corrupted since. The rerun rewrites those two, the same bytes as before, and keeps
    every other file as it is (not rewritten)."""
    out = shutil.copytree(digit_shards, tmp_path / "shards")
    original = (out / MANIFEST).read_text()
    (out / MANIFEST).unlink()
    (out / "train" / "train-000003.tar").unlink()
    (out / "train" / ".train-000005.tar.partial-12345").write_bytes(b"half a shard")
    corrupted = out / "train" / "train-000001.tar"
    data = bytearray(corrupted.read_bytes())
    data[5000] ^= 0xFF
    corrupted.write_bytes(bytes(data))
    before = {p.name: p.stat().st_mtime_ns for p in (out / "train").iterdir()}
    write_shards(digits_root, out, samples_per_shard=200, seed=5, workers=1)
    assert (out / MANIFEST).read_text() == original
    after = {p.name: p.stat().st_mtime_ns for p in (out / "train").iterdir()}
    assert not any(".partial-" in name for name in after)
    rewritten = {name for name in after if after[name] != before.get(name)}
    assert rewritten == {"train-000001.tar", "train-000003.tar", "train-000001.idx", "train-000003.idx",
                         "train-000001.json", "train-000003.json"}
    assert verify_shards(out) == []


def test_verification_and_the_loader_catch_corrupted_shards(digit_shards: Path, tmp_path: Path) -> None:
    out = shutil.copytree(digit_shards, tmp_path / "shards")
    flipped, cut = out / "train" / "train-000002.tar", out / "val" / "val-000001.tar"
    data = bytearray(flipped.read_bytes())
    data[-2000] ^= 0x01
    flipped.write_bytes(bytes(data))
    cut.write_bytes(cut.read_bytes()[:-512])
    problems = verify_shards(out)
    assert len(problems) == 2 and "sha256" in problems[0] and "train-000002.tar" in problems[0]
    assert "val-000001.tar" in problems[1] and "the manifest says" in problems[1]
    script = subprocess.run([sys.executable, str(REPO / "scripts" / "prepare_imagenet.py"), "--verify-shards",
                             str(out), "--workers", "1"], capture_output=True, text=True, timeout=120)
    assert script.returncode == 1 and "train-000002.tar" in script.stdout
    with pytest.raises(DatasetError, match=r"val-000001\.tar: \d+ bytes, the manifest says"):
        load_manifest(out)  # the start-up check: sizes (a flipped byte is verify_shards' to find)
    (out / "train" / "train-000004.idx").unlink()
    with pytest.raises(DatasetError, match=r"train-000004\.idx: missing"):
        load_manifest(out)


def test_the_loader_is_chosen_by_configuration_and_refuses_a_missing_manifest(digit_shards: Path,
                                                                              tmp_path: Path) -> None:
    cfg = DataConfig(kind="shards", root=str(digit_shards), num_classes=10, image_size=32, val_resize=32,
                     num_threads=1, shuffle_buffer=32)
    data = build_data(cfg, global_batch=64, rank=0, world_size=2, device=CPU, seed=0)
    assert isinstance(data, ShardSource) and data.num_train == 1442 and data.steps_per_epoch == 1442 // 64
    images, labels = next(iter(data.train_batches(0)))
    assert images.shape == (32, 3, 32, 32) and labels.dtype == torch.int64
    with pytest.raises(DatasetError, match=f"{tmp_path}/manifest.json: no shard manifest"):
        build_data(DataConfig(kind="shards", root=str(tmp_path), num_classes=10), global_batch=64, rank=0,
                   world_size=1, device=CPU, seed=0)
    with pytest.raises(DatasetError, match="10 classes but data.num_classes=1000"):
        build_data(DataConfig(kind="shards", root=str(digit_shards)), global_batch=64, rank=0, world_size=1,
                   device=CPU, seed=0)
    with pytest.raises(DatasetError, match="data.loader=torchvision"):
        build_data(DataConfig(kind="shards", root=str(digit_shards), num_classes=10, loader="torchvision"),
                   global_batch=64, rank=0, world_size=1, device=CPU, seed=0)


def _epochs(sources: list[ShardSource], epochs: int) -> list[list[list[int]]]:
    """[epoch][rank] -> the labels each rank delivered in that epoch."""
    return [[[int(i) for _, y in source.train_batches(epoch) for i in y] for source in sources]
            for epoch in range(epochs)]


def test_every_image_once_per_epoch_across_ranks_from_one_pipeline(one_per_class: Path) -> None:
    """48 images, 2 ranks of 6: each epoch holds all 48 once, the ranks swap halves every epoch,
    the order changes, and one pipeline per rank serves all the epochs."""
    sources = [shard_source(one_per_class, rank, 2, 6) for rank in range(2)]
    seen = _epochs(sources, 3)
    for epoch in seen:
        assert sorted(epoch[0] + epoch[1]) == list(range(48))
        assert all(len(part) == 4 * 6 for part in epoch)
    assert set(seen[0][0]) == set(seen[1][1]) == set(seen[2][0])  # rank r reads part (r + epoch) % 2
    assert seen[0][0] != seen[2][0]  # another order
    assert [source.pipelines_built for source in sources] == [1, 1]


@pytest.mark.parametrize("world,local_batch", [(2, 5), (3, 4)])
def test_a_split_that_does_not_divide_gives_each_image_at_most_once(one_per_class: Path, world: int,
                                                                   local_batch: int) -> None:
    """48 images, 2 x 5 (4 steps: 40 images, and per rank 4 of the 5 batches of its 24-image part,
    padded by DALI: one dropped) or 3 x 4 (4 steps: 48 images, no batch dropped): no image twice in
    an epoch, every rank the same number of steps."""
    sources = [shard_source(one_per_class, rank, world, local_batch) for rank in range(world)]
    steps = 48 // (world * local_batch)
    for epoch in _epochs(sources, 3):
        together = [i for part in epoch for i in part]
        assert len(together) == len(set(together)) == steps * world * local_batch
    assert sources[0].discarded_per_epoch == (1 if world == 2 else 0)
    assert [source.pipelines_built for source in sources] == [1] * world


def test_resume_reads_the_same_part_and_validation_each_image_once(one_per_class: Path) -> None:
    whole = [shard_source(one_per_class, rank, 2, 6) for rank in range(2)]
    uninterrupted = _epochs(whole, 2)
    resumed = shard_source(one_per_class, 1, 2, 6)
    tail = [int(i) for _, y in resumed.train_batches(1, skip=2) for i in y]
    assert len(tail) == 2 * 6 and set(tail) <= set(uninterrupted[1][1])  # the part rank 1 reads in epoch 1
    nxt = [int(i) for _, y in resumed.train_batches(2) for i in y]
    assert set(nxt) == set(uninterrupted[0][1])  # epoch 2: the part of epoch 0 again
    for world in (2, 3):
        sources = [shard_source(one_per_class, rank, world, 5) for rank in range(world)]
        for _ in range(2):  # a second pass from the same pipelines
            labels = [int(i) for source in sources for _, y in source.val_batches() for i in y]
            assert sorted(labels) == list(range(48))
        assert [source.pipelines_built for source in sources] == [1] * world


def test_channels_last_half_batches_hold_the_same_values(one_per_class: Path) -> None:
    plain = shard_source(one_per_class, 0, 1, 8)
    nhwc = shard_source(one_per_class, 0, 1, 8, channels_last=True, output_dtype=torch.float16)
    for (x, y), (xc, yc) in zip(plain.train_batches(0), nhwc.train_batches(0), strict=True):
        assert xc.shape == x.shape and xc.dtype == torch.float16
        assert xc.is_contiguous(memory_format=torch.channels_last) and not xc.is_contiguous()
        assert torch.equal(y, yc) and torch.allclose(xc.float(), x, atol=2e-3)


def test_stage_copies_once_and_refuses_a_bad_source(digit_shards: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    target = tmp_path / "local"
    assert stage_main(["--manifest", str(digit_shards / MANIFEST), "--to", str(target), "--workers", "2"]) == 0
    first = capsys.readouterr().out
    total = sum(p.stat().st_size for p in digit_shards.rglob("*") if p.suffix in (".tar", ".idx"))
    assert f"copied {total / 1e9:.2f} GB, kept 0.00 GB" in first and "GB/s" in first
    assert verify_shards(target) == [] and load_manifest(target).train.samples == 1442
    assert not list(target.rglob(".*partial*")) and [p.name for p in target.rglob("*.json")] == [MANIFEST]
    times = {p: p.stat().st_mtime_ns for p in target.rglob("*")}
    assert stage_main(["--manifest", str(digit_shards / MANIFEST), "--to", str(target)]) == 0
    assert "copied 0.00 GB" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in target.rglob("*")} == times  # nothing rewritten
    damaged = target / "train" / "train-000000.tar"
    data = bytearray(damaged.read_bytes())
    data[3000] ^= 0xFF
    damaged.write_bytes(bytes(data))
    assert stage_main(["--manifest", str(digit_shards / MANIFEST), "--to", str(target), "--verify"]) == 0
    assert verify_shards(target) == []  # the same-size damage is found by --verify and copied again
    broken = shutil.copytree(digit_shards, tmp_path / "broken")
    (broken / "val" / "val-000000.tar").write_bytes(b"short")
    run = subprocess.run([sys.executable, "-m", "gradientflow_repro.data.stage", "--manifest",
                          str(broken / MANIFEST), "--to", str(tmp_path / "other")],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert run.returncode == 1 and "val-000000.tar: 5 bytes, the manifest says" in run.stderr
    assert not (tmp_path / "other" / MANIFEST).exists()
