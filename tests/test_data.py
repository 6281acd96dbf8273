"""Data: the embedded dataset, sharding (each validation image exactly once), exact mid-epoch resume."""

from __future__ import annotations

import hashlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from gradientflow_repro.data.dali import DaliSource
from gradientflow_repro.data.digits import build_digits
from gradientflow_repro.data.folder import TorchvisionSource
from gradientflow_repro.data.listing import DatasetError, ImageOptions, Listing, list_image_folder

from conftest import REPO
from support import process_group

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


@pytest.mark.parametrize("kind", [DaliSource, TorchvisionSource])
def test_channels_last_batches_equal_the_nchw_batches(digits_root: Path, kind: type) -> None:
    """data.channels_last: NCHW-shaped batches in channels_last memory (DALI emits NHWC, permuted
    without a copy; the torchvision loader converts), with the values of the plain batches; float16
    where asked (fp16 runs)."""
    train = indexed(list_image_folder(digits_root / "train"))
    val = indexed(list_image_folder(digits_root / "val", train.classes))
    threads = 0 if kind is TorchvisionSource else 1

    def make(**layout):
        options = ImageOptions(image_size=32, val_resize=32, min_crop_scale=0.5, flip=True, mean=(0.0,) * 3,
                               std=(255.0,) * 3, num_threads=threads, prefetch=2, **layout)
        return kind(train, val, options, device=CPU, local_batch=32, global_batch=64, rank=1, world_size=2, seed=3)

    plain, nhwc = make(), make(channels_last=True)
    half = make(channels_last=True, output_dtype=torch.float16)
    for batches in (lambda s: s.train_batches(1), lambda s: s.val_batches()):
        for (x, y), (xc, yc), (xh, yh) in zip(batches(plain), batches(nhwc), batches(half), strict=True):
            assert xc.shape == x.shape and xc.is_contiguous(memory_format=torch.channels_last)
            assert not xc.is_contiguous() and x.is_contiguous()
            assert torch.equal(xc, x) and torch.equal(yc, y) and torch.equal(yh, y)
            assert xh.dtype == torch.float16 and xh.is_contiguous(memory_format=torch.channels_last)
            assert torch.allclose(xh.float(), x, atol=2e-3)


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


# The torchvision loader's workers, in a process of their own (the fork server is one per process:
# the test process's is left alone). A thread runs, as gloo's do in a trainer. The script reads part
# of an epoch with workers and without, makes two validation passes, sends one validation worker
# the SIGTERM that Process.terminate() sends, and exits with the other still running.
FORK_SERVER_SCENARIO = r"""
import json, os, signal, sys, threading, time
from pathlib import Path
import torch
from gradientflow_repro.data.folder import TorchvisionSource
from gradientflow_repro.data.listing import ImageOptions, list_image_folder

def children(pid):
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []

def blocked(pid):
    line = next(l for l in Path(f"/proc/{pid}/status").read_text().splitlines() if l.startswith("SigBlk:"))
    return [s for s in (signal.SIGUSR1, signal.SIGTERM) if int(line.split()[1], 16) >> (s - 1) & 1]

threading.Thread(target=threading.Event().wait, daemon=True).start()
root = Path(sys.argv[1])
train = list_image_folder(root / "train")
val = list_image_folder(root / "val", train.classes)
options = ImageOptions(image_size=32, val_resize=32, min_crop_scale=0.5, flip=True, mean=(0.0,) * 3,
                       std=(255.0,) * 3, num_threads=1, prefetch=2)
shard = dict(device=torch.device("cpu"), local_batch=32, global_batch=64, rank=1, world_size=2, seed=3)
src = TorchvisionSource(train, val, options, reader_workers=2, **shard)
inline = TorchvisionSource(train, val, options, reader_workers=0, **shard)
epoch = src.train_batches(1)
first = [next(epoch) for _ in range(3)]
server = [c for c in children(os.getpid())  # started as python -c "from multiprocessing.forkserver import main; ..."
          if any(arg.startswith(b"from multiprocessing.forkserver")
                 for arg in Path(f"/proc/{c}/cmdline").read_bytes().split(b"\0"))]
train_workers = sorted(w for s in server for w in children(s))
report = {"method": src.loader_args["multiprocessing_context"].get_start_method(), "server": server,
          "children": children(os.getpid()), "train_workers": train_workers,
          "server_threads": [len(os.listdir(f"/proc/{s}/task")) for s in server],
          "blocked": {p: blocked(p) for p in server + train_workers},
          "same_batches": all(torch.equal(x, xi) and torch.equal(y, yi)
                              for (x, y), (xi, yi) in zip(first, inline.train_batches(1)))}
epoch.close()
passes, val_workers = [], []
for _ in range(2):
    batches = src.val_batches()
    passes.append([next(batches)])
    val_workers.append(sorted(w for s in server for w in children(s)))
    passes[-1] += list(batches)
report["val_workers"] = val_workers
report["same_passes"] = all(torch.equal(x, xo) and torch.equal(y, yo)
                            for (x, y), (xo, yo) in zip(passes[0], passes[1], strict=True))
report["terminated"] = None
for victim in [w for w in val_workers[-1] if Path(f"/proc/{w}").exists()][:1]:
    os.kill(victim, signal.SIGTERM)  # what Process.terminate() does: the trainer's SIGTERM
    deadline = time.monotonic() + 20
    while Path(f"/proc/{victim}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    report["terminated"] = not Path(f"/proc/{victim}").exists()
print(json.dumps(report), flush=True)
"""


def _gone(pgid: int, within_s: float) -> list[int]:
    """What is left of process group ``pgid`` after waiting up to ``within_s`` for it to empty."""
    deadline = time.monotonic() + within_s
    while process_group(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return process_group(pgid)


def _scenario(script: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, *args], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_torchvision_workers_come_from_a_fork_server_and_validation_keeps_its_workers(digits_root: Path) -> None:
    """No worker is a fork of the (threaded) training process: they are the fork server's children,
    born with the stop signals blocked (the server too), and give the batches the training process
    reads itself. Validation starts its workers once for every pass. A worker ends at the trainer's
    SIGTERM (its parent is the server), and the trainer exits with one still running, leaving
    nothing behind."""
    job = _scenario(FORK_SERVER_SCENARIO, str(digits_root))
    try:
        output = job.communicate(timeout=90)[0]
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        raise AssertionError(f"no exit within 90 s:\n{job.communicate()[0][-3000:]}") from None
    assert job.returncode == 0, output[-3000:]
    left = _gone(job.pid, 10)
    assert not left, f"left running after the trainer exited: {left}"
    report = json.loads(output.strip().splitlines()[-1])
    assert report["method"] == "forkserver", report
    assert len(report["server"]) == 1 and report["server_threads"] == [1], report
    assert len(report["train_workers"]) == 2, report
    assert not set(report["train_workers"]) & set(report["children"]), report  # not the trainer's forks
    assert all(got == [signal.SIGUSR1, signal.SIGTERM] for got in report["blocked"].values()), report
    assert report["same_batches"], report
    assert report["val_workers"][0] == report["val_workers"][1] and len(report["val_workers"][0]) == 2, report
    assert not set(report["val_workers"][0]) & set(report["train_workers"]), report
    assert report["same_passes"], report
    assert report["terminated"], report


# Files that deliver late or never (FIFOs: as on a file system that is slow or stopped answering).
# Training, with the loader looking at its workers every 0.3 s: the first file of the epoch arrives
# 1.5 s after a worker starts reading it (a thread writes a real image into it), and the batch must
# be the one read in the process. Validation, limit 2 s: the shard's first file never delivers a
# byte. The test then kills the script.
STUCK_SCENARIO = r"""
import json, os, sys, threading, time
from pathlib import Path
import torch
import gradientflow_repro.data.folder as folder
from gradientflow_repro.data.folder import LoaderError, TorchvisionSource
from gradientflow_repro.data.listing import ImageOptions, Listing, epoch_permutation, list_image_folder

root, stuck, late = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
folder.POLL_S = 0.3
train = list_image_folder(root / "train")
val = list_image_folder(root / "val", train.classes)
options = ImageOptions(image_size=32, val_resize=32, min_crop_scale=0.5, flip=True, mean=(0.0,) * 3,
                       std=(255.0,) * 3, num_threads=1, prefetch=2)
shard = dict(device=torch.device("cpu"), reader_workers=2, local_batch=32, global_batch=32, rank=0, world_size=1,
             seed=0)
first = epoch_permutation(len(train), 0, 0)[0]
slow = Listing(train.classes, [late if i == first else f for i, f in enumerate(train.files)], train.labels)
image = Path(train.files[first]).read_bytes()

def write_late():
    with open(late, "wb") as fifo:  # returns once a worker opens the file to read it
        time.sleep(1.5)
        fifo.write(image)

threading.Thread(target=write_late, daemon=True).start()
started = time.monotonic()
late_batch = next(TorchvisionSource(slow, val, options, worker_timeout_s=30, **shard).train_batches(0))
report = {"late_s": time.monotonic() - started}
inline = next(TorchvisionSource(train, val, options, **{**shard, "reader_workers": 0}).train_batches(0))
report["late_same"] = all(torch.equal(a, b) for a, b in zip(late_batch, inline))
val = Listing(val.classes, [stuck] + val.files[1:], val.labels)
batches = TorchvisionSource(train, val, options, worker_timeout_s=2, **shard).val_batches()
started = time.monotonic()
try:
    next(batches)
    report["error"] = None
except LoaderError as error:
    report.update(error=str(error), after_s=time.monotonic() - started)
print(json.dumps(report), flush=True)
sys.stdin.readline()  # the test kills this process meanwhile
"""


def test_a_stuck_torchvision_worker_is_named_and_nothing_outlives_a_killed_trainer(digits_root: Path,
                                                                                   tmp_path: Path) -> None:
    """A worker slower than the loader's looks at its workers still delivers; one that delivers
    nothing within the limit ends the wait with a one-line error naming the loader, the worker and
    the limit. When the trainer is killed, its workers and their server end too."""
    stuck, late = tmp_path / "never.JPEG", tmp_path / "late.JPEG"
    os.mkfifo(stuck)
    os.mkfifo(late)
    job = _scenario(STUCK_SCENARIO, str(digits_root), str(stuck), str(late))
    lines: queue.Queue = queue.Queue()  # the script's output, read with a deadline (a hang is a failure)
    threading.Thread(target=lambda: [*map(lines.put, job.stdout), lines.put("")], daemon=True).start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while not seen or not seen[-1].startswith("{"):
            try:
                seen.append(lines.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                raise AssertionError("no batch and no error within 60 s:\n" + "".join(seen)[-3000:]) from None
            assert seen[-1], "the script ended early:\n" + "".join(seen)[-3000:]
        report = json.loads(seen[-1])
        assert 1.5 <= report["late_s"] < 20 and report["late_same"], report  # late, not lost
        assert report["error"] is not None, "a batch came from a file that never delivers a byte"
        assert re.fullmatch(r"torchvision loader, validation: no batch from worker 0 \(pid \d+\) for 2 s "
                            r"\(the loader's limit\): .*data\.reader_workers=0.*", report["error"]), report
        assert 2 <= report["after_s"] < 10, report
        # the script, the tracker, the server, the workers
        assert len(process_group(job.pid)) >= 4, process_group(job.pid)
        os.kill(job.pid, signal.SIGKILL)  # the trainer dies: its workers, and their server, must follow
        job.wait(timeout=10)
        left = _gone(job.pid, 15)
        assert not left, f"left running after the trainer was killed: {left}"
    finally:
        if process_group(job.pid):
            os.killpg(job.pid, signal.SIGKILL)


@pytest.mark.parametrize("line", ["x.JPEG ../../outside", "../x.JPEG n01", "x.JPEG .", "sub/x.JPEG n01"])
def test_a_validation_label_that_is_not_a_plain_name_is_refused_naming_its_line(line: str, tmp_path: Path) -> None:
    from gradientflow_repro.data.imagenet import read_val_labels

    labels = tmp_path / "labels.txt"
    labels.write_text(f"ok.JPEG n02\n{line}\n")
    with pytest.raises(SystemExit, match=r"labels\.txt:2: .* is not a plain file or class name"):
        read_val_labels(labels)
    (tmp_path / "kaggle.csv").write_text("ImageId,PredictionString\nv1,../up 1 2 3 4\n")
    with pytest.raises(SystemExit, match=r"kaggle\.csv:2: '\.\./up'"):
        read_val_labels(tmp_path / "kaggle.csv")


def test_the_patterns_dataset_is_an_imagenet_layout_written_deterministically(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The paper-regime miniature's data (few images here): ImageNet layout that the file listing reads,
    the same images from the same seed, labels that are the main texture's class (a class's images
    correlate with its prototypes more than with another class's), no partial folder left behind."""
    import numpy as np
    from PIL import Image

    from gradientflow_repro.data import patterns
    from gradientflow_repro.data.listing import list_image_folder

    monkeypatch.setattr(patterns, "TRAIN_PER_CLASS", 3)
    monkeypatch.setattr(patterns, "VAL_PER_CLASS", 2)
    first, second = (patterns.build_patterns(tmp_path / name) for name in ("a", "b"))
    train, val = list_image_folder(first / "train"), list_image_folder(first / "val", None)
    assert (len(train), len(val), len(train.classes)) == (30, 20, patterns.CLASSES)
    assert train.classes == val.classes == [f"pattern_{c}" for c in range(patterns.CLASSES)]
    assert not (tmp_path / "a.partial").exists()
    for file in train.files[:5]:
        assert (Path(file).read_bytes() == (second / Path(file).relative_to(first)).read_bytes())
        assert Image.open(file).size == (patterns.IMAGE_SIZE, patterns.IMAGE_SIZE)
    assert patterns.build_patterns(first) == first  # there already: left alone
    rng = np.random.default_rng(patterns.SEED)
    protos = patterns.prototypes(rng).reshape(patterns.CLASSES, patterns.PROTOTYPES, -1)
    monkeypatch.setattr(patterns, "NOISE", 0.0)
    monkeypatch.setattr(patterns, "SHIFT", 0)
    monkeypatch.setattr(patterns, "DISTRACTOR", 0.0)
    labels = np.arange(patterns.CLASSES)
    images = patterns.draw(rng, patterns.prototypes(np.random.default_rng(patterns.SEED)), labels).reshape(
        patterns.CLASSES, -1)
    best = np.abs(np.einsum("nd,ckd->nck", images, protos)).max(axis=2).argmax(axis=1)
    assert best.tolist() == labels.tolist()
