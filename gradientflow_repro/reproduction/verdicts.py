"""The reproduction's goals, each decided here as a value (``Verdict``) from the measured numbers;
the report's renderer (``render/reproduction.py``) only words them.

Every goal is held to a bound named here (``TIME_GOAL``, ``FINAL_GAP_GOAL``, ...): a verdict says
what was measured, the bound, whether it is met, and the figures its sentence gives beside them
(``detail``). Verdicts go into the report's data (``Verdict.data``) as they are.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

CSC = "gradientflow"  # our full stack, the configuration every goal is about
DDP = "ddp"  # plain DDP, the goals' dense reference
TIME_GOAL = 0.6  # gradientflow's time to target over ddp's, median over the seeds, at most this
FINAL_GAP_GOAL = 0.3  # gradientflow's top-1 at the end at most this far below the same seed's dense run's
# (or the dense seeds' own spread, if larger)
FINAL_TOP1_POINTS = 0.5  # "at equal final top-1" against a peer: at most this many points below
LARGE_FALL_POINTS = 5.0  # a fall after the warm-up larger than this makes a recipe unstable
MODEL_ERROR_GOAL = 0.15  # the scaling model's step time within this fraction of the measured one
HIDDEN_GOAL = 1.2  # gradientflow's step over the compute-only step, at most this
SPARSE_EPOCHS_GOAL = 0.1  # at density 0.1, gradientflow's epochs to target at most this much above dense
SPARSE_GOAL_DENSITY = 0.1  # the density the epochs goal is stated at


@dataclass(frozen=True)
class Verdict:
    """One goal, decided: ``measured`` against ``target`` (the bound), ``met`` or not, and the
    figures its sentence words beside them (``detail``)."""

    goal: str
    measured: Any
    target: Any
    met: bool
    detail: Mapping[str, Any] = field(default_factory=dict)

    def data(self) -> dict[str, Any]:
        """The verdict as plain data (JSON), as the report's document holds it."""
        return asdict(self)


Seed = Union[int, str]


def time_to_target(ratios: Optional[Mapping[str, float]], reference: str) -> Optional[Verdict]:
    """``gradientflow``'s time to target at most ``TIME_GOAL`` times ``reference``'s (medians over the
    seeds; ``ratios``: its ``decomposition``). None where it or the reference never reached the target."""
    if not ratios or reference == CSC:
        return None
    return Verdict("time_to_target", ratios["time"], TIME_GOAL, ratios["time"] <= TIME_GOAL,
                   {"reference": reference, **{key: ratios[key] for key in ("step", "epochs", "overhead")}})


def final_gap(ends: Mapping[Seed, Optional[float]], reference_ends: Mapping[Seed, Optional[float]],
              reference: str) -> Verdict:
    """The paper's criterion as a goal: in every seed, ``gradientflow``'s top-1 at the end (``ends``, by
    seed) at most ``FINAL_GAP_GOAL`` points below the same seed's ``reference`` run, or below by the
    reference seeds' own spread if that is larger."""
    values = list(reference_ends.values())
    spread = max(values) - min(values) if values and None not in values else 0.0
    allowed = max(FINAL_GAP_GOAL, spread)
    gaps = [[seed, end - reference_ends[seed]] for seed, end in ends.items() if seed in reference_ends]
    met = bool(gaps) and all(gap >= -allowed for _, gap in gaps)
    return Verdict("final_gap", gaps, allowed, met,
                   {"reference": reference, "goal_points": FINAL_GAP_GOAL, "reference_spread": spread})


def peers_ahead(time: Mapping[str, Optional[float]], final: Mapping[str, Optional[float]],
                peers: Sequence[str]) -> Verdict:
    """``gradientflow`` ahead of every peer on time to target (``time``: medians over the seeds) at
    equal top-1 at the end (``final``: at most ``FINAL_TOP1_POINTS`` below; unknown: not equal)."""
    parts, met = [], True
    for peer in peers:
        ahead = time[CSC] is not None and (time[peer] is None or time[CSC] < time[peer])
        mine, theirs = final.get(CSC), final.get(peer)
        gap = None if mine is None or theirs is None else mine - theirs
        parts.append({"peer": peer, "time": time[CSC], "peer_time": time[peer], "ahead": ahead, "top1_gap": gap})
        met = met and ahead and gap is not None and gap >= -FINAL_TOP1_POINTS
    return Verdict("ahead_of_peers", parts, FINAL_TOP1_POINTS, met, {"peers": list(peers)})


def below_ddp(median: Optional[Mapping[str, float]],
              seeds: Sequence[tuple[Seed, Optional[Mapping[str, float]], bool]]) -> Verdict:
    """``gradientflow``'s time to target below ``ddp``'s in the median (``median``: its
    ``decomposition``) and in every seed (``seeds``: seed, that seed's decomposition or None, and
    whether ``gradientflow`` reached the target in it)."""
    met = median is not None and median["time"] < 1
    each = []
    for seed, parts, reached in seeds:
        each.append({"seed": seed, "ratios": None if parts is None else dict(parts), "reached": reached})
        met = met and (parts["time"] < 1 if parts is not None else reached)
    met = met and bool(seeds)
    return Verdict("below_ddp", None if median is None else median["time"], 1.0, met,
                   {"median": None if median is None else dict(median), "seeds": each})


def dense_agreement(by_seed: Mapping[Seed, Sequence[Optional[float]]], every: float) -> Verdict:
    """Dense strategies (the same SGD) reach the target at the same epoch, within one evaluation
    (``every`` epochs), in every seed (``by_seed``: each dense strategy's epochs to target)."""
    spreads = [[seed, (max(epochs) - min(epochs)) if None not in epochs else None]
               for seed, epochs in sorted(by_seed.items(), key=lambda item: str(item[0]))]
    met = all(spread is not None and spread <= every for _, spread in spreads)
    return Verdict("dense_agreement", spreads, every, met)


def sparse_epochs(epochs: Sequence[Optional[float]], dense: Optional[float]) -> Verdict:
    """At density 0.1, ``gradientflow``'s epochs to target (median over the seeds that reached it) at
    most ``SPARSE_EPOCHS_GOAL`` above dense training's (``dense``); NOT met where it reached the target
    in at most half of its seeds."""
    reached = [e for e in epochs if e is not None]
    if 2 * len(reached) <= len(epochs) or dense is None:
        return Verdict("sparse_epochs", None, SPARSE_EPOCHS_GOAL, False,
                       {"reached": len(reached), "seeds": len(epochs)})
    extra = statistics.median(reached) / dense - 1
    return Verdict("sparse_epochs", extra, SPARSE_EPOCHS_GOAL, extra <= SPARSE_EPOCHS_GOAL,
                   {"reached": len(reached), "seeds": len(epochs)})


def model_within(errors: Sequence[float]) -> Optional[Verdict]:
    """The scaling model's predictions of the ladder's step times, each within ``MODEL_ERROR_GOAL``
    (``errors``: |predicted / measured - 1|). None without predictions."""
    if not errors:
        return None
    within = sum(error <= MODEL_ERROR_GOAL for error in errors)
    return Verdict("model_within", max(errors), MODEL_ERROR_GOAL, within == len(errors),
                   {"within": within, "predictions": len(errors)})


def hidden_communication(world: int, ratio: float) -> Verdict:
    """``gradientflow``'s step at most ``HIDDEN_GOAL`` times the compute-only step at ``world``."""
    return Verdict("hidden_communication", ratio, HIDDEN_GOAL, ratio <= HIDDEN_GOAL, {"world": world})

