"""Checkpoint save and resume time against world size, and the projection for 512 ranks.

Measured (gloo ranks on this machine, ``spawn``): each rank holds a per-rank state shaped like
CSC's (a residual and a velocity, fp32, ``rank_mb`` MB together: a scaled-down AlexNet-BN's) and
rank 0 a shared state of ``shared_mb`` MB (weights and momentum). ``save`` is
``checkpoint.save_checkpoint`` (every rank writes and hashes its own file, rank 0 the manifest
last); ``resume`` is ``find_resumable`` (each rank hashes the files it reads, one all-reduce
decides) plus loading them; ``rank 0 hashes all`` is the verification the previous design did on
rank 0 alone (``checkpoint.verify`` of every file), timed for comparison. Each figure is the
slowest rank's, the median over ``repeats``. The files are read back from the page cache of this
one machine: the measurement shows how the work divides among ranks, not a parallel file system.

Projected: per-rank bytes from the models' parameter counts with ``comm=gradientflow`` (residual +
velocity, fp32: 8 bytes per parameter), the shared state (weights + momentum, fp32) once, at a
stated file-system bandwidth (aggregate, per client node) and the hash rate measured here.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Sequence

import torch

from gradientflow_repro import checkpoint, render
from gradientflow_repro.bench import provenance
from gradientflow_repro.cluster.world import spawn

KIND = "bench.checkpoint"
WARNING_S = 180.0  # the Slurm templates' --signal=USR1@180: the time a preempted job has to save
RANKS, RANKS_PER_NODE = 512, 8
AGGREGATE_GBPS, PER_NODE_GBPS = 100.0, 10.0  # a mid-size Lustre/GPFS; one client node's link
STREAM_GBPS = 1.0  # one process reading or writing one file sequentially on such a file system


def _measure(rank: int, world: int, where: str, rank_mb: float, shared_mb: float, repeats: int) -> None:
    group = checkpoint.Group()
    elements = int(rank_mb * 1e6 / 4) // 2
    generator = torch.Generator().manual_seed(rank)
    mine = {"comm": {"residual": {0: torch.randn(elements, generator=generator)},
                     "velocity": {0: torch.randn(elements, generator=generator)}}}
    shared = {"model": torch.randn(int(shared_mb * 1e6 / 4), generator=generator)} if rank == 0 else None
    run = Path(where) / f"world{world}"
    rows = []
    for repeat in range(repeats):
        group.barrier()
        started = time.perf_counter()
        path = checkpoint.save_checkpoint(run, repeat, shared, mine, rank=rank, world_size=world,
                                          barrier=group.barrier, keep=1)
        save_s = time.perf_counter() - started
        group.barrier()
        started = time.perf_counter()
        found = checkpoint.find_resumable(run)
        assert found == path, (found, path)
        checkpoint.load_file(found / checkpoint.SHARED)
        checkpoint.load_file(found / checkpoint.rank_file(rank))
        resume_s = time.perf_counter() - started
        group.barrier()
        old_s = 0.0
        if rank == 0:
            started = time.perf_counter()
            checkpoint.verify(found)  # every file, on one rank: the previous design
            old_s = time.perf_counter() - started
        rows.append((save_s, resume_s, old_s))
    every = group.gather({"rows": rows, "bytes": os.path.getsize(path / checkpoint.rank_file(rank))})
    if rank == 0:
        torch.save(every, Path(where) / f"world{world}.pt")


def _hash_rate_gbps(megabytes: int = 256) -> float:
    data = os.urandom(megabytes << 20)
    started = time.perf_counter()
    hashlib.sha256(data).hexdigest()
    return len(data) / (time.perf_counter() - started) / 1e9


def _parameters(name: str) -> int:
    from gradientflow_repro.models import build_model

    return sum(p.numel() for p in build_model(name, 1000, 224).parameters())


def project(params: int, hash_gbps: float) -> dict[str, float]:
    """Seconds for 512 ranks (8 per node) under ``comm=gradientflow``: the new design (parallel
    writes and hashes; resume: each rank reads shared + own) and the previous one's extra (rank 0
    hashes every file, one after another, at min(hash rate, one stream's bandwidth))."""
    per_rank, shared = 8 * params, 8 * params
    total = RANKS * per_rank + shared
    nodes = RANKS // RANKS_PER_NODE
    write = max(total / (AGGREGATE_GBPS * 1e9), (RANKS_PER_NODE * per_rank + shared) / (PER_NODE_GBPS * 1e9))
    write = max(write, (per_rank + shared) / (STREAM_GBPS * 1e9))  # rank 0 writes both files
    hash_own = (per_rank + shared) / (hash_gbps * 1e9)  # each rank's own (rank 0: also shared), in parallel
    read = max(RANKS * (per_rank + shared) / (AGGREGATE_GBPS * 1e9),
               RANKS_PER_NODE * (per_rank + shared) / (PER_NODE_GBPS * 1e9),
               (per_rank + shared) / (STREAM_GBPS * 1e9))
    serial = total / (min(hash_gbps, STREAM_GBPS) * 1e9)  # one process reads every file, in a row
    return {"per_rank_gb": per_rank / 1e9, "shared_gb": shared / 1e9, "total_gb": total / 1e9, "nodes": nodes,
            "save_s": write, "resume_s": read + hash_own, "old_save_s": write + serial,
            "old_resume_s": serial + read}


def bench_checkpoint(out: Path, worlds: Sequence[int] = (1, 2, 4, 8), rank_mb: float = 64.0,
                     shared_mb: float = 32.0, repeats: int = 3,
                     command: str = "python scripts/bench_checkpoint.py") -> str:
    """Measure every world size of ``worlds`` and project 512 ranks; write the figures and the
    verdicts against the preemption warning beside ``out`` (.json, kind ``bench.checkpoint``) and the
    Markdown rendered from them to ``out``; returns the Markdown."""
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    measured = {}
    with tempfile.TemporaryDirectory(prefix="bench_checkpoint_") as where:
        for world in worlds:
            spawn(_measure, world, where, rank_mb, shared_mb, repeats, timeout_s=600)
            measured[world] = torch.load(Path(where) / f"world{world}.pt", weights_only=True)
    hash_gbps = _hash_rate_gbps()
    document = {"provenance": provenance(command, list(worlds)), "elapsed_s": time.perf_counter() - started,
                "rank_mb": rank_mb, "shared_mb": shared_mb, "repeats": repeats, "measured": [],
                "ranks": RANKS, "ranks_per_node": RANKS_PER_NODE, "warning_s": WARNING_S, "hash_gbps": hash_gbps,
                "file_system": {"aggregate_gbps": AGGREGATE_GBPS, "per_node_gbps": PER_NODE_GBPS,
                                "stream_gbps": STREAM_GBPS}, "projection": []}
    for world, every in measured.items():
        seconds = [[max(rank["rows"][i][k] for rank in every) for i in range(repeats)] for k in range(3)]
        save, resume, old = (statistics.median(s) for s in seconds)
        document["measured"].append({"world": world, "bytes_per_rank": every[0]["bytes"],
                                     "total_bytes": sum(rank["bytes"] for rank in every) + shared_mb * 1e6,
                                     "save_s": save, "resume_s": resume, "old_s": old})
    for label, name in (("AlexNet-BN", "alexnet_bn"), ("ResNet-50", "resnet50")):
        params = _parameters(name)
        p = project(params, hash_gbps)
        document["projection"].append({"label": label, "params": params, **p,
                                       "within_warning": p["save_s"] < WARNING_S,
                                       "old_within_warning": p["old_save_s"] < WARNING_S})
    data = render.write_data(out.with_suffix(".json"), KIND, document)
    return render.render_file(data, out).read_text()
