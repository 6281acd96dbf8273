"""Communicators from a ``Plan``: the sum, the wire, the fusion or the sparsifier's own communicator.

``plan.resolve`` has decided everything (which sum, which wire, fusion, sparsifier and its keys,
the warm-up); ``build`` turns the plan into the objects that do the work in one pass: the summing
function (``build_sum``: the backend's allreduce or our ring / two-level ring, each with the fp16
wire around it where asked), then the communicator: the sparsifier's own builder where it has one
(CSC's, PowerSGD's: ``registry.Sparsifier.builder``), else the fusion's (per-tensor allreduce, the
lazy pool, DDP). ``build_communicator`` is both steps from options, as the trainer calls it.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Union

import torch
import torch.distributed as dist

from gradientflow_repro.comm import registry
from gradientflow_repro.comm.allreduce import PerTensorAllreduce
from gradientflow_repro.comm.base import BuiltinSum, Communicator, SumFn, builtin_sum
from gradientflow_repro.comm.compression import Fp16Wire
from gradientflow_repro.comm.ddp import DDPCommunicator
from gradientflow_repro.comm.hierarchical import HierarchicalSum
from gradientflow_repro.comm.knobs import (
    SMALL_MESSAGE_BYTES,
    CommConfig,
    check_backend,
    check_overlap,
    describe_nccl_algo,
    summing,
)
from gradientflow_repro.comm.lazy import LazyAllreduce
from gradientflow_repro.comm.plan import Plan, describe_schedule, describe_sum, resolve
from gradientflow_repro.comm.recursive_doubling import SizedSum, small_sum
from gradientflow_repro.comm.ring import DEFAULT_SEGMENT_BYTES, ring_sum


def backend_name(backend: Optional[str] = None) -> str:
    """``backend``, or the default process group's backend ("nccl", "gloo"); "gloo" without one."""
    if backend is not None:
        return backend
    return dist.get_backend() if dist.is_initialized() else "gloo"


def build_sum(algorithm: str, wire: str, ranks_per_node: int | None = None,
              segment_kb: int = DEFAULT_SEGMENT_BYTES // 1024, local_rank: int | None = None,
              small_bytes: int = SMALL_MESSAGE_BYTES, implementation: str = "auto",
              backend: Optional[str] = None, at_world_1: bool = False) -> SumFn:
    """The summing function of ``algorithm`` (with the fp16 wire around it) on ``backend`` (None:
    the process group's) under ``comm.implementation``: what ``knobs.summing`` says, the backend's
    allreduce by default on NCCL (its tuner picks ring or tree; no configuration sets NCCL_ALGO),
    our algorithms by default elsewhere. ``ranks_per_node``: how
    many consecutive ranks share a node, as the launcher says (torchrun's LOCAL_WORLD_SIZE, Slurm's
    tasks per node) or ``comm.ranks_per_node`` sets; ``local_rank`` checks that layout. Our own
    algorithms send small messages (at most ``small_bytes``: by default ``SMALL_MESSAGE_BYTES``,
    measured) by recursive doubling: log2(N) latencies instead of the ring's 2(N-1). One rank has
    nothing to sum with and sends nothing, unless ``at_world_1`` (``build_communicator``)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        if not at_world_1:
            return builtin_sum()  # nothing to sum with
        # the backend's allreduce of one rank, as NCCL's carries the messages of many by default
        sent = builtin_sum(at_world_1=True)
        return Fp16Wire(sent, 1, at_world_1=True) if wire == "fp16" else sent
    chosen = summing(algorithm, world, ranks_per_node, backend_name(backend), implementation)
    if chosen.how == "two-level":
        sum_fn = SizedSum(HierarchicalSum(ranks_per_node or 1, segment_kb * 1024, local_rank=local_rank),
                          threshold_bytes=small_bytes, ours=True)
    elif chosen.how == "ring":
        sum_fn = SizedSum(ring_sum(segment_bytes=segment_kb * 1024), threshold_bytes=small_bytes, ours=True)
    else:
        sum_fn = builtin_sum()
    return Fp16Wire(sum_fn, world) if wire == "fp16" else sum_fn


def prepare_backend(options: Union[Mapping[str, Any], CommConfig, Any], device: torch.device,
                    world_size: int) -> Optional[str]:
    """Before the process group starts (``train.py``): refuse a combination that cannot overlap
    (``knobs.check_overlap``) before any work. The backend follows the device as
    ``distributed.init_process_group`` chooses it: NCCL for CUDA devices on more than one rank.
    Returns the NCCL_ALGO in force (a user's; no configuration sets it: ``knobs.Summing``). Raises
    ``distributed.WorldError`` naming the keys."""
    from gradientflow_repro.distributed import WorldError

    backend = "nccl" if device.type == "cuda" and world_size > 1 else "gloo"
    try:
        return check_backend(options, backend)
    except ValueError as error:
        raise WorldError(str(error)) from None


def build_communicator(options: Union[Mapping[str, Any], CommConfig, Plan, Any], device: torch.device,
                       ranks_per_node: int | None = None, local_rank: int | None = None,
                       lr_warmup_epochs: float = 0.0, backend: Optional[str] = None,
                       at_world_1: bool = False) -> Communicator:
    """The communicator of ``options`` (``comm.*``, resolved against its preset into a ``Plan`` for
    this process group). ``ranks_per_node`` and ``local_rank`` come from the launcher
    (``distributed.World``); ``comm.ranks_per_node`` overrides the former, to emulate nodes on one
    machine. ``lr_warmup_epochs``: the optimizer's learning-rate warm-up, which a sparsifier's dense
    warm-up follows unless ``comm.csc_warmup_epochs`` is set (0, as without a training run: sparse
    from the first step). ``backend``: the process group's (None: as ``dist.get_backend()`` says).
    ``at_world_1``: see ``build``."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    plan = resolve(options, world=world, backend=backend_name(backend), ranks_per_node=ranks_per_node,
                   local_rank=local_rank, lr_warmup_epochs=lr_warmup_epochs)
    return build(plan, device, at_world_1)


def build(plan: Plan, device: torch.device, at_world_1: bool = False) -> Communicator:
    """The communicator ``plan`` describes, in one pass: its sum, then the sparsifier's communicator
    (``registry.Sparsifier.builder``) or the fusion's. ``at_world_1``: in a process group of one rank,
    send every message anyway through the backend's allreduce (the pool's parts, the fp16 wire's
    scale, CSC's norms), which the sum of one rank leaves as it is: how the GPU check runs NCCL from
    the pool's thread and stream on one GPU. By default one rank sends nothing."""
    check_overlap(plan, plan.backend)
    sum_fn = build_sum(plan.algorithm, plan.wire, plan.layout_ranks_per_node, plan.segment_kb, plan.local_rank,
                       plan.small_message_bytes, plan.implementation, plan.backend, at_world_1)
    builder = plan.sparsifier.builder
    communicator = registry.load(builder)(plan, device, sum_fn) if builder is not None else \
        _fused(plan, device, sum_fn)
    if at_world_1 and hasattr(communicator, "norm_sum"):  # CSC's chunk norms: a small sum of their own
        communicator.norm_sum = small_sum(at_world_1=True)
    communicator.summing = describe_sum(plan, describe_nccl_algo())
    communicator.schedule = describe_schedule(plan)
    return communicator


def _fused(plan: Plan, device: torch.device, sum_fn: SumFn) -> Communicator:
    """A dense strategy's communicator, by ``comm.fusion``: DDP, the lazy pool, or one allreduce per tensor."""
    if plan.fusion == "ddp":  # PyTorch's own hooks where DDP sums by the backend, ``sum_hook`` over ours
        # fp32 over the backend's allreduce: DDP's own; fp16 with comm.algorithm=builtin: PyTorch's
        # fp16_compress_hook, no scale (comm=ddp-fp16, or comm=ddp comm.wire=fp16: the peer as researchers
        # run it). Our algorithms' fp16 wire carried by the backend (NCCL's allreduce by default there)
        # keeps its shared scale: ``sum_hook`` over ``Fp16Wire.start``, overlapped
        builtin_fp16 = (plan.algorithm == "builtin" and isinstance(sum_fn, Fp16Wire)
                        and isinstance(sum_fn.inner, BuiltinSum))
        if isinstance(sum_fn, BuiltinSum) or builtin_fp16:
            return DDPCommunicator(device, plan.ddp_bucket_mb, None, wire=plan.wire)
        return DDPCommunicator(device, plan.ddp_bucket_mb, sum_fn)
    if plan.fusion == "lazy":
        return LazyAllreduce(device, sum_fn, plan.bucket_bytes, plan.overlap)
    return PerTensorAllreduce(device, sum_fn)
