"""What one rank computes, as the scaling model sees it: a model's step (forward, backward, the
optimizer) and when each gradient tensor becomes ready during backward, with the local work per
element that compression adds. Measured by ``scaling/profile.py`` or spread by size
(``uniform_profile``); priced by ``scaling/perfmodel.py``."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional


@dataclass(frozen=True)
class TensorProfile:
    elements: int
    ready_s: float  # seconds after backward starts when this gradient is complete
    one_dimensional: bool = False
    # the tensor's first dimension (PowerSGD views a gradient as shape[0] x the rest); None: not
    # recorded (an older profile), then the elements of a one-dimensional tensor, else the square's side
    rows: Optional[int] = None

    @property
    def matrix(self) -> tuple[int, int]:
        """The gradient as PowerSGD views it (``tensor.view(tensor.shape[0], -1)``): (n, m)."""
        rows = self.rows or (self.elements if self.one_dimensional else max(1, math.isqrt(self.elements)))
        return rows, max(1, self.elements // rows)


@dataclass(frozen=True)
class ModelProfile:
    forward_s: float
    backward_s: float
    optimizer_s: float
    tensors: tuple[TensorProfile, ...]  # in the order backward produces them
    sparsify_s_per_element: float = 0.0  # CSC's local work (norms, selection, packing, residuals)
    wire_cast_s_per_element: float = 0.0  # the fp16 wire's local work per element it sends
    # the optimizer's step while CSC's momentum correction has taken over its momentum, weight decay
    # and adaptation (``CSCCommunicator.TAKEN``: plain SGD; their work is in CSC's local work); None:
    # not measured, the whole ``optimizer_s``
    plain_optimizer_s: Optional[float] = None
    # PowerSGD's local work (error feedback, the two matrix products and the orthogonalisation that
    # compress, the one that decompresses) per element of the matrices it compresses, at the rank it
    # is measured for (``profile.low_rank_work``)
    low_rank_s_per_element: float = 0.0
    # per-step overhead of a distributed framework beyond the single-GPU step (negotiating which
    # tensors are ready, launching the collectives from the host, waiting for the slowest rank):
    # added to the step for more than one rank only, since the single-GPU step is the measured one
    # and already holds its own overhead. Fitted per framework (``scaling/calibration.py``: per GPU
    # driven where one process drives a node's GPUs, ``calibration.step_overhead_s``); 0: none
    step_overhead_s: float = 0.0

    @property
    def elements(self) -> int:
        return sum(t.elements for t in self.tensors)

    def scaled(self, compute_factor: float, parameter_factor: Optional[float] = None) -> "ModelProfile":
        """The same model on a device ``compute_factor`` times slower at its forward and backward,
        and ``parameter_factor`` (unless given, the same) times slower at the work per parameter or
        gradient element: the optimizer's step, CSC's and the fp16 wire's local work. They differ
        where the per-rank batch differs from the profile's: more images make the first longer,
        not the second."""
        per_element = compute_factor if parameter_factor is None else parameter_factor
        return ModelProfile(self.forward_s * compute_factor, self.backward_s * compute_factor,
                            self.optimizer_s * per_element,
                            tuple(replace(t, ready_s=t.ready_s * compute_factor) for t in self.tensors),
                            self.sparsify_s_per_element * per_element,
                            self.wire_cast_s_per_element * per_element,
                            None if self.plain_optimizer_s is None else self.plain_optimizer_s * per_element,
                            self.low_rank_s_per_element * per_element,
                            self.step_overhead_s)  # the host's, not the device's: not scaled



def uniform_profile(layer_elements: list[int], forward_s: float, backward_s: float,
                    optimizer_s: float = 0.0, one_dimensional: list[bool] | None = None) -> ModelProfile:
    """Backward spread over the layers in proportion to their size (last layer's gradient first):
    a stand-in when no measured profile is at hand."""
    total = sum(layer_elements)
    flags = one_dimensional or [False] * len(layer_elements)
    tensors, done = [], 0
    for elements, flat in zip(reversed(layer_elements), reversed(flags)):
        done += elements
        tensors.append(TensorProfile(elements, backward_s * done / total, flat))
    return ModelProfile(forward_s, backward_s, optimizer_s, tuple(tensors))

