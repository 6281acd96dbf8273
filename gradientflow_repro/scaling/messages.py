"""What one step sends and what each message costs: the pricing of a strategy's messages.

``messages`` lays out one step's messages in sending order (one per tensor, or the pool's parts
as ``comm/pool.py`` packs them; CSC's chunks; PowerSGD's three collectives per bucket), each with
the small allreduce before it and its local work; ``message_s`` prices one on a network, and
``sent_bytes`` / ``uplink_bytes`` count what it puts on the wire (the rules:
``scaling/perfmodel.py``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from gradientflow_repro.comm import knobs as comm_knobs
from gradientflow_repro.comm.pool import csc_parts, pack_parts
from gradientflow_repro.scaling.network import Network, allreduce_s, small_allreduce_s, uplink_sharers
from gradientflow_repro.scaling.strategy import Strategy
from gradientflow_repro.scaling.workload import ModelProfile, TensorProfile


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
        return payload_bytes * sum(uplink_sharers(ranks, net.ranks_per_node))
    if chosen.how == "two-level" and per_node > 1:
        ranks = -(-ranks // per_node)
    return 2 * (ranks - 1) / ranks * payload_bytes
