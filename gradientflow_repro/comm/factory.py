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
from gradientflow_repro.comm.knobs import (
    SMALL_MESSAGE_BYTES,
    CommConfig,
    csc_warmup,
    resolve,
    sends_sparse,
    small_message_bytes,
    two_level,
)
from gradientflow_repro.comm.lazy import LazyAllreduce
from gradientflow_repro.comm.recursive_doubling import SizedSum
from gradientflow_repro.comm.ring import DEFAULT_SEGMENT_BYTES, ring_sum


def summing(algorithm: str, world: int, ranks_per_node: int | None) -> str:
    """What ``algorithm`` sums with for ``world`` ranks placed ``ranks_per_node`` per node: "builtin",
    "ring" (flat) or "two-level" (``auto`` is two-level on several nodes of several ranks)."""
    if two_level(algorithm, world, ranks_per_node):
        return "two-level"
    return "ring" if algorithm in ("ring", "auto") else "builtin"


def build_sum(algorithm: str, wire: str, ranks_per_node: int | None = None,
              segment_kb: int = DEFAULT_SEGMENT_BYTES // 1024, local_rank: int | None = None,
              small_bytes: int = SMALL_MESSAGE_BYTES) -> SumFn:
    """The summing function of ``algorithm`` (with the fp16 wire around it). ``ranks_per_node``:
    how many consecutive ranks share a node, as the launcher says (torchrun's LOCAL_WORLD_SIZE,
    Slurm's tasks per node) or ``comm.ranks_per_node`` sets; ``local_rank`` checks that layout.
    Our own algorithms send small messages (at most ``small_bytes``: by default ``SMALL_MESSAGE_BYTES``,
    measured) by recursive doubling: log2(N) latencies instead of the ring's 2(N-1)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        return builtin_sum()  # nothing to sum with
    chosen = summing(algorithm, world, ranks_per_node)
    if chosen == "two-level":
        sum_fn = SizedSum(HierarchicalSum(ranks_per_node or 1, segment_kb * 1024, local_rank=local_rank),
                          threshold_bytes=small_bytes)
    elif chosen == "ring":
        sum_fn = SizedSum(ring_sum(segment_bytes=segment_kb * 1024), threshold_bytes=small_bytes)
    else:
        sum_fn = builtin_sum()
    return Fp16Wire(sum_fn, world) if wire == "fp16" else sum_fn


def build_communicator(options: Union[Mapping[str, Any], CommConfig], device: torch.device,
                       ranks_per_node: int | None = None, local_rank: int | None = None,
                       lr_warmup_epochs: float = 0.0) -> Communicator:
    """The communicator of ``options`` (``comm.*``, resolved against its preset). ``ranks_per_node``
    and ``local_rank`` come from the launcher (``distributed.World``); ``comm.ranks_per_node``
    overrides the former, to emulate nodes on one machine (then the launcher's local rank says
    nothing about that layout). ``lr_warmup_epochs``: the optimizer's learning-rate warm-up, which
    CSC's dense warm-up follows unless ``comm.csc_warmup_epochs`` is set (``knobs.csc_warmup``;
    0, as without a training run: sparse from the first step)."""
    knobs = resolve(options)
    if knobs.ranks_per_node:
        ranks_per_node, local_rank = knobs.ranks_per_node, None
    sum_fn = build_sum(knobs.algorithm, knobs.wire, ranks_per_node, knobs.segment_kb, local_rank,
                       small_message_bytes(knobs))
    communicator = _communicator(knobs, device, sum_fn, lr_warmup_epochs)
    communicator.summing = describe_sum(knobs.algorithm, knobs.wire, ranks_per_node, small_message_bytes(knobs))
    communicator.schedule = describe_schedule(knobs, lr_warmup_epochs)
    return communicator


def describe_schedule(knobs: CommConfig, lr_warmup_epochs: float) -> str:
    """CSC's schedule in words, its dense warm-up resolved (``comm.csc_warmup_epochs`` null shows as
    null in the run's saved config); empty for dense strategies."""
    if not sends_sparse(knobs):
        return ""
    warmup = csc_warmup(knobs, lr_warmup_epochs)
    why = "the learning rate's warm-up" if knobs.csc_warmup_epochs is None else "comm.csc_warmup_epochs"
    ramp = (f", falling to it over {knobs.density_ramp_epochs} epoch(s)" if knobs.density_ramp_epochs else "")
    start = f"dense for the first {warmup:g} epoch(s) ({why}), then" if warmup else "sparse from the first step:"
    return f"{start} density {knobs.density:g}{ramp}"


def describe_sum(algorithm: str, wire: str, ranks_per_node: int | None,
                 small_bytes: int = SMALL_MESSAGE_BYTES) -> str:
    """``build_sum``'s choice in words, for the run's first lines (our algorithms: with the size up
    to which they send by recursive doubling)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        return "one rank: nothing to sum"
    chosen = summing(algorithm, world, ranks_per_node)
    how = {"two-level": f"two-level ring ({-(-world // (ranks_per_node or 1))} nodes x {ranks_per_node} ranks)",
           "ring": f"flat ring over {world} ranks",
           "builtin": f"the backend's allreduce over {world} ranks"}[chosen]
    if chosen != "builtin":
        how += f", small messages (up to {small_bytes // 1024} KiB) by recursive doubling"
    return how + (", fp16 wire" if wire == "fp16" else "")


def _communicator(knobs: CommConfig, device: torch.device, sum_fn: SumFn, lr_warmup_epochs: float) -> Communicator:
    if knobs.fusion == "ddp":
        custom = (knobs.algorithm, knobs.wire) != ("builtin", "fp32")
        return DDPCommunicator(device, knobs.ddp_bucket_mb, sum_fn if custom else None)
    bucket_bytes = int(knobs.bucket_mb * 2**20)
    if knobs.sparsity == "csc":
        return CSCCommunicator(device, sum_fn, bucket_bytes, knobs.overlap, chunk_size=knobs.chunk_size,
                               density=knobs.density, warmup_epochs=csc_warmup(knobs, lr_warmup_epochs),
                               momentum_correction=knobs.momentum_correction,
                               momentum_masking=knobs.momentum_masking,
                               density_ramp_epochs=knobs.density_ramp_epochs, release_cap=knobs.release_cap,
                               trust_noise_correction=knobs.trust_noise_correction)
    if knobs.fusion == "lazy":
        return LazyAllreduce(device, sum_fn, bucket_bytes, knobs.overlap)
    return PerTensorAllreduce(device, sum_fn)
