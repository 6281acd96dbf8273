"""Coarse-grained sparse communication (CSC): GradientFlow's sparse allreduce over the memory pool.

Element-wise top-k sparsification (Deep Gradient Compression, DGC) needs an allgather of indices
and values whose volume grows with the number of workers. GradientFlow sparsifies coarsely instead:
it sends whole chunks of the pool, the same chunks on every rank, so what is sent is summed densely
by any allreduce and no index travels. Each step, for each pool part (lazy allreduce's fusion
buffer, ``comm/lazy.py``; its layout ``pool.csc_parts``):

1. the part's multi-dimensional (weight) gradients are cut into chunks of ``chunk_size`` elements;
   its one-dimensional tensors (BatchNorm, biases: small and sensitive) follow as the part's dense
   tail and are always sent;
2. each rank adds its new gradient to its residual (error feedback) and computes the L1 norm of
   every chunk (``selection.chunk_l1_norms``);
3. the vector of chunk norms (one float per chunk: tiny) is summed over ranks, so every rank ranks
   the chunks by the same global importance and picks the same top ``density`` fraction, ties
   broken by chunk index so the choice is deterministic (``selection.agree_on_norms``,
   ``selection.select_chunks``);
4. the chosen chunks and the dense tail are packed contiguously and summed densely by the chosen
   algorithm (ring, fp16 wire ...): no indices travel, and the volume is ``density`` times the dense
   one (``state.BucketState.sparsify``);
5. the chunks not chosen stay in the per-rank residual and are added in the next step, so no
   gradient is ever dropped, only delayed.

Two collectives per pool part, no more: each collective is a latency (log2(N) of them for a small
one, 2(N-1) for a ring), and at hundreds of GPUs latency, not volume, is what CSC leaves. So the
norms' small message (recursive doubling or NCCL's tree) also carries the fp16 wire's scale (each
rank's peak magnitude, summed: a bound on every partial sum) and the trust ratio's noise sketches,
and the dense tail travels in the chosen chunks' payload, not as a part of its own.

Around the algorithm, one module each:
- ``selection.py``: chunk norms, the ranks' agreement, the top-density choice, the release cap
  (ours: a chosen chunk sends at most ``release_cap`` times the norm of what this step added to it,
  the rest stays in its residual, so a chunk that waited long does not land as one burst), and the
  density schedule (dense for ``warmup_epochs``, then optionally DGC's exponential ramp over
  ``density_ramp_epochs``; with ``density`` 1 nothing is sparsified and this is exactly lazy
  allreduce);
- ``momentum.py``: DGC's momentum correction and momentum factor masking, and LARS's pre-momentum
  step moved with the momentum (``LocalStep``);
- ``trust.py``: LARS's trust-ratio rescaling and its correction for the noise of each rank's own
  gradient (``TrustNoise``, ours);
- ``state.py``: the per-bucket state (``BucketState``: residual, velocity, noise estimate), staged
  and committed so a step skipped on every rank changes nothing, saved per rank, averaged over the
  old ranks on a resume on another number of ranks;
- ``communicator.py``: ``CSCCommunicator``, all of the above as the trainer's communicator, one
  ``BucketState`` per pool part. The DDP communication hook ``csc_hook`` (``comm/hooks.py``) keeps
  one per DDP bucket; it cannot wait for the host to learn whether a step will be applied, so it
  commits on the device: after an overflow the residual is kept and the bucket arrives as inf
  everywhere.

Tuning advice (``comm.*`` keys; the presets ``configs/comm/csc.yaml`` and ``gradientflow.yaml`` set
the values below):
1. ``density`` (0.1): the fraction of chunks sent per step, so about that fraction of the dense
   volume. Lower saves bandwidth but delays each chunk about 1/density steps: on the digits recipe
   0.1 reaches the dense target one to two epochs later, 0.01 in some seeds only
   (docs/notes/2026-12-01-digits-recipe-search.md). Check convergence before going lower.
2. ``chunk_size`` (32768 elements): the norms' message carries one float per chunk, so larger
   chunks keep it small next to the payload; smaller ones choose more finely. On the digits recipe
   1K to 32K made no difference to convergence. It fixes the state's layout, so a resume keeps it.
3. ``csc_warmup_epochs`` (null: as long as the learning rate's warm-up): sparsifying while the
   learning rate still climbs cost accuracy; start sparse once it has peaked
   (docs/notes/2026-12-02-csc-dense-warmup.md).
4. ``density_ramp_epochs`` (0): DGC's gradual fall from dense to ``density``. On the digits recipe
   it did not help; try it where the switch to sparse makes accuracy fall.
5. ``release_cap`` (3; 0: DGC's rule): lower spreads a long-waiting chunk over more steps (smoother,
   but the held-back updates drain slowly at very low density; docs/notes/2026-12-01-release-cap.md).
6. ``momentum_correction``, ``momentum_masking`` (true): DGC's correction keeps the momentum of the
   chunks held back; turned off only to measure what it costs or brings. ``masking_min_wait`` (0:
   DGC's rule) masks only the chunks that waited longer than it; every progress record says how
   much momentum masking erased and how often each layer's chunks were sent
   (``CSCCommunicator.sparsity_stats``).
7. ``trust_noise_correction`` (true; acts under LARS with more than one rank): keeps each rank's
   trust ratio at dense LARS's size.
8. ``rank_by`` (rescaled): under LARS the velocity is in trust-rescaled units, so its norm measures a
   layer's weights; ``raw`` divides each chunk's norm by its layer's trust ratio before ranking.
9. ``weight_decay_in`` (velocity): ``local`` keeps weight decay out of the sent velocity, in a
   momentum of its own on each rank, as DGC's reference optimizer does (SGD only: under LARS each
   rank's trust ratio would rescale it differently, and it is refused on several ranks).

Example, the paper's full stack (``configs/comm/gradientflow.yaml``)::

    strategy: gradientflow
    algorithm: auto
    wire: fp16
    fusion: lazy
    overlap: true
    sparsity: csc
    bucket_mb: 32
    chunk_size: 32768
    density: 0.1
    csc_warmup_epochs: null
    momentum_correction: true
    momentum_masking: true
    release_cap: 3
    trust_noise_correction: true

and from the command line ``python -m gradientflow_repro.train comm=gradientflow comm.density=0.05``;
in code, ``comm.factory.build_communicator({"strategy": "gradientflow", "density": 0.05}, device)``.

This module is CSC as the registry sees it (``registry.Sparsifier``): its keys (``CSCKeys``, with
their checks), its builder, how the scaling model prices it (``csc``: whole chunks, plus the noise
sketches under momentum correction and LARS) and the fusion it needs (the pool). It imports no torch:
the config check reads it; the algorithm's modules load when first used.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gradientflow_repro.checks import boolean, in_range, non_negative, one_of, positive, setting
from gradientflow_repro.comm.registry import Sparsifier

if TYPE_CHECKING:
    import torch

    from gradientflow_repro.comm.base import Communicator, SumFn
    from gradientflow_repro.comm.plan import Plan


@dataclass(frozen=True)
class CSCKeys:
    """CSC's own ``comm.*`` keys (the tuning advice above says what each does)."""

    chunk_size: int = setting(32768, positive)  # elements per chunk
    density: float = setting(0.1, in_range(0, 1, low_open=True))  # fraction of chunks sent
    density_ramp_epochs: int = setting(0, non_negative)  # epochs over which density falls
    momentum_correction: bool = setting(True, boolean)
    momentum_masking: bool = setting(True, boolean)
    # with momentum_masking, mask only the sent chunks that waited more than this many steps since
    # their last send; 0: every sent chunk (DGC's rule). Masking erases the momentum still due to a
    # chunk's last sends, which DGC meant for chunks sent every ~1,000 steps, not every ~1/density
    masking_min_wait: float = setting(0.0, non_negative)
    # under momentum correction and LARS: rank chunks by the norm of the trust-rescaled velocity
    # ("rescaled": what is sent) or of the same divided by its layer's trust ratio ("raw": the gradients
    # that built it up; what is sent is unchanged)
    rank_by: str = setting("rescaled", one_of("rescaled", "raw"))
    # under momentum correction: weight decay rides in the sent velocity ("velocity") or keeps a
    # velocity of its own on each rank, applied every step and never sent ("local": DGC's reference
    # optimizer, dgc/optim/sgd.py; refused under LARS on several ranks: each rank's own trust ratio
    # would rescale it differently and the weights would drift apart)
    weight_decay_in: str = setting("velocity", one_of("velocity", "local"))
    # a chosen chunk sends at most this many times the norm of what the step added to it (its
    # velocity under momentum correction), the rest staying in the residual; 0: no cap (DGC's rule)
    release_cap: float = setting(0.0, in_range(0, math.inf, high_open=True))
    # under momentum correction and LARS: each rank's trust ratio corrected for the noise of its
    # own gradient, estimated from sketches that ride with the chunk norms (trust.py, TrustNoise)
    trust_noise_correction: bool = setting(True, boolean)


def build(plan: Plan, device: torch.device, sum_fn: SumFn) -> Communicator:
    """CSC over the lazy pool, dense for the plan's warm-up (the learning rate's unless
    ``comm.csc_warmup_epochs`` is set)."""
    from gradientflow_repro.comm.csc.communicator import CSCCommunicator

    keys: CSCKeys = plan.keys
    return CSCCommunicator(device, sum_fn, plan.bucket_bytes, plan.overlap, chunk_size=keys.chunk_size,
                           density=keys.density, warmup_epochs=plan.warmup_epochs,
                           momentum_correction=keys.momentum_correction, momentum_masking=keys.momentum_masking,
                           density_ramp_epochs=keys.density_ramp_epochs, release_cap=keys.release_cap,
                           trust_noise_correction=keys.trust_noise_correction,
                           masking_min_wait=keys.masking_min_wait, rank_by=keys.rank_by,
                           weight_decay_in=keys.weight_decay_in)


def _schedule(keys: CSCKeys) -> str:
    ramp = f", falling to it over {keys.density_ramp_epochs} epoch(s)" if keys.density_ramp_epochs else ""
    return f"density {keys.density:g}{ramp}"


SPARSIFIER = Sparsifier(
    "csc", keys=CSCKeys, builder=build, pricing="csc", fusion="lazy",
    # below density 1 some steps send part of the gradients; at 1 it is lazy allreduce exactly
    sends_sparse=lambda keys: keys.density < 1, describe=_schedule)

# The algorithm's names, loaded on first use (this module stays torch-free)
_EXPORTS = {
    "communicator": ("CSCCommunicator", "check_settings"),
    "momentum": ("TAKEN", "LocalStep", "give_back", "merged_settings", "take_settings", "velocity_from_optimizer"),
    "selection": ("Agreed", "agree_on_norms", "chunk_l1_norms", "density_at", "hold_back", "select_chunks"),
    "state": ("SAME_ON_EVERY_RANK", "BucketState", "Sent", "rank_rules"),
    "trust": ("NOISE_KEEP", "SIGN_SHIFTS", "SKETCH_SEED", "TrustNoise", "adapts", "lars_rescale_", "sketch_into",
              "sketch_signs"),
}
_WHERE = {name: module for module, exported in _EXPORTS.items() for name in exported}
__all__ = ["CSCKeys", "SPARSIFIER", "build", *_WHERE]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
