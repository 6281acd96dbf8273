"""How many CPU threads and reader processes a rank's loader uses when the configuration leaves it
to the machine (``data.num_threads: null``, ``data.reader_workers: null``).

The CPUs a rank may use: Slurm's ``SLURM_CPUS_PER_TASK`` (one task is one rank under ``srun``),
never more than the process's affinity mask allows (``os.sched_getaffinity``); without Slurm, the
affinity mask. torchrun starts ``LOCAL_WORLD_SIZE`` ranks inside one task or mask and binds none of
them, so there they share it equally.

How they are divided (``loader_cpus``): one core stays with the training process (its Python loop
launches the GPU work and runs the optimizer), and of the rest

* reader workers (the processes of DALI's parallel external source, which read each batch's files,
  parse their headers and draw the crop windows: ``dali.EpochBatches``) take a quarter, at least one
  on a GPU. One worker alone does the feeder's work faster than one GPU takes images at the paper's
  rate while the files come from the page cache, with little to spare, and through DALI's pool on
  busy cores it may fall short (``results/loader.md``, feeder section); so a quarter of a task's
  cores (2 of 12) rather than one, which also overlaps reads that wait on a network file system.
  Without a GPU there are none: the trainer computes on the same cores, and the files are read in
  the training process as before.
* DALI's threads (JPEG decoding on the CPU, or nvJPEG's CPU stages on a GPU, and augmentation) take
  the rest, at least one.

A value given in the configuration is used as it is, and the other is taken from what is left.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

READER_SHARE = 4  # one reader worker per this many spare cores (at least one on a GPU)


@dataclass(frozen=True)
class LoaderCpus:
    cpus: int  # the CPUs this rank may use
    origin: str  # where that number came from, for the run's log
    threads: int  # DALI's num_threads (the torchvision loader: its DataLoader workers)
    workers: int  # reader processes of the parallel external source; 0: read in the training process


def rank_cpus(environ: Optional[Mapping[str, str]] = None,
              affinity: Optional[set[int]] = None) -> tuple[int, str]:
    """(CPUs this rank may use, where the number came from); see the module's docstring."""
    env = os.environ if environ is None else environ
    if affinity is None:
        affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    cpus, origin = max(1, len(affinity)), "affinity mask"
    slurm = env.get("SLURM_CPUS_PER_TASK", "")
    if slurm.isdigit() and int(slurm) > 0:
        cpus, origin = min(cpus, int(slurm)), "SLURM_CPUS_PER_TASK"
    local = env.get("LOCAL_WORLD_SIZE", "")
    if "TORCHELASTIC_RUN_ID" in env and local.isdigit() and int(local) > 1:
        cpus, origin = max(1, cpus // int(local)), f"{origin} shared by {local} torchrun ranks"
    return cpus, origin


def loader_cpus(num_threads: Optional[int], reader_workers: Optional[int], *, on_gpu: bool,
                environ: Optional[Mapping[str, str]] = None,
                affinity: Optional[set[int]] = None) -> LoaderCpus:
    """The loader's threads and reader workers: ``num_threads`` and ``reader_workers`` where given
    (not None), otherwise derived from the rank's CPUs by the rule in the module's docstring."""
    cpus, origin = rank_cpus(environ, affinity)
    spare = max(1, cpus - 1)  # one core for the training process
    if reader_workers is None:
        reader_workers = max(1, spare // READER_SHARE) if on_gpu else 0
    if num_threads is None:
        num_threads = max(1, spare - reader_workers)
    return LoaderCpus(cpus, origin, num_threads, reader_workers)


def source_queue_depth(prefetch: int, workers: int) -> int:
    """Batches the parallel external source computes ahead. With ``batch=True`` each batch is one
    task for one worker, and DALI schedules at most the source's ``prefetch_queue_depth`` tasks at a
    time (1 unless given), so a depth below the number of workers leaves the others idle: at least
    ``workers``, and at least the pipeline's own ``prefetch``."""
    return max(prefetch, workers, 1)
