"""A scaling model: step time and speedup of data-parallel training for N GPUs, per strategy.

Inputs: when each gradient tensor becomes ready during backward (from a profile), its size, the
compute times, and the network: link bandwidth B (bytes/s per direction per rank), per-message
latency a, ranks per node and the intra-node bandwidth. A ring allreduce of S bytes over n ranks
costs 2(n-1) (a + S / (n B)): 2(n-1)/n of the data crosses every link, in 2(n-1) messages.

Strategies are the knobs of ``comm/knobs.py`` as the model sees them (``Strategy.from_knobs``; the
ladder of `make reproduce` is derived from ``knobs.LADDER``, not retyped):
- fusion ``per_tensor``: one allreduce per tensor; ``bucket``: tensors are packed in backward order
  into buckets of ``bucket_bytes`` (DDP, lazy allreduce) by the pool's own rule (``comm/pool.py``),
  one allreduce per bucket;
- ``overlap``: a message may start as soon as its data is ready (backward continues meanwhile);
  without it every message starts after backward. Messages go one at a time, in order;
- ``wire_bytes``: 4 for fp32, 2 for the fp16 wire (plus one tiny allreduce per message for the
  shared scale, and the local work of finding the peak, scaling, casting and casting back: a
  measured cost per element sent, on the communication path);
- ``density`` < 1 (CSC): multi-dimensional tensors send ceil(density x chunks) whole chunks of
  ``chunk_elements``, after an allreduce of the chunk norms (one fp32 value per chunk, by the
  backend's own allreduce, priced at its size) and after CSC's local work (norms, selection,
  packing: a measured cost per element, on the communication path); one-dimensional tensors go
  dense, in pool parts of their own after the others (as ``comm/csc.py`` lays out the pool);
- ``hierarchical``: reduce inside each node, ring among node leaders, broadcast inside the node;
- ``builtin``: the backend's own allreduce (``allreduce``, ``ddp``). On a cluster that is NCCL's
  ring, priced like ours. Where the network description carries the builtin's own measured cost by
  message size (as nccl-tests measures it), that table is used instead, interpolated linearly in
  bytes: the builtin is a black box (gloo picks its algorithm by size, and small calls pay the
  host's scheduling), so it is measured, not described by two numbers.

Step time = forward + max(end of backward, end of the last message) + optimizer. Speedup for N GPUs
is weak scaling (fixed per-GPU batch): N * step(1) / step(N).

The analytic model only: no torch, nothing measured here (the measurements that feed it, a model's
backward profile and the local work per element, are in ``gradientflow_repro/harness/profile.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

from gradientflow_repro.comm import knobs as comm_knobs
from gradientflow_repro.comm.pool import pack_parts


@dataclass(frozen=True)
class TensorProfile:
    elements: int
    ready_s: float  # seconds after backward starts when this gradient is complete
    one_dimensional: bool = False


@dataclass(frozen=True)
class ModelProfile:
    forward_s: float
    backward_s: float
    optimizer_s: float
    tensors: tuple[TensorProfile, ...]  # in the order backward produces them
    sparsify_s_per_element: float = 0.0  # CSC's local work (norms, selection, packing, residuals)
    wire_cast_s_per_element: float = 0.0  # the fp16 wire's local work per element it sends

    @property
    def elements(self) -> int:
        return sum(t.elements for t in self.tensors)

    def scaled(self, compute_factor: float) -> "ModelProfile":
        """The same model on a device ``compute_factor`` times slower."""
        return ModelProfile(self.forward_s * compute_factor, self.backward_s * compute_factor,
                            self.optimizer_s * compute_factor,
                            tuple(replace(t, ready_s=t.ready_s * compute_factor) for t in self.tensors),
                            self.sparsify_s_per_element * compute_factor,
                            self.wire_cast_s_per_element * compute_factor)


@dataclass(frozen=True)
class Network:
    bandwidth_Bps: float  # per rank and direction, between nodes
    latency_s: float  # per message
    ranks_per_node: int = 1
    intra_bandwidth_Bps: float = float("inf")
    intra_latency_s: float = 0.0
    tiny_allreduce_s: Optional[float] = None  # measured cost of a one-value allreduce, if known
    # the backend's allreduce, if measured: (payload bytes, seconds per call), by increasing size
    builtin_cost_by_size: Optional[tuple[tuple[float, float], ...]] = None


@dataclass(frozen=True)
class Strategy:
    name: str
    fusion: str = "per_tensor"  # per_tensor | bucket
    bucket_bytes: float = 25 * 2**20
    overlap: bool = False
    wire_bytes: int = 4
    density: float = 1.0
    chunk_elements: int = 32768
    hierarchical: bool = False
    builtin: bool = False

    @classmethod
    def from_knobs(cls, name: str, knobs: comm_knobs.CommConfig) -> "Strategy":
        """The model's view of a resolved ``comm`` configuration (``comm.knobs.resolve``), as
        ``comm/factory.py`` builds it: DDP and the lazy pool fuse into buckets (DDP of
        ``ddp_bucket_mb``, always overlapped; the pool of ``bucket_mb``, overlapped if ``overlap``)."""
        fusion = "bucket" if knobs.fusion in ("lazy", "ddp") else "per_tensor"
        bucket_mb = knobs.ddp_bucket_mb if knobs.fusion == "ddp" else knobs.bucket_mb
        return cls(name, fusion=fusion,
                   bucket_bytes=int(bucket_mb * 2**20) if fusion == "bucket" else cls.bucket_bytes,
                   overlap=knobs.fusion == "ddp" or (knobs.fusion == "lazy" and bool(knobs.overlap)),
                   wire_bytes=2 if knobs.wire == "fp16" else 4,
                   density=knobs.density if knobs.sparsity == "csc" else 1.0,
                   chunk_elements=knobs.chunk_size, hierarchical=knobs.algorithm == "hierarchical",
                   builtin=knobs.algorithm == "builtin")


# The ablation ladder of `make reproduce` (comm.knobs.LADDER), as the model sees it.
LADDER: tuple[Strategy, ...] = tuple(Strategy.from_knobs(label, comm_knobs.resolve(options))
                                     for label, options in comm_knobs.LADDER.items())


@dataclass(frozen=True)
class StepPrediction:
    compute_s: float  # forward + backward + optimizer
    comm_s: float  # time the network is busy
    exposed_comm_s: float  # communication not hidden behind backward
    step_s: float
    bytes_per_rank: float  # bytes each rank sends per step


def ring_allreduce_s(payload_bytes: float, ranks: int, bandwidth_Bps: float, latency_s: float) -> float:
    if ranks <= 1 or payload_bytes <= 0:
        return 0.0
    return 2 * (ranks - 1) * (latency_s + payload_bytes / (ranks * bandwidth_Bps))


def measured_cost_s(payload_bytes: float, cost_by_size: tuple[tuple[float, float], ...]) -> float:
    """Seconds for ``payload_bytes`` from a table of measured (bytes, seconds): linear between the
    two sizes around it, the smallest size's cost below it, proportional to bytes beyond the largest."""
    sizes = sorted(cost_by_size)
    if payload_bytes <= sizes[0][0]:
        return sizes[0][1]
    for (small, small_s), (large, large_s) in zip(sizes, sizes[1:]):
        if payload_bytes <= large:
            return small_s + (large_s - small_s) * (payload_bytes - small) / (large - small)
    largest, largest_s = sizes[-1]
    return largest_s * payload_bytes / largest


def allreduce_s(payload_bytes: float, ranks: int, net: Network, hierarchical: bool,
                builtin: bool = False) -> float:
    """One allreduce of ``payload_bytes`` among ``ranks`` ranks placed ``net.ranks_per_node`` per node."""
    if builtin and net.builtin_cost_by_size and ranks > 1:
        return measured_cost_s(payload_bytes, net.builtin_cost_by_size)
    per_node = min(net.ranks_per_node, ranks)
    nodes = max(1, ranks // per_node)
    if hierarchical and per_node > 1:
        # reduce to the leader and broadcast back: each a pipeline over the node's ranks
        inside = 2 * ((per_node - 1) * net.intra_latency_s + payload_bytes / net.intra_bandwidth_Bps)
        return inside + ring_allreduce_s(payload_bytes, nodes, net.bandwidth_Bps, net.latency_s)
    if nodes == 1:  # all ranks in one node: the ring runs over the intra-node links
        return ring_allreduce_s(payload_bytes, ranks, net.intra_bandwidth_Bps, net.intra_latency_s)
    return ring_allreduce_s(payload_bytes, ranks, net.bandwidth_Bps, net.latency_s)


@dataclass(frozen=True)
class Message:
    """One summed part of the gradients, as the communicator sends it."""
    ready_s: float  # when its last gradient is complete, after the start of backward
    payload_bytes: float  # what the summing algorithm carries
    scalar_allreduces: int  # one-value allreduces before it (the fp16 wire's shared scale)
    local_work_s: float  # CSC's and the fp16 wire's own work on the communication path
    norm_bytes: float = 0.0  # CSC's chunk norms: summed first, by the backend's own allreduce


def pool_parts(profile: ModelProfile, strategy: Strategy) -> list[tuple[list[TensorProfile], int]]:
    """The parts one step sends, in sending order, each with its length in elements after padding:
    one per tensor, or the pool's parts (``comm/pool.py``). With CSC the pool holds the
    multi-dimensional gradients first, padded to whole chunks, and the one-dimensional ones (always
    dense) in parts of their own after them, as ``comm/csc.py`` lays it out."""
    tensors = list(profile.tensors)
    if strategy.fusion == "per_tensor":
        return [([t], t.elements) for t in tensors]
    if strategy.density < 1:
        groups = [([t for t in tensors if not t.one_dimensional], strategy.chunk_elements),
                  ([t for t in tensors if t.one_dimensional], 1)]
    else:
        groups = [(tensors, 1)]
    return [([group[i] for i in part.indices], part.elements)
            for group, multiple in groups
            for part in pack_parts([t.elements for t in group], strategy.bucket_bytes, multiple)]


def _message(tensors: list[TensorProfile], padded: int, profile: ModelProfile, strategy: Strategy) -> Message:
    cast = profile.wire_cast_s_per_element if strategy.wire_bytes < 4 else 0.0
    sparse_elements = sum(t.elements for t in tensors if strategy.density < 1 and not t.one_dimensional)
    dense_elements = sum(t.elements for t in tensors) - sparse_elements
    # as csc.py: a part padded to whole chunks (pool_parts), of which ceil(density x chunks) are sent
    chunks = -(-padded // strategy.chunk_elements) if sparse_elements else 0
    sent_elements = dense_elements + math.ceil(strategy.density * chunks) * strategy.chunk_elements
    return Message(ready_s=max(t.ready_s for t in tensors),
                   payload_bytes=sent_elements * strategy.wire_bytes,
                   scalar_allreduces=1 if strategy.wire_bytes < 4 else 0,
                   local_work_s=sparse_elements * profile.sparsify_s_per_element + sent_elements * cast,
                   norm_bytes=4.0 * chunks)


def messages(profile: ModelProfile, strategy: Strategy) -> list[Message]:
    """The messages of one step, in sending order (``pool_parts``)."""
    return [_message(tensors, padded, profile, strategy) for tensors, padded in pool_parts(profile, strategy)]


def predict_step(profile: ModelProfile, ranks: int, net: Network, strategy: Strategy) -> StepPrediction:
    compute = profile.forward_s + profile.backward_s + profile.optimizer_s
    if ranks == 1:
        return StepPrediction(compute, 0.0, 0.0, compute, 0.0)
    clock = 0.0 if strategy.overlap else profile.backward_s  # relative to the start of backward
    busy = sent = 0.0
    tiny = net.tiny_allreduce_s if net.tiny_allreduce_s is not None else allreduce_s(
        4.0, ranks, net, strategy.hierarchical)
    for message in messages(profile, strategy):
        cost = (message.local_work_s + message.scalar_allreduces * tiny
                + allreduce_s(message.payload_bytes, ranks, net, strategy.hierarchical, strategy.builtin))
        if message.norm_bytes:  # CSC's norms travel in the backend's own allreduce (comm/csc.py)
            cost += allreduce_s(message.norm_bytes, ranks, net, strategy.hierarchical, builtin=True)
        clock = max(clock, message.ready_s if strategy.overlap else profile.backward_s) + cost
        busy += cost
        sent += 2 * (ranks - 1) / ranks * (message.payload_bytes + message.norm_bytes)
    exposed = max(0.0, clock - profile.backward_s)
    return StepPrediction(compute, busy, exposed, compute + exposed, sent)


def speedup(profile: ModelProfile, ranks: int, net: Network, strategy: Strategy) -> float:
    """Weak scaling: images per second on ``ranks`` GPUs over images per second on one."""
    single = predict_step(profile, 1, net, strategy).step_s
    return ranks * single / predict_step(profile, ranks, net, strategy).step_s


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


# ---------------------------------------------------------------- the paper's setting
# Each value with its source; "derived" values follow from the paper's own abstract.
IMAGENET_TRAIN = 1_281_167  # ILSVRC-2012 training images
PAPER_GPUS, PAPER_SPEEDUP, PAPER_MINUTES, PAPER_EPOCHS = 512, 410.2, 1.5, 95  # abstract
PAPER_BASELINE_GPUS, PAPER_BASELINE_SPEEDUP = 64, 2.5  # abstract: "popular open-source systems"
PAPER_LINK_GBPS = 56  # abstract
PAPER_PER_GPU_BATCH = 128  # ours: 65,536 / 512 (Jia et al. 2018 trained AlexNet at 64K)
# derived: 95 epochs in 90 s on 512 GPUs is 1.35M images/s; with speedup 410.2 one GPU runs at
# 1.35M / 410.2 = 3,300 images/s (the paper's own single-GPU throughput, whatever its GPU)
PAPER_SINGLE_GPU_IMAGES_S = IMAGENET_TRAIN * PAPER_EPOCHS / (PAPER_MINUTES * 60) / PAPER_SPEEDUP
ASSUMED_GPUS_PER_NODE = 8  # assumption: the common 8-GPU server (the paper's is not known to us)
ASSUMED_LATENCY_S = 10e-6  # assumption: per message of a ring step over InfiniBand with NCCL/MPI
ASSUMED_INTRA_NODE_BPS = 10e9  # assumption: PCIe 3.0 x16 between GPUs of a node (no NVLink)
ASSUMED_BACKWARD_SHARE = 2 / 3  # assumption: backward takes twice the forward's time
# torchvision AlexNet parameter tensors (weights and biases), in forward order
ALEXNET_LAYERS: tuple[tuple[int, bool], ...] = (
    (64 * 3 * 11 * 11, False), (64, True), (192 * 64 * 5 * 5, False), (192, True),
    (384 * 192 * 3 * 3, False), (384, True), (256 * 384 * 3 * 3, False), (256, True),
    (256 * 256 * 3 * 3, False), (256, True), (4096 * 9216, False), (4096, True),
    (4096 * 4096, False), (4096, True), (1000 * 4096, False), (1000, True))


def paper_profile() -> ModelProfile:
    step = PAPER_PER_GPU_BATCH / PAPER_SINGLE_GPU_IMAGES_S
    elements = [e for e, _ in ALEXNET_LAYERS]
    flags = [flat for _, flat in ALEXNET_LAYERS]
    return uniform_profile(elements, step * (1 - ASSUMED_BACKWARD_SHARE), step * ASSUMED_BACKWARD_SHARE,
                           0.0, flags)


def paper_network() -> Network:
    return Network(PAPER_LINK_GBPS * 1e9 / 8, ASSUMED_LATENCY_S, ASSUMED_GPUS_PER_NODE,
                   ASSUMED_INTRA_NODE_BPS, ASSUMED_LATENCY_S)


def paper_dense_ratio() -> tuple[float, str]:
    """Dense fp32 ring traffic time over compute time per step on the paper's cluster, with the
    arithmetic spelled out (what `make reproduce` matches with its link rate)."""
    profile, net = paper_profile(), paper_network()
    compute = profile.forward_s + profile.backward_s
    payload = profile.elements * 4
    comm = 2 * (PAPER_GPUS - 1) / PAPER_GPUS * payload / net.bandwidth_Bps
    text = (f"single-GPU throughput {PAPER_SINGLE_GPU_IMAGES_S:,.0f} images/s = {IMAGENET_TRAIN:,} x "
            f"{PAPER_EPOCHS} images / {PAPER_MINUTES * 60:.0f} s / {PAPER_SPEEDUP} (the paper's own figures), "
            f"so a {PAPER_PER_GPU_BATCH}-image step computes in {compute * 1e3:.1f} ms; AlexNet's "
            f"{profile.elements / 1e6:.1f}M fp32 gradients ({payload / 1e6:.0f} MB) cross each link "
            f"2(N-1)/N times per ring allreduce: at {PAPER_LINK_GBPS} Gbit/s ({net.bandwidth_Bps / 1e9:.1f} GB/s) "
            f"and N = {PAPER_GPUS} that is {comm * 1e3:.1f} ms; ratio {comm / compute:.2f}")
    return comm / compute, text
