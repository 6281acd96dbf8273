"""Strategies by name, each technique switchable alone.

A strategy is a preset of five independent knobs; any knob can be overridden from the command
line (``comm=ring comm.wire=fp16``) to build the paper's ablation one technique at a time:

| knob      | values                        | technique                                   |
|-----------|-------------------------------|---------------------------------------------|
| algorithm | builtin, ring, hierarchical   | how a message is summed (ring.py, hierarchical.py) |
| wire      | fp32, fp16                    | mixed-precision communication (compression.py) |
| fusion    | per_tensor, lazy, ddp         | per-tensor messages, memory pool (lazy.py), or PyTorch DDP |
| overlap   | true, false                   | pool parts sent during backward (lazy only)  |
| sparsity  | dense, csc                    | coarse-grained sparse communication (csc.py) |
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.distributed as dist

from gradientflow_repro.comm.allreduce import PerTensorAllreduce
from gradientflow_repro.comm.base import Communicator, SumFn, builtin_sum
from gradientflow_repro.comm.compression import Fp16Wire
from gradientflow_repro.comm.csc import CSCCommunicator
from gradientflow_repro.comm.ddp import DDPCommunicator
from gradientflow_repro.comm.hierarchical import HierarchicalSum
from gradientflow_repro.comm.lazy import LazyAllreduce
from gradientflow_repro.comm.ring import DEFAULT_SEGMENT_BYTES, ring_sum

_BASE = dict(algorithm="builtin", wire="fp32", fusion="per_tensor", overlap=False, sparsity="dense")
STRATEGIES: dict[str, dict[str, Any]] = {
    "allreduce": {**_BASE},
    "ddp": {**_BASE, "fusion": "ddp", "overlap": True},
    "ring": {**_BASE, "algorithm": "ring"},
    "hierarchical": {**_BASE, "algorithm": "hierarchical"},
    "lazy": {**_BASE, "algorithm": "ring", "fusion": "lazy", "overlap": True},
    "csc": {**_BASE, "algorithm": "ring", "fusion": "lazy", "overlap": True, "sparsity": "csc"},
    "gradientflow": {**_BASE, "algorithm": "ring", "wire": "fp16", "fusion": "lazy", "overlap": True,
                     "sparsity": "csc"},
}
KNOB_VALUES = {"algorithm": ("builtin", "ring", "hierarchical"), "wire": ("fp32", "fp16"),
               "fusion": ("per_tensor", "lazy", "ddp"), "overlap": (True, False),
               "sparsity": ("dense", "csc")}


def resolve(options: Mapping[str, Any]) -> dict[str, Any]:
    """The preset of ``options['strategy']`` with every non-null knob of ``options`` laid over it,
    checked. Raises ValueError naming the ``comm.*`` key at fault."""
    strategy = options.get("strategy")
    if strategy not in STRATEGIES:
        raise ValueError(f"config key 'comm.strategy' = {strategy!r}: allowed values are "
                         f"{', '.join(STRATEGIES)}")
    knobs = {**STRATEGIES[strategy], **{k: v for k, v in options.items() if v is not None}}
    for key, allowed in KNOB_VALUES.items():
        if knobs[key] not in allowed:
            raise ValueError(f"config key 'comm.{key}' = {knobs[key]!r}: allowed values are "
                             f"{', '.join(map(str, allowed))}")
    if knobs["sparsity"] == "csc" and knobs["fusion"] != "lazy":
        raise ValueError("config key 'comm.sparsity' = 'csc' works over the memory pool: it needs "
                         "comm.fusion=lazy")
    if knobs["fusion"] == "ddp" and knobs["sparsity"] != "dense":
        raise ValueError("config key 'comm.sparsity' = 'csc' works over our memory pool, not DDP's "
                         "buckets: use comm.fusion=lazy")
    if not 0 < float(knobs.get("density", 1.0)) <= 1:
        raise ValueError(f"config key 'comm.density' = {knobs['density']}: must be in (0, 1]")
    if int(knobs.get("density_ramp_epochs", 0)) < 0:
        raise ValueError(f"config key 'comm.density_ramp_epochs' = {knobs['density_ramp_epochs']}: must be >= 0")
    return knobs


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


def build_communicator(options: Mapping[str, Any], device: torch.device,
                       ranks_per_node: int | None = None, local_rank: int | None = None) -> Communicator:
    """The communicator of ``options`` (``comm.*``). ``ranks_per_node`` and ``local_rank`` come from
    the launcher (``distributed.World``); ``comm.ranks_per_node`` overrides the former, to emulate
    nodes on one machine (then the launcher's local rank says nothing about that layout)."""
    knobs = resolve(options)
    if knobs.get("ranks_per_node"):
        ranks_per_node, local_rank = knobs["ranks_per_node"], None
    sum_fn = build_sum(knobs["algorithm"], knobs["wire"], ranks_per_node,
                       knobs.get("segment_kb", DEFAULT_SEGMENT_BYTES // 1024), local_rank)
    if knobs["fusion"] == "ddp":
        custom = (knobs["algorithm"], knobs["wire"]) != ("builtin", "fp32")
        return DDPCommunicator(device, knobs.get("ddp_bucket_mb", 25.0), sum_fn if custom else None)
    bucket_bytes = int(float(knobs.get("bucket_mb", 32.0)) * 2**20)
    if knobs["sparsity"] == "csc":
        return CSCCommunicator(device, sum_fn, bucket_bytes, knobs["overlap"],
                               chunk_size=int(knobs.get("chunk_size", 32768)),
                               density=float(knobs.get("density", 0.1)),
                               warmup_epochs=float(knobs.get("csc_warmup_epochs", 1.0)),
                               momentum_correction=bool(knobs.get("momentum_correction", True)),
                               momentum_masking=bool(knobs.get("momentum_masking", True)),
                               density_ramp_epochs=int(knobs.get("density_ramp_epochs", 0)))
    if knobs["fusion"] == "lazy":
        return LazyAllreduce(device, sum_fn, bucket_bytes, knobs["overlap"])
    return PerTensorAllreduce(device, sum_fn)
