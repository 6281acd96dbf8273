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

from gradientflow_repro import checkpoint
from gradientflow_repro.cluster.world import spawn

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
    """Measure every world size of ``worlds``, project 512 ranks, write Markdown to ``out``; returns it."""
    from gradientflow_repro.provenance import environment_facts

    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    measured = {}
    with tempfile.TemporaryDirectory(prefix="bench_checkpoint_") as where:
        for world in worlds:
            spawn(_measure, world, where, rank_mb, shared_mb, repeats, timeout_s=600)
            measured[world] = torch.load(Path(where) / f"world{world}.pt", weights_only=True)
    hash_gbps = _hash_rate_gbps()
    facts = environment_facts()
    machine = facts["gpu"] or f"{facts['cpu']}, {facts['cpu_count']} cores"
    lines = ["# Checkpoints: save and resume time against world size", "",
             f"Machine: {machine}; gloo ranks on this one machine, one local disk (files read back from its "
             f"page cache). torch {facts['torch']}, commit {facts['git_commit']}. The run took "
             f"{time.perf_counter() - started:.0f} s.", f"Command: `{command}`.", "",
             f"Per rank: a CSC-like state of {rank_mb:g} MB (residual + velocity, fp32; AlexNet-BN's is "
             f"about 490 MB); rank 0 also a shared state of {shared_mb:g} MB. Each figure: the slowest rank's "
             f"seconds, median of {repeats}. *rank 0 hashes all*: what the previous design added at every "
             "save and every resume (rank 0 alone hashing every rank's file, the others waiting).", "",
             "| world size | bytes per rank | total bytes | save s | resume s (verify + load) | "
             "rank 0 hashes all s |", "|---|---|---|---|---|---|"]
    for world, every in measured.items():
        seconds = [[max(rank["rows"][i][k] for rank in every) for i in range(repeats)] for k in range(3)]
        per_rank = every[0]["bytes"]
        total = sum(rank["bytes"] for rank in every) + shared_mb * 1e6
        save, resume, old = (statistics.median(s) for s in seconds)
        lines.append(f"| {world} | {per_rank / 1e6:.1f} MB | {total / 1e6:.0f} MB | {save:.2f} | {resume:.2f} | "
                     f"{old:.2f} |")
    cores = facts["cpu_count"] or 1
    lines += ["", f"With {cores} cores, ranks beyond {cores} take turns on them and share one disk: here the "
              "save and resume times grow with the total bytes, as they would on one file-system client; "
              "what the table shows is that no rank does more than its own share (save and resume stay "
              "one rank's file of work per rank), while *rank 0 hashes all* grows with the world size.", "",
              "## Projection: 512 ranks (64 nodes of 8), `comm=gradientflow`", "",
              f"File system: {AGGREGATE_GBPS:g} GB/s aggregate, {PER_NODE_GBPS:g} GB/s per client node "
              f"(a mid-size Lustre or GPFS, one 100 Gb/s link per node), {STREAM_GBPS:g} GB/s for one process "
              f"reading or writing one file; SHA-256 at {hash_gbps:.2f} GB/s per stream (measured here). "
              "Per rank: residual + velocity in fp32 (8 bytes per parameter; "
              "the residual covers the weights CSC sparsifies, taken here as every parameter); shared: "
              "weights + momentum in fp32, once. Save: max(total / aggregate, one node's bytes / per-node, "
              "rank 0's two files / one stream); "
              "resume: every rank reads shared + its own file (same bounds) and hashes them in parallel. "
              f"Previous design: plus rank 0 reading and hashing every file, one after another. Against the "
              f"{WARNING_S:.0f} s preemption warning (`--signal=USR1@180`).", "",
              "| model | parameters | per rank | per checkpoint | save s | resume s | previous save s | "
              "previous resume s | save within 180 s |", "|---|---|---|---|---|---|---|---|---|"]
    for label, name in (("AlexNet-BN", "alexnet_bn"), ("ResNet-50", "resnet50")):
        params = _parameters(name)
        p = project(params, hash_gbps)
        lines.append(f"| {label} | {params / 1e6:.1f} M | {p['per_rank_gb']:.2f} GB | {p['total_gb']:.0f} GB | "
                     f"{p['save_s']:.0f} | {p['resume_s']:.0f} | {p['old_save_s']:.0f} | {p['old_resume_s']:.0f} | "
                     f"{'yes' if p['save_s'] < WARNING_S else 'no'} (previous: "
                     f"{'yes' if p['old_save_s'] < WARNING_S else 'no'}) |")
    lines += ["", "Keep=3 holds three such checkpoints. The save is bound by the aggregate bandwidth (total "
              "bytes / aggregate), no longer by one rank's hashing.", ""]
    text = "\n".join(lines)
    out.write_text(text)
    return text
