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
  (``DDPCommunicator``'s default); ``counting_fp16_compress_hook`` and ``counting_powersgd_hook``
  are PyTorch's own ``fp16_compress_hook`` and ``powerSGD_hook``, unchanged, with what they put on
  the wire counted (``comm=ddp-fp16``, ``comm=powersgd``: the hooks researchers would pick instead).

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
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

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


def counting_fp16_compress_hook(stats: CommStats,
                                bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PyTorch's ``default_hooks.fp16_compress_hook`` (the bucket divided by the world size, cast to
    fp16, allreduced by the backend, cast back), counting the ring-equivalent bytes of the fp16
    payload and one collective into ``stats``. Returns torch's own future: the bucket's sum overlaps
    with backward as it does without the count."""
    buffer = bucket.buffer()
    stats.bytes += ring_bytes(buffer.numel() * 2, dist.get_world_size())
    stats.collectives += 1
    return default_hooks.fp16_compress_hook(None, bucket)


def powersgd_allreduce_sizes(shapes: list[torch.Size], rank: int, compressing: bool,
                             min_compression_rate: float = 2) -> list[int]:
    """The elements of each allreduce that ``powerSGD_hook`` issues for one bucket holding gradients
    of ``shapes``, in order: the rule of torch's ``powerSGD_hook`` (not batching same-shaped tensors),
    kept here so the count cannot drift from it (``tests/test_peers.py`` checks it against the
    allreduces torch really issues).

    1. Before ``start_powerSGD_iter`` (``compressing`` False): one allreduce of the whole bucket.
    2. Otherwise each gradient is viewed as a matrix n x m (n = shape[0], m = numel / n) of rank
       r = min(n, m, ``rank``); it is compressed when (n + m) r ``min_compression_rate`` < n m
       (torch's ``_should_compress``), else sent whole (vectors: biases, BatchNorm; small matrices).
       Three allreduces follow: (a) the uncompressed gradients, concatenated (issued even when
       empty); (b) P, n x r per compressed matrix; (c) Q, m x r per compressed matrix."""
    if not compressing:
        return [sum(shape.numel() for shape in shapes)]
    uncompressed = low_rank_p = low_rank_q = 0
    for shape in shapes:
        n = shape[0] if len(shape) else 1
        m = shape.numel() // n if n else 0
        r = min(n, m, rank)
        if (n + m) * r * min_compression_rate < n * m:
            low_rank_p, low_rank_q = low_rank_p + n * r, low_rank_q + m * r
        else:
            uncompressed += shape.numel()
    return [uncompressed, low_rank_p, low_rank_q]


class PowerSGDHookState:
    """State of ``counting_powersgd_hook``: PyTorch's own ``PowerSGDState`` (``torch_state``),
    untouched but for ``start_powerSGD_iter`` (which ``PowerSGDCommunicator`` moves while its dense
    warm-up lasts), the counts, and which parameters each DDP bucket held when it last compressed
    (``layouts``: bucket index -> positions in ``parameters``), which a checkpoint saves so that a
    resumed run can check that its buckets hold the same gradients as the saved error and factors."""

    def __init__(self, torch_state: powerSGD_hook.PowerSGDState, parameters: list[torch.nn.Parameter]) -> None:
        self.torch_state, self.stats = torch_state, CommStats()
        self.positions = {id(param): i for i, param in enumerate(parameters)}
        self.layouts: dict[int, list[int]] = {}
        self.expected_layouts: dict[int, list[int]] = {}  # restored from a checkpoint, not yet seen again
        self.in_flight: Optional[torch.futures.Future[torch.Tensor]] = None  # the last bucket's, off NCCL


def powersgd_in_order(state: PowerSGDHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Torch's ``powerSGD_hook``, called only once the previous bucket's is done where the backend
    completes futures on its own threads (gloo). Torch's hook issues a bucket's second and third
    allreduces (P, Q) from callbacks on the first one's future; on gloo those run on the backend's
    threads while backward calls the hook of the next bucket, so two ranks could issue one bucket's
    P and the next bucket's first allreduce in opposite orders (gloo then fails on mismatched
    sizes); the last bucket is waited for too, before DDP's own allreduce of which parameters were
    used. On NCCL the future completes as its kernel is queued, the callbacks run at once in
    order, and nothing waits."""
    in_order = bucket.buffer().device.type != "cuda"  # NCCL carries CUDA tensors only
    if state.in_flight is not None and in_order:
        state.in_flight.wait()
    state.in_flight = powerSGD_hook.powerSGD_hook(state.torch_state, bucket)
    if in_order and bucket.is_last():  # DDP's own allreduces follow (unused parameters' map)
        state.in_flight.wait()
    return state.in_flight


def counting_powersgd_hook(state: PowerSGDHookState,
                           bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """PyTorch's ``powerSGD_hook`` on ``state.torch_state``, unchanged, counting into
    ``state.stats`` the ring-equivalent bytes of each allreduce it issues for this bucket
    (``powersgd_allreduce_sizes``) and the collectives. Returns torch's own future. Raises
    RuntimeError where a bucket restored from a checkpoint now holds other parameters (its saved
    error and factors would be applied to the wrong gradients)."""
    torch_state = state.torch_state
    compressing = torch_state.iter >= torch_state.start_powerSGD_iter
    gradients = bucket.gradients()
    world = dist.get_world_size()
    for size in powersgd_allreduce_sizes([g.shape for g in gradients], torch_state.matrix_approximation_rank,
                                         compressing, torch_state.min_compression_rate):
        state.stats.bytes += ring_bytes(size * bucket.buffer().element_size(), world)
        state.stats.collectives += 1
    if compressing:
        index = bucket.index()
        layout = [state.positions[id(param)] for param in bucket.parameters()]
        expected = state.expected_layouts.pop(index, None)
        if expected is not None and expected != layout:
            raise RuntimeError(f"powersgd: DDP bucket {index} holds parameters {layout} but its saved error and "
                               f"factors were for {expected} (another model, comm.ddp_bucket_mb, or a layout "
                               f"DDP had not rebuilt yet)")
        state.layouts[index] = layout
    return powersgd_in_order(state, bucket)


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
