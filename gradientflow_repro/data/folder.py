"""torchvision fallback loader (``data.loader=torchvision``): the same files, order and sharding as
the DALI path, decoded by PIL in DataLoader workers. Useful where DALI is unavailable and as the
reference the DALI pipeline is benchmarked against.

Where the workers come from. The trainer runs threads (gloo's, the liveness heartbeat and watchdog,
DALI's), and a process forked from a threaded Python process can hang before it runs a line: if
another thread held the interpreter's internal lock at the fork, the child waits for it forever
(CPython issue 112275). So no worker is a fork of the trainer: they are forked by multiprocessing's
fork server, an interpreter of their own started by fork and exec (no Python runs in between) that
has imported what the workers need (``PRELOAD``) and runs one thread. It is started inside
``preemption.workers_ignore_stop_signals()``, so it and every worker it forks are born with the stop
signals blocked. The validation loader starts its workers once and keeps them for every evaluation
(``persistent_workers``); training starts a loader, and its workers, per epoch, since each epoch is a
dataset of its own (its order and augmentation seeds), which the fork server makes cheap. As with
``spawn``, each worker runs the program's main module first (not as ``__main__``): a program that
uses this loader with workers keeps its work under ``if __name__ == "__main__"``.

A worker that delivers nothing for ``worker_timeout_s`` (a hung file system, a deadlock) ends the
run with a ``LoaderError`` naming the loader and the worker, instead of a silent wait. One that dies
is reported too: the trainer is not the parent of the fork server's children, so no SIGCHLD tells
it; the training loader looks at its workers after every ``POLL_S`` without a batch, the
validation loader after ``worker_timeout_s`` (each pass of its kept workers starts by waiting for
every worker's answer, through the same limit: a short one would fail a pass whenever a worker idle
since the last evaluation is slow to answer)."""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import time
from typing import Any, Iterator, Optional

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms

from gradientflow_repro.data.base import Batch
from gradientflow_repro.data.cpus import loader_cpus
from gradientflow_repro.data.listing import ImageOptions, Listing, ShardedFolder, epoch_permutation, shard_bounds
from gradientflow_repro.preemption import ignore_stop_signals, workers_ignore_stop_signals

# What a worker imports that takes time, imported once by the fork server (else every worker of every
# epoch imports it anew): torch, torchvision, PIL, and Hydra (this package's configuration, imported
# with ``gradientflow_repro.data``). Third-party only: a worker imports this package itself, from the
# trainer's ``sys.path`` (the server's is the interpreter's own plus its working directory, where
# another copy of the package could be found first). Importing them starts no thread, so forking
# from the server stays safe.
PRELOAD = ["torch", "torchvision", "PIL.Image", "hydra", "omegaconf"]
# Long enough for a batch of large images on a loaded node, short of the collectives' limit
# (``dist_timeout_s``, 5 minutes by default) and of the 512-GPU configuration's ``watchdog_s``, so
# that the rank whose worker is stuck says so before its peers report a rank that stopped answering.
WORKER_TIMEOUT_S = 120.0
POLL_S = 5.0  # torch's own interval between looks at its workers (MP_STATUS_CHECK_INTERVAL)
WORKERS = multiprocessing.get_context("forkserver")


class LoaderError(Exception):
    """A loader worker that is stuck or died. This rank's own failure, not one every rank shares
    (unlike ``DatasetError``), so every rank that has it prints it."""


def start_fork_server() -> None:
    """Start this process's fork server (multiprocessing's one per process) unless it runs: with
    ``PRELOAD`` imported, and with the stop signals blocked, so that every worker it forks is born
    with them blocked. Cheap when it runs already. Call it inside
    ``workers_ignore_stop_signals(processes=True)``: the server inherits the calling thread's mask.
    A server that other code of this process started before (none in the trainer) is used as it is.

    Each worker still runs the trainer's main module, as multiprocessing does in every child it
    does not fork from the parent; not preloaded here: what it imports beyond ``PRELOAD`` costs
    milliseconds, and preloading it would run it in the server too."""
    WORKERS.set_forkserver_preload(PRELOAD)
    multiprocessing.forkserver.ensure_running()


def to_device(images: torch.Tensor, labels: torch.Tensor, device: torch.device,
              channels_last: bool = False, dtype: torch.dtype = torch.float32) -> Batch:
    """Both tensors copied without waiting for the host: on CUDA the DataLoader pins its batches
    (``pin_memory``), so a ``non_blocking`` copy is queued on the stream and the step goes on (a
    blocking one would stall every step until the copy lands); on the CPU nothing is copied. Then,
    on the device, the images in ``dtype`` and, with ``channels_last``, in channels_last memory (the
    layout DALI's loaders emit for ``data.channels_last``)."""
    images = images.to(device, non_blocking=True).to(dtype)
    if channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    return images, labels.to(device, non_blocking=True)


def _own_generator(seed: int) -> torch.Generator:
    """For the DataLoader's one draw per iterator (its workers' base seed): without a generator of
    its own it draws from the trainer's global RNG, so a run resumed mid-epoch, which starts one
    more iterator than the uninterrupted run at that point, would draw other dropout masks from then
    on. (The samples do not use that seed: ``_Files`` seeds each one itself.)"""
    return torch.Generator().manual_seed(seed)


def _awaited_worker(batches: Any) -> str:
    """'worker W (pid P)' that owes the batch the iterator waits for, from the DataLoader iterator's
    own bookkeeping (private to torch: 'a worker' where it is not there)."""
    try:
        worker = batches._task_info[batches._rcvd_idx][0]
        return f"worker {worker} (pid {batches._workers[worker].pid})"
    except (AttributeError, KeyError, IndexError, TypeError):
        return "a worker"


class _Files(Dataset):
    """Each sample's augmentation is seeded by (``seed``, position), so batches do not depend on the
    number of workers or on what ran before, and the trainer's own RNG is left untouched."""

    def __init__(self, files: list[str], labels: list[int], transform: transforms.Compose,
                 seed: int = 0) -> None:
        self.files, self.labels, self.transform, self.seed = files, labels, transform, seed

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        with Image.open(self.files[index]) as image, torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed + index)
            return self.transform(image.convert("RGB")), self.labels[index]


class TorchvisionSource(ShardedFolder):
    """``worker_timeout_s``: how long the loader waits for a worker's batch before it gives up
    (``LoaderError``)."""

    def __init__(self, train: Listing, val: Listing, options: ImageOptions, *, device: torch.device,
                 reader_workers: Optional[int] = None, worker_timeout_s: float = WORKER_TIMEOUT_S,
                 **shard: int) -> None:
        super().__init__(train, val, options, **shard)
        self.device = device
        # reader_workers (data.reader_workers) where given; else num_threads=None: every spare core
        # decodes (cpus.loader_cpus; no separate readers here)
        workers = (loader_cpus(options.num_threads, 0, on_gpu=device.type == "cuda").threads
                   if reader_workers is None else reader_workers)
        self.worker_timeout_s = worker_timeout_s
        # the workers ignore the stop signals: only the trainer decides (preemption.py). They come
        # from the fork server (WORKERS), never from a fork of the trainer; the loader looks at them
        # every POLL_S (timeout) and gives up after worker_timeout_s (_next_batch)
        parallel = dict(multiprocessing_context=WORKERS, timeout=min(POLL_S, worker_timeout_s),
                        prefetch_factor=options.prefetch) if workers > 0 else {}
        self.loader_args = dict(batch_size=self.local_batch, num_workers=workers,
                                worker_init_fn=ignore_stop_signals,
                                pin_memory=device.type == "cuda", **parallel)
        normalize = transforms.Normalize([m / 255 for m in options.mean], [s / 255 for s in options.std])
        augment = [transforms.RandomResizedCrop(options.image_size, scale=(options.min_crop_scale, 1.0))]
        if options.flip:
            augment.append(transforms.RandomHorizontalFlip())
        self.train_transform = transforms.Compose([*augment, transforms.ToTensor(), normalize])
        self.val_transform = transforms.Compose([transforms.Resize(options.val_resize),
                                                 transforms.CenterCrop(options.image_size),
                                                 transforms.ToTensor(), normalize])
        self._val: Optional[DataLoader] = None  # built on the first evaluation, kept for the others

    def train_batches(self, epoch: int, skip: int = 0) -> Iterator[Batch]:
        order = epoch_permutation(len(self.train), self.seed, epoch)
        start, _ = shard_bounds(len(order), self.rank, self.world_size)
        mine = order[start:start + self.steps_per_epoch * self.local_batch]
        dataset = _Files([self.train.files[i] for i in mine], [self.train.labels[i] for i in mine],
                         self.train_transform, seed=self.epoch_seed(epoch) * 1_000_003)
        loader = DataLoader(dataset, shuffle=False, drop_last=True, generator=_own_generator(epoch),
                            **self.loader_args)
        yield from self._delivered(loader, f"training epoch {epoch}", skip)

    def val_batches(self) -> Iterator[Batch]:
        if self._val is None:  # its workers start with the first pass and serve every later one
            start, end = shard_bounds(len(self.val), self.rank, self.world_size)
            dataset = _Files(self.val.files[start:end], self.val.labels[start:end], self.val_transform)
            kept = self.loader_args["num_workers"] > 0
            args = {**self.loader_args, **({"timeout": self.worker_timeout_s} if kept else {})}  # module doc
            self._val = DataLoader(dataset, shuffle=False, generator=_own_generator(0), persistent_workers=kept,
                                   **args)
        yield from self._delivered(self._val, "validation")

    def _delivered(self, loader: DataLoader, which: str, skip: int = 0) -> Iterator[Batch]:
        parallel = loader.num_workers > 0
        # the workers (and, the first time, their server) start here
        with workers_ignore_stop_signals(processes=parallel):
            if parallel:
                start_fork_server()
            try:
                batches = iter(loader)
            except RuntimeError as error:  # kept workers that did not answer, or died, before the pass
                if (failure := self._loader_error(error, which, None)) is None:
                    raise
                raise failure from error
        step = 0
        while (batch := self._next_batch(batches, which)) is not None:
            if step >= skip:
                yield to_device(*batch, self.device, self.options.channels_last, self.options.output_dtype)
            step += 1

    def _next_batch(self, batches: Iterator, which: str) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The next batch (None at the end). With workers, the DataLoader gives up on a wait after
        its ``timeout`` (``POLL_S`` for training), having looked whether a worker died (then a
        ``LoaderError``); it is asked again until ``worker_timeout_s`` have passed without a batch."""
        waiting_since = time.monotonic()
        while True:
            try:
                return next(batches)
            except StopIteration:
                return None
            except RuntimeError as error:
                if str(error).startswith("DataLoader timed out") and \
                        time.monotonic() - waiting_since < self.worker_timeout_s:
                    continue
                if (failure := self._loader_error(error, which, batches)) is None:
                    raise
                raise failure from error

    def _loader_error(self, error: RuntimeError, which: str, batches: Any) -> Optional[LoaderError]:
        """The one-line ``LoaderError`` for the DataLoader's ``error`` (a worker died, or the wait
        reached the limit), naming the loader and the worker; None for any other error. No
        "timeout" in the words: the trainer reads those as a collective's failure."""
        said = str(error)
        if said.startswith("DataLoader worker"):  # "... (pid(s) N) exited unexpectedly"
            return LoaderError(f"torchvision loader, {which}: {said}: its error, if it raised one, is printed "
                               f"above; else it was killed (by the out-of-memory killer? see the kernel log; "
                               f"data.reader_workers sets how many workers a rank runs)")
        if not said.startswith("DataLoader timed out"):
            return None
        what = (f"no batch from {_awaited_worker(batches)}" if batches is not None
                else "no answer from its workers at the start of the pass")
        return LoaderError(f"torchvision loader, {which}: {what} for {self.worker_timeout_s:g} s (the loader's "
                           f"limit): stuck, most likely reading a file: check that the data's file system "
                           f"answers; data.reader_workers=0 reads in the training process instead")
