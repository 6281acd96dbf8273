"""PyTorch DistributedDataParallel: the strategy users would otherwise pick.

DDP fuses gradients into ~25 MB buckets and allreduces each bucket as soon as backward fills it, so
its communication happens inside ``backward()`` and ``synchronize()`` has nothing left to wait for.
A pass-through communication hook counts the buckets and their bytes. Where the configuration sums
differently (the fp16 wire; our ring or two-level ring on gloo), DDP's buckets are summed through
``sum_hook``: over the backend's allreduce it returns the collective's future, so the buckets still
overlap with backward; our point-to-point algorithms finish inside the hook, which the factory
refuses on NCCL (``knobs.check_overlap``). The hooks themselves, which any DDP program can register
(``sum_hook``, ``csc_hook``), live in ``comm/hooks.py``.

The fp16 wire over the backend's allreduce (``comm=ddp-fp16``, or ``comm=ddp comm.wire=fp16``: the
same knobs) is PyTorch's own ``fp16_compress_hook``, counted (``hooks.counting_fp16_compress_hook``),
as researchers would run DDP with fp16 compression. ``PowerSGDCommunicator`` (``comm=powersgd``)
is DDP with PyTorch's own ``powerSGD_hook``, after a dense warm-up.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from gradientflow_repro.comm.base import Communicator, GradScale, SumFn
from gradientflow_repro.comm.hooks import (
    PowerSGDHookState,
    SumHookState,
    counting_allreduce_hook,
    counting_fp16_compress_hook,
    counting_powersgd_hook,
    sum_hook,
)


class DDPCommunicator(Communicator):
    """DDP with a counting hook: DDP's own allreduce (``sum_fn`` None, ``wire`` fp32), PyTorch's own
    ``fp16_compress_hook`` (``sum_fn`` None, ``wire`` fp16), or ``sum_hook`` over ``sum_fn``."""

    def __init__(self, device: torch.device, bucket_mb: float = 25.0,
                 sum_fn: Optional[SumFn] = None, wire: str = "fp32") -> None:
        super().__init__(device)
        self.bucket_mb, self.sum_fn, self.wire = bucket_mb, sum_fn, wire

    def _wrap(self, model: nn.Module, **options: bool) -> DistributedDataParallel:
        return DistributedDataParallel(
            model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
            bucket_cap_mb=self.bucket_mb, **options)

    def attach(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> nn.Module:
        self.model, self.optimizer = model, optimizer
        if self.world_size == 1:
            return model
        wrapped = self._wrap(model)
        if self.sum_fn is None and self.wire == "fp16":  # PyTorch's own fp16 compression
            wrapped.register_comm_hook(self.stats, counting_fp16_compress_hook)
        elif self.sum_fn is None:
            wrapped.register_comm_hook(self.stats, counting_allreduce_hook)
        else:  # DDP's buckets, summed by one of our algorithms
            state = SumHookState(self.sum_fn)
            state.stats = self.stats
            wrapped.register_comm_hook(state, sum_hook)
        return wrapped

    def synchronize(self) -> None:
        pass  # DDP already reduced every bucket inside backward()


# With error feedback and warm start, torch's hook refuses to compress before iteration 2: DDP lays
# its buckets out anew after the first iteration, and the error and factors are kept per bucket.
FIRST_COMPRESSIBLE_ITERATION = 2
# DDP puts every parameter in one bucket for its first iteration and lays its buckets out by size
# after it, unless it looks for unused parameters: then its buckets are laid out by size from the
# start and never rebuilt. A resumed run's first iteration then has the buckets the saved error and
# factors belong to, and sums the same messages as the run that never stopped: bit-exact resumes.
STABLE_BUCKETS = True
# PowerSGD's state that is equal on every rank: counters, the generator (seeded alike), the factors
# (P and Q are allreduced before they are kept) and the buckets' layouts.
SAME_ON_EVERY_RANK = ("iteration", "start_iteration", "rank", "rng", "p", "q", "layouts")


class PowerSGDCommunicator(DDPCommunicator):
    """DDP with PyTorch's own PowerSGD hook (Vogels et al. 2019, ``torch.distributed.algorithms.
    ddp_comm_hooks.powerSGD_hook``), counted (``hooks.counting_powersgd_hook``).

    Algorithm (torch's, per DDP bucket; see ``hooks.powersgd_allreduce_sizes`` for what it sends):

    1. Dense warm-up: while the training progress is below ``warmup_epochs`` (``begin_step``), the
       hook's ``start_powerSGD_iter`` is kept one iteration ahead of its counter, so torch's hook
       allreduces each bucket whole, as DDP does; compression starts with the first step after
       the warm-up (never before iteration 2, where torch's hook first allows it).
    2. Then each matrix-shaped gradient M (n x m, plus this rank's error from the last step) is
       sent as two rank-r factors: P = M Q (Q warm-started from the last step), allreduced and
       orthogonalised; Q = M^T P, allreduced and averaged; M is replaced by P Q^T. Vectors (biases,
       BatchNorm) and matrices that would not shrink by ``min_compression_rate`` go whole.
    3. Error feedback: what compression lost on this rank (M - P Q^T) is added to its next gradient.

    Tuning (torch's advice): a higher ``rank`` approximates better and sends more, (n + m) r per
    matrix; the warm-up should be no shorter than the learning rate's (PowerSGD's start follows
    CSC's dense warm-up here, ``plan.Plan.warmup_epochs``).

    Checkpoints: ``state_dict`` holds torch's hook state as tensors, ints and lists (the iteration,
    the start, the numpy random generator's state, each bucket's error and factors, and which
    parameters each bucket held), so a run resumes bit-exactly under ``torch.load(weights_only=True)``.
    DDP is built with ``find_unused_parameters`` (``STABLE_BUCKETS``) so that its buckets never
    change, before or after a resume; the hook still refuses (RuntimeError) a bucket whose parameters
    differ from the saved bucket's rather than add one bucket's error to another's gradients.

    On another number of ranks (``rank_rules``): each new rank's error is the mean of the old ranks'
    (the mean over ranks of what error feedback holds back, which the next step's averaged sum
    delivers, is unchanged, as for CSC's residual); the rest is equal on every rank (the counters,
    the generator seeded alike, the factors P and Q, allreduced, and the buckets' layouts): old
    rank 0's."""

    name = "powersgd"
    rank_label = "PowerSGD"  # in the line a resume on another number of ranks prints

    steps_sent_whole = FIRST_COMPRESSIBLE_ITERATION

    def __init__(self, device: torch.device, bucket_mb: float = 25.0, rank: int = 4,
                 warmup_epochs: float = 0.0) -> None:
        super().__init__(device, bucket_mb)
        self.rank, self.warmup_epochs = rank, warmup_epochs
        self.hook_state: Optional[PowerSGDHookState] = None
        self._loaded: Optional[dict] = None  # a state loaded before ``attach``

    def attach(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> nn.Module:
        self.model, self.optimizer = model, optimizer
        if self.world_size == 1:
            return model  # nothing to compress
        wrapped = self._wrap(model, find_unused_parameters=STABLE_BUCKETS)
        torch_state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=self.rank, use_error_feedback=True, warm_start=True,
            start_powerSGD_iter=FIRST_COMPRESSIBLE_ITERATION)
        self.hook_state = PowerSGDHookState(torch_state, list(model.parameters()))
        self.hook_state.stats = self.stats
        wrapped.register_comm_hook(self.hook_state, counting_powersgd_hook)
        if self._loaded is not None:
            self.load_state_dict(self._loaded)
        return wrapped

    def begin_step(self, epoch: float, grad_scale: GradScale = None) -> None:
        """While ``epoch`` is within the dense warm-up, keep torch's start one iteration ahead."""
        if self.hook_state is not None and epoch < self.warmup_epochs:
            torch_state = self.hook_state.torch_state
            torch_state.start_powerSGD_iter = max(FIRST_COMPRESSIBLE_ITERATION, torch_state.iter + 1)

    @property
    def compressing(self) -> bool:
        """Whether the coming step compresses (torch's own test)."""
        state = None if self.hook_state is None else self.hook_state.torch_state
        return state is not None and state.iter >= state.start_powerSGD_iter

    def state_dict(self) -> dict:
        if self.hook_state is None:
            return {} if self._loaded is None else self._loaded
        torch_state = self.hook_state.torch_state
        _, keys, position, has_gauss, cached_gaussian = torch_state.rng.get_state()
        return {"iteration": torch_state.iter, "start_iteration": torch_state.start_powerSGD_iter,
                "rank": torch_state.matrix_approximation_rank,
                "rng": {"keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position),
                        "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
                "error": {i: t.detach().cpu().clone() for i, t in torch_state.error_dict.items()},
                "p": {i: t.detach().cpu().clone() for i, t in torch_state.p_memory_dict.items()},
                "q": {i: t.detach().cpu().clone() for i, t in torch_state.q_memory_dict.items()},
                "layouts": {i: list(layout) for i, layout in self.hook_state.layouts.items()}}

    def rank_rules(self) -> dict[str, str]:
        """On another number of ranks: the error is the mean over the old ranks, the rest old rank 0's."""
        return {"error": "mean", **{key: "same" for key in SAME_ON_EVERY_RANK}}

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        if self.hook_state is None:  # before attach (or one rank: nothing to restore)
            self._loaded = state
            return
        if state["rank"] != self.rank:
            raise ValueError(f"powersgd state was saved with comm.powersgd_rank {state['rank']}, not {self.rank}")
        torch_state = self.hook_state.torch_state
        torch_state.iter, torch_state.start_powerSGD_iter = int(state["iteration"]), int(state["start_iteration"])
        rng = state["rng"]
        torch_state.rng.set_state(("MT19937", rng["keys"].numpy().astype(np.uint32), int(rng["position"]),
                                   int(rng["has_gauss"]), float(rng["cached_gaussian"])))
        for name, target in (("error", torch_state.error_dict), ("p", torch_state.p_memory_dict),
                             ("q", torch_state.q_memory_dict)):
            target.clear()
            target.update({int(i): t.to(self.device) for i, t in state[name].items()})
        self.hook_state.layouts = {int(i): [int(p) for p in layout] for i, layout in state["layouts"].items()}
        self.hook_state.expected_layouts = dict(self.hook_state.layouts)
        self._loaded = None
