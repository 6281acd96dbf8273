"""Atomic checkpoints with per-rank state, and exact resume.

A checkpoint is a directory ``checkpoints/step_<N>/`` holding ``shared.pt`` (model, optimizer,
precision, progress: the same on every rank, written by rank 0), one ``rank_<r>.pt`` per rank (RNG
states and communicator state such as sparse-communication residuals, which differ between ranks)
and ``manifest.json`` with the world size and each file's SHA-256. Everything is written into
``step_<N>.tmp/`` and renamed into place by rank 0 once all ranks have written, so a checkpoint
directory without ``.tmp`` is always complete; a kill mid-write leaves the previous one as latest.
The run directory must be on a filesystem every rank sees (as on any cluster).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from gradientflow_repro import faults

MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    pass


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _save_file(obj: Any, path: Path, step: int = -1) -> None:
    partial = path.with_name(path.name + ".partial")
    torch.save(obj, partial)
    faults.inject("checkpoint", step)
    with open(partial, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(partial, path)


def save_checkpoint(run_dir: Path, step: int, shared: Optional[dict], per_rank: dict, *, rank: int,
                    world_size: int, barrier: Callable[[], None], keep: int) -> Path:
    """Collective: every rank calls it with its own ``per_rank``; rank 0 also passes ``shared``."""
    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{step:09d}"
    tmp = root / f"step_{step:09d}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    _save_file(per_rank, tmp / f"rank_{rank:05d}.pt", step)
    barrier()
    if rank == 0:
        _save_file(shared, tmp / "shared.pt")
        files = sorted(p.name for p in tmp.iterdir() if p.suffix == ".pt")
        manifest = {"step": step, "world_size": world_size,
                    "sha256": {name: _sha256(tmp / name) for name in files}}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if final.exists():  # same step saved again (e.g. final save after a periodic one)
            shutil.rmtree(final)
        os.rename(tmp, final)
        _prune(root, keep)
    barrier()
    return final


def _prune(root: Path, keep: int) -> None:
    for old in complete_checkpoints(root.parent)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def complete_checkpoints(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir()
                  if p.is_dir() and not p.name.endswith(".tmp") and (p / MANIFEST).exists())


def verify(checkpoint: Path) -> dict:
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    for name, expected in manifest["sha256"].items():
        path = checkpoint / name
        if not path.exists() or _sha256(path) != expected:
            raise CheckpointError(f"{path}: missing or checksum mismatch")
    return manifest


def find_resumable(run_dir: Path) -> Optional[Path]:
    """The newest checkpoint whose files match their checksums; damaged ones are skipped with a
    warning naming them."""
    for candidate in reversed(complete_checkpoints(run_dir)):
        try:
            verify(candidate)
            return candidate
        except (CheckpointError, OSError, ValueError) as error:
            warnings.warn(f"skipping damaged checkpoint {candidate}: {error}")
    return None


def load_checkpoint(checkpoint: Path, rank: int, world_size: int) -> tuple[dict, dict]:
    manifest = json.loads((Path(checkpoint) / MANIFEST).read_text())
    if manifest["world_size"] != world_size:
        raise CheckpointError(f"{checkpoint} was written by {manifest['world_size']} ranks, this job "
                              f"has {world_size}: per-rank state cannot be mapped")
    shared = torch.load(Path(checkpoint) / "shared.pt", map_location="cpu", weights_only=False)
    per_rank = torch.load(Path(checkpoint) / f"rank_{rank:05d}.pt", map_location="cpu",
                          weights_only=False)
    return shared, per_rank
