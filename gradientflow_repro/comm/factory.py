"""Communicators from a resolved configuration: which summing function, which fusion.

The strategies, their knobs and how a configuration resolves to one live in ``knobs.py`` (torch-free,
read from the presets in ``configs/comm/``); this module turns a resolved ``CommConfig`` into the
objects that do the work.
"""

from __future__ import annotations

from typing import Any, Mapping, Union

import torch
import torch.distributed as dist

from gradientflow_repro.comm.allreduce import PerTensorAllreduce
from gradientflow_repro.comm.base import Communicator, SumFn, builtin_sum
from gradientflow_repro.comm.compression import Fp16Wire
from gradientflow_repro.comm.csc import CSCCommunicator
from gradientflow_repro.comm.ddp import DDPCommunicator
from gradientflow_repro.comm.hierarchical import HierarchicalSum
from gradientflow_repro.comm.knobs import CommConfig, resolve
from gradientflow_repro.comm.lazy import LazyAllreduce
from gradientflow_repro.comm.ring import DEFAULT_SEGMENT_BYTES, ring_sum


def build_sum(algorithm: str, wire: str, ranks_per_node: int | None = None,
              segment_kb: int = DEFAULT_SEGMENT_BYTES // 1024, local_rank: int | None = None) -> SumFn:
    """The summing function of ``algorithm`` (with the fp16 wire around it). ``ranks_per_node``:
    how many consecutive ranks share a node, as the launcher says (torchrun's LOCAL_WORLD_SIZE,
    Slurm's tasks per node) or ``comm.ranks_per_node`` sets; ``local_rank`` checks that layout."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        return builtin_sum()  # nothing to sum with
    if algorithm == "ring":
        sum_fn = ring_sum(segment_bytes=segment_kb * 1024)
    elif algorithm == "hierarchical":
        sum_fn = HierarchicalSum(ranks_per_node or 1, segment_kb * 1024, local_rank=local_rank)
    else:
        sum_fn = builtin_sum()
    return Fp16Wire(sum_fn, world) if wire == "fp16" else sum_fn


def build_communicator(options: Union[Mapping[str, Any], CommConfig], device: torch.device,
                       ranks_per_node: int | None = None, local_rank: int | None = None) -> Communicator:
    """The communicator of ``options`` (``comm.*``, resolved against its preset). ``ranks_per_node``
    and ``local_rank`` come from the launcher (``distributed.World``); ``comm.ranks_per_node``
    overrides the former, to emulate nodes on one machine (then the launcher's local rank says
    nothing about that layout)."""
    knobs = resolve(options)
    if knobs.ranks_per_node:
        ranks_per_node, local_rank = knobs.ranks_per_node, None
    sum_fn = build_sum(knobs.algorithm, knobs.wire, ranks_per_node, knobs.segment_kb, local_rank)
    if knobs.fusion == "ddp":
        custom = (knobs.algorithm, knobs.wire) != ("builtin", "fp32")
        return DDPCommunicator(device, knobs.ddp_bucket_mb, sum_fn if custom else None)
    bucket_bytes = int(knobs.bucket_mb * 2**20)
    if knobs.sparsity == "csc":
        return CSCCommunicator(device, sum_fn, bucket_bytes, knobs.overlap, chunk_size=knobs.chunk_size,
                               density=knobs.density, warmup_epochs=knobs.csc_warmup_epochs,
                               momentum_correction=knobs.momentum_correction,
                               momentum_masking=knobs.momentum_masking,
                               density_ramp_epochs=knobs.density_ramp_epochs)
    if knobs.fusion == "lazy":
        return LazyAllreduce(device, sum_fn, bucket_bytes, knobs.overlap)
    return PerTensorAllreduce(device, sum_fn)
