"""Communicators from a resolved configuration: which summing function, which fusion.

The strategies live in the registry (``registry.py``, torch-free), their knobs and how a
configuration resolves to one in ``knobs.py`` (read from the presets in ``configs/comm/``), and so
does what sums a message (``knobs.summing``: on NCCL NCCL's own allreduce by default, ours on gloo);
this module turns a resolved ``CommConfig`` into the objects that do the work: the sum from
``algorithm`` and ``wire``, the communicator from the registered sparsifier's builder (CSC's:
``csc_communicator``) or else from ``fusion``. It also sets NCCL_ALGO before the process group
starts (``prepare_backend``).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Union

import torch
import torch.distributed as dist

from gradientflow_repro.comm import registry
from gradientflow_repro.comm.allreduce import PerTensorAllreduce
from gradientflow_repro.comm.base import BuiltinSum, Communicator, SumFn, builtin_sum
from gradientflow_repro.comm.compression import Fp16Wire
from gradientflow_repro.comm.csc import CSCCommunicator
from gradientflow_repro.comm.ddp import DDPCommunicator, PowerSGDCommunicator
from gradientflow_repro.comm.hierarchical import HierarchicalSum
from gradientflow_repro.comm.knobs import (
    SMALL_MESSAGE_BYTES,
    CommConfig,
    check_backend,
    check_overlap,
    csc_warmup,
    describe_nccl_algo,
    resolve,
    sends_sparse,
    small_message_bytes,
    summing,
)
from gradientflow_repro.comm.lazy import LazyAllreduce
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
    allreduce by default on NCCL (``comm.algorithm=ring`` then selects NCCL's ring through
    NCCL_ALGO, ``prepare_backend``), our algorithms by default elsewhere. ``ranks_per_node``: how
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


def build_communicator(options: Union[Mapping[str, Any], CommConfig], device: torch.device,
                       ranks_per_node: int | None = None, local_rank: int | None = None,
                       lr_warmup_epochs: float = 0.0, backend: Optional[str] = None,
                       at_world_1: bool = False) -> Communicator:
    """The communicator of ``options`` (``comm.*``, resolved against its preset). ``ranks_per_node``
    and ``local_rank`` come from the launcher (``distributed.World``); ``comm.ranks_per_node``
    overrides the former, to emulate nodes on one machine (then the launcher's local rank says
    nothing about that layout). ``lr_warmup_epochs``: the optimizer's learning-rate warm-up, which
    CSC's dense warm-up follows unless ``comm.csc_warmup_epochs`` is set (``knobs.csc_warmup``;
    0, as without a training run: sparse from the first step). ``backend``: the process group's
    (None: as ``dist.get_backend()`` says), for the payloads; the small messages (CSC's norms, the
    fp16 wire's scale: ``recursive_doubling.small_sum``) follow the group's own backend.
    ``at_world_1``: in a process group of one rank, send every message anyway through the backend's
    allreduce (the pool's parts, the fp16 wire's scale, CSC's norms), which the sum of one rank
    leaves as it is: how the GPU check runs NCCL from the pool's thread and stream on one GPU. By
    default one rank sends nothing."""
    knobs = resolve(options)
    backend = backend_name(backend)
    check_overlap(knobs, backend)
    if knobs.ranks_per_node:
        ranks_per_node, local_rank = knobs.ranks_per_node, None
    sum_fn = build_sum(knobs.algorithm, knobs.wire, ranks_per_node, knobs.segment_kb, local_rank,
                       small_message_bytes(knobs), knobs.implementation, backend, at_world_1)
    communicator = _communicator(knobs, device, sum_fn, lr_warmup_epochs)
    if at_world_1 and hasattr(communicator, "norm_sum"):  # CSC's chunk norms: a small sum of their own
        communicator.norm_sum = small_sum(at_world_1=True)
    communicator.summing = describe_sum(knobs.algorithm, knobs.wire, ranks_per_node, small_message_bytes(knobs),
                                        knobs.implementation, backend)
    communicator.schedule = describe_schedule(knobs, lr_warmup_epochs)
    return communicator


def describe_schedule(knobs: CommConfig, lr_warmup_epochs: float) -> str:
    """A sparsifier's schedule in words (CSC's, PowerSGD's), its dense warm-up resolved
    (``comm.csc_warmup_epochs`` null shows as null in the run's saved config); empty for dense strategies."""
    if not sends_sparse(knobs):
        return ""
    warmup = csc_warmup(knobs, lr_warmup_epochs)
    why = "the learning rate's warm-up" if knobs.csc_warmup_epochs is None else "comm.csc_warmup_epochs"
    ramp = (f", falling to it over {knobs.density_ramp_epochs} epoch(s)" if knobs.density_ramp_epochs else "")
    if registry.sparsifier(knobs.sparsity).pricing == "low_rank":  # PowerSGD: never before torch's iteration 2
        start = f"dense for the first {warmup:g} epoch(s) ({why}), then" if warmup else "dense for 2 steps, then"
        return f"{start} PowerSGD rank {knobs.powersgd_rank}"
    start = f"dense for the first {warmup:g} epoch(s) ({why}), then" if warmup else "sparse from the first step:"
    return f"{start} density {knobs.density:g}{ramp}"


def describe_sum(algorithm: str, wire: str, ranks_per_node: int | None,
                 small_bytes: int = SMALL_MESSAGE_BYTES, implementation: str = "auto",
                 backend: Optional[str] = None) -> str:
    """``build_sum``'s choice in words, for the run's first lines: NCCL's allreduce with the
    NCCL_ALGO in force, or ours (with the size up to which they send by recursive doubling)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        return "one rank: nothing to sum"
    backend = backend_name(backend)
    chosen = summing(algorithm, world, ranks_per_node, backend, implementation)
    if chosen.how == "backend" and backend == "nccl":
        how = f"NCCL's allreduce ({describe_nccl_algo()}) over {world} ranks"
    elif chosen.how == "backend":
        how = f"the backend's allreduce ({backend}) over {world} ranks"
    else:
        how = {"two-level": f"two-level ring ({-(-world // (ranks_per_node or 1))} nodes x {ranks_per_node} ranks)",
               "ring": f"flat ring over {world} ranks"}[chosen.how]
        if backend == "nccl":  # ours, asked for by name: point-to-point, its small messages included
            how = f"our {how} (comm.implementation=ours: point-to-point groups issued from Python)"
        how += f", small messages (up to {small_bytes // 1024} KiB) by recursive doubling"
    return how + (", fp16 wire" if wire == "fp16" else "")


def _communicator(knobs: CommConfig, device: torch.device, sum_fn: SumFn, lr_warmup_epochs: float) -> Communicator:
    """The registered sparsifier's own communicator where it has one (``registry.Sparsifier.builder``:
    CSC's), else the fusion's: DDP, the lazy pool, or one allreduce per tensor."""
    builder = registry.sparsifier(knobs.sparsity).builder
    if builder is not None:
        return registry.load(builder)(knobs, device, sum_fn, lr_warmup_epochs)
    if knobs.fusion == "ddp":  # PyTorch's own hooks where DDP sums by the backend, ``sum_hook`` over ours
        # fp32 over the backend's allreduce: DDP's own; fp16 with comm.algorithm=builtin: PyTorch's
        # fp16_compress_hook, no scale (comm=ddp-fp16, or comm=ddp comm.wire=fp16: the peer as researchers
        # run it). Our algorithms' fp16 wire carried by the backend (NCCL's allreduce by default there)
        # keeps its shared scale: ``sum_hook`` over ``Fp16Wire.start``, overlapped
        builtin_fp16 = (knobs.algorithm == "builtin" and isinstance(sum_fn, Fp16Wire)
                        and isinstance(sum_fn.inner, BuiltinSum))
        if isinstance(sum_fn, BuiltinSum) or builtin_fp16:
            return DDPCommunicator(device, knobs.ddp_bucket_mb, None, wire=knobs.wire)
        return DDPCommunicator(device, knobs.ddp_bucket_mb, sum_fn)
    if knobs.fusion == "lazy":
        return LazyAllreduce(device, sum_fn, int(knobs.bucket_mb * 2**20), knobs.overlap)
    return PerTensorAllreduce(device, sum_fn)


def powersgd_communicator(knobs: CommConfig, device: torch.device, sum_fn: SumFn,
                          lr_warmup_epochs: float) -> Communicator:
    """DDP with PyTorch's own PowerSGD hook (``comm.sparsity=powersgd``; the registry's builder for
    it): rank ``comm.powersgd_rank`` factors, error feedback and warm start, dense for CSC's warm-up
    (``knobs.csc_warmup``: the learning rate's unless ``comm.csc_warmup_epochs`` is set). Torch's hook
    does its own allreduces (the backend's): ``sum_fn`` is not used; ``knobs.resolve`` has checked
    that ``comm.fusion`` is ddp."""
    return PowerSGDCommunicator(device, knobs.ddp_bucket_mb, rank=knobs.powersgd_rank,
                                warmup_epochs=csc_warmup(knobs, lr_warmup_epochs))


def csc_communicator(knobs: CommConfig, device: torch.device, sum_fn: SumFn, lr_warmup_epochs: float) -> Communicator:
    """CSC over the lazy pool (``comm.sparsity=csc``; the registry's builder for it), its dense
    warm-up following the learning rate's unless ``comm.csc_warmup_epochs`` is set (``knobs.csc_warmup``)."""
    return CSCCommunicator(device, sum_fn, int(knobs.bucket_mb * 2**20), knobs.overlap, chunk_size=knobs.chunk_size,
                           density=knobs.density, warmup_epochs=csc_warmup(knobs, lr_warmup_epochs),
                           momentum_correction=knobs.momentum_correction,
                           momentum_masking=knobs.momentum_masking,
                           density_ramp_epochs=knobs.density_ramp_epochs, release_cap=knobs.release_cap,
                           trust_noise_correction=knobs.trust_noise_correction,
                           masking_min_wait=knobs.masking_min_wait, rank_by=knobs.rank_by,
                           weight_decay_in=knobs.weight_decay_in)
