"""Atomic checkpoints with per-rank state, written and verified by every rank in parallel.

Layout: a checkpoint is a directory ``checkpoints/step_<N>/`` holding ``shared.pt`` (model,
optimizer, precision, progress: the same on every rank, written by rank 0), one ``rank_<r>.pt``
per rank (RNG states and communicator state such as sparse-communication residuals, which differ
between ranks) and ``manifest.json`` (``step``, ``world_size``, ``sha256``: each file's SHA-256;
``bytes``: each file's size, absent in checkpoints from before it was kept). The run directory must
be on a filesystem every rank sees (as on any cluster).

Writing (``save_checkpoint``, collective): every rank writes its own file into ``step_<N>.tmp/``
at the same time (rank 0 also ``shared.pt``), hashing the bytes as ``torch.save`` produces them
(``_HashingWriter``: no second read), and fsyncs it; the digests are gathered to rank 0, which
writes the manifest LAST and renames the directory into place. A directory without ``.tmp`` is
therefore complete; a kill mid-write leaves the previous one as the latest. Nothing is read or
hashed by one rank for all: with N ranks the time is one rank's file at its share of the
file system's bandwidth, not N files in a row.

Resuming (``find_resumable``, collective): newest first, each rank hashes only the files it will
read (``shared.pt`` and its own ``rank_<r>.pt``; on another number of ranks, the old ranks' files
``sources`` gives it), then one all-reduce of a per-rank "damaged" flag decides for every rank: a
checkpoint damaged on any rank is skipped by all (with a warning naming the ranks and files), so
every rank resumes from the same one. The files are then read again by ``torch.load``, from the
page cache.

Loading: ``torch.load(weights_only=True)``: only tensors, containers and plain values unpickle; a
file holding anything else (a pickle that would run code) is refused with ``CheckpointError``
naming it. ``SAFE_GLOBALS`` allow-lists what the trainer's state needs beyond that (nothing today:
model and optimizer state dicts, GradScaler's state, progress, RNG byte tensors and CSC's state are
all tensors, dicts, lists and numbers).

Why not ``torch.distributed.checkpoint`` (DCP): DCP describes one global state sharded over ranks
(each tensor a global tensor, each rank saving its shards, a planner deduplicating replicas). Our
large state is per-rank and distinct on every rank (CSC's residuals and velocities, BatchNorm's
local statistics, RNG states), which DCP can only store as N unrelated keys, and resuming on
another number of ranks needs a reduction (a mean), which its resharding does not express; the
shared state (weights, optimizer) is replicated and small next to it, written once by rank 0. The
parts we need from DCP (parallel writes, metadata last as the completeness marker) are those above.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from gradientflow_repro import faults

MANIFEST = "manifest.json"
SHARED = "shared.pt"
SAFE_GLOBALS: list[Any] = []  # classes and functions besides torch's defaults that the state holds


class CheckpointError(RuntimeError):
    pass


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


class Group:
    """The few collectives a checkpoint needs, over the default process group (a world of one
    without one). Small messages only: flags, digests, a few names."""

    def __init__(self, device: Optional[torch.device] = None) -> None:
        self.active = dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if self.active else 0
        self.world_size = dist.get_world_size() if self.active else 1
        self.device = device or torch.device("cpu")

    def barrier(self) -> None:
        self.flags(0)  # an all-reduce rather than dist.barrier(): NCCL barriers guess the device

    def flags(self, flag: int) -> list[int]:
        """Every rank's ``flag``, in one all-reduce (each rank fills its own slot)."""
        if not self.active:
            return [flag]
        slots = torch.zeros(self.world_size, dtype=torch.int32, device=self.device)
        slots[self.rank] = flag
        dist.all_reduce(slots)
        return slots.tolist()

    def gather(self, obj: Any) -> Optional[list[Any]]:
        """Every rank's ``obj`` on rank 0 (None elsewhere)."""
        if not self.active:
            return [obj]
        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out

    def all_gather(self, obj: Any) -> list[Any]:
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.active:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


class _HashingWriter:
    """A binary file that hashes what is written to it: the digest costs no second read."""

    def __init__(self, handle: BinaryIO) -> None:
        self.handle, self.digest, self.size = handle, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        self.size += len(data)
        return self.handle.write(data)

    def flush(self) -> None:
        self.handle.flush()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _save_file(obj: Any, path: Path, step: int = -1) -> tuple[str, int]:
    """Write ``obj`` to ``path`` (through ``.partial``, fsynced); its SHA-256 and size."""
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as handle:
        writer = _HashingWriter(handle)
        torch.save(obj, writer)
        handle.flush()
        faults.inject("checkpoint", step)
        os.fsync(handle.fileno())
    os.replace(partial, path)
    return writer.digest.hexdigest(), writer.size


def save_checkpoint(run_dir: Path, step: int, shared: Optional[dict], per_rank: dict, *, rank: int,
                    world_size: int, barrier: Callable[[], None], keep: int,
                    group: Optional[Group] = None) -> Path:
    """Collective: every rank calls it with its own ``per_rank``; rank 0 also passes ``shared``.
    ``group`` gathers the digests to rank 0 (default: the process group, if any).

    A write that fails on any rank (no space, quota, an I/O error) is agreed before anything else
    collective: every rank raises the same ``CheckpointError`` naming the first rank at fault and
    its error, the half-written ``step_N.tmp`` is removed, and the previous checkpoint stays the
    newest. (``barrier`` is kept for callers; the agreements are the barriers.)"""
    group = group or Group()
    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{step:09d}"
    tmp = root / f"step_{step:09d}.tmp"
    problem = ""
    if rank == 0:
        try:
            tidy(Path(run_dir))  # what an interrupted save left, this step's .tmp included
            tmp.mkdir(parents=True)
        except OSError as error:
            problem = f"rank 0: cannot create {tmp}: {_why(error)}"
    _agree(group, problem, step, tmp, rank)
    written = {}
    try:
        written[rank_file(rank)] = _save_file(per_rank, tmp / rank_file(rank), step)
        if rank == 0:
            written[SHARED] = _save_file(shared, tmp / SHARED)
    except OSError as error:
        problem = f"rank {rank}: cannot write {error.filename or tmp}: {_why(error)}"
    _agree(group, problem, step, tmp, rank)
    everyone = group.gather(written)
    if rank == 0:
        try:
            files = {name: facts for each in everyone for name, facts in each.items()}
            expected = {SHARED, *(rank_file(r) for r in range(world_size))}
            if set(files) != expected:
                raise CheckpointError(f"{tmp}: ranks reported {sorted(files)}, expected {sorted(expected)}")
            manifest = {"step": step, "world_size": world_size,
                        "sha256": {name: files[name][0] for name in sorted(files)},
                        "bytes": {name: files[name][1] for name in sorted(files)}}
            with open(tmp / MANIFEST, "w") as handle:  # last: the completeness marker
                handle.write(json.dumps(manifest, indent=1))
                handle.flush()
                os.fsync(handle.fileno())
            _replace(tmp, final)
            _prune(root, keep)
        except (OSError, CheckpointError) as error:
            problem = f"rank 0: cannot complete {final}: {_why(error) if isinstance(error, OSError) else error}"
    _agree(group, problem, step, tmp, rank)
    return final


def _why(error: OSError) -> str:
    return f"{error.strerror} (errno {error.errno})" if error.strerror else str(error) or type(error).__name__


def _agree(group: Group, problem: str, step: int, tmp: Path, rank: int) -> None:
    """Collective: raise the same ``CheckpointError`` on every rank if any rank has a ``problem``."""
    failed = [r for r, flag in enumerate(group.flags(int(bool(problem)))) if flag]
    if not failed:
        return
    first = group.all_gather(problem)[failed[0]]
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    newest = complete_checkpoints(tmp.parent.parent)
    others = f" (and on {len(failed) - 1} other rank(s))" if len(failed) > 1 else ""
    raise CheckpointError(f"checkpoint of step {step} not written: {first}{others}; the newest checkpoint is "
                          + (f"{newest[-1]}, intact" if newest else "none"))


def _replace(tmp: Path, final: Path) -> None:
    """Rename the complete ``tmp`` to ``final``. A step saved again (a final save after a periodic
    one) keeps the old copy as ``step_N.old`` until the new one is in place, so a crash in between
    leaves one of the two (``tidy`` puts it back)."""
    old = final.with_name(final.name + ".old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def tidy(run_dir: Path) -> list[str]:
    """Remove what interrupted saves left in ``run_dir/checkpoints`` (``step_N.tmp``; a
    ``step_N.old`` whose new copy is in place), and put back a ``step_N.old`` whose new copy never
    arrived. Only for the holder of the run directory (``run_dir.Lock``): another job's save in
    progress would look the same. Returns the names removed."""
    root = Path(run_dir) / "checkpoints"
    removed = []
    if not root.is_dir():
        return removed
    for path in sorted(root.iterdir()):
        if path.name.endswith(".tmp"):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
        elif path.name.endswith(".old"):
            kept = path.with_name(path.name[:-len(".old")])
            if kept.exists():
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path.name)
            else:
                os.rename(path, kept)
    return removed


def _prune(root: Path, keep: int) -> None:
    for old in complete_checkpoints(root.parent)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def step_of(checkpoint: Path) -> int:
    """The step a checkpoint directory ``step_<N>`` holds, from its name."""
    return int(Path(checkpoint).name.removeprefix("step_"))


def complete_checkpoints(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir()
                  if p.is_dir() and re.fullmatch(r"step_\d+", p.name) and (p / MANIFEST).exists())


def read_manifest(checkpoint: Path) -> dict:
    """The manifest, with its keys checked; a manifest of another layout is refused naming it."""
    path = Path(checkpoint) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path}: unreadable ({error})") from None
    missing = {"step", "world_size", "sha256"} - set(manifest) if isinstance(manifest, dict) else {"all keys"}
    if missing:
        raise CheckpointError(f"{path} is not a manifest of this checkpoint format (step, world_size, "
                              f"sha256 per file); it lacks {sorted(missing)}")
    wrong = [key for key, ok in (("step", _count(manifest["step"])), ("world_size", _count(manifest["world_size"])),
                                 ("sha256", isinstance(manifest["sha256"], dict) and all(
                                     isinstance(k, str) and isinstance(v, str) for k, v in manifest["sha256"].items())))
             if not ok]
    if wrong or manifest["world_size"] < 1:
        raise CheckpointError(f"{path}: {', '.join(wrong or ['world_size'])} of the wrong type or value "
                              f"(step and world_size whole numbers, sha256 a map of file names to digests)")
    return manifest


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def sources(rank: int, world_size: int, old_world_size: int) -> list[int]:
    """The old ranks whose files new ``rank`` reads: its own when the world size is unchanged, else
    every old rank i with i % world_size == rank (each old file read by exactly one new rank)."""
    if old_world_size == world_size:
        return [rank]
    return list(range(rank, old_world_size, world_size))


def files_to_read(manifest: dict, rank: int, world_size: int) -> list[str]:
    return [SHARED, *(rank_file(i) for i in sources(rank, world_size, int(manifest["world_size"])))]


def verify(checkpoint: Path, names: Optional[list[str]] = None) -> dict:
    """Check ``names`` (default: every file) against the manifest; returns the manifest."""
    manifest = read_manifest(checkpoint)
    for name in names if names is not None else list(manifest["sha256"]):
        path = Path(checkpoint) / name
        expected = manifest["sha256"].get(name)
        if expected is None:
            raise CheckpointError(f"{path}: not in the manifest (written by {manifest['world_size']} ranks)")
        if not path.exists() or _sha256(path) != expected:
            raise CheckpointError(f"{path}: missing or checksum mismatch")
    return manifest


def intact(candidate: Path, group: Optional[Group] = None) -> Optional[str]:
    """Collective: None when every rank finds the files it will read from ``candidate`` matching
    their checksums (one all-reduce of a flag per rank), else what is wrong, naming ranks and files."""
    group = group or Group()
    try:
        manifest = read_manifest(candidate)
        verify(candidate, files_to_read(manifest, group.rank, group.world_size))
        problem = ""
    except (CheckpointError, OSError, ValueError, KeyError, TypeError) as error:
        problem = str(error) or type(error).__name__
    damaged = [r for r, flag in enumerate(group.flags(int(bool(problem)))) if flag]
    if not damaged:
        return None
    problems = group.all_gather(problem)  # only on this rare path: the messages, for the warning
    return (f"damaged on rank(s) {damaged}: " + "; ".join(problems[r] for r in damaged[:4])
            + (" ..." if len(damaged) > 4 else ""))


def find_resumable(run_dir: Path, group: Optional[Group] = None) -> Optional[Path]:
    """Collective: the newest checkpoint whose files match their checksums on every rank, each rank
    checking the files it will read. Damaged ones are skipped by all, with a warning naming them.
    None when there is no checkpoint at all; when there are some but none is intact,
    ``CheckpointError`` lists each with what is wrong: starting again from step 0 without a word
    would lose the run (``resume=never`` sets them aside and starts afresh)."""
    group = group or Group()
    candidates = group.broadcast([p.name for p in reversed(complete_checkpoints(run_dir))])
    problems = []
    for name in candidates:  # rank 0's list: every rank walks the same one
        candidate = Path(run_dir) / "checkpoints" / name
        problem = intact(candidate, group)
        if problem is None:
            return candidate
        warnings.warn(f"skipping damaged checkpoint {candidate} ({problem})")
        problems.append(f"{name}: {problem}")
    if problems:
        raise CheckpointError(f"no checkpoint in {Path(run_dir) / 'checkpoints'} is intact, so the run cannot "
                              f"resume: " + "; ".join(problems) + ". Restore them, resume one explicitly "
                              "with resume=<path>, or set them aside and start afresh with resume=never")
    return None


@contextlib.contextmanager
def _allowed() -> Iterator[None]:
    with torch.serialization.safe_globals(SAFE_GLOBALS):
        yield


def load_file(path: Path) -> Any:
    """One checkpoint file, unpickled with ``weights_only=True``: anything beyond tensors, plain
    containers, numbers and ``SAFE_GLOBALS`` is refused, naming the file."""
    try:
        with _allowed():
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"{path} holds objects that safe loading (weights_only) refuses: {first}. "
                              f"Only tensors, containers and plain values load; a file that needs more "
                              f"is not one this code wrote") from None


def load_checkpoint(checkpoint: Path, rank: int, world_size: int) -> tuple[dict, dict]:
    """This rank's shared and own state of a checkpoint written by ``world_size`` ranks (another
    number of ranks: ``state.TrainState.load`` maps the per-rank state)."""
    manifest = read_manifest(checkpoint)
    if manifest["world_size"] != world_size:
        raise CheckpointError(f"{checkpoint} was written by {manifest['world_size']} ranks, this job "
                              f"has {world_size}: per-rank state is mapped by TrainState.load")
    return load_file(Path(checkpoint) / SHARED), load_file(Path(checkpoint) / rank_file(rank))


class CheckpointClock:
    """``checkpoint.every_minutes``: whether this rank's wall clock says a periodic checkpoint is due.

    Ranks' clocks differ, so this rank's answer is never acted on alone: the trainer folds ``due()``
    into the MAX-allreduce every step already makes (the overflow and stop-signal agreement,
    ``preemption.StopRequests``), and every rank saves after the step in which the first of them
    found the interval passed. No extra collective, no extra read-back. The interval is counted from
    the last checkpoint of any kind (``restart``), or from the first step of this process."""

    def __init__(self, every_minutes: Optional[float]) -> None:
        self.interval_s = every_minutes * 60.0 if every_minutes else None
        self._since: Optional[float] = None

    def due(self) -> float:
        """1.0 when the interval has passed on this rank's clock, else 0.0 (always 0.0 when off)."""
        if self.interval_s is None:
            return 0.0
        now = time.monotonic()
        if self._since is None:  # the first step: the clock starts with training, not the start-up
            self._since = now
        return 1.0 if now - self._since >= self.interval_s else 0.0

    def restart(self) -> None:
        """A checkpoint was written: the next one is due an interval from now."""
        self._since = time.monotonic()
