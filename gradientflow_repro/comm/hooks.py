"""DDP communication hooks: this project's algorithms inside any PyTorch DDP program.

The analogue of PyTorch's ``torch.distributed.algorithms.ddp_comm_hooks``: small functions that DDP
calls once per gradient bucket during ``backward()``, each with a state object that holds its knobs,
its counts and, where it has any, its per-rank state (with ``state_dict``/``load_state_dict``, to be
saved beside each rank's checkpoint)::

    from torch.nn.parallel import DistributedDataParallel
    from gradientflow_repro.comm.compression import Fp16Wire
    from gradientflow_repro.comm.hooks import CSCHookState, SumHookState, csc_hook, sum_hook
    from gradientflow_repro.comm.ring import ring_sum

    ddp_model = DistributedDataParallel(model)
    # every bucket averaged by the ring allreduce, over an fp16 wire
    ddp_model.register_comm_hook(SumHookState(Fp16Wire(ring_sum(), world_size)), sum_hook)
    # or coarse-grained sparse communication: dense for 500 iterations, then the top 10% of chunks
    state = CSCHookState(density=0.1, dense_steps=500)
    ddp_model.register_comm_hook(state, csc_hook)
    ...
    torch.save(state.state_dict(), f"csc_rank{rank}.pt")  # residuals are per rank

- ``sum_hook`` sums each bucket with any summing function (``SumFn``: ring, hierarchical, fp16 wire,
  the builtin allreduce) and divides by the world size; over the builtin allreduce it returns the
  collective's future (below: overlap).
- ``csc_hook`` sends each bucket by coarse-grained sparse communication (``comm/csc/``): the chunk
  norms of residual + gradient are summed over ranks, the top ``density`` of the chunks (plus every
  chunk holding part of a 1-D tensor: biases, BatchNorm) are averaged, the rest stay in the bucket's
  residual (``csc.state.BucketState``, the same object ``CSCCommunicator`` keeps per pool part). The hook
  cannot see whether GradScaler will skip the step, so it decides on the device: a non-finite
  gradient on any rank keeps every rank's residual and arrives as inf, so every rank skips. It never
  reads a value back to the host, so under NCCL it never waits for the GPU.
- ``counting_allreduce_hook`` is DDP's own allreduce with bytes and collectives counted
  (``DDPCommunicator``'s default).

Overlap. DDP calls a hook as soon as backward fills its bucket and waits for the future it returns
only at the end of backward. ``sum_hook`` over the backend's allreduce (``base.BuiltinSum``, alone
or inside the fp16 wire) returns the collective's own future, the division (and the fp16 wire's
decompression) chained on it with ``then``, as PyTorch's ``fp16_compress_hook``: backward goes on
while the bucket is summed. Over our point-to-point algorithms (ring, two-level, recursive
doubling) the sum is done before the hook returns, so that bucket's communication holds backward
up: the trainer refuses that combination on NCCL (``knobs.check_overlap``: ``comm.fusion=ddp`` with
``comm.implementation=ours``); on gloo it runs so, as measured. ``csc_hook`` too finishes its bucket
inside the hook (it selects chunks from the summed norms before it sends).
(No postponed annotations in this file: DDP checks a hook's annotations at run time.)
"""

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from gradientflow_repro.comm.base import CommStats, SumFn, builtin_sum, ring_bytes
from gradientflow_repro.comm.csc import BucketState
from gradientflow_repro.comm.recursive_doubling import small_sum


def _done(buffer: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


def counting_allreduce_hook(stats: CommStats, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default allreduce, counting ring-equivalent bytes and collectives into ``stats``."""
    buffer = bucket.buffer()
    stats.bytes += ring_bytes(buffer.numel() * buffer.element_size(), dist.get_world_size())
    stats.collectives += 1
    return default_hooks.allreduce_hook(None, bucket)


class SumHookState:
    """State of ``sum_hook``: the summing function (ring, hierarchical, fp16-wrapped ...) and its counts."""

    def __init__(self, sum_fn: SumFn) -> None:
        self.sum_fn, self.stats = sum_fn, CommStats()


def sum_hook(state: SumHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook that averages each bucket with one of this project's algorithms::

        ddp_model.register_comm_hook(SumHookState(ring_sum()), sum_hook)
    """
    buffer = bucket.buffer()
    world = dist.get_world_size()
    if getattr(state.sum_fn, "asynchronous", False):  # the backend's allreduce: DDP overlaps it
        def mean(future: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            return future.value().div_(world)
        return state.sum_fn.start(buffer, state.stats).then(mean)
    state.sum_fn(buffer, state.stats)  # one of our point-to-point loops: done when it returns
    buffer.div_(world)
    return _done(buffer)


class CSCHookState:
    """State of ``csc_hook``: the knobs, a ``BucketState`` per DDP bucket (its residual kept in fp32,
    per rank: save it with ``state_dict`` beside the model's checkpoint) and the counts.

    ``dense_steps``: iterations sent densely first (dense warm-up). The first iteration is always
    dense, since DDP lays its buckets out anew after it. Unlike ``CSCCommunicator`` the hook cannot
    reach the optimizer, so there is no DGC momentum correction (the optimizer's momentum applies to
    what arrives), no release cap (chosen chunks are sent whole: its chunks mix weights with the
    biases and BatchNorm tensors that must arrive whole), and a step that GradScaler skips also
    discards the residual sent in it."""

    def __init__(self, density: float, chunk_size: int = 32768, dense_steps: int = 0,
                 sum_fn: Optional[SumFn] = None, group: Optional[dist.ProcessGroup] = None) -> None:
        if not 0 < density <= 1:
            raise ValueError(f"csc_hook: density {density} must be in (0, 1]")
        if chunk_size < 1:
            raise ValueError(f"csc_hook: chunk_size {chunk_size} must be positive")
        self.density, self.chunk_size, self.dense_steps = density, chunk_size, max(1, dense_steps)
        self.sum_fn = sum_fn or builtin_sum(group)
        self.norm_sum = small_sum(group)  # the chunk norms: a small message
        self.group = group
        self.iteration = 0
        self.parts: dict[int, BucketState] = {}  # DDP bucket index -> its state
        self.always_sent: dict[int, torch.Tensor] = {}  # bucket -> chunks holding 1-D tensors
        self.stats = CommStats()

    @property
    def residual(self) -> dict[int, torch.Tensor]:
        """DDP bucket index -> its residual, [chunks, chunk_size]."""
        return {i: part.residual for i, part in self.parts.items()}

    @property
    def last_selection(self) -> dict[int, torch.Tensor]:
        """DDP bucket index -> the chunks it last sent (for tests)."""
        return {i: part.last_selection for i, part in self.parts.items() if part.last_selection is not None}

    def part(self, index: int, buffer: torch.Tensor) -> BucketState:
        """Bucket ``index``'s state, made on first use, on the bucket's device."""
        chunks = math.ceil(buffer.numel() / self.chunk_size)
        part = self.parts.get(index)
        if part is None:
            part = self.parts[index] = BucketState.zeros(chunks, self.chunk_size, buffer.device)
        part.to(buffer.device)  # restored from a checkpoint on the CPU
        if part.residual.shape[0] != chunks:
            raise RuntimeError(f"csc_hook: DDP bucket {index} holds {buffer.numel()} elements but its residual "
                               f"was made for {part.residual.numel()} (another model, bucket_cap_mb or chunk_size?)")
        return part

    def state_dict(self) -> dict:
        return {"iteration": self.iteration, "chunk_size": self.chunk_size,
                "residual": {i: part.state_dict()["residual"] for i, part in self.parts.items()}}

    def load_state_dict(self, state: dict) -> None:
        if state["chunk_size"] != self.chunk_size:
            raise ValueError(f"csc_hook state was saved with chunk_size {state['chunk_size']}, "
                             f"not {self.chunk_size}")
        self.iteration = state["iteration"]
        self.parts = {}
        for index, residual in state["residual"].items():
            part = self.parts[int(index)] = BucketState()
            part.load_state_dict({"residual": residual})


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
    """A DDP communication hook that sends each bucket by coarse-grained sparse communication::

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
        part = state.part(index, buffer)
        if index not in state.always_sent:
            state.always_sent[index] = _one_dimensional_chunks(bucket, state.chunk_size)
        sent = part.sparsify(buffer, state.density, state.sum_fn, state.norm_sum, state.stats,
                             always=state.always_sent[index], guard_overflow=True)
        # whether to apply is decided on the device (reading it on the host would wait for the GPU
        # in every bucket): after an overflow the residual stays as it was ...
        part.commit(when=sent.finite)
        # ... and the bucket is poisoned with inf, so every rank sees the overflow and skips the step
        result = part.scratch.zero_().index_copy_(0, sent.chosen, sent.summed)
        buffer.copy_(result.view(-1)[:buffer.numel()])
        buffer.add_(torch.where(sent.finite, 0.0, math.inf))
    buffer.div_(world)
    if bucket.is_last():
        state.iteration += 1
    return _done(buffer)
