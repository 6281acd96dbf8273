"""Lazy allreduce: gradients gathered in a memory pool, one fused allreduce per full pool part,
overlapped with the rest of backward.

Per-tensor allreduce pays a network latency for every tensor and sends small messages that do not
fill the link. GradientFlow instead lets backward write each gradient, as soon as autograd has
finished it, into a contiguous memory pool, and "lazily" allreduces a part of the pool once it holds
at least ``bucket_bytes`` (the paper's fusion threshold; the idea of Horovod's tensor fusion and of
DDP's buckets). While that part travels on a communication thread, backward keeps computing the
gradients of earlier layers: computation/communication overlap. ``synchronize()`` sends what is
left and waits.

The pool's layout is fixed at ``attach`` from the parameter order (reversed, since backward meets
the last layers first) and is the same on every rank; parts are sent strictly in layout order, so
every rank issues the same collectives in the same order whatever order its hooks fire in. A part
holding a parameter that got no gradient this step (unused branch) is completed with zeros at
``synchronize()``. Under ``accumulating()`` (micro-batches of gradient accumulation) hooks do
nothing, and the last micro-batch's hooks copy the accumulated gradients.

Gradients are views of the pool (as DDP's ``gradient_as_bucket_view``): a hook copies the gradient
autograd made into its place in the pool once and points ``p.grad`` at that place, so the summed
mean is in ``p.grad`` without a copy out (or a fresh gradient tensor) per step. The copy in stays:
autograd allocates each gradient, and accumulating straight into a pool that must first be zeroed
reads and writes more than copying once. Each view lies in memory like its parameter
(``shaped_like``: a channels_last weight's gradient stays channels_last), so elementwise work and
the optimizer's fused kernels pair gradients with weights without a transpose.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
from torch import nn

from gradientflow_repro.comm.base import Communicator, SumFn, channels_last, communication_thread, trainable
from gradientflow_repro.comm.pool import pack_parts


def shaped_like(flat: torch.Tensor, offset: int, param: torch.Tensor) -> torch.Tensor:
    """The ``param.numel()`` elements of ``flat`` from ``offset`` as a view shaped like ``param`` and
    laid out like it (in its memory order: channels_last stays channels_last; any other layout is
    taken as contiguous): where a parameter's gradient lies in the pool."""
    segment = flat[offset:offset + param.numel()]
    if channels_last(param):
        n, c, h, w = param.shape
        return segment.view(n, h, w, c).permute(0, 3, 1, 2)
    return segment.view(param.shape)


@dataclass(eq=False)
class Bucket:
    """One pool part: the parameters whose gradients it holds, where each lies in it, and the
    fp32 buffer itself (end to end for lazy allreduce; CSC puts its chunks, padded to whole chunks,
    before the dense tail)."""

    params: list[nn.Parameter]
    offsets: list[int]  # where each parameter's gradient starts in ``flat``
    flat: torch.Tensor  # the pool part (fp32)
    sparse_elements: int = 0  # csc: the leading elements that may be sparsified (whole chunks)
    index: int = -1  # position in the layout (the order parts are sent in)
    seen: list[bool] = field(default_factory=list)
    views: list[torch.Tensor] = field(default_factory=list)  # each parameter's place in ``flat``, shaped like it

    def __post_init__(self) -> None:
        if not self.views:
            self.views = [shaped_like(self.flat, offset, param) for param, offset in zip(self.params, self.offsets)]

    @property
    def full(self) -> bool:
        return all(self.seen)


def pool_gradient(param: nn.Parameter, view: torch.Tensor) -> None:
    """Make ``param.grad`` the pool's ``view``: copy the gradient autograd made there (zeros where it
    made none) unless ``param.grad`` is that view already (a micro-batch accumulated into it). A
    gradient of another type than the fp32 pool (a half-precision parameter) stays its own tensor,
    and ``synchronize`` copies the mean back into it."""
    grad = param.grad
    if grad is not None and grad.data_ptr() == view.data_ptr() and grad.stride() == view.stride():
        return
    view.copy_(grad) if grad is not None else view.zero_()
    if grad is None or grad.dtype == view.dtype:  # (a gradient of another type than the fp32 pool keeps its own)
        param.grad = view


class LazyAllreduce(Communicator):
    def __init__(self, device: torch.device, sum_fn: SumFn, bucket_bytes: int, overlap: bool) -> None:
        super().__init__(device)
        self.sum_fn, self.bucket_bytes, self.overlap = sum_fn, bucket_bytes, overlap
        self.buckets: list[Bucket] = []
        self._slot: dict[nn.Parameter, tuple[int, int]] = {}  # parameter -> (bucket, position)
        self._hooks: list = []
        self._futures: list[Future] = []
        self._next_launch = 0
        self._accumulating = False
        self._executor: Optional[ThreadPoolExecutor] = None
        # high priority: a part's collective and CSC's local work are the step's critical path at the
        # end of backward, so the GPU schedules them ahead of the rest of backward's kernels
        self._stream = torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None

    # ------------------------------------------------------------------ layout
    def attach(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> nn.Module:
        super().attach(model, optimizer)
        self.buckets = self.layout(trainable(model)[::-1])
        for index, bucket in enumerate(self.buckets):
            bucket.index = index
            for position, param in enumerate(bucket.params):
                self._slot[param] = (index, position)
                self._hooks.append(param.register_post_accumulate_grad_hook(self._on_grad))
        if self.overlap:
            self._executor = communication_thread(self.device)
        return model

    def layout(self, params: list[nn.Parameter]) -> list[Bucket]:
        """Consecutive parameters into parts of at least ``bucket_bytes`` (the last may be smaller):
        the pool's packing rule, ``comm/pool.py`` (which the scaling model prices too)."""
        return [self.make_bucket([params[i] for i in part.indices])
                for part in pack_parts([p.numel() for p in params], self.bucket_bytes)]

    def make_bucket(self, params: list[nn.Parameter], elements: int = 0,
               starts: Optional[list[int]] = None, sparse_elements: int = 0) -> Bucket:
        """A pool part of ``elements`` (at least the parameters' total) zeroed fp32 elements holding
        ``params`` at ``starts`` (default: end to end from 0)."""
        if starts is None:
            starts = [sum(p.numel() for p in params[:i]) for i in range(len(params))]
        elements = max(elements, sum(p.numel() for p in params))
        return Bucket(params, starts, torch.zeros(elements, dtype=torch.float32, device=self.device),
                      sparse_elements=sparse_elements, seen=[False] * len(params))

    # ------------------------------------------------------------------ during backward
    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """Backward passes inside accumulate into ``p.grad`` without communicating."""
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    def _on_grad(self, param: nn.Parameter) -> None:
        if self._accumulating:
            return
        index, position = self._slot[param]
        bucket = self.buckets[index]
        pool_gradient(param, bucket.views[position])
        bucket.seen[position] = True
        if self._executor is not None:
            self._launch_full_buckets()

    def _launch_full_buckets(self) -> None:
        """Hand full parts to the communication thread, strictly in layout order."""
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].full:
            ready = None
            if self._stream is not None:  # the copy into the pool must land before sending
                ready = torch.cuda.Event()
                ready.record()
            self._futures.append(self._executor.submit(self._reduce_on_stream, self._next_launch, ready))
            self._next_launch += 1

    def _reduce_on_stream(self, index: int, ready: Optional[torch.cuda.Event]) -> None:
        if self._stream is None:
            self.reduce_bucket(self.buckets[index])
            return
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            self.reduce_bucket(self.buckets[index])

    def reduce_bucket(self, bucket: Bucket) -> None:
        """Sum one pool part over ranks, in place (overridden by sparse communication)."""
        self.sum_fn(bucket.flat, self.stats)

    # ------------------------------------------------------------------ after backward
    def synchronize(self) -> None:
        started = time.perf_counter()
        for bucket in self.buckets:
            for position, param in enumerate(bucket.params):
                if not bucket.seen[position]:  # no hook fired: unused parameter (or hooks bypassed)
                    pool_gradient(param, bucket.views[position])
                    bucket.seen[position] = True
        if self._executor is not None:
            self._launch_full_buckets()
        else:  # no overlap: everything is sent now, after backward
            for bucket in self.buckets:
                self.reduce_bucket(bucket)
        for future in self._futures:
            future.result()  # re-raises a failure of the communication thread here
        if self._stream is not None:
            torch.cuda.current_stream().wait_stream(self._stream)
        for bucket in self.buckets:  # p.grad is a view of its part: the mean needs no copy out
            if self.world_size > 1:
                bucket.flat.div_(self.world_size)
            for param, view in zip(bucket.params, bucket.views):
                if param.grad.data_ptr() != view.data_ptr():  # a gradient of its own type (see pool_gradient)
                    param.grad.copy_(view)
            bucket.seen = [False] * len(bucket.params)
        self._futures, self._next_launch = [], 0
        self.stats.wait_s += time.perf_counter() - started

    def close(self) -> None:  # (each p.grad stays a view of the pool: the model keeps its last gradients)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
