"""The one interface through which the trainer reaches gradients.

A communicator is attached once to the model (and its optimizer, which sparse communication must
adjust); then every step the trainer calls ``begin_step`` before the forward pass and
``synchronize`` after ``backward``, which leaves each ``p.grad`` holding the global mean over ranks
(or, under sparse communication, the mean of what was sent this step). Strategies that work during
backward do so from gradient hooks; between ``backward`` and ``synchronize`` a ``p.grad`` may be in
flight (the lazy pool's gradients are views of parts being summed, as under DDP's
``gradient_as_bucket_view``): read gradients after ``synchronize``. Per-rank state (residuals,
velocities) travels through ``state_dict``/``load_state_dict`` into each rank's own checkpoint file;
``rank_rules`` says how it maps onto another number of ranks. ``stats`` counts, per step,
the bytes this rank put on the wire, the collectives it issued and the seconds the trainer waited
in ``synchronize()``.

Byte accounting: algorithms built here count the bytes they send. For builtin collectives
(``dist.all_reduce``, DDP's buckets), whose internal algorithm the backend picks, the count is the
ring-equivalent 2(N-1)/N of the payload, so all strategies are compared on the same footing.
"""

from __future__ import annotations

import abc
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class CommStats:
    bytes: int = 0  # bytes this rank sent (ring-equivalent for builtin collectives)
    collectives: int = 0  # collective operations issued (a ring allreduce counts as one)
    wait_s: float = 0.0  # seconds the trainer spent inside synchronize()

    def take(self) -> dict:
        """Return the counts since the last call and start new ones."""
        snapshot = asdict(self)
        self.bytes, self.collectives, self.wait_s = 0, 0, 0.0
        return snapshot


# An in-place SUM over ranks that records what it sent: builtin, ring, hierarchical, fp16-wrapped.
SumFn = Callable[[torch.Tensor, CommStats], None]


_SCRATCH = threading.local()


def scratch(purpose: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A buffer of ``numel`` elements kept between calls, one per purpose, type and device, and per
    thread (the lazy pool's communication thread and the trainer's may both be summing). A fresh
    allocation from a few hundred KiB up costs page faults on every call on a CPU: the receive
    buffers of the ring and of recursive doubling and the fp16 wire's buffer are all reused. The
    contents are whatever the last user left; the buffer is the caller's until the same thread asks
    for the same purpose again."""
    buffers = _SCRATCH.__dict__.setdefault("buffers", {})
    key = (purpose, dtype, device)
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = buffers[key] = torch.empty(numel, dtype=dtype, device=device)
    return buffer[:numel]


def ring_bytes(payload_bytes: int, world: int) -> int:
    return 2 * (world - 1) * payload_bytes // world if world > 1 else 0


class BuiltinSum:
    """The backend's own allreduce (NCCL's or gloo's) as a summing function (a ``SumFn``).
    ``start`` issues it without waiting and returns a future of the summed tensor: what a DDP
    communication hook returns so that backward goes on while the bucket is summed (``hooks.py``).
    Our point-to-point algorithms have no ``start``: they finish before they return."""

    asynchronous = True  # has ``start``

    def __init__(self, group: Optional[dist.ProcessGroup] = None, at_world_1: bool = False) -> None:
        """``at_world_1``: send even when the group has one rank (the sum of one rank is itself, so
        nothing changes but that the backend runs): how the GPU check drives NCCL from the pool's
        thread and stream on one GPU. Otherwise one rank sends nothing."""
        self.group, self.at_world_1 = group, at_world_1

    def _count(self, tensor: torch.Tensor, stats: CommStats) -> bool:
        """Whether ``tensor`` is sent (more than one rank, or ``at_world_1``); counts it if so."""
        world = dist.get_world_size(self.group) if dist.is_initialized() else 1
        if world == 1 and not (self.at_world_1 and dist.is_initialized()):
            return False
        stats.collectives += 1
        stats.bytes += ring_bytes(tensor.numel() * tensor.element_size(), world)
        return True

    def __call__(self, tensor: torch.Tensor, stats: CommStats) -> None:
        if self._count(tensor, stats):
            dist.all_reduce(tensor, group=self.group)

    def start(self, tensor: torch.Tensor, stats: CommStats) -> "torch.futures.Future[torch.Tensor]":
        """Issue the allreduce of ``tensor`` (in place) and return at once: a future of ``tensor``."""
        if not self._count(tensor, stats):
            done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            done.set_result(tensor)
            return done

        def summed(future: "torch.futures.Future[list[torch.Tensor]]") -> torch.Tensor:
            future.value()  # raises what the collective raised
            return tensor
        return dist.all_reduce(tensor, group=self.group, async_op=True).get_future().then(summed)


def builtin_sum(group: Optional[dist.ProcessGroup] = None, at_world_1: bool = False) -> SumFn:
    """The backend's own allreduce (NCCL or gloo): ``BuiltinSum``."""
    return BuiltinSum(group, at_world_1)


def communication_thread(device: torch.device) -> ThreadPoolExecutor:
    """The one thread that sends pool parts while backward runs. A new thread's current CUDA device
    is 0, whatever the rank's: using a stream of GPU k there (``torch.cuda.stream``) would switch
    to GPU k and, on leaving, back to GPU 0, creating a CUDA context on GPU 0 in every rank (hundreds
    of MB each, and an error on exclusive-process GPUs). So the thread adopts the rank's device
    before it runs anything."""
    initializer = (lambda: torch.cuda.set_device(device)) if device.type == "cuda" else None
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradientflow-comm", initializer=initializer)


# The fp16 loss scale the coming gradients carry: a tensor on the device (reading it would wait for
# the GPU), a number (tests), or None for none.
GradScale = Union[torch.Tensor, float, None]


def channels_last(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a 4-d tensor laid out channels_last (and not also contiguous)."""
    return (tensor.dim() == 4 and not tensor.is_contiguous()
            and tensor.is_contiguous(memory_format=torch.channels_last))


def in_memory_order(tensor: torch.Tensor) -> Optional[torch.Tensor]:
    """``tensor``'s elements as one contiguous dimension in the order they lie in memory, a view
    (contiguous and channels_last tensors); None for other layouts. A sum over ranks is elementwise,
    so it may run in memory order wherever every rank lays the tensor out alike (the same model)."""
    if tensor.is_contiguous():
        return tensor.view(-1)
    if channels_last(tensor):
        return tensor.permute(0, 2, 3, 1).view(-1)
    return None


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


class Communicator(abc.ABC):
    name: str = "abstract"
    density_now: float = 1.0  # fraction of weight-gradient chunks sent this step (below 1: CSC)
    summing: str = "the backend's allreduce"  # how messages are summed, in words (set by the factory)
    schedule: str = ""  # for a sparse strategy, when it sends how much, in words (set by the factory)
    # steps after ``attach`` that send every gradient whole whatever the schedule says (PowerSGD:
    # torch's hook compresses from its third iteration): a benchmark of the compressed step skips them
    steps_sent_whole: int = 0

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.stats = CommStats()

    def attach(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> nn.Module:
        """Prepare for ``model``; returns the module to run forward on. Broadcasts rank 0's
        parameters and buffers so that every rank starts from the same weights."""
        if self.world_size > 1:
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor.data, src=0)
        self.model, self.optimizer = model, optimizer
        return model

    def begin_step(self, epoch: float, grad_scale: GradScale = None) -> None:
        """Called before each forward pass: training progress in epochs, and the loss scale the
        coming gradients will carry (fp16; kept on the device, never read on the host)."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """After backward: every parameter's ``grad`` becomes the mean over ranks."""

    def end_step(self, applied: bool) -> None:
        """After the optimizer decision: ``applied`` is False when the step was skipped on every
        rank (non-finite gradients), so stateful strategies can discard what this step added."""

    def sparsity_stats(self) -> dict:
        """What sparsification did since the last call, for the run's metrics (``{}``: nothing to say;
        CSC's: ``CSCCommunicator.sparsity_stats``). Called at the trainer's progress records, so a
        GPU is waited for there only."""
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def rank_rules(self) -> dict[str, str]:
        """How each key of ``state_dict`` maps onto another number of ranks at a resume (see
        ``state``): ``"mean"`` (each new rank takes the mean over the old ranks), ``"same"`` (equal
        on every rank: old rank 0's) or ``"own"``. A key without a rule refuses such a resume."""
        return {}

    def close(self) -> None:
        """Release threads and hooks."""
