"""PyTorch DistributedDataParallel: the strategy users would otherwise pick.

DDP fuses gradients into ~25 MB buckets and allreduces each bucket as soon as backward fills it, so
its communication happens inside ``backward()`` and ``synchronize()`` has nothing left to wait for.
A pass-through communication hook counts the buckets and their bytes. With ``comm.algorithm`` or
``comm.wire`` set, DDP's buckets are summed by this project's ring / hierarchical / fp16 wire
through ``sum_hook``, which any DDP program can register too; ``csc_hook`` brings coarse-grained
sparse communication to any DDP program. (No postponed annotations in this file: DDP checks the
hook's annotations at run time.)
"""

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from gradientflow_repro.comm.base import CommStats, Communicator, SumFn, builtin_sum, ring_bytes
from gradientflow_repro.comm.csc import chunk_l1_norms, send_chosen_chunks_


def _counting_allreduce_hook(stats: CommStats, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    stats.bytes += ring_bytes(buffer.numel() * buffer.element_size(), dist.get_world_size())
    stats.collectives += 1
    return default_hooks.allreduce_hook(None, bucket)


class SumHookState:
    """State of ``sum_hook``: the summing function (ring, hierarchical, fp16-wrapped ...) and its counts."""

    def __init__(self, sum_fn: SumFn) -> None:
        self.sum_fn, self.stats = sum_fn, CommStats()


def sum_hook(state: SumHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook that averages each bucket with one of this project's algorithms,
    so any DDP program can use them::

        ddp_model.register_comm_hook(SumHookState(ring_sum()), sum_hook)

    It runs synchronously inside backward (DDP's own overlap comes from its bucketing order)."""
    buffer = bucket.buffer()
    state.sum_fn(buffer, state.stats)
    buffer.div_(dist.get_world_size())
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


class CSCHookState:
    """State of ``csc_hook``: the knobs, a residual per DDP bucket (kept in fp32, per rank: save it
    with ``state_dict`` beside the model's checkpoint) and the counts.

    ``dense_steps``: iterations sent densely first (dense warm-up). The first iteration is always
    dense, since DDP lays its buckets out anew after it. Unlike ``CSCCommunicator`` the hook cannot
    reach the optimizer, so there is no DGC momentum correction (the optimizer's momentum applies to
    what arrives), and a step that GradScaler skips also discards the residual sent in it."""

    def __init__(self, density: float, chunk_size: int = 32768, dense_steps: int = 0,
                 sum_fn: Optional[SumFn] = None, group: Optional[dist.ProcessGroup] = None) -> None:
        if not 0 < density <= 1:
            raise ValueError(f"csc_hook: density {density} must be in (0, 1]")
        if chunk_size < 1:
            raise ValueError(f"csc_hook: chunk_size {chunk_size} must be positive")
        self.density, self.chunk_size, self.dense_steps = density, chunk_size, max(1, dense_steps)
        self.sum_fn = sum_fn or builtin_sum(group)
        self.norm_sum = builtin_sum(group)
        self.group = group
        self.iteration = 0
        self.residual: dict[int, torch.Tensor] = {}
        self._spare: dict[int, torch.Tensor] = {}  # a bucket's next residual is built here (no allocation)
        self.last_selection: dict[int, torch.Tensor] = {}
        self.always_sent: dict[int, torch.Tensor] = {}  # bucket -> chunks holding 1-D tensors
        self.stats = CommStats()

    def state_dict(self) -> dict:
        return {"iteration": self.iteration, "chunk_size": self.chunk_size,
                "residual": {i: t.cpu() for i, t in self.residual.items()}}

    def load_state_dict(self, state: dict) -> None:
        if state["chunk_size"] != self.chunk_size:
            raise ValueError(f"csc_hook state was saved with chunk_size {state['chunk_size']}, "
                             f"not {self.chunk_size}")
        self.iteration = state["iteration"]
        self.residual = {int(i): t.clone() for i, t in state["residual"].items()}


def _one_dimensional_chunks(bucket: dist.GradBucket, chunk_size: int) -> torch.Tensor:
    """Chunks of the bucket that hold any part of a bias or BatchNorm gradient: always sent. On the
    bucket's device, where the chunk norms it indexes live."""
    chunks, offset = set(), 0
    for param in bucket.parameters():
        if param.ndim <= 1:
            chunks.update(range(offset // chunk_size, (offset + param.numel() - 1) // chunk_size + 1))
        offset += param.numel()
    return torch.tensor(sorted(chunks), dtype=torch.long, device=bucket.buffer().device)


def csc_hook(state: CSCHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook that sends each bucket by coarse-grained sparse communication
    (``comm/csc.py``): chunk norms of residual + gradient summed over ranks, the top ``density`` of
    the chunks (plus those holding 1-D tensors) averaged, the rest kept in the bucket's residual::

        state = CSCHookState(density=0.1, dense_steps=500)
        ddp_model.register_comm_hook(state, csc_hook)

    A non-finite gradient on any rank makes the summed norms non-finite on every rank: that bucket
    then arrives as inf everywhere (GradScaler skips the step) and its residual is kept. Nothing in
    the hook reads a value back to the host: under NCCL it never waits for the GPU."""
    buffer = bucket.buffer()
    world = dist.get_world_size(state.group)
    index = bucket.index()
    if state.iteration < state.dense_steps or state.density >= 1 or world == 1:
        state.sum_fn(buffer, state.stats)
    else:
        chunks = math.ceil(buffer.numel() / state.chunk_size)
        residual = state.residual.get(index)
        if residual is not None and residual.device != buffer.device:  # restored from a checkpoint
            residual = state.residual[index] = residual.to(buffer.device)
        if residual is None:
            residual = state.residual[index] = torch.zeros(chunks, state.chunk_size, device=buffer.device)
        elif residual.shape[0] != chunks:
            raise RuntimeError(f"csc_hook: DDP bucket {index} holds {buffer.numel()} elements but its residual "
                               f"was made for {residual.numel()} (another model, bucket_cap_mb or chunk_size?)")
        spare = state._spare.get(index)
        if spare is None or spare.shape != residual.shape or spare.device != residual.device:
            spare = state._spare[index] = torch.empty_like(residual)
        accumulated = spare.copy_(residual)
        accumulated.view(-1)[:buffer.numel()] += buffer.float()
        norms = chunk_l1_norms(accumulated)
        state.norm_sum(norms, state.stats)
        # A non-finite gradient on any rank makes the summed norms non-finite on every rank. That is
        # decided on the device (reading it on the host would wait for the GPU in every bucket):
        # the residual stays as it was and the bucket is poisoned with inf, so every rank sees the
        # overflow and skips the step.
        finite = torch.isfinite(norms.sum())
        if index not in state.always_sent:
            state.always_sent[index] = _one_dimensional_chunks(bucket, state.chunk_size)
        chosen, summed = send_chosen_chunks_(accumulated, torch.nan_to_num(norms), state.density,
                                             state.sum_fn, state.stats, always=state.always_sent[index])
        # the new residual (or, after an overflow, the old one) goes to the residual's buffer; the
        # spare is then free to assemble what arrived
        torch.where(finite, accumulated, residual, out=residual)
        result = accumulated.zero_().index_copy_(0, chosen, summed)
        buffer.copy_(result.view(-1)[:buffer.numel()])
        buffer.add_(torch.where(finite, 0.0, math.inf))
        state.last_selection[index] = chosen
    buffer.div_(world)
    if bucket.is_last():
        state.iteration += 1
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


class DDPCommunicator(Communicator):
    def __init__(self, device: torch.device, bucket_mb: float = 25.0,
                 sum_fn: Optional[SumFn] = None) -> None:
        super().__init__(device)
        self.bucket_mb, self.sum_fn = bucket_mb, sum_fn

    def attach(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> nn.Module:
        self.model, self.optimizer = model, optimizer
        if self.world_size == 1:
            return model
        wrapped = DistributedDataParallel(
            model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
            bucket_cap_mb=self.bucket_mb)
        if self.sum_fn is None:
            wrapped.register_comm_hook(self.stats, _counting_allreduce_hook)
        else:  # DDP's buckets, summed by one of our algorithms
            state = SumHookState(self.sum_fn)
            state.stats = self.stats
            wrapped.register_comm_hook(state, sum_hook)
        return wrapped

    def synchronize(self) -> None:
        pass  # DDP already reduced every bucket inside backward()
