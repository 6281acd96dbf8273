"""A scaling model: step time and speedup of data-parallel training for N GPUs, per strategy.

Inputs: when each gradient tensor becomes ready during backward (from a profile), its size, the
compute times, and the network: link bandwidth B (bytes/s per direction per node uplink), per-
message latency a, ranks per node and the intra-node bandwidth. Collectives, as the communicators
send them:
- large messages (more than ``small_message_bytes``): a ring allreduce of S bytes over n ranks
  costs 2(n-1) (a + S / (n B)): 2(n-1)/n of the data crosses every link, in 2(n-1) messages.
  Ranks are placed node by node (as torchrun and Slurm number them), so a flat ring crosses each
  node's uplink once in each direction: one flow, the full B;
- small messages (our recursive doubling; NCCL's trees): log2(p) exchange steps of the whole
  message (plus two to fold in the ranks beyond the largest power of two p <= n). A step's pairs
  at a distance of at least the node size cross the network, and then all ranks of a node send
  through its one uplink at once: that step costs a + (crossing ranks of the busiest node) x S / B.
  Nodes may be partly filled (world sizes that are not a multiple of the node size);
- two-level (``hierarchical``, and ``auto`` on more than one node of more than one rank): reduce
  inside each node, ring among the node leaders, broadcast inside the node.

Strategies are the knobs of ``comm/knobs.py`` as the model sees them (``Strategy.from_knobs``; a
label of the registry, ``comm/registry.py``, by ``strategy_of(label)``; the ladder of `make reproduce`
is the registry's, not retyped), the sparsifier priced by its registered rule:
- fusion ``per_tensor``: one allreduce per tensor; ``bucket``: tensors are packed in backward order
  into buckets of ``bucket_bytes`` (DDP, lazy allreduce) by the pool's own rule (``comm/pool.py``),
  one allreduce per bucket;
- ``overlap``: a message may start as soon as its data is ready (backward continues meanwhile);
  without it every message starts after backward. Messages go one at a time, in order;
- ``wire_bytes``: 4 for fp32, 2 for the fp16 wire (plus one small allreduce per message for the
  shared scale, except for a small message of our own recursive doubling, which carries its own
  scale: ``self_scaled``; and the local work of finding the peak, scaling, casting, reducing in fp32 and
  rounding once (as the ring adds fp16 segments), casting back: a cost per element sent, on the
  communication path);
- ``density`` < 1 (CSC): each pool part (``pool.csc_parts``) sends ceil(density x chunks) whole
  chunks of ``chunk_elements`` of its multi-dimensional tensors plus its one-dimensional tensors
  whole, in one payload, after one small allreduce of the chunk norms (one fp32 value per chunk,
  plus one for the fp16 wire's scale), and after CSC's local work (a cost per element);
- ``low_rank`` (PowerSGD, PyTorch's ``powerSGD_hook``): per DDP bucket three allreduces in turn, the
  tensors it sends whole, then P (n x r per compressed n x m matrix), then Q (m x r), after its
  local work (a cost per compressed element, ``ModelProfile.low_rank_s_per_element``;
  ``low_rank_split``); dense, as DDP, during its warm-up (``time_to_train``'s dense epochs);
- PyTorch's ``fp16_compress_hook`` (``comm=ddp-fp16``: DDP's fp16 wire with ``comm.algorithm=builtin``,
  as the factory builds it): DDP's buckets at 2 bytes an element, no scale to agree on; DDP's fp16
  wire under any other algorithm keeps our shared scale, whoever carries it (NCCL's allreduce too);
- who sums: ``knobs.summing``, the one definition the factory builds (``comm.implementation``): the
  backend's own allreduce for ``builtin`` (``allreduce``, ``ddp``) and, on an NCCL network
  (``Network.nccl``, a GPU cluster) by default for every algorithm; our algorithms above by default
  on gloo, or where ``comm.implementation=ours`` asks for them (a ``Strategy`` built by hand names
  ours). NCCL's allreduce is priced as NCCL's own tuning model prices it (``nccl_allreduce_s``: one
  kernel per message, so no per-step launch from the host; its ring's steps inside a node at the
  intra-node latency, only the 2(M-1) steps between M nodes at the network's; its tree's depth
  log2(M); between nodes the node's whole uplink, all its NICs), the faster of ring and tree, as
  NCCL's tuner picks (no configuration sets NCCL_ALGO: ``knobs.Summing``). Our rings cross between
  nodes from one GPU, so through one NIC of ``Network.rails``. Gloo's own allreduce is a ring. Where the network
  description carries the backend's measured cost by message size (as nccl-tests measures it),
  that table is used instead, interpolated linearly in bytes: the builtin is a black box (gloo
  picks its algorithm by size, and small calls pay the host's scheduling), so it is measured, not
  described by two numbers.

Step time = forward + max(end of backward, end of the last message) + optimizer. Speedup for N GPUs
is weak scaling (fixed per-GPU batch): N * step(1) / step(N).

Three costs that real systems pay and the rules above do not, each 0 (or 1) by default so that the
measured runs are checked without them, and fitted on published results (``scaling/calibration.py``,
``scripts/model_check.py``): ``Network.link_efficiency`` (the payload rate between nodes over the
nominal), ``Network.overlap_slowdown`` (backward stretched by the communication it overlaps) and
``ModelProfile.step_overhead_s`` (a framework's per-step overhead on more than one GPU). A fourth,
``Network.local_work_slowdown`` (how much of the local work backward hides), is not fitted: no
published row has local work, so it follows ``overlap_slowdown`` unless set, and the paper's band
spans it. A whole run's time (dense warm-up epochs, evaluation, start-up) from the step:
``time_to_train``.

An emulated link (``cluster/netemu.py``: Linux's token-bucket shaper) also lets a burst through at
once after it has been idle: ``Network.burst_bytes`` of credit, refilled at the link's rate while
nothing crosses it (during local work, between steps) and spent by the next large message, whose
time shrinks by the credit it uses over B. At 100 Mbit/s a 256 KiB bucket is worth 21 ms, as much
as a sparse strategy's whole payload takes; a real link has none (0, the default).

The analytic model only: no torch, nothing measured here (the measurements that feed it, a model's
backward profile and the local work per element, are in ``gradientflow_repro/scaling/profile.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Optional

from gradientflow_repro.comm import knobs as comm_knobs
from gradientflow_repro.comm import registry
from gradientflow_repro.comm.pool import csc_parts, pack_parts


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


@dataclass(frozen=True)
class Network:
    bandwidth_Bps: float  # per node uplink and direction, between nodes
    latency_s: float  # per message
    ranks_per_node: int = 1
    intra_bandwidth_Bps: float = float("inf")
    intra_latency_s: float = 0.0
    tiny_allreduce_s: Optional[float] = None  # measured cost of the one-value allreduce (fp16 scale), if known
    # the backend's allreduce, if measured: (payload bytes, seconds per call), by increasing size
    builtin_cost_by_size: Optional[tuple[tuple[float, float], ...]] = None
    # NCCL: small messages go to NCCL's own allreduce (``recursive_doubling.small_sum``), whose tuner
    # takes the faster of its tree and its ring for each size, unless comm.implementation=ours asks
    # for our recursive doubling; gloo: our recursive doubling always
    nccl: bool = False
    # NCCL_ALGO in the job's environment ("Ring": NCCL's ring alone, as the systems of 2017 ran it);
    # None: NCCL's tuner picks ring or tree. A property of the cluster's job, never of a strategy
    nccl_algo: Optional[str] = None
    burst_bytes: float = 0.0  # payload an idle link passes at once (an emulated link's token bucket)
    # NICs per node that ``bandwidth_Bps`` adds up (a rail-optimised GPU node: one per GPU). NCCL's
    # allreduce spreads its channels over all of them; our rings cross between nodes from one GPU,
    # through one NIC: ``bandwidth_Bps / rails``
    rails: int = 1
    # payload rate over nominal of the links between nodes: what a ring's bus bandwidth reaches of
    # ``bandwidth_Bps`` (NCCL's maintainers: ~96-98% of line rate on InfiniBand with GPUDirect RDMA,
    # nccl-tests#29, nccl#307, nccl-tests#119, nccl#812; less through the host or over TCP). Fitted per
    # fabric (``scaling/calibration.py``); 1: the nominal rate
    link_efficiency: float = 1.0
    # communication slowing the computation it overlaps: NCCL's kernels take SMs and memory bandwidth
    # from backward, which is stretched by ``overlap_slowdown`` x (communication time that overlaps
    # it). Fitted (``scaling/calibration.py``); 0: overlap is free
    overlap_slowdown: float = 0.0
    # the local work (CSC's selection, the fp16 wire's casts, PowerSGD's products) runs on the device
    # that runs backward: backward is stretched by this x the local work it overlaps. None: as
    # ``overlap_slowdown``. On a GPU it runs beside backward on a side stream (``comm/lazy.py``) and
    # takes SMs and memory bandwidth for all its time, so somewhere between that and 1: no published
    # row has local work to fit it on, and no GPU profile here says where
    local_work_slowdown: Optional[float] = None


def effective_network(net: Network) -> Network:
    """``net`` with ``link_efficiency`` applied to the rate between nodes (and then 1): what every
    price between nodes uses. The same object when the efficiency is 1, so defaults change nothing."""
    if net.link_efficiency == 1.0:
        return net
    return replace(net, bandwidth_Bps=net.bandwidth_Bps * net.link_efficiency, link_efficiency=1.0)


# The pricing rules of ``registry.PRICING_RULES`` that ``Strategy.from_knobs`` knows
PRICED_RULES = ("dense", "chunks", "csc", "low_rank")


@dataclass(frozen=True)
class Strategy:
    name: str
    fusion: str = "per_tensor"  # per_tensor | bucket
    bucket_bytes: float = 25 * 2**20
    overlap: bool = False
    wire_bytes: int = 4
    density: float = 1.0
    chunk_elements: int = 32768
    algorithm: str = "ring"  # builtin | ring | hierarchical | auto, as ``comm.algorithm``
    # as ``comm.implementation`` (``knobs.summing``); by hand: our algorithms (``from_knobs``: the
    # configuration's, auto by default: NCCL's allreduce on an NCCL network). Not compared: a rung is
    # the same strategy (the same messages) whoever carries them; the pricing asks ``summing``
    implementation: str = field(default="ours", compare=False)
    small_message_bytes: float = comm_knobs.SMALL_MESSAGE_BYTES  # recursive doubling up to here
    # CSC's trust-ratio noise sketches ride with the chunk norms (momentum correction under LARS)
    noise_sketch: bool = False
    # CSC's momentum correction does the optimizer's momentum, weight decay and adaptation
    takes_optimizer: bool = False
    # PowerSGD (``low_rank`` pricing): its matrix approximation rank (``comm.powersgd_rank``); 0: not low-rank
    low_rank: int = 0
    # PowerSGD compresses a matrix only where it shrinks by more than this (PowerSGDState's default, 2)
    min_compression_rate: float = 2.0
    # the fp16 wire agrees on one power-of-two scale per message (a small allreduce, ours); PyTorch's
    # fp16_compress_hook divides by the world size before the cast and agrees on none
    shared_scale: bool = True

    @classmethod
    def from_knobs(cls, name: str, knobs: comm_knobs.CommConfig, lars: bool = True) -> "Strategy":
        """The model's view of a resolved ``comm`` configuration (``comm.knobs.resolve``), as
        ``comm/factory.py`` builds it: DDP and the lazy pool fuse into buckets (DDP of
        ``ddp_bucket_mb``, always overlapped; the pool of ``bucket_mb``, overlapped if ``overlap``).
        ``lars``: the optimizer is LARS (the paper's), so CSC under momentum correction sends the
        noise sketches of its trust ratios (``comm/csc/``, ``TrustNoise``).

        What the sparsifier sends is priced by its rule in the registry (``registry.PRICING_RULES``:
        ``dense``, ``chunks``, ``csc``, ``low_rank``); a rule not known here raises ValueError, so a
        new sparsifier is never priced as dense by mistake. DDP's fp16 wire with ``comm.algorithm=builtin``
        is PyTorch's ``fp16_compress_hook`` (no shared scale), as the factory builds it; under any
        other algorithm it keeps our shared scale, on NCCL's allreduce too."""
        rule = registry.sparsifier(knobs.sparsity).pricing
        if rule not in PRICED_RULES:
            raise ValueError(f"strategy {name!r}: sparsifier {knobs.sparsity!r} has pricing rule {rule!r}, which "
                             f"the model does not know (it prices {', '.join(registry.PRICING_RULES)})")
        corrected = rule == "csc" and knobs.momentum_correction  # CSC's momentum correction
        fusion = "bucket" if knobs.fusion in ("lazy", "ddp") else "per_tensor"
        bucket_mb = knobs.ddp_bucket_mb if knobs.fusion == "ddp" else knobs.bucket_mb
        return cls(name, fusion=fusion,
                   bucket_bytes=int(bucket_mb * 2**20) if fusion == "bucket" else cls.bucket_bytes,
                   overlap=knobs.fusion == "ddp" or (knobs.fusion == "lazy" and bool(knobs.overlap)),
                   wire_bytes=2 if knobs.wire == "fp16" else 4,
                   density=knobs.density if rule in ("chunks", "csc") else 1.0,
                   chunk_elements=knobs.chunk_size, algorithm=knobs.algorithm,
                   implementation=knobs.implementation,
                   small_message_bytes=comm_knobs.small_message_bytes(knobs),
                   noise_sketch=lars and corrected and knobs.trust_noise_correction,
                   takes_optimizer=corrected, low_rank=knobs.powersgd_rank if rule == "low_rank" else 0,
                   shared_scale=not (knobs.wire == "fp16" and knobs.fusion == "ddp" and knobs.algorithm == "builtin"))

    @property
    def builtin(self) -> bool:
        return self.algorithm == "builtin"

    def summing(self, ranks: int, net: "Network") -> comm_knobs.Summing:
        """What sums this strategy's messages over ``ranks`` ranks on ``net`` (``knobs.summing``)."""
        return comm_knobs.summing(self.algorithm, ranks, net.ranks_per_node, "nccl" if net.nccl else "gloo",
                                  self.implementation)

    def ours(self, ranks: int, net: "Network") -> bool:
        """Whether our algorithms carry the messages (then small ones by recursive doubling)."""
        return ranks > 1 and self.summing(ranks, net).ours


def strategy_of(label: str, lars: bool = True) -> Strategy:
    """The model's view of a registered label (``registry.options``: a label, an old one, or a
    strategy's name), as ``from_knobs`` prices it."""
    return Strategy.from_knobs(registry.canonical(label), comm_knobs.resolve(registry.options(label)), lars=lars)


def __getattr__(name: str) -> tuple[Strategy, ...]:
    """``LADDER``: the ablation ladder of `make reproduce` (the registry's, ``knobs.LADDER``) as the
    model sees it, read from the registry when asked for."""
    if name == "LADDER":
        return tuple(strategy_of(label) for label in registry.labels(registry.LADDER))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


def recursive_doubling_pairs(ranks: int) -> list[list[tuple[int, int]]]:
    """The exchange steps of recursive doubling over ``ranks`` ranks, as ``comm/recursive_doubling.py``
    runs them: with p the largest power of two <= n and r = n - p, ranks 2i and 2i+1 (i < r) first
    fold (the even hands its data to the odd), the p remaining ranks exchange with the rank whose
    index differs in bit k at step k, and the folded ranks get the result back."""
    p = 1 << (ranks.bit_length() - 1)
    extra = ranks - p
    fold = [(2 * i, 2 * i + 1) for i in range(extra)]
    members = [2 * i + 1 for i in range(extra)] + list(range(2 * extra, ranks))
    steps = [fold] if fold else []
    distance = 1
    while distance < p:
        steps.append([(members[i], members[i ^ distance]) for i in range(p) if i < i ^ distance])
        distance *= 2
    return steps + ([fold] if fold else [])


@lru_cache(maxsize=4096)
def small_allreduce_s(payload_bytes: float, ranks: int, net: Network) -> float:
    """Recursive doubling of ``payload_bytes`` over ``ranks`` ranks placed ``net.ranks_per_node``
    per node (the last node may be partly filled): a step whose pairs stay inside every node costs
    an intra-node message; one that crosses costs a + (ranks of the busiest node whose partner is
    elsewhere) x S / B, since a node's ranks share its uplink."""
    if ranks <= 1 or payload_bytes <= 0:
        return 0.0
    total = 0.0
    for crossing in _uplink_sharers(ranks, net.ranks_per_node):
        if crossing:
            total += net.latency_s + crossing * payload_bytes / net.bandwidth_Bps
        else:
            total += net.intra_latency_s + payload_bytes / net.intra_bandwidth_Bps
    return total


@lru_cache(maxsize=1024)
def _uplink_sharers(ranks: int, ranks_per_node: int) -> tuple[int, ...]:
    """For each step of recursive doubling: how many ranks of the busiest node send across its
    uplink at once (0: every pair stays inside its node)."""
    per_node, sharers = max(1, ranks_per_node), []
    for pairs in recursive_doubling_pairs(ranks):
        crossing: dict[int, int] = {}
        for a, b in pairs:
            if a // per_node != b // per_node:
                crossing[a // per_node] = crossing.get(a // per_node, 0) + 1
                crossing[b // per_node] = crossing.get(b // per_node, 0) + 1
        sharers.append(max(crossing.values(), default=0))
    return tuple(sharers)


def allreduce_s(payload_bytes: float, ranks: int, net: Network, algorithm: str = "ring",
                small_message_bytes: float = comm_knobs.SMALL_MESSAGE_BYTES, implementation: str = "ours") -> float:
    """One allreduce of ``payload_bytes`` among ``ranks`` ranks placed ``net.ranks_per_node`` per
    node (node by node; the last node may be partly filled) by ``algorithm`` (``comm.algorithm``)
    under ``implementation`` (``comm.implementation``, ``knobs.summing``): the backend's allreduce
    (measured, NCCL's tuning model, or gloo's ring), or ours, by recursive doubling up to
    ``small_message_bytes`` (on NCCL too, where ``comm.implementation=ours`` asks for ours)."""
    if ranks <= 1 or payload_bytes <= 0:
        return 0.0
    chosen = comm_knobs.summing(algorithm, ranks, net.ranks_per_node, "nccl" if net.nccl else "gloo",
                                implementation)
    if chosen.how == "backend":
        if net.builtin_cost_by_size:
            return measured_cost_s(payload_bytes, net.builtin_cost_by_size)
        if net.nccl:
            return nccl_allreduce_s(payload_bytes, ranks, net, net.nccl_algo)
        return _ring_s(payload_bytes, ranks, net, "builtin")  # gloo's own: a ring, unless measured
    if payload_bytes <= small_message_bytes:
        return small_allreduce_s(payload_bytes, ranks, net)
    return _ring_s(payload_bytes, ranks, net, algorithm)


def nccl_allreduce_s(payload_bytes: float, ranks: int, net: Network, nccl_algo: Optional[str] = None) -> float:
    """NCCL's own allreduce of ``payload_bytes`` over ``ranks`` ranks placed node by node, as NCCL's
    tuning model prices it (``src/graph/tuning.cc``), with this network's figures:
    - ring: 2(N-1) steps, of which the 2(M-1) that cross between M nodes cost the network's latency
      and the others the intra-node latency; 2(N-1)/N of the payload over the slowest link;
    - tree (a chain inside each node, a double binary tree between nodes): 2((G-1) intra-node
      latencies + floor(log2 M) network latencies) for G ranks per node, and the payload twice (up
      the tree and down again) over the link.
    Between nodes both run over the node's whole uplink, ``bandwidth_Bps``: NCCL lays a channel
    over every NIC (``rails``). One kernel per message: no per-step launch from the host.
    ``nccl_algo`` "Ring" (NCCL_ALGO=Ring in the job's environment, ``Network.nccl_algo``: the published
    systems of 2017, before NCCL's trees): the ring alone; None: the faster of the two, as NCCL's
    tuner picks."""
    if ranks <= 1 or payload_bytes <= 0:
        return 0.0
    per_node = min(max(1, net.ranks_per_node), ranks)
    nodes = -(-ranks // per_node)
    link = net.bandwidth_Bps if nodes > 1 else net.intra_bandwidth_Bps
    steps, crossing = 2 * (ranks - 1), 2 * (nodes - 1)
    ring = (steps - crossing) * net.intra_latency_s + crossing * net.latency_s + steps / ranks * payload_bytes / link
    if nccl_algo == "Ring":
        return ring
    depth = nodes.bit_length() - 1  # floor(log2 M)
    tree = 2 * ((per_node - 1) * net.intra_latency_s + depth * net.latency_s) + 2 * payload_bytes / link
    return min(ring, tree)


def switch_over_bytes(ranks: int, net: Network, algorithm: str = "ring") -> int:
    """The largest power of two of bytes up to which recursive doubling beats the ring (or the
    two-level ring) on ``net``: where ``comm.small_message_kb`` belongs for that network."""
    if small_allreduce_s(4, ranks, net) >= _ring_s(4, ranks, net, algorithm):
        return 0
    size = 4
    while size < 1 << 30 and small_allreduce_s(2 * size, ranks, net) < _ring_s(2 * size, ranks, net, algorithm):
        size *= 2
    return size


def _ring_s(payload_bytes: float, ranks: int, net: Network, algorithm: str) -> float:
    """A large message: the ring over every rank, or over the node leaders with the node's own
    reduce and broadcast around it (two-level)."""
    per_node = min(net.ranks_per_node, ranks)
    nodes = -(-ranks // per_node)
    if comm_knobs.two_level(algorithm, ranks, per_node) and per_node > 1:
        # reduce to the leader and broadcast back: each a pipeline over the node's ranks
        inside = 2 * ((per_node - 1) * net.intra_latency_s + payload_bytes / net.intra_bandwidth_Bps)
        return inside + ring_allreduce_s(payload_bytes, nodes, net.bandwidth_Bps / net.rails, net.latency_s)
    if nodes == 1:  # all ranks in one node: the ring runs over the intra-node links
        return ring_allreduce_s(payload_bytes, ranks, net.intra_bandwidth_Bps, net.intra_latency_s)
    # between nodes from one GPU: through one NIC of the node's ``rails``
    return ring_allreduce_s(payload_bytes, ranks, net.bandwidth_Bps / net.rails, net.latency_s)


@dataclass(frozen=True)
class Message:
    """One summed part of the gradients, as the communicator sends it."""
    ready_s: float  # when its last gradient is complete, after the start of backward
    payload_bytes: float  # what the summing algorithm carries
    small_bytes: float  # the small allreduce before it: CSC's chunk norms (+ the fp16 peak), or the
    # fp16 wire's one-value scale; 0 when none
    local_work_s: float  # CSC's and the fp16 wire's own work on the communication path


def pool_parts(profile: ModelProfile, strategy: Strategy) -> list[tuple[list[TensorProfile], int, int]]:
    """The parts one step sends, in sending order, each as (its tensors, its length in elements,
    the length of its sparse section): one per tensor, or the pool's parts (``comm/pool.py``; with
    CSC each part's multi-dimensional tensors padded to whole chunks, then its one-dimensional ones,
    as ``comm/csc/`` lays it out)."""
    tensors = list(profile.tensors)
    if strategy.fusion == "per_tensor":  # (CSC per tensor exists only in the model: a tensor is a part)
        return [([t], padded if (padded := _sparse_section(t, strategy)) else t.elements, padded)
                for t in tensors]
    sizes = [t.elements for t in tensors]
    if strategy.density < 1:
        return [([tensors[i] for i in (*part.sparse, *part.dense)], part.elements, part.sparse_elements)
                for part in csc_parts(sizes, [t.one_dimensional for t in tensors], strategy.bucket_bytes,
                                      strategy.chunk_elements)]
    return [([tensors[i] for i in part.indices], part.elements, 0)
            for part in pack_parts(sizes, strategy.bucket_bytes)]


def _sparse_section(tensor: TensorProfile, strategy: Strategy) -> int:
    """A tensor's elements padded to whole chunks when CSC sparsifies it alone, else 0."""
    if strategy.density >= 1 or tensor.one_dimensional:
        return 0
    return -(-tensor.elements // strategy.chunk_elements) * strategy.chunk_elements


def _message(tensors: list[TensorProfile], elements: int, sparse_elements: int, profile: ModelProfile,
             strategy: Strategy) -> Message:
    fp16 = strategy.wire_bytes < 4
    cast = profile.wire_cast_s_per_element if fp16 else 0.0
    chunks = sparse_elements // strategy.chunk_elements
    # as comm/csc/ does: ceil(density x chunks) chunks of the sparse section, then the dense tail, in one
    # payload; the norms, any trust-ratio noise sketches (one squared norm and the buckets per
    # layer LARS adapts: the multi-dimensional ones, which optim.parameter_groups gives weight
    # decay; at world size 1 there are none, but nothing is sent then) and the fp16 peak in one
    # small allreduce before it
    sent = (elements - sparse_elements) + math.ceil(strategy.density * chunks) * strategy.chunk_elements
    sketches = (sum(1 + min(comm_knobs.TRUST_SKETCH_BUCKETS, t.elements) for t in tensors if not t.one_dimensional)
                if strategy.noise_sketch and strategy.density < 1 else 0)
    scale = 1 if fp16 and strategy.shared_scale else 0  # PyTorch's fp16 hook agrees on no scale
    small = 4.0 * (chunks + sketches + scale) if chunks else 4.0 * scale
    return Message(ready_s=max(t.ready_s for t in tensors), payload_bytes=sent * strategy.wire_bytes,
                   small_bytes=small,
                   local_work_s=sparse_elements * profile.sparsify_s_per_element + sent * cast)


def low_rank_split(tensors: list[TensorProfile], rank: int,
                   min_compression_rate: float = 2.0) -> tuple[int, int, int, int]:
    """PowerSGD's view of one DDP bucket (``powerSGD_hook``, step I): each gradient as an n x m
    matrix (n its first dimension, ``TensorProfile.matrix``) at rank r = min(n, m, ``rank``) is
    compressed where (n + m) r x ``min_compression_rate`` < n m (torch's ``_should_compress``), else
    sent whole (vectors never shrink). Returns (elements sent whole, elements of P: the sum of n r,
    of Q: the sum of m r, elements of the compressed matrices)."""
    whole = p_elements = q_elements = compressed = 0
    for tensor in tensors:
        n, m = tensor.matrix
        r = min(n, m, rank)
        if (n + m) * r * min_compression_rate < n * m:
            p_elements, q_elements, compressed = p_elements + n * r, q_elements + m * r, compressed + tensor.elements
        else:
            whole += tensor.elements
    return whole, p_elements, q_elements, compressed


def _low_rank_messages(tensors: list[TensorProfile], profile: ModelProfile, strategy: Strategy) -> list[Message]:
    """One DDP bucket under PowerSGD (``powerSGD_hook``), as its three collectives go, one after the
    other: the tensors sent whole (fp32; an empty one still a call), then P (n x r per compressed
    matrix), then Q (m x r). The local work (``ModelProfile.low_rank_s_per_element`` per compressed
    element: error feedback, P = M Q, orthogonalising P, Q = M^T P, M = P Q^T) is on the path of the
    bucket's messages; it is laid before P's allreduce, where the bucket's sends wait for it."""
    whole, p_elements, q_elements, compressed = low_rank_split(tensors, strategy.low_rank,
                                                               strategy.min_compression_rate)
    ready = max(t.ready_s for t in tensors)
    return [Message(ready, whole * strategy.wire_bytes, 0.0, 0.0),
            Message(ready, p_elements * strategy.wire_bytes, 0.0, compressed * profile.low_rank_s_per_element),
            Message(ready, q_elements * strategy.wire_bytes, 0.0, 0.0)]


def messages(profile: ModelProfile, strategy: Strategy) -> list[Message]:
    """The messages of one step, in sending order (``pool_parts``; three per bucket under PowerSGD)."""
    if strategy.low_rank:
        return [message for tensors, _, _ in pool_parts(profile, strategy)
                for message in _low_rank_messages(tensors, profile, strategy)]
    return [_message(tensors, elements, sparse, profile, strategy)
            for tensors, elements, sparse in pool_parts(profile, strategy)]


def message_s(message: Message, ranks: int, net: Network, strategy: Strategy) -> float:
    """Seconds one message keeps the communication path busy: its local work, its small allreduce
    if any (always recursive doubling or NCCL's tree, whatever the algorithm; the measured one-value
    cost for a bare fp16 scale, when known; none for a ``self_scaled`` message) and its payload."""
    return _lead_s(message, ranks, net, strategy) + _payload_s(message, ranks, net, strategy)


def self_scaled(message: Message, net: Network, strategy: Strategy) -> bool:
    """Whether the fp16 wire sends ``message`` with its scale inside (``compression.self_scaled_sum_``):
    a small payload of our own recursive doubling (not the backend's, not NCCL's) with nothing but
    the wire's scale before it. Then there is no scale to agree on: no small allreduce, and the
    payload is one fp16 value (the scale's exponent) longer."""
    return (strategy.wire_bytes < 4 and message.small_bytes == 4.0 and not net.nccl
            and strategy.summing(2, net).ours and message.payload_bytes <= strategy.small_message_bytes)


def _sent_bytes(message: Message, ranks: int, net: Network, strategy: Strategy) -> float:
    """Bytes rank 0 sends for ``message`` on ``net``: a self-scaled one by recursive doubling with
    its exponent's two bytes (counted, not timed), any other its small allreduce and payload."""
    if self_scaled(message, net, strategy):
        return sent_bytes(message.payload_bytes + 2.0, ranks, strategy, small=True)
    return (sent_bytes(message.payload_bytes, ranks, strategy, net=net)
            + sent_bytes(message.small_bytes, ranks, strategy, small=True))


def _local_s(message: Message, ranks: int, net: Network, strategy: Strategy) -> float:
    """A message's local work: for a self-scaled one (no agreement), each step that combines
    decodes, adds and re-encodes, the wire's work (peak, scale and cast, cast back) once more per
    step on top of the first encode."""
    if self_scaled(message, net, strategy):
        power = 1 << (ranks.bit_length() - 1)
        steps = power.bit_length() - 1 + (1 if ranks > power else 0)
        return message.local_work_s * (1 + steps)
    return message.local_work_s


def _lead_s(message: Message, ranks: int, net: Network, strategy: Strategy) -> float:
    """What comes before a message's payload, with the link idle: its local work and small allreduce."""
    if self_scaled(message, net, strategy):
        return _local_s(message, ranks, net, strategy)
    if message.small_bytes == 4.0 and net.tiny_allreduce_s is not None:
        small = net.tiny_allreduce_s
    elif net.nccl:
        small = allreduce_s(message.small_bytes, ranks, net, strategy.algorithm, strategy.small_message_bytes,
                            strategy.implementation)
    else:
        small = small_allreduce_s(message.small_bytes, ranks, net)
    return _local_s(message, ranks, net, strategy) + small


def _payload_s(message: Message, ranks: int, net: Network, strategy: Strategy) -> float:
    return allreduce_s(message.payload_bytes, ranks, net, strategy.algorithm, strategy.small_message_bytes,
                       strategy.implementation)


def sent_bytes(payload_bytes: float, ranks: int, strategy: Strategy, small: bool = False,
               net: Optional[Network] = None) -> float:
    """Bytes rank 0 sends for one allreduce (the rank whose counts runs report): the ring's (and, as
    communicators count them, any builtin's) 2(N-1)/N of the payload, or for a small message of our
    own (``small``: always, as CSC's norms and the fp16 scale) the payload once per recursive-
    doubling step, or once in all when rank 0 folds (N not a power of two). ``net``: where the
    backend sums (``knobs.summing``; None: the builtin alone)."""
    if ranks <= 1:
        return 0.0
    ours = not strategy.builtin if net is None else strategy.ours(ranks, net)
    if small or (ours and payload_bytes <= strategy.small_message_bytes):
        power = 1 << (ranks.bit_length() - 1)
        return payload_bytes * (1 if ranks > power else power.bit_length() - 1)
    return 2 * (ranks - 1) / ranks * payload_bytes


def uplink_bytes(payload_bytes: float, ranks: int, net: Network, strategy: Strategy) -> float:
    """Bytes one allreduce of ``payload_bytes`` puts on the busiest link per direction: 2(n-1)/n
    of it for a ring over n ranks, or over the node leaders (two-level); by recursive doubling (our
    algorithms' small messages), the message once per step that crosses it, times the node's ranks
    that cross together."""
    per_node = min(net.ranks_per_node, ranks)
    if ranks <= 1 or ranks <= per_node:  # one node: nothing crosses an uplink
        return 0.0
    chosen = strategy.summing(ranks, net)
    if chosen.ours and payload_bytes <= strategy.small_message_bytes:
        return payload_bytes * sum(_uplink_sharers(ranks, net.ranks_per_node))
    if chosen.how == "two-level" and per_node > 1:
        ranks = -(-ranks // per_node)
    return 2 * (ranks - 1) / ranks * payload_bytes


@dataclass(frozen=True)
class _Timeline:
    end_s: float  # when the last message ends, after the start of backward
    busy_s: float
    sent_bytes: float
    first_payload_s: float  # when the first message's payload starts crossing the link
    credit_bytes: float  # burst credit left at the end
    overlapped_s: float = 0.0  # communication time inside backward (before its end)
    overlapped_local_s: float = 0.0  # of it, the messages' local work


def _timeline(profile: ModelProfile, ranks: int, net: Network, strategy: Strategy, credit: float) -> _Timeline:
    """One step's messages, one at a time in order, each after its data is ready (``overlap``) or
    after backward; ``credit``: the link's burst credit when the first payload starts."""
    clock = 0.0 if strategy.overlap else profile.backward_s  # relative to the start of backward
    busy = sent = overlapped = overlapped_local = 0.0
    link_free = first_payload = None
    for message in messages(profile, strategy):
        start = max(clock, message.ready_s if strategy.overlap else profile.backward_s)
        lead, payload_s = _lead_s(message, ranks, net, strategy), _payload_s(message, ranks, net, strategy)
        cost = lead + payload_s
        if net.burst_bytes:  # the payload goes last: the link is idle until then
            payload_start = start + lead
            if link_free is not None:
                credit = min(net.burst_bytes, credit + (payload_start - link_free) * net.bandwidth_Bps)
            first_payload = payload_start if first_payload is None else first_payload
            used = min(credit, uplink_bytes(message.payload_bytes, ranks, net, strategy))
            credit -= used
            cost -= min(used / net.bandwidth_Bps, payload_s)
        clock = link_free = start + cost
        busy += cost
        overlapped += max(0.0, min(clock, profile.backward_s) - start)
        overlapped_local += max(0.0, min(start + _local_s(message, ranks, net, strategy), profile.backward_s) - start)
        sent += _sent_bytes(message, ranks, net, strategy)
    return _Timeline(clock, busy, sent, clock if first_payload is None else first_payload, credit, overlapped,
                     overlapped_local)


def compute_s(profile: ModelProfile, ranks: int, strategy: Strategy) -> float:
    """Forward, backward and the optimizer's step; its plain step where CSC sends sparsely under
    momentum correction (on more than one rank) and it was measured."""
    plain = (ranks > 1 and strategy.takes_optimizer and strategy.density < 1
             and profile.plain_optimizer_s is not None)
    return profile.forward_s + profile.backward_s + (profile.plain_optimizer_s if plain else profile.optimizer_s)


def stretched_backward(profile: ModelProfile, ranks: int, net: Network, strategy: Strategy) -> ModelProfile:
    """``profile`` with backward (and every gradient's readiness) stretched by the communication
    that overlaps it: backward' = backward + ``net.overlap_slowdown`` x (communication time before
    backward' ends, less its local work) + ``net.local_work_slowdown`` x (the local work before
    backward' ends). A fixed point, since a longer backward hides more communication:
    1. lay out the messages against the current backward (``_timeline``);
    2. backward' = backward + the two slowdowns x what each overlaps; readiness scaled alike;
    3. repeat until backward' moves by less than a nanosecond (slowdowns < 1 contract: a few rounds).
    Unchanged (the same object) without overlap or without slowdown."""
    local_slowdown = net.overlap_slowdown if net.local_work_slowdown is None else net.local_work_slowdown
    if not ((net.overlap_slowdown or local_slowdown) and strategy.overlap) or profile.backward_s <= 0:
        return profile
    base, stretched = profile.backward_s, profile
    for _ in range(50):
        timeline = _timeline(stretched, ranks, net, strategy, net.burst_bytes)
        backward = (base + net.overlap_slowdown * (timeline.overlapped_s - timeline.overlapped_local_s)
                    + local_slowdown * timeline.overlapped_local_s)
        if abs(backward - stretched.backward_s) < 1e-9:
            break
        factor = backward / base
        stretched = replace(profile, backward_s=backward,
                            tensors=tuple(replace(t, ready_s=t.ready_s * factor) for t in profile.tensors))
    return stretched


def predict_step(profile: ModelProfile, ranks: int, net: Network, strategy: Strategy) -> StepPrediction:
    """One step on ``ranks`` ranks: compute, then the messages' timeline (``_timeline``), with the
    network's ``link_efficiency`` and ``overlap_slowdown`` and the profile's ``step_overhead_s``
    (all three only where more than one rank trains)."""
    if ranks == 1:
        compute = compute_s(profile, ranks, strategy)
        return StepPrediction(compute, 0.0, 0.0, compute, 0.0)
    net = effective_network(net)
    profile = stretched_backward(profile, ranks, net, strategy)
    compute = compute_s(profile, ranks, strategy)
    credit = net.burst_bytes  # a full bucket at the first step; then what the step before left,
    timeline = _timeline(profile, ranks, net, strategy, credit)  # refilled until the first payload
    for _ in range(100 if net.burst_bytes else 0):  # until the steady state (a step's credit repeats)
        step = compute + max(0.0, timeline.end_s - profile.backward_s)
        idle = step - (timeline.end_s - timeline.first_payload_s)
        credit, before = min(net.burst_bytes, timeline.credit_bytes + idle * net.bandwidth_Bps), credit
        if abs(credit - before) < 1.0:
            break
        timeline = _timeline(profile, ranks, net, strategy, credit)
    exposed = max(0.0, timeline.end_s - profile.backward_s)
    return StepPrediction(compute, timeline.busy_s, exposed, compute + exposed + profile.step_overhead_s,
                          timeline.sent_bytes)


@dataclass(frozen=True)
class TimeToTrain:
    """A whole run's wall-clock time, by part (seconds)."""
    dense_s: float  # the dense warm-up epochs (CSC sends densely until its warm-up ends)
    steady_s: float  # the remaining epochs at the steady-state step
    evaluation_s: float
    startup_s: float

    @property
    def total_s(self) -> float:
        return self.dense_s + self.steady_s + self.evaluation_s + self.startup_s


def time_to_train(epochs: float, images_per_epoch: int, global_batch: int, step_s: float,
                  dense_epochs: float = 0.0, dense_step_s: Optional[float] = None,
                  evaluation_s_per_epoch: float = 0.0, startup_s: float = 0.0) -> TimeToTrain:
    """Time to train for ``epochs`` from the model's step predictions: a step-time prediction is the
    steady state, but a run also has (1) its dense warm-up epochs, where a sparse strategy steps at
    ``dense_step_s`` (its dense counterpart's step; None: ``step_s``), (2) evaluation after each
    epoch and (3) start-up (launch, data loading, the first steps' compilation and warm-up). Steps
    per epoch are ceil(images / global batch), as a loader that keeps the last partial batch runs."""
    if not 0 <= dense_epochs <= epochs:
        raise ValueError(f"dense_epochs={dense_epochs} must be in [0, epochs={epochs}]")
    steps = math.ceil(images_per_epoch / global_batch)
    dense = dense_epochs * steps * (step_s if dense_step_s is None else dense_step_s)
    return TimeToTrain(dense, (epochs - dense_epochs) * steps * step_s, epochs * evaluation_s_per_epoch, startup_s)


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
ASSUMED_BACKWARD_SHARE = 2 / 3  # assumption: backward takes twice the forward's time (the by-size stand-in)
# The local work of CSC and of the fp16 wire on a GPU is memory-bound: priced as the bytes it moves
# over the GPU's memory bandwidth. Assumed: a V100 (the paper's GPU by our unverified recollection)
# streams about 800 GB/s in practice (BabelStream, Deakin et al. 2018, of its 900 GB/s peak).
ASSUMED_GPU_MEMORY_BPS = 800e9
# Bytes moved per element of a sparsified section, counted from comm/csc/'s operations in one
# sparse step: unscale (read+write 8), LARS's rescaling under momentum correction (norms of w and g
# 8, g + wd w 12, times the ratio 8: 28), momentum u <- m u + g (12), v + u into the spare (12),
# chunk norms (4), peak (4), re-scale the part (8), zero the section (4), ~density x 20 for
# packing, clearing and writing back the chosen chunks, and ~density x 48 for the release cap on
# them (their residual rows 8, this step's rows 12, two norms 8, the split 20), and the trust ratio's
# noise sketch (g times the signs into a buffer 4 + 1 + 4, summed into buckets 4: 13): about 100 at
# density 0.1.
CSC_BYTES_PER_ELEMENT = 100
# Per element the fp16 wire sends: scale and cast (read 4, write 2), cast back and unscale (read 2,
# write 4).
FP16_WIRE_BYTES_PER_ELEMENT = 12
# Per element of a matrix PowerSGD compresses at rank 4 (``powerSGD_hook``): error feedback (add the
# error 12, keep a copy 8, the new error from the copy 12), P = M Q and Q = M^T P (read M twice: 8),
# M = P Q^T (write 4); the products' 2 x 4 multiply-adds per element and the orthogonalisation of the
# n x 4 P are far below a GPU's compute per byte moved.
LOW_RANK_BYTES_PER_ELEMENT = 44
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


def gpu_local_work(profile: ModelProfile, memory_Bps: float = ASSUMED_GPU_MEMORY_BPS) -> ModelProfile:
    """``profile`` with CSC's, the fp16 wire's and PowerSGD's local work priced for a GPU of ``memory_Bps``."""
    return replace(profile, sparsify_s_per_element=CSC_BYTES_PER_ELEMENT / memory_Bps,
                   wire_cast_s_per_element=FP16_WIRE_BYTES_PER_ELEMENT / memory_Bps,
                   low_rank_s_per_element=LOW_RANK_BYTES_PER_ELEMENT / memory_Bps)


def paper_network() -> Network:
    return Network(PAPER_LINK_GBPS * 1e9 / 8, ASSUMED_LATENCY_S, ASSUMED_GPUS_PER_NODE,
                   ASSUMED_INTRA_NODE_BPS, ASSUMED_LATENCY_S, nccl=True)


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
