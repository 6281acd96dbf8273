"""The network of the scaling model and what one allreduce costs on it.

A ``Network`` is a cluster's links: the rate and latency between nodes (per node uplink), inside a
node, and the terms fitted on published results (``link_efficiency``, ``overlap_slowdown``; see
``scaling/calibration.py``). The costs of one allreduce by who sums it (``knobs.summing``): our
ring (flat or two-level) and recursive doubling for small messages, NCCL's allreduce as its tuning
model prices it, or the backend's measured cost by size (the rules: ``scaling/perfmodel.py``)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Optional

from gradientflow_repro.comm import knobs as comm_knobs


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
    for crossing in uplink_sharers(ranks, net.ranks_per_node):
        if crossing:
            total += net.latency_s + crossing * payload_bytes / net.bandwidth_Bps
        else:
            total += net.intra_latency_s + payload_bytes / net.intra_bandwidth_Bps
    return total


@lru_cache(maxsize=1024)
def uplink_sharers(ranks: int, ranks_per_node: int) -> tuple[int, ...]:
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
