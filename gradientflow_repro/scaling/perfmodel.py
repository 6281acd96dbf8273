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

Strategies are resolved plans (``comm/plan.py``) as the model sees them (``Strategy.from_plan``; a
label of ``variants.py`` by ``strategy_of(label)``; the ladder of `make reproduce` is its lineup's,
not retyped), the sparsifier priced by its rule (``scaling/pricing.py``):
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

Where each part lives (every name re-exported here): ``scaling/workload.py`` (``TensorProfile``,
``ModelProfile``), ``scaling/network.py`` (``Network`` and one allreduce's cost),
``scaling/strategy.py`` (``Strategy``, ``Strategy.from_plan``, ``strategy_of``: the only reader of
communication plans), ``scaling/pricing.py`` (the sparsifiers' pricing rules),
``scaling/messages.py`` (one step's messages and their prices),
``scaling/paper.py`` (the paper's setting); the step itself (``predict_step``) is here.

The analytic model only: no torch, nothing measured here (the measurements that feed it, a model's
backward profile and the local work per element, are in ``gradientflow_repro/scaling/profile.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

# The model's parts, one concept a module; every name is re-exported here, where the rest of the
# project reads them (``from gradientflow_repro.scaling import perfmodel as pm``)
from gradientflow_repro.scaling.messages import (  # noqa: F401
    Message,
    _lead_s,
    _local_s,
    _message,
    _payload_s,
    _sent_bytes,
    low_rank_split,
    message_s,
    messages,
    pool_parts,
    self_scaled,
    sent_bytes,
    uplink_bytes,
)
from gradientflow_repro.scaling.network import (  # noqa: F401
    Network,
    allreduce_s,
    effective_network,
    measured_cost_s,
    nccl_allreduce_s,
    recursive_doubling_pairs,
    ring_allreduce_s,
    small_allreduce_s,
    switch_over_bytes,
)
from gradientflow_repro.scaling.paper import (  # noqa: F401
    ALEXNET_LAYERS,
    ASSUMED_BACKWARD_SHARE,
    ASSUMED_GPU_MEMORY_BPS,
    ASSUMED_GPUS_PER_NODE,
    ASSUMED_INTRA_NODE_BPS,
    ASSUMED_LATENCY_S,
    CSC_BYTES_PER_ELEMENT,
    FP16_WIRE_BYTES_PER_ELEMENT,
    IMAGENET_TRAIN,
    LOW_RANK_BYTES_PER_ELEMENT,
    PAPER_BASELINE_GPUS,
    PAPER_BASELINE_SPEEDUP,
    PAPER_EPOCHS,
    PAPER_GPUS,
    PAPER_LINK_GBPS,
    PAPER_MINUTES,
    PAPER_PER_GPU_BATCH,
    PAPER_SINGLE_GPU_IMAGES_S,
    PAPER_SPEEDUP,
    gpu_local_work,
    paper_dense_ratio,
    paper_network,
    paper_profile,
)
from gradientflow_repro.scaling.strategy import Strategy, ladder, strategy_of  # noqa: F401
from gradientflow_repro.scaling.workload import ModelProfile, TensorProfile, uniform_profile  # noqa: F401


def __getattr__(name: str) -> tuple[Strategy, ...]:
    """``LADDER``: the ablation ladder of `make reproduce` as the model sees it (``strategy.ladder``),
    read when asked for."""
    if name == "LADDER":
        return ladder()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class StepPrediction:
    compute_s: float  # forward + backward + optimizer
    comm_s: float  # time the network is busy
    exposed_comm_s: float  # communication not hidden behind backward
    step_s: float
    bytes_per_rank: float  # bytes each rank sends per step



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
